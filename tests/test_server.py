"""Shard server processes on loopback: pull/push round trips on 1 and 3
shards against the in-process table core as the oracle, stats, health,
reflection, clean SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tf_dlt import _native
from tf_dlt import errors as tf_dlt_errors
from tf_dlt.server.local import LocalCluster
from tf_dlt.server.shard_server import ShardServer
from tf_dlt.table_config import TableConfig

from conftest import Cluster

EXTREMES = [-(2**63), -(2**63) + 1, -1, 0, 1, 2**63 - 2, 2**63 - 1]


def _oracle(name: str, dim: int, optimizer: str, seed: int = 5) -> object:
    """The same table in this process: what the shards must compute."""
    return _native.Table(TableConfig.create(name, dim, "uniform", optimizer, seed).to_dict())


def _ids(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    ids[: n // 4] = ids[n // 4 : n // 2]  # repeats
    return np.concatenate([ids, np.array(EXTREMES, np.int64)])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "ftrl"])
def test_pull_push_round_trip_matches_table_core(cluster: Cluster, optimizer: str) -> None:
    client = cluster.client()
    client.create_table("emb", 8, "uniform", optimizer, seed=5)
    oracle = _oracle("emb", 8, optimizer)
    ids = _ids(2000)
    np.testing.assert_array_equal(client.pull("emb", ids), oracle.pull(ids))
    grads = np.random.default_rng(1).normal(size=(len(ids), 8)).astype(np.float32)
    for lr in (0.1, 0.05):
        client.push("emb", ids, grads, lr)
        oracle.push(ids, grads, lr)
    np.testing.assert_allclose(client.pull("emb", ids), oracle.pull(ids), rtol=1e-6, atol=1e-7)
    tables = client.list_tables()
    assert tables["emb"]["rows"] == len(np.unique(ids))
    client.close()


def test_pull_shapes_empty_batches_and_inference_modes(cluster: Cluster) -> None:
    client = cluster.client()
    client.create_table("emb", 4, "normal", "sgd", seed=1)
    ids = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    assert client.pull("emb", ids, training=False).shape == (2, 3, 4, 4)
    assert client.list_tables()["emb"]["rows"] == 0  # inference inserts nothing
    zeros = client.pull("emb", ids, training=False, missing="zeros")
    np.testing.assert_array_equal(zeros, np.zeros((2, 3, 4, 4), np.float32))
    initial = client.pull("emb", ids, training=False)
    np.testing.assert_array_equal(client.pull("emb", ids), initial)  # now inserted
    assert client.list_tables()["emb"]["rows"] == 24
    assert client.pull("emb", np.zeros((0,), np.int64)).shape == (0, 4)
    client.push("emb", np.zeros((0,), np.int64), np.zeros((0, 4), np.float32), 0.1)
    client.close()


def test_rows_do_not_depend_on_shard_count(start_cluster: Callable[..., Cluster]) -> None:
    one, three = start_cluster(1), start_cluster(3)
    ids = _ids(3000, seed=7)
    rows = []
    for c in (one, three):
        client = c.client()
        client.create_table("t", 16, "truncated_normal", "adagrad", seed=11)
        rows.append(client.pull("t", ids[::-1])[::-1])
        client.close()
    np.testing.assert_array_equal(rows[0], rows[1])


def test_batches_larger_than_a_frame_are_split(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2, "--max-frame-bytes", "65536")
    client = cluster.client()
    client.create_table("big", 16, "uniform", "sgd", seed=2)
    ids = _ids(50_000, seed=3)
    oracle = _oracle("big", 16, "sgd", seed=2)
    np.testing.assert_array_equal(client.pull("big", ids), oracle.pull(ids))
    grads = np.ones((len(ids), 16), np.float32)
    client.push("big", ids, grads, 0.5)
    oracle.push(ids, grads, 0.5)
    np.testing.assert_allclose(client.pull("big", ids), oracle.pull(ids), atol=1e-6)
    stats = client.stats()
    assert sum(int(s["pulls"]) for s in stats) > 2 * len(stats)  # several frames per shard
    client.close()


@pytest.mark.parametrize("optimizer", ["adagrad", "keras_adagrad", "adam"])
def test_a_push_over_many_frames_updates_a_repeated_id_once(
    start_cluster: Callable[..., Cluster], optimizer: str
) -> None:
    """A push of many frames whose ids repeat far apart in it (a quarter of
    the batch apart, many frames) updates each row once, as the in-process
    table does for the whole batch: a shard sums an id's rows within a
    frame, so every occurrence of an id goes in one frame (an id updated
    once per frame it met moves its slots twice)."""
    cluster = start_cluster(2, "--max-frame-bytes", "65536")
    client = cluster.client()
    client.create_table("rep", 16, "uniform", optimizer, seed=2)
    oracle = _oracle("rep", 16, optimizer, seed=2)
    ids = _ids(50_000, seed=3)
    grads = np.random.default_rng(4).normal(size=(len(ids), 16)).astype(np.float32)
    for lr in (0.1, 0.05):
        client.push("rep", ids, grads, lr)
        oracle.push(ids, grads, lr)
    np.testing.assert_allclose(client.pull("rep", ids), oracle.pull(ids), rtol=1e-5, atol=1e-6)
    assert sum(int(s["pushes"]) for s in client.stats()) > 8  # several frames per shard
    client.close()


def test_an_id_repeated_past_what_a_frame_holds_is_refused_and_nothing_is_sent(
    start_cluster: Callable[..., Cluster],
) -> None:
    """An id more often in one push than one frame holds cannot be summed
    by a shard as the rest are: refused before anything is sent, naming the
    id and its count."""
    cluster = start_cluster(1, "--max-frame-bytes", "65536")
    client = cluster.client()
    client.create_table("rep", 16, "uniform", "adagrad", seed=2)
    ids = np.concatenate([np.arange(100), np.full(5000, 1000), np.arange(100, 200)])
    before = client.pull("rep", ids)
    refused = r"id 1000 occurs 5000 times.*nothing sent"
    with pytest.raises(tf_dlt_errors.ResourceExhaustedError, match=refused):
        client.push("rep", ids, np.ones((len(ids), 16), np.float32), 0.1)
    np.testing.assert_array_equal(client.pull("rep", ids), before)
    client.close()


def test_concurrent_clients_lose_no_update(cluster: Cluster) -> None:
    setup = cluster.client()
    setup.create_table("c", 4, "zeros", "sgd")
    ids = np.arange(500, dtype=np.int64)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with cluster.client() as client:
                for _ in range(20):
                    client.push("c", ids, np.ones((500, 4), np.float32), 0.01)
                    client.pull("c", ids)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    # SGD updates commute: 4 clients x 20 pushes of 0.01 each.
    np.testing.assert_allclose(setup.pull("c", ids), np.full((500, 4), -0.8, np.float32), atol=1e-5)
    setup.close()


def test_stats_count_traffic(cluster: Cluster) -> None:
    client = cluster.client()
    client.create_table("s", 4, "zeros", "sgd")
    ids = np.arange(1000, dtype=np.int64)
    client.pull("s", ids)
    client.push("s", ids, np.ones((1000, 4), np.float32), 0.1)
    stats = client.stats()
    assert [s["shard_index"] for s in stats] == list(range(len(cluster.addresses)))
    assert sum(int(s["pulled_rows"]) for s in stats) == 1000
    assert sum(int(s["pushed_rows"]) for s in stats) == 1000
    assert sum(int(s["tables"][0]["rows"]) for s in stats) == 1000
    for s in stats:
        assert int(s["pull_latency"]["count"]) >= 1
        assert s["pull_latency"]["p99_us"] >= s["pull_latency"]["p50_us"] > 0
    client.close()


def test_health_and_reflection(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1)
    with grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[0]}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tf_dlt.v1.ShardAdmin"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"tf_dlt.v1.ShardAdmin", "grpc.health.v1.Health"} <= names


def test_sigterm_stops_cleanly(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1)
    client = cluster.client()
    client.create_table("t", 4)
    client.pull("t", [1, 2, 3])
    assert cluster.stop() == [0]
    assert "stopped" in cluster.log(0)
    client.close()


def test_cli_help_names_every_flag() -> None:
    tf_dlt_command = Path(sys.executable).parent / "tf-dlt"  # the installed entry point
    out = subprocess.run(
        [str(tf_dlt_command), "server", "--help"],
        capture_output=True, text=True, check=True, timeout=60, cwd="/",
    ).stdout  # fmt: skip
    for flag in ("--port", "--admin-port", "--shard-index", "--num-shards", "--bind",
                 "--auth-token-file", "--max-frame-bytes", "--threads", "--load-from"):  # fmt: skip
        assert flag in out


def test_assign_sets_rows_with_fresh_slots(cluster: Cluster) -> None:
    client = cluster.client()
    client.create_table("up", 4, "uniform", "adagrad", seed=5)
    oracle = _oracle("up", 4, "adagrad")
    ids = _ids(500, seed=9)
    values = np.random.default_rng(2).normal(size=(len(ids), 4)).astype(np.float32)
    client.push("up", ids, np.ones((len(ids), 4), np.float32), 0.1)  # accumulators move
    client.assign("up", ids, values)
    oracle.import_rows(ids, values)  # values set, slots fresh: what Assign must do
    # Repeated ids: the last occurrence wins in both.
    np.testing.assert_array_equal(client.pull("up", ids), oracle.pull(ids))
    client.push("up", ids, np.ones((len(ids), 4), np.float32), 0.1)
    oracle.push(ids, np.ones((len(ids), 4), np.float32), 0.1)
    np.testing.assert_allclose(client.pull("up", ids), oracle.pull(ids), rtol=1e-6, atol=1e-7)
    bad = values.copy()
    bad[3, 1] = np.nan
    before = client.pull("up", ids)
    with pytest.raises(tf_dlt_errors.InvalidArgumentError, match="non-finite value; nothing sent"):
        client.assign("up", ids, bad)
    np.testing.assert_array_equal(client.pull("up", ids), before)
    client.close()


def test_an_admin_port_in_use_is_refused_with_a_reason_not_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "tf_dlt.server", "--shard-index", "0", "--num-shards", "1",
             "--port", "0", "--admin-port", str(port)],
            capture_output=True, text=True, timeout=60, cwd="/",
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"cannot bind the admin port 127.0.0.1:{port}: in use" in result.stderr
    assert "Traceback" not in result.stderr


def _server(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tf_dlt.server", "--port", "0", *flags],
        capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip


@pytest.mark.parametrize(
    "flags, says",
    [
        # pybind's TypeError traceback (the shard takes 32 bits; 4096 at most).
        (["--num-shards", str(2**32)], "--num-shards: must be at most 4096"),
        (["--shard-index", str(2**32), "--num-shards", "2"], "--shard-index: must be at most"),
        # A RuntimeError traceback ("Resource temporarily unavailable").
        (["--threads", "2147483647"], "cannot start"),
        # Stopped at once with exit 0; the working directory; no budget.
        (["--parent-pid", "-1"], "--parent-pid: must be >= 0"),
        (["--checkpoint-root", ""], "must name a path or URL"),
        (["--memory-budget", "0.5"], "under one byte"),
        # A TypeError traceback from the native core (it takes 64 bits).
        (["--memory-budget", "1e30"], "2^64 bytes or more"),
        # An unset $TIER_DIR: no tier, and the rows past the budget evicted.
        (["--memory-budget", "300MiB", "--storage-dir", ""], "--storage-dir: must name a path"),
    ],
)
def test_flags_the_shard_cannot_take_are_refused_without_a_traceback(
    flags: list[str], says: str
) -> None:
    result = _server(*flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert says in result.stderr and "Traceback" not in result.stderr


def test_a_shard_server_takes_its_budget_as_a_size(tmp_path: Path) -> None:
    """`ShardServer(memory_budget=3e10)` or `"16GiB"` (docs/tiered_storage.md:
    it takes what --memory-budget takes) raised raw TypeErrors. (Budgets
    well above what this test process holds, TensorFlow loaded.)"""
    for budget, bytes_ in (
        (3e10, 30_000_000_000), ("16GiB", 16 << 30), (16 << 30, 16 << 30), (np.int64(3e10), 3e10),
    ):  # fmt: skip
        server = ShardServer(memory_budget=budget, storage_dir=str(tmp_path / "ssd"))
        try:
            assert server.shard.memory_status()["budget"] == bytes_
        finally:
            server.stop(0)
    for bad in ([1], True, "lots", -1):
        with pytest.raises(ValueError, match="memory_budget must be a number|is not a size"):
            ShardServer(memory_budget=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="storage_dir must name a directory"):
        ShardServer(memory_budget="16GiB", storage_dir=" ")


def test_a_port_file_it_cannot_write_stops_the_shard_with_a_reason(tmp_path: Path) -> None:
    """A FileNotFoundError traceback, exit 1, after the log said it served."""
    result = _server("--port-file", str(tmp_path / "missing" / "ports"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cannot write --port-file" in result.stderr and "Traceback" not in result.stderr


def test_a_second_signal_as_a_shard_stops_leaves_its_exit_clean() -> None:
    """Ctrl-C reaches a launcher's shards, then its SIGTERM: one that came
    as the process exited killed it (-15; the interpreter puts back the
    default action of the signals it handled), and `tf-dlt launch` said the
    shards did not stop cleanly."""
    cluster = LocalCluster(1).start()
    try:
        proc = cluster.processes[0]
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            if "shard 0 stopped" in cluster.log(0):
                proc.send_signal(signal.SIGTERM)  # again and again, until it exits
            time.sleep(0.002)
        assert proc.wait(10) == 0, cluster.log(0)[-2000:]
    finally:
        cluster.stop()


def test_a_shard_whose_terminal_closed_stops_as_on_sigterm() -> None:
    """SIGHUP (the terminal a shard ran in closed) killed it, with no
    grace for a running save."""
    cluster = LocalCluster(1).start()
    try:
        proc = cluster.processes[0]
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(30) == 0, cluster.log(0)[-2000:]
        assert "received SIGHUP, shutting down" in cluster.log(0)
    finally:
        cluster.stop()


def test_a_shard_started_under_nohup_outlives_its_terminal(tmp_path: Path) -> None:
    """A shard started ignoring SIGHUP (nohup) keeps serving when its
    terminal closes, as before SIGHUP stopped a shard: the handler for it
    replaced the ignore nohup set."""
    port_file, log = tmp_path / "port", tmp_path / "shard.log"
    with log.open("wb") as out:
        # Started by nohup itself (a preexec_fn setting SIGHUP ignored ran
        # Python in the forked child of a threaded pytest, and hung there).
        proc = subprocess.Popen(
            ["nohup", sys.executable, "-m", "tf_dlt.server", "--port", "0", "--admin-port", "0",
             "--bind", "127.0.0.1", "--shard-index", "0", "--num-shards", "1",
             "--port-file", str(port_file)],
            stdout=subprocess.DEVNULL, stderr=out,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert port_file.exists(), log.read_text()
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert proc.poll() is None, log.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


_EXIT_WITH_A_SERVER_RUNNING = """
import socket, sys, time
from tf_dlt.server.shard_server import ShardServer
mute = socket.socket()  # its peer: connections wait in its backlog, unanswered
mute.bind(("127.0.0.1", 0))
mute.listen(64)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
members = [f"127.0.0.1:{port}", f"127.0.0.1:{mute.getsockname()[1]}"]
ShardServer(0, 1, port=port, replica_set=members, advertise=members[0]).start()
time.sleep(float(sys.argv[1]))
print("leaving", flush=True)
"""


@pytest.mark.parametrize("seconds", [3, 6])
def test_a_process_that_exits_with_a_shard_serving_exits_cleanly(seconds: int) -> None:
    """A program that ends with a ShardServer still running (no stop) exits
    0: the server stops as the interpreter exits. Its threads were cut off
    inside native calls, which aborted the process (exit code 134), here a
    replica set member's calls to a peer that never answers."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_A_SERVER_RUNNING, str(seconds)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "leaving" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr


