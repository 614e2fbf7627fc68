"""Failover of a hot standby (docs/replication.md): how long a trainer's steps
stall across `kill -9` of its shard's primary (or its going silent, with
--failure silence), over several kills.

Each kill: a fresh 2-shard cluster with one sync standby per shard
(LocalCluster replicas=2; --replicas 3 for two, which elect the one that
takes over), then a trainer thread taking steps (a pull and a
push of the same ids) in a loop while shard 1's primary is killed. The stall
is the longest step across the kill; the baseline, measured in the same run,
is the longest step of the same loop before the kill. Also checked each
time: no step raised, and how many rows at the end differ from a local table
that applied the same pushes once each: none with sync replication (a push
in flight at the kill is sent again and applied once); with async, the rows
of pushes acknowledged but not yet on the standby.

--failure silence stops the primary (SIGSTOP) instead of killing it: its
connections stay open and nothing answers, as when a host loses power or
its network, so the standby takes over only once the primary's Hellos time
out, and the trainer finds it by asking while it waits (kSilentMs).

Usage: python bench/bench_failover.py [--kills 20] [--ids 1024] [--replication async]
       [--replicas 3] [--failure silence]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from step_trainer import StepTrainer

import tf_dlt
from tf_dlt.server.local import LocalCluster
from tf_dlt.table_config import TableConfig

from common import emit, log

DIM = 16


def wait_covered(client: tf_dlt.Client, standbys: int, timeout: float = 30.0) -> None:
    """Until every shard's `standbys` standbys hold its primary's tables."""
    deadline = time.monotonic() + timeout
    while not all(
        len(s["standbys"]) == standbys and all(r["caught_up"] for r in s["standbys"])
        for s in client.stats()
    ):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the standbys did not catch up in {timeout} s")
        time.sleep(0.05)


def one_kill(
    ids: np.ndarray, workdir: Path, replication: str, replicas: int, failure: str
) -> tuple[float, float, int]:
    """(longest step before the kill, longest step across it, rows that
    differ from the oracle's)."""
    config = TableConfig.create("emb", DIM, optimizer="adagrad")
    flags = ("--replication", replication)
    with LocalCluster(2, *flags, workdir=workdir, replicas=replicas) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table_from_config(config)
        wait_covered(client, replicas - 1)
        trainer = StepTrainer(client, config, lambda rng: rng.choice(ids, len(ids))).start()
        time.sleep(1.0)
        killed = time.monotonic()
        if failure == "kill":
            cluster.kill(1)
        else:
            cluster.processes[1].send_signal(signal.SIGSTOP)
        times = trainer.steps
        # Until steps have run a while after the takeover.
        while not trainer.failures and (
            not times or times[-1][0] < killed + 0.5 or time.monotonic() < killed + 3
        ):
            time.sleep(0.05)
        trainer.stop()
        cluster.kill(1)  # a stopped process answers no SIGTERM
        if trainer.failures:
            raise RuntimeError(f"a step failed across the kill: {trainer.failures[0]}")
        differ = trainer.rows_differing(np.arange(len(ids), dtype=np.int64))
    before = max(s for t, s in times if t + s < killed)
    across = max(s for t, s in times if t + s >= killed)
    return before, across, differ


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--ids", type=int, default=1024)
    p.add_argument(
        "--replication", choices=("sync", "async"), default="sync",
        help="async: pushes acknowledged before the standby has them; the rows that then "
        "differ from the oracle are reported",
    )  # fmt: skip
    p.add_argument("--replicas", type=int, default=2, help="processes per shard (2 to 5)")
    p.add_argument(
        "--failure", choices=("kill", "silence"), default="kill",
        help="silence: SIGSTOP the primary (a host gone without a reset) instead of kill -9",
    )  # fmt: skip
    args = p.parse_args()
    if args.kills < 1 or args.ids < 1 or not 2 <= args.replicas <= 5:
        p.error("--kills and --ids must be at least 1, --replicas 2 to 5")
    ids = np.arange(args.ids, dtype=np.int64)
    before, across, differ = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_failover-") as tmp:
        for k in range(args.kills):
            b, a, d = one_kill(
                ids, Path(tmp) / f"kill{k}", args.replication, args.replicas, args.failure
            )
            before.append(b)
            across.append(a)
            differ.append(d)
            log(
                f"kill {k}: longest step before {b * 1e3:.1f} ms, across the kill {a:.2f} s; "
                f"{d} rows differ from the oracle"
            )
    across.sort()
    failure_words = "kill -9" if args.failure == "kill" else "going silent (SIGSTOP)"
    p99 = across[min(len(across) - 1, int(round(0.99 * (len(across) - 1))))]
    emit(
        {
            "bench": "failover",
            "kills": args.kills,
            "ids": args.ids,
            "value": round(p99, 3),
            "baseline_value": round(max(before), 4),
            "what": f"longest step (pull + push) across a primary's {failure_words} (p99 over "
            "kills), seconds; baseline: longest step before it",
            "failure": args.failure,
            "stall_s_median": round(statistics.median(across), 3),
            "stall_s_max": round(across[-1], 3),
            "replication": args.replication,
            "replicas": args.replicas,
            # Sync: must be 0 (a push in flight is sent again and applied
            # once). Async: the rows of pushes acknowledged but not yet on
            # the standby at the kill, out of `ids`.
            "rows_differing_from_oracle_max": max(differ),
            "rows_differing_from_oracle_median": statistics.median(differ),
        }
    )


if __name__ == "__main__":
    main()
