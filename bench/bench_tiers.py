"""Tiered storage (docs/tiered_storage.md): one shard process serving a table
larger than its --memory-budget, with the cold rows in --storage-dir,
against the same table all in RAM, measured in the same run:

- pull and push rows/s under Zipf(--skew) traffic and under uniform traffic
  (the worst case), as a ratio of the all-RAM shard's (target >= 0.5 under
  Zipf(1.05) with the table 10x the budget);
- the shard's peak resident set (VmHWM) against the budget (target <=
  budget + 10%);
- rows/s against the budget as a fraction of the table (docs/img/tiers.png).

Every shard loads the same checkpoint (written once from an embedded
table), so each starts with the same rows: the tiered ones fill RAM to the
budget and put the rest on disk. The tables' RAM bytes are measured on the
all-RAM shard; a budget fraction f gives the shard's rows f x those bytes:
the budget is that, what the idle process holds and the reserve a shard
keeps for a save's or load's buffers, over the keeper's 90%.

With --page-cache-limit B each tiered shard runs in a memory cgroup of its
budget plus B bytes, which the page cache of its tier files counts against:
the cold reads and the load then pay the disk, not the page cache.

Usage: python bench/bench_tiers.py [--rows N] [--dim D] [--fractions 0.1,0.25]
       [--seconds S] [--skew 1.05] [--batches 400] [--dtype bfloat16]
       [--storage-dir DIR] [--page-cache-limit B]
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

from tf_dlt import Client, _native
from tf_dlt.checkpoint import manifest, shard_files
from tf_dlt.server.local import LocalCluster

from bench_core import make_table
from common import emit, log

BATCH = 4096


def peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def storage_read_bytes(pid: int) -> int:
    """Bytes process `pid` has had read from storage (not the page cache)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def traffic(ids: np.ndarray, kind: str, skew: float, batches: int, seed: int) -> list[np.ndarray]:
    """Batches of ids: Zipf(skew) ranks over a fixed random order of the ids,
    or uniform."""
    rng = np.random.default_rng(seed)
    order = np.random.default_rng(99).permutation(len(ids))
    out = []
    for _ in range(batches):
        if kind == "zipf":
            ranks = np.minimum(rng.zipf(skew, BATCH) - 1, len(ids) - 1)
            out.append(ids[order[ranks]])
        else:
            out.append(ids[rng.integers(0, len(ids), BATCH)])
    return out


TIER_MOVES = ("promotions", "demotions", "disk_updates", "disk_reads")


def tier_counters(client: Client) -> dict[str, int]:
    (stats,) = client.stats()
    tier = stats["tables"][0].get("tier", {})
    return {key: int(tier.get(key, 0)) for key in TIER_MOVES}


