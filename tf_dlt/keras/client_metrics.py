"""ClientMetrics: a Keras callback reporting the trainer's side of the
tables: pulls and pushes, rows, payload bytes, latency and pushes in flight,
per epoch into the Keras logs (History, later callbacks) and, with a
`log_dir`, as TensorBoard scalars."""

from __future__ import annotations

import time
from typing import Any

import keras
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from tf_dlt import dlt_ops as ops
from tf_dlt import latency
from tf_dlt.keras.walk import model_clients

_COUNTS = ("pulls", "pulled_rows", "pull_bytes", "pull_errors", "pushes", "pushed_rows",
           "push_bytes", "push_errors", "pulls_ahead", "pulls_ahead_used", "pulls_ahead_dropped",
           "pulled_ahead_stale_rows", "pulled_ahead_refreshed_rows", "cache_hits",
           "cache_misses", "cache_fills", "cache_refreshes", "cache_evictions",
           "cache_applied_rows", "cache_bytes_saved")  # fmt: skip
# Hot-row caches now (summed over the tables), not per interval.
_GAUGES = ("cache_rows", "cache_bytes", "cache_capacity_bytes")
# Latency histograms ("<kind>_latency" in client_stats): pulls and pushes on
# the wire, whole lookups (what a training step waits for: a lookup whose rows
# were pulled ahead is short); waits ("<kind>" there): for a worker thread,
# and of a push for admission (backpressure on the step); and the age of the
# oldest row each cached lookup served.
_LATENCIES = ("pull", "push", "lookup")
_WAITS = ("worker_wait", "push_wait")
_HISTOGRAMS = (*_WAITS, "cache_staleness")


# What the Keras logs (and the progress bar) get by default: the step's wait
# for rows, the traffic, errors; and, where used, the pulls ahead and caches.
SUMMARY = ("dlt_lookup_p50_ms", "dlt_lookup_s", "dlt_pull_mb_per_s", "dlt_push_mb_per_s",
           "dlt_pull_errors", "dlt_push_errors")  # fmt: skip
_SUMMARY_IF_USED = {
    "dlt_pulls_ahead_used": "dlt_pulls_ahead",
    "dlt_cache_hit_rate": "dlt_cache_rows",
}

# Every name `summarize` gives: a list of names given as `logs` must be of
# these.
NAMES = frozenset(
    [f"dlt_{k}" for k in (*_COUNTS, *_GAUGES)]
    + [f"dlt_{kind}_p{q}_ms" for kind in _LATENCIES for q in (50, 99)]
    + [f"dlt_{kind}_p99_ms" for kind in _HISTOGRAMS]
    + [f"dlt_{name}_s" for name in ("lookup", *_WAITS)]
    + ["dlt_pull_mb_per_s", "dlt_push_mb_per_s", "dlt_pushes_in_flight", "dlt_cache_hit_rate",
       "dlt_cache_max_staleness_steps"]
)  # fmt: skip

_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()


