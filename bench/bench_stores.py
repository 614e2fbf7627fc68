"""Save / Load GB/s of one shard to a real HDFS and a real S3-compatible
server beside local disk, in the same run (tf_dlt.tools.local_stores starts
both on loopback: a NameNode + DataNode of Hadoop 2.7.3, rclone serve s3).

Each store gets the same table saved and loaded `--reps` times, interleaved
store by store; the medians are reported, with local disk's as the baseline
and the ratio. All three servers share this machine's disk and cores with
the shard, so the figures bound what the client and the protocol cost, not
what a cluster of storage hosts would give. GB/s counts the shard file's
bytes. A store that cannot start here (no Java, no Hadoop jars, no rclone)
is reported as skipped with the reason. Usage:
  python bench/bench_stores.py [--rows N] [--dim D] [--reps R] [--stores local,hdfs,s3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tf_dlt import _native
from tf_dlt.checkpoint import shard_files
from tf_dlt.checkpoint.manifest import write_manifest
from tf_dlt.tools import local_stores

from bench_core import make_table
from common import emit, log


@contextlib.contextmanager
def started(store: str, base: Path) -> Iterator[str | None]:
    """The URL prefix of `store`, running for the block (None: cannot start)."""
    if store == "local":
        yield str(base / "local")
        return
    reason = (local_stores.hdfs_unavailable if store == "hdfs" else local_stores.s3_unavailable)()
    if reason:
        log(f"stores: {store} skipped: {reason}")
        yield None
        return
    if store == "hdfs":
        with local_stores.LocalHdfs(base / "hdfs-server") as hdfs:
            yield f"{hdfs.url}/bench"
        return
    with local_stores.LocalS3(base / "s3-server") as s3:
        saved = {k: os.environ.get(k) for k in s3.env}
        os.environ.update(s3.env)
        try:
            yield "s3://tf-dlt/bench"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def measure(url: str, shard: _native.Shard, rows: int, reps: int) -> tuple[float, float, int]:
    """(median save s, median load s, file bytes) of `shard` at `url`."""
    saves, loads, nbytes = [], [], 0
    for rep in range(reps):
        target = f"{url}/ck{rep}"
        start = time.perf_counter()
        part = shard_files.save_shard(target, shard, f"bench{rep}")
        saves.append(time.perf_counter() - start)
        write_manifest(target, [part], f"bench{rep}")
        nbytes = part["bytes"]
        fresh = _native.Shard(0, 1)
        start = time.perf_counter()
        shard_files.load_shard(target, fresh)
        loads.append(time.perf_counter() - start)
        assert fresh.tables()[0].size() == rows
        del fresh
    return statistics.median(saves), statistics.median(loads), nbytes


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--stores", default="local,hdfs,s3")
    args = p.parse_args()
    stores = args.stores.split(",")
    unknown = sorted(set(stores) - {"local", "hdfs", "s3"})
    if unknown or len(set(stores)) != len(stores):
        p.error(f"--stores: each of local, hdfs, s3 at most once, got {args.stores!r}")
    base = Path(tempfile.mkdtemp(prefix="tf_dlt-bench-stores-"))
    try:
        log(f"stores: {args.rows} rows of dim {args.dim}, adagrad, {args.reps} reps each")
        table, _ = make_table(args.rows, args.dim)
        shard = _native.Shard(0, 1)
        shard.install_tables([table])
        figures: dict[str, tuple[float, float, int]] = {}
        for store in stores:
            with started(store, base) as url:
                if url is None:
                    continue
                start = time.perf_counter()
                figures[store] = measure(url, shard, args.rows, args.reps)
                log(f"stores: {store} done in {time.perf_counter() - start:.1f} s")
        local = figures.get("local")
        for store, (save_s, load_s, nbytes) in figures.items():
            common = {
                "store": store, "rows": args.rows, "dim": args.dim, "bytes": nbytes,
                "unit": "GB/s", "baseline_name": "local disk, same table, same run",
            }  # fmt: skip
            for what, seconds, index in (("save", save_s, 0), ("load", load_s, 1)):
                value = nbytes / seconds / 1e9
                baseline = nbytes / local[index] / 1e9 if local else None
                emit({
                    **common, "name": f"stores_{what}_{store}", "value": value,
                    "seconds": seconds, "baseline_value": baseline,
                })  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
