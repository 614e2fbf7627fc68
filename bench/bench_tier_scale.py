"""Tiered storage at the scale it exists for (docs/tiered_storage.md): one
shard process under a fixed --memory-budget (default 6 GiB) grown by
training inserts to far more rows than its budget holds (default 5e8 rows of
dim 10, bfloat16 values and Adagrad slots), against a 1M-row table of the
same config all in RAM in another shard process, measured in the same run:

- growth: rows/s of training steps that each insert a batch of new ids
  (a pull that makes the rows, then a push of their gradients);
- Zipf(--skew) pull rows/s over every id in training steps (a pull, then a
  push), as a ratio of the same traffic's on the all-RAM table (target >=
  0.5 with skew 1.05); and in pulls alone (a read-only stream);
- uniform pull rows/s in training steps, with the tier's slot reads per
  pulled row beside them (the worst case's reads, from the page cache or
  the device) and the 4 KiB pages the shard process read from the device
  per pulled row (`/proc/PID/io` read_bytes: cold reads, and the pages the
  keeper's demotions read in);
- the tiered shard's peak resident set (VmHWM) against its budget (target
  <= budget + 10%), and the tier files' disk bytes per row (blocks
  allocated, not file sizes).

Ids are spread over int64 (a bijective mix of 0..rows-1), so nothing about
them is sequential for the table's hashing. With --page-cache-limit B the
tiered shard runs in a memory cgroup of its budget plus B bytes, so its tier
files cannot stay in the page cache (root; see bench_tiers.py).

With --grow-seconds T the growth stops after T seconds (at a batch's end)
and the rest runs on the rows made so far (`rows_grown`): past the page
cache, a row's demotion may wait for a device read (a write into a page not
in the cache reads it first), and the growth rate at each size is logged.

With --load-fractions F1,F2,... the table is not grown: it is written once
as a checkpoint of --parts shard files (each built in RAM on its own, so the
writer never holds more than a part; --checkpoint DIR keeps it for the
next run) holding each row as 100,000 training
steps of the Zipf(--skew) stream below would have left it (its last-touched
stamp and update count; the hot rows touched last), the page cache is
dropped (root), and
for each fraction a tiered shard restores it (`--load-from`: every part into
one shard) under the budget that gives its rows that fraction of the table's
all-RAM bytes (the 1M-row table's bytes per row times the rows; the budget
as bench_tiers.py computes it), then runs the same measurements: one line
per budget with the restore's rows/s and GB/s (docs/img/tier_scale.png).

Usage: python bench/bench_tier_scale.py [--rows N] [--dim D] [--budget BYTES]
       [--seconds S] [--skew 1.05] [--storage-dir DIR] [--page-cache-limit B]
       [--grow-seconds T] [--load-fractions F1,F2 [--parts K]]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from bench_tiers import budget_for, idle_shard_rss, page_cache_capped, peak_rss, storage_read_bytes

from tf_dlt import Client, _native, routing
from tf_dlt.checkpoint import manifest, shard_files
from tf_dlt.server.local import LocalCluster
from tf_dlt.table_config import TableConfig

from common import emit, log

BATCH = 65_536
TABLE = "bench"
_MIX = np.int64(0x9E3779B97F4A7C15 >> 1)  # odd: a bijection of int64
_SPREAD = 2_654_435_761  # coprime with every row count tried here


def ids_of(counters: np.ndarray) -> np.ndarray:
    """The ids of row numbers `counters` (int64, wrapping)."""
    with np.errstate(over="ignore"):
        return (counters.astype(np.int64) * _MIX) ^ np.int64(12345)


def zipf_batch(rng: np.random.Generator, rows: int, skew: float) -> np.ndarray:
    """A batch of ids under Zipf(skew) over `rows` ranks (the continuous
    approximation, inverted in closed form: numpy's sampler is too slow to
    keep up with the pulls), rank r being row r x _SPREAD mod rows: the hot
    rows are not neighbours."""
    u = rng.random(BATCH)
    top = float(rows) ** (1.0 - skew)
    ranks = np.floor((1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - skew))) - 1
    ranks = np.clip(ranks, 0, rows - 1).astype(np.uint64)
    return ids_of((ranks * np.uint64(_SPREAD)) % np.uint64(rows))


def uniform_batch(rng: np.random.Generator, rows: int) -> np.ndarray:
    return ids_of(rng.integers(0, rows, BATCH))


def tier_of(client: Client) -> dict[str, int]:
    (stats,) = client.stats()
    (table,) = [t for t in stats["tables"] if t["config"]["name"] == TABLE]
    return {**table.get("tier", {}), "rows": int(table["rows"])}


def disk_bytes(directory: Path) -> int:
    """Bytes the files under `directory` occupy on disk."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