_EXIT_WITH_NATIVE_CALLS_RUNNING = """
import sys, threading, time
import numpy as np
from tf_dlt import _native
cfg = dict(name="t", dim=64, seed=1, initializer=dict(kind="uniform"),
           optimizer=dict(kind="adagrad"))
ids = np.arange(50_000, dtype=np.int64)
if sys.argv[1] == "table":
    table = _native.Table(cfg)
    pull = lambda: table.pull(ids)
else:
    shard = _native.Shard(0, 1)
    shard.create_table(cfg)
    server = _native.DataServer(shard, worker_threads=2)
    server.start()
    client = _native.Client([f"127.0.0.1:{server.port}"])
    pull = lambda: client.pull("t", 64, ids)
pull()
def run():
    while True:
        pull()
for _ in range(4):
    threading.Thread(target=run, daemon=True).start()
time.sleep(0.5)
print("leaving", flush=True)
"""


@pytest.mark.parametrize("source", ["table", "client"])
def test_a_process_that_exits_with_daemon_threads_in_native_calls_exits_cleanly(
    source: str,
) -> None:
    """Daemon threads inside native calls that released the GIL (a table's
    or a client's pulls) as the program ends: it exits 0. Each such thread
    was ended by the interpreter as it took the GIL back, through a
    destructor that could not let that pass, and aborted the process (exit
    code 134, "terminate called without an active exception")."""
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _EXIT_WITH_NATIVE_CALLS_RUNNING, source],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert "leaving" in done.stdout, done.stderr[-3000:]
        assert "terminate called" not in done.stderr
        assert done.returncode == 0, done.stderr[-3000:]


