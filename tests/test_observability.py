"""Observability: Prometheus metrics of a shard move with traffic, the
trainer's ClientMetrics callback reports its side per epoch (logs and
TensorBoard), `tf-dlt stats` prints per-shard and per-table lines, and long
operations show progress."""

from __future__ import annotations

import io
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from prometheus_client.parser import text_string_to_metric_families

import tf_dlt
from tf_dlt.keras import client_metrics
from tf_dlt.layers import Embedding
from tf_dlt.progress import Progress

import frames
from conftest import Cluster, wait_until


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def test_shard_metrics_move_with_traffic(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2, "--metrics-port", "0")
    assert all(port > 0 for port in cluster.metrics_ports)
    before = _scrape(cluster.metrics_ports[0])
    assert (
        before["tf_dlt_pulls_total"] == 0 and before["tf_dlt_shard_info{num_shards=2,shard=0}"] == 1
    )
    with cluster.client() as client:
        client.create_table("m", 8, optimizer="adagrad")
        client.pull("m", np.arange(1000))
        client.push("m", np.arange(100), np.ones((100, 8), np.float32), 0.1)
        client.save(str(tmp_path / "ck"))
    # Requests the Python client would refuse before sending, as raw frames.
    own = int(np.flatnonzero(tf_dlt.routing.shard_of(np.arange(100), 2) == 0)[0])
    host, port = cluster.addresses[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(frames.hello())
        frames.read_frame(sock)
        sock.sendall(frames.pull(2, "missing", 8, [own]))
        assert frames.read_frame(sock)[0] == frames.ERROR
        nan = np.full((1, 8), np.nan, np.float32)
        sock.sendall(frames.push(3, "m", 8, [own], nan, 0.1))
        assert frames.read_frame(sock)[0] == frames.ERROR
        assert _scrape(cluster.metrics_ports[0])["tf_dlt_connections_authenticated"] >= 1
    after = [_scrape(port) for port in cluster.metrics_ports]
    assert sum(a["tf_dlt_table_rows{table=m}"] for a in after) == 1000
    assert all(a["tf_dlt_table_bytes{table=m}"] > 0 for a in after)
    assert sum(a["tf_dlt_pulled_rows_total"] for a in after) == 1000
    assert sum(a["tf_dlt_pushed_rows_total"] for a in after) == 100
    # The memory policy's counters: 1000 rows made by training, none removed.
    assert sum(a["tf_dlt_table_rows_admitted_total{table=m}"] for a in after) == 1000
    for kind in ("refused", "expired", "evicted", "shrunk"):
        assert all(a[f"tf_dlt_table_rows_{kind}_total{{table=m}}"] == 0 for a in after)
    a = after[0]
    assert a["tf_dlt_pulls_total"] >= 1 and a["tf_dlt_pushes_total"] >= 1
    assert a["tf_dlt_pull_latency_seconds_count"] >= 1 and a["tf_dlt_pull_latency_seconds_sum"] > 0
    assert (
        a["tf_dlt_pull_latency_seconds_bucket{le=+Inf}"] == a["tf_dlt_pull_latency_seconds_count"]
    )
    assert a["tf_dlt_bytes_received_total"] > before["tf_dlt_bytes_received_total"]
    after = [_scrape(port) for port in cluster.metrics_ports]
    assert after[0]["tf_dlt_errors_total{code=INVALID_ARGUMENT}"] == 1
    assert after[0]["tf_dlt_errors_total{code=NOT_FOUND}"] == 1
    assert a["tf_dlt_save_seconds_count"] == 1 and a["tf_dlt_last_save_seconds"] > 0
    # Connection gauges and the caps in force; a stranger who never says Hello.
    assert a["tf_dlt_connection_limit"] > 0
    assert a["tf_dlt_worker_threads"] >= 1
    # The raw connection's buffers go when the server has seen it close (a
    # worker's next turn: a scrape just after may still count them).
    wait_until(
        lambda: _scrape(cluster.metrics_ports[0])["tf_dlt_buffered_bytes"] == 0,
        "no bytes buffered once every connection is idle or gone",
    )
    # The client closed its data-plane connections with itself.
    wait_until(
        lambda: _scrape(cluster.metrics_ports[0])["tf_dlt_connections_authenticated"] == 0,
        "no connection left once the client and the raw socket closed",
    )
    assert a["tf_dlt_connection_timeouts_total{kind=hello}"] == 0
    stranger = socket.create_connection((host, int(port)), timeout=10)
    assert frames.closed_by_peer(stranger, timeout=20)  # --hello-timeout: 5 s
    stranger.close()
    with cluster.client() as client:
        removed = client.shrink("m", min_count=1)  # the 900 rows never pushed
    later = _scrape(cluster.metrics_ports[0])
    assert (
        later["tf_dlt_table_rows_shrunk_total{table=m}"]
        + _scrape(cluster.metrics_ports[1])["tf_dlt_table_rows_shrunk_total{table=m}"]
        == removed
        == 900
    )
    assert later["tf_dlt_connection_timeouts_total{kind=hello}"] == 1
    assert later["tf_dlt_connections_accepted_total"] > a["tf_dlt_connections_accepted_total"]


def test_a_restarted_shards_metrics_port_is_the_one_it_serves(
    start_cluster: Callable[..., Cluster],
) -> None:
    """`--metrics-port 0` takes any free port again on a restart:
    LocalCluster kept the dead process's, so a scrape after
    `LocalCluster.restart` failed to connect."""
    cluster = start_cluster(2, "--metrics-port", "0")
    with cluster.client() as client:
        client.create_table("m", 4)
        client.pull("m", np.arange(100))
    cluster.kill(1)
    cluster.restart(1)
    fresh = _scrape(cluster.metrics_ports[1])
    assert fresh["tf_dlt_pulls_total"] == 0  # the restarted process answered
    assert fresh["tf_dlt_shard_info{num_shards=2,shard=1}"] == 1


def test_half_sent_scrapes_hold_a_bounded_number_of_threads(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Each connection to the metrics port had a thread of its own for as
    long as its peer kept it open (300 half-sent requests: 314 threads);
    at most MAX_SCRAPES are served at once now, the rest closed at once,
    and a real scrape gets in once they are gone."""
    from tf_dlt.server import metrics

    cluster = start_cluster(1, "--metrics-port", "0")
    pid, port = cluster.processes[0].pid, cluster.metrics_ports[0]

    def threads() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("Threads:")).split()[1])

    before = threads()
    held = []
    for _ in range(metrics.MAX_SCRAPES + 40):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
        held.append(sock)
    wait_until(lambda: threads() >= before + metrics.MAX_SCRAPES // 2, "the scrapes' threads")
    time.sleep(0.5)
    assert threads() <= before + metrics.MAX_SCRAPES + 2
    for sock in held:
        sock.close()
    wait_until(lambda: _try_scrape(port), "a scrape after the half-sent ones left")


def _try_scrape(port: int) -> bool:
    try:
        return "tf_dlt_pulls_total" in str(_scrape(port))
    except OSError:
        return False


def test_client_metrics_callback_reports_each_epoch(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    inp = keras.Input((3,), dtype="int64")
    emb = Embedding(output_dim=4, is_distributed=True, name="observed")
    model = tf_dlt.transpile(
        keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp)))), cluster.addresses
    )
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 500, size=(64, 3)), rng.normal(size=(64, 1)).astype("float32")
    metrics = tf_dlt.ClientMetrics(log_dir=str(tmp_path / "tb"), every_n_batches=2, logs="all")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[metrics]).history
    assert history["dlt_pushes"] == [8.0, 8.0]  # per epoch, not cumulative
    assert all(p >= 8 for p in history["dlt_pulls"])
    assert all(r > 0 for r in history["dlt_pull_bytes"]) and all(
        r > 0 for r in history["dlt_push_bytes"]
    )
    assert all(v > 0 for v in history["dlt_pull_p50_ms"]) and all(
        v > 0 for v in history["dlt_push_p99_ms"]
    )
    assert history["dlt_pull_errors"] == [0.0, 0.0]
    assert history["dlt_pushes_in_flight"] == [0.0, 0.0]  # flushed at epoch end
    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    tags = {
        (value.tag, event.step)
        for event in tf.compat.v1.train.summary_iterator(str(events))
        for value in event.summary.value
    }
    assert {("epoch_dlt_pushes", 0), ("epoch_dlt_pushes", 1), ("batch_dlt_pull_p50_ms", 2)} <= tags


def test_client_stats_count_pushes_waiting_for_admission_and_workers(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1)
    with cluster.client() as control:
        control.create_table("waits", 4)
    client = tf_dlt.ops.ClientResource(cluster.addresses, max_inflight_pushes=1)
    ids, grads = tf.range(64, dtype=tf.int64), tf.ones([64, 4])
    for _ in range(20):
        tf_dlt.ops.push(client, ids, grads, 0.1, "waits", 4)
    tf_dlt.ops.flush(client)
    stats = tf_dlt.ops.client_stats(client)
    # Every push is admitted once (most after waiting for the one in flight)
    # and runs on a worker thread.
    assert sum(stats["push_wait"]["buckets"]) == 20
    assert sum(stats["worker_wait"]["buckets"]) == 20
    logs = client_metrics.summarize(stats, None, 1.0)
    assert logs["dlt_push_wait_s"] == stats["push_wait"]["sum_us"] / 1e6
    assert logs["dlt_pushes"] == 20


def test_stats_command_prints_shards_and_tables(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2)
    with cluster.client() as client:
        client.create_table("alpha", 4)
        client.pull("alpha", np.arange(50))
    out = subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "stats",
         "--pservers", ",".join(cluster.addresses)],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["shard", "address", "tables", "rows"]
    assert [line.split()[1] for line in lines[1:3]] == cluster.addresses
    assert any(line.split()[:3] == ["alpha", "4", "50"] for line in lines)
    assert lines[0].split()[-1] == "conns/max"
    assert re.fullmatch(r"[1-9]\d*/[1-9]\d*", lines[1].split()[-1])  # connections / the cap
    down = subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "stats", "--pservers", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert down.returncode == 1 and "tf-dlt stats:" in down.stderr
    # An admin port given for the data port: said so, not only "bad magic".
    admin = subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "stats",
         "--pservers", f"127.0.0.1:{cluster.admin_ports[0]}"],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert admin.returncode == 1 and "is this a shard's data port" in admin.stderr, admin.stderr


def test_save_and_load_show_progress(
    start_cluster: Callable[..., Cluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = start_cluster(2)
    with cluster.client() as client:
        client.create_table("p", 4)
        client.pull("p", np.arange(10))
        client.save(str(tmp_path / "ck"), progress=True)
        client.load(str(tmp_path / "ck"), progress=True)
        client.save(str(tmp_path / "quiet"), progress=False)
    err = capsys.readouterr().err
    assert f"saving {tmp_path / 'ck'}: " in err and "2/2 shards" in err
    assert f"loading {tmp_path / 'ck'}: " in err
    assert "quiet" not in err


def test_progress_lines_off_a_terminal() -> None:
    stream = io.StringIO()
    with Progress("uploading t", 4, "rows", enabled=True, stream=stream) as bar:
        bar.update(1)
        bar.update(3, "done")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and "1/4 rows" in lines[0] and lines[1].endswith("done")
    assert Progress("x", 1, "rows", stream=io.StringIO()).enabled is False  # not a tty


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_rich_bar() -> None:
    stream = _Terminal()
    with Progress("uploading t", 4, "rows", stream=stream) as bar:
        assert bar.enabled and bar._bar is not None
        bar.update(4, "done")
    drawn = stream.getvalue()
    assert "uploading t" in drawn and "4/4" in drawn and "rows" in drawn and "━" in drawn


def test_client_metrics_keep_the_progress_line_short_by_default(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1)
    ids = keras.Input((3,), dtype="int64")
    emb = Embedding(output_dim=4, is_distributed=True, name="short_line")
    model = tf_dlt.transpile(
        keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids)))),
        cluster.addresses,
    )
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 500, size=(64, 3)), rng.normal(size=(64, 1)).astype("float32")
    summary, named = tf_dlt.ClientMetrics(), tf_dlt.ClientMetrics(logs=["dlt_pushes"])
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[summary]).history
    shown = {k for k in history if k.startswith("dlt_")}
    assert shown == set(client_metrics.SUMMARY)
    assert len(summary.last) > 30 and summary.last["dlt_pushes"] == 8.0
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[named]).history
    assert {k for k in history if k.startswith("dlt_")} == {"dlt_pushes"}
    with pytest.raises(ValueError, match="summary"):
        tf_dlt.ClientMetrics(logs="everything")
    # Every value an epoch gives has a name `logs` may list, and a name that
    # is none of them (a typo) is refused, not ignored.
    assert set(summary.last) == client_metrics.NAMES
    with pytest.raises(ValueError, match=r"names no metric \['dlt_nope'\]"):
        tf_dlt.ClientMetrics(logs=["dlt_pulls", "dlt_nope"])
    with pytest.raises(ValueError, match="give log_dir"):
        tf_dlt.ClientMetrics(every_n_batches=10)
