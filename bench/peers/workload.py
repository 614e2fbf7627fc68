"""The side-by-side workload, run the same way by both sides:

    python bench/peers/workload.py tfra      # in the TFRA environment (TF 2.16.2)
    python bench/peers/workload.py tf_dlt    # in tf_dlt's environment (TF 2.21)
    python bench/peers/workload.py keras sgd|adagrad   # keras.layers.Embedding in process
    python bench/peers/workload.py tf_sparse # tf.Variable + ResourceSparseApplyAdagradV2

(each also takes --keys N: N keys instead of 1M.)

Same ids (numpy PCG64, seed 0), dim, batch and optimizer (Adagrad, lr 0.05)
on both sides. Prints one JSON object: keys/s for insert (1M new keys with
given values), lookup (batches of 65536 present keys) and a full Keras train
step (embedding lookup, a Dense head, MSE, gradients, sparse Adagrad),
median of 7 after warm-up. Only numpy, TensorFlow and the side's own package
are imported, so it runs in TFRA's older environment too.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np


def _common() -> Any:
    """bench/common.py (standard library only: it imports in TFRA's env
    too), by its path."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common.py")
    spec = importlib.util.spec_from_file_location("common", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_median_and_max = _common().median_seconds


def median_seconds(fn):  # type: ignore[no-untyped-def]
    return _median_and_max(fn, reps=7, warmup=1)[0]


KEYS, DIM, LOOKUP_BATCH, TRAIN_BATCH, LR = 1_000_000, 16, 65536, 4096, 0.05


def data():  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**62, size=KEYS, dtype=np.int64)
    values = rng.normal(0, 0.05, size=(KEYS, DIM)).astype(np.float32)
    lookups = [keys[rng.integers(0, KEYS, size=LOOKUP_BATCH)] for _ in range(8)]
    train_x = [keys[rng.integers(0, KEYS, size=(TRAIN_BATCH, 1))] for _ in range(8)]
    train_y = rng.normal(size=(TRAIN_BATCH, 1)).astype(np.float32)
    return keys, values, lookups, train_x, train_y


def run_tfra():  # type: ignore[no-untyped-def]
    import tensorflow as tf
    import tf_keras
    from tensorflow_recommenders_addons import dynamic_embedding as de

    keys, values, lookups, train_x, train_y = data()
    table = de.get_variable("bench", key_dtype=tf.int64, dim=DIM, init_size=2 * KEYS)

    @tf.function
    def upsert(k, v):  # type: ignore[no-untyped-def]
        table.upsert(k, v)

    lookup = tf.function(lambda k: table.lookup(k))
    out = {}
    tk, tv = tf.constant(keys), tf.constant(values)
    start = time.perf_counter()
    upsert(tk, tv)
    out["insert_keys_per_s"] = KEYS / (time.perf_counter() - start)
    batches = [tf.constant(b) for b in lookups]
    i = iter(range(10**9))
    out["lookup_keys_per_s"] = LOOKUP_BATCH / median_seconds(
        lambda: lookup(batches[next(i) % len(batches)]).numpy()
    )
    inp = tf_keras.Input((1,), dtype=tf.int64)
    emb = de.keras.layers.Embedding(DIM, initializer=tf_keras.initializers.Zeros(), name="emb")
    x = tf_keras.layers.Flatten()(emb(inp))
    model = tf_keras.Model(inp, tf_keras.layers.Dense(1)(x))
    optimizer = de.DynamicEmbeddingOptimizer(tf_keras.optimizers.Adagrad(LR))
    out["train_keys_per_s"] = _step_keys_per_s(model, optimizer, train_x, train_y)
    out["versions"] = {"tensorflow": tf.__version__}
    return out


def run_tf_dlt(pservers):  # type: ignore[no-untyped-def]
    import keras
    import tensorflow as tf

    import tf_dlt
    from tf_dlt import dlt_ops as ops
    from tf_dlt.table_config import TableConfig

    keys, values, lookups, train_x, train_y = data()
    client = ops.ClientResource(pservers)
    config = TableConfig.create("bench", DIM, "zeros", tf_dlt.optimizers.Adagrad(), 0)
    if client.embedded:
        tf_dlt.embedded.create_table(config)
    else:
        with tf_dlt.Client(pservers) as c:
            c.create_table(config.name, DIM, "zeros", "adagrad")
    out = {}
    start = time.perf_counter()
    ops.assign(client, tf.constant(keys), tf.constant(values), "bench", DIM)
    out["insert_keys_per_s"] = KEYS / (time.perf_counter() - start)
    lookup = tf.function(lambda k: ops.lookup(client, k, "bench", DIM, training=False))
    batches = [tf.constant(b) for b in lookups]
    i = iter(range(10**9))
    out["lookup_keys_per_s"] = LOOKUP_BATCH / median_seconds(
        lambda: lookup(batches[next(i) % len(batches)]).numpy()
    )
    inp = keras.Input((1,), dtype="int64")
    layer = tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, optimizer="adagrad", learning_rate=LR,
        embeddings_initializer="zeros", name="bench_emb", table_name="bench",
    )  # fmt: skip
    layer.use_client(client)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(layer(inp))))
    optimizer = keras.optimizers.Adagrad(LR)
    out["train_keys_per_s"] = _step_keys_per_s(model, optimizer, train_x, train_y)
    out["versions"] = {"tensorflow": tf.__version__}
    return out


