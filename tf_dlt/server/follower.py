"""A read-only shard following a checkpoint directory (`tf-dlt server
--read-only --follow DIR`): it loads the newest committed chain there, then
applies every new delta as training commits it, so serving tracks training
within one delta interval without any load on the training shards.

A delta extending the chain served is applied in place, one checkpoint at a
time, each verified whole before it changes anything (a pull during an
apply may see part of that delta's rows). Any other newer checkpoint (a new
full base, another chain) is loaded into staged tables and installed in one
step. Whatever fails, the shard keeps serving what it has and says why
(`status()`, Stats, metrics and the health service "tf_dlt.follow")."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from tf_dlt import _native, errors
from tf_dlt.checkpoint import chain, shard_files
from tf_dlt.checkpoint import manifest as manifest_lib
from tf_dlt.server.repeated import Repeated

log = logging.getLogger("tf_dlt.server")
# A newest checkpoint that failed is read again after a pause that doubles
# from the poll interval up to this (it may be gigabytes, on shared storage);
# a newer one is read at the next poll.
MAX_RETRY_PAUSE_S = 60.0
# Checkpoints older than the newest read in one poll when the newest fails.
_FALLBACKS = 1


@dataclasses.dataclass
class FollowStatus:
    """What a follower serves and how current it is."""

    directory: str
    serving_path: str = ""
    serving_save_id: str = ""
    current: bool = False  # serving the newest committed checkpoint of the directory
    lag_seconds: float = 0.0  # how long a newer committed checkpoint has waited
    error: str = ""  # why it is not current ("" when it is)
    deltas_applied: int = 0


class Follower:
    """Keeps `shard` serving the newest checkpoint chain in `directory`.

    Args:
        shard: the read-only shard's native tables.
        directory: where training commits checkpoints (each in a
            subdirectory, or model checkpoints with their tables/).
        interval_s: how often the directory is read.
        on_change: called after every change of status.
        reading: checks of the checkpoints a poll reads, for its length
            (`ShardService.reading`): each raises for a path it may not
            read and returns what to read it through.
    """

    def __init__(
        self,
        shard: _native.Shard,
        directory: str,
        interval_s: float = 5.0,
        on_change: Callable[[FollowStatus], None] | None = None,
        reading: Callable[[], AbstractContextManager[Callable[[str], str]]] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._shard = shard
        self._interval_s = interval_s
        self._on_change = on_change
        self._reading = reading or (lambda: contextlib.nullcontext(lambda path: path))
        self._status = FollowStatus(directory)
        self._lock = threading.Lock()  # one poll at a time; guards _status
        # What status() returns: _status as last published (a poll holds
        # _lock while it reads and applies checkpoints, for minutes maybe).
        self._published = FollowStatus(directory)
        self._published_lock = threading.Lock()
        # A checkpoint that does not load is tried again and again: said
        # once a minute, not at each try (each newer one that fails, at once).
        self._complaints = Repeated(log, every_s=60.0)
        # The save id of the newest checkpoint that failed, when it is read
        # again and the pause before that.
        self._failing = ""
        self._retry_at = 0.0
        self._retry_pause_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def status(self) -> FollowStatus:
        with self._published_lock:
            return dataclasses.replace(self._published)

    def start(self) -> Follower:
        """Brings the shard to the newest checkpoint now (serving whatever
        it managed on failure), then follows on a background thread."""
        self.poll()
        self._thread = threading.Thread(target=self._run, name="dlt-follow", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll()  # never raises: failures go to the status

    def poll(self) -> FollowStatus:
        """Reads the directory once and catches up as far as it can; any
        failure is reported in the status, never raised."""
        with self._lock:
            try:
                with errors.storage_errors(f"following {self._status.directory}"):
                    self._poll()
            except Exception as e:  # noqa: BLE001 - a follower keeps serving and says why
                self._complaints.log(
                    f"failed {type(e).__name__}", logging.ERROR, "following %s failed",
                    self._status.directory, exc_info=True,
                )  # fmt: skip
                self._status.error = f"{type(e).__name__}: {e}"
                self._status.current = False
                self._changed()
            return dataclasses.replace(self._status)

    def _poll(self) -> None:
        status = self._status
        found = chain.find(status.directory, whole_models=False)  # the tables are what it serves
        served = status.serving_save_id
        # A checkpoint served that is gone from the directory, with none
        # newer there, was withdrawn (a bad model rolled back): the newest
        # there is served instead, as a follower started now would serve it.
        # (One saved again at its path is newer.)
        newer = [c for c in found if _save_id(c) > served]
        withdrawn = bool(found and served and not newer) and served not in _save_ids(found)
        if withdrawn:
            newer = found
        if not newer:
            status.error = "" if found else f"no committed checkpoint in {status.directory}"
            self._complaints.clear()
            self._failing = ""
            status.current, status.lag_seconds = bool(found), 0.0
            self._changed()
            return
        head = _save_id(newer[-1])
        status.current = False  # said while it reads (a large chain, a slow store)
        status.lag_seconds = _lag(newer, served)
        if not withdrawn and head == self._failing and time.monotonic() < self._retry_at:
            self._changed()
            return  # it failed lately: read again once its pause ends
        if withdrawn:
            status.error = f"{status.serving_path} was withdrawn from {status.directory}"
            log.warning("following %s: %s", status.directory, status.error)
        self._changed()
        failures = []
        for candidate in reversed(newer):  # the newest that can be reached
            if not withdrawn and _save_id(candidate) <= status.serving_save_id:
                break  # an older one than what the failed one's links brought
            try:
                with self._reading() as allow:
                    links = manifest_lib.resolve_chain(candidate.tables, allow)
                    self._catch_up(candidate, links, allow)
            except errors.DltError as e:
                failures.append(f"{candidate.path}: {e.message}")
                # The one before it may load (a file of the newest is
                # damaged): served meanwhile, the newest read again after
                # its pause. No further back: a failure they all share (a
                # damaged base, a shard too small) read every one at every
                # try.
                if len(failures) < _FALLBACKS + 1:
                    continue
            break
        status.current = status.serving_save_id == head
        status.error = "; ".join(failures)
        status.lag_seconds = _lag(newer, status.serving_save_id)
        if status.error:
            # Keyed by the checkpoint tried: a newer one that fails is said at once.
            self._complaints.log(
                head, logging.WARNING, "following %s: %s", status.directory, status.error
            )
            pause = 2 * self._retry_pause_s if head == self._failing else self._interval_s
            self._failing, self._retry_pause_s = head, min(pause, MAX_RETRY_PAUSE_S)
            self._retry_at = time.monotonic() + self._retry_pause_s
        else:
            self._complaints.clear()
            self._failing = ""
        self._changed()

    def _catch_up(
        self,
        head: chain.Checkpoint,
        links: list[manifest_lib.Link],
        allow: Callable[[str], str],
    ) -> None:
        """Moves the shard along `links` to `head`: in place from the
        checkpoint served when the chain extends it, else a staged load."""
        status = self._status
        served = [link.save_id for link in links]
        if status.serving_save_id not in served:
            self._load_staged(head, allow)
            return
        buckets = (self._shard.first_bucket, self._shard.end_bucket)
        for link in links[served.index(status.serving_save_id) + 1 :]:
            tables = {t.name: t for t in self._shard.tables()}
            # Saved by as many shards or fewer, it holds no more for this
            # shard than one of them held: taken whole, max_rows or not.
            whole = shard_files.takes_every_row([link], self._shard)
            start = time.monotonic()
            try:
                shard_files.apply_link(
                    link, tables, self._shard.new_table, buckets, in_use=True, every_row=whole
                )
            except shard_files.WouldEvict:
                # Applied in place it would take a table past its max_rows,
                # evicting rows while the follower reports itself current:
                # a staged load of the head instead, which refuses to drop
                # any (and keeps serving what it served).
                self._load_staged(head, allow)
                return
            self._install(list(tables.values()))
            status.serving_path, status.serving_save_id = link.path, link.save_id
            status.deltas_applied += 1
            log.info("applied %s %s in %.2f s", link.kind, link.path, time.monotonic() - start)
        status.serving_path = head.path

    def _load_staged(self, head: chain.Checkpoint, allow: Callable[[str], str]) -> None:
        """Loads the chain of `head` into staged tables and serves them."""
        result = shard_files.prepare_load(head.tables, self._shard, allow, replace=True)
        self._install(result["staged"])
        status = self._status
        status.serving_path, status.serving_save_id = head.path, str(result["save_id"])
        log.info("serving %s (%d checkpoint(s) loaded)", head.path, result["links"])

    def _install(self, tables: list[_native.Table]) -> None:
        """Makes `tables` the shard's tables: new ones installed, others
        dropped."""
        keep = {t.name for t in tables}
        current = {t.name: t for t in self._shard.tables()}
        self._shard.install_tables([t for t in tables if current.get(t.name) is not t])
        for name in current:
            if name not in keep:
                self._shard.drop_table(name)

    def _changed(self) -> None:
        with self._published_lock:
            self._published = dataclasses.replace(self._status)
        if self._on_change is not None:
            self._on_change(dataclasses.replace(self._status))


def _save_id(checkpoint: chain.Checkpoint) -> str:
    return str(checkpoint.manifest["save_id"])


def _save_ids(found: list[chain.Checkpoint]) -> set[str]:
    return {_save_id(c) for c in found}


def _lag(newer: list[chain.Checkpoint], serving_save_id: str) -> float:
    """How long the oldest of `newer` not yet served has waited (0: none)."""
    waiting = [
        float(c.manifest.get("created_unix", 0.0))
        for c in newer
        if str(c.manifest["save_id"]) > serving_save_id
    ]
    return max(0.0, time.time() - min(waiting)) if waiting else 0.0


def describe(status: FollowStatus) -> dict[str, Any]:
    """The follower's status as Stats and the metrics report it."""
    return {
        "serving_path": status.serving_path,
        "serving_save_id": status.serving_save_id,
        "follow_dir": status.directory,
        "follow_current": status.current,
        "follow_lag_seconds": status.lag_seconds,
        "follow_error": status.error,
        "deltas_applied": status.deltas_applied,
    }
