"""tf_dlt.Client: the Python client of a cluster of shard servers.

The data plane (pull, push) goes through the C++ client in the native
extension, the one implementation of the wire protocol; the control plane
(tables, save, load, stats) is gRPC to each shard's admin port, which every
shard advertises in its Hello reply, so users only ever list data addresses.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from google.protobuf import json_format

from tf_dlt import _native, cluster, errors, grpc_util, initializers, optimizers, tls
from tf_dlt.checkpoint import manifest
from tf_dlt.memory_policy import MemoryPolicy
from tf_dlt.progress import Progress
from tf_dlt.table_config import TableConfig
from tf_dlt.tls import TlsConfig

# What an inference pull reads for an id without a row.
log = logging.getLogger("tf_dlt.client")

_PULL_MODES = {name: _native.PULL_MODES[name] for name in ("init", "zeros")}


# Counters of a table's memory policy, as list_tables sums them.
_POLICY_COUNTERS = {"admitted": 0, "refused": 0, "expired": 0, "evicted": 0, "shrunk": 0}


def _as_ids(ids: npt.ArrayLike) -> npt.NDArray[np.int64]:
    a = np.asarray(ids)
    if a.dtype == np.int64:
        return np.ascontiguousarray(a)
    if a.size == 0 and a.dtype == np.float64:  # np.asarray([]) is float64
        return a.astype(np.int64)
    if a.dtype.kind in "iu" and np.can_cast(a.dtype, np.int64, "safe"):
        return a.astype(np.int64)
    raise errors.InvalidArgumentError(
        f"ids must be int64 (or an integer type that converts safely), got {a.dtype}"
    )


# Seconds between a control plane's questions to the shards about their
# layout (live re-sharding, docs/replication.md).
_LAYOUT_ASK_S = 5.0
# Times a control-plane write is sent, each to the layout learned after the
# last refused it (re-shards one after another).
_LAYOUT_RETRIES = 3
# How often an admin call whose shard's copies do not greet asks them again.
_REGREET_PAUSE_S = 0.2
# How often an admin call waiting on a shard with standbys looks for another
# copy serving (Client._leave_silent).
_SILENT_CHECK_S = 1.0
# frame_bytes a client takes (wire::kMinMaxFrameBytes; a uint32).
_MIN_FRAME_BYTES, _MAX_FRAME_BYTES = 4096, 2**32 - 1
# How many times an admin call that ends UNAVAILABLE is sent to the copy
# serving after it (a standby that took over, and the one after it).
_MAX_MOVES = 3
# A control-plane channel's reconnect backoff, first and longest (ms).
_RECONNECT_MS = (100, 1000)
# The other reason a control plane closes a connection at once.
_AT_CAP = (
    "; or the shard holds --max-admin-connections control-plane connections already "
    "(connections from hosts that should not reach its admin port?)"
)
# How many times a save is made, under a new save id each, while its shards
# fail over as it runs (errors.FailedOverError): a failure, and another in a
# row (the copy that took over failing in turn).
SAVE_TRIES = 3
# Admin calls that write what a shard holds, or save it: sent with the
# lineage of the copy met (grpc_util.LINEAGE_METADATA_KEY), refused by a
# process of another. A load is not: it replaces what a shard holds (the way
# back after a restart), greeting every shard afresh first.
_WRITES = frozenset({"CreateTable", "DropTable", "Shrink", "Save"})

_T = TypeVar("_T")


def saved_despite_failovers(save: Callable[[], _T], path: str) -> _T:
    """`save()` (a save of `path` under a new save id each call), made
    again where a shard failed over as it ran (`errors.FailedOverError`):
    `SAVE_TRIES` tries in all."""
    for _ in range(SAVE_TRIES - 1):
        try:
            return save()
        except errors.FailedOverError as e:
            log.warning("%s; saving %s again, under a new save id", e.message, path)
    return save()


@dataclasses.dataclass
class _AdminStub:
    """One shard's control-plane stub: its channel and stub, the copy it
    asks (data-plane address), the epoch that copy greeted with (0:
    unknown), and the copy the data plane used when it was made (its
    address and the admin port it told: a process restarted at the same
    address tells another)."""

    channel: grpc.Channel
    stub: Any
    at: str
    epoch: int
    data_at: str
    data_admin: int


class _Greeted(NamedTuple):
    """A round of greetings of a shard's addresses (Client._greet_shard):
    the copy of the lineage asked for at the newest epoch (its address and
    Hello info; None where none greeted), what each other address said, how
    many addresses there were and how many greeted with another lineage,
    and the last error met."""

    newest: tuple[str, dict[str, Any]] | None
    said: list[str]
    addresses: int
    others: int
    last: errors.DltError


def _layout_moved(result: object) -> bool:
    """Whether a control call's `result` is a refusal by a shard serving a
    newer layout than the call's (grpc_util.LAYOUT_MOVED)."""
    return isinstance(result, errors.AbortedError) and grpc_util.LAYOUT_MOVED in result.message


def _not_found(result: object) -> bool:
    return isinstance(result, errors.NotFoundError)


def _lineage(lineage: int) -> tuple[tuple[str, str], ...]:
    """Call metadata naming `lineage` (none for 0: unknown)."""
    return ((grpc_util.LINEAGE_METADATA_KEY, f"{lineage:016x}"),) if lineage else ()


def address_list(pservers: Sequence[str] | str) -> list[str]:
    """Shard addresses as a list, from a list or a comma-separated string,
    each stripped of surrounding spaces; InvalidArgumentError names one that
    is not host:port (or host:port|host:port, a shard's standbys after its
    primary), which no call could reach."""
    if isinstance(pservers, str):
        entries = [p.strip() for p in pservers.split(",") if p.strip()]
    else:
        entries = [str(p).strip() for p in pservers]
    for entry in entries:
        if not all(cluster.is_address(part) for part in entry.split("|")):
            raise errors.InvalidArgumentError(
                f"shard address {entry!r} is not host:port with a port 1 to 65535 (a shard's "
                "standbys after its primary: host:port|host:port)"
            )
    return entries


# What an UNAVAILABLE error says where a shard's data plane greeted the
# client and its control plane did not (TLS on one side only).
_CONTROL_PLANE_UNREACHED = "The shard's data plane answered but its control plane did not"


def _looks_like_tls(error: grpc.RpcError) -> bool:
    """Whether an UNAVAILABLE control-plane call may have met TLS on one side
    only: gRPC then says the socket closed or the handshake failed. A shard
    that died or is stopping says so otherwise (the stream removed, calls
    cancelled, the connection refused): no TLS hint for those."""
    details = str(error.details() or "")
    lowered = details.lower()
    if any(gone in details for gone in ("Stream removed", "Cancelling", "Connection refused")):
        return False
    return "Socket closed" in details or any(
        sign in lowered for sign in ("handshake", "ssl", "certificate", "tls", "verification")
    )


