"""Benchmarks of the TensorFlow ops (shared/research/perf.md B3-B5, B7, B8),
each case one JSON line with its same-run baseline:

- remote_pull: Dlt>Lookup against 2 shard processes, batch 65536, dim 64,
  consumed in graph, vs tf.nn.embedding_lookup on a tf.Variable of the same
  rows consumed in graph (target >= 0.2, goal >= 0.5) and vs one loopback TCP
  stream's GB/s (goal >= 0.7).
- remote_pull_cpu: the pull's wall time per call beside the CPU time the
  trainer and each shard process spent per pull, and their sum over the
  cores (the wall time if every process overlapped perfectly), with the
  two goals in ms.
- latency_<n>: p50 / p99 of a lookup of 1, 64 and 1024 ids in a tf.function
  (latency_eager_<n>: the op called eagerly) vs a loopback TCP ping-pong
  round trip (p50 ratio reported; goal p50 <= 3x RTT + 50 us).
- push_apply: LookupGrad + sync Push (Adagrad on the shards), Zipf ids, vs
  remote pull rows/s (target >= 0.5).
- frame_<MiB>: remote pull rows/s with frames of 1..32 MiB vs the default 8 MiB.
- shards_2_vs_1: pull rows/s with 2 shard processes vs 1 (target >= 0.9);
  pull_vs_shards: rows/s with 1, 2 and 4 shard processes (for the plot).
- embedded_lookup: Dlt>Lookup on the embedded transport vs
  tf.nn.embedding_lookup on the same rows (target >= 0.5).

Usage: python bench/bench_ops.py [--rows N] [--batch B] [--cases ...]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

import numpy as np
import tensorflow as tf

import tf_dlt
from tf_dlt import _native, embedded
from tf_dlt import dlt_ops as ops
from tf_dlt.server.local import LocalCluster
from tf_dlt.table_config import TableConfig

from common import cpu_seconds, emit, log, median_seconds

DIM = 64
TABLE = "bench"


def _stream_sender(port: int, seconds: float) -> None:
    block = b"\0" * (8 << 20)
    with socket.create_connection(("127.0.0.1", port)) as s:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            s.sendall(block)


def tcp_stream_gbs(seconds: float = 3.0) -> float:
    """GB/s of one loopback TCP stream between two processes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sender = mp.get_context("spawn").Process(
            target=_stream_sender, args=(listener.getsockname()[1], seconds)
        )
        sender.start()
        conn, _ = listener.accept()
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        total, start = 0, time.monotonic()
        with conn:
            while n := conn.recv_into(view):
                total += n
        elapsed = time.monotonic() - start
        sender.join(10)
    return total / elapsed / 1e9


def _echo_server(port_queue: mp.Queue, rounds: int) -> None:  # type: ignore[type-arg]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port_queue.put(listener.getsockname()[1])
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            for _ in range(rounds):
                conn.sendall(conn.recv(64))


