"""Prometheus metrics of a shard server (prometheus_client), read on each
scrape from the shard's own counters, so nothing is counted twice:

- tf_dlt_table_rows / tf_dlt_table_bytes {table}: gauges (rows in both tiers;
  RAM bytes);
- tf_dlt_table_tier_rows / tf_dlt_table_tier_bytes {table, tier="ram"|"disk"}:
  where the rows live; tf_dlt_table_promotions_total,
  tf_dlt_table_demotions_total, tf_dlt_table_disk_reads_total,
  tf_dlt_table_disk_updates_total {table} (rates in PromQL);
  tf_dlt_table_tier_error {table, error}: 1 while the disk tier fails;
  tf_dlt_memory_budget_bytes and tf_dlt_resident_bytes (gauges, with
  --memory-budget); tf_dlt_staged_bytes (gauge: tables a load staged, or
  replaced and keeps for a rollback);
- tf_dlt_table_rows_admitted_total, _refused_total, _expired_total,
  _evicted_total, _shrunk_total {table}: what each table's memory policy did
  (rows made by training; pushed ids not admitted; rows removed by ttl
  sweeps, by max_rows eviction, by shrink);
- tf_dlt_pulls_total, tf_dlt_pushes_total, tf_dlt_{pulled,pushed,assigned}_rows_total,
  tf_dlt_repeated_pushes_total (pushes sent again and not applied twice),
  tf_dlt_standby_rounds_dropped_total (a standby's replication rounds past
  its --max-buffered-bytes, dropped and copied afresh),
  tf_dlt_bytes_{received,sent}_total: counters (per-second rates in PromQL:
  rate(tf_dlt_pulls_total[1m]));
- tf_dlt_errors_total {code}: errors answered, by canonical code;
- tf_dlt_pull_latency_seconds / tf_dlt_push_latency_seconds: histograms;
- tf_dlt_save_seconds / tf_dlt_load_seconds: summaries (count, sum) of
  checkpoint saves and loads, tf_dlt_last_{save,load}_seconds gauges;
- tf_dlt_connections_open, tf_dlt_connections_authenticated,
  tf_dlt_connections_waiting (for buffer memory), tf_dlt_buffered_bytes
  (gauges); tf_dlt_connections_accepted_total,
  tf_dlt_connections_refused_total (Hello past --max-connections),
  tf_dlt_connections_evicted_total (closed before their Hello for a newer
  connection), tf_dlt_connection_timeouts_total {kind="hello"|"idle"|"io"};
- tf_dlt_connection_limit, tf_dlt_worker_threads (gauges);
- tf_dlt_shard_info {shard, num_shards}: 1;
- a read-only shard: tf_dlt_read_only (1), tf_dlt_serving_checkpoint_info
  {path, save_id}: 1; following a directory also tf_dlt_follow_current
  (1 when serving its newest committed checkpoint), tf_dlt_follow_lag_seconds
  (how long a newer one has waited) and tf_dlt_deltas_applied_total;
- replication (docs/replication.md): tf_dlt_standby (1 while this shard is
  a standby), tf_dlt_takeovers_total; a primary, per standby {standby}:
  tf_dlt_standby_connected, tf_dlt_standby_caught_up,
  tf_dlt_replication_lag_seconds (async), tf_dlt_replicated_rows_total.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import ThreadingWSGIServer

from tf_dlt import latency

if TYPE_CHECKING:
    from tf_dlt.server.service import ShardAdminServicer

# Every 4th native bucket: powers of two from 1 us to ~2 h (32 buckets).
_EVERY = 4


def _histogram(name: str, doc: str, buckets: list[int], sum_us: int) -> HistogramMetricFamily:
    cumulative, total, out = 0, sum(buckets), []
    for i, count in enumerate(buckets):
        cumulative += count
        if i % _EVERY == 0 and i > 0:
            out.append((repr(latency.BOUNDS_US[i] / 1e6), cumulative))
    out.append(("+Inf", total))
    return HistogramMetricFamily(name, doc, buckets=out, sum_value=sum_us / 1e6)


class ShardCollector:
    """Collects one shard's metrics from its servicer on every scrape."""

    def __init__(self, servicer: ShardAdminServicer) -> None:
        self._servicer = servicer

    def collect(self) -> Iterator[Metric]:
        s: dict[str, Any] = self._servicer.snapshot()
        info = GaugeMetricFamily("tf_dlt_shard_info", "This shard", labels=["shard", "num_shards"])
        info.add_metric([str(s["shard_index"]), str(s["num_shards"])], 1)
        yield info
        yield GaugeMetricFamily(
            "tf_dlt_read_only", "1 when the shard serves checkpoints read-only",
            value=int(s["read_only"]),
        )  # fmt: skip
        if s["read_only"]:
            serving = GaugeMetricFamily(
                "tf_dlt_serving_checkpoint_info", "The checkpoint a read-only shard serves",
                labels=["path", "save_id"],
            )  # fmt: skip
            serving.add_metric([s.get("serving_path", ""), s.get("serving_save_id", "")], 1)
            yield serving
        if s.get("follow_dir"):
            yield GaugeMetricFamily(
                "tf_dlt_follow_current", "1 when serving the newest committed checkpoint",
                value=int(s["follow_current"]),
            )  # fmt: skip
            yield GaugeMetricFamily(
                "tf_dlt_follow_lag_seconds", "How long a newer committed checkpoint has waited",
                value=s["follow_lag_seconds"],
            )  # fmt: skip
            yield CounterMetricFamily(
                "tf_dlt_deltas_applied", "Deltas applied in place", value=s["deltas_applied"]
            )
        yield from _replication_metrics(s)
        rows = GaugeMetricFamily("tf_dlt_table_rows", "Rows of each table", labels=["table"])
        size = GaugeMetricFamily("tf_dlt_table_bytes", "Bytes of each table", labels=["table"])
        policy = {
            key: CounterMetricFamily(f"tf_dlt_table_rows_{key}", doc, labels=["table"])
            for key, doc in (
                ("admitted", "Rows made by training (admitted ids)"),
                ("refused", "Pushed ids not admitted (per id and push)"),
                ("expired", "Rows removed by ttl sweeps"),
                ("evicted", "Rows evicted to stay within max_rows"),
                ("shrunk", "Rows removed by shrink"),
            )
        }
        for t in s["tables"]:
            rows.add_metric([t["name"]], t["rows"])
            size.add_metric([t["name"]], t["bytes"])
            for key, family in policy.items():
                family.add_metric([t["name"]], t[key])
        yield rows
        yield size
        yield from policy.values()
        yield from _tier_metrics(s)
        c = s["counters"]
        for name, key, doc in (
            ("tf_dlt_pulls", "pulls", "Pull requests served"),
            ("tf_dlt_pushes", "pushes", "Push requests served"),
            ("tf_dlt_pulled_rows", "pulled_rows", "Rows pulled"),
            ("tf_dlt_pushed_rows", "pushed_rows", "Rows pushed"),
            ("tf_dlt_assigned_rows", "assigned_rows", "Rows assigned"),
            ("tf_dlt_repeated_pushes", "repeated_pushes",
             "Pushes sent again, answered without applying them twice"),
            ("tf_dlt_standby_rounds_dropped", "standby_rounds_dropped",
             "Replication rounds past this standby's buffer, dropped and copied afresh"),
            ("tf_dlt_bytes_received", "bytes_in", "Data-plane bytes received"),
            ("tf_dlt_bytes_sent", "bytes_out", "Data-plane bytes sent"),
            ("tf_dlt_connections_accepted", "connections_accepted", "Connections accepted"),
            ("tf_dlt_connections_refused", "connections_refused", "Hellos past the cap"),
            ("tf_dlt_connections_evicted", "connections_evicted",
             "Connections closed before their Hello to make room"),
        ):  # fmt: skip
            yield CounterMetricFamily(name, doc, value=c[key])
        timeouts = CounterMetricFamily(
            "tf_dlt_connection_timeouts", "Connections closed by a timeout", labels=["kind"]
        )
        for kind in ("hello", "idle", "io"):
            timeouts.add_metric([kind], c[f"{kind}_timeouts"])
        yield timeouts
        for name, value, doc in (
            ("tf_dlt_connections_open", c["connections_open"], "Data-plane connections open"),
            ("tf_dlt_connections_authenticated", c["connections_authenticated"],
             "Connections that said Hello"),
            ("tf_dlt_connections_waiting", c["connections_waiting"],
             "Connections waiting for buffer memory"),
            ("tf_dlt_buffered_bytes", c["buffered_bytes"], "Bytes of frames and replies held"),
            ("tf_dlt_connection_limit", s["max_connections"], "Authenticated connections allowed"),
            ("tf_dlt_worker_threads", s["worker_threads"], "Data-plane worker threads"),
        ):  # fmt: skip
            yield GaugeMetricFamily(name, doc, value=value)
        errors = CounterMetricFamily("tf_dlt_errors", "Errors answered, by code", labels=["code"])
        for code, count in sorted(s["errors"].items()):
            errors.add_metric([code], count)
        yield errors
        for kind in ("pull", "push"):
            yield _histogram(
                f"tf_dlt_{kind}_latency_seconds",
                f"{kind.capitalize()} service time on the shard",
                c[f"{kind}_latency"],
                c[f"{kind}_latency_sum_us"],
            )
        for kind in ("save", "load"):
            count, total, last = (
                s[f"{kind}s"],
                s[f"{kind}_seconds_total"],
                s[f"last_{kind}_seconds"],
            )
            yield SummaryMetricFamily(
                f"tf_dlt_{kind}_seconds", f"Checkpoint {kind} durations",
                count_value=count, sum_value=total,
            )  # fmt: skip
            yield GaugeMetricFamily(
                f"tf_dlt_last_{kind}_seconds", f"Duration of the last checkpoint {kind}", value=last
            )