def measure(
    client: Client, batches: list[np.ndarray], dim: int, seconds: float, pid: int
) -> dict[str, float]:
    """Pull then push each batch until `seconds` pass (after a warm-up pass
    over a tenth of them); rows/s of each, and per pulled row the 4 KiB
    pages the shard read from the device and its tier's moves (rows moved
    in and out, updated and read on disk)."""
    grads = np.full((BATCH, dim), 1e-3, dtype=np.float32)
    for b in batches[: len(batches) // 10]:
        client.pull("bench", b)
        client.push("bench", b, grads, 0.01)
    counters, device = tier_counters(client), storage_read_bytes(pid)
    pulled = pushed = 0
    pull_s = push_s = 0.0
    start = time.perf_counter()
    i = len(batches) // 10
    while time.perf_counter() - start < seconds:
        b = batches[i % len(batches)]
        i += 1
        t = time.perf_counter()
        client.pull("bench", b)
        pull_s += time.perf_counter() - t
        t = time.perf_counter()
        client.push("bench", b, grads, 0.01)
        push_s += time.perf_counter() - t
        pulled += len(b)
        pushed += len(b)
    out = {"pull_rows_per_s": pulled / pull_s, "push_rows_per_s": pushed / push_s}
    out["device_pages_per_row"] = round((storage_read_bytes(pid) - device) / 4096 / pulled, 3)
    after = tier_counters(client)
    for key in TIER_MOVES:
        out[f"{key}_per_row"] = round((after[key] - counters[key]) / pulled, 3)
    return out


@contextlib.contextmanager
def page_cache_capped(limit: int | None) -> Iterator[None]:
    """With `limit`, the processes this one starts in the block run in a
    memory cgroup of `limit` bytes (this process joins it, so its children
    do; memory it held before stays charged elsewhere). The page cache of
    their files counts against it, so tier files larger than `limit` less
    the shard's own memory cannot stay cached: what a shard on a host whose
    page cache cannot hold its tier pays. Needs root and cgroup v1's
    memory controller or cgroup v2; RuntimeError otherwise."""
    if limit is None:
        yield
        return
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    if v1.is_dir():
        group, limit_file, root = v1 / f"tf_dlt_bench_{os.getpid()}", "memory.limit_in_bytes", v1
    elif (v2 / "cgroup.controllers").exists():
        group, limit_file, root = v2 / f"tf_dlt_bench_{os.getpid()}", "memory.max", v2
    else:
        raise RuntimeError("--page-cache-limit needs a memory cgroup (v1 or v2)")
    group.mkdir()
    try:
        (group / limit_file).write_text(str(limit))
        (group / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield
        finally:
            (root / "cgroup.procs").write_text(str(os.getpid()))
    finally:
        for _ in range(50):  # its processes may take a moment to be gone
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def idle_shard_rss() -> int:
    """The peak resident set of a shard process with no table."""
    with LocalCluster(1) as idle:
        return peak_rss(idle.processes[0].pid)


def budget_for(fraction: float, table_ram: int, idle_rss: int) -> int:
    """The --memory-budget that gives the rows `fraction` of a table of
    `table_ram` bytes all in RAM: what the idle process holds, the reserve
    a shard keeps for a save's or load's buffers and the rows' room, over
    the memory keeper's 90%."""
    rows_room = max(fraction * table_ram, _native.MIN_ROW_ROOM_BYTES)
    return int((idle_rss + _native.PERSIST_RESERVE_BYTES + rows_room) / 0.9) + (1 << 20)


def run_shard(
    checkpoint: Path, budget: int, storage: Path | None, traffic_sets: dict[str, list[np.ndarray]],
    dim: int, seconds: float,
) -> dict[str, object]:  # fmt: skip
    args = ["--load-from", str(checkpoint), "--threads", "2"]
    if budget:
        args += ["--memory-budget", str(budget)]
    if storage is not None:
        shutil.rmtree(storage, ignore_errors=True)
        args += ["--storage-dir", str(storage)]
    start = time.perf_counter()
    with LocalCluster(1, *args, start_timeout=1800) as cluster:
        loaded = time.perf_counter() - start
        pid = cluster.processes[0].pid
        out: dict[str, object] = {"load_s": round(loaded, 1)}
        with Client(cluster.addresses) as c:
            (table,) = c.stats()[0]["tables"]
            out["ram_bytes"] = int(table["bytes"])
            out["tier_after_load"] = table.get("tier", {})
            for kind, batches in traffic_sets.items():
                out[kind] = measure(c, batches, dim, seconds, pid)
            (stats,) = c.stats()
            out["tier"] = stats["tables"][0].get("tier", {})
        out["peak_rss"] = peak_rss(pid)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--fractions", default="0.1,0.25,0.5")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--skew", type=float, default=1.05)
    p.add_argument(
        "--batches", type=int, default=400,
        help=f"distinct batches of {BATCH} ids per traffic kind, cycled through (a set run "
        "through once in --seconds is a stream that never repeats)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
        help="the table's value and slot dtype",
    )  # fmt: skip
    p.add_argument("--storage-dir", help="disk tier directory (default: under the temp dir)")
    p.add_argument(
        "--page-cache-limit", type=float, default=None,
        help="run each tiered shard in a memory cgroup of its budget plus this many bytes, "
        "so its tier files cannot stay in the page cache (root; default: no limit)",
    )  # fmt: skip
    args = p.parse_args()
    work = Path(
        tempfile.mkdtemp(prefix="bench_tiers-", dir="/work" if Path("/work").is_dir() else None)
    )
    try:
        log(f"building {args.rows:,} rows of dim {args.dim} (Adagrad, {args.dtype})")
        table, ids = make_table(args.rows, args.dim, value_dtype=args.dtype, slot_dtype=args.dtype)
        shard = _native.Shard(0, 1)
        shard.install_tables([table])
        checkpoint = work / "ckpt"
        save_id = manifest.new_save_id()
        part = shard_files.save_shard(str(checkpoint), shard, save_id)
        manifest.write_manifest(str(checkpoint), [part], save_id)
        del shard, table
        sets = {
            "zipf": traffic(ids, "zipf", args.skew, args.batches, 1),
            "uniform": traffic(ids, "uniform", args.skew, args.batches, 2),
        }
        del ids
        idle_rss = idle_shard_rss()
        log("all in RAM")
        base = run_shard(checkpoint, 0, None, sets, args.dim, args.seconds)
        table_ram = int(base["ram_bytes"])  # type: ignore[arg-type]
        storage = Path(args.storage_dir) if args.storage_dir else work / "ssd"
        results = []
        for fraction in [float(f) for f in args.fractions.split(",")]:
            budget = budget_for(fraction, table_ram, idle_rss)
            share = f"{fraction:g} of the table's {table_ram / 2**20:.0f} MiB"
            log(f"budget {budget / 2**20:.0f} MiB: {share}")
            cap = None if args.page_cache_limit is None else budget + int(args.page_cache_limit)
            with page_cache_capped(cap):
                got = run_shard(checkpoint, budget, storage, sets, args.dim, args.seconds)
            results.append((fraction, budget, got))
        for fraction, budget, got in results:
            for kind in sets:
                for op in ("pull", "push"):
                    key = f"{op}_rows_per_s"
                    emit({
                        "bench": "tiers", "case": f"{kind} {op}", "rows": args.rows,
                        "dim": args.dim, "dtype": args.dtype, "budget_fraction": fraction,
                        "budget_bytes": budget,
                        "table_ram_bytes": table_ram, "idle_rss": idle_rss,
                        "value": round(got[kind][key]),  # type: ignore[index]
                        "baseline_value": round(base[kind][key]),  # type: ignore[index]
                        "unit": "rows/s", "peak_rss": got["peak_rss"],
                        "rss_over_budget": round(int(got["peak_rss"]) / budget, 3),  # type: ignore[arg-type]
                        "tier": got["tier"], "tier_after_load": got["tier_after_load"],
                        "load_s": got["load_s"], "baseline_load_s": base["load_s"],
                        "baseline_peak_rss": base["peak_rss"], "skew": args.skew,
                        "page_cache_limit": args.page_cache_limit,
                        "per_row": {k: v for k, v in got[kind].items()  # type: ignore[attr-defined]
                                    if k.endswith("_per_row")},
                    })  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