class Client:
    """Client of the shard servers of one cluster.

    Args:
        pservers: data-plane addresses ``host:port``, in shard-index order;
            a shard's may list its hot standbys after its primary,
            ``host:port|host:port`` (docs/replication.md).
        auth_token: token the shards require (empty: none).
        connect_timeout: seconds to connect and say Hello to a shard.
        request_timeout: deadline in seconds of one pull, push or admin call
            (save and load get `persist_timeout`).
        persist_timeout: deadline in seconds of save and load.
        frame_bytes: target bytes per data-plane frame; bigger batches are
            split and pipelined.
        tls: TLS of the control plane (`tf_dlt.tls.TlsConfig`); default:
            the TF_DLT_TLS_* environment variables, else plaintext.
    """

    def __init__(
        self,
        pservers: Sequence[str] | str,
        *,
        auth_token: str | bytes | None = "",
        connect_timeout: float = 5.0,
        request_timeout: float = 30.0,
        persist_timeout: float = 3600.0,
        frame_bytes: int = 8 << 20,
        tls: TlsConfig | None = None,
    ) -> None:
        self.pservers = address_list(pservers)
        if not self.pservers:
            raise errors.InvalidArgumentError("Client needs at least one shard address")
        # Surrounding whitespace is never part of a token (the shards drop
        # it from their token file): `open(path).read()` works as given,
        # and so does `open(path, "rb").read()`.
        if isinstance(auth_token, bytes):
            try:
                auth_token = auth_token.decode("ascii")
            except UnicodeDecodeError:
                raise errors.InvalidArgumentError(
                    "the auth_token given holds bytes that are not ASCII"
                ) from None
        if auth_token is not None and not isinstance(auth_token, str):
            raise errors.InvalidArgumentError(
                f"auth_token must be a str, got {type(auth_token).__name__}"
            )
        auth_token = (auth_token or "").strip()
        if auth_token:
            check_token(auth_token, "the auth_token given")
        else:
            auth_token = token_from_env()
        self._token = auth_token
        try:
            self._tls = tls if tls is not None else TlsConfig.from_env()
            if self._tls is not None:  # its files read now, not at the first call
                self._tls.channel_credentials()
        except ValueError as e:
            raise errors.InvalidArgumentError(str(e)) from None
        self._request_timeout = request_timeout
        self._persist_timeout = persist_timeout
        timeout_ms("persist_timeout", persist_timeout)  # checked alike
        if (
            not isinstance(frame_bytes, int | np.integer)
            or isinstance(frame_bytes, bool)
            or not _MIN_FRAME_BYTES <= frame_bytes <= _MAX_FRAME_BYTES
        ):
            raise errors.InvalidArgumentError(
                f"frame_bytes must be an int from {_MIN_FRAME_BYTES} to {_MAX_FRAME_BYTES}, got "
                f"{frame_bytes!r}"
            )
        self._data = _native.Client(
            self.pservers,
            auth_token=auth_token,
            connect_timeout_ms=timeout_ms("connect_timeout", connect_timeout),
            request_timeout_ms=timeout_ms("request_timeout", request_timeout),
            frame_bytes=int(frame_bytes),
        )
        self._connect_timeout = connect_timeout
        self._frame_bytes = frame_bytes
        self._dims: dict[str, int] = {}
        self._admins: list[_AdminStub] = []  # each shard's, once made (_admin)
        # Guards _admins: threads sharing a new client each made every stub,
        # and the later ones closed the channels the first were calling on.
        self._stubs_lock = threading.RLock()
        self._expected_lineages: list[int] = []  # expect_lineages
        self._expected_layout = 0
        self._prepared_at: list[str] = []  # _prepare_load
        self._stubs_layout = 1  # the layout epoch the stubs were made for
        self._layout_asked = -_LAYOUT_ASK_S  # when the shards were last asked theirs

    @property
    def num_shards(self) -> int:
        return len(self.pservers)

    def reshard(
        self, pservers: Sequence[str] | str, *, timeout: float = 600.0, pace: float | None = None
    ) -> dict[str, Any]:
        """Moves every table to the shards at `pservers` (in shard order)
        while training goes on (docs/replication.md): bucket ranges stream
        from their owners, then writes pause for one short switch. A process
        new to the cluster runs `tf-dlt server --join`; one not listed leaves
        (it keeps running, owning nothing). Trainers' clients follow the new
        layout by themselves. A failure before the switch leaves the old
        layout serving. `pace` in (0, 1]: the fraction of the time each
        range stream's copy may keep a core busy (below 1 trainers keep more
        of the cores while the ranges stream longer); None (the default):
        1/16 of each shard host's cores, at most 1. `timeout`: seconds the
        re-shard may take up to its switch (streaming included); past them
        it aborts (DeadlineExceededError), the old layout serving. Returns
        the new layout epoch, the seconds the ranges streamed and the
        seconds writes were held; where the shards serve `pservers`
        already, the epoch they serve and "unchanged": True."""
        from tf_dlt import reshard as resharding
        from tf_dlt.proto import dlt_pb2_grpc

        to = address_list(pservers)
        channels: list[grpc.Channel] = []

        def stub_for(address: str, admin_port: int) -> Any:
            channels.append(self._channel(grpc_util.admin_address(address, admin_port)))
            return dlt_pb2_grpc.ShardAdminStub(channels[-1])

        try:
            try:
                current = self._layout_addresses()
            except errors.DltError:
                # Shards of two layouts: a re-shard left part way, which
                # this one finishes or undoes first.
                current = list(self.pservers)
            done = resharding.reshard(
                current, to, stub_for=stub_for, auth_token=self._token,
                timeout_s=timeout, hold_timeout_s=self._request_timeout, pace=pace,
            )  # fmt: skip
        finally:
            for channel in channels:
                channel.close()
        self._follow_layout(learn=True)
        return done

    def _layout_addresses(self) -> list[str]:
        """The data-plane addresses of the layout the shards serve now."""
        self._follow_layout(learn=True)
        return list(self.pservers)

    def _follow_layout(self, learn: bool = False) -> None:
        """After a re-shard: the control plane talks to the new layout's
        shards, once the data plane learned it from them (with `learn`: asks
        them now)."""
        if learn:
            self._layout_asked = time.monotonic()
            self._data.learn_layout()
        if int(self._data.layout_epoch) == self._stubs_layout:
            return
        infos = self._data.shard_infos()
        epoch = int(self._data.layout_epoch)
        self.close()
        self.pservers = [i["replicas"] for i in infos]
        self._stubs_layout = epoch

    def shard_infos(self) -> list[dict[str, Any]]:
        """What each shard said in its Hello: index, count, admin port."""
        return list(self._data.shard_infos())

    # Control plane ------------------------------------------------------------

    def _admin(self) -> list[_AdminStub]:
        with self._stubs_lock:
            return self._admin_locked()

    def _admin_locked(self) -> list[_AdminStub]:
        # Another client's re-shard shows within _LAYOUT_ASK_S (this one's,
        # and a data-plane call's meeting it, at once).
        self._follow_layout(learn=time.monotonic() - self._layout_asked > _LAYOUT_ASK_S)
        if not self._admins:
            for i, info in enumerate(self.shard_infos()):
                self._set_stub(
                    i, info["address"], info["admin_port"], info["address"], info["epoch"]
                )
            return self._admins
        # A shard whose data plane moved to another copy since its stub was
        # made (it saw a standby take over: the primary went silent, say; or
        # a process restarted at the same address, with another admin port)
        # is asked there: the copy the stub names may never answer again.
        with contextlib.suppress(errors.DltError):
            for i, info in enumerate(self._data.shard_infos()):
                made = self._admins[i] if i < len(self._admins) else None
                told = (info["address"], int(info["admin_port"]))
                if made is not None and told != (made.data_at, made.data_admin):
                    self._set_stub(
                        i, info["address"], info["admin_port"], info["address"], info["epoch"]
                    )
        return self._admins  # moved stubs replace their shard's in place

    def _set_stub(
        self,
        shard: int,
        at: str,
        admin_port: int,
        data_at: str | None = None,
        epoch: int = 0,
    ) -> Any:
        """`shard`'s stub from now on (the first, for the next shard, or in
        place of one whose channel it closes): to the copy at data-plane
        address `at`, its admin port `admin_port`, that greeted at `epoch`
        (0: unknown); the data plane using `data_at` (the copy `at` itself;
        None: what it used, as it may not have moved yet)."""
        with self._stubs_lock:
            return self._set_stub_locked(shard, at, admin_port, data_at, epoch)

    def _set_stub_locked(
        self, shard: int, at: str, admin_port: int, data_at: str | None, epoch: int
    ) -> Any:
        from tf_dlt.proto import dlt_pb2_grpc

        channel = self._channel(grpc_util.admin_address(at, int(admin_port)))
        stub = dlt_pb2_grpc.ShardAdminStub(channel)
        old = self._admins[shard] if shard < len(self._admins) else None
        data = (data_at or at, int(admin_port))
        if old is not None:
            old.channel.close()
            if data_at is None:
                data = (old.data_at, old.data_admin)
        made = _AdminStub(channel, stub, at, int(epoch), *data)
        if old is None:
            self._admins.append(made)
        else:
            self._admins[shard] = made
        return stub

    def _call_all(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        progress: Progress | None = None,
        shards: Sequence[int] | None = None,
    ) -> list[Any]:
        """Calls `method` on every shard (or those of `shards`) at once;
        returns each shard's reply or its failure as a tf_dlt error naming
        the shard, in the order of the shards. `progress` advances as each
        shard answers."""
        admins = self._admin()
        for _ in range(_LAYOUT_RETRIES):
            if int(self._data.layout_epoch) == self._stubs_layout:
                break
            admins = self._admin()  # the data plane learned a newer one meanwhile
        layout = self._stubs_layout  # the layout these stubs are of
        shards = range(len(admins)) if shards is None else list(shards)
        deadline = timeout or self._request_timeout
        metadata = grpc_util.bearer(self._token)
        met_all = self._met_all()
        met = {i: met_all[i] if i < len(met_all) else {"lineage": 0, "epoch": 0} for i in shards}
        lineages = {i: met[i]["lineage"] for i in shards}
        # Only writes carry it: a load replaces what a shard holds (the way
        # back after a restart), greeting every shard afresh first.
        # And the layout they are of: a shard that switched to a newer one
        # refuses them (`_on_all` sends them again to the new layout's).
        carried = {
            i: _lineage(lineages[i]) + ((grpc_util.LAYOUT_METADATA_KEY, str(layout)),)
            if method in _WRITES
            else ()
            for i in shards
        }
        if method in _WRITES or method == "Load":
            self._to_newest_copies({i: met[i] for i in shards})
        answered: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()

        def send(i: int, stub: Any, timeout: float) -> Any:
            call = getattr(stub, method).future(
                request, timeout=timeout, metadata=metadata + carried[i]
            )
            call.add_done_callback(lambda done, i=i: answered.put((i, done)))
            return call

        calls = {i: send(i, admins[i].stub, deadline) for i in shards}  # _to_newest_copy's
        ended: dict[int, Any] = {}  # a shard's call that ended, or the error it was given up with
        give_up = time.monotonic() + deadline
        # Shards with standbys: while their calls wait, each second, another
        # copy serving means the one asked went silent (paused, cut off) and
        # a standby took over (_leave_silent); a call that ends UNAVAILABLE
        # (its copy died) is sent to the copy that serves after it, within
        # the same deadline and watched the same way (_moved_on).
        watched = self._replicated(shards)
        moves: dict[int, int] = {}  # calls sent again after UNAVAILABLE, by shard
        resent: set[int] = set()  # shards whose call went on to another copy
        # A shard's addresses come from the data plane, which may learn a
        # re-shard's new layout meanwhile: its shard i is not this call's.

        def same_layout() -> bool:
            return int(self._data.layout_epoch) == layout

        def end(i: int, outcome: Any) -> None:
            ended[i] = outcome
            if progress is not None:
                failed = isinstance(outcome, errors.DltError) or outcome.exception()
                progress.update(1, f"(shard {i} {'failed' if failed else 'done'})")

        while len(ended) < len(calls):
            try:
                i, call = answered.get(timeout=_SILENT_CHECK_S if watched else None)
            except queue.Empty:
                for i in watched:
                    left = give_up - time.monotonic()
                    if i in ended or left <= 0 or not same_layout():
                        continue
                    outcome = self._leave_silent(i, calls[i], method, request, left, send)
                    if isinstance(outcome, errors.DltError):
                        end(i, outcome)
                    elif outcome is not calls[i]:
                        calls[i] = outcome
                        resent.add(i)
                continue
            if i in ended or call is not calls[i]:
                continue  # a call given up
            if i in watched and moves.get(i, 0) < _MAX_MOVES and same_layout():
                outcome = self._moved_on(i, call, method, give_up, met[i], send)
                if outcome is not call and not isinstance(outcome, errors.DltError):
                    moves[i] = moves.get(i, 0) + 1
                    calls[i] = outcome
                    resent.add(i)
                    continue
                call = outcome
            end(i, call)
        results: list[Any] = []
        unreached: dict[int, int] = {}  # shard -> its place in results: no process at its port
        for i in calls:
            if isinstance(ended[i], errors.DltError):
                results.append(ended[i])
                continue
            try:
                reply = ended[i].result()
                if method == "Stats" and reply.role in ("standby", "joining"):
                    # A primary that came back as its shard's standby: ask
                    # the copy that serves now (if none does, this one).
                    with contextlib.suppress(errors.DltError, grpc.RpcError):
                        reply = getattr(self._reresolve(i), method)(
                            request, timeout=deadline, metadata=metadata
                        )
                results.append(reply)
            except grpc.RpcError as e:
                if i in resent and method == "DropTable" and e.code() == grpc.StatusCode.NOT_FOUND:
                    # The copy first asked may have dropped it (its standby
                    # too) before it went silent or died: done, not failed.
                    from tf_dlt.proto import dlt_pb2

                    results.append(dlt_pb2.DropTableResponse())
                    continue
                error = grpc_util.error_from_rpc(e, self._what(i, method))
                if isinstance(error, errors.UnavailableError) and _looks_like_tls(e):
                    error = errors.ControlPlaneUnreachedError(f"{error}{self._tls_hint()}")
                elif isinstance(error, errors.UnavailableError) and i not in watched:
                    unreached[i] = len(results)
                results.append(error)
        if unreached:  # each asked once, at the same time
            with concurrent.futures.ThreadPoolExecutor(min(len(unreached), 64)) as pool:
                said = pool.map(
                    lambda i: self._restarted(i, met[i]["lineage"], results[unreached[i]]),
                    list(unreached),
                )
                for i, error in zip(list(unreached), said, strict=True):
                    results[unreached[i]] = error
        return results

    def _restarted(self, shard: int, lineage: int, error: errors.DltError) -> errors.DltError:
        """`error` (the control call found no process at the admin port it
        knows), or DataLossError where the shard's data-plane address
        answers as a process of another lineage than `lineage`, the one met:
        it restarted (with another admin port, as `tf-dlt server --port P`
        run again takes), and the rows the client wrote there are gone.
        Each control call failed UNAVAILABLE until a pull met the restart."""
        address = self._admins[shard].data_at
        try:
            info = _native.hello(address, self._token, timeout_ms=1000)
        except errors.DltError:
            return error
        if not lineage or int(info["lineage"]) in (0, lineage):
            return error
        return errors.DataLossError(
            f"{error}: {address} is a process that started since this client met shard "
            f"{shard} (admin port {info['admin_port']}): the rows written to the "
            "shard before are not there. Load a checkpoint (Client.load or tf_dlt.load, which "
            "take the processes serving now) so that every shard agrees"
        )

    def _what(self, shard: int, method: str) -> str:
        """How errors of `method` on `shard` begin."""
        return f"shard {shard} ({self.pservers[shard]}) {method}"

    def _moved_on(
        self,
        shard: int,
        call: Any,
        method: str,
        give_up: float,
        met: dict[str, int],
        send: Callable[[int, Any, float], Any],
    ) -> Any:
        """`call` (`method` on `shard`, ended), or where it ended
        UNAVAILABLE and the copy it asked no longer greets as the one met
        (`met`: its lineage and epoch; the copy died, or a process restarted
        empty at its address) or is stopping (SIGTERM: its admin port
        refuses calls while its data plane still greets), the same call
        (a Save only where it was refused as the copy stopped, so it never
        began there; else FailedOverError, the stub moved) sent to the copy
        of that
        lineage that greets at the newest epoch (a standby that took over,
        or is taking over), before `give_up` (the call's deadline). Where
        none does, the call's own error, with what each address said; where
        every process of the shard restarted, DataLossError."""
        error = call.exception()
        left = give_up - time.monotonic()
        if error is None or error.code() != grpc.StatusCode.UNAVAILABLE or left <= 0:
            return call
        if _looks_like_tls(error):
            return call  # no failover: TLS on one side only (its error says so)
        stopping = grpc_util.STOPPING in (error.details() or "")
        if not stopping and self._asked_greets(shard, met["lineage"]):
            return call  # alive, the copy met: its own UNAVAILABLE stands
        failed = (self._admins[shard].at, self._admins[shard].epoch)
        what = self._what(shard, method)
        try:
            stub = self._reresolve(
                shard,
                wait_s=min(left, self._request_timeout),
                lineage=met["lineage"],
                beside=failed,
                min_epoch=met["epoch"],
            )
        except errors.DataLossError as lost:
            return errors.DataLossError(f"{what}: {lost.message}")
        except errors.DltError as unresolved:
            own = grpc_util.error_from_rpc(error, what)
            return type(own)(f"{own.message}; no other copy serves: {unresolved.message}")
        if method == "Save" and not stopping:
            # It may have begun there (a process past its --stop-grace goes
            # on writing its part as it exits): sent again under the same
            # save id, that part could land over the one the new copy
            # writes. Given up; `save` makes it again under a new id.
            return errors.FailedOverError(
                f"{what}: {failed[0]} failed as it ran ({error.details()}); "
                f"{self._admins[shard].at} serves the shard now: the Save is given up"
            )
        return send(shard, stub, give_up - time.monotonic())

    def _leave_silent(
        self,
        shard: int,
        call: Any,
        method: str,
        request: Any,
        left: float,
        send: Callable[[int, Any, float], Any],
    ) -> Any:
        """`call` (`method` on `shard`, unanswered) where no other copy of
        the shard serves. Where one does (the copy asked went silent, paused
        or cut off, and a standby took over), the shard's stub moves to it
        and `call` is cancelled. A Save is given up, an UnavailableError
        returned: the silent copy could still write its part when it wakes,
        over the one the new primary wrote of the same save (a checkpoint
        whose file no longer matches its manifest), so the save fails in a
        second or two, not at its deadline (the persist timeout), and the
        next goes to the copy serving. Any other call changes only what the
        silent copy holds, which a replaced primary serves to no one: it is
        sent to the copy serving, within the `left` seconds of its deadline,
        and that call returned (a load's COMMIT then finds no load prepared
        there, and `_commit_load` prepares it there)."""
        serving = self._serving_elsewhere(shard)
        if serving is None:
            return call
        call.cancel()
        silent = self._admins[shard].at
        address, info = serving
        stub = self._set_stub(shard, address, info["admin_port"], epoch=info["epoch"])
        if method == "Save":
            return errors.FailedOverError(
                f"{self._what(shard, method)}: {silent} gave no answer and "
                f"{address} serves the shard now (its standby took over): the {method} is given "
                f"up, and may still run on {silent} if it wakes; run it again (it goes to "
                f"{address})"
            )
        log.warning(
            "shard %d: %s gave no answer to %s and %s serves: asking it",
            shard,
            silent,
            method,
            address,
        )
        return send(shard, stub, left)

    def _serving_elsewhere(self, shard: int) -> tuple[str, dict[str, Any]] | None:
        """Another address of `shard` than the one its stub asks that greets
        a trainer now (a standby refuses), of the lineage this client met,
        at an epoch newer than the copy the stub asks greeted with and no
        older than the data plane met (not a process restarted empty, nor an
        old primary woken before it learned it was replaced), with its
        Hello's info; None when none does. The copy asked is greeted first
        (half a second at most): one that answers, unreplaced, is not
        silent, and the others are left alone (each would count a refused
        Hello among its errors)."""
        met = self._met_all()[shard]
        lineage = met["lineage"]
        if self._asked_greets(shard, lineage):
            return None
        newer_than = max(self._admins[shard].epoch, met["epoch"] - 1)
        for address, info in self._greetings(shard, skip=self._admins[shard].at):
            if isinstance(info, errors.DltError):
                continue
            if lineage and info["lineage"] != lineage:
                continue
            if info["epoch"] <= newer_than:
                continue
            return address, info
        return None

    def _asked_greets(self, shard: int, lineage: int) -> bool:
        """Whether the copy `shard`'s stub asks greets within half a second
        as a copy of `lineage` (0: any): alive, and not a process restarted
        at its address since."""
        try:
            asked = _native.hello(self._admins[shard].at, self._token, timeout_ms=500)
        except errors.DltError:
            return False  # silent, replaced, or gone
        return not lineage or asked["lineage"] == lineage

    def _greetings(
        self, shard: int, skip: str = ""
    ) -> Iterator[tuple[str, dict[str, Any] | errors.DltError]]:
        """Each address of `shard` but `skip` (its primary, then its
        standbys), greeted as it is reached, with what it said: its Hello's
        info, or the error (a standby refuses trainers; 1 s at most)."""
        for address in self._addresses_of(shard).split("|"):
            if address == skip:
                continue
            try:
                yield address, _native.hello(address, self._token, timeout_ms=1000)
            except errors.DltError as e:
                yield address, e

    def _reresolve(
        self,
        shard: int,
        wait_s: float = 0.0,
        lineage: int = 0,
        beside: tuple[str, int] | None = None,
        min_epoch: int = 0,
    ) -> Any:
        """A new admin stub of `shard`, at the copy of its addresses that
        greets now at the newest epoch (docs/replication.md), asking again
        every 0.2 s for up to `wait_s` (a standby taking over). With
        `lineage`, only a copy of that lineage (a process restarted since
        holds none of its rows) at `min_epoch` or newer (the epoch this
        client met: an older copy is a primary replaced since, which may not
        know it): DataLossError, at once, when every address greets with
        another (every process of the shard restarted, as the data plane
        says). `beside`: an address and epoch not to be taken (the copy a
        call just failed on). The error of the last round names what each
        address said."""
        give_up = time.monotonic() + wait_s
        while True:
            greeted = self._greet_shard(shard, lineage, beside, min_epoch)
            if greeted.newest is not None:
                address, info = greeted.newest
                return self._set_stub(shard, address, info["admin_port"], epoch=info["epoch"])
            restarted = greeted.addresses > 0 and greeted.others == greeted.addresses
            if restarted or time.monotonic() + _REGREET_PAUSE_S >= give_up:
                if restarted:
                    raise errors.DataLossError(
                        f"shard {shard}: every process of it started since this client met it "
                        f"(lineage {lineage:016x}): the rows written to it before are not there; "
                        f"load a checkpoint ({'; '.join(greeted.said)})"
                    )
                last = greeted.last
                raise type(last)("; ".join(greeted.said) or last.message)
            time.sleep(_REGREET_PAUSE_S)

    def _greet_shard(
        self,
        shard: int,
        lineage: int,
        beside: tuple[str, int] | None = None,
        min_epoch: int = 0,
    ) -> _Greeted:
        """One round of greetings of `shard`'s addresses: the copy of
        `lineage` (0: any) greeting at the newest epoch, `min_epoch` or
        newer, but `beside`."""
        said: list[str] = []
        last: errors.DltError = errors.UnavailableError(f"shard {shard}: no address greets")
        newest: tuple[str, dict[str, Any]] | None = None
        addresses = others = 0
        refused: list[str] = []  # addresses that did not greet (a standby refuses)
        theirs: set[str] = set()  # the copies of another lineage's replica sets
        for address, info in self._greetings(shard):
            addresses += 1
            if isinstance(info, errors.DltError):
                said.append(f"{address}: {info.message}")
                last = info
                refused.append(address)
                continue
            if lineage and info["lineage"] and info["lineage"] != lineage:
                said.append(
                    f"{address}: a process of lineage {info['lineage']:016x}, started since "
                    f"this client met lineage {lineage:016x}"
                )
                others += 1
                theirs.update(str(info.get("standbys", "")).split("|"))
                continue
            if beside is not None and (address, int(info["epoch"])) == beside:
                said.append(f"{address}: the copy the call failed on")
                continue
            if info["epoch"] < min_epoch:
                said.append(
                    f"{address}: at epoch {info['epoch']}, older than epoch {min_epoch} this "
                    "client met (a primary replaced since)"
                )
                continue
            if newest is None or info["epoch"] > newest[1]["epoch"]:
                newest = (address, info)
        # A standby of a primary of another lineage is of that lineage too
        # (the whole replica set restarted: its standbys refuse trainers).
        others += sum(1 for address in refused if address in theirs)
        return _Greeted(newest, said, addresses, others, last)

    def _to_newest_copies(self, met: dict[int, dict[str, int]]) -> None:
        """`_to_newest_copy` of each shard of `met` (with what the client
        met of it), those with standbys at once: a silent copy costs its
        greeting's second once, not once per shard."""
        replicated = self._replicated(met)
        if len(replicated) < 2:
            for i in replicated:
                self._to_newest_copy(i, met[i])
            return
        with concurrent.futures.ThreadPoolExecutor(min(len(replicated), 16)) as pool:
            for done in [pool.submit(self._to_newest_copy, i, met[i]) for i in replicated]:
                done.result()

    def _to_newest_copy(self, shard: int, met: dict[str, int]) -> None:
        """Points the stub of `shard` (one with standbys), before a write,
        at the copy of the shard that greets at the newest epoch among
        those of the lineage this client met and no older than the epoch it
        met (`met`; lineage 0: any). The copy it asks may be a primary replaced while it was paused
        and woken since, which takes writes until it learns it was replaced
        (a few seconds: a save there holds the rows of before its pause), or
        a process restarted empty at its address (gRPC reconnects to it
        unseen). Where no address greets so but a process restarted since
        greets beside one that does not (its standby taking over), waits up
        to a request's deadline for one (`_reresolve`). Left as it is where
        no address greets so: the call itself then fails or moves on. Each
        write greets the shard's standbys once (a refusal they do not count
        among their errors)."""
        lineage = met["lineage"]
        greeted = self._greet_shard(shard, lineage, min_epoch=met["epoch"])
        if greeted.newest is None:
            if 0 < greeted.others < greeted.addresses:
                with contextlib.suppress(errors.DltError):
                    self._reresolve(
                        shard, wait_s=self._request_timeout, lineage=lineage,
                        min_epoch=met["epoch"],
                    )  # fmt: skip
            return
        address, info = greeted.newest
        if address == self._admins[shard].at:
            self._admins[shard].epoch = int(info["epoch"])
            return
        log.warning(
            "shard %d: %s greets at epoch %d, the newest: writing there, not to %s",
            shard,
            address,
            int(info["epoch"]),
            self._admins[shard].at,
        )
        self._set_stub(shard, address, info["admin_port"], epoch=info["epoch"])

    def expect_lineages(self, lineages: Sequence[int], *, layout_epoch: int = 0) -> None:
        """This client's saves and table changes go only to the copy of each
        shard of `lineages[i]` (0: the one it meets), the lineage of the
        copy another client of the cluster wrote to: `tf_dlt.save` passes
        the model's op clients' (`tf_dlt.ops.client_stats`), so a save made
        by a new client in the seconds between a primary's restart at its
        address and its standby's takeover never reaches the empty restart
        (docs/replication.md). `layout_epoch`: the layout those shards are
        of; while this client routes by another (a re-shard since), the
        lineages are not used."""
        self._expected_lineages = [int(lineage) for lineage in lineages]
        self._expected_layout = int(layout_epoch)

    def _met_all(self) -> list[dict[str, int]]:
        """The lineage and newest epoch of the copy of each shard this
        client's data plane met (0 where none is known; the lineages
        `expect_lineages` named first): its admin calls go only to a copy of
        that lineage, its writes carrying it. One greeting of the shards at
        most."""
        met: list[dict[str, int]] = []
        with contextlib.suppress(errors.DltError):
            met = [
                {"lineage": int(info["lineage"]), "epoch": int(info["epoch"])}
                for info in self._data.shard_infos()
            ]
        met += [{"lineage": 0, "epoch": 0}] * (len(self.pservers) - len(met))
        expected = self._expected_lineages
        if not self._expected_layout or self._expected_layout == int(self._data.layout_epoch):
            for i, lineage in enumerate(expected[: len(met)]):
                if lineage and lineage != met[i]["lineage"]:
                    met[i] = {"lineage": lineage, "epoch": 0}
        return met

    def _addresses_of(self, shard: int, infos: Sequence[dict[str, Any]] | None = None) -> str:
        """`shard`'s addresses: those this client was given, then the
        standbys the data plane learned from the shard's Hellos (a client
        given its primaries alone follows a takeover too). `infos`: the
        data plane's `shard_infos`, where the caller has them."""
        if infos is None:
            infos = []
            with contextlib.suppress(errors.DltError):
                infos = self._data.shard_infos()
        if shard < len(infos) and infos[shard]["replicas"]:
            return str(infos[shard]["replicas"])
        return self.pservers[shard]

    def _replicated(self, shards: Iterable[int]) -> list[int]:
        """Those of `shards` that list standbys (`_addresses_of`)."""
        infos: Sequence[dict[str, Any]] = []
        with contextlib.suppress(errors.DltError):
            infos = self._data.shard_infos()
        return [i for i in shards if "|" in self._addresses_of(i, infos)]

    def _channel(self, address: str) -> grpc.Channel:
        return tls.channel(
            address,
            self._tls,
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
                # A channel that failed to connect retries at most every
                # second (gRPC backs off up to 2 minutes): calls fail fast
                # meanwhile, and a Client.load right after a shard restarted
                # failed for 6 s after an outage of 20 s. (Not
                # grpc.min_reconnect_backoff_ms: that bounds each attempt,
                # 20 s by default, and 100 ms failed every TLS handshake
                # over a 120 ms round trip.)
                ("grpc.initial_reconnect_backoff_ms", _RECONNECT_MS[0]),
                ("grpc.max_reconnect_backoff_ms", _RECONNECT_MS[1]),
            ],
        )

    def _tls_hint(self) -> str:
        """Why a control plane may be unreachable when the data plane
        answered: TLS on one side only (gRPC says only "Socket closed" or
        "handshake failed")."""
        if self._tls is None:
            return (
                f". {_CONTROL_PLANE_UNREACHED}: if the shard "
                "serves TLS (--tls-cert), give this client TLS too (tls=tf_dlt.tls.TlsConfig(...) "
                "or TF_DLT_TLS_CA); this client speaks plaintext" + _AT_CAP
            )
        hint = (
            f". {_CONTROL_PLANE_UNREACHED}: this client "
            "speaks TLS (tls= or TF_DLT_TLS_*); if the shard runs without --tls-cert, drop "
            "the client's TLS, else check that the CA matches the shard's certificate and "
            + (f"that the certificate names {self._tls.server_name!r} (server_name=)"
               if self._tls.server_name else "that the certificate names the host this client "
               "dials (or name the one it holds: server_name=, TF_DLT_TLS_SERVER_NAME)")
        )  # fmt: skip
        if self._tls.cert is None:
            hint += (
                "; and this client presents no certificate: a shard started with "
                "--tls-client-ca refuses it (give TlsConfig(cert=, key=), or TF_DLT_TLS_CERT "
                "and TF_DLT_TLS_KEY)"
            )
        return hint + _AT_CAP

    def _on_all(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> list[Any]:
        """`_call_all`, raising the first failure (in shard order). A write
        that shards of a newer layout refused (another client re-sharded
        since this one last asked) is sent again to the new layout's shards,
        once it is learned."""
        again = False
        for _ in range(_LAYOUT_RETRIES):
            layout = int(self._data.layout_epoch)
            results = self._call_all(method, request, timeout, progress)
            if again and method == "DropTable" and not all(_not_found(r) for r in results):
                # Shards that had not switched dropped it the first time.
                results = [None if _not_found(r) else r for r in results]
            if not any(_layout_moved(r) for r in results):
                break
            self._follow_layout(learn=True)
            if int(self._data.layout_epoch) == layout:
                break  # no shard greets with the newer layout: its refusal stands
            again = True
        for result in results:
            if isinstance(result, errors.DltError):
                raise result
        return results

    def create_table(
        self,
        name: str,
        dim: int,
        initializer: initializers.InitializerLike = "uniform",
        optimizer: optimizers.OptimizerLike = "sgd",
        seed: int = 0,
        memory: MemoryPolicy | dict[str, Any] | None = None,
        **policy: Any,
    ) -> TableConfig:
        """Creates a table on every shard (a no-op where an identical one
        exists; ALREADY_EXISTS where a different one does). `memory`: its
        `tf_dlt.MemoryPolicy`; `policy`: the same fields as keywords
        (admission, unadmitted, ttl, max_rows, eviction, value_dtype,
        slot_dtype, rounding), as `TableConfig.create` takes them."""
        config = TableConfig.create(name, dim, initializer, optimizer, seed, memory, **policy)
        return self.create_table_from_config(config)

    def create_table_from_config(
        self, config: TableConfig, *, provisional: bool = False
    ) -> TableConfig:
        """Creates `config`'s table on every shard, as `create_table`.
        `provisional`: the optimizer is not known yet (see
        `tf_dlt.embedded.create_table`)."""
        from tf_dlt.proto import dlt_pb2

        request = dlt_pb2.CreateTableRequest(config=config.to_proto(), provisional=provisional)
        self._on_all("CreateTable", request)
        self._dims[config.name] = config.dim
        return config

    def drop_table(self, name: str) -> None:
        from tf_dlt.proto import dlt_pb2

        self._on_all("DropTable", dlt_pb2.DropTableRequest(name=name))
        self._dims.pop(name, None)

    def list_tables(self) -> dict[str, dict[str, Any]]:
        """Tables with their config, and rows, bytes and the memory policy's
        counters (admitted, refused, expired, evicted, shrunk) summed over
        shards."""
        from tf_dlt.proto import dlt_pb2

        out: dict[str, dict[str, Any]] = {}
        for reply in self._on_all("ListTables", dlt_pb2.ListTablesRequest()):
            for info in reply.tables:
                config = TableConfig.from_proto(info.config)
                entry = out.setdefault(
                    config.name, {"config": config, "rows": 0, "bytes": 0, **_POLICY_COUNTERS}
                )
                entry["rows"] += info.rows
                entry["bytes"] += info.bytes
                for key in _POLICY_COUNTERS:
                    entry[key] += getattr(info.policy_counters, key)
        for name, entry in out.items():
            self._dims[name] = entry["config"].dim
        return out

    def shrink(self, table: str, *, min_count: int = 0, unseen_for: int = 0) -> int:
        """Removes, on every shard, the rows of `table` updated fewer than
        `min_count` times or untouched for more than `unseen_for` units of
        the table's clock (pushes of the table on each shard, or seconds with
        a `tf_dlt.expiry.Seconds` ttl). 0 turns a condition off. Returns the
        rows removed."""
        from tf_dlt.proto import dlt_pb2

        for name, value in (("min_count", min_count), ("unseen_for", unseen_for)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise errors.InvalidArgumentError(f"{name} must be an int >= 0, got {value!r}")
        if min_count == 0 and unseen_for == 0:
            raise errors.InvalidArgumentError("shrink needs min_count or unseen_for")
        request = dlt_pb2.ShrinkRequest(table=table, min_count=min_count, unseen_for=unseen_for)
        return sum(r.removed for r in self._on_all("Shrink", request, self._persist_timeout))

    def save(
        self,
        path: str,
        *,
        base: str | None = None,
        tables: list[str] | None = None,
        progress: bool | None = None,
        save_id: str | None = None,
    ) -> dict[str, Any]:
        """Saves every shard into checkpoint directory `path` (a local path
        or an fsspec URL: file://, s3://, hdfs://, memory://) and commits it
        by writing the manifest last. Returns the manifest. `progress`: show
        shards finishing on stderr (None: when stderr is a terminal).

        With `base` (a committed checkpoint in another directory: the last
        one saved or loaded, typically) the save is a delta: each shard
        writes only the rows changed since `base` (value, optimizer slots
        and metadata of a row together) and the ids removed since. A table
        a shard cannot tell the changes of (created since, the shard
        restarted, or `base` is older than the last 4 saves it took) is
        written in full; the manifest is then still a valid delta, or a full
        checkpoint when every table was written in full. Loading `path`
        reads the chain: the full base and every delta up to `path`.

        `tables`: save only these tables (a model's: `tf_dlt.save` passes
        them); None: every table on the shards. A delta holds every table of
        its base that the shards hold (one left out would be dropped from
        the chain: refused). `save_id`: the save's id, from
        `chain.next_save_id` (`tf_dlt.save` names its dense weights by it
        before the tables commit); None: a new one from it (later than every
        save beside `path` and than `base`, whatever this host's clock
        says), and another where a try is given up because a shard failed over as it ran
        (`errors.FailedOverError`, raised where `save_id` is given;
        `SAVE_TRIES` tries in all).
        """
        from tf_dlt.checkpoint import chain

        _check_tables(tables, "save")
        path = manifest.absolute(path)  # the shards' working directory is not ours
        parent: dict[str, Any] | None = None
        if base is not None:
            with errors.storage_errors(f"reading the base {base}"):
                parent = manifest.delta_parent(path, manifest.absolute(base))
            if tables:
                # A table of the base that a delta leaves out is dropped
                # from its chain: only a table the shards dropped may be.
                held = set(self.list_tables())
                dropped = [t for t in parent["tables"] if t not in tables and t in held]
                if dropped:
                    raise errors.InvalidArgumentError(
                        f"a delta on {base} leaves out tables {dropped} of it that the shards "
                        "hold: its chain would drop them; list them in tables= too, or save "
                        "in full (no base; tf_dlt.save: incremental=False)"
                    )
        with errors.storage_errors(f"reading what {path} holds"):
            chain.refuse_breaking_dependents(path)
        if save_id is None:

            def save_once() -> dict[str, Any]:
                unread: list[str] = []
                with errors.storage_errors(f"reading the saves beside {path}"):
                    save_id = chain.next_save_id(
                        path, manifest.absolute(base) if base else None, unread
                    )
                saved = self._save(path, parent, tables, progress, save_id)
                # Once the shards took it: a save they refuse (a path outside
                # their checkpoint roots, say) says why, and no more.
                chain.warn_unread(path, unread)
                return saved

            return saved_despite_failovers(save_once, path)
        if not manifest.is_save_id(save_id):
            raise errors.InvalidArgumentError(f"not a save id: {save_id!r}")
        return self._save(path, parent, tables, progress, save_id)

    def _save(
        self,
        path: str,
        parent: dict[str, Any] | None,
        tables: list[str] | None,
        progress: bool | None,
        save_id: str,
    ) -> dict[str, Any]:
        """`save` of `path` (absolute) under `save_id`, a delta on `parent`
        (its manifest) or full (None)."""
        from tf_dlt.checkpoint import chain
        from tf_dlt.proto import dlt_pb2

        request = dlt_pb2.SaveRequest(
            path=path,
            save_id=save_id,
            base_save_id=parent["save_id"] if parent else "",
            tables=sorted(tables or ()),
        )
        with Progress(f"saving {path}", len(self.pservers), "shards", enabled=progress) as bar:
            replies = self._on_all("Save", request, self._persist_timeout, bar)
        parts = []
        for r in replies:
            part = json_format.MessageToDict(
                r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            part["bytes"] = int(part["bytes"])
            part["block_bytes"] = int(part["block_bytes"])
            if not part["block_bytes"]:  # a shard of an earlier version: whole-file hash only
                del part["block_bytes"], part["block_sha256"]
            part["tables"] = [
                {
                    "config": TableConfig.from_proto(t.config).to_dict(),
                    "rows": t.rows,
                    "mode": t.mode or "full",
                    "removed": t.removed,
                }
                for t in r.tables
            ]
            parts.append(part)
        with errors.storage_errors(f"reading what {path} holds"):
            # Again: a delta on what `path` holds may have committed while
            # the shards wrote.
            chain.refuse_breaking_dependents(path)
        with errors.storage_errors(f"committing {path}"):
            return manifest.write_manifest(path, parts, save_id, parent)

    def load(
        self, path: str, *, tables: list[str] | None = None, progress: bool | None = None
    ) -> dict[str, dict[str, Any]]:
        """Loads checkpoint `path` onto every shard (any shard count at save
        time). Returns the loaded tables with rows summed over shards.
        `progress`: show shards finishing on stderr (None: on a terminal).

        All or nothing: every shard first reads and verifies its rows into
        staged tables (PREPARE); only when all succeeded do they install
        them (COMMIT), each keeping what it replaced until every shard
        committed (FINISH). A failed prepare changes no shard; a commit that
        fails on some shard is rolled back on the others (ROLLBACK), and the
        error says which shards hold what.

        `tables`: load only these of the checkpoint's tables (a model's:
        `tf_dlt.load` passes them), leaving every other table on the shards
        as it is; None: every table the checkpoint holds. A name the
        checkpoint does not hold fails the load (NotFoundError), before any
        shard changes.

        The load replaces what the shards held: this client's pulls and
        pushes take the shards' processes serving now from then on, even a
        shard restarted since it met it (which would otherwise fail its next
        call with DataLossError, docs/replication.md).
        """
        _check_tables(tables, "load")
        path = manifest.absolute(path)  # the shards' working directory is not ours
        with errors.storage_errors(f"reading {path}"):
            # Fails fast, before any shard starts; and every shard reads
            # this save (one saved meanwhile is refused, never mixed in).
            head = manifest.resolve_chain(path)[-1]
        held = {t["config"]["name"] for t in head.manifest["tables"]}
        absent = sorted(set(tables or ()) - held)
        if absent:
            raise errors.NotFoundError(
                f"checkpoint {path} holds no table {', '.join(map(repr, absent))} (it holds "
                f"{sorted(held)}): nothing loaded"
            )
        save_id = head.save_id
        self._data.regreet()
        load_id = secrets.token_hex(8)
        self._prepare_load(path, load_id, progress, tables, save_id)
        return self._commit_load(path, load_id, tables, save_id)

    def abort_load(self, load_id: str) -> list[str]:
        """Undoes a cluster load a client left in the middle (it died
        between its phases: other loads are refused, `in the middle of load
        ...`, and `tf-dlt stats` shows it `in progress` with its id) instead
        of waiting for it to expire: each shard that prepared it drops what
        it staged; each that committed it puts back the tables it had before
        (pushes they took since are lost with the loaded tables). A load
        that committed on every shard and was finished on some (its client
        died between FINISHes) is finished on the others instead: undoing it
        there would leave the shards of two checkpoints. Returns what each
        shard did: "aborted", "rolled back" or "finished", or "-" where it
        had no such load."""
        from tf_dlt.proto import dlt_pb2

        request = dlt_pb2.LoadRequest
        if not load_id:
            raise errors.InvalidArgumentError("abort_load needs the load's id (tf-dlt stats)")
        before = [str(s.get("pending_load", "")) for s in self.stats()]
        held = [h.startswith(f"load {load_id!r} ") for h in before]
        committed_at = [i for i, h in enumerate(before) if held[i] and ", committed " in h]
        if committed_at and not all(held):
            # FINISH goes out only once every shard committed: the load is whole.
            self._load_phase(request.FINISH, load_id, committed_at)
            return ["finished" if i in committed_at else "-" for i in range(len(before))]
        aborts = self._call_all(
            "Load", request(phase=request.ABORT, load_id=load_id), self._persist_timeout
        )
        committed = [
            i for i, r in enumerate(aborts)
            if isinstance(r, errors.FailedPreconditionError) and "is committed" in str(r)
        ]  # fmt: skip
        failures = [r for i, r in enumerate(aborts) if isinstance(r, errors.DltError)
                    and i not in committed]  # fmt: skip
        if failures:
            raise failures[0]
        if committed:
            self._load_phase(request.ROLLBACK, load_id, committed)
        return [
            "rolled back" if i in committed else "aborted" if held[i] else "-"
            for i in range(len(before))
        ]

    def _load_phase(self, phase: Any, load_id: str, shards: list[int]) -> None:
        """Sends load phase `phase` of `load_id` to `shards`; raises the
        first failure once every shard answered."""
        from tf_dlt.proto import dlt_pb2

        request = dlt_pb2.LoadRequest(phase=phase, load_id=load_id)
        replies = self._call_all("Load", request, self._persist_timeout, shards=shards)
        failures = [r for r in replies if isinstance(r, errors.DltError)]
        if failures:
            raise failures[0]

    def _prepare_load(
        self,
        path: str,
        load_id: str,
        progress: bool | None,
        tables: list[str] | None = None,
        save_id: str = "",
    ) -> None:
        from tf_dlt.proto import dlt_pb2

        request = dlt_pb2.LoadRequest
        with Progress(f"loading {path}", len(self.pservers), "shards", enabled=progress) as bar:
            results = self._call_all(
                "Load", _prepare(path, load_id, tables, save_id), self._persist_timeout, bar
            )
        # The copy of each shard that prepared it (_commit_load).
        self._prepared_at = [admin.at for admin in self._admins]
        failures = [r for r in results if isinstance(r, errors.DltError)]
        if failures:
            # Shards that did prepare drop what they staged (or it expires).
            self._call_all(
                "Load", request(phase=request.ABORT, load_id=load_id), self._persist_timeout
            )
            raise failures[0]

    def _commit_load(
        self, path: str, load_id: str, tables: list[str] | None = None, save_id: str = ""
    ) -> dict[str, dict[str, Any]]:
        from tf_dlt.proto import dlt_pb2

        request = dlt_pb2.LoadRequest
        self._admin()
        prepared_at = self._prepared_at or [admin.at for admin in self._admins]
        # The later phases wait for the shard's persistence lock (a save may
        # hold it): they get the save's deadline, not a data call's.
        commit = request(phase=request.COMMIT, load_id=load_id)
        results = self._call_all("Load", commit, self._persist_timeout)
        # A shard whose standby took over since its PREPARE has no load
        # prepared (the new primary never staged it): it prepares there and
        # commits, as the other shards wait in COMMIT. Only a copy of the
        # lineage met: the client's admin plane moves to no other (a process
        # restarted empty at the old address answered as the old one, and
        # never had it prepared: that load fails).
        moved = [
            i
            for i, r in enumerate(results)
            if isinstance(r, errors.FailedPreconditionError)
            and i < len(prepared_at)
            and self._admins[i].at != prepared_at[i]
        ]
        if moved:
            log.warning(
                "load of %r: shards %s failed over since they prepared it: preparing and "
                "committing it on the copies serving now",
                path,
                moved,
            )
            again = self._call_all(
                "Load",
                _prepare(path, load_id, tables, save_id),
                self._persist_timeout,
                shards=moved,
            )
            ready = [
                i for i, r in zip(moved, again, strict=True) if not isinstance(r, errors.DltError)
            ]
            for i, r in zip(moved, again, strict=True):
                results[i] = r  # the failed PREPAREs' errors stand
            for i, r in zip(
                ready,
                self._call_all("Load", commit, self._persist_timeout, shards=ready),
                strict=True,
            ):
                results[i] = r
        failed = [i for i, r in enumerate(results) if isinstance(r, errors.DltError)]
        # A shard committed again on its new primary: the old one may have
        # committed before it died, its standby then holding the checkpoint
        # already, which a rollback there keeps.
        failed_over = set(moved)
        if failed:
            undone = self._call_all(
                "Load", request(phase=request.ROLLBACK, load_id=load_id), self._persist_timeout
            )
            stuck = []  # hold the checkpoint's tables, or may
            for i, (result, rollback) in enumerate(zip(results, undone, strict=True)):
                if i in failed_over and not isinstance(result, errors.DltError):
                    stuck.append(i)  # rolled back to what its new primary held: maybe the load
                    continue
                if not isinstance(rollback, errors.DltError):
                    continue  # rolled back, or had nothing to roll back
                if not isinstance(result, errors.DltError):
                    stuck.append(i)  # committed
                elif isinstance(result, (errors.DeadlineExceededError, errors.UnavailableError)):
                    # No answer to its COMMIT, which may have run: unless its
                    # rollback says it never committed.
                    if not isinstance(rollback, errors.FailedPreconditionError):
                        stuck.append(i)
            first: errors.DltError = results[failed[0]]
            if stuck:
                state = (
                    f"shards {stuck} could not be rolled back and hold the checkpoint's tables, "
                    f"or may (a shard that failed over during the load), the others what they "
                    f"held before: load {path!r} again once every shard answers"
                )
            else:
                state = "every other shard was rolled back to what it held before"
            raise type(first)(
                f"load of {path!r} did not commit on shards {failed} ({first.message}); {state}"
            )
        # Every shard committed: each frees what the load replaced.
        self._call_all(
            "Load", request(phase=request.FINISH, load_id=load_id), self._persist_timeout
        )
        out: dict[str, dict[str, Any]] = {}
        for reply in results:
            for info in reply.tables:
                config = TableConfig.from_proto(info.config)
                entry = out.setdefault(config.name, {"config": config, "rows": 0})
                entry["rows"] += info.rows
                self._dims[config.name] = config.dim
        return out

    def stats(self, *, buckets: bool = False) -> list[dict[str, Any]]:
        """Per-shard statistics: tables (rows, bytes), pulls, pushes, rows,
        bytes, errors by code, pull/push latency (count, p50 and p99 in
        microseconds). Numbers are numbers. `buckets`: also the latency
        histograms' raw counts (`buckets` in each latency, with
        `bucket_bounds_us` their upper bounds). `address`: the data-plane
        address of the copy that answered (of a shard's standbys, the one
        serving)."""
        from tf_dlt.proto import dlt_pb2

        replies = self._on_all("Stats", dlt_pb2.StatsRequest())
        return [
            {**message_dict(r, buckets), "address": admin.at}
            for r, admin in zip(replies, self._admins, strict=True)
        ]

    # Data plane ---------------------------------------------------------------

    def _dim(self, table: str) -> int:
        if table not in self._dims:
            self.list_tables()
        if table not in self._dims:
            raise errors.NotFoundError(f"no table {table!r} on the shards")
        return self._dims[table]

    def pull(
        self,
        table: str,
        ids: npt.ArrayLike,
        *,
        training: bool = True,
        missing: str = "init",
    ) -> npt.NDArray[np.float32]:
        """Rows of `ids` (any shape) as float32 ``ids.shape + (dim,)``.

        With ``training=True`` unseen ids get rows created with their initial
        value when the table's admission admits them on sight (every id, or
        `tf_dlt.admission.Probability`), else they read the table's
        ``unadmitted`` default and nothing is stored; otherwise nothing is
        inserted and unseen ids read as their initial value
        (``missing="init"``) or zeros (``missing="zeros"``).
        """
        if missing not in _PULL_MODES:
            raise errors.InvalidArgumentError(
                f"missing must be one of {sorted(_PULL_MODES)}, got {missing!r}"
            )
        if training and missing != "init":
            # (It was ignored: a training pull makes the rows it admits.)
            raise errors.InvalidArgumentError(
                f"missing={missing!r} applies to pulls with training=False; a training pull "
                "makes the rows of unseen ids (or reads the table's unadmitted default)"
            )
        a = _as_ids(ids)
        dim = self._dim(table)
        mode = 0 if training else _PULL_MODES[missing]
        try:
            rows = self._data.pull(table, dim, a.reshape(-1), mode)
        except errors.InvalidArgumentError as e:
            if not self._forgot_dim(table, e):
                raise
            dim = self._dim(table)  # made again with another dim: pulled at it
            rows = self._data.pull(table, dim, a.reshape(-1), mode)
        return rows.reshape(a.shape + (dim,))

    def _forgot_dim(self, table: str, e: errors.InvalidArgumentError) -> bool:
        """Whether `e` says the shards hold `table` at a dim other than the
        one this client took it for (another client dropped it and made it
        again): then the dim is asked again at the next use."""
        if "the request says" not in str(e):
            return False
        self._dims.pop(table, None)
        return True

    def push(
        self,
        table: str,
        ids: npt.ArrayLike,
        grads: npt.ArrayLike,
        learning_rate: float,
    ) -> None:
        """Applies `grads` (``ids.shape + (dim,)``) to the rows of `ids` with
        the table's optimizer and `learning_rate`. Repeated ids are summed
        (every occurrence of an id travels in one frame; an id repeated more
        often than the shard's largest frame holds raises
        ResourceExhaustedError and nothing is sent). Non-finite gradients are
        rejected and nothing is applied."""
        flat_ids, rows, dim = self._id_rows(table, ids, grads, "grads")
        try:
            self._data.push(table, dim, flat_ids, rows, float(learning_rate))
        except errors.InvalidArgumentError as e:
            self._forgot_dim(table, e)  # the next call takes the dim it has now
            raise

    def assign(self, table: str, ids: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """Sets the rows of `ids` to `values` (``ids.shape + (dim,)``), with
        fresh optimizer slots: uploads an existing embedding. Non-finite
        values are rejected and nothing is assigned. Sent again to the
        standby that takes over when a shard's primary dies (a push to the
        same rows that landed there meanwhile is overwritten)."""
        flat_ids, rows, dim = self._id_rows(table, ids, values, "values")
        try:
            self._data.assign(table, dim, flat_ids, rows)
        except errors.InvalidArgumentError as e:
            self._forgot_dim(table, e)
            raise

    def _id_rows(
        self, table: str, ids: npt.ArrayLike, rows: npt.ArrayLike, what: str
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], int]:
        """Checks ids and their rows (``ids.shape + (dim,)``, floating point);
        returns them flattened for the native client, and the dim."""
        a = _as_ids(ids)
        dim = self._dim(table)
        r = np.asarray(rows)
        if r.dtype.kind != "f":
            raise errors.InvalidArgumentError(f"{what} must be floating point, got {r.dtype}")
        if r.shape != a.shape + (dim,):
            raise errors.InvalidArgumentError(
                f"{what} must have shape {a.shape + (dim,)} (ids.shape + (dim,)), got {r.shape}"
            )
        return a.reshape(-1), np.ascontiguousarray(r, np.float32).reshape(-1, dim), dim

    # Lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        """Closes the control-plane channels and the data plane's pooled
        connections (each holds one of a shard's `--max-connections` until
        closed, or until the object is collected). A later call opens what
        it needs again."""
        with self._stubs_lock:
            for admin in self._admins:
                admin.channel.close()
            self._admins.clear()
        self._data.close_idle()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


TOKEN_FILE_ENV = "TF_DLT_AUTH_TOKEN_FILE"
# The longest timeout: the native core keeps milliseconds in an int.
MAX_TIMEOUT_MS = 2**31 - 1


def _check_tables(tables: Any, what: str) -> None:
    """Refuses a `tables=` of a save or load that names no table: an empty
    list (the shards take no names for every table: a list filtered down to
    nothing loaded every table, undoing what was trained since) or a string
    (its letters were taken for table names)."""
    if tables is None:
        return
    if isinstance(tables, str | bytes) or not all(isinstance(t, str) for t in tables):
        raise errors.InvalidArgumentError(
            f"{what}: tables must be a list of table names (or None: every table), got {tables!r}"
        )
    if not tables:
        raise errors.InvalidArgumentError(
            f"{what}: tables=[] names no table; nothing to {what} (None: every table)"
        )


def _prepare(path: str, load_id: str, tables: list[str] | None, save_id: str) -> Any:
    """A load's PREPARE request: `tables` of the checkpoint at `path` (None:
    every one), read at save `save_id`."""
    from tf_dlt.proto import dlt_pb2

    request = dlt_pb2.LoadRequest
    return request(
        path=path,
        phase=request.PREPARE,
        load_id=load_id,
        tables=sorted(tables or ()),
        save_id=save_id,
    )


def timeout_ms(what: str, seconds: float) -> int:
    """`seconds` in whole milliseconds (at least 1); InvalidArgumentError
    naming `what` unless it is above 0 and at most MAX_TIMEOUT_MS (24.8
    days): 30 days wrapped to a negative deadline, 0 was taken as 1 ms."""
    if not isinstance(seconds, int | float | np.integer | np.floating) or isinstance(seconds, bool):
        raise errors.InvalidArgumentError(f"{what} must be a number of seconds, got {seconds!r}")
    if not 0 < seconds * 1000 <= MAX_TIMEOUT_MS:  # NaN fails too
        raise errors.InvalidArgumentError(
            f"{what} must be more than 0 and at most {MAX_TIMEOUT_MS / 1000:.3f} seconds "
            f"(24.8 days), got {seconds}"
        )
    return max(1, int(seconds * 1000))


def read_token_file(
    path: str,
    named_by: str = "--auth-token-file",
    error: type[errors.DltError] = errors.InvalidArgumentError,
) -> str:
    """The token in file `path` (surrounding whitespace dropped), read by
    the native core as the op kernel reads TF_DLT_AUTH_TOKEN_FILE: a file
    that cannot be read, is not a regular file (a FIFO would block, a device
    never end), or holds no token or one no request can carry (see
    check_token) is `error` naming `named_by` and the reason, never the path
    or the token: a token pasted where its file goes would be printed."""
    try:
        return str(_native.read_token_file(os.fsencode(path), named_by))
    except errors.DltError as e:
        raise error(e.message) from None


def check_token(
    token: str, what: str, error: type[errors.DltError] = errors.InvalidArgumentError
) -> None:
    """Raises `error` (naming `what`, never the token) unless every request
    can carry `token`: at most 4,096 bytes of printable ASCII (a gRPC header
    carries it to the control plane). The native core's rule, which token
    files meet too."""
    try:
        _native.check_token(token.encode("utf-8", "surrogatepass"), what)
    except errors.DltError as e:
        raise error(e.message) from None


def token_from_env() -> str:
    """The token in the file TF_DLT_AUTH_TOKEN_FILE names (surrounding
    whitespace dropped, as the shards drop it from theirs), "" when it is
    unset: what clients given no token use, as the ops' clients do (a
    Kubernetes Secret mounted in the pod)."""
    path = os.environ.get(TOKEN_FILE_ENV, "")
    if not path:
        return ""
    return read_token_file(path, TOKEN_FILE_ENV, errors.FailedPreconditionError)


def message_dict(message: Any, buckets: bool) -> dict[str, Any]:
    """A reply as a dict of numbers (JSON's rules would make 64-bit ints
    strings), enums by name, every field present; histogram buckets only
    with `buckets`."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        # protobuf 7 has is_repeated only; 5 has label
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == 3
        if not buckets and field.name in ("buckets", "bucket_bounds_us"):
            continue
        value = getattr(message, field.name)
        kind = field.message_type
        if kind is not None and kind.GetOptions().map_entry:
            nested = kind.fields_by_name["value"].message_type is not None
            out[field.name] = {
                k: message_dict(v, buckets) if nested else v for k, v in value.items()
            }
        elif kind is not None:
            is_list = repeated
            items = [message_dict(v, buckets) for v in (value if is_list else [value])]
            out[field.name] = items if is_list else items[0]
        elif field.enum_type is not None:
            names = {n: v.name for n, v in field.enum_type.values_by_number.items()}
            is_list = repeated
            values = [names.get(v, v) for v in (value if is_list else [value])]
            out[field.name] = values if is_list else values[0]
        elif repeated:
            out[field.name] = list(value)
        else:
            out[field.name] = value
    return out