def summarize(
    now: dict[str, Any], before: dict[str, Any] | None, seconds: float
) -> dict[str, float]:
    """Log entries for the interval between two `client_stats` snapshots."""

    def delta(key: str) -> float:
        return float(now[key] - (before[key] if before else 0))

    def buckets(key: str) -> list[int]:
        counts = now[key]["buckets"]
        return latency.difference(counts, before[key]["buckets"]) if before else counts

    out = {f"dlt_{k}": delta(k) for k in _COUNTS}
    for kind in _LATENCIES:
        out[f"dlt_{kind}_p50_ms"] = latency.quantile_us(buckets(f"{kind}_latency"), 0.5) / 1000
        out[f"dlt_{kind}_p99_ms"] = latency.quantile_us(buckets(f"{kind}_latency"), 0.99) / 1000
    for kind in _HISTOGRAMS:
        out[f"dlt_{kind}_p99_ms"] = latency.quantile_us(buckets(kind), 0.99) / 1000
    # Seconds summed: how long remote lookups took (steps waiting for rows),
    # pushes waited for admission, and calls waited for a worker thread.
    for key, name in (("lookup_latency", "lookup"), *((k, k) for k in _WAITS)):
        out[f"dlt_{name}_s"] = (now[key]["sum_us"] - (before[key]["sum_us"] if before else 0)) / 1e6
    out["dlt_pull_mb_per_s"] = out["dlt_pull_bytes"] / 1e6 / max(seconds, 1e-9)
    out["dlt_push_mb_per_s"] = out["dlt_push_bytes"] / 1e6 / max(seconds, 1e-9)
    out["dlt_pushes_in_flight"] = float(now["pushes_in_flight"] + now["pushes_waiting"])
    for key in _GAUGES:
        out[f"dlt_{key}"] = float(now[key])
    # Of the distinct ids the cached tables were asked for, the share served
    # from the cache; the oldest row any lookup served, in lookups.
    asked = out["dlt_cache_hits"] + out["dlt_cache_misses"]
    out["dlt_cache_hit_rate"] = out["dlt_cache_hits"] / asked if asked else 0.0
    out["dlt_cache_max_staleness_steps"] = float(now["cache_max_staleness_steps"])
    return out


