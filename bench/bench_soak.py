"""Soak: training goes on through a failure or a re-shard every --every
seconds (docs/replication.md).

--events kill (the default): one 2-shard cluster with a sync standby per
shard (LocalCluster replicas=2; --replicas 3: two standbys, which elect the
one that takes over). Every --every seconds the process serving
one shard (the shards in turn) is killed (-9) and started again at once: it
rejoins its shard (--replica-set) and follows the standby that took over;
the next kill of that shard waits until it caught up.

--events reshard: one 2-shard cluster and a joining process; every --every
seconds the tables move to 3 shards, or back to 2 (tf_dlt.Client.reshard).

--events both: the kill cluster (sync standbys, the joining shard with one
too) with kills and re-shards in turn: a process killed after a re-shard
restarts with the flags of the layout before and takes its shard's new
place as it rejoins.

Either way a trainer thread takes steps (a pull and a push of random ids)
for --seconds. Reported: steps, events, errors that reached the trainer
(must be 0), the longest step across each event (the baseline: the median
step), and the rows that differ at the end from a local table that applied
the same pushes once each (must be 0).

Usage: python bench/bench_soak.py [--seconds 600] [--every 30] [--ids 1024]
       [--events kill|reshard|both] [--replicas 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from step_trainer import StepTrainer

import tf_dlt
from tf_dlt.server.local import LocalCluster
from tf_dlt.table_config import TableConfig

from bench_failover import DIM, wait_covered
from common import emit, log

SHARDS = 2


def _serving(cluster: LocalCluster, client: tf_dlt.Client, shard: int) -> int:
    """The process serving `shard` now."""
    port = client.stats()[shard]["data_port"]
    return cluster.process_addresses.index(f"127.0.0.1:{port}")


def _covered(client: tf_dlt.Client, shard: int, standby: str, count: int) -> bool:
    """True when `shard` has `count` caught-up standbys, `standby` one of them."""
    caught = [s["address"] for s in client.stats()[shard]["standbys"] if s["caught_up"]]
    return len(caught) >= count and standby in caught


class Kills:
    """Each event kills the process serving a shard (in turn) and restarts
    it; it rejoins as its shard's standby."""

    def __init__(self, cluster: LocalCluster, admin: tf_dlt.Client) -> None:
        self.cluster, self.admin, self.count = cluster, admin, 0
        wait_covered(admin, cluster.replicas - 1)

    def __call__(self) -> str:
        shard = self.count % len(self.admin.stats())  # 2 or 3 shards with re-shards
        self.count += 1
        victim = _serving(self.cluster, self.admin, shard)
        self.cluster.kill(victim)
        self.cluster.restart(victim)  # rejoins as the standby of the one that took over
        deadline = time.monotonic() + 60
        address = self.cluster.process_addresses[victim]
        while not _covered(self.admin, shard, address, self.cluster.replicas - 1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {victim} did not rejoin shard {shard} in 60 s")
            time.sleep(0.1)
        return f"process {victim} (shard {shard}) killed, restarted and caught up again"


class Reshards:
    """Each event moves the tables to 3 shards, or back to 2."""

    def __init__(self, cluster: LocalCluster, admin: tf_dlt.Client) -> None:
        self.two = list(cluster.addresses)
        self.three = [*self.two, cluster.join(replicas=cluster.replicas)]
        self.admin, self.count = admin, 0

    def __call__(self) -> str:
        to = self.three if self.count % 2 == 0 else self.two
        self.count += 1
        done = self.admin.reshard(to)
        return f"re-shard to {len(to)} shards (writes held {done['held_s'] * 1e3:.0f} ms)"


def soak(
    ids: np.ndarray, seconds: float, every: float, workdir: Path, events: str, replicas: int
) -> dict[str, object]:
    config = TableConfig.create("emb", DIM, optimizer="adagrad")
    replicas = 1 if events == "reshard" else replicas
    with LocalCluster(SHARDS, workdir=workdir, replicas=replicas) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table_from_config(config)
        admin = tf_dlt.Client(cluster.addresses)  # the bench's own, for stats and re-shards
        kinds: list[Callable[[], str]] = []
        if events != "reshard":
            kinds.append(Kills(cluster, admin))
        if events != "kill":
            kinds.append(Reshards(cluster, admin))
        trainer = StepTrainer(client, config, lambda rng: rng.choice(ids, len(ids))).start()
        began = time.monotonic()
        at: list[float] = []
        try:
            while not trainer.failures and time.monotonic() - began + every <= seconds:
                time.sleep(max(0.0, began + (len(at) + 1) * every - time.monotonic()))
                at.append(time.monotonic())
                what = kinds[(len(at) - 1) % len(kinds)]()
                log(f"event {len(at)} at {at[-1] - began:.0f} s: {what}")
            time.sleep(max(0.0, began + seconds - time.monotonic()))
        finally:
            trainer.stop()
        differ = trainer.rows_differing(ids)
    times = trainer.steps
    stalls = []
    for k, t0 in enumerate(at):
        until = at[k + 1] if k + 1 < len(at) else float("inf")
        stalls.append(max((s for t, s in times if t + s >= t0 and t < until), default=0.0))
    return {
        "steps": len(times),
        "events": len(at),
        "errors": len(trainer.failures),
        "first_error": str(trainer.failures[0]) if trainer.failures else "",
        "stalls": stalls,
        "median_step": statistics.median(s for _, s in times),
        "differ": differ,
        "replicas": replicas,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--every", type=float, default=30.0)
    p.add_argument("--ids", type=int, default=1024)
    p.add_argument(
        "--events", choices=("kill", "reshard", "both"), default="kill",
        help="kill: a primary killed -9 (standbys); reshard: 2 -> 3 or 3 -> 2 shards; "
        "both: the two in turn (standbys)",
    )  # fmt: skip
    p.add_argument(
        "--replicas", type=int, default=2, choices=(2, 3, 4, 5),
        help="processes per shard with kills: the primary and replicas - 1 sync standbys",
    )  # fmt: skip
    args = p.parse_args()
    ids = np.arange(args.ids, dtype=np.int64)
    with tempfile.TemporaryDirectory(prefix="bench_soak-") as tmp:
        r = soak(ids, args.seconds, args.every, Path(tmp), args.events, args.replicas)
    stalls = sorted(r["stalls"])  # type: ignore[call-overload]
    emit(
        {
            "bench": "soak",
            "seconds": args.seconds,
            "every_s": args.every,
            "ids": args.ids,
            "steps": r["steps"],
            "events": args.events,
            "replicas": r["replicas"],
            "event_count": r["events"],
            # Must be 0: no error reaches the trainer, no row is lost or
            # applied twice.
            "errors": r["errors"],
            "first_error": r["first_error"],
            "rows_differing_from_oracle": r["differ"],
            "value": round(stalls[-1], 3) if stalls else None,
            "baseline_value": round(r["median_step"], 4),  # type: ignore[call-overload]
            "what": "longest step (pull + push) across any event, seconds; baseline: the "
            "median step",
            "stall_s_median": round(statistics.median(stalls), 3) if stalls else None,
        }
    )
    if r["errors"] or r["differ"]:
        raise SystemExit(f"soak failed: {r['errors']} errors, {r['differ']} rows differ")


if __name__ == "__main__":
    main()
