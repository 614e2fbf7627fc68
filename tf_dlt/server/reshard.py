"""A shard server's part of a live re-shard (docs/replication.md): the steps
a coordinator (`tf_dlt.Client.reshard`, `tf-dlt reshard`) runs on every
process of the old and the new layout, one ReshardRequest each.

PREPARE makes the empty shard this process serves in the next layout;
STREAM starts a range stream from this shard to each process of each shard
of the next layout that takes some of its buckets (its own process
included; a shard's standbys take the same streams as its primary); HOLD
refuses writes until the switch and pauses the stream to this primary's
standby once it holds every write; SWITCH serves the prepared shard, keeping
the one it served until RELEASE (writes go on, the re-shard is done) or
UNDO (another process could not switch: back to the old one); ABORT undoes
whatever came before the switch. The work is the native core's
(`ReshardTarget`, `Replicator(range_stream=True)`, `DataServer.hold_writes`
and `switch_layout`); this module keeps the streams and checks the steps'
order.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from tf_dlt import _native, errors, routing
from tf_dlt.reshard import LEASE_S
from tf_dlt.server.replication import Standbys

log = logging.getLogger("tf_dlt.server")


def default_pace() -> float:
    """A re-shard's pace when its caller names none: each range stream's
    copy may keep a core busy 1/16 of this host's cores' time, at most all
    of one (a host of 16 cores or more streams flat out). On a host of 2
    cores a copy flat out took one of the two from training (a trainer
    beside it kept 0.23-0.43x of its rows/s; at 0.25, 0.43-0.45x; at 0.125,
    0.50-0.70x: docs/benchmarks.md, "Live re-sharding")."""
    return min(1.0, len(os.sched_getaffinity(0)) / 16)


class ReshardSteps:
    """The re-shard steps of one shard server process."""

    def __init__(
        self,
        shard: _native.Shard,
        data_server: _native.DataServer,
        auth_token: str = "",
        io_timeout_s: float = 30.0,
        standbys: Standbys | None = None,
    ) -> None:
        self._shard = shard
        self._data_server = data_server
        self._standbys = standbys
        self._auth_token = auth_token
        self._io_timeout_ms = max(1, int(io_timeout_s * 1000))
        self._lock = threading.Lock()
        self._streams: list[_native.Replicator] = []  # guarded by _lock
        self._held = False  # guarded by _lock
        # The re-shard taken part in: the layouts from and to; guarded by _lock.
        self._plan = ("", "")
        # Its coordinator: id, when it last stepped this process
        # (monotonic), its lease; guarded by _lock.
        self._holder = ("", 0.0, 0.0)

    def _who(self) -> str:
        """How errors name this process: its shard, or (a server started
        with --join) a process of no shard yet."""
        if self._shard.shard_index < self._shard.num_shards:
            return f"shard {self._shard.shard_index}"
        return "this joining process (it owns no bucket yet)"

    def admit(self, coordinator: str, lease_s: float, status_only: bool) -> None:
        """Before a step from `coordinator` (a random id; "" for none): while
        this process takes part in a re-shard whose coordinator stepped it
        within its lease, another coordinator may read its STATUS only (two
        coordinators at once would undo or switch each other's steps). A
        step from the holder, or any step once no live one holds it, makes
        (or keeps) its sender the holder."""
        now = time.monotonic()
        with self._lock:
            holder, last, lease = self._holder
            busy = bool(self._plan[1] or self._held or self._streams)
            live = busy and bool(holder) and now - last < lease
            if coordinator and live and coordinator != holder:
                if status_only:
                    return
                raise errors.FailedPreconditionError(
                    f"{self._who()} takes part in another re-shard (from "
                    f"{self._plan[0]} to {self._plan[1]}), whose coordinator stepped it "
                    f"{now - last:.1f} s ago: run this one once that has ended (or once its "
                    f"coordinator has been gone {lease:.0f} s)"
                )
            if coordinator and (not status_only or coordinator == holder):
                self._holder = (coordinator, now, float(lease_s) or LEASE_S)

    def prepare(
        self, shard_index: int, num_shards: int, why_not: str | None, plan: tuple[str, str]
    ) -> None:
        """Prepares shard `shard_index` of `num_shards` (index == count: this
        process leaves the layout) of the re-shard `plan` (the layouts from
        and to). `why_not`: why this process cannot take part (a read-only
        shard, ...), or None."""
        # Standbys of the layouts from and to (the coordinator leaves out one
        # that does not answer, which its primary may still name).
        taking_part = {
            a for layout in plan for shard in layout.split(",") for a in shard.split("|")
        }
        behind = [
            s["standby"]
            for s in (self._standbys.statuses() if self._standbys is not None else [])
            if not (s["connected"] and s["caught_up"])
            and (s["standby"] in taking_part or not any(plan))
        ]
        if why_not is None and behind:
            why_not = f"its standby {', '.join(behind)} has not caught up with it"
        if why_not is not None:
            raise errors.FailedPreconditionError(f"{self._who()} cannot be re-sharded: {why_not}")
        if self._shard.memory_status()["budget"]:
            raise errors.FailedPreconditionError(
                f"{self._who()} has a memory budget: re-sharding shards with "
                "one is not supported yet (docs/replication.md)"
            )
        with self._lock:
            self._stop_streams()
            self._data_server.reshard_prepare(shard_index, num_shards)
            self._plan = plan
        log.info("re-shard: prepared shard %d of %d", shard_index, num_shards)

    def stream(self, targets: list[str], pace: float = 0.0) -> None:
        """Streams this shard's buckets to each process of each target
        shard (`primary|standby`) that takes some; each stream's copy keeps
        its thread busy `pace` of the time at most (0: `default_pace()`)."""
        if not targets:
            raise errors.InvalidArgumentError("STREAM needs the next layout's addresses")
        pace = pace or default_pace()
        if not 0 < pace <= 1:
            raise errors.InvalidArgumentError(f"a re-shard's pace must be in (0, 1], got {pace}")
        first, end = self._shard.first_bucket, self._shard.end_bucket
        with self._lock:
            self._stop_streams()
            for j, target in enumerate(targets):
                lo, hi = routing.bucket_range(j, len(targets))
                if max(first, lo) >= min(end, hi):
                    continue  # none of this shard's buckets are shard j's
                for process in target.split("|"):
                    stream = _native.Replicator(
                        self._shard, process, auth_token=self._auth_token,
                        io_timeout_ms=self._io_timeout_ms, range_stream=True, copy_pace=pace,
                    )  # fmt: skip
                    stream.start()
                    self._streams.append(stream)
        log.info("re-shard: streaming buckets [%d, %d) to %s", first, end, ", ".join(targets))

    def hold(self, hold: bool) -> None:
        """Refuses writes (returns once none is being applied) and pauses
        the stream to this shard's standby once that holds them all, or
        takes them again; then the layout switched from (if any) is dropped:
        the re-shard is done."""
        with self._lock:
            self._held = hold
            if not hold:
                self._plan = ("", "")
        if hold:
            self._data_server.hold_writes(True, timeout_ms=self._io_timeout_ms)
            self._pause_standbys(True)
            return
        self._pause_standbys(False)
        self._data_server.hold_writes(False)
        self._shard.drop_previous_layout()

    def switch(self, layout_epoch: int, layout: str) -> None:
        """Serves the prepared shard from now on. Writes held stay held
        until RELEASE: the coordinator releases them once every process
        switched."""
        with self._lock:
            self._stop_streams()
            self._data_server.switch_layout(layout_epoch, layout)
        index, count = self._shard.shard_index, self._shard.num_shards
        if index < count:
            log.info(
                "re-shard: serving shard %d of %d at layout epoch %d", index, count, layout_epoch
            )
        else:  # left out of the new layout: it serves no bucket
            log.info(
                "re-shard: left out of layout epoch %d (%d shards): serving no bucket; stop it "
                "once the re-shard is done", layout_epoch, count,
            )  # fmt: skip

    def undo(self, layout_epoch: int, layout: str) -> None:
        """Serves the layout switched from again (another process could not
        switch; writes are still held, so nothing written is lost), as
        layout `layout_epoch` of `layout`: newer than the one switched to,
        so clients that learned that one learn this (a process that did not
        switch takes the epoch too)."""
        with self._lock:
            reverted = self._data_server.revert_layout(layout_epoch, layout)
        log.info(
            "re-shard: %s at layout epoch %d",
            "switched back" if reverted else "nothing to switch back", layout_epoch,
        )  # fmt: skip

    def abort(self) -> None:
        """Stops the streams, drops what was prepared, takes writes again."""
        with self._lock:
            under_way = bool(self._streams or self._held or self._plan[1])
            under_way |= self._data_server.reshard_prepared is not None
            self._stop_streams()
            self._data_server.reshard_clear()
            self._held = False
            self._plan = ("", "")
        self._pause_standbys(False)
        self._data_server.hold_writes(False)
        if under_way:  # also called at every takeover, where mostly none was
            log.info("re-shard: aborted on shard %d", self._shard.shard_index)

    def status(self) -> dict[str, Any]:
        prepared = self._data_server.reshard_prepared
        with self._lock:
            streams = [s.status() for s in self._streams]
            held = self._held
            plan = self._plan
            holder, last, lease = self._holder if plan[1] else ("", 0.0, 0.0)
        return {
            "coordinator": holder,
            "coordinator_idle_s": time.monotonic() - last if holder else 0.0,
            "lease_s": lease,
            "prepared": prepared is not None,
            "shard_index": prepared[0] if prepared else 0,
            "num_shards": prepared[1] if prepared else 0,
            "streams": streams,
            "layout_epoch": self._shard.layout_epoch,
            "layout": self._shard.layout_addresses,
            "writes_held": held,
            "switched": self._shard.has_previous_layout,
            "plan_from": plan[0],
            "plan_to": plan[1],
            "standby": bool(self._data_server.standby),
        }

    def describe(self) -> str:
        """This process's part in a re-shard under way, in words ("": none)."""
        s = self.status()
        if not s["plan_to"]:
            return ""
        parts = [
            f"prepares shard {s['shard_index']} of {s['num_shards']}" if s["prepared"] else "",
            "writes held" if s["writes_held"] else "",
            f"switched to layout epoch {s['layout_epoch']}" if s["switched"] else "",
            f"{len(s['streams'])} range streams" if s["streams"] else "",
        ]
        return "; ".join(
            [p for p in parts if p] + [f"re-shard from {s['plan_from']} to {s['plan_to']}"]
        )

    def close(self) -> None:
        with self._lock:
            self._stop_streams()

    def _pause_standbys(self, pause: bool) -> None:
        if self._standbys is not None:
            self._standbys.pause(pause)

    def _stop_streams(self) -> None:
        for stream in self._streams:
            stream.stop()
        self._streams = []
