"""The event-driven data plane under load and under an adversary, with real
shard processes on loopback: idle sockets that never speak, oversize frames
before the Hello, a connection cap, and a thousand trainer connections from
several processes at once."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tf_dlt import errors

import frames
from conftest import Cluster

OLD_CAP = 64  # the thread-per-connection server's default connection cap


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _port(cluster: Cluster, shard: int = 0) -> int:
    return int(cluster.addresses[shard].rsplit(":", 1)[1])


def test_idle_sockets_4x_the_old_cap_do_not_lock_out_a_trainer(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1)
    with cluster.client() as setup:
        setup.create_table("t", 8)
    idle = [socket.create_connection(("127.0.0.1", _port(cluster))) for _ in range(4 * OLD_CAP)]
    try:
        # A fresh trainer connects and pulls within a one-second deadline
        # while every idle socket is still open.
        with cluster.client(connect_timeout=1.0, request_timeout=1.0) as trainer:
            rows = trainer.pull("t", np.arange(1000))
            trainer.push("t", np.arange(1000), np.ones((1000, 8), np.float32), 0.1)
        assert rows.shape == (1000, 8)
        with cluster.client() as admin:
            stats = admin.stats()[0]
        print(f"\n{len(idle)} idle sockets open; trainer served; stats: "
              f"open {stats['connections_authenticated']} authenticated")  # fmt: skip
    finally:
        for s in idle:
            s.close()


def test_an_oversize_frame_before_hello_is_refused_without_buffering(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1, token="secret")
    pid = cluster.processes[0].pid
    with cluster.client() as client:
        client.create_table("t", 8)
        client.pull("t", np.arange(100))
    before = _rss_kib(pid)
    body = b"\x07" * (8 << 20)
    for opcode in (frames.HELLO, frames.PULL, frames.PUSH):
        for _ in range(4):
            with socket.create_connection(("127.0.0.1", _port(cluster)), timeout=10) as sock:
                sock.sendall(frames.HEADER.pack(frames.MAGIC, 1, opcode, 0, 9, 64 << 20, 0))
                try:
                    sock.sendall(body)  # the server hangs up long before
                except OSError:
                    pass
                opcode_back, _, rid, payload = frames.read_frame(sock)
                code, message = frames.error_of(payload)
                assert (opcode_back, rid) == (frames.ERROR, 9)
                if opcode == frames.HELLO:
                    assert code == errors.InvalidArgumentError.code
                    assert "exceeds the 4104 bytes a Hello may have" in message
                else:
                    assert code == errors.UnauthenticatedError.code
                assert frames.closed_by_peer(sock)
    growth = _rss_kib(pid) - before
    print(f"\nshard RSS growth after 12 refused 64 MiB frames: {growth} KiB")
    assert growth < 4096
    with cluster.client() as client:  # still serving
        assert client.pull("t", np.arange(10), training=False).shape == (10, 8)


def test_a_full_shard_refuses_hellos_and_clients_retry_within_their_deadline(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1, "--max-connections", "1")
    holder = socket.create_connection(("127.0.0.1", _port(cluster)), timeout=10)
    holder.sendall(frames.hello())
    assert frames.read_frame(holder)[0] == frames.HELLO
    with pytest.raises(errors.ResourceExhaustedError, match="limit of 1 connections"):
        with cluster.client(connect_timeout=0.5) as refused:
            refused.shard_infos()
    holder.close()
    with cluster.client(connect_timeout=10) as client:
        assert client.shard_infos()[0]["shard_index"] == 0


def test_a_closed_client_gives_its_connection_back_at_once(
    start_cluster: Callable[..., Cluster],
) -> None:
    """close() closed the control plane only: the data plane's pooled
    connection held the shard's one slot until the object was collected."""
    cluster = start_cluster(1, "--max-connections", "1")
    first = cluster.client()
    first.create_table("t", 4)
    first.pull("t", np.arange(8))  # its data-plane connection, pooled
    first.close()  # still referenced
    with cluster.client(connect_timeout=0.5) as second:
        assert second.pull("t", np.arange(8)).shape == (8, 4)
    assert first.pull("t", np.arange(8)).shape == (8, 4)  # connects again
    first.close()


