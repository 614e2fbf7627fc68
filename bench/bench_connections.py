"""Many connections on one shard (the fleet-scale data plane), each case one
JSON line with its same-run baseline:

- conn_pull_<n> / conn_push_<n>: rows/s and p50/p99 latency of n connections,
  each with one request of 256 ids (dim 16) in flight (closed loop), from a
  C++ load generator (bench/loadgen.cc, one thread), vs 8 connections in the
  same run (goal: >= 0.9 at 512, no errors at 4096).
- idle_rss_per_connection: RSS growth of a fresh shard per idle
  authenticated connection, 4096 of them (the kernel's socket buffers are
  not in RSS).

The load generator and the shard share the machine's cores; both run the
same way for every n, so the ratios compare the server alone.

Usage: python bench/bench_connections.py [--connections 8 64 512 4096] [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np

import tf_dlt
from tf_dlt.server.local import LocalCluster

from common import emit, load_module, log

build = load_module("tests/native_build.py").build


TABLE, DIM, IDS = "conn", 16, 256


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def run_load(loadgen: Path, address: str, n: int, seconds: float, mode: str) -> dict[str, float]:
    cmd = [str(loadgen), address, str(n), str(seconds), mode, str(IDS), str(DIM), TABLE]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def idle_rss(loadgen: Path, cluster: LocalCluster, n: int) -> float:
    pid = cluster.processes[0].pid
    time.sleep(0.5)
    before = _rss_kib(pid)
    cmd = [str(loadgen), cluster.addresses[0], str(n), "0", "idle", "1", str(DIM), TABLE]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    ready = proc.stdout.readline().split()
    assert ready[0] == "ready" and ready[1] == "0", ready
    time.sleep(0.5)
    after = _rss_kib(pid)
    proc.stdin.close()
    proc.wait(60)
    return (after - before) * 1024 / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, nargs="+", default=[8, 64, 512, 4096])
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args()
    loadgen = build("loadgen", "optimized", [Path(__file__).parent / "loadgen.cc"])
    n = max(args.connections)
    with LocalCluster(1, "--idle-timeout", "0") as cluster:  # a fresh shard: nothing reused
        with tf_dlt.Client(cluster.addresses) as client:
            client.create_table(TABLE, DIM, optimizer="adagrad")
        per_connection = idle_rss(loadgen, cluster, n)
        emit({
            "name": "idle_rss_per_connection", "connections": n, "unit": "bytes",
            "value": round(per_connection, 1),
        })  # fmt: skip
    with LocalCluster(1, "--idle-timeout", "0") as cluster:
        with tf_dlt.Client(cluster.addresses) as client:
            client.create_table(TABLE, DIM, optimizer="adagrad")
            client.pull(TABLE, np.arange(1_000_000))  # every id the load uses exists
        for mode in ("pull", "push"):
            base = run_load(loadgen, cluster.addresses[0], 8, args.seconds, mode)
            for n in args.connections:
                log(f"{mode} with {n} connections")
                r = (
                    base
                    if n == 8
                    else run_load(loadgen, cluster.addresses[0], n, args.seconds, mode)
                )
                emit({
                    "name": f"conn_{mode}_{n}", "connections": n, "unit": "rows/s",
                    "value": r["rows_per_s"], "p50_us": r["p50_us"], "p99_us": r["p99_us"],
                    "errors": r["errors"], "ids_per_request": IDS, "dim": DIM,
                    "baseline_name": "8 connections, same run",
                    "baseline_value": base["rows_per_s"], "baseline_p50_us": base["p50_us"],
                    "target_ratio": ">= 0.9 at 512 connections; no errors at 4096",
                })  # fmt: skip


if __name__ == "__main__":
    main()
