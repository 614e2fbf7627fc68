"""Table-core benchmarks (shared/research/perf.md B1, B2, B10), in process,
no RPC. Each case prints one JSON line with its same-run baseline:

- lookup:  Table.pull rows/s of present ids vs a C random-row gather of a
           dense float32 array with the same rows, dim and batch (target >= 0.4).
- apply:   Adagrad push rows/s vs TF's ResourceSparseApplyAdagradV2 on a
           tf.Variable of the same shape (target >= 3x); Adam and FTRL vs
           Adagrad (target >= 0.5x).
- memory:  bytes per row (RSS growth / rows) at 10M rows, dim 64, Adagrad vs
           the raw 8 + 256 + 256 = 520 B (target <= 1.5x, goal <= 1.25x).

Usage: python bench/bench_core.py [--rows N] [--dim D] [--batch B] [--cases ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tf_dlt import _native
from tf_dlt.table_config import TableConfig

from common import OUT, emit, log, median_seconds, rss_bytes

INSERT_CHUNK = 1 << 20


def make_table(
    rows: int, dim: int, optimizer: str = "adagrad", **policy: str
) -> tuple[_native.Table, np.ndarray]:
    """A table of `rows` rows (`policy`: memory policy fields, e.g.
    value_dtype) and its ids."""
    config = TableConfig.create("bench", dim, "uniform", optimizer, **policy)
    table = _native.Table(config.to_dict())
    ids = (np.arange(rows, dtype=np.int64) * np.int64(0x9E3779B97F4A7C15 >> 1)) ^ np.int64(12345)
    for start in range(0, rows, INSERT_CHUNK):
        table.pull(ids[start : start + INSERT_CHUNK])
    return table, ids


def c_gather_baseline(rows: int, dim: int, batch: int) -> dict[str, float]:
    OUT.mkdir(exist_ok=True)
    binary = OUT / "gather"
    source = Path(__file__).parent / "c" / "gather.c"
    subprocess.run(["gcc", "-O3", "-march=native", "-o", str(binary), str(source)], check=True)
    out = subprocess.run(
        [str(binary), str(rows), str(dim), str(batch), "15"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def pull_seconds(table: _native.Table, batches: list[np.ndarray]) -> tuple[float, float]:
    cycle = itertools.cycle(batches)
    return median_seconds(lambda: table.pull(next(cycle)), reps=15)


def case_lookup(args: argparse.Namespace) -> None:
    log(f"lookup: inserting {args.rows} rows of dim {args.dim}")
    table, ids = make_table(args.rows, args.dim)
    rng = np.random.default_rng(0)
    batches = [ids[rng.integers(0, args.rows, args.batch)] for _ in range(16)]
    p50, worst = pull_seconds(table, batches)
    del table, ids
    baseline = c_gather_baseline(args.rows, args.dim, args.batch)["gather_rows_per_s"]
    emit({
        "name": "core_lookup", "rows": args.rows, "dim": args.dim, "batch": args.batch,
        "unit": "rows/s", "value": args.batch / p50, "p50_ms": p50 * 1e3, "max_ms": worst * 1e3,
        "baseline_name": "C random gather (bench/c/gather.c, -O3)", "baseline_value": baseline,
        "target_ratio": ">= 0.4",
    })  # fmt: skip


def tf_sparse_adagrad_rows_per_s(rows: int, dim: int, batches: list[np.ndarray]) -> float:
    import tensorflow as tf

    var = tf.Variable(tf.random.uniform((rows, dim), -0.05, 0.05))
    accum = tf.Variable(tf.fill((rows, dim), 0.1))
    grads = tf.constant(np.ones((len(batches[0]), dim), np.float32))

    @tf.function
    def apply(indices: tf.Tensor) -> None:
        tf.raw_ops.ResourceSparseApplyAdagradV2(
            var=var.handle, accum=accum.handle, lr=0.01, epsilon=1e-7, grad=grads, indices=indices
        )

    tensors = itertools.cycle([tf.constant(b) for b in batches])
    p50, _ = median_seconds(lambda: apply(next(tensors)), reps=15)
    return len(batches[0]) / p50


def push_rows_per_s(table: _native.Table, batches: list[np.ndarray], grads: np.ndarray) -> float:
    cycle = itertools.cycle(batches)
    p50, _ = median_seconds(lambda: table.push(next(cycle), grads, 0.01), reps=15)
    return len(batches[0]) / p50


def case_apply(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(1)
    # Unique row indices per batch (the TF kernel applies duplicates one by one).
    index_batches = [rng.choice(args.rows, args.batch, replace=False) for _ in range(8)]
    grads = rng.normal(size=(args.batch, args.dim)).astype(np.float32)
    rates = {}
    for optimizer in ("adagrad", "adam", "ftrl", "sgd"):
        log(f"apply: {optimizer}, {args.rows} rows")
        table, ids = make_table(args.rows, args.dim, optimizer)
        rates[optimizer] = push_rows_per_s(table, [ids[b] for b in index_batches], grads)
        del table, ids
    log("apply: TF ResourceSparseApplyAdagradV2")
    tf_rate = tf_sparse_adagrad_rows_per_s(
        args.rows, args.dim, [b.astype(np.int64) for b in index_batches]
    )
    emit({
        "name": "core_apply_adagrad", "rows": args.rows, "dim": args.dim, "batch": args.batch,
        "unit": "rows/s", "value": rates["adagrad"],
        "baseline_name": "TF ResourceSparseApplyAdagradV2 on a tf.Variable",
        "baseline_value": tf_rate,
        "target_ratio": ">= 3",
    })  # fmt: skip
    for optimizer in ("adam", "ftrl", "sgd"):
        emit({
            "name": f"core_apply_{optimizer}", "rows": args.rows, "dim": args.dim,
            "batch": args.batch, "unit": "rows/s", "value": rates[optimizer],
            "baseline_name": "tf_dlt Adagrad apply, same run", "baseline_value": rates["adagrad"],
            "target_ratio": ">= 0.5" if optimizer != "sgd" else "none",
        })  # fmt: skip


def memory_child(rows: int, dim: int) -> None:
    before = rss_bytes()
    table, _ = make_table(rows, dim)
    after = rss_bytes()
    print(
        json.dumps(
            {"rss_bytes": after - before, "table_bytes": table.bytes(), "rows": table.size()}
        )
    )


def case_memory(args: argparse.Namespace) -> None:
    rows = args.memory_rows
    log(f"memory: {rows} rows, dim {args.dim}, adagrad (subprocess)")
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", "--memory-rows", str(rows),
         "--dim", str(args.dim)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    m = json.loads(out.stdout.strip().splitlines()[-1])
    raw = 8 + 4 * args.dim * 2
    per_row = m["rss_bytes"] / m["rows"]
    emit({
        "name": "core_memory_per_row", "rows": m["rows"], "dim": args.dim, "unit": "bytes/row",
        "value": per_row, "accounted_bytes_per_row": m["table_bytes"] / m["rows"],
        "baseline_name": "raw id + values + adagrad slot", "baseline_value": raw,
        "target_ratio": "<= 1.5 (goal <= 1.25); lower is better",
    })  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--memory-rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument(
        "--cases", nargs="+", default=["lookup", "apply", "memory"],
        choices=["lookup", "apply", "memory"],
    )  # fmt: skip
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.rows, args.memory_rows, args.dim, args.batch) < 1:
        p.error("--rows, --memory-rows, --dim and --batch must be at least 1")
    if args.memory_child:
        memory_child(args.memory_rows, args.dim)
        return
    cases = {"lookup": case_lookup, "apply": case_apply, "memory": case_memory}
    for name in args.cases:
        cases[name](args)


if __name__ == "__main__":
    main()
