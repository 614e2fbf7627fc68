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

Usage: python bench/bench_reshard.py [--rows 1000000] [--ids 4096] [--reshards 2] [--pace F]
(--pace: default the shards' own, 1/16 of their host's cores)
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from step_trainer import StepTrainer

import tf_dlt
from tf_dlt.server.local import LocalCluster
from tf_dlt.table_config import TableConfig

from common import emit, log

DIM = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--ids", type=int, default=4096)
    p.add_argument("--reshards", type=int, default=2, help="alternately 2 -> 3 and 3 -> 2")
    p.add_argument("--settle", type=float, default=3.0, help="seconds of training between")
    p.add_argument(
        "--pace", type=float, default=None,
        help="tf-dlt reshard --pace: the fraction of the time a stream's copy keeps a core busy",
    )  # fmt: skip
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
        trainer = StepTrainer(
            tf_dlt.Client(two), config, lambda rng: rng.integers(0, args.rows, args.ids)
        )
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
            done = admin.reshard(to, pace=args.pace)
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
        differ = trainer.rows_differing(np.arange(args.rows, dtype=np.int64))
    stall = max(m["stall_s"] for m in moves)
    streaming = min(m["rows_per_s_streaming"] for m in moves)
    emit({
        "bench": "reshard",
        "rows": args.rows,
        "ids": args.ids,
        "pace": args.pace,
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
