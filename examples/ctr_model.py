"""A small click-through-rate task shared by the examples: 13 dense and 26
categorical features with Zipf-distributed ids, and a model whose categorical
embeddings live in one distributed table."""

from __future__ import annotations

import quiet_tensorflow  # noqa: F401  (first: TensorFlow loads without its log lines)

# isort: split

from typing import Any

import keras
import numpy as np

import tf_dlt

NUM_DENSE, NUM_CATEGORICAL, DIM = 13, 26, 8
VOCAB_PER_FEATURE = 1_000_000


def make_data(
    n: int, seed: int, zipf: float = 1.2, vocab: int = VOCAB_PER_FEATURE
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Features and 0/1 labels; categorical values Zipf(`zipf`) over `vocab`
    ids per feature. Each categorical value has a hidden effect (a fixed
    function of the id), so the embeddings have something to learn."""
    rng = np.random.default_rng(seed)
    dense = rng.normal(size=(n, NUM_DENSE)).astype("float32")
    values = rng.zipf(zipf, size=(n, NUM_CATEGORICAL)) % vocab
    # One table for all features: the feature index goes into the high bits.
    ids = (np.arange(NUM_CATEGORICAL, dtype=np.int64) << 40) + values.astype(np.int64)
    effect = np.sin(ids % 9973 * 0.37) * 0.6
    logit = effect.sum(axis=1) * 0.5 + dense[:, :3].sum(axis=1) * 0.5 - 0.5
    labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype("float32")[:, None]
    return {"dense_features": dense, "categorical_ids": ids}, labels


def make_model(name: str = "ctr_emb", **table_options: Any) -> keras.Model:
    """The model; `table_options` go to the distributed Embedding (a memory
    policy, e.g. admission=tf_dlt.admission.Frequency(3))."""
    dense = keras.Input((NUM_DENSE,), name="dense_features")
    categorical = keras.Input((NUM_CATEGORICAL,), dtype="int64", name="categorical_ids")
    embedded = tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, optimizer="adagrad", learning_rate=0.05,
        name=name, **table_options,
    )(categorical)  # fmt: skip
    x = keras.layers.Concatenate()([keras.layers.Flatten()(embedded), dense])
    x = keras.layers.Dense(64, activation="relu")(x)
    out = keras.layers.Dense(1, activation="sigmoid")(x)
    model = keras.Model([dense, categorical], out)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="binary_crossentropy",
        metrics=[keras.metrics.AUC(name="auc")],
    )
    return model
