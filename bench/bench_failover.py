"""Failover of a hot standby (docs/replication.md): how long a trainer's pulls
stall across `kill -9` of its shard's primary, over several kills.

Each kill: a fresh 2-shard cluster with one sync standby per shard
(LocalCluster replicas=2), a table trained a little, then a trainer thread
pulling in a loop while shard 1's primary is killed. The stall is the longest
pull across the kill; the baseline, measured in the same run, is the longest
pull of the same loop before the kill. Also checked each time: the rows read
after the takeover equal those before the kill (no push ran meanwhile).

Usage: python bench/bench_failover.py [--kills 20] [--ids 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import tf_dlt
from tf_dlt.server.local import LocalCluster

from common import emit, log

DIM = 16


def one_kill(ids: np.ndarray, workdir: Path) -> tuple[float, float, bool]:
    """(longest pull before the kill, longest pull across it, rows equal)."""
    with LocalCluster(2, workdir=workdir, replicas=2) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, optimizer="adagrad")
        rng = np.random.default_rng(0)
        for _ in range(10):
            client.push("emb", ids, rng.normal(size=(len(ids), DIM)).astype(np.float32), 0.1)
        deadline = time.monotonic() + 30
        while not all(
            s["standbys"] and s["standbys"][0]["caught_up"] for s in client.stats()
        ):  # every standby holds its primary's tables
            if time.monotonic() > deadline:
                raise TimeoutError("the standbys did not catch up in 30 s")
            time.sleep(0.05)
        expected = client.pull("emb", ids)
        times: list[tuple[float, float]] = []  # (start, seconds) of each pull
        stop = threading.Event()
        same = [True]

        def trainer() -> None:
            while not stop.is_set():
                start = time.monotonic()
                rows = client.pull("emb", ids)
                times.append((start, time.monotonic() - start))
                same[0] &= bool(np.array_equal(rows, expected))

        thread = threading.Thread(target=trainer)
        thread.start()
        time.sleep(1.0)
        killed = time.monotonic()
        cluster.kill(1)
        time.sleep(0.5)
        # Until pulls have run a while after the takeover.
        while not times or times[-1][0] < killed + 0.5 or time.monotonic() < killed + 3:
            time.sleep(0.05)
        stop.set()
        thread.join()
    before = max(s for t, s in times if t + s < killed)
    across = max(s for t, s in times if t + s >= killed)
    return before, across, same[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--ids", type=int, default=1024)
    args = p.parse_args()
    ids = np.arange(args.ids, dtype=np.int64)
    before, across, equal = [], [], True
    with tempfile.TemporaryDirectory(prefix="bench_failover-") as tmp:
        for k in range(args.kills):
            b, a, same = one_kill(ids, Path(tmp) / f"kill{k}")
            before.append(b)
            across.append(a)
            equal &= same
            log(f"kill {k}: longest pull before {b * 1e3:.1f} ms, across the kill {a:.2f} s")
    across.sort()
    p99 = across[min(len(across) - 1, int(round(0.99 * (len(across) - 1))))]
    emit(
        {
            "bench": "failover",
            "kills": args.kills,
            "ids": args.ids,
            "value": round(p99, 3),
            "baseline_value": round(max(before), 4),
            "what": "longest pull across a primary's kill -9 (p99 over kills), seconds; "
            "baseline: longest pull before it",
            "stall_s_median": round(statistics.median(across), 3),
            "stall_s_max": round(across[-1], 3),
            "rows_equal_after_takeover": equal,
        }
    )


if __name__ == "__main__":
    main()
