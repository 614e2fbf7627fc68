"""Soak: training goes on through a failure every --every seconds
(docs/replication.md).

One 2-shard cluster with a sync standby per shard (LocalCluster replicas=2).
A trainer thread takes steps (a pull and a push of random ids) for
--seconds. Every --every seconds the process serving one shard (the shards
in turn) is killed (-9) and started again at once: it rejoins its shard
(--replica-set) and follows the standby that took over; the next kill of
that shard waits until it caught up. Reported: steps, kills, errors that
reached the trainer (must be 0), the longest step across each kill (the
baseline: the median step), and the rows that differ at the end from a local
table that applied the same pushes once each (must be 0).

Usage: python bench/bench_soak.py [--seconds 600] [--every 30] [--ids 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import tf_dlt
from tf_dlt.server.local import LocalCluster
from tf_dlt.table_config import TableConfig

from bench_failover import DIM, Trainer, wait_covered
from common import emit, log

SHARDS = 2


def _serving(cluster: LocalCluster, client: tf_dlt.Client, shard: int) -> int:
    """The process serving `shard` now."""
    port = client.stats()[shard]["data_port"]
    return cluster.process_addresses.index(f"127.0.0.1:{port}")


def _covered(client: tf_dlt.Client, shard: int, standby: str) -> bool:
    """True when `shard`'s standby is `standby` and caught up."""
    standbys = client.stats()[shard]["standbys"]
    return bool(standbys) and standbys[0]["caught_up"] and standbys[0]["address"] == standby


def soak(ids: np.ndarray, seconds: float, every: float, workdir: Path) -> dict[str, object]:
    config = TableConfig.create("emb", DIM, optimizer="adagrad")
    with LocalCluster(SHARDS, workdir=workdir, replicas=2) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table_from_config(config)
        admin = tf_dlt.Client(cluster.addresses)  # the bench's own, for stats
        wait_covered(admin)
        trainer = Trainer(client, ids, config).start()
        began = time.monotonic()
        kills: list[float] = []
        try:
            while not trainer.failures and time.monotonic() - began + every <= seconds:
                time.sleep(max(0.0, began + (len(kills) + 1) * every - time.monotonic()))
                shard = len(kills) % SHARDS
                victim = _serving(cluster, admin, shard)
                kills.append(time.monotonic())
                cluster.kill(victim)
                cluster.restart(victim)  # rejoins as the standby of the one that took over
                deadline = time.monotonic() + 60
                while not _covered(admin, shard, cluster.process_addresses[victim]):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"process {victim} did not rejoin shard {shard} in 60 s")
                    time.sleep(0.1)
                log(f"kill {len(kills)} at {kills[-1] - began:.0f} s: process {victim} (shard "
                    f"{shard}) killed, restarted and caught up again")  # fmt: skip
            time.sleep(max(0.0, began + seconds - time.monotonic()))
        finally:
            trainer.stop()
        differ = trainer.rows_differing()
    times = trainer.times
    stalls = []
    for k, at in enumerate(kills):
        until = kills[k + 1] if k + 1 < len(kills) else float("inf")
        stalls.append(max((s for t, s in times if t + s >= at and t < until), default=0.0))
    return {
        "steps": len(times),
        "kills": len(kills),
        "errors": len(trainer.failures),
        "first_error": str(trainer.failures[0]) if trainer.failures else "",
        "stalls": stalls,
        "median_step": statistics.median(s for _, s in times),
        "differ": differ,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--every", type=float, default=30.0)
    p.add_argument("--ids", type=int, default=1024)
    args = p.parse_args()
    ids = np.arange(args.ids, dtype=np.int64)
    with tempfile.TemporaryDirectory(prefix="bench_soak-") as tmp:
        r = soak(ids, args.seconds, args.every, Path(tmp))
    stalls = sorted(r["stalls"])  # type: ignore[call-overload]
    emit(
        {
            "bench": "soak",
            "seconds": args.seconds,
            "every_s": args.every,
            "ids": args.ids,
            "steps": r["steps"],
            "kills": r["kills"],
            # Must be 0: no error reaches the trainer, no row is lost or
            # applied twice.
            "errors": r["errors"],
            "first_error": r["first_error"],
            "rows_differing_from_oracle": r["differ"],
            "value": round(stalls[-1], 3) if stalls else None,
            "baseline_value": round(r["median_step"], 4),  # type: ignore[call-overload]
            "what": "longest step (pull + push) across any kill, seconds; baseline: the "
            "median step",
            "stall_s_median": round(statistics.median(stalls), 3) if stalls else None,
        }
    )
    if r["errors"] or r["differ"]:
        raise SystemExit(f"soak failed: {r['errors']} errors, {r['differ']} rows differ")


if __name__ == "__main__":
    main()
