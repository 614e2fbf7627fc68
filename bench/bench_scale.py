"""Scale benchmark (issue "Scale"): 100 million rows of dim 10 (40-byte
values, the rows of the Paddle design's 1e11-id example) in 2 shard server
processes on this machine.

Measured in one run, growing one Adagrad table through 1M, 10M, 30M and
100M rows:
- insert rows/s (pulls of new ids create rows);
- bytes per row: table bytes reported by the shards, and shard RSS;
- pull and push rows/s (batch 65536 random present ids) and pull latency
  (p50 of batches of 1024 and 65536) at each size;
- the target, pull latency at 100M within 1.5x of 1M, A/B: a 1M-row table
  in the same shards measured alternately with the 100M-row one, 5 rounds;
- at 1M rows, pull rows/s for batches 1024 .. 262144 (the batch-size curve);
- save of the 100M-row table to local disk and load into a fresh 2-shard
  cluster, GB/s.

Writes JSON lines to bench/out/results.jsonl and the measured figures the
capacity planner reads to tf_dlt/tools/data/capacity.json (`--write-capacity`).

Usage: python bench/bench_scale.py [--rows 100000000] [--dim 10] [--write-capacity]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

import tf_dlt
from tf_dlt.server.local import LocalCluster
from tf_dlt.tools import capacity

from common import OUT, emit, log, sorted_seconds

# The checkout's copy (not the installed package's).
CAPACITY = Path(__file__).resolve().parent.parent / "tf_dlt" / "tools" / "data" / "capacity.json"
TABLE = "scale"
SMALL = "scale_1m"
INSERT_BATCH = 1 << 20
# The smallest table whose figures may replace the capacity planner's.
MIN_CAPACITY_ROWS = 30_000_000


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def measure(
    client: tf_dlt.Client, rows: int, dim: int, rng: np.random.Generator, table: str = TABLE
) -> dict:  # type: ignore[type-arg]
    """Pull / push throughput and pull latency over `rows` present ids."""
    big = rng.integers(0, rows, size=65536)
    small = rng.integers(0, rows, size=1024)
    grads = np.full((len(np.unique(big)), dim), 1e-3, np.float32)
    pull_big = sorted_seconds(lambda: client.pull(table, big, training=False), warmup=1)
    pull_small = sorted_seconds(
        lambda: client.pull(table, small, training=False), reps=31, warmup=1
    )
    unique = np.unique(big)
    push = sorted_seconds(lambda: client.push(table, unique, grads, 0.01), warmup=1)
    return {
        "pull_rows_per_s": len(big) / pull_big[len(pull_big) // 2],
        "push_rows_per_s": len(unique) / push[len(push) // 2],
        "pull_p50_ms_65536": pull_big[len(pull_big) // 2] * 1e3,
        "pull_p50_ms_1024": pull_small[len(pull_small) // 2] * 1e3,
        "pull_p99_ms_1024": pull_small[-1] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--dim", type=int, default=10)
    ap.add_argument("--optimizer", default="adagrad")
    ap.add_argument("--checkpoint", default=str(OUT / "scale-ck"))
    ap.add_argument(
        "--write-capacity", action="store_true", help="update tf_dlt/tools/data/capacity.json"
    )
    args = ap.parse_args()
    if args.rows < 1 or args.dim < 1:
        ap.error("--rows and --dim must be at least 1")
    if args.write_capacity and args.rows < MIN_CAPACITY_ROWS:
        # tf-dlt plan and tf-dlt k8s size every cluster by these figures.
        ap.error(
            f"--write-capacity needs a table of at least {MIN_CAPACITY_ROWS:,} rows (the "
            f"figures tf-dlt plan sizes shards by); --rows {args.rows:,} would replace them "
            "with a small table's"
        )
    dim, rng = args.dim, np.random.default_rng(0)
    stops = [s for s in (1_000_000, 10_000_000, 30_000_000, args.rows) if s <= args.rows]
    stops = sorted(set(stops))
    at: dict[int, dict] = {}  # type: ignore[type-arg]
    with LocalCluster(2, "--log-level", "WARNING") as cluster:
        client = tf_dlt.Client(cluster.addresses, request_timeout=300)
        client.create_table(TABLE, dim, optimizer=args.optimizer)
        inserted, insert_seconds = 0, 0.0
        for stop in stops:
            while inserted < stop:
                n = min(INSERT_BATCH, stop - inserted)
                start = time.perf_counter()
                client.pull(TABLE, np.arange(inserted, inserted + n))
                insert_seconds += time.perf_counter() - start
                inserted += n
            tables = client.list_tables()[TABLE]
            rss = sum(_rss(p.pid) for p in cluster.processes)
            m = measure(client, stop, dim, rng)
            m.update(
                rows=stop, table_bytes_per_row=tables["bytes"] / stop, rss_bytes_per_row=rss / stop,
                insert_rows_per_s=inserted / insert_seconds,
            )  # fmt: skip
            at[stop] = m
            log(f"{stop:>11,} rows: {json.dumps({k: round(v, 3) for k, v in m.items()})}")
            emit({"name": "scale_point", "dim": dim, "optimizer": args.optimizer, "shards": 2, **m})
            if stop == stops[0]:
                for batch in (1024, 4096, 16384, 65536, 262144):
                    ids = rng.integers(0, stop, size=batch)
                    times = sorted_seconds(
                        lambda ids=ids: client.pull(TABLE, ids, training=False), warmup=1
                    )
                    emit({"name": "pull_vs_batch", "rows": stop, "batch": batch, "dim": dim,
                          "shards": 2, "rows_per_s": batch / times[len(times) // 2]})  # fmt: skip
        last = at[stops[-1]]
        # The latency target, A/B: a 1M-row table in the same shards, measured
        # alternately with the full one (single points above swing with load).
        client.create_table(SMALL, dim, optimizer=args.optimizer)
        for start in range(0, stops[0], INSERT_BATCH):
            client.pull(SMALL, np.arange(start, min(start + INSERT_BATCH, stops[0])))
        pairs = [
            (measure(client, stops[0], dim, rng, SMALL), measure(client, stops[-1], dim, rng))
            for _ in range(5)
        ]
        for batch in (65536, 1024):
            key = f"pull_p50_ms_{batch}"
            small_ms = float(np.median([a[key] for a, _ in pairs]))
            big_ms = float(np.median([b[key] for _, b in pairs]))
            emit({
                "name": f"scale_pull_latency_{batch}", "rows": stops[-1], "dim": dim,
                "unit": "ms p50", "value": big_ms, "target_ratio": "<= 1.5",
                "baseline_name": f"{stops[0]:,}-row table in the same shards, interleaved x5",
                "baseline_value": small_ms,
            })  # fmt: skip
        client.drop_table(SMALL)
        ck = Path(args.checkpoint)
        shutil.rmtree(ck, ignore_errors=True)
        start = time.perf_counter()
        client.save(str(ck))
        save_s = time.perf_counter() - start
        client.close()
    size = sum(p.stat().st_size for p in ck.iterdir())
    with LocalCluster(2, "--log-level", "WARNING") as fresh:
        with tf_dlt.Client(fresh.addresses, request_timeout=300, persist_timeout=3600) as client:
            start = time.perf_counter()
            client.load(str(ck))
            load_s = time.perf_counter() - start
            assert client.list_tables()[TABLE]["rows"] == stops[-1]
    shutil.rmtree(ck, ignore_errors=True)
    emit({"name": "scale_save", "rows": stops[-1], "bytes": size, "seconds": save_s,
          "gb_per_s": size / save_s / 1e9})  # fmt: skip
    emit({"name": "scale_load", "rows": stops[-1], "bytes": size, "seconds": load_s,
          "gb_per_s": size / load_s / 1e9})  # fmt: skip
    if args.write_capacity:
        figures = {
            "measured": time.strftime("%Y-%m-%d"),
            "machine": "2 vCPU, 24 GiB, loopback, local disk (docs/benchmarks.md)",
            "command": "python bench/bench_scale.py --write-capacity",
            "dim": dim,
            "optimizer": args.optimizer,
            "rows": stops[-1],
            "shards": 2,
            "table_bytes_per_row": last["table_bytes_per_row"],
            "rss_bytes_per_row": last["rss_bytes_per_row"],
            "raw_record_bytes": capacity.raw_record_bytes(dim, args.optimizer),
            "generation_bytes": capacity.GENERATION_BYTES,
            "pull_rows_per_s_per_shard": last["pull_rows_per_s"] / 2,
            "push_rows_per_s_per_shard": last["push_rows_per_s"] / 2,
            "save_bytes_per_s_per_shard": size / save_s / 2,
            "load_bytes_per_s_per_shard": size / load_s / 2,
            "checkpoint_bytes_per_row": size / stops[-1],
        }
        CAPACITY.parent.mkdir(exist_ok=True)
        # What other benchmarks measured (per-core throughput from
        # bench_wire.py, the tier's figures) is kept.
        kept = json.loads(CAPACITY.read_text()) if CAPACITY.exists() else {}
        CAPACITY.write_text(json.dumps({**kept, **figures}, indent=2, sort_keys=True) + "\n")
        log(f"wrote {CAPACITY}")


if __name__ == "__main__":
    main()
