"""Steadiness of remote training: `model.fit` of a CTR model on 2 local shard
processes against the same model on embedded tables, alternated in one run.

The stream: 26 categorical features with Zipf(--zipf) ids over 1M values
each, 13 dense features, dim 16 rows with Adagrad, batch 1024, fed by a
`tf.data.Dataset`. Each repetition trains a fresh embedded model and a
fresh model transpiled onto a fresh 2-shard cluster for --epochs epochs on
the same data: as is, with `tf_dlt.pull_ahead` and with it at
refresh=False. Each run is a trainer process of its own, as a training job
is (--one-process: all in this one). Per epoch it records examples/s and, for the remote models,
the trainer's table traffic (`tf_dlt.ClientMetrics`: pull, push and lookup p50/p99, seconds spent in
lookups, pulls ahead used, pushes in flight at the epoch's end) and the
shards' side: seconds they spent serving pulls and pushes (ShardTime).

Reported (JSON lines, bench/out/results.jsonl): each remote epoch against
the embedded epoch of the same repetition and index; each kind of remote run
against the embedded runs (examples/s summed over repetitions, target
>= 0.9); per kind, the spread of the repetitions (slowest / fastest total
examples/s, target >= 0.9, i.e. within 10%) and how many epochs ran slower
than the one before them (target 0); and per remote kind the bytes and round
trips per step to the shards with the step time they imply on a 25 Gbit/s,
100 us round-trip network (see `projection`).

Usage: python bench/bench_fit_steady.py [--examples 500000] [--reps 3]
       [--epochs 2] [--batch 1024] [--one-iterator] [--no-autotune]
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import time
from typing import Any

import keras
import tensorflow as tf

import tf_dlt
from tf_dlt.server.local import LocalCluster

from bench_keras import model
from common import emit, example, log, print_result, result_of

_ctr = example("ctr_model")
make_data = _ctr.make_data

DIM = 16
# The remote runs of each repetition: plain, and with tf_dlt.pull_ahead (ids
# pushed in between pulled again, or not).
REMOTE = ("remote", "remote pull-ahead", "remote pull-ahead no refresh")
# The datacenter network the traffic is projected onto.
NET_GBIT, NET_RTT_US = 25.0, 100.0


class EpochClock(keras.callbacks.Callback):  # type: ignore[misc]
    """Seconds of each epoch, and the logs ClientMetrics added to it."""

    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[dict[str, Any]] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        seconds = time.perf_counter() - self._start
        kept = {k: float(v) for k, v in (logs or {}).items() if k.startswith("dlt_")}
        self.epochs.append({"seconds": seconds, **kept})

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._start = time.perf_counter()

    def teardown(self) -> None:
        """Once fit returned: the seconds from its end to here, after a full
        garbage collection (which frees its data iterator if a cycle holds
        it), in the last epoch's record: tf.data's stall when the iterator
        is destroyed (docs/keras.md) would show here."""
        gc.collect()
        self.epochs[-1]["teardown_s"] = time.perf_counter() - self._start


class ShardTime(keras.callbacks.Callback):  # type: ignore[misc]
    """Seconds the shards spent serving pulls and pushes in each epoch,
    summed over shards: the other side of the step's split. From the shards'
    latency histograms (`tf_dlt.Client.stats`), each call counted at its
    bucket's midpoint (buckets are 1.25x wide: within about 11%)."""

    def __init__(self, addresses: list[str]) -> None:
        super().__init__()
        self._client = tf_dlt.Client(addresses)
        self.epochs: list[dict[str, float]] = []
        self._start: dict[str, float] = {}

    def _served(self) -> dict[str, float]:
        shards = self._client.stats(buckets=True)
        out = {}
        for kind in ("pull", "push"):
            micros = 0.0
            for shard in shards:
                bounds = shard["bucket_bounds_us"]
                for i, count in enumerate(shard[f"{kind}_latency"]["buckets"]):
                    micros += int(count) * (bounds[max(i - 1, 0)] + bounds[i]) / 2
            out[f"shard_{kind}_s"] = micros / 1e6
        return out

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = self._served()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epochs.append({k: v - self._start[k] for k, v in self._served().items()})