def _merge(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums the snapshots of several clients."""
    merged: dict[str, Any] = {
        k: sum(s[k] for s in stats)
        for k in (*_COUNTS, *_GAUGES, "pushes_in_flight", "pushes_waiting")
    }
    merged["cache_max_staleness_steps"] = max(s["cache_max_staleness_steps"] for s in stats)
    for kind in (*(f"{k}_latency" for k in _LATENCIES), *_HISTOGRAMS):
        merged[kind] = {
            "buckets": [sum(col) for col in zip(*(s[kind]["buckets"] for s in stats), strict=True)],
            "sum_us": sum(s[kind]["sum_us"] for s in stats),
        }
    return merged


def chosen(values: dict[str, float], logs: str | list[str] | tuple[str, ...]) -> dict[str, float]:
    """The entries of `values` that `logs` names: "summary" (SUMMARY, and
    the pulls ahead and cache hit rate where they were used), "all", or
    names."""
    if logs == "all":
        return values
    if logs == "summary":
        names = [*SUMMARY, *(k for k, used in _SUMMARY_IF_USED.items() if values.get(used))]
    else:
        names = list(logs)
    return {name: values[name] for name in names if name in values}


class ClientMetrics(keras.callbacks.Callback):  # type: ignore[misc]
    """Adds the trainer's table traffic of each epoch to the Keras logs. By
    default a summary (`logs="summary"`: `dlt_lookup_p50_ms`,
    `dlt_lookup_s`, `dlt_pull_mb_per_s`, `dlt_push_mb_per_s`,
    `dlt_pull_errors`, `dlt_push_errors`, and `dlt_pulls_ahead_used` /
    `dlt_cache_hit_rate` where pulls ahead / caches are used); `logs="all"`
    (or a list of names) for more. TensorBoard (`log_dir`) and `last` (the
    last epoch's values) always get all of them:
    `dlt_pulls`, `dlt_pulled_rows`, `dlt_pull_bytes`, `dlt_pull_errors`, the
    same for pushes, `dlt_pull_p50_ms` / `_p99_ms` (and push), whole remote
    lookups as `dlt_lookup_p50_ms` / `_p99_ms` and `dlt_lookup_s` (seconds
    summed), waits for a worker thread and of pushes for admission
    (`dlt_worker_wait_s`, `dlt_push_wait_s` and their `_p99_ms`), the
    pulls ahead (`dlt_pulls_ahead`, `dlt_pulls_ahead_used`,
    `dlt_pulls_ahead_dropped`, `dlt_pulled_ahead_stale_rows`,
    `dlt_pulled_ahead_refreshed_rows`), the
    hot-row caches (`dlt_cache_hits` and `dlt_cache_misses` in distinct ids
    per lookup, `dlt_cache_hit_rate`, `dlt_cache_bytes_saved` (pull bytes
    the hits did not cost), `dlt_cache_fills`, `dlt_cache_refreshes`,
    `dlt_cache_evictions`, `dlt_cache_applied_rows` (own pushed rows applied
    locally), `dlt_cache_rows`, `dlt_cache_bytes` and
    `dlt_cache_capacity_bytes` now, the staleness of the oldest row a lookup
    served as `dlt_cache_staleness_p99_ms`, and
    `dlt_cache_max_staleness_steps`),
    `dlt_pull_mb_per_s` / `dlt_push_mb_per_s` and `dlt_pushes_in_flight` (at
    the end of the epoch). Place it before callbacks that should see them.

    Args:
        log_dir: also write these as TensorBoard scalars here: "epoch_<name>"
            per epoch, "batch_<name>" every `every_n_batches` batches (step:
            the batch count) when given.
        every_n_batches: TensorBoard scalars every n training batches.
        logs: what goes into the Keras logs (and so the progress bar and
            History): "summary", "all", or a list of the names above.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        every_n_batches: int | None = None,
        logs: str | list[str] | tuple[str, ...] = "summary",
    ) -> None:
        super().__init__()
        if every_n_batches is not None and every_n_batches < 1:
            raise ValueError(f"every_n_batches must be >= 1, got {every_n_batches}")
        if isinstance(logs, str) and logs not in ("summary", "all"):
            raise ValueError(f'logs must be "summary", "all" or a list of names, got {logs!r}')
        if not isinstance(logs, str) and (unknown := sorted(set(logs) - NAMES)):
            raise ValueError(f"logs names no metric {unknown}: the names are {sorted(NAMES)}")
        if every_n_batches is not None and not log_dir:
            raise ValueError("every_n_batches writes TensorBoard scalars: give log_dir too")
        self.logs = logs
        # Every value of the last epoch (whatever `logs` shows).
        self.last: dict[str, float] = {}
        self.log_dir = log_dir
        self.every_n_batches = every_n_batches
        self._writer: Any = None
        self._epoch_start: tuple[dict[str, Any], float] | None = None
        self._batch_start: tuple[dict[str, Any], float] | None = None
        self._step = 0

    def _snapshot(self) -> tuple[dict[str, Any], float]:
        clients = model_clients(self.model)
        stats = [ops.client_stats(c) for c in clients]
        return (_merge(stats) if stats else {}), time.monotonic()

    def _interval(
        self, start: tuple[dict[str, Any], float] | None
    ) -> tuple[dict[str, float], tuple[dict[str, Any], float]]:
        now = self._snapshot()
        if not now[0]:
            return {}, now
        before, t0 = start if start is not None and start[0] else (None, now[1])
        return summarize(now[0], before, now[1] - t0), now

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if self.log_dir and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        self._epoch_start = self._batch_start = self._snapshot()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._step += 1
        if self._writer is None or not self.every_n_batches or self._step % self.every_n_batches:
            return
        values, self._batch_start = self._interval(self._batch_start)
        self._write(values, self._step, "batch_")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        values, self._epoch_start = self._interval(self._epoch_start)
        self.last = values
        if logs is not None:
            logs.update(chosen(values, self.logs))
        self._write(values, epoch, "epoch_")

    def _write(self, values: dict[str, float], step: int, prefix: str) -> None:
        if self._writer is None or not values:
            return
        with self._writer.as_default():
            for name, value in values.items():
                # tf.summary.scalar without TensorBoard installed: the same
                # event, tagged for TensorBoard's scalars plugin.
                tf.summary.write(
                    prefix + name,
                    tf.constant(value, tf.float32),
                    step=step,
                    metadata=_SCALAR_METADATA,
                )
        self._writer.flush()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
