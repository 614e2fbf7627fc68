"""Incremental checkpoints (docs/checkpoints.md), measured against full saves
of the same table in the same run:

- delta save: 1% of the rows changed since the base; time and bytes as a
  fraction of a full save (targets <= 0.05 and <= 0.02);
- restore of base + 5 deltas vs a full checkpoint of the same state
  (loads back to back, after a warm-up load);
- freshness: time from a push on a training shard until a shard following
  its checkpoint directory (`tf-dlt server --read-only --follow`) serves
  it, with a delta saved every --interval seconds.

Usage: python bench/bench_delta.py [--rows N] [--dim D] [--interval S]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from tf_dlt import Client, _native
from tf_dlt.checkpoint import manifest, shard_files
from tf_dlt.server.local import LocalCluster

from bench_core import make_table
from common import emit, log


def save(shard: _native.Shard, path: Path, base: Path | None) -> tuple[float, int]:
    """(seconds, bytes) of one save of `shard` to `path`, a delta on `base`."""
    parent = None
    if base is not None:
        m = manifest.read_manifest(str(base))
        parent = {"path": str(base), "save_id": m["save_id"], "chain_length": m["chain_length"]}
    save_id = manifest.new_save_id()
    start = time.perf_counter()
    part = shard_files.save_shard(str(path), shard, save_id, parent["save_id"] if parent else "")
    manifest.write_manifest(str(path), [part], save_id, parent)
    return time.perf_counter() - start, int(part["bytes"])


def load_seconds(path: Path) -> float:
    fresh = _native.Shard(0, 1)
    start = time.perf_counter()
    shard_files.load_shard(str(path), fresh)
    return time.perf_counter() - start


def change(table: _native.Table, ids: np.ndarray, fraction: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    picked = rng.choice(ids, int(len(ids) * fraction), replace=False)
    for start in range(0, len(picked), 65536):
        batch = picked[start : start + 65536]
        grads = rng.normal(size=(len(batch), table.dim)).astype(np.float32)
        table.push(batch, grads, 0.05)


def deltas(args: argparse.Namespace, work: Path) -> None:
    log(f"delta: {args.rows} rows of dim {args.dim}, adagrad, {args.fraction:.0%} changed")
    table, ids = make_table(args.rows, args.dim)
    shard = _native.Shard(0, 1)
    shard.install_tables([table])
    full_s, full_bytes = save(shard, work / "base", None)
    change(table, ids, args.fraction, 1)
    delta_s, delta_bytes = save(shard, work / "d1", work / "base")
    common = {"rows": args.rows, "dim": args.dim, "changed": args.fraction}
    emit({
        **common, "name": "delta_save_time", "value": delta_s, "unit": "s",
        "baseline_name": "full save of the same table", "baseline_value": full_s,
        "target_ratio": "<= 0.05",
    })  # fmt: skip
    emit({
        **common, "name": "delta_save_bytes", "value": delta_bytes, "unit": "bytes",
        "baseline_name": "full save of the same table", "baseline_value": full_bytes,
        "target_ratio": "<= 0.02",
    })  # fmt: skip
    for k in range(2, 6):  # base + 5 deltas
        change(table, ids, args.fraction, k)
        save(shard, work / f"d{k}", work / f"d{k - 1}")
    save(shard, work / "full", None)  # the same state, whole
    load_seconds(work / "full")  # warm-up: memory a table held before
    chain, whole = [], []
    for _ in range(3):
        chain.append(load_seconds(work / "d5"))
        whole.append(load_seconds(work / "full"))
    emit({
        **common, "name": "restore_base_plus_5_deltas", "value": statistics.median(chain),
        "unit": "s", "baseline_name": "restore of a full checkpoint of the same rows",
        "baseline_value": statistics.median(whole),
    })  # fmt: skip


def freshness(args: argparse.Namespace, work: Path) -> None:
    log(f"freshness: a delta every {args.interval} s, followers read every {args.follow} s")
    run = work / "run"
    with LocalCluster(1, workdir=work / "trainer") as trainer:
        with Client(trainer.addresses) as c:
            c.create_table("t", 16, "uniform", "adagrad")
            ids = np.arange(100_000, dtype=np.int64)
            c.pull("t", ids)
            c.save(str(run / "c0000"))
            with LocalCluster(
                1, "--read-only", "--follow", str(run), "--follow-interval", str(args.follow),
                workdir=work / "follower",
            ) as follower, Client(follower.addresses) as f:  # fmt: skip
                ages, previous = [], "c0000"
                for k in range(1, args.rounds + 1):
                    marker = ids[k : k + 1]
                    c.push("t", marker, np.full((1, 16), 1.0, np.float32), 0.5)
                    pushed_at, want = time.perf_counter(), c.pull("t", marker)
                    time.sleep(max(0.0, args.interval - 0.01))  # the next delta is due
                    name = f"c{k:04d}"
                    c.save(str(run / name), base=str(run / previous))
                    previous = name
                    deadline = time.perf_counter() + 60
                    while not np.array_equal(f.pull("t", marker), want):
                        if time.perf_counter() > deadline:
                            raise RuntimeError("the follower never served the push")
                        time.sleep(0.005)
                    ages.append(time.perf_counter() - pushed_at)
    emit({
        "name": "follower_freshness_p50", "value": statistics.median(ages), "unit": "s",
        "max": max(ages), "delta_interval_s": args.interval, "follow_interval_s": args.follow,
        "rounds": len(ages),
        "baseline_name": "delta interval + follow interval",
        "baseline_value": args.interval + args.follow,
    })  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between deltas")
    p.add_argument("--follow", type=float, default=0.5, help="--follow-interval of the follower")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--skip-freshness", action="store_true")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tf_dlt-bench-delta-", dir=args.dir))
    try:
        deltas(args, work)
        if not args.skip_freshness:
            freshness(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