def fit(
    m: keras.Model,
    data: tf.data.Dataset,
    epochs: int,
    steps_per_epoch: int | None,
    addresses: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Epochs of `m.fit`; with the shards' `addresses`, the trainer's
    (ClientMetrics) and the shards' (ShardTime) side of each."""
    clock = EpochClock()
    kwargs = {"epochs": epochs, "steps_per_epoch": steps_per_epoch, "verbose": 0}
    if addresses is None:
        m.fit(data, callbacks=[clock], **kwargs)
        clock.teardown()
        return clock.epochs
    shards = ShardTime(addresses)
    m.fit(data, callbacks=[tf_dlt.ClientMetrics(logs="all"), shards, clock], **kwargs)
    clock.teardown()
    return [{**e, **s} for e, s in zip(clock.epochs, shards.epochs, strict=True)]


def layer(name: str) -> tf_dlt.layers.Embedding:
    return tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, optimizer="adagrad", learning_rate=0.05, name=name
    )


def projection(
    kind: str, runs: list[dict[str, list[dict[str, Any]]]], examples: int, batch: int
) -> dict[str, Any]:
    """Bytes and round trips per step to the shards, measured, and the step
    time they imply on a datacenter network (NET_GBIT, NET_RTT_US): the
    compute of a step (the embedded run's) plus the network time on the
    step's critical path. A plain lookup waits for a round trip and its
    bytes; with pull-ahead only the ids the lookup pulls again (pushed and
    not refreshed ahead) are on it, the pull ahead and its refreshes ahead
    overlapping the steps before. Pushes are
    asynchronous: off the path while fewer than max_inflight_pushes wait."""
    epochs = [e for run in runs for e in run[kind]]
    steps = len(epochs) * -(-examples // batch)
    per_step = {
        key: sum(e[f"dlt_{key}"] for e in epochs) / steps
        for key in ("pulls", "pull_bytes", "pushes", "push_bytes", "pulled_ahead_stale_rows",
                    "pulled_ahead_refreshed_rows")
    }  # fmt: skip
    row_bytes = 8 + 4 * DIM
    bytes_per_us = NET_GBIT * 1e9 / 8 / 1e6
    if kind == "remote":
        on_path_us = NET_RTT_US + per_step["pull_bytes"] / bytes_per_us
        on_path_trips = 1.0
    else:  # pulled ahead: only the ids pulled again at the lookup wait, in one more round trip
        again = per_step["pulled_ahead_stale_rows"] - per_step["pulled_ahead_refreshed_rows"]
        on_path_trips = 1.0 if again > 0 else 0.0
        on_path_us = on_path_trips * NET_RTT_US + again * row_bytes / bytes_per_us
    compute_us = (
        1e6
        * sum(e["seconds"] for run in runs for e in run["embedded"])
        / (len(runs) * len(runs[0]["embedded"]) * -(-examples // batch))
    )
    return {
        "bench": "fit_steady", "case": f"{kind} network projection", "unit": "examples/s",
        "network": f"{NET_GBIT:g} Gbit/s, {NET_RTT_US:g} us round trip",
        "value": round(batch / ((compute_us + on_path_us) / 1e6)),
        "baseline_name": "compute only (embedded step time)",
        "baseline_value": round(batch / (compute_us / 1e6)),
        "per_step": {k: round(v, 1) for k, v in per_step.items()},
        "round_trips_on_path": on_path_trips, "network_us_on_path": round(on_path_us, 1),
        "compute_us": round(compute_us, 1),
    }  # fmt: skip


_DATA: dict[tuple[int, int, float], tf.data.Dataset] = {}


def one_run(kind: str, rep: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The epochs of one run of `kind` (embedded, or one of REMOTE on a
    fresh 2-shard cluster)."""
    key = (args.examples, args.batch, args.zipf)
    if key not in _DATA:
        x, y = make_data(args.examples, seed=0, zipf=args.zipf)
        data = (
            tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).prefetch(tf.data.AUTOTUNE)
        )
        if args.no_autotune:  # no autotuning thread, so no stall when an iterator is destroyed
            options = tf.data.Options()
            options.autotune.enabled = False
            data = data.with_options(options)
        _DATA[key] = data
    data, steps = _DATA[key], None
    if args.one_iterator:  # Keras keeps one iterator for all epochs
        data, steps = data.repeat(), -(-args.examples // args.batch)
    if kind == "embedded":
        m = model(layer(f"steady_embedded_{rep}"), keras.optimizers.Adam(1e-3))
        return fit(m, data, args.epochs, steps)
    with LocalCluster(2, "--log-level", "WARNING") as cluster:
        remote_model = tf_dlt.transpile(
            model(layer(f"steady_{rep}"), keras.optimizers.Adam(1e-3)), cluster.addresses
        )
        if kind != "remote":
            tf_dlt.pull_ahead(remote_model, refresh=not kind.endswith("no refresh"))
        return fit(remote_model, data, args.epochs, steps, cluster.addresses)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--examples", type=int, default=500_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument(
        "--one-process", action="store_true",
        help="every run in this process (as before), the earlier runs' models and clients "
        "still in it",
    )  # fmt: skip
    p.add_argument(
        "--one-iterator", action="store_true",
        help="the dataset repeated, with steps_per_epoch: one iterator for all epochs, which "
        "avoids tf.data's stall at an epoch's start (docs/benchmarks.md)",
    )  # fmt: skip
    p.add_argument(
        "--no-autotune", action="store_true",
        help="the dataset with tf.data's autotuning off (docs/keras.md, 'Training')",
    )  # fmt: skip
    p.add_argument("--run", help=argparse.SUPPRESS)  # "kind,rep": one run, in this process
    args = p.parse_args()
    if args.run:
        kind, rep = args.run.rsplit(",", 1)
        print_result(one_run(kind, int(rep), args))
        return
    # Per repetition, the epochs of each kind of run.
    runs: list[dict[str, list[dict[str, Any]]]] = []
    for rep in range(args.reps):
        run = {}
        for kind in ("embedded", *REMOTE):
            log(f"repetition {rep + 1}: {kind}")
            if args.one_process:
                run[kind] = one_run(kind, rep, args)
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--run", f"{kind},{rep}",
                 "--examples", str(args.examples), "--epochs", str(args.epochs),
                 "--batch", str(args.batch), "--zipf", str(args.zipf),
                 *(["--one-iterator"] if args.one_iterator else []),
                 *(["--no-autotune"] if args.no_autotune else [])],
                capture_output=True, text=True, check=True, timeout=1800,
            ).stdout  # fmt: skip
            run[kind] = result_of(out)
        runs.append(run)
    common = {"bench": "fit_steady", "examples": args.examples, "batch": args.batch,
              "dim": DIM, "zipf": args.zipf, "unit": "examples/s",
              "processes": "one" if args.one_process else "one per run",
              "iterators": "one per fit" if args.one_iterator else "one per epoch",
              "autotune": not args.no_autotune}  # fmt: skip
    for rep, run in enumerate(runs):
        for kind in REMOTE:
            for epoch, (e, r) in enumerate(zip(run["embedded"], run[kind], strict=True)):
                emit({
                    **common, "case": f"{kind} epoch", "rep": rep + 1, "epoch": epoch + 1,
                    "value": round(args.examples / r["seconds"]),
                    "baseline_name": "embedded tables, same repetition and epoch",
                    "baseline_value": round(args.examples / e["seconds"]),
                    "client": {k: round(v, 3) for k, v in r.items() if k != "seconds"},
                })  # fmt: skip
    seen = args.examples * args.epochs
    totals = {
        kind: [seen / sum(e["seconds"] for e in run[kind]) for run in runs]
        for kind in ("embedded", *REMOTE)
    }
    for kind in REMOTE:
        emit({
            **common, "case": f"{kind} vs embedded", "value": round(sum(totals[kind])),
            "baseline_name": "embedded tables, same repetitions",
            "baseline_value": round(sum(totals["embedded"])), "target_ratio": ">= 0.9",
        })  # fmt: skip
    for kind in REMOTE:
        emit(projection(kind, runs, args.examples, args.batch))
    for kind, values in totals.items():
        slower = sum(
            later["seconds"] > earlier["seconds"]
            for run in runs
            for earlier, later in zip(run[kind], run[kind][1:], strict=False)
        )
        emit({
            **common, "case": f"{kind} spread", "value": round(min(values)),
            "baseline_name": "fastest repetition", "baseline_value": round(max(values)),
            "repetitions": [round(t) for t in values], "epochs_slower_than_previous": slower,
            "fit_teardown_s": [round(run[kind][-1]["teardown_s"], 3) for run in runs],
            "target_ratio": "reported" if kind == "embedded" else ">= 0.9 and no slower epoch",
        })  # fmt: skip


if __name__ == "__main__":
    main()