def _tier_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    """Rows and bytes per tier, moves between them and disk reads."""
    tier_rows = GaugeMetricFamily(
        "tf_dlt_table_tier_rows", "Rows of each table per tier", labels=["table", "tier"]
    )
    tier_bytes = GaugeMetricFamily(
        "tf_dlt_table_tier_bytes", "Bytes of each table per tier", labels=["table", "tier"]
    )
    moves = {
        key: CounterMetricFamily(f"tf_dlt_table_{key}", doc, labels=["table"])
        for key, doc in (
            ("promotions", "Cold rows a pull or push moved into RAM"),
            ("demotions", "Rows moved to the disk tier"),
            ("disk_updates", "Pushes applied to cold rows on disk (RAM full, the row not hot)"),
            ("disk_reads", "Row slots read from the disk tier"),
            ("disk_read_errors", "Disk tier reads that failed (I/O errors, short reads)"),
            ("disk_write_errors", "Disk tier writes that failed (I/O errors, a full disk)"),
        )
    }
    failing = GaugeMetricFamily(
        "tf_dlt_table_tier_error", "1 while a table's disk tier fails", labels=["table", "error"]
    )
    for t in s["tables"]:
        tier_rows.add_metric([t["name"], "ram"], t["ram_rows"])
        tier_rows.add_metric([t["name"], "disk"], t["disk_rows"])
        tier_bytes.add_metric([t["name"], "ram"], t["ram_bytes"])
        tier_bytes.add_metric([t["name"], "disk"], t["disk_bytes"])
        for key, family in moves.items():
            family.add_metric([t["name"]], t[key])
        if t["tier_error"]:
            failing.add_metric([t["name"], t["tier_error"]], 1)
    yield tier_rows
    yield tier_bytes
    yield from moves.values()
    yield failing
    memory = s["memory"]
    if memory["budget"]:
        yield GaugeMetricFamily(
            "tf_dlt_memory_budget_bytes", "The shard's memory budget", value=memory["budget"]
        )
        yield GaugeMetricFamily(
            "tf_dlt_resident_bytes", "The shard's resident memory", value=memory["resident"]
        )
    yield GaugeMetricFamily(
        "tf_dlt_staged_bytes",
        "Bytes of tables a load staged, or replaced and keeps for a rollback",
        value=memory["staged_bytes"],
    )


