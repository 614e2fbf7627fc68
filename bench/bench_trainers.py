"""Multi-trainer scaling: 1, 2 and 4 trainer processes training one CTR table
on the same 2 local shard processes at once.

Each trainer is a process of its own (this script with --trainer): the CTR
stream of bench_fit_steady.py (26 Zipf(--zipf) features in one dim-16
Adagrad table, batch 1024, a `tf.data.Dataset`), its own slice of the
examples (--examples per trainer), its own dense weights, asynchronous
pushes. The trainers wait for each other at a file barrier before `fit`, so
they train at the same time; each reports its examples/s over --epochs
epochs. Per trainer count the shards are fresh.

Reported (JSON lines, bench/out/results.jsonl): per trainer count, the mean
examples/s per trainer against the single trainer of the same run, and the
sum over trainers. The machine has 2 cores for the shards and every
trainer, so per-trainer speed falls with the count by construction; the sum
shows what the shards sustain.

Usage: python bench/bench_trainers.py [--trainers 1,2,4] [--examples 100000]
       [--epochs 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import emit, example, log, print_result, result_of

DIM = 16


def trainer(args: argparse.Namespace) -> None:
    """One trainer: waits at the barrier, trains, prints its examples/s."""
    import keras
    import tensorflow as tf

    from bench_keras import model

    make_data = example("ctr_model").make_data

    import tf_dlt

    x, y = make_data(args.examples, seed=100 + args.index, zipf=args.zipf)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(1024).prefetch(tf.data.AUTOTUNE)
    layer = tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, optimizer="adagrad", learning_rate=0.05,
        name="scale_emb", seed=1,
    )  # fmt: skip
    remote = tf_dlt.transpile(model(layer, keras.optimizers.Adam(1e-3)), args.pservers.split(","))
    barrier = Path(args.barrier)
    (barrier / f"ready_{args.index}").touch()
    deadline = time.monotonic() + 300
    while len(list(barrier.glob("ready_*"))) < args.count:
        if time.monotonic() > deadline:
            raise SystemExit("the other trainers did not get ready within 300 s")
        time.sleep(0.05)
    start = time.perf_counter()
    remote.fit(data, epochs=args.epochs, verbose=0)
    seconds = time.perf_counter() - start
    print_result({"examples_per_s": args.examples * args.epochs / seconds})


def run(count: int, args: argparse.Namespace) -> list[float]:
    """Examples/s of each of `count` trainers training at once."""
    from tf_dlt.server.local import LocalCluster

    with LocalCluster(2, "--log-level", "WARNING") as cluster, tempfile.TemporaryDirectory() as b:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--trainer",
                    "--index",
                    str(i),
                    "--count",
                    str(count),
                    "--pservers",
                    ",".join(cluster.addresses),
                    "--barrier",
                    b,
                    "--examples",
                    str(args.examples),
                    "--epochs",
                    str(args.epochs),
                    "--zipf",
                    str(args.zipf),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            )  # fmt: skip
            for i in range(count)
        ]
        rates = []
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"a trainer failed (exit {p.returncode}): {out[-2000:]}")
            rates.append(result_of(out)["examples_per_s"])
    return rates


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trainers", default="1,2,4")
    p.add_argument("--examples", type=int, default=100_000, help="per trainer")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--pservers", default="", help=argparse.SUPPRESS)
    p.add_argument("--barrier", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer:
        trainer(args)
        return
    results = {}
    for count in (int(c) for c in args.trainers.split(",")):
        log(f"{count} trainer(s) on 2 shard processes")
        results[count] = run(count, args)
    single = sum(results[min(results)]) / len(results[min(results)])
    for count, rates in results.items():
        emit({
            "bench": "trainers", "case": f"{count} trainers", "shards": 2, "dim": DIM,
            "examples_per_trainer": args.examples, "epochs": args.epochs, "zipf": args.zipf,
            "unit": "examples/s per trainer", "value": round(sum(rates) / len(rates)),
            "baseline_name": f"{min(results)} trainer(s), same run",
            "baseline_value": round(single),
            "per_trainer": [round(r) for r in rates], "sum": round(sum(rates)),
        })  # fmt: skip


if __name__ == "__main__":
    main()
