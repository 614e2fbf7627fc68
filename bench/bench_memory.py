"""Costs of the memory policy, each against a baseline measured in the same
run:

- bytes: table bytes per row of dim 16 with Adagrad, bfloat16 and float16
  (values and slots) vs float32, at several table sizes (the index's load
  factor moves between 0.375 and 0.75 as a table grows; target <= 0.6x);
- admission: push ids/s of a long-tail stream (Zipf 1.05 over 1e9 ids,
  batches of 65536) into a table with Frequency(2) and Probability(0.25)
  admission vs one without (target: cost <= 10%), in process (no network);
- sweep: pull p99 (batches of 1024 random present ids) of a 10M-row table
  on a shard process sweeping its ttl continuously (--sweep-interval 0.01,
  a ttl no row reaches, so every sweep walks the whole table) vs the same
  shard with sweeps off, alternated (target: <= 2x).

Usage: python bench/bench_memory.py [--cases bytes,admission,sweep] [--sweep-rows 10000000]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

import tf_dlt
from tf_dlt import _native, admission, expiry
from tf_dlt.server.local import LocalCluster

from common import emit, log


def _table(dim: int, **policy: Any) -> _native.Table:
    return _native.Table(
        tf_dlt.TableConfig.create("t", dim, "uniform", "adagrad", **policy).to_dict()
    )


def bytes_case() -> None:
    for rows in (1_000_000, 2_000_000, 3_000_000, 5_000_000):
        per_row = {}
        for dtype in ("float32", "bfloat16", "float16"):
            t = _table(16, value_dtype=dtype, slot_dtype=dtype)
            for s in range(0, rows, 1 << 20):
                t.pull(np.arange(s, min(rows, s + (1 << 20)), dtype=np.int64))
            per_row[dtype] = t.bytes() / rows
            del t
        for dtype in ("bfloat16", "float16"):
            emit({"name": "row_bytes", "dim": 16, "optimizer": "adagrad", "rows": rows,
                  "dtype": dtype, "value": per_row[dtype], "baseline": "float32",
                  "baseline_value": per_row["float32"]})  # fmt: skip


def admission_case() -> None:
    rng = np.random.default_rng(0)
    batches = [np.unique(rng.zipf(1.05, 65536) % 10**9).astype(np.int64) for _ in range(60)]
    grads = np.full((65536, 16), 1e-3, np.float32)

    def ids_per_s(**policy: Any) -> float:
        t = _table(16, **policy)
        start = time.perf_counter()
        for b in batches:
            t.push(b, grads[: len(b)], 0.01)
        return sum(len(b) for b in batches) / (time.perf_counter() - start)

    cases = {
        "frequency_2": {"admission": admission.Frequency(2)},
        "probability_0.25": {"admission": admission.Probability(0.25)},
    }
    results: dict[str, list[float]] = {"none": [], **{k: [] for k in cases}}
    for _ in range(3):  # alternated, medians reported
        results["none"].append(ids_per_s())
        for name, policy in cases.items():
            results[name].append(ids_per_s(**policy))
    base = float(np.median(results["none"]))
    for name in cases:
        emit({"name": "admission_push", "policy": name, "value": float(np.median(results[name])),
              "unit": "ids/s", "baseline": "no admission", "baseline_value": base})  # fmt: skip


def _pull_p99(client: tf_dlt.Client, rows: int, rng: np.random.Generator, n: int = 1500) -> float:
    times = []
    for _ in range(n):
        ids = rng.integers(0, rows, 1024)
        start = time.perf_counter()
        client.pull("swept", ids, training=False)
        times.append(time.perf_counter() - start)
    return float(np.percentile(times, 99))


def sweep_case(rows: int) -> None:
    rng = np.random.default_rng(0)
    p99: dict[str, list[float]] = {"off": [], "on": []}
    clusters = {
        "off": LocalCluster(1, "--sweep-interval", "3600", "--log-level", "WARNING"),
        "on": LocalCluster(1, "--sweep-interval", "0.01", "--log-level", "WARNING"),
    }
    try:
        clients = {}
        for name, cluster in clusters.items():
            cluster.start()
            client = tf_dlt.Client(cluster.addresses, request_timeout=300)
            client.create_table("swept", 16, "uniform", "adagrad", ttl=expiry.Pushes(2**31 - 1))
            for s in range(0, rows, 1 << 20):
                client.pull("swept", np.arange(s, min(rows, s + (1 << 20))))
            clients[name] = client
        for _ in range(3):
            for name, client in clients.items():
                p99[name].append(_pull_p99(client, rows, rng))
        log(f"pull p99 (s): {p99}")
        emit({"name": "sweep_pull_p99", "rows": rows, "value": float(np.median(p99["on"])) * 1e3,
              "unit": "ms", "baseline": "no sweeps",
              "baseline_value": float(np.median(p99["off"])) * 1e3})  # fmt: skip
        for client in clients.values():
            client.close()
    finally:
        for cluster in clusters.values():
            cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="bytes,admission,sweep")
    ap.add_argument("--sweep-rows", type=int, default=10_000_000)
    args = ap.parse_args()
    cases = args.cases.split(",")
    if "bytes" in cases:
        bytes_case()
    if "admission" in cases:
        admission_case()
    if "sweep" in cases:
        sweep_case(args.sweep_rows)


if __name__ == "__main__":
    main()
