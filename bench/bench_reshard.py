"""Live re-sharding while a trainer trains (docs/replication.md): how long
its steps stall across a re-shard's switch, and how fast it trains while
the buckets stream, over re-shards 2 -> 3 -> 2 of one table.

A 2-shard cluster (LocalCluster) and a joining process; one Adagrad table of
--rows rows (assigned first, so the streams have rows to move); a trainer
thread takes steps (a pull and a push of --ids random ids) in a loop and
applies the same pushes once each to a local table. The baseline, measured
in the same run, is the trainer before the first re-shard: its longest step
and its rows/s. Each re-shard reports its longest step across the switch
(the steps that overlap the time writes were held), the trainer's rows/s
while the buckets streamed, and the seconds writes were held. At the end:
no step raised, and how many rows differ from the local table (must be 0).

Usage: python bench/bench_reshard.py [--rows 1000000] [--ids 4096] [--reshards 2]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import numpy as np

import tf_dlt
from tf_dlt import _native
from tf_dlt.server.local import LocalCluster
from tf_dlt.table_config import TableConfig

from common import emit, log

DIM = 16


class Trainer:
    """A trainer thread taking steps until stopped, timing each and applying
    the same pushes once each to a local table (`oracle`)."""

    def __init__(self, client: tf_dlt.Client, rows: int, ids: int, config: TableConfig) -> None:
        self.oracle = _native.Table(config.to_dict())
        self.steps: list[tuple[float, float]] = []  # (start, seconds)
        self.failures: list[BaseException] = []
        self._client, self._rows, self._ids = client, rows, ids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        rng = np.random.default_rng(1)
        try:
            while not self._stop.is_set():
                batch = rng.integers(0, self._rows, self._ids)
                grads = rng.normal(size=(self._ids, DIM)).astype(np.float32)
                start = time.monotonic()
                self._client.pull("emb", batch)
                self._client.push("emb", batch, grads, 0.05)
                self.steps.append((start, time.monotonic() - start))
                self.oracle.push(batch, grads, 0.05)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.failures.append(e)

    def start(self) -> Trainer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def rows_per_s(self, begin: float, end: float) -> float:
        """Rows pulled and pushed per second by steps that began in [begin, end)."""
        inside = [s for t, s in self.steps if begin <= t < end]
        return 2 * self._ids * len(inside) / max(end - begin, 1e-9)

    def longest(self, begin: float, end: float) -> float:
        """The longest step that overlapped [begin, end)."""
        return max((s for t, s in self.steps if t < end and t + s >= begin), default=0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--ids", type=int, default=4096)
    p.add_argument("--reshards", type=int, default=2, help="alternately 2 -> 3 and 3 -> 2")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of training between")
    args = p.parse_args()
    config = TableConfig.create("emb", DIM, optimizer="adagrad", seed=3)
    with (
        tempfile.TemporaryDirectory(prefix="bench_reshard-") as tmp,
        LocalCluster(2, workdir=tmp) as cluster,
    ):
        two = list(cluster.addresses)
        three = [*two, cluster.join()]
        admin = tf_dlt.Client(two)
        admin.create_table_from_config(config)
        values = np.random.default_rng(0).normal(size=(65536, DIM)).astype(np.float32) * 0.01
        for first in range(0, args.rows, 65536):
            ids = np.arange(first, min(first + 65536, args.rows), dtype=np.int64)
            admin.assign("emb", ids, values[: len(ids)])
        log(f"{args.rows} rows assigned on 2 shards")
        trainer = Trainer(tf_dlt.Client(two), args.rows, args.ids, config)
        # The oracle holds the assigned rows too.
        for first in range(0, args.rows, 65536):
            ids = np.arange(first, min(first + 65536, args.rows), dtype=np.int64)
            trainer.oracle.import_rows(ids, values[: len(ids)])
        trainer.start()
        time.sleep(args.settle)
        began = time.monotonic()
        baseline = (trainer.longest(began - args.settle + 0.5, began),
                    trainer.rows_per_s(began - args.settle + 0.5, began))  # fmt: skip
        moves = []
        for k in range(args.reshards):
            to = three if k % 2 == 0 else two
            start = time.monotonic()
            done = admin.reshard(to)
            end = time.monotonic()
            streamed_until = start + done["stream_s"]
            held = (end - done["held_s"], end)
            time.sleep(args.settle)
            moves.append({
                "to_shards": len(to),
                "stall_s": round(trainer.longest(*held), 3),
                "held_s": round(done["held_s"], 3),
                "stream_s": round(done["stream_s"], 2),
                "rows_per_s_streaming": round(trainer.rows_per_s(start, streamed_until)),
            })  # fmt: skip
            log(f"re-shard to {len(to)}: {moves[-1]}")
        trainer.stop()
        if trainer.failures:
            raise RuntimeError(f"a step failed: {trainer.failures[0]}")
        every = np.arange(args.rows, dtype=np.int64)
        pulled = admin.pull("emb", every, training=False)
        differ = int((pulled != trainer.oracle.pull(every)).any(axis=1).sum())
    stall = max(m["stall_s"] for m in moves)
    streaming = min(m["rows_per_s_streaming"] for m in moves)
    emit({
        "bench": "reshard",
        "rows": args.rows,
        "ids": args.ids,
        "value": stall,
        "baseline_value": round(baseline[0], 4),
        "what": "longest trainer step (pull + push) across a re-shard's switch, seconds "
        "(the worst re-shard); baseline: the longest step before any",
        "rows_per_s_before": round(baseline[1]),
        "rows_per_s_streaming_vs_before": round(streaming / max(baseline[1], 1), 3),
        "reshards": moves,
        "rows_differing_from_oracle": differ,
    })  # fmt: skip


if __name__ == "__main__":
    main()
