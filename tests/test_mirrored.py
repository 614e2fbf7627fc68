"""MirroredStrategy on one host: two replicas (two logical CPU devices, set
up in a fresh process before TensorFlow starts) push their
gradients together once per step; with SGD (and with a LossScaleOptimizer
around it) the table must end where keras.layers.Embedding under the same
strategy ends."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_dlt
from tf_dlt import dlt_ops as ops

VOCAB, DIM, STEPS, BATCH = 50, 4, 10, 16
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
assert strategy.num_replicas_in_sync == 2

def model(layer):
    inp = keras.Input((3,), dtype="int64")
    dense = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")
    m = keras.Model(inp, dense(keras.layers.Flatten()(layer(inp))))
    opt = keras.optimizers.SGD(0.1)
    if sys.argv[1] == "loss_scaled":
        opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=2.0**10)
    m.compile(optimizer=opt, loss="mse")
    return m

with strategy.scope():
    layer = tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, optimizer="sgd", learning_rate=0.1,
        sync_push=True, name="mirrored")
    dist = model(layer)
    keras_emb = keras.layers.Embedding(VOCAB, DIM)
    local = model(keras_emb)

def rows():
    ids = np.arange(VOCAB, dtype=np.int64)
    return ops.lookup(layer.client, ids, "mirrored", DIM, training=False).numpy()

keras_emb.set_weights([rows()])
rng = np.random.default_rng(0)
x = rng.integers(0, VOCAB, size=(BATCH * STEPS, 3)).astype("int64")
y = rng.normal(size=(BATCH * STEPS, 1)).astype("float32")
h1 = dist.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
h2 = local.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-5)
np.testing.assert_allclose(rows(), keras_emb.get_weights()[0], atol=1e-5)
np.testing.assert_allclose(dist.predict(x, verbose=0), local.predict(x, verbose=0), atol=1e-5)
assert int(layer.pushes.numpy()) == 2 * STEPS, int(layer.pushes.numpy())
print("OK", h1.history["loss"])
"""


@pytest.mark.parametrize("optimizer", ["sgd", "loss_scaled"])
def test_mirrored_strategy_two_replicas_match_keras_embedding(
    tmp_path: Path, optimizer: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, optimizer], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK" in out.stdout


RAGGED = """
import sys
import numpy as np, tensorflow as tf
replicas = int(sys.argv[1])
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
import keras, tf_dlt
from tf_dlt import dlt_ops as ops

strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
assert strategy.num_replicas_in_sync == replicas
rng = np.random.default_rng(0)
lengths = rng.integers(1, 5, size=64)
ids = tf.RaggedTensor.from_row_lengths(rng.integers(1, 50, size=lengths.sum()), lengths)
y = rng.integers(0, 2, size=(64, 1)).astype("float32")
data = tf.data.Dataset.from_tensor_slices((ids, y)).batch(8)
with strategy.scope():
    inp = keras.Input(shape=(None,), ragged=True, dtype="int64")
    layer = tf_dlt.layers.Embedding(
        output_dim=4, is_distributed=True, combiner="mean", optimizer="sgd",
        learning_rate=0.5, sync_push=True, name="multi_hot")
    out = keras.layers.Dense(1, activation="sigmoid")(layer(inp))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy")
seen = np.unique(ids.flat_values.numpy())
before = ops.lookup(layer.client, seen, "multi_hot", 4, training=False).numpy()
history = model.fit(data, epochs=3, verbose=0)
losses = history.history["loss"]
assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
after = ops.lookup(layer.client, seen, "multi_hot", 4, training=False).numpy()
assert not np.allclose(before, after)
assert int(layer.pushes.numpy()) == 3 * 8, int(layer.pushes.numpy())
model.evaluate(data, verbose=0)
assert model.predict(data, verbose=0).shape == (64, 1)
# A dense batch given to a combiner is still refused (at the step's trace).
dense = tf.data.Dataset.from_tensor_slices((ids.to_tensor(), y)).batch(8)
try:
    model.fit(dense, epochs=1, verbose=0)
except ValueError as e:
    assert "feed a RaggedTensor or SparseTensor" in str(e), e
else:
    raise AssertionError("dense ids were taken by a combiner")
print("OK", losses)
"""


@pytest.mark.parametrize("replicas", [1, 2])
def test_ragged_ids_with_a_combiner_train_under_mirrored_strategy(
    tmp_path: Path, replicas: int
) -> None:
    """Ragged ids (a multi-hot feature, combiner="mean") through `fit`,
    `evaluate` and `predict` under a MirroredStrategy: with two replicas
    Keras's build from the first batch failed (`AttributeError:
    'RaggedTensor' object has no attribute 'device'`, a plain Keras model's
    too); with one, the layer refused the dense stand-in Keras builds it
    from."""
    out = subprocess.run(
        [sys.executable, "-c", RAGGED, str(replicas)], capture_output=True, text=True,
        timeout=300, cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "OK" in out.stdout


DENSE_ON_SHARDS = """
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_dlt

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(1)(inp))
    model.compile(optimizer=tf_dlt.DenseOnShards([], "sgd", 0.1, table="mirrored_dense"),
                  loss="mse")
try:
    model.fit(np.ones((32, 4)), np.ones((32, 1)), batch_size=16, verbose=0)
except tf_dlt.errors.InvalidArgumentError as e:
    assert "2 replicas" in e.message, e.message
    print("REFUSED")
"""


def test_dense_on_shards_refuses_several_replicas(tmp_path: Path) -> None:
    """Under a MirroredStrategy each replica pushed its part of the batch's
    gradients as a step of its own: the dense weights trained unlike Keras
    SGD (0.03 apart after one epoch), without a word."""
    out = subprocess.run(
        [sys.executable, "-c", DENSE_ON_SHARDS], capture_output=True, text=True, timeout=300,
        cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "REFUSED" in out.stdout, out.stdout[-2000:]
