"""The one list of benchmarks: each case is a script of bench/ with the
arguments of a full run and those of a quick one (a tiny size: a smoke test
that the case still runs; its figures mean nothing). `python bench` and
bench/run_all.sh run them from this list; tests/test_bench.py runs every
case quick."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # bench/<name>.py
    what: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()


CASES = (
    Case("bench_core", "table core: batched lookup and apply vs a C gather; memory per row",
         quick=("--rows", "20000", "--memory-rows", "20000", "--batch", "1024")),
    Case("bench_persist", "checkpoint save and load GB/s vs the disk's own",
         quick=("--rows", "20000", "--reps", "2")),
    Case("bench_stores", "checkpoint save and load GB/s on a real HDFS and S3 vs local disk",
         quick=("--rows", "20000", "--reps", "1")),
    Case("bench_delta", "delta checkpoints vs full; a follower's freshness",
         quick=("--rows", "20000", "--rounds", "1", "--interval", "0.5", "--skip-freshness")),
    Case("bench_embedded_persist", "peak memory of an embedded tf_dlt.save / load vs the rows",
         quick=("--rows", "20000")),
    Case("bench_ops", "TF ops: remote and embedded lookups vs tf.nn.embedding_lookup",
         quick=("--rows", "20000", "--batch", "1024")),
    Case("bench_wire", "the data path without TensorFlow: shards x threads x clients vs a "
         "local gather and one TCP stream",
         full=("--threads", "1,2", "--exchange-threads", "1,2"),
         quick=("--ids", "4096", "--dim", "16", "--calls", "3", "--threads", "1",
                "--rows", "20000", "--standby", "none,sync", "--standbys", "2")),
    Case("bench_wire_targets", "where the data path's and a standby's targets stand on this "
         "machine: every case its cores allow, against each target",
         quick=("--quick", "--reps", "1")),
    Case("bench_failover", "hot standbys: a trainer's longest pull across kill -9 of a primary",
         quick=("--kills", "1", "--ids", "256")),
    Case("bench_reshard", "live re-sharding: a trainer's stall across 2 -> 3 -> 2 shards",
         quick=("--rows", "20000", "--reshards", "2", "--settle", "1")),
    Case("bench_soak", "training through a kill -9 and a rejoin, or a re-shard, every 30 s",
         quick=("--seconds", "8", "--every", "3", "--ids", "256", "--events", "both")),
    Case("bench_connections", "one shard serving many connections",
         quick=("--connections", "8", "--seconds", "0.5")),
    Case("bench_keras", "model.fit examples/s: tf_dlt vs keras.layers.Embedding",
         quick=("--examples", "4096", "--batch", "512")),
    Case("bench_fit_steady", "remote model.fit: steadiness, pull-ahead, epoch by epoch",
         quick=("--examples", "4096", "--reps", "1", "--epochs", "1")),
    Case("bench_cache", "hot-row cache: bytes pulled, AUC and examples/s",
         quick=("--train", "4096", "--validation", "1024", "--epochs", "1", "--rows", "1000",
                "--steps", "4")),
    Case("bench_trainers", "1, 2, 4 trainer processes on 2 shards",
         quick=("--trainers", "1", "--examples", "2048", "--epochs", "1")),
    Case("bench_scale", "100M rows on one machine; writes the capacity figures",
         full=("--write-capacity",), quick=("--rows", "50000")),
    Case("bench_admission", "Frequency admission: memory and AUC vs none",
         quick=("--train", "20000", "--test", "2000", "--min-counts", "2")),
    Case("bench_memory", "memory policy costs: 16-bit bytes, admission, sweeps",
         quick=("--cases", "admission,sweep", "--sweep-rows", "20000")),
    Case("bench_tiers", "a table 10x the memory budget on the disk tier",
         quick=("--rows", "400000", "--fractions", "0.25", "--seconds", "1")),
    Case("bench_tier_scale", "5e8 rows grown under a 6 GiB budget: growth, Zipf and uniform pulls",
         full=("--grow-seconds", "3600"),
         quick=("--rows", "1500000", "--budget", str(300 << 20), "--baseline-rows", "100000",
                "--seconds", "1")),
    Case("bench_peers", "side by side with TFRA (a TF 2.16 environment of its own)",
         quick=("--without-tfra", "--keys", "20000", "--reps", "1")),
)  # fmt: skip


def named(names: list[str]) -> list[Case]:
    """The cases of `names` (all when empty), in list order; ValueError
    naming an unknown one."""
    known = {case.name: case for case in CASES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {sorted(known)}")
    return [case for case in CASES if not names or case.name in names]