@contextlib.contextmanager
def tiered_shard(
    args: argparse.Namespace, budget: int, storage: Path, *flags: str,
    start_timeout: float = 60.0,
) -> Iterator[LocalCluster]:  # fmt: skip
    """One shard process under `budget` with its disk tier in `storage` (in a
    memory cgroup of the budget plus --page-cache-limit when given)."""
    cap = None if args.page_cache_limit is None else budget + int(args.page_cache_limit)
    with (
        page_cache_capped(cap),
        LocalCluster(
            1, "--threads", "2", "--memory-budget", str(budget), "--storage-dir", str(storage),
            *flags, start_timeout=start_timeout,
        ) as cluster,
    ):  # fmt: skip
        yield cluster


def create(client: Client, dim: int) -> None:
    client.create_table(
        TABLE, dim, "uniform", "adagrad", value_dtype="bfloat16", slot_dtype="bfloat16"
    )


def grow(
    client: Client, rows: int, dim: int, pid: int, budget: int, seconds: float = float("inf")
) -> tuple[int, float]:
    """Inserts rows 0..rows-1 by training steps, stopping after `seconds`;
    the rows made and their rows/s."""
    grads = np.full((BATCH, dim), 1e-3, dtype=np.float32)
    start = last = time.perf_counter()
    reported = made = 0
    for first in range(0, rows, BATCH):
        if time.perf_counter() - start >= seconds:
            log(f"growth stopped after {seconds:.0f} s at {made:,} rows")
            break
        n = min(BATCH, rows - first)
        ids = ids_of(np.arange(first, first + n, dtype=np.int64))
        client.pull(TABLE, ids)
        client.push(TABLE, ids, grads[:n], 0.01)
        made = first + n
        if first + n - reported >= max(min(rows // 20, 10_000_000), BATCH) or first + n == rows:
            now = time.perf_counter()
            tier = tier_of(client)
            log(
                f"{first + n:,} rows in {now - start:.0f} s ("
                f"{(first + n - reported) / (now - last) / 1e6:.2f} M rows/s lately); "
                f"{tier.get('ram_rows', 0):,} in RAM, {tier.get('disk_rows', 0):,} on disk; "
                f"peak RSS {peak_rss(pid) / budget:.2f} of the budget"
            )
            reported, last = first + n, now
    return made, made / (time.perf_counter() - start)


def steps(client: Client, batches, dim: int, seconds: float, push: bool = True):  # type: ignore[no-untyped-def]
    """Training steps (a pull, then a push of its gradients; pulls only
    without `push`) on batches from `batches` (a callable) for `seconds` of
    pulling; pull rows/s, push rows/s (0 without pushes), rows pulled."""
    grads = np.full((BATCH, dim), 1e-3, dtype=np.float32)
    rows, pull_s, push_s = 0, 0.0, 0.0
    while pull_s < seconds:
        ids = batches()
        t = time.perf_counter()
        client.pull(TABLE, ids)
        pull_s += time.perf_counter() - t
        if push:
            t = time.perf_counter()
            client.push(TABLE, ids, grads, 0.01)
            push_s += time.perf_counter() - t
        rows += len(ids)
    return rows / pull_s, (rows / push_s if push else 0.0), rows


def baseline(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, int]:
    """The 1M-row table all in RAM (another shard process): growth, Zipf
    training steps and pulls alone, uniform steps; and its RAM bytes per row."""
    out: dict[str, int] = {}
    with LocalCluster(1, "--threads", "2") as ram_cluster, Client(ram_cluster.addresses) as ram:
        log(f"all in RAM: {args.baseline_rows:,} rows")
        create(ram, args.dim)
        out["baseline_grow_rows_per_s"] = round(
            grow(ram, args.baseline_rows, args.dim, ram_cluster.processes[0].pid, 1 << 62)[1]
        )
        (stats,) = ram.stats()
        (table,) = [t for t in stats["tables"] if t["config"]["name"] == TABLE]
        out["baseline_ram_bytes_per_row"] = round(int(table["bytes"]) / args.baseline_rows)
        zipf = lambda: zipf_batch(rng, args.baseline_rows, args.skew)  # noqa: E731
        steps(ram, zipf, args.dim, 2.0)
        pull, push, _ = steps(ram, zipf, args.dim, args.seconds)
        out["baseline_zipf_pull_rows_per_s"] = round(pull)
        out["baseline_zipf_push_rows_per_s"] = round(push)
        out["baseline_zipf_pull_only_rows_per_s"] = round(
            steps(ram, zipf, args.dim, args.seconds, push=False)[0]
        )
        uniform = lambda: uniform_batch(rng, args.baseline_rows)  # noqa: E731
        out["baseline_uniform_pull_rows_per_s"] = round(
            steps(ram, uniform, args.dim, args.seconds)[0]
        )
    return out


def measure_tiered(
    tiered: Client, pid: int, rows: int, args: argparse.Namespace, rng: np.random.Generator
) -> dict[str, object]:
    """Zipf pulls alone, Zipf training steps and uniform training steps over
    rows 0..rows-1 of the tiered shard (process `pid`)."""
    out: dict[str, object] = {}
    zipf = lambda: zipf_batch(rng, rows, args.skew)  # noqa: E731
    uniform = lambda: uniform_batch(rng, rows)  # noqa: E731
    log("Zipf pulls alone (a read-only stream: RAM is full, so nothing moves in)")
    out["zipf_pull_only_rows_per_s"] = round(
        steps(tiered, zipf, args.dim, args.seconds, push=False)[0]
    )
    log("Zipf training steps (first a warm-up of the same length)")
    steps(tiered, zipf, args.dim, args.seconds)
    pull, push, _ = steps(tiered, zipf, args.dim, args.seconds)
    out["zipf_pull_rows_per_s"] = round(pull)
    out["zipf_push_rows_per_s"] = round(push)
    log("uniform training steps")
    before, read_before = tier_of(tiered), storage_read_bytes(pid)
    pull, _, pulled = steps(tiered, uniform, args.dim, args.seconds)
    after = tier_of(tiered)
    out["uniform_pull_rows_per_s"] = round(pull)
    out["uniform_slot_reads_per_row"] = round(
        (after.get("disk_reads", 0) - before.get("disk_reads", 0)) / pulled, 3
    )
    # What reached the device: the pulls' cold reads and the pages the
    # keeper's demotions read in, per 4 KiB.
    out["uniform_device_page_reads_per_row"] = round(
        (storage_read_bytes(pid) - read_before) / 4096 / pulled, 3
    )
    out["tier"] = after
    return out


def ratios(out: dict[str, object]) -> None:
    """Adds the peak RSS over the budget and Zipf pulls against all in RAM."""
    out["rss_over_budget"] = round(int(out["peak_rss"]) / int(out["budget_bytes"]), 3)  # type: ignore[call-overload]
    out["zipf_vs_all_ram"] = round(
        int(out["zipf_pull_rows_per_s"]) / int(out["baseline_zipf_pull_rows_per_s"]),  # type: ignore[call-overload]
        3,
    )


# The pushes a training stream ran before the checkpoint a restore reads.
TRAINED_PUSHES = 100_000


def zipf_probability(ranks: np.ndarray, rows: int, skew: float) -> np.ndarray:
    """Each rank's probability under zipf_batch's sampler (its CDF,
    ((r + 1) ** (1 - skew) - 1) / (rows ** (1 - skew) - 1), differenced)."""
    r = ranks.astype(np.float64)
    top = float(rows) ** (1.0 - skew)
    return ((r + 2.0) ** (1.0 - skew) - (r + 1.0) ** (1.0 - skew)) / (top - 1.0)


def trained_state(
    counters: np.ndarray, rows: int, skew: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Update counts and last-touched stamps (push clock) of rows `counters`
    after TRAINED_PUSHES training steps of BATCH ids drawn by zipf_batch:
    a row of probability p per id is touched by a step with probability
    q = 1 - (1 - p) ** BATCH, so the steps since its last touch are
    geometric and its touches about Poisson; a row never touched keeps the
    stamp and count of its insert (0, 1)."""
    inverse = pow(_SPREAD, -1, rows)  # row -> its Zipf rank
    ranks = (counters.astype(np.uint64) * np.uint64(inverse)) % np.uint64(rows)
    p = zipf_probability(ranks, rows, skew)
    q = -np.expm1(BATCH * np.log1p(-p))
    since = rng.geometric(np.clip(q, 1e-300, 1.0)) - 1
    touched = np.where(since < TRAINED_PUSHES, TRAINED_PUSHES - since, 0).astype(np.uint32)
    steps = 1 + np.minimum(rng.poisson(q * TRAINED_PUSHES), 1 << 31).astype(np.uint32)
    return steps, touched


def write_checkpoint(path: Path, rows: int, dim: int, parts: int, skew: float) -> int:
    """Rows 0..rows-1 as a Zipf(skew) training stream leaves them
    (trained_state: the hot rows touched last), saved as a checkpoint of
    `parts` shard files, each built in RAM on its own from the rows its
    shard owns; the checkpoint's bytes."""
    owned: list[list[np.ndarray]] = [[] for _ in range(parts)]
    for first in range(0, rows, 1 << 24):
        counters = np.arange(first, min(rows, first + (1 << 24)), dtype=np.int64)
        owner = routing.shard_of(ids_of(counters), parts)
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(parts + 1))
        for k in range(parts):
            owned[k].append(counters[order[bounds[k] : bounds[k + 1]]])
    config = TableConfig.create(
        TABLE, dim, "uniform", "adagrad", value_dtype="bfloat16", slot_dtype="bfloat16"
    )
    rng = np.random.default_rng(11)
    save_id = manifest.new_save_id()
    written = []
    for k in range(parts):
        counters = np.concatenate(owned[k])
        owned[k] = []
        table = _native.Table(config.to_dict())
        table.set_push_clock(TRAINED_PUSHES)
        for first in range(0, len(counters), 1 << 20):
            batch = counters[first : first + (1 << 20)]
            values = rng.uniform(-0.05, 0.05, (len(batch), dim)).astype(np.float32)
            steps, touched = trained_state(batch, rows, skew, rng)
            table.import_rows(ids_of(batch), values, None, steps, touched)
        shard = _native.Shard(k, parts)
        shard.install_tables([table])
        written.append(shard_files.save_shard(str(path), shard, save_id))
        del shard, table
        log(f"checkpoint part {k + 1} of {parts}: {len(counters):,} rows")
    manifest.write_manifest(str(path), written, save_id)
    return disk_bytes(path)


def drop_page_cache() -> bool:
    """Writes back and drops the page cache (root), so a restore reads its
    checkpoint from the device; False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def restores(
    args: argparse.Namespace, work: Path, storage: Path, out: dict[str, object],
    rng: np.random.Generator,
) -> None:  # fmt: skip
    """The --load-fractions mode: one checkpoint, restored under each budget."""
    checkpoint = Path(args.checkpoint) if args.checkpoint else work / "ckpt"
    if (checkpoint / "MANIFEST.json").exists():  # written by an earlier run
        size = disk_bytes(checkpoint)
        log(f"restoring the checkpoint of {size / 1e9:.1f} GB at {checkpoint}")
    else:
        start = time.perf_counter()
        size = write_checkpoint(checkpoint, args.rows, args.dim, args.parts, args.skew)
        log(f"checkpoint of {size / 1e9:.1f} GB written in {time.perf_counter() - start:.0f} s")
    table_ram = args.rows * int(out["baseline_ram_bytes_per_row"])  # type: ignore[call-overload]
    idle_rss = idle_shard_rss()
    for fraction in [float(f) for f in args.load_fractions.split(",")]:
        shutil.rmtree(storage, ignore_errors=True)
        budget = budget_for(fraction, table_ram, idle_rss)
        got: dict[str, object] = {
            **out, "case": "restore", "budget_bytes": budget, "budget_fraction": fraction,
            "table_ram_bytes": table_ram, "checkpoint_bytes": size, "cold": drop_page_cache(),
        }  # fmt: skip
        log(f"restoring under {budget / 2**30:.1f} GiB ({fraction:g} of the table)")
        start = time.perf_counter()
        load = ("--load-from", str(checkpoint))
        with tiered_shard(args, budget, storage, *load, start_timeout=4 * 3600) as cluster:
            loaded = time.perf_counter() - start
            pid = cluster.processes[0].pid
            got["load_s"] = round(loaded, 1)
            got["load_rows_per_s"] = round(args.rows / loaded)
            got["load_gb_per_s"] = round(size / loaded / 1e9, 3)
            got["peak_rss_after_load"] = peak_rss(pid)
            with Client(cluster.addresses) as tiered:
                got["tier_after_load"] = tier_of(tiered)
                got["disk_bytes_per_row"] = round(disk_bytes(storage) / args.rows, 1)
                log(f"restored in {loaded:.0f} s: {got['tier_after_load']}")
                got.update(measure_tiered(tiered, pid, args.rows, args, rng))
            got["peak_rss"] = peak_rss(pid)
        ratios(got)
        emit(got)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=500_000_000)
    p.add_argument("--dim", type=int, default=10)
    p.add_argument("--budget", type=int, default=6 << 30)
    p.add_argument("--baseline-rows", type=int, default=1_000_000)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--skew", type=float, default=1.05)
    p.add_argument(
        "--grow-seconds", type=float, default=float("inf"),
        help="stop growing after this many seconds; measure on the rows made so far",
    )  # fmt: skip
    p.add_argument(
        "--load-fractions",
        help="restore a checkpoint of the table under budgets giving its rows these fractions "
        "of the table (comma-separated) instead of growing it",
    )  # fmt: skip
    p.add_argument("--parts", type=int, default=10, help="the checkpoint's shard files")
    p.add_argument(
        "--checkpoint",
        help="with --load-fractions: the checkpoint's directory, kept (and reused when it holds "
        "one: same --rows, --dim and --skew); default: under the run's temp directory",
    )  # fmt: skip
    p.add_argument(
        "--storage-dir", help="disk tier directory (default: under /work or the temp dir)"
    )
    p.add_argument(
        "--page-cache-limit", type=float, default=None,
        help="run the tiered shard in a memory cgroup of its budget plus this many bytes (root)",
    )  # fmt: skip
    args = p.parse_args()
    work = Path(
        tempfile.mkdtemp(
            prefix="bench_tier_scale-", dir="/work" if Path("/work").is_dir() else None
        )
    )
    storage = Path(args.storage_dir) if args.storage_dir else work / "ssd"
    shutil.rmtree(storage, ignore_errors=True)
    out: dict[str, object] = {
        "bench": "tier_scale", "rows": args.rows, "dim": args.dim, "budget_bytes": args.budget,
        "skew": args.skew, "page_cache_limit": args.page_cache_limit,
    }  # fmt: skip
    rng = np.random.default_rng(7)
    try:
        out.update(baseline(args, rng))
        if args.load_fractions:
            restores(args, work, storage, out, rng)
            return
        with tiered_shard(args, args.budget, storage) as cluster:
            pid = cluster.processes[0].pid
            with Client(cluster.addresses) as tiered:
                log(f"tiered under {args.budget / 2**30:.1f} GiB: {args.rows:,} rows")
                create(tiered, args.dim)
                rows, rate = grow(tiered, args.rows, args.dim, pid, args.budget, args.grow_seconds)
                out["rows_grown"] = rows
                out["grow_rows_per_s"] = round(rate)
                out["tier_after_growth"] = tier_of(tiered)
                out["disk_bytes_per_row"] = round(disk_bytes(storage) / rows, 1)
                out.update(measure_tiered(tiered, pid, rows, args, rng))
            out["peak_rss"] = peak_rss(pid)
        ratios(out)
        emit(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
