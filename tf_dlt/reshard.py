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

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from tf_dlt import _native, errors, grpc_util

log = logging.getLogger("tf_dlt.reshard")

# How often the coordinator polls the streams while writes are held, and
# while they catch up.
_POLL_S = 0.005
_CATCH_UP_POLL_S = 0.05


def reshard(
    current: Sequence[str],
    to: Sequence[str],
    *,
    stub_for: Callable[[str, int], Any],
    auth_token: str = "",
    timeout_s: float = 600.0,
    hold_timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Moves the tables of the shards at `current` (in shard order; the
    layout they serve) to the shards at `to`. A shard's address lists its
    primary and its standbys (`a|b`): the standbys take the same streams
    and switch with it. `stub_for(address, admin_port)` makes the admin
    stub of a process. Returns what it did: the new layout epoch, seconds
    streaming and seconds writes were held.
    """
    from tf_dlt.proto import dlt_pb2

    current, to = list(current), list(to)
    if not to:
        raise errors.InvalidArgumentError("reshard needs at least one shard address to move to")
    if len(set(to)) != len(to):
        raise errors.InvalidArgumentError(f"reshard: an address is listed twice in {to}")
    old_sets, new_sets = _replica_sets(current, auth_token), _replica_sets(to, auth_token)
    taking = [a for replicas in new_sets for a in replicas]
    if len(set(taking)) != len(taking):
        raise errors.InvalidArgumentError(f"reshard: a process is listed in two shards of {to}")
    # The old primaries stream and hold writes; every process (standbys
    # too: they take the same streams) prepares, switches, is released.
    primaries = [replicas[0] for replicas in old_sets]
    standbys = {a for replicas in old_sets + new_sets for a in replicas[1:]}
    processes = list(dict.fromkeys(a for replicas in old_sets + new_sets for a in replicas))
    metadata = grpc_util.bearer(auth_token)
    stubs = {}
    for address in processes:
        hello = _native.hello(address, auth_token, replica=address in standbys)
        stubs[address] = stub_for(address, int(hello["admin_port"]))
    step = dlt_pb2.ReshardRequest

    def call(address: str, request: Any) -> Any:
        try:
            return stubs[address].Reshard(request, timeout=hold_timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            raise grpc_util.error_from_rpc(e, f"reshard step {request.step} on {address}") from e

    epochs = {
        call(a, step(step=step.STATUS)).layout_epoch for replicas in old_sets for a in replicas
    }
    if len(epochs) != 1:
        raise errors.FailedPreconditionError(
            f"reshard: the shards at {current} serve different layouts (epochs {sorted(epochs)})"
        )
    epoch = epochs.pop() + 1
    layout = ",".join("|".join(replicas) for replicas in new_sets)
    began = time.monotonic()
    try:
        for address in processes:
            index = next((j for j, r in enumerate(new_sets) if address in r), len(new_sets))
            call(address, step(step=step.PREPARE, shard_index=index, num_shards=len(to)))
        for address in primaries:
            call(address, step(step=step.STREAM, targets=layout.split(",")))
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
        for address in processes:
            _quietly(call, address, step(step=step.ABORT))
        raise
    switches = _on_each(processes, call, step(step=step.SWITCH, layout_epoch=epoch, layout=layout))
    if any(isinstance(r, BaseException) for r in switches):
        # Writes are still held everywhere: the processes that switched go
        # back to the old layout losing nothing, then all abort.
        for address, result in zip(processes, switches, strict=True):
            if not isinstance(result, BaseException):
                _quietly(call, address, step(step=step.UNDO))
        for address in processes:
            _quietly(call, address, step(step=step.ABORT))
        _raise_first(switches)
    _raise_first(_on_each(processes, call, step(step=step.RELEASE)))
    done = time.monotonic()
    log.info(
        "re-shard to %s: layout epoch %d, streamed %.2f s, writes held %.3f s",
        layout, epoch, streamed - began, done - held,
    )  # fmt: skip
    return {"layout_epoch": epoch, "stream_s": streamed - began, "held_s": done - held}


def _replica_sets(shards: list[str], auth_token: str) -> list[list[str]]:
    """Each shard's processes, the primary (the one serving trainers)
    first, checked against the standbys it replicates to: a re-shard moves
    the primary and every standby it has, or none."""
    sets = []
    for shard in shards:
        replicas = list(dict.fromkeys(a for a in shard.split("|") if a))
        serving: list[str] = []
        said: set[str] = set()
        for address in list(replicas):
            try:
                info = _native.hello(address, auth_token)
            except errors.UnavailableError:
                try:  # a standby greets its primary only
                    _native.hello(address, auth_token, replica=True)
                except errors.DltError as e:
                    # A process that died (its standby took over): not in
                    # the next layout.
                    log.warning("reshard: leaving out %s, which does not answer: %s", address, e)
                    replicas.remove(address)
                continue
            serving.append(address)
            said = {a for a in info["standbys"].split("|") if a}
        if len(serving) != 1:
            raise errors.FailedPreconditionError(
                f"reshard: shard {shard} needs exactly one process serving trainers (its "
                f"primary); {serving or 'none'} did"
            )
        others = [a for a in replicas if a != serving[0]]
        if set(others) != said:
            raise errors.FailedPreconditionError(
                f"reshard: {serving[0]} replicates to {sorted(said) or 'no standby'}, but the "
                f"shard lists {others or 'none'}: list each shard's primary and all its standbys"
            )
        sets.append([serving[0], *others])
    return sets


def _on_each(addresses: list[str], call: Callable[[str, Any], Any], request: Any) -> list[Any]:
    """`request` to every process at once (the steps writes wait through);
    each one's reply or exception, in order."""

    def one(address: str) -> Any:
        try:
            return call(address, request)
        except BaseException as e:  # noqa: BLE001 - returned to the caller
            return e

    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        return list(pool.map(one, addresses))


def _raise_first(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _quietly(call: Callable[[str, Any], Any], address: str, request: Any) -> None:
    """A step of undoing a failed re-shard: a process that cannot be
    reached (the one that failed) is logged and passed over."""
    try:
        call(address, request)
    except errors.DltError as e:
        log.warning("reshard: step %s on %s failed: %s", request.step, address, e)


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