def _step_keys_per_s(model, optimizer, train_x, train_y):  # type: ignore[no-untyped-def]
    """Keys/s of a tf.function train step (tape, MSE, apply_gradients): the
    same step TFRA's side runs."""
    import tensorflow as tf

    @tf.function
    def step(x, y):  # type: ignore[no-untyped-def]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    xs, y = [tf.constant(b) for b in train_x], tf.constant(train_y)
    j = iter(range(10**9))
    return TRAIN_BATCH / median_seconds(lambda: step(xs[next(j) % len(xs)], y).numpy())


def run_keras(optimizer):  # type: ignore[no-untyped-def]
    import keras

    keys, values, lookups, train_x, train_y = data()
    # keras.layers.Embedding needs ids 0..n-1: the same batches, remapped.
    index = {int(k): i for i, k in enumerate(keys)}
    remap = [np.vectorize(index.__getitem__)(b).astype(np.int64) for b in train_x]
    inp = keras.Input((1,), dtype="int64")
    emb = keras.layers.Embedding(KEYS, DIM, embeddings_initializer="zeros")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    opt = keras.optimizers.Adagrad(LR) if optimizer == "adagrad" else keras.optimizers.SGD(LR)
    return {"train_keys_per_s": _step_keys_per_s(model, opt, remap, train_y)}


def run_tf_sparse():  # type: ignore[no-untyped-def]
    """The local sparse-variable step: rows in a tf.Variable, gathered, the
    same head and loss, rows updated by ResourceSparseApplyAdagradV2."""
    import keras
    import tensorflow as tf

    keys, values, lookups, train_x, train_y = data()
    index = {int(k): i for i, k in enumerate(keys)}
    remap = [np.vectorize(index.__getitem__)(b).astype(np.int64) for b in train_x]
    table = tf.Variable(tf.zeros([KEYS, DIM]))
    accum = tf.Variable(tf.fill([KEYS, DIM], 0.1))
    kernel = tf.Variable(tf.random.normal([DIM, 1], stddev=0.1))
    bias = tf.Variable(tf.zeros([1]))
    head = keras.optimizers.Adagrad(LR)  # the dense head, as on the other sides

    @tf.function
    def step(x, y):  # type: ignore[no-untyped-def]
        ids = tf.reshape(x, [-1])
        with tf.GradientTape() as tape:
            tape.watch(table)
            rows = tf.gather(table, ids)
            loss = tf.reduce_mean((tf.matmul(rows, kernel) + bias - y) ** 2)
        g_rows, g_kernel, g_bias = tape.gradient(loss, [rows, kernel, bias])
        tf.raw_ops.ResourceSparseApplyAdagradV2(
            var=table.handle, accum=accum.handle, lr=LR, epsilon=1e-7, grad=g_rows, indices=ids
        )
        head.apply_gradients([(g_kernel, kernel), (g_bias, bias)])
        return loss

    xs, y = [tf.constant(b) for b in remap], tf.constant(train_y)
    j = iter(range(10**9))
    return {"train_keys_per_s": TRAIN_BATCH / median_seconds(
        lambda: step(xs[next(j) % len(xs)], y).numpy())}  # fmt: skip


if __name__ == "__main__":
    if "--keys" in sys.argv:  # fewer keys (bench_peers --keys: a smoke run)
        at = sys.argv.index("--keys")
        KEYS = int(sys.argv[at + 1])
        del sys.argv[at : at + 2]
    side = sys.argv[1]
    if side == "tfra":
        result = run_tfra()
    elif side == "tf_dlt":
        result = run_tf_dlt([a for a in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if a])
    elif side == "tf_sparse":
        result = run_tf_sparse()
    else:
        result = run_keras(sys.argv[2] if len(sys.argv) > 2 else "sgd")
    print("RESULT " + json.dumps(result), flush=True)
