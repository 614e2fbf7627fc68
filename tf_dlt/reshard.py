"""Driving a live re-shard (docs/replication.md): the tables move from the
shards of one layout to those of another while trainers keep pulling and
pushing. `tf_dlt.Client.reshard` and `tf-dlt reshard` run `reshard`.

Every process of either layout (standbys too) prepares the shard it serves
in the next (none for one that leaves); every old primary streams the
buckets it owns of each new shard's to each of that shard's processes; once
every stream caught up, writes are held on the old primaries (each pauses
the stream to its standby, which holds every write then), each stream runs
a round begun since, and every process switches to the shard it prepared at
a layout one epoch newer; then writes go on.
Clients learn the new layout from the shards and send again what was
refused meanwhile. A failure before the switch aborts everywhere: the old
layout serves on, nothing moved.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from tf_dlt import _native, errors, grpc_util, routing

log = logging.getLogger("tf_dlt.reshard")

# How often the coordinator polls the streams while writes are held, and
# while they catch up.
_POLL_S = 0.005
_CATCH_UP_POLL_S = 0.05
# How long after a coordinator's last step a process may take it for dead
# (another coordinator may then finish or undo its re-shard); it steps
# every process that takes part (STATUS) four times a lease.
LEASE_S = 10.0


def reshard(
    current: Sequence[str],
    to: Sequence[str],
    *,
    stub_for: Callable[[str, int], Any],
    auth_token: str = "",
    timeout_s: float = 600.0,
    hold_timeout_s: float = 30.0,
    pace: float | None = None,
    lease_s: float = LEASE_S,
) -> dict[str, Any]:
    """Moves the tables of the shards at `current` (in shard order; the
    layout they serve) to the shards at `to`. A shard's address lists its
    primary and its standbys (`a|b`): the standbys take the same streams
    and switch with it. `stub_for(address, admin_port)` makes the admin
    stub of a process. `pace` (0, 1]: the fraction of the time each
    stream's copy may keep its thread busy (less leaves more of the cores
    to training, and streams longer); None: each shard's host decides (1/16
    of its cores, at most 1: `tf_dlt.server.reshard.default_pace`). Returns
    what it did: the new layout epoch, seconds streaming and seconds writes
    were held. `lease_s`: how
    long after this coordinator's last step the processes may take it for
    dead (it steps them all four times a lease while it runs); another
    coordinator waits that long, or for this one's re-shard to end.
    """
    from tf_dlt.proto import dlt_pb2

    current, to = list(current), list(to)
    if pace is not None and not 0 < pace <= 1:
        raise errors.InvalidArgumentError(f"reshard: pace must be in (0, 1], got {pace}")
    if not to:
        raise errors.InvalidArgumentError("reshard needs at least one shard address to move to")
    listed = [a for shard in to for a in shard.split("|") if a]
    twice = sorted({a for a in listed if listed.count(a) > 1})
    if twice:  # a shard's, or two shards' (a|b,b)
        raise errors.InvalidArgumentError(
            f"reshard: {', '.join(twice)} is listed twice in {to}; nothing was changed"
        )
    call = _Calls(stub_for, auth_token, hold_timeout_s, lease_s)
    step = dlt_pb2.ReshardRequest
    hellos: dict[tuple[str, bool], Any] = {}  # each process greeted once
    old_sets = _replica_sets(current, auth_token, hellos)
    new_sets = _replica_sets(to, auth_token, hellos)
    layout = _layout(new_sets)
    earlier = _finish_earlier(call, _members(old_sets + new_sets))
    if earlier is not None:
        if earlier["layout"] == layout:
            return {k: v for k, v in earlier.items() if k != "layout"}
        hellos.clear()  # the processes it finished or undid serve other shards now
        old_sets = _replica_sets(earlier["layout"].split(","), auth_token, hellos)  # served now
        new_sets = _replica_sets(to, auth_token, hellos)
        layout = _layout(new_sets)
    _refuse_a_partial_layout(old_sets, hellos)
    _refuse_one_process_twice(new_sets, hellos)
    if layout == _layout(old_sets):
        # Done already (run again after a reply was lost, say): nothing to
        # move. It failed, and a script running the documented command a
        # second time took a re-shard that had ended for one that had not.
        served = max(call(a, step(step=step.STATUS)).layout_epoch for a in _members(old_sets))
        return {"layout_epoch": served, "stream_s": 0.0, "held_s": 0.0, "unchanged": True}
    _refuse_owners_from_elsewhere(new_sets, old_sets, hellos)
    taking = [a for replicas in new_sets for a in replicas]
    if len(set(taking)) != len(taking):
        raise errors.InvalidArgumentError(f"reshard: a process is listed in two shards of {to}")
    _refuse_past_max_rows(call, old_sets, new_sets)
    # The old primaries stream and hold writes; every process (standbys
    # too: they take the same streams) prepares, switches, is released.
    processes = _members(old_sets + new_sets)
    statuses = {a: call(a, step(step=step.STATUS)) for a in _members(old_sets)}
    epoch = _layout_epoch_served(old_sets, statuses, current) + 1
    with _heartbeat(call, processes):
        return _move(call, old_sets, new_sets, layout, epoch, timeout_s, hold_timeout_s, pace)


def _refuse_past_max_rows(
    call: _Calls, old_sets: list[list[str]], new_sets: list[list[str]]
) -> None:
    """Refuses, before anything moves, a re-shard onto fewer shards that
    would give a new shard more rows of a table than its max_rows: the
    rows past it would be evicted (they were, silently, as the streams came
    in). A shard keeps max_rows per range of its buckets (each of its
    stripes holds at most its buckets' share), so each new shard's rows
    are estimated at the density of every old shard it takes buckets from
    (hashing spreads a shard's rows evenly over its buckets): 3,000 rows
    of one old shard and 400 of the other passed a cap of 4,096 in total,
    and the first pushes after the switch evicted 798 of them. And they
    must fit every stripe's quota, not only the table's (`_rows_that_fit`:
    2,043 rows of 4,096 at twice the density evicted 38). Onto as many
    shards or more, no range holds more than an old shard's did."""
    if len(new_sets) >= len(old_sets):
        return
    caps: dict[str, int] = {}
    rows: dict[str, list[float]] = {}  # the densest estimate for each new shard
    for i, replicas in enumerate(old_sets):
        lo, hi = routing.bucket_range(i, len(old_sets))
        for info in call.tables(replicas[0]).tables:
            cap = int(info.config.policy.max_rows)
            if not cap:
                continue
            caps[info.config.name] = cap
            held = rows.setdefault(info.config.name, [0.0] * len(new_sets))
            for j in range(len(new_sets)):
                first, end = routing.bucket_range(j, len(new_sets))
                if min(hi, end) > max(lo, first):
                    held[j] = max(held[j], info.rows * (end - first) / (hi - lo))
    past = [
        f"table {name!r}: about {held[j]:.0f} rows for shard {j} of {len(new_sets)} (at the "
        f"density of the densest shard it takes buckets from), past the about "
        f"{_rows_that_fit(caps[name]):.0f} its max_rows of {caps[name]} holds without evicting"
        for name, held in sorted(rows.items())
        for j in range(len(new_sets))
        if held[j] > _rows_that_fit(caps[name])
    ]
    if past:
        raise errors.FailedPreconditionError(
            f"reshard onto {len(new_sets)} shards would evict rows: {'; '.join(past[:3])}"
            f"{'; ...' if len(past) > 3 else ''}; nothing was changed. Re-shard onto more "
            "shards, or raise max_rows"
        )


def _rows_that_fit(cap: int) -> float:
    """The rows a shard's table of max_rows `cap` holds without evicting
    one: each of its stripes holds at most cap / STRIPES, and hashing fills
    a stripe as a Poisson count of mean rows / STRIPES fills, so the mean
    plus three standard deviations stays within the quota (about 69% of a
    cap of 4,096; 99.7% of one of 50 million)."""
    quota = cap / _native.STRIPES
    per_stripe = ((math.sqrt(9 + 4 * quota) - 3) / 2) ** 2  # m + 3 sqrt(m) = quota
    return per_stripe * _native.STRIPES


def _layout_epoch_served(
    old_sets: list[list[str]], statuses: dict[str, Any], current: list[str]
) -> int:
    """The layout epoch the shards of `old_sets` serve. A process restarted
    after a re-shard in the place that re-shard gave it (`--shard-index`,
    `--num-shards`: docs/operations.md) begins at layout epoch 1 again; it
    is of the newest layout when that layout names it at its index. Any
    other difference (a process of an older layout, whose buckets moved
    away) is refused."""
    newest = max(s.layout_epoch for s in statuses.values())
    layout = next(s.layout for s in statuses.values() if s.layout_epoch == newest)
    places = [set(shard.split("|")) for shard in layout.split(",")] if layout else []
    behind = []
    for i, replicas in enumerate(old_sets):
        for address in replicas:
            if statuses[address].layout_epoch == newest:
                continue
            if len(places) != len(old_sets) or address not in places[i]:
                behind.append(f"{address} at layout epoch {statuses[address].layout_epoch}")
    if behind:
        raise errors.FailedPreconditionError(
            f"reshard: the shards at {current} serve different layouts: "
            f"{', '.join(behind)}, which the newest one (epoch {newest}: {layout or 'none'}) "
            "does not name at its index; nothing was changed"
        )
    return int(newest)


def _move(
    call: _Calls,
    old_sets: list[list[str]],
    new_sets: list[list[str]],
    layout: str,
    epoch: int,
    timeout_s: float,
    hold_timeout_s: float,
    pace: float | None,
) -> dict[str, Any]:
    """The steps of a re-shard from `old_sets` to `new_sets` (`layout`),
    switching at layout epoch `epoch`."""
    from tf_dlt.proto import dlt_pb2

    step = dlt_pb2.ReshardRequest
    primaries = [replicas[0] for replicas in old_sets]
    processes = _members(old_sets + new_sets)
    began = time.monotonic()
    # Every step before the switch ends by `timeout_s` from now: one that
    # does not (a process frozen, a stream slow) aborts the re-shard.
    call.deadline = began + timeout_s
    try:
        for address in processes:
            call(address, step(
                step=step.PREPARE, shard_index=_index_in(address, new_sets),
                num_shards=len(new_sets), layout=layout, from_layout=_layout(old_sets),
            ))  # fmt: skip
        for address in primaries:
            call(address, step(step=step.STREAM, targets=layout.split(","), pace=pace or 0.0))
        _await_streams(primaries, call, lambda s: s.caught_up, began + timeout_s, "catch up")
        streamed = time.monotonic()
        _raise_first(_on_each(primaries, call, step(step=step.HOLD)))
        held = time.monotonic()
        # A round begun after the hold holds every write there was.
        rounds = {
            (a, s.target): s.rounds
            for a in primaries
            for s in call(a, step(step=step.STATUS)).streams
        }
        _await_streams(
            primaries, call, lambda s: True, held + hold_timeout_s, "drain", rounds_after=rounds
        )
    except BaseException:
        call.deadline = None
        _quietly(call, processes, step(step=step.ABORT))
        raise
    call.deadline = None  # the switch and release, once begun, are not cut short
    switches = _on_each(processes, call, step(step=step.SWITCH, layout_epoch=epoch, layout=layout))
    if any(isinstance(r, BaseException) for r in switches):
        # Writes are still held everywhere: every process goes back to the
        # old layout losing nothing (a SWITCH whose reply was lost may have
        # switched too), then all abort.
        _undo(call, processes, epoch + 1, _layout(old_sets))
        _raise_first(switches)
    unreleased = _release(call, processes)
    done = time.monotonic()
    log.info(
        "re-shard to %s: layout epoch %d, streamed %.2f s, writes held %.3f s",
        layout, epoch, streamed - began, done - held,
    )  # fmt: skip
    result: dict[str, Any] = {
        "layout_epoch": epoch, "stream_s": streamed - began, "held_s": done - held
    }  # fmt: skip
    if unreleased:
        result["unreleased"] = unreleased
    return result


def _undo(call: Callable[[str, Any], Any], processes: list[str], epoch: int, old: str) -> None:
    """Every process serves the old layout again, as layout `epoch` (newer
    than the one switched to: clients that learned that one learn this, and
    no epoch is used twice), then aborts (writes taken again). A process
    that did not switch takes the epoch too."""
    from tf_dlt.proto import dlt_pb2

    step = dlt_pb2.ReshardRequest
    _quietly(call, processes, step(step=step.UNDO, layout_epoch=epoch, layout=old))
    _quietly(call, processes, step(step=step.ABORT))


class _Calls:
    """Reshard steps to shard processes by data-plane address, each one's
    admin stub made when first needed (from its Hello: a standby greets a
    replica's Hello only). Every step carries this coordinator's id and
    lease; while `deadline` (monotonic) is set, none waits past it."""

    def __init__(
        self,
        stub_for: Callable[[str, int], Any],
        token: str,
        timeout_s: float,
        lease_s: float = LEASE_S,
    ) -> None:
        self._stub_for, self._token, self._timeout_s = stub_for, token, timeout_s
        self._metadata = grpc_util.bearer(token)
        self._stubs: dict[str, Any] = {}
        self._stubs_lock = threading.Lock()
        self.coordinator, self.lease_s = secrets.token_hex(8), lease_s
        self.deadline: float | None = None

    def __call__(self, address: str, request: Any) -> Any:
        from tf_dlt.proto import dlt_pb2

        stamped = dlt_pb2.ReshardRequest()
        stamped.CopyFrom(request)
        stamped.coordinator, stamped.lease_s = self.coordinator, self.lease_s
        return self._send(address, stamped)

    def tables(self, address: str) -> Any:
        """The tables process `address` holds (its ListTables reply)."""
        from tf_dlt.proto import dlt_pb2

        try:
            return self._stub(address).ListTables(
                dlt_pb2.ListTablesRequest(), timeout=self._timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise grpc_util.error_from_rpc(e, f"reshard: listing the tables of {address}") from e

    def _stub(self, address: str) -> Any:
        with self._stubs_lock:
            stub = self._stubs.get(address)
        if stub is None:
            try:
                hello = _native.hello(address, self._token)
            except errors.UnavailableError:
                hello = _native.hello(address, self._token, replica=True)
            stub = self._stub_for(address, int(hello["admin_port"]))
            with self._stubs_lock:
                stub = self._stubs.setdefault(address, stub)
        return stub

    def _send(self, address: str, request: Any) -> Any:
        stub = self._stub(address)
        step = type(request).Step.Name(request.step)  # PREPARE, not "step 1"
        timeout, deadline = self._timeout_s, self.deadline
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout <= 0:
                raise errors.DeadlineExceededError(
                    f"reshard {step} on {address}: the re-shard's timeout passed before it"
                )
        try:
            return stub.Reshard(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise grpc_util.error_from_rpc(e, f"reshard {step} on {address}") from e


@contextlib.contextmanager
def _heartbeat(call: _Calls, processes: list[str]) -> Iterator[None]:
    """Steps every process (STATUS) four times a lease while the block
    runs, so none takes this coordinator for dead while a long step (a
    HOLD waiting for writes in flight, a stream catching up) keeps it from
    stepping them."""
    from tf_dlt.proto import dlt_pb2

    stop = threading.Event()
    status = dlt_pb2.ReshardRequest(step=dlt_pb2.ReshardRequest.STATUS)

    def beat() -> None:
        while not stop.wait(call.lease_s / 4):
            for address in processes:
                with contextlib.suppress(errors.DltError):
                    call(address, status)

    thread = threading.Thread(target=beat, name="reshard-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _wait_out_others(call: _Calls, known: list[str]) -> None:
    """Waits while another coordinator's re-shard holds processes of
    `known` (one that stepped them within its lease): until its lease
    passes with no step (it died: the caller may then finish or undo its
    re-shard), or raises if it keeps going past that wait, or ended
    meanwhile (the layout this caller planned from may be gone)."""
    from tf_dlt.proto import dlt_pb2

    status = dlt_pb2.ReshardRequest(step=dlt_pb2.ReshardRequest.STATUS)
    deadline, seen = None, ""
    while True:
        others, planned = [], False
        for address in known:
            try:
                s = call(address, status)
            except errors.DltError:
                continue
            planned |= bool(s.plan_to)
            if s.plan_to and s.coordinator and s.coordinator != call.coordinator:
                seen = seen or f"from {s.plan_from} to {s.plan_to}"
                if s.coordinator_idle_s < s.lease_s:
                    others.append((address, s))
        if not others:
            if seen and not planned:
                raise errors.FailedPreconditionError(
                    f"reshard: another re-shard ({seen}) ended while this one waited: run this "
                    "again against the layout served now"
                )
            return
        address, s = others[0]
        if deadline is None:
            deadline = time.monotonic() + max(o.lease_s for _, o in others) + 2.0
            log.warning(
                "reshard: another re-shard (from %s to %s) is under way; waiting for it to end "
                "or for its coordinator's lease (%.0f s) to pass", s.plan_from, s.plan_to,
                s.lease_s,
            )  # fmt: skip
        if time.monotonic() > deadline:
            raise errors.FailedPreconditionError(
                f"reshard: another re-shard (from {s.plan_from} to {s.plan_to}) is under way: "
                f"its coordinator stepped {address} {s.coordinator_idle_s:.1f} s ago; run this "
                "again once it has ended"
            )
        time.sleep(0.25)


def _layout(sets: list[list[str]]) -> str:
    return ",".join("|".join(replicas) for replicas in sets)


def _members(sets: list[list[str]]) -> list[str]:
    return list(dict.fromkeys(a for replicas in sets for a in replicas))


def _index_in(address: str, sets: list[list[str]]) -> int:
    """The shard `address` serves in the layout of `sets` (their count: none)."""
    return next((j for j, replicas in enumerate(sets) if address in replicas), len(sets))


def _release(call: Callable[[str, Any], Any], processes: list[str]) -> list[str]:
    """RELEASE to every process once the switch holds everywhere, tried 3
    times: one that still cannot be reached is logged and returned (it died
    after it switched, and a standby of it took part too and takes over; or
    it holds writes until the re-shard is run again) and the re-shard
    stands."""
    from tf_dlt.proto import dlt_pb2

    release = dlt_pb2.ReshardRequest(step=dlt_pb2.ReshardRequest.RELEASE)
    left, errors_met = list(processes), {}
    for attempt in range(3):
        if attempt:
            time.sleep(0.2)
        results = _on_each(left, call, release)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result  # this process is stopping (KeyboardInterrupt, SystemExit)
        errors_met = {a: r for a, r in zip(left, results, strict=True) if isinstance(r, Exception)}
        left = list(errors_met)
        if not left:
            return []
    for address, error in errors_met.items():
        log.warning(
            "reshard: %s switched but could not be released (%s); the new layout holds (run the "
            "re-shard again to release it if it lives)", address, error,
        )  # fmt: skip
    return left


def _finish_earlier(call: _Calls, known: list[str]) -> dict[str, Any] | None:
    """Finishes or undoes a re-shard whose coordinator died (or was cut off)
    part way, which may have left writes held. Every process that took part
    keeps the plan (the layouts from and to) until RELEASE or ABORT, so all
    are found from any of `known`. It is finished (the others switched,
    all released) once a process was released, or when some switched, every
    process answers, and each one not switched still prepares its shard of
    the new layout with its writes held (its streams drained before any
    switch); otherwise every process goes back (UNDO at a newer epoch, then
    ABORT). Returns what finishing did (with the layout served now), or
    None when there was nothing to finish."""
    from tf_dlt.proto import dlt_pb2

    step = dlt_pb2.ReshardRequest
    _wait_out_others(call, known)
    statuses: dict[str, Any] = {}

    def status(address: str) -> Any:
        if address not in statuses:
            try:
                statuses[address] = call(address, step(step=step.STATUS))
            except errors.DltError as e:
                log.warning("reshard: %s does not answer: %s", address, e)
                statuses[address] = None
        return statuses[address]

    plans = {(s.plan_from, s.plan_to) for a in known if (s := status(a)) and s.plan_to}
    if not plans:
        return None
    if len(plans) > 1:
        raise errors.FailedPreconditionError(
            f"reshard: processes take part in different re-shards at once: {sorted(plans)}"
        )
    plan_from, plan_to = plans.pop()
    new_sets = [shard.split("|") for shard in plan_to.split(",")]
    old = _members([shard.split("|") for shard in plan_from.split(",")])
    participants = _members([old] + new_sets)
    alive = [a for a in participants if status(a) is not None]
    unreachable = [a for a in participants if status(a) is None]
    switched = [a for a in alive if statuses[a].layout == plan_to]
    released = [a for a in switched if not statuses[a].plan_to]
    behind = [a for a in alive if a not in switched]
    place = {a: (_index_in(a, new_sets), len(new_sets)) for a in behind}
    # A process not switched still prepares its shard, and (an old primary)
    # holds its writes: it took none since its streams drained.
    ready = all(
        statuses[a].prepared
        and (statuses[a].shard_index, statuses[a].num_shards) == place[a]
        and (statuses[a].writes_held or statuses[a].standby or a not in old)
        for a in behind
    )
    undo_epoch = max(statuses[a].layout_epoch for a in alive) + 1
    if released and not ready:
        raise errors.FailedPreconditionError(
            f"reshard: the re-shard to {plan_to} was released on {', '.join(released)}, but "
            f"{', '.join(behind)} no longer prepare their shards of it (or took writes since): "
            "it can be neither finished nor undone (restart "
            "those with the new layout's --shard-index and --num-shards)"
        )
    if not released and (not switched or not ready or unreachable):
        log.warning(
            "reshard: undoing the unfinished re-shard from %s to %s%s", plan_from, plan_to,
            f" ({', '.join(unreachable)} do not answer)" if unreachable else "",
        )  # fmt: skip
        _undo(call, alive, undo_epoch, plan_from)
        return None
    epoch = statuses[switched[0]].layout_epoch
    log.warning(
        "reshard: finishing the re-shard to %s (layout epoch %d) that %s switched to",
        plan_to, epoch, ", ".join(switched),
    )  # fmt: skip
    began = time.monotonic()
    results = _on_each(behind, call, step(step=step.SWITCH, layout_epoch=epoch, layout=plan_to))
    if not released and any(isinstance(r, BaseException) for r in results):
        _undo(call, alive, undo_epoch, plan_from)
    _raise_first(results)
    unreleased = _release(call, alive)
    done: dict[str, Any] = {
        "layout_epoch": epoch, "stream_s": 0.0, "held_s": time.monotonic() - began,
        "resumed": True, "layout": plan_to,
    }  # fmt: skip
    if unreleased or unreachable:
        done["unreleased"] = unreleased + unreachable
    return done


def _replica_sets(
    shards: list[str], auth_token: str, hellos: dict[tuple[str, bool], Any]
) -> list[list[str]]:
    """Each shard's processes, the primary (the one serving trainers)
    first, then every standby it replicates to: a re-shard moves the
    primary and every standby it has, or none. A standby the primary's
    Hello names and the list leaves out is added if it answers (one attached
    since the layout was set: the layout the shards serve does not name it,
    and every re-shard after it was refused); a listed process it does not
    replicate to is refused. `hellos` keeps what each process said (or the error it
    met), so each is greeted once."""

    def hello(address: str, replica: bool) -> dict[str, Any]:
        key = (address, replica)
        if key not in hellos:
            try:
                hellos[key] = _native.hello(address, auth_token, replica=replica)
            except errors.DltError as e:
                hellos[key] = e
                if replica:  # once per process, however many layouts list it
                    log.warning(
                        "reshard: %s does not answer (%s): a shard's process that does not is "
                        "left out, and a shard none of whose processes does is refused",
                        address, e,
                    )  # fmt: skip
        if isinstance(hellos[key], errors.DltError):
            raise hellos[key]
        return dict(hellos[key])

    sets = []
    for shard in shards:
        replicas = list(dict.fromkeys(a for a in shard.split("|") if a))
        serving: list[str] = []
        said: set[str] = set()
        for address in list(replicas):
            try:
                info = hello(address, False)
            except errors.UnavailableError:
                try:  # a standby greets its primary only
                    hello(address, True)
                except errors.DltError:
                    # A process that died (its standby took over): not in
                    # the next layout.
                    replicas.remove(address)
                continue
            serving.append(address)
            said = {a for a in info["standbys"].split("|") if a}
        if not serving and not replicas:
            raise errors.UnavailableError(
                f"reshard: no process of shard {shard} answers (is the cluster up, and are these "
                "its addresses?)"
            )
        if len(serving) != 1:
            raise errors.FailedPreconditionError(
                f"reshard: shard {shard} needs exactly one process serving trainers (its "
                f"primary); {serving or 'none'} did"
            )
        others = [a for a in replicas if a != serving[0]]
        if not set(others) <= said:
            raise errors.FailedPreconditionError(
                f"reshard: {serving[0]} replicates to {sorted(said) or 'no standby'}, but the "
                f"shard lists {others}: list each shard's primary and its standbys only"
            )
        unlisted = [a for a in sorted(said - set(others)) if _answers(hello, a)]
        if unlisted:
            log.info("reshard: %s replicates to %s too: they move with it", serving[0], unlisted)
        sets.append([serving[0], *others, *unlisted])
    return sets


def _answers(hello: Callable[[str, bool], dict[str, Any]], standby: str) -> bool:
    """Whether `standby` answers a standby's Hello. One that died stays
    named by its primary until the primary detaches it; like a listed
    process that does not answer, it is left out of the next layout."""
    try:
        hello(standby, True)
    except errors.DltError:
        return False
    return True


def _refuse_a_partial_layout(
    old_sets: list[list[str]], hellos: dict[tuple[str, bool], Any]
) -> None:
    """The shards being re-sharded must be the whole layout, in order: each
    primary serves shard i of len(old_sets). A list missing a shard would
    leave that shard serving its buckets beside the new owners of them."""
    for i, replicas in enumerate(old_sets):
        info = hellos.get((replicas[0], False))
        if isinstance(info, dict) and (info["shard_index"], info["num_shards"]) != (
            i,
            len(old_sets),
        ):
            raise errors.FailedPreconditionError(
                f"reshard: {replicas[0]} serves shard {info['shard_index']} of "
                f"{info['num_shards']}, not shard {i} of the {len(old_sets)} listed "
                f"({_layout(old_sets)}): list every shard of the layout served now, in order "
                "(before the first re-shard the shards do not know each other's addresses)"
            )


def _refuse_one_process_twice(
    new_sets: list[list[str]], hellos: dict[tuple[str, bool], Any]
) -> None:
    """Two shards of the new layout whose primaries greet with one lineage
    are one process under two names (127.0.0.1:P and localhost:P): the
    re-shard streamed every range, then failed at its switch, and the
    process was left saying it served shard 1 of 1."""
    seen: dict[int, str] = {}
    for replicas in new_sets:
        info = hellos.get((replicas[0], False))
        lineage = int(info.get("lineage", 0)) if isinstance(info, dict) else 0
        if not lineage:
            continue
        if lineage in seen:
            raise errors.InvalidArgumentError(
                f"reshard: {seen[lineage]} and {replicas[0]} are one process (both greet "
                f"with lineage {lineage:016x}): each shard of the new layout needs its own; "
                "nothing was changed"
            )
        seen[lineage] = replicas[0]


def _refuse_owners_from_elsewhere(
    new_sets: list[list[str]], old_sets: list[list[str]], hellos: dict[tuple[str, bool], Any]
) -> None:
    """A shard of the new layout whose primary is no process of the old one
    must own no bucket (a server started with `tf-dlt server --join`, or
    one a re-shard left out): one that serves buckets is another cluster's
    shard (a mistyped address), or one of these listed under another
    address, and PREPARE would replace its tables."""
    old = set(_members(old_sets))
    for replicas in new_sets:
        primary = replicas[0]
        info = hellos.get((primary, False))
        if primary in old or not isinstance(info, dict):
            continue
        if info["shard_index"] < info["num_shards"]:
            raise errors.FailedPreconditionError(
                f"reshard: {primary} serves shard {info['shard_index']} of {info['num_shards']} "
                f"but is no process of the shards being re-sharded "
                f"({_layout(old_sets)}): a shard of another cluster, or one of these under "
                "another address? A server new to the cluster starts with `tf-dlt server --join` "
                "(it owns no bucket); nothing was changed"
            )


def _on_each(addresses: list[str], call: Callable[[str, Any], Any], request: Any) -> list[Any]:
    """`request` to every process at once (the steps writes wait through);
    each one's reply or exception, in order."""

    def one(address: str) -> Any:
        try:
            return call(address, request)
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            return e

    if not addresses:
        return []
    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        return list(pool.map(one, addresses))


def _raise_first(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _quietly(call: Callable[[str, Any], Any], processes: list[str], request: Any) -> None:
    """A step of undoing a failed re-shard, to every process at once (one
    frozen costs one step's timeout, not one each): a process that cannot be
    reached (the one that failed) is logged and passed over."""
    for result in _on_each(processes, call, request):
        if isinstance(result, errors.DltError):
            log.warning("reshard: undoing, passed over: %s", result)  # names the step, process
        elif isinstance(result, BaseException):
            raise result  # this process is stopping (KeyboardInterrupt, SystemExit)


def _await_streams(
    current: list[str],
    call: Callable[[str, Any], Any],
    ready: Callable[[Any], bool],
    deadline: float,
    what: str,
    rounds_after: dict[tuple[str, str], int] | None = None,
) -> None:
    """Polls every old shard's streams until each is `ready` (and, with
    `rounds_after`, ran two rounds more than it had then); raises when one
    ended or the deadline passed."""
    from tf_dlt.proto import dlt_pb2

    status = dlt_pb2.ReshardRequest(step=dlt_pb2.ReshardRequest.STATUS)
    while True:
        waiting = []
        for address in current:
            for s in call(address, status).streams:
                if s.ended:
                    raise errors.UnavailableError(
                        f"reshard: the stream of buckets [{s.first_bucket}, {s.end_bucket}) "
                        f"from {address} to {s.target} failed: {s.error}"
                    )
                behind = (
                    rounds_after is not None and s.rounds < rounds_after[(address, s.target)] + 2
                )
                if not ready(s) or behind:
                    waiting.append(f"{address} -> {s.target}")
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise errors.DeadlineExceededError(
                f"reshard: streams did not {what} in time: {', '.join(waiting)}"
            )
        # Writes wait while draining: polled often then; seldom while the
        # streams catch up (the trainers' cores).
        time.sleep(_POLL_S if rounds_after is not None else _CATCH_UP_POLL_S)