# A scrape is one short request: a connection that sends or takes nothing
# for this long (or is not done within 3 times it) is closed, and at most
# this many are served at once (more are closed at once). 300 half-sent
# requests held 300 threads until their peers left, and a peer that
# vanished without a FIN held its thread for good.
SCRAPE_TIMEOUT_S = 10.0
MAX_SCRAPES = 64


class _Handler(WSGIRequestHandler):
    timeout = SCRAPE_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # quiet, as prometheus_client's own server is


class _Server(ThreadingWSGIServer):
    """prometheus_client's threaded server, with at most MAX_SCRAPES at once,
    each cut off 3 x SCRAPE_TIMEOUT_S after it began (the handler's timeout
    is per receive: one byte every 9 s held a slot for good)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before the base binds: a failed bind calls server_close.
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self._lock = threading.Lock()
        self._began: dict[Any, float] = {}  # guarded by _lock
        self._closed = threading.Event()
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._cut_late, name="dlt-metrics-deadline", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._began[request] = time.monotonic()
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._began.pop(request, None)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that timed out or went is no server error (each printed a
        # traceback); anything else is, as the base class says.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()

    def _cut_late(self) -> None:
        while not self._closed.wait(1.0):
            cutoff = time.monotonic() - 3 * SCRAPE_TIMEOUT_S
            with self._lock:
                late = [r for r, began in self._began.items() if began < cutoff]
            for request in late:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)


def serve(servicer: ShardAdminServicer, bind: str, port: int) -> tuple[Any, int]:
    """Starts the /metrics HTTP endpoint; returns ((server, its thread),
    bound port)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ShardCollector(servicer))
    try:
        family = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_MetricsServer", (_Server,), {"address_family": family})
        server: Any = make_server(
            bind, port, make_wsgi_app(registry), server_class, handler_class=_Handler
        )
    except OSError as e:
        raise OSError(
            e.errno, f"cannot serve metrics on {bind}:{port} (--metrics-port): {e.strerror}"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="dlt-metrics", daemon=True)
    thread.start()
    return (server, thread), int(server.server_port)