_CONNECTOR = textwrap.dedent(
    """
    import json, sys, threading
    import numpy as np
    import tf_dlt

    addresses, threads, rounds, seed = json.loads(sys.argv[1])
    clients = [tf_dlt.Client(addresses, connect_timeout=60, request_timeout=120)
               for _ in range(threads)]
    failures = []
    def connect(c):
        try:
            c.pull("many", np.arange(4))  # opens this client's connection to every shard
        except Exception as e:
            failures.append(repr(e))
    def work(k, c):
        rng = np.random.default_rng(seed * 1000 + k)
        try:
            for _ in range(rounds):
                ids = rng.integers(0, 100000, size=64)
                rows = c.pull("many", ids)
                c.push("many", ids, np.full_like(rows, 0.01), 0.1)
        except Exception as e:
            failures.append(repr(e))
    for group in (connect, None):
        ts = [threading.Thread(target=connect, args=(c,)) for c in clients] if group else [
            threading.Thread(target=work, args=(k, c)) for k, c in enumerate(clients)]
        for t in ts: t.start()
        for t in ts: t.join()
        if group:
            print("ready", flush=True)
            sys.stdin.readline()  # every process connected: go
    print(json.dumps({"failures": failures}), flush=True)
    """
)


def test_a_thousand_connections_from_several_processes(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(2)
    with cluster.client() as admin:
        admin.create_table("many", 8, optimizer="adagrad")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONNECTOR, json.dumps([cluster.addresses, 250, 4, p])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",  # the installed package, not the checkout
        )
        for p in range(4)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        with cluster.client() as admin:
            open_now = [int(s["connections_authenticated"]) for s in admin.stats()]
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(proc.communicate(timeout=600)[0].splitlines()[-1]) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    failures = [f for r in results for f in r["failures"]]
    print(f"\nconnections per shard with 4 x 250 clients connected: {open_now}; "
          f"failures: {len(failures)}")  # fmt: skip
    assert all(n >= 1000 for n in open_now)
    assert failures == []
    with cluster.client() as admin:
        stats = admin.stats()
    assert sum(int(s["pushes"]) for s in stats) > 0
    assert all(not s["errors"] for s in stats), [s["errors"] for s in stats]


def test_stats_report_the_data_plane_limits(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1, "--threads", "3", "--max-connections", "100")
    with cluster.client() as client:
        stats = client.stats()[0]
    assert stats["worker_threads"] == 3 and stats["max_connections"] == 100
    assert int(stats["connections_authenticated"]) >= 1


def test_a_connection_that_never_says_hello_is_closed(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1, "--hello-timeout", "0.3")
    with socket.create_connection(("127.0.0.1", _port(cluster)), timeout=10) as sock:
        assert frames.closed_by_peer(sock, timeout=10)
    with cluster.client() as client:
        assert int(client.stats()[0]["hello_timeouts"]) == 1


def test_a_push_after_the_shard_closed_idle_connections_succeeds(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A pooled connection the shard closed for idleness is never used: a
    push (never retried, as it may have been applied) still succeeds."""
    cluster = start_cluster(1, "--idle-timeout", "0.2")
    with cluster.client() as client:
        client.create_table("t", 4)
        before = client.pull("t", np.arange(8))
        deadline = time.monotonic() + 10
        while int(client.stats()[0]["idle_timeouts"]) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert int(client.stats()[0]["idle_timeouts"]) >= 1
        client.push("t", np.arange(8), np.ones((8, 4), np.float32), 0.5)
        np.testing.assert_allclose(client.pull("t", np.arange(8)), before - 0.5, rtol=1e-6)
