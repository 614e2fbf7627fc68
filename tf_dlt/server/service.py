"""The control-plane servicer (tf_dlt.v1.ShardAdmin): decodes requests, calls
the shard, and turns tf_dlt errors into gRPC status codes. No table logic."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from tf_dlt import _native, cluster, errors, grpc_util, latency
from tf_dlt.checkpoint import shard_files
from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc
from tf_dlt.server import paths, replication, reshard
from tf_dlt.table_config import TableConfig

if TYPE_CHECKING:
    from tf_dlt.server.admin_server import CallContext

log = logging.getLogger("tf_dlt.server")


R = TypeVar("R")


def _handler(method: Callable[..., R]) -> Callable[..., R]:
    """Aborts the call with the error's own code on a tf_dlt error and with
    INTERNAL (naming the method) on anything unexpected."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: CallContext) -> R:
        try:
            return method(self, request, context)
        except errors.DltError as e:
            self.count_error(e.code_name)
            context.abort(grpc_util.status_code_for(e), grpc_util.bounded_details(e.message))
        except Exception as e:  # noqa: BLE001 - reported to the caller, server stays up
            log.exception("%s failed", method.__name__)
            self.count_error("INTERNAL")
            message = f"{method.__name__}: {type(e).__name__}: {e}"
            context.abort(grpc.StatusCode.INTERNAL, grpc_util.bounded_details(message))
        raise AssertionError("unreachable")

    return wrapper


def table_info(table: _native.Table, tier: dict[str, Any] | None = None) -> dlt_pb2.TableInfo:
    """`table`'s TableInfo; `tier`: its `_tier_dict`, when already read."""
    tier = tier or _tier_dict(table)
    return dlt_pb2.TableInfo(
        config=TableConfig.from_dict(table.config).to_proto(),
        rows=table.size(),
        bytes=tier["ram_bytes"],
        record_bytes=table.record_bytes,
        provisional=table.provisional,
        policy_counters=dlt_pb2.PolicyCounters(**table.counters()),
        tier=dlt_pb2.TierInfo(
            ram_rows=tier["ram_rows"],
            disk_rows=tier["disk_rows"],
            disk_bytes=tier["disk_bytes"],
            promotions=tier["promotions"],
            demotions=tier["demotions"],
            disk_reads=tier["disk_reads"],
            error=tier["tier_error"],
            promotions_per_s=tier["promotions_per_s"],
            demotions_per_s=tier["demotions_per_s"],
            disk_reads_per_s=tier["disk_reads_per_s"],
            disk_read_errors=tier["disk_read_errors"],
            disk_write_errors=tier["disk_write_errors"],
            disk_updates=tier["disk_updates"],
        ),
    )


def _tier_dict(table: _native.Table) -> dict[str, Any]:
    """A table's tier stats, with "bytes" the RAM bytes (as before tiers)."""
    tier = table.tier_stats()
    return {"bytes": tier["ram_bytes"], **tier}


def _info_from_dict(info: dict[str, Any]) -> dlt_pb2.TableInfo:
    return dlt_pb2.TableInfo(
        config=TableConfig.from_dict(info["config"]).to_proto(),
        rows=info["rows"],
        bytes=info.get("bytes", 0),
        record_bytes=info.get("record_bytes", 0),
        mode=info.get("mode", ""),
        removed=info.get("removed", 0),
    )


def summarize_latency(buckets: list[int]) -> dlt_pb2.LatencySummary:
    return dlt_pb2.LatencySummary(
        count=sum(buckets),
        p50_us=latency.quantile_us(buckets, 0.5),
        p99_us=latency.quantile_us(buckets, 0.99),
        buckets=buckets,
    )


@dataclasses.dataclass
class PendingLoad:
    """A cluster load between its phases on this shard: prepared (staged
    tables, not installed) or committed (installed; `undo` holds what they
    replaced, None where a table was absent, until FINISH or ROLLBACK)."""

    load_id: str
    path: str
    phase: str  # "prepared" or "committed"
    since: float
    result: dict[str, Any]
    undo: dict[str, Any] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        age = time.monotonic() - self.since
        return f"load {self.load_id!r} of {self.path!r}, {self.phase} {age:.0f} s ago"