def test_a_shard_server_starts_once_and_a_second_start_leaves_it_serving() -> None:
    """ShardServer.start() again raises FAILED_PRECONDITION and the server
    serves on (a second start of its data server aborted the process); a
    stopped one does not start again."""
    import tf_dlt
    from tf_dlt.server.shard_server import ShardServer

    server = ShardServer(0, 1, port=0).start()
    try:
        with pytest.raises(tf_dlt_errors.FailedPreconditionError, match="starts once"):
            server.start()
        client = tf_dlt.Client([server.address])
        client.create_table("t", 4)
        assert client.pull("t", np.arange(3, dtype=np.int64)).shape == (3, 4)
    finally:
        server.stop(0)
    with pytest.raises(tf_dlt_errors.FailedPreconditionError, match="starts once"):
        server.start()


class _SlowStats:
    """A ShardAdmin servicer whose Stats takes `seconds`; its Shrink raises
    SystemExit (no method of the real one lets it escape)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def Stats(self, request: object, context: object) -> object:  # noqa: N802 - gRPC's name
        from tf_dlt.proto import dlt_pb2

        time.sleep(self.seconds)
        return dlt_pb2.StatsResponse(shard_index=3)

    def Shrink(self, request: object, context: object) -> object:  # noqa: N802 - gRPC's name
        raise SystemExit(1)

    def __getattr__(self, name: str) -> object:
        return self.Stats


def test_the_admin_server_serves_many_calls_a_channel_and_stops_in_order() -> None:
    """The admin port's server, alone: 150 calls at once on one channel all
    answered (a cap on streams per connection refused some, UNAVAILABLE);
    a method raising SystemExit ends its call (INTERNAL), not the server;
    health says NOT_SERVING from the first step of a stop, while calls in
    hand finish; a port bound and never served is released by stop."""
    from concurrent.futures import ThreadPoolExecutor

    from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc
    from tf_dlt.server.admin_server import AdminServer

    def server(seconds: float, port: int = 0) -> AdminServer:
        return AdminServer(
            _SlowStats(seconds), f"127.0.0.1:{port}", auth_token="", count_error=lambda _: None,
            tls_files=None, max_connections=64, handshake_timeout_s=5.0,
        )  # fmt: skip

    admin = server(0.05)
    port = admin.bind()
    admin.start()
    admin.set_health("", health_pb2.HealthCheckResponse.SERVING)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = dlt_pb2_grpc.ShardAdminStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        with ThreadPoolExecutor(150) as pool:
            replies = list(
                pool.map(lambda _: stub.Stats(dlt_pb2.StatsRequest(), timeout=60), range(150))
            )
        assert [r.shard_index for r in replies] == [3] * 150
        with pytest.raises(grpc.RpcError) as exited:
            stub.Shrink(dlt_pb2.ShrinkRequest(), timeout=10)
        assert exited.value.code() == grpc.StatusCode.INTERNAL
        assert "SystemExit" in (exited.value.details() or "")
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
        admin._servicer.seconds = 2.0  # type: ignore[attr-defined]
        with ThreadPoolExecutor(1) as pool:
            in_hand = pool.submit(stub.Stats, dlt_pb2.StatsRequest(), timeout=60)
            time.sleep(0.5)
            admin.begin_stop()
            admin.set_health("", health_pb2.HealthCheckResponse.SERVING)  # too late
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            admin.stop(30)
            assert in_hand.result().shard_index == 3  # finished within the grace
    finally:
        channel.close()
        admin.stop(0)
    unserved = server(0.0)
    port = unserved.bind()
    unserved.stop(5)
    again = server(0.0, port)
    assert again.bind() == port  # released
    again.stop(0)


def test_sigterm_ends_the_process_past_a_save_the_store_never_answers(
    tmp_path: Path, start_cluster: Callable[..., Cluster]
) -> None:
    """A Save held in a call to a store that does not answer (a frozen S3
    endpoint: 3 minutes a call; one sending a byte now and then: for as long
    as it does). SIGTERM: the shard logged "stopped" after --stop-grace, yet
    its process stayed until that call ended (the interpreter waits for the
    thread at exit). It exits within the grace and a few seconds."""
    import tf_dlt

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import time\n"
        "from tf_dlt.checkpoint import shard_files\n"
        "def stuck(*args, **kwargs):\n"
        "    time.sleep(3600)\n"
        "shard_files.save_shard = stuck\n"
    )
    env = {"PYTHONPATH": f"{hook}:{Path(tf_dlt.__file__).parent.parent}"}
    cluster = start_cluster(1, "--stop-grace", "1", env=env)
    client = cluster.client()
    client.create_table("t", 4)
    saver = threading.Thread(
        target=lambda: pytest.raises(tf_dlt_errors.DltError, client.save, str(tmp_path / "c")),
        daemon=True,
    )
    saver.start()
    deadline = time.monotonic() + 30
    while "saving to" not in cluster.log(0):
        assert time.monotonic() < deadline, cluster.log(0)
        time.sleep(0.05)
    process = cluster.processes[0]
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(40)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"still running 40 s after SIGTERM:\n{cluster.log(0)[-2000:]}")
    assert code == 0 and time.monotonic() - started < 20
    assert "given up" in cluster.log(0)
    saver.join(30)


def test_threads_sharing_a_new_client_all_get_their_rows(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Threads making a new client's first calls at once each made every
    control-plane stub, the later ones closing the channels the first were
    calling on: raw ValueError('Cannot invoke RPC: Channel closed!'), or a
    CANCELLED call given as the base DltError."""
    cluster = start_cluster(3)
    with cluster.client() as c:
        c.create_table("emb", 4)
    for attempt in range(5):
        client = cluster.client()
        barrier = threading.Barrier(8)
        out: list[object] = []

        def work(client: Any, barrier: threading.Barrier, out: list[object]) -> None:
            barrier.wait()
            try:
                out.append(client.pull("emb", np.arange(10)).shape)
            except Exception as e:  # noqa: BLE001 - what each thread met
                out.append(repr(e))

        threads = [threading.Thread(target=work, args=(client, barrier, out)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        client.close()
        assert out == [(10, 4)] * 8, (attempt, out)


def test_a_table_made_again_with_another_dim_is_followed(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A client kept the dim it first met: after another client dropped the
    table and made it again at another dim, each of its pulls failed
    INVALID_ARGUMENT until something made it list the tables."""
    cluster = start_cluster(1)
    with cluster.client() as a, cluster.client() as b:
        a.create_table("emb", 4)
        assert a.pull("emb", [1, 2]).shape == (2, 4)
        b.drop_table("emb")
        b.create_table("emb", 8)
        assert a.pull("emb", [1, 2]).shape == (2, 8)
        b.drop_table("emb")
        b.create_table("emb", 2)
        with pytest.raises(tf_dlt_errors.InvalidArgumentError, match="has dim 2"):
            a.push("emb", [1], np.ones((1, 8), np.float32), 0.1)
        with pytest.raises(tf_dlt_errors.InvalidArgumentError, match=r"shape \(1, 2\)"):
            a.push("emb", [1], np.ones((1, 8), np.float32), 0.1)  # the dim learned again
        a.push("emb", [1], np.ones((1, 2), np.float32), 0.1)