def _replication_metrics(s: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "tf_dlt_standby", "1 while this shard is a standby", value=int(s["role"] == "standby")
    )
    yield CounterMetricFamily(
        "tf_dlt_takeovers", "Times this shard took over from its primary",
        value=s.get("takeovers", 0),
    )  # fmt: skip
    insync = s.get("insync", {}).get("members", "") if s["role"] == "primary" else ""
    yield GaugeMetricFamily(
        "tf_dlt_insync_standbys",
        "A primary's standbys holding every acknowledged write (its in-sync set)",
        value=len([m for m in insync.split("|") if m]),
    )
    families = {
        key: (kind(name, doc, labels=["standby"]), key)
        for kind, name, key, doc in (
            (GaugeMetricFamily, "tf_dlt_standby_connected", "connected",
             "1 while the standby is connected"),
            (GaugeMetricFamily, "tf_dlt_standby_caught_up", "caught_up",
             "1 once every table was copied to the standby since it connected"),
            (GaugeMetricFamily, "tf_dlt_replication_lag_seconds", "lag_seconds",
             "Async: how long the oldest acknowledged write not on the standby waited"),
            (CounterMetricFamily, "tf_dlt_replicated_rows", "rows_sent",
             "Rows sent to the standby"),
        )
    }  # fmt: skip
    for standby in s["standbys"]:
        for family, key in families.values():
            family.add_metric([standby["standby"]], float(standby[key]))
    for family, _ in families.values():
        yield family