# Saves and loads run one at a time; at most this many more wait for their
# turn (the admin plane's pool has 8 threads), polling their caller's
# deadline this often.
_PERSIST_WAITERS = 2
_PERSIST_POLL_S = 0.2
# How long a shutdown waits for the save or load under way before it goes on.
_CLOSE_WAIT_S = 5.0

_RANGE_STREAM_FIELDS = (
    "first_bucket", "end_bucket", "caught_up", "rounds", "rows_sent", "ended", "error",
)  # fmt: skip
_STANDBY_FIELDS = ("connected", "caught_up", "rounds", "rows_sent", "removals_sent",
                   "tables_copied", "lag_seconds", "error")  # fmt: skip


class ShardAdminServicer(dlt_pb2_grpc.ShardAdminServicer):
    """CreateTable, DropTable, ListTables, Save, Load and Stats of one shard.

    Args:
        shard: the native shard.
        data_server: its data plane (for statistics).
        roots: where Save and Load may go.
        load_timeout_s: a prepared load is dropped, and a committed one made
            final, after this long without its next phase.
    """

    def __init__(
        self,
        shard: _native.Shard,
        data_server: _native.DataServer,
        roots: paths.CheckpointRoots | None = None,
        load_timeout_s: float = 600.0,
    ) -> None:
        self._shard = shard
        self._data_server = data_server
        self._roots = roots or paths.CheckpointRoots()
        self._load_timeout_s = load_timeout_s
        self._persist_lock = threading.Lock()  # one Save or Load at a time
        # The Save or Load holding it (for those that wait), and how many wait.
        self._persist_state = threading.Lock()
        self._persisting_now: tuple[str, float] | None = None
        self._persist_waiters = 0
        # At most one cluster load between phases; guarded by _persist_lock.
        self._pending: PendingLoad | None = None
        # The load_id of the PREPARE running now ("": none).
        self._preparing = ""
        self._expiry: threading.Timer | None = None
        self._errors_lock = threading.Lock()
        self._errors: dict[str, int] = {}
        self.last_save_seconds = 0.0
        self.last_load_seconds = 0.0
        self.saves = self.loads = 0
        self.save_seconds_total = self.load_seconds_total = 0.0
        # Read-only (None: writable): why, for the errors; what it serves.
        self.read_only: str | None = None
        self.serving: dict[str, Any] = {}
        # Replication (tf_dlt.server.replication): this primary's standby,
        # or this standby's link to its primary; set by the ShardServer.
        self.standbys: replication.Standbys | None = None
        self.standby_link: replication.StandbyLink | None = None
        # This process's part of a live re-shard; set by the ShardServer.
        self.reshard: reshard.ReshardSteps | None = None
        # New at each start of the process (Stats): a standby tells a
        # restarted primary from the one it followed.
        self.incarnation = secrets.randbits(63) or 1

    def reading(self) -> contextlib.AbstractContextManager[Callable[[str], str]]:
        """Checks of each checkpoint of a chain a Load reads, for the
        block's length: each raises unless Load may read the path, and
        returns what to read it through (`paths.CheckpointRoots.holding`)."""
        return self._roots.holding("Load")

    def _writable(self, what: str, context: CallContext | None = None) -> None:
        met = context.metadata(grpc_util.LINEAGE_METADATA_KEY) if context is not None else None
        if met and met != f"{self._shard.lineage:016x}":
            # A process started since the client met the shard: it holds
            # none of the rows the client wrote (a save here would commit an
            # empty shard). UNAVAILABLE: the client looks for the copy it
            # met (a standby that took over keeps the lineage).
            raise errors.UnavailableError(
                f"shard {self._shard.shard_index} here is a process of lineage "
                f"{self._shard.lineage:016x}, started since the client met lineage {met}: it "
                f"holds none of the rows written before; {what} goes to the copy the client met"
            )
        told = context.metadata(grpc_util.LAYOUT_METADATA_KEY) if context is not None else None
        if told and cluster.is_count(told) and int(told) < int(self._shard.layout_epoch):
            # The client's stubs are of a layout before a re-shard: applied
            # here, a table made or dropped would miss the shards that joined
            # (or a save leave their rows out). Nothing applied: it learns
            # the layout and sends it again.
            raise errors.AbortedError(
                f"shard {self._shard.shard_index} here serves layout epoch "
                f"{self._shard.layout_epoch}, the client's calls are of epoch {told} "
                f"({grpc_util.LAYOUT_MOVED}): {what} goes to the shards of the new layout"
            )
        superseded = int(self._shard.superseded_by)
        if superseded:
            # Replaced while paused or cut off: its rows miss what the new
            # primary took since (a save here would lose acknowledged pushes).
            raise errors.UnavailableError(
                f"shard {self._shard.shard_index} here was replaced by a standby that took over "
                f"({self._shard.replaced_by}, epoch {superseded}): {what} goes to that primary"
            )
        if self.standby_link is not None and self.standby_link.role != "primary":
            # UNAVAILABLE: a client moves on to the shard's other address.
            raise errors.UnavailableError(
                f"shard {self._shard.shard_index} here is a standby ({self.read_only}): {what} "
                "goes to its primary"
            )
        if self.read_only is not None:
            raise errors.FailedPreconditionError(
                f"shard {self._shard.shard_index} is read-only ({self.read_only}): {what} goes "
                "to the training shards"
            )

    def _held_by_standbys(self, what: str, timeout_s: float | None = None) -> None:
        """Acknowledges an admin-plane write (a load installed or undone, a
        table made, dropped or shrunk) once the standbys hold it: a primary
        that dies right after it never leaves a standby to take over without
        it. In sync mode, as a push is: the write stays done here when they
        do not, and fails (a load's COMMIT then fails and the client rolls
        it back). In async mode, where a push is acknowledged at once, after
        the standbys hold it or, where they do not within `timeout_s` (None:
        the standby timeout), all the same, logged: a standby down fails no
        async write, and one that takes over without it serves before it."""
        if self.standbys is None:
            return
        try:
            self.standbys.hold(timeout_s)
        except errors.DltError as e:
            if self.standbys.replication == "async":
                log.warning(
                    "%s on shard %d: acknowledged before its standbys hold it (async "
                    "replication): %s", what, self._shard.shard_index, e.message,
                )  # fmt: skip
                return
            raise type(e)(
                f"{what} on shard {self._shard.shard_index} is done here, but its standbys do "
                f"not hold it: {e.message}"
            ) from e

    def count_error(self, code_name: str) -> None:
        with self._errors_lock:
            self._errors[code_name] = self._errors.get(code_name, 0) + 1

    @_handler
    def CreateTable(self, request: Any, context: CallContext) -> Any:
        self._writable("CreateTable", context)
        config = TableConfig.from_proto(request.config)
        created = self._shard.create_table(config.to_dict(), request.provisional)
        self._held_by_standbys(f"table {config.name!r} made")
        if created:
            log.info(
                "created table %s (dim %d, %s%s)", config.name, config.dim,
                config.optimizer.kind, ", until the trainer's optimizer is known"
                if request.provisional else "",
            )  # fmt: skip
        return dlt_pb2.CreateTableResponse(created=created)

    @_handler
    def DropTable(self, request: Any, context: CallContext) -> Any:
        self._writable("DropTable", context)
        self._shard.drop_table(request.name)
        log.info("dropped table %s", request.name)
        self._held_by_standbys(f"table {request.name!r} dropped")
        return dlt_pb2.DropTableResponse()

    @_handler
    def Shrink(self, request: Any, context: CallContext) -> Any:
        self._writable("Shrink", context)
        table = self._shard.get_table(request.table)
        removed = table.shrink(request.min_count, request.unseen_for)
        log.info(
            "shrink of %s (min_count %d, unseen_for %d) removed %d rows",
            request.table, request.min_count, request.unseen_for, removed,
        )  # fmt: skip
        self._held_by_standbys(f"shrink of {request.table!r}")
        return dlt_pb2.ShrinkResponse(removed=removed, rows=table.size())

    @_handler
    def ClaimTakeover(self, request: Any, context: CallContext) -> Any:
        link = self.standby_link
        if link is None:
            return dlt_pb2.ClaimTakeoverResponse(
                granted=False, reason="this process is no standby of a shard"
            )
        why_not = link.grant(
            request.candidate, (request.shard_index, request.num_shards),
            (request.insync_epoch, request.insync_version),
        )  # fmt: skip
        return dlt_pb2.ClaimTakeoverResponse(granted=not why_not, reason=why_not)

    @_handler
    def AttachStandby(self, request: Any, context: CallContext) -> Any:
        if not cluster.is_address(request.address):
            # Published in the Hello's "|"-separated standbys as it came.
            raise errors.InvalidArgumentError(
                f"a standby's address must be host:port (an IPv6 host in []) with a port 1 to "
                f"65535, got {request.address!r}"
            )
        self._writable("a standby")
        self._not_resharding("attach a standby")
        if self.standbys is None:
            raise errors.FailedPreconditionError(
                f"shard {self._shard.shard_index} here is a standby: attach to its primary"
            )
        if request.leaving:
            self.standbys.detach(request.address, request.shard_index, request.num_shards)
        else:
            self.standbys.attach(request.address, request.shard_index, request.num_shards)
        return dlt_pb2.AttachStandbyResponse(
            replication=self.standbys.replication, incarnation=self.incarnation
        )

    @_handler
    def Reshard(self, request: Any, context: CallContext) -> Any:
        steps = self.reshard
        if steps is None:
            raise errors.FailedPreconditionError("this server takes no part in re-shards")
        step = request.step
        kinds = dlt_pb2.ReshardRequest
        steps.admit(request.coordinator, request.lease_s, step == kinds.STATUS)
        if step == kinds.PREPARE:
            # Not while a save or load runs, nor between a load's phases; a
            # save or load waits for the re-shard's end (they refuse meanwhile).
            if not self._persist_lock.acquire(blocking=False):
                raise errors.FailedPreconditionError(
                    f"shard {self._shard.shard_index} is saving or loading: re-shard after it"
                )
            try:
                why_not = self._why_not_reshardable()
                if why_not is None and self._pending is not None:
                    why_not = f"it is in the middle of {self._pending.describe()}"
                steps.prepare(
                    request.shard_index, request.num_shards, why_not,
                    (request.from_layout, request.layout),
                )  # fmt: skip
            finally:
                self._persist_lock.release()
        elif step == kinds.STREAM:
            steps.stream(list(request.targets), request.pace)
        elif step in (kinds.HOLD, kinds.RELEASE):
            steps.hold(step == kinds.HOLD)
        elif step == kinds.SWITCH:
            steps.switch(request.layout_epoch, request.layout)
        elif step == kinds.UNDO:
            steps.undo(request.layout_epoch, request.layout)
        elif step == kinds.ABORT:
            steps.abort()
        s = steps.status()
        return dlt_pb2.ReshardResponse(
            prepared=s["prepared"], shard_index=s["shard_index"], num_shards=s["num_shards"],
            streams=[
                dlt_pb2.RangeStreamStatus(
                    target=r["standby"],
                    **{k: r[k] for k in _RANGE_STREAM_FIELDS},
                )
                for r in s["streams"]
            ],
            layout_epoch=s["layout_epoch"], layout=s["layout"], writes_held=s["writes_held"],
            switched=s["switched"], plan_from=s["plan_from"], plan_to=s["plan_to"],
            standby=s["standby"], coordinator=s["coordinator"],
            coordinator_idle_s=s["coordinator_idle_s"], lease_s=s["lease_s"],
        )  # fmt: skip

    @contextlib.contextmanager
    def _persisting(
        self, what: str, context: CallContext, *, capped: bool = True
    ) -> Iterator[None]:
        """Holds the persist lock for `what` (a Save or Load, as the log says
        it). One runs at a time; at most _PERSIST_WAITERS more wait, each as
        long as its caller does, and more are refused: each holds a thread
        of the admin plane's pool, whose others health checks and Stats must
        always find (a save to a store that never answers holds the lock for
        as long as that). Not `capped`: a later phase of a load under way
        (its COMMIT, ROLLBACK, ...), which finishes what the shards began
        together and is never refused for others that wait."""
        if not self._persist_lock.acquire(blocking=False):
            with self._persist_state:
                running = self._describe_persisting()
                if capped and self._persist_waiters >= _PERSIST_WAITERS:
                    raise errors.ResourceExhaustedError(
                        f"shard {self._shard.shard_index}: {what} refused: {running}, and "
                        f"{self._persist_waiters} more wait for it; try again after them"
                    )
                self._persist_waiters += int(capped)
            try:
                while not self._persist_lock.acquire(timeout=_PERSIST_POLL_S):
                    if not context.is_active():
                        raise errors.DeadlineExceededError(
                            f"shard {self._shard.shard_index}: {what} given up by its caller "
                            f"while it waited: {running}"
                        )
            finally:
                with self._persist_state:
                    self._persist_waiters -= int(capped)
        with self._persist_state:
            self._persisting_now = (what, time.monotonic())
        try:
            yield
        finally:
            with self._persist_state:
                self._persisting_now = None
            self._persist_lock.release()

    def _describe_persisting(self) -> str:
        """What holds the persist lock, for those that wait (under
        _persist_state)."""
        if self._persisting_now is None:
            return "a save or load is running"
        what, since = self._persisting_now
        return f"{what} has been running for {time.monotonic() - since:.0f} s"

    def _not_resharding(self, what: str) -> None:
        """Raises while this process takes part in a re-shard (between its
        PREPARE and its SWITCH or ABORT): the tables are about to move."""
        if self._data_server.reshard_prepared is not None:
            raise errors.FailedPreconditionError(
                f"shard {self._shard.shard_index} is being re-sharded: {what} after it ends"
            )

    def holds_whole_copy(self) -> bool:
        """This process holds a whole copy of its shard's rows: a shard
        without standbys, a primary once it began (its load done) or took
        over, a standby once it caught up; not one that loads, copies or
        learns its role, nor a primary replaced by a standby that took over.
        (A rolling restart of a replica set waits for it: docs/kubernetes.md.)"""
        if int(self._shard.superseded_by):
            return False
        link = self.standby_link
        if link is None:
            return True
        return link.role == "primary" or (link.role == "standby" and link.caught_up())

    def _why_not_reshardable(self) -> str | None:
        """Why this shard cannot take part in a re-shard yet, or None."""
        link = self.standby_link
        if link is not None and link.role != "primary":
            # A standby moves with its primary (it takes the same streams).
            if not self.holds_whole_copy():
                return f"it is a standby ({link.role}) that holds no whole copy of its primary"
            return None
        if self.read_only is not None:
            return f"it is read-only ({self.read_only})"
        return None

    @_handler
    def ListTables(self, request: Any, context: CallContext) -> Any:
        tables = sorted(self._shard.tables(), key=lambda t: t.name)
        return dlt_pb2.ListTablesResponse(tables=[table_info(t) for t in tables])

    @_handler
    def Save(self, request: Any, context: CallContext) -> Any:
        self._writable("Save", context)
        if not request.path:
            raise errors.InvalidArgumentError("Save needs a path")
        self._roots.check(request.path, "Save")
        with (
            self._persisting(f"Save to {request.path}", context),
            self._roots.holding("Save", create=True) as confine,
            errors.storage_errors(f"Save to {request.path}"),
        ):
            self._not_resharding("Save")
            log.info("saving to %s", request.path)
            part = shard_files.save_shard(
                confine(request.path),
                self._shard,
                request.save_id,
                request.base_save_id,
                tables=list(request.tables) or None,
            )
        self.last_save_seconds = part["seconds"]
        self.saves += 1
        self.save_seconds_total += part["seconds"]
        log.info("saved %s (%d bytes) in %.2f s", part["file"], part["bytes"], part["seconds"])
        return dlt_pb2.SaveResponse(
            file=part["file"],
            sha256=part["sha256"],
            bytes=part["bytes"],
            shard_index=part["shard_index"],
            num_shards=part["num_shards"],
            first_bucket=part["first_bucket"],
            end_bucket=part["end_bucket"],
            tables=[_info_from_dict(i) for i in part["tables"]],
            seconds=part["seconds"],
            block_bytes=part["block_bytes"],
            block_sha256=part["block_sha256"],
            meta_block_bytes=part["meta_block_bytes"],
        )

    @_handler
    def Load(self, request: Any, context: CallContext) -> Any:
        self._writable("Load")
        phases = dlt_pb2.LoadRequest
        phase = request.phase
        if phase in (phases.COMMIT, phases.ABORT, phases.FINISH, phases.ROLLBACK):
            if not request.load_id:
                raise errors.InvalidArgumentError("this Load phase needs a load_id")
            # A phase of the load under way waits past the cap (refused, it
            # could leave a cluster load mixed); one naming no load here (an
            # expired one, or forged: they took every admin thread) is capped.
            pending = self._pending
            ours = request.load_id == self._preparing or (
                pending is not None and pending.load_id == request.load_id
            )
            with self._persisting(f"Load {request.load_id}", context, capped=not ours):
                return self._load_response(self._next_phase(phase, request.load_id))
        if phase not in (phases.LOAD, phases.PREPARE):
            raise errors.InvalidArgumentError(f"unknown Load phase {phase}")
        if not request.path:
            raise errors.InvalidArgumentError("Load needs a path")
        if phase == phases.PREPARE and not request.load_id:
            raise errors.InvalidArgumentError("a prepared Load needs a load_id")
        self._roots.check(request.path, "Load")
        with self._persisting(f"Load of {request.path}", context):
            self._not_resharding("Load")
            if self._pending is not None:
                # One cluster load at a time: a second one never replaces a
                # load another client is in the middle of.
                raise errors.FailedPreconditionError(
                    f"shard {self._shard.shard_index} is in the middle of "
                    f"{self._pending.describe()}; it expires {self._load_timeout_s:.0f} s after "
                    "its last phase unless committed or aborted first"
                )
            log.info("loading from %s", request.path)
            # Its ABORT (its client gave up waiting) is a phase of the load
            # under way: never refused for the waiting saves.
            self._preparing = request.load_id if phase == phases.PREPARE else ""
            try:
                with self.reading() as allow, errors.storage_errors(f"Load of {request.path}"):
                    result = shard_files.prepare_load(
                        request.path,
                        self._shard,
                        allow,
                        tables=list(request.tables) or None,
                        save_id=request.save_id,
                    )
            finally:
                self._preparing = ""
            if phase == phases.PREPARE:
                self._set_pending(
                    PendingLoad(request.load_id, request.path, "prepared", time.monotonic(), result)
                )
            else:
                self._shard.install_tables(result["staged"])
                self._held_by_standbys(f"load of {request.path!r}", self._load_timeout_s)
        self.last_load_seconds = result["seconds"]
        self.loads += 1
        self.load_seconds_total += result["seconds"]
        log.info("read %s in %.2f s", request.path, result["seconds"])
        return self._load_response(result)

    def _next_phase(self, phase: int, load_id: str) -> dict[str, Any]:
        """COMMIT, ABORT, FINISH or ROLLBACK of `load_id`; the caller holds
        the persist lock."""
        phases = dlt_pb2.LoadRequest
        pending = self._pending if self._pending and self._pending.load_id == load_id else None
        empty: dict[str, Any] = {"tables": [], "seconds": 0.0}
        if phase == phases.COMMIT:
            if pending is None or pending.phase != "prepared":
                raise errors.FailedPreconditionError(
                    f"no load prepared under id {load_id!r} on shard {self._shard.shard_index} "
                    f"(never prepared, aborted, or expired after {self._load_timeout_s:.0f} s)"
                )
            current = {t.name: t for t in self._shard.tables()}
            pending.undo = {t.name: current.get(t.name) for t in pending.result["staged"]}
            self._shard.install_tables(pending.result["staged"])
            pending.result["staged"] = []
            pending.phase, pending.since = "committed", time.monotonic()
            self._set_pending(pending)
            log.info("committed load %s", load_id)
            # Until they hold it the load stays committed here, to be rolled
            # back when the client sees this COMMIT fail.
            self._held_by_standbys(f"load {load_id!r}", self._load_timeout_s)
            return pending.result
        if phase == phases.ABORT:
            if pending is not None and pending.phase == "committed":
                raise errors.FailedPreconditionError(
                    f"load {load_id!r} is committed on shard {self._shard.shard_index}: "
                    "ROLLBACK undoes it"
                )
            if pending is not None:
                self._set_pending(None)
                log.info("aborted load %s", load_id)
            return empty
        if phase == phases.FINISH:
            if pending is not None and pending.phase == "committed":
                self._set_pending(None)  # what the load replaced is freed
            return empty
        # ROLLBACK
        if pending is None:
            raise errors.FailedPreconditionError(
                f"nothing to roll back for load {load_id!r} on shard {self._shard.shard_index}: "
                f"never committed here, or final after {self._load_timeout_s:.0f} s"
            )
        if pending.phase == "committed":
            for name, table in pending.undo.items():
                if table is not None:
                    self._shard.install_tables([table])
                else:
                    with contextlib.suppress(errors.NotFoundError):
                        self._shard.drop_table(name)
            log.warning("rolled back load %s", load_id)
        self._set_pending(None)
        if pending.phase == "committed":
            self._held_by_standbys(f"rollback of load {load_id!r}", self._load_timeout_s)
        return empty

    def _set_pending(self, pending: PendingLoad | None) -> None:
        """Makes `pending` the load between phases (None: none), with its
        expiry; the caller holds the persist lock."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self._pending = pending
        if pending is not None:
            self._expiry = threading.Timer(self._load_timeout_s, self._expire, args=(pending,))
            self._expiry.daemon = True
            self._expiry.start()

    def _expire(self, pending: PendingLoad) -> None:
        with self._persist_lock:
            if self._pending is not pending:
                return
            log.warning(
                "%s expired: %s", pending.describe(),
                "its staged tables are dropped" if pending.phase == "prepared" else "it is final",
            )  # fmt: skip
            self._pending = None
            self._expiry = None

    def close(self) -> None:
        """Cancels the expiry timer (at shutdown), without waiting long for a
        save or load that holds the lock (one a store never answers holds it
        for good)."""
        held = self._persist_lock.acquire(timeout=_CLOSE_WAIT_S)
        try:
            self._set_pending(None)
        finally:
            if held:
                self._persist_lock.release()

    @staticmethod
    def _load_response(result: dict[str, Any]) -> Any:
        return dlt_pb2.LoadResponse(
            tables=[_info_from_dict(i) for i in result["tables"]], seconds=result["seconds"]
        )

    def snapshot(self) -> dict[str, Any]:
        """Everything Stats and the Prometheus metrics report, as plain data."""
        c = self._data_server.counters()
        errors_by_code = dict(c["errors"])
        with self._errors_lock:
            for name, count in self._errors.items():
                errors_by_code[name] = errors_by_code.get(name, 0) + count
        tables = sorted(self._shard.tables(), key=lambda t: t.name)
        pending = self._pending
        return {
            "pending_load": pending.describe() if pending is not None else "",
            "max_connections": self._data_server.max_connections,
            "worker_threads": self._data_server.worker_threads,
            "shard_index": self._shard.shard_index,
            "num_shards": self._shard.num_shards,
            "tables": [
                {"name": t.name, "rows": t.size(), **t.counters(), **_tier_dict(t)} for t in tables
            ],
            "memory": self._shard.memory_status(),
            "table_objects": tables,
            "counters": c,
            "errors": errors_by_code,
            "saves": self.saves,
            "loads": self.loads,
            "save_seconds_total": self.save_seconds_total,
            "load_seconds_total": self.load_seconds_total,
            "last_save_seconds": self.last_save_seconds,
            "last_load_seconds": self.last_load_seconds,
            "read_only": self.read_only is not None,
            **self.serving,
            **replication.describe(self._shard, self.standbys, self.standby_link),
        }

    @_handler
    def Stats(self, request: Any, context: CallContext) -> Any:
        s = self.snapshot()
        c = s["counters"]
        return dlt_pb2.StatsResponse(
            shard_index=s["shard_index"],
            num_shards=s["num_shards"],
            tables=[
                table_info(t, info) for t, info in zip(s["table_objects"], s["tables"], strict=True)
            ],
            pulls=c["pulls"],
            pushes=c["pushes"],
            pulled_rows=c["pulled_rows"],
            pushed_rows=c["pushed_rows"],
            bytes_in=c["bytes_in"],
            bytes_out=c["bytes_out"],
            errors=s["errors"],
            pull_latency=summarize_latency(c["pull_latency"]),
            push_latency=summarize_latency(c["push_latency"]),
            bucket_bounds_us=latency.BOUNDS_US,
            connections_open=c["connections_open"],
            connections_accepted=c["connections_accepted"],
            last_save_seconds=s["last_save_seconds"],
            last_load_seconds=s["last_load_seconds"],
            data_port=self._data_server.port,
            connections_authenticated=c["connections_authenticated"],
            connections_refused=c["connections_refused"],
            connections_evicted=c["connections_evicted"],
            connections_waiting=c["connections_waiting"],
            hello_timeouts=c["hello_timeouts"],
            idle_timeouts=c["idle_timeouts"],
            io_timeouts=c["io_timeouts"],
            buffered_bytes=c["buffered_bytes"],
            max_connections=s["max_connections"],
            worker_threads=s["worker_threads"],
            pending_load=s["pending_load"],
            read_only=s["read_only"],
            serving_path=s.get("serving_path", ""),
            serving_save_id=s.get("serving_save_id", ""),
            follow_dir=s.get("follow_dir", ""),
            follow_current=s.get("follow_current", False),
            follow_lag_seconds=s.get("follow_lag_seconds", 0.0),
            follow_error=s.get("follow_error", ""),
            deltas_applied=s.get("deltas_applied", 0),
            memory_budget=s["memory"]["budget"],
            resident_bytes=s["memory"]["resident"],
            storage_dir=s["memory"]["storage_dir"],
            staged_bytes=s["memory"]["staged_bytes"],
            role=s["role"],
            standby_of=s["standby_of"],
            replication=s.get("replication", ""),
            standbys=[
                dlt_pb2.StandbyStatus(
                    address=r["standby"],
                    **{k: r[k] for k in _STANDBY_FIELDS},
                )
                for r in s["standbys"]
            ],
            takeovers=s.get("takeovers", 0),
            epoch=s["epoch"],
            lineage=self._shard.lineage,
            incarnation=self.incarnation,
            caught_up=s.get("caught_up", False),
            layout_epoch=self._shard.layout_epoch,
            layout=self._shard.layout_addresses,
            reshard=self.reshard.describe() if self.reshard is not None else "",
            insync_epoch=s["insync"].get("epoch", 0),
            insync_version=s["insync"].get("version", 0),
            insync=[a for a in s["insync"].get("members", "").split("|") if a],
            promised_to=s.get("promised_to", ""),
            peers=s.get("peers", []),
            standby_error=s.get("standby_error", ""),
        )
