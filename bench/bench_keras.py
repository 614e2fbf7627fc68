"""Keras training benchmark (shared/research/perf.md B6): examples/s of
`model.fit` on the CTR model of examples/ctr_model.py (26 categorical + 13
dense features, dim 8), measured in one run:

- tf_dlt on 2 local shard processes (distributed Embedding, server-side SGD)
  vs the same model with keras.layers.Embedding + SGD in process
  (target >= 0.6x, goal >= 0.9x);
- tf_dlt embedded (in process) vs the same baseline;
- keras.layers.Embedding with Keras Adagrad, reported against the same baseline;
- tf_dlt on 2 shards vs the Keras baseline compiled with jit_compile=False
  (Keras' default "auto" compiles the local model with XLA; tf_dlt's layer
  turns XLA off).

Usage: python bench/bench_keras.py [--examples 100000] [--batch 1024]
"""

from __future__ import annotations

import argparse
import time

import keras
import numpy as np

import tf_dlt
from tf_dlt.server.local import LocalCluster

from common import emit, example, log

_ctr = example("ctr_model")
DIM, NUM_CATEGORICAL, NUM_DENSE = _ctr.DIM, _ctr.NUM_CATEGORICAL, _ctr.NUM_DENSE
make_data = _ctr.make_data

VOCAB = 100_000  # per feature, so a local table fits: 26 * 100k rows


def data(n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    x, y = make_data(n, seed=0)
    feature = np.arange(NUM_CATEGORICAL, dtype=np.int64) * VOCAB
    x["categorical_ids"] = feature + (x["categorical_ids"] & ((1 << 40) - 1)) % VOCAB
    return x, y


def model(
    embedding: keras.layers.Layer, optimizer: keras.optimizers.Optimizer, jit: object = "auto"
) -> keras.Model:
    dense = keras.Input((NUM_DENSE,), name="dense_features")
    ids = keras.Input((NUM_CATEGORICAL,), dtype="int64", name="categorical_ids")
    x = keras.layers.Concatenate()([keras.layers.Flatten()(embedding(ids)), dense])
    x = keras.layers.Dense(64, activation="relu")(x)
    m = keras.Model([dense, ids], keras.layers.Dense(1, activation="sigmoid")(x))
    m.compile(optimizer=optimizer, loss="binary_crossentropy", jit_compile=jit)
    return m


def examples_per_s(m: keras.Model, x: dict[str, np.ndarray], y: np.ndarray, batch: int) -> float:
    m.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # warm-up: tracing, rows created
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        m.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        rates.append(len(y) / (time.perf_counter() - start))
    return sorted(rates)[1]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--examples", type=int, default=100_000)
    p.add_argument("--batch", type=int, default=1024)
    args = p.parse_args()
    x, y = data(args.examples)
    rows = NUM_CATEGORICAL * VOCAB
    log("baseline: keras.layers.Embedding + SGD")
    sgd = examples_per_s(
        model(keras.layers.Embedding(rows, DIM), keras.optimizers.SGD(0.05)), x, y, args.batch
    )
    log("keras.layers.Embedding + SGD, jit_compile=False")
    sgd_no_xla = examples_per_s(
        model(keras.layers.Embedding(rows, DIM), keras.optimizers.SGD(0.05), jit=False),
        x, y, args.batch,
    )  # fmt: skip
    log("keras.layers.Embedding + Adagrad")
    adagrad = examples_per_s(
        model(keras.layers.Embedding(rows, DIM), keras.optimizers.Adagrad(0.05)), x, y, args.batch
    )

    def dlt_layer(name: str) -> tf_dlt.layers.Embedding:
        return tf_dlt.layers.Embedding(
            output_dim=DIM, is_distributed=True, optimizer="sgd", learning_rate=0.05, name=name
        )

    log("tf_dlt embedded")
    embedded = examples_per_s(
        model(dlt_layer("b6_embedded"), keras.optimizers.SGD(0.05)), x, y, args.batch
    )
    log("tf_dlt on 2 shard processes")
    with LocalCluster(2, "--log-level", "WARNING") as cluster:
        remote_model = tf_dlt.transpile(
            model(dlt_layer("b6_remote"), keras.optimizers.SGD(0.05)), cluster.addresses
        )
        remote = examples_per_s(remote_model, x, y, args.batch)
    common = {
        "examples": args.examples,
        "batch": args.batch,
        "dim": DIM,
        "unit": "examples/s",
        "baseline_name": "keras.layers.Embedding + SGD in process",
        "baseline_value": sgd,
    }
    emit(
        {
            **common,
            "name": "keras_fit_2_shards",
            "value": remote,
            "target_ratio": ">= 0.6 (goal 0.9)",
        }
    )
    emit(
        {
            **common,
            "name": "keras_fit_embedded",
            "value": embedded,
            "target_ratio": ">= 0.6 (goal 0.9)",
        }
    )
    emit(
        {**common, "name": "keras_fit_local_adagrad", "value": adagrad, "target_ratio": "reported"}
    )
    no_xla = {
        **common,
        "baseline_name": "keras.layers.Embedding + SGD, jit_compile=False",
        "baseline_value": sgd_no_xla,
    }
    emit(
        {
            **no_xla,
            "name": "keras_fit_2_shards_vs_no_xla",
            "value": remote,
            "target_ratio": ">= 0.6",
        }
    )


if __name__ == "__main__":
    main()
