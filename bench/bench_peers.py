"""Side by side with TensorFlow Recommenders-Addons (shared/research/perf.md
section 3), measured in the same run on the same machine.

TFRA 0.8.1 runs only with TensorFlow 2.16.2 and tf-keras, so this script
creates that environment itself (once, in .bench/tfra-venv):

    python3 -m venv .bench/tfra-venv
    .bench/tfra-venv/bin/pip install tensorflow==2.16.2 \\
        tensorflow-recommenders-addons==0.8.1 tf-keras==2.16.0

and runs bench/peers/workload.py in it (TF_USE_LEGACY_KERAS=1) and in
tf_dlt's environment: same ids, dim 16, batches, Adagrad. Reports tf_dlt /
TFRA for insert (1M keys with values), lookup (batches of 65536) and a full
Keras train step (batch 4096), tf_dlt embedded (in process, like TFRA's CPU
table) and on 2 shard processes; and the train step against in-process
keras.layers.Embedding with SGD and with Adagrad, and against a tf.Variable
updated by ResourceSparseApplyAdagradV2 (the local sparse step). TFRA and tf_dlt embedded
run twice, interleaved; the median of the two is reported.

Usage: python bench/bench_peers.py
       python bench/bench_peers.py --without-tfra   # tf_dlt on 2 shards vs
           embedded only: 3 interleaved pairs, medians and per-pair ratios
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tf_dlt.server.local import LocalCluster

from common import emit, log, result_of

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".bench" / "tfra-venv"
WORKLOAD = ROOT / "bench" / "peers" / "workload.py"
TFRA_PACKAGES = ["tensorflow==2.16.2", "tensorflow-recommenders-addons==0.8.1", "tf-keras==2.16.0"]


def ensure_tfra_env() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        log(f"creating {VENV} (TensorFlow 2.16.2 + TFRA 0.8.1 + tf-keras; a few minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TFRA_PACKAGES], check=True)
    return python


# Keys of the workload (bench/peers/workload.py --keys); main() sets it.
_keys = 1_000_000


def run(python: Path | str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(
        [str(python), str(WORKLOAD), *args, "--keys", str(_keys)], capture_output=True,
        text=True, timeout=1800, env={**os.environ, **(env or {})}, cwd="/",
    )  # fmt: skip
    result: dict[str, Any] | None = result_of(out.stdout)
    if out.returncode != 0 or result is None:
        raise RuntimeError(f"{args[0]} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    log(f"{' '.join(args)}: {result}")
    return result


def _median(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """The median of two runs (their mean) of every rate."""
    return {k: (a[k] + b[k]) / 2 for k in a if k.endswith("_per_s")}


def shards_vs_embedded(reps: int) -> None:
    """tf_dlt alone: the train step (and lookup) on 2 shard processes
    against embedded tables, `reps` interleaved pairs, each run a process."""
    runs: dict[str, list[dict[str, Any]]] = {"embedded": [], "2_shards": []}
    for _ in range(reps):
        runs["embedded"].append(run(sys.executable, "tf_dlt"))
        with LocalCluster(2, "--log-level", "WARNING") as cluster:
            runs["2_shards"].append(run(sys.executable, "tf_dlt", ",".join(cluster.addresses)))
    for op, batch in (("lookup", 65536), ("train", 4096)):
        key = f"{op}_keys_per_s"
        shards = [r[key] for r in runs["2_shards"]]
        embedded = [r[key] for r in runs["embedded"]]
        emit({"name": f"peers_{op}_2_shards_vs_embedded", "dim": 16, "batch": batch,
              "unit": "keys/s", "value": statistics.median(shards),
              "baseline_name": "tf_dlt embedded, same run (medians)",
              "baseline_value": statistics.median(embedded),
              "pairs": [round(s / e, 3) for s, e in zip(shards, embedded, strict=True)],
              "target_ratio": ">= 0.9" if op == "train" else "reported"})  # fmt: skip


def main() -> None:
    global _keys
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--without-tfra", action="store_true",
        help="only tf_dlt on 2 shards against embedded (no TFRA environment)",
    )  # fmt: skip
    p.add_argument("--keys", type=int, default=1_000_000, help="keys of the workload")
    p.add_argument("--reps", type=int, default=3, help="pairs of runs (--without-tfra)")
    args = p.parse_args()
    _keys = args.keys
    if args.without_tfra:
        shards_vs_embedded(reps=args.reps)
        return
    tfra_python = ensure_tfra_env()
    tfra_env = {"TF_USE_LEGACY_KERAS": "1"}
    tfra_runs, dlt_runs = [], []
    for _ in range(2):  # interleaved, so both see the same machine
        tfra_runs.append(run(tfra_python, "tfra", env=tfra_env))
        dlt_runs.append(run(sys.executable, "tf_dlt"))
    tfra, dlt = _median(*tfra_runs), _median(*dlt_runs)
    with LocalCluster(2, "--log-level", "WARNING") as cluster:
        shards = run(sys.executable, "tf_dlt", ",".join(cluster.addresses))
    keras_sgd = run(sys.executable, "keras", "sgd")
    keras_adagrad = run(sys.executable, "keras", "adagrad")
    tf_sparse = run(sys.executable, "tf_sparse")
    common = {"dim": 16, "keys": _keys, "peer": "TFRA 0.8.1 (TF 2.16.2, tf-keras)"}
    for op, batch in (("insert", 1_000_000), ("lookup", 65536), ("train", 4096)):
        key = f"{op}_keys_per_s"
        for side, result in (("embedded", dlt), ("2_shards", shards)):
            emit({**common, "name": f"peers_{op}_{side}", "batch": batch, "unit": "keys/s",
                  "value": result[key], "baseline_name": "TFRA, same run",
                  "baseline_value": tfra[key]})  # fmt: skip
    baselines = (
        ("keras_sgd", keras_sgd, "keras.layers.Embedding + SGD in process"),
        ("keras_adagrad", keras_adagrad, "keras.layers.Embedding + Adagrad in process"),
        ("tf_sparse", tf_sparse, "tf.Variable + ResourceSparseApplyAdagradV2 in process"),
    )
    for name, baseline, label in baselines:
        for side, result in (("embedded", dlt), ("2_shards", shards)):
            emit({"name": f"peers_train_{side}_vs_{name}", "batch": 4096, "dim": 16,
                  "unit": "keys/s", "value": result["train_keys_per_s"],
                  "baseline_name": f"{label}, same run",
                  "baseline_value": baseline["train_keys_per_s"]})  # fmt: skip


if __name__ == "__main__":
    main()