def tcp_rtt_us(rounds: int = 2000) -> float:
    """Median loopback TCP ping-pong round trip of 64 bytes, microseconds."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_echo_server, args=(q, rounds))
    server.start()
    with socket.create_connection(("127.0.0.1", q.get(timeout=30))) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            s.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(s.recv(64))
            times.append(time.perf_counter() - t)
    server.join(10)
    return statistics.median(times) * 1e6


def fill(cluster: LocalCluster, rows: int, optimizer: str = "adagrad") -> np.ndarray:
    """Creates the table and inserts `rows` ids; returns them."""
    with tf_dlt.Client(cluster.addresses) as client:
        client.create_table(TABLE, DIM, "uniform", optimizer)
        ids = np.arange(rows, dtype=np.int64) * 7919
        for start in range(0, rows, 1 << 18):
            client.pull(TABLE, ids[start : start + (1 << 18)])
    return ids


def consumed_lookup(client: ops.ClientResource) -> tf.types.experimental.GenericFunction:
    @tf.function
    def f(ids: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(ops.lookup(client, ids, TABLE, DIM))

    return f


def rows_per_s(fn, batches: list[tf.Tensor], reps: int = 15) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    it = iter(range(10**9))
    p50, worst = median_seconds(
        lambda: fn(batches[next(it) % len(batches)]).numpy(), reps=reps, warmup=5
    )
    return len(batches[0]) / p50, p50, worst


def cycling(fn: Any, items: list[Any]) -> Any:
    """A no-argument call of `fn` on the next of `items`, round robin."""
    it = iter(range(10**9))
    return lambda: fn(items[next(it) % len(items)])


def batches_of(ids: np.ndarray, batch: int, count: int = 8, seed: int = 0) -> list[tf.Tensor]:
    rng = np.random.default_rng(seed)
    return [tf.constant(ids[rng.integers(0, len(ids), batch)]) for _ in range(count)]


def local_baseline(rows: int, batches: list[tf.Tensor], ids: np.ndarray) -> float:
    """tf.nn.embedding_lookup on a tf.Variable of the same rows, in graph."""
    var = tf.Variable(tf.random.uniform((rows, DIM), -0.05, 0.05))
    # The benchmark ids are arange(rows) * 7919: an id's row index is id // 7919.
    index_batches = [b // 7919 for b in batches]

    @tf.function
    def f(idx: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(tf.nn.embedding_lookup(var, idx))

    rate, _, _ = rows_per_s(f, index_batches)
    return rate


def case_remote(args: argparse.Namespace) -> None:
    with LocalCluster(2, "--log-level", "WARNING") as cluster:
        ids = fill(cluster, args.rows)
        client = ops.ClientResource(cluster.addresses)
        batches = batches_of(ids, args.batch)
        pull = consumed_lookup(client)
        pull_rate, p50, worst = rows_per_s(pull, batches)
        gbs = pull_rate * DIM * 4 / 1e9
        local = local_baseline(args.rows, batches, ids)
        stream = tcp_stream_gbs()
        common = {"rows": args.rows, "dim": DIM, "batch": args.batch, "shards": 2}
        emit({**common, "name": "remote_pull", "unit": "rows/s", "value": pull_rate,
              "GB_per_s": gbs, "p50_ms": p50 * 1e3, "max_ms": worst * 1e3,
              "baseline_name": "tf.nn.embedding_lookup on a tf.Variable, in graph",
              "baseline_value": local, "target_ratio": ">= 0.2 (goal >= 0.5)"})  # fmt: skip
        emit({**common, "name": "remote_pull_vs_tcp", "unit": "GB/s", "value": gbs,
              "baseline_name": "one loopback TCP stream (Python, 8 MiB recv)",
              "baseline_value": stream, "target_ratio": "goal >= 0.7"})  # fmt: skip

        # Where the pull's time goes: CPU per pull of the trainer and of each
        # shard process. Their sum over the cores is the fastest the pull
        # could be on this machine with every process busy all the time.
        pids = ["self"] + [p.pid for p in cluster.processes]
        reps = 60
        before = [cpu_seconds(p) for p in pids]
        start = time.perf_counter()
        for k in range(reps):
            pull(batches[k % len(batches)]).numpy()
        wall_ms = (time.perf_counter() - start) / reps * 1e3
        per_pull = [(cpu_seconds(p) - b) / reps * 1e3 for p, b in zip(pids, before, strict=True)]
        cores = os.cpu_count() or 1
        emit({**common, "name": "remote_pull_cpu", "unit": "ms per pull", "value": wall_ms,
              "trainer_cpu_ms": per_pull[0], "shard_cpu_ms": per_pull[1:],
              "cpu_sum_ms": sum(per_pull), "cores": cores,
              "baseline_name": "CPU of all processes / cores (the wall time at full overlap)",
              "baseline_value": sum(per_pull) / cores,
              "goal_ms": {"0.5x embedding_lookup": args.batch / (0.5 * local) * 1e3,
                          "0.7x TCP stream": args.batch * DIM * 4 / (0.7 * stream * 1e9) * 1e3},
              "target_ratio": "reported"})  # fmt: skip

        rtt = tcp_rtt_us()
        for n in (1, 64, 1024):
            small = batches_of(ids, n, count=16, seed=n)
            f = consumed_lookup(client)
            # In a tf.function (as in a model), and the op called eagerly
            # (as a custom loop or a serving process may): the same op
            # without a function call around it.
            calls = {
                f"latency_{n}": lambda b, f=f: f(b).numpy(),
                f"latency_eager_{n}": lambda b: tf.reduce_sum(
                    ops.lookup(client, b, TABLE, DIM)
                ).numpy(),
            }
            for name, call in calls.items():
                call(small[0])
                times = []
                for k in range(300):
                    t = time.perf_counter()
                    call(small[k % 16])
                    times.append(time.perf_counter() - t)
                times.sort()
                p50_us = times[len(times) // 2] * 1e6
                p99_us = times[int(len(times) * 0.99)] * 1e6
                emit({**common, "batch": n, "name": name, "unit": "us p50",
                      "value": p50_us, "p99_us": p99_us, "p99_over_p50": p99_us / p50_us,
                      "baseline_name": "loopback TCP 64 B ping-pong p50 (Python)",
                      "baseline_value": rtt, "goal_us": 3 * rtt + 50,
                      "target_ratio": "goal: p50 <= 3x RTT + 50 us"})  # fmt: skip

        # Where a small lookup's time goes: a tf.function of a trivial
        # gather (the dispatch every lookup pays), the C++ client's pull
        # alone (no TensorFlow), and what is left of the lookup through the
        # op (the op's own share), each the median of 7 interleaved rounds.
        var = tf.Variable(tf.zeros((16, DIM)))

        @tf.function
        def trivial(i: tf.Tensor) -> tf.Tensor:
            return tf.reduce_sum(tf.gather(var, i % 16))

        raw = _native.Client(cluster.addresses)
        lookup = consumed_lookup(client)
        for n in (1, 64):
            small = batches_of(ids, n, count=16, seed=n)
            arrays = [b.numpy() for b in small]
            lookup(small[0]), trivial(small[0])
            rounds = []
            for _ in range(7):
                rounds.append([
                    median_seconds(cycling(lambda b: lookup(b).numpy(), small), reps=200)[0],
                    median_seconds(cycling(lambda b: trivial(b).numpy(), small), reps=200)[0],
                    median_seconds(cycling(lambda a: raw.pull(TABLE, DIM, a), arrays), reps=200)[0],
                ])  # fmt: skip
            whole, dispatch, wire = (statistics.median(r[k] for r in rounds) for k in range(3))
            own = statistics.median(r[0] - r[1] - r[2] for r in rounds)
            emit({**common, "batch": n, "name": f"latency_parts_{n}", "unit": "us p50",
                  "value": dispatch * 1e6, "client_pull_us": wire * 1e6,
                  "lookup_us": whole * 1e6, "op_own_us": own * 1e6,
                  "baseline_name": "loopback TCP 64 B ping-pong p50 (Python)",
                  "baseline_value": rtt,
                  "note": "value: a tf.function of a trivial gather; client_pull_us: the C++ "
                          "client's pull alone; op_own_us: lookup - the two"})  # fmt: skip

        zipf = np.random.default_rng(1).zipf(1.05, (8, args.batch)) % args.rows
        zipf_batches = [tf.constant(ids[z]) for z in zipf]

        @tf.function
        def push_step(batch: tf.Tensor) -> tf.Tensor:
            grads = tf.ones(tf.concat([tf.shape(batch), [DIM]], 0)) * 0.01
            unique, summed = ops.lookup_grad(batch, grads)
            ops.push(client, unique, summed, 0.01, TABLE, DIM, sync=True)
            return tf.shape(unique)[0]

        push_rate, _, _ = rows_per_s(push_step, zipf_batches)
        emit({**common, "name": "push_apply", "unit": "rows/s (ids before dedup)",
              "value": push_rate, "baseline_name": "remote_pull rows/s, same run",
              "baseline_value": pull_rate, "target_ratio": ">= 0.5"})  # fmt: skip

        rates = {}
        for mib in (1, 4, 8, 16, 32):
            c = ops.ClientResource(cluster.addresses, frame_bytes=mib << 20)
            rates[mib], _, _ = rows_per_s(consumed_lookup(c), batches)
        for mib, rate in rates.items():
            emit({**common, "name": f"frame_{mib}MiB", "unit": "rows/s", "value": rate,
                  "baseline_name": "default 8 MiB frames, same run", "baseline_value": rates[8],
                  "target_ratio": "default within 10% of the best"})  # fmt: skip


def case_shards(args: argparse.Namespace) -> None:
    rates = {}
    for n in (1, 2, 4):
        with LocalCluster(n, "--log-level", "WARNING") as cluster:
            ids = fill(cluster, args.rows)
            client = ops.ClientResource(cluster.addresses)
            rates[n], _, _ = rows_per_s(consumed_lookup(client), batches_of(ids, args.batch))
        emit({"name": "pull_vs_shards", "rows": args.rows, "dim": DIM, "batch": args.batch,
              "shards": n, "rows_per_s": rates[n]})  # fmt: skip
    emit({"name": "shards_2_vs_1", "rows": args.rows, "dim": DIM, "batch": args.batch,
          "unit": "rows/s", "value": rates[2], "baseline_name": "1 shard process, same run",
          "baseline_value": rates[1], "target_ratio": ">= 0.9"})  # fmt: skip


def case_embedded(args: argparse.Namespace) -> None:
    client = ops.ClientResource()
    embedded.create_table(TableConfig.create(TABLE, DIM, "uniform", "adagrad"))
    ids = np.arange(args.rows, dtype=np.int64) * 7919
    for start in range(0, args.rows, 1 << 18):
        ops.lookup(client, ids[start : start + (1 << 18)], TABLE, DIM)
    batches = batches_of(ids, args.batch)
    rate, _, _ = rows_per_s(consumed_lookup(client), batches)
    local = local_baseline(args.rows, batches, ids)
    emit({"name": "embedded_lookup", "rows": args.rows, "dim": DIM, "batch": args.batch,
          "unit": "rows/s", "value": rate,
          "baseline_name": "tf.nn.embedding_lookup on a tf.Variable, in graph",
          "baseline_value": local, "target_ratio": ">= 0.5"})  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--cases", nargs="+", default=["remote", "shards", "embedded"])
    args = p.parse_args()
    cases = {"remote": case_remote, "shards": case_shards, "embedded": case_embedded}
    for name in args.cases:
        log(f"case {name}")
        cases[name](args)


if __name__ == "__main__":
    main()
