"""tf_dlt.layers.Embedding as a drop-in for keras.layers.Embedding, the way a
user moving a model meets it: masks into an LSTM in a Functional model, the
Keras initializers and optimizers users already hold, `weights=`, sparse
inputs, Keras's own layer test harness, one inference semantics for ids
without a row, loss-scale skips, and transpile taking a cluster spec."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src import testing

import tf_dlt
from tf_dlt import dlt_ops as ops
from tf_dlt import errors, initializers, optimizers
from tf_dlt.layers import Embedding

from conftest import Cluster

VOCAB, DIM, STEPS = 40, 4, 20


# Keras's own harness, with the expectations Keras holds its Embedding to
# (keras/src/layers/core/embedding_test.py), on the local mode.
class KerasHarness(testing.TestCase):  # type: ignore[misc]
    def test_basics(self) -> None:
        for cls in (keras.layers.Embedding, Embedding):
            self.run_layer_test(
                cls,
                {"input_dim": 4, "output_dim": 3},
                input_shape=(2,),
                input_dtype="int32",
                expected_output_shape=(2, 3),
                expected_num_trainable_weights=1,
                expected_num_non_trainable_weights=0,
                expected_num_seed_generators=0,
                expected_num_losses=0,
                supports_masking=False,
            )
            self.run_layer_test(
                cls,
                {"input_dim": 5, "output_dim": 4, "mask_zero": True},
                input_shape=(2, 3),
                input_dtype="int64",
                expected_output_shape=(2, 3, 4),
                expected_num_trainable_weights=1,
                expected_num_non_trainable_weights=0,
                expected_num_seed_generators=0,
                expected_num_losses=0,
                supports_masking=True,
            )

    def test_sparse(self) -> None:
        self.run_layer_test(
            Embedding,
            {"input_dim": 5, "output_dim": 4},
            input_shape=(2, 3),
            input_dtype="int32",
            input_sparse=True,
            expected_output_shape=(2, 3, 4),
            expected_num_trainable_weights=1,
            expected_num_non_trainable_weights=0,
            expected_num_seed_generators=0,
            expected_num_losses=0,
            supports_masking=False,
        )

    def test_ragged(self) -> None:
        self.run_layer_test(
            Embedding,
            {"input_dim": 5, "output_dim": 4},
            input_shape=(2, 3),
            input_dtype="int32",
            input_ragged=True,
            expected_output_shape=(2, None, 4),
            expected_output_ragged=True,
            expected_num_trainable_weights=1,
            expected_num_non_trainable_weights=0,
            expected_num_seed_generators=0,
            expected_num_losses=0,
            supports_masking=False,
        )

    def test_correctness_dense_and_sparse(self) -> None:
        weights = np.array([[0.0, 0.0], [2.0, 2.0], [3.0, 3.0]], np.float32)
        for layer in (
            Embedding(3, 2, weights=weights),
            Embedding(3, 2, weights=[weights], is_distributed=True, name="correct_dist"),
        ):
            self.assertAllClose(layer(np.array([2, 1, 0])), weights[[2, 1, 0]])
            x = tf.SparseTensor([[0, 0], [1, 2]], [2, 1], (2, 3))
            self.assertAllClose(
                layer(x),
                [[[3.0, 3.0], [0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0], [2.0, 2.0]]],
            )


@pytest.mark.parametrize("is_distributed", [False, True])
def test_mask_zero_into_an_lstm_in_a_functional_model(is_distributed: bool) -> None:
    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.1, (VOCAB, DIM)).astype("float32")

    def model(emb: keras.layers.Layer) -> keras.Model:
        ids = keras.Input((6,), dtype="int64")
        hidden = keras.layers.LSTM(3, kernel_initializer="ones", recurrent_initializer="ones")
        return keras.Model(ids, keras.layers.Dense(1, kernel_initializer="ones")(hidden(emb(ids))))

    ours = model(
        Embedding(VOCAB, DIM, is_distributed=is_distributed, mask_zero=True, weights=weights,
                  optimizer="sgd", learning_rate=0.1, sync_push=True,
                  name=f"masked_{is_distributed}")
    )  # fmt: skip
    reference = model(keras.layers.Embedding(VOCAB, DIM, mask_zero=True, weights=weights))
    x = rng.integers(1, VOCAB, (32, 6))
    x[:, 4:] = 0  # padding the mask hides from the LSTM
    y = rng.normal(size=(32, 1)).astype("float32")
    np.testing.assert_allclose(
        ours.predict(x, verbose=0), reference.predict(x, verbose=0), atol=1e-6
    )
    # The mask reaches the LSTM: changing what sits under it changes nothing.
    padded = x.copy()
    padded[:, 4:] = 0
    assert ours._layers[1].compute_mask(tf.constant(padded)) is not None
    for m in (ours, reference):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = ours.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    expected = reference.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)


def test_local_tables_take_every_keras_initializer() -> None:
    k = keras.initializers
    for make in (
        lambda: k.RandomNormal(stddev=0.05, seed=1),
        lambda: k.GlorotUniform(seed=2),
        lambda: k.Orthogonal(seed=3),
        lambda: {"class_name": "HeNormal", "config": {"seed": 4}},
    ):
        ours = Embedding(VOCAB, DIM, embeddings_initializer=make())
        theirs = keras.layers.Embedding(VOCAB, DIM, embeddings_initializer=make())
        ours.build()
        theirs.build()
        np.testing.assert_array_equal(ours.embeddings.numpy(), theirs.embeddings.numpy())
        clone = Embedding.from_config(ours.get_config())
        assert clone.get_config() == ours.get_config()
    named = Embedding(VOCAB, DIM, embeddings_initializer="he_normal")
    named.build()
    assert named.embeddings.shape == (VOCAB, DIM)
    local = Embedding(VOCAB, DIM, embeddings_initializer=initializers.Constant(0.5))
    local.build()
    assert np.all(local.embeddings.numpy() == 0.5)


def test_distributed_tables_map_keras_initializers_with_their_arguments_and_seed() -> None:
    k = keras.initializers
    cases = [
        (k.RandomNormal(mean=0.1, stddev=0.05, seed=1), initializers.RandomNormal(0.1, 0.05), 1),
        (k.RandomUniform(-0.2, 0.3, seed=7), initializers.RandomUniform(-0.2, 0.3), 7),
        (k.TruncatedNormal(stddev=0.02), initializers.TruncatedNormal(0.0, 0.02), 0),
        (k.Zeros(), initializers.Zeros(), 0),
        (k.Ones(), initializers.Constant(1.0), 0),
        (k.Constant(3.0), initializers.Constant(3.0), 0),
        ("normal", initializers.RandomNormal(0.0, 0.05), 0),
    ]
    for init, table_init, seed in cases:
        layer = Embedding(output_dim=DIM, is_distributed=True, embeddings_initializer=init)
        assert layer.table_config.initializer == table_init, init
        assert layer.table_config.seed == seed
    limit = math.sqrt(6 / (1000 + DIM))
    glorot = Embedding(1000, DIM, is_distributed=True, embeddings_initializer="glorot_uniform")
    assert glorot.table_config.initializer == initializers.RandomUniform(-limit, limit)
    he = Embedding(1000, DIM, is_distributed=True, embeddings_initializer=k.HeNormal())
    assert he.table_config.initializer == initializers.TruncatedNormal(
        0.0, math.sqrt(2 / 1000) / 0.87962566103423978
    )
    with pytest.raises(ValueError, match="GlorotUniform scales with the table's shape.*input_dim"):
        Embedding(output_dim=DIM, is_distributed=True, embeddings_initializer="glorot_uniform")
    with pytest.raises(
        ValueError, match="Orthogonal cannot initialize.*RandomNormal, RandomUniform"
    ):
        Embedding(VOCAB, DIM, is_distributed=True, embeddings_initializer=k.Orthogonal())
    # The rows follow the distribution: RandomNormal(0.1, 0.05) over 20,000 ids.
    init = k.RandomNormal(mean=0.1, stddev=0.05, seed=4)
    layer = Embedding(
        output_dim=8, is_distributed=True, name="normal_rows", embeddings_initializer=init
    )
    layer.build()
    assert layer.client is not None
    rows = ops.lookup(layer.client, np.arange(20_000), "normal_rows", 8, missing="init").numpy()
    assert abs(rows.mean() - 0.1) < 0.002 and abs(rows.std() - 0.05) < 0.002
    # An explicit seed on the layer wins over the initializer's.
    seeded = Embedding(output_dim=DIM, is_distributed=True, seed=9,
                       embeddings_initializer=k.RandomNormal(seed=1))  # fmt: skip
    assert seeded.table_config.seed == 9


def test_supports_masking_only_with_mask_zero() -> None:
    assert not Embedding(VOCAB, DIM).supports_masking
    assert Embedding(VOCAB, DIM, mask_zero=True).supports_masking
    assert not Embedding(output_dim=DIM, is_distributed=True).supports_masking


def _adagrad_keras_model() -> keras.Model:
    ids = keras.Input((3,), dtype="int64")
    emb = keras.layers.Embedding(VOCAB, DIM, name="follow_emb")
    out = keras.layers.Dense(1, kernel_initializer="ones")(keras.layers.Flatten()(emb(ids)))
    return keras.Model(ids, out)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (8 * STEPS, 3)), rng.normal(size=(8 * STEPS, 1)).astype("float32")


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.Adagrad(0.05),
        lambda: keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=3, decay_rate=0.7)
        ),
    ],
    ids=["adagrad", "sgd_schedule"],
)
def test_converted_model_on_two_shards_follows_the_compiled_optimizer(
    start_cluster: Callable[..., Cluster], make_optimizer: Callable[[], keras.optimizers.Optimizer]
) -> None:
    """A Keras model with keras.layers.Embedding equals its converted,
    transpiled copy on 2 shard processes over 20 steps."""
    cluster = start_cluster(2)
    model = _adagrad_keras_model()
    model.compile(optimizer=make_optimizer(), loss="mse")
    copy = tf_dlt.transpile(model, cluster.addresses, convert_keras_embeddings=True)
    layer = copy.get_layer("follow_emb")
    assert isinstance(layer, Embedding) and layer.optimizer is None
    table = layer.table_config.optimizer
    inner = model.optimizer
    if isinstance(inner, keras.optimizers.Adagrad):
        assert table == optimizers.KerasAdagrad(initial_accumulator=0.1, epsilon=1e-7)
    else:
        assert table == optimizers.SGD()
    layer.sync_push = True  # deterministic: each step's push applied before the next lookup
    x, y = _data()
    ours = copy.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    theirs = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    np.testing.assert_allclose(ours.history["loss"], theirs.history["loss"], rtol=1e-5)
    rows = tf_dlt.Client(cluster.addresses).pull("follow_emb", np.arange(VOCAB), training=False)
    np.testing.assert_allclose(rows, model.get_layer("follow_emb").embeddings.numpy(), atol=1e-5)


def test_table_optimizers_from_keras_and_what_they_refuse() -> None:
    layer = Embedding(output_dim=DIM, is_distributed=True, name="followed")
    k = keras.optimizers
    layer.follow_optimizer(k.Adam(beta_1=0.8, beta_2=0.99, epsilon=1e-6))
    assert layer.table_config.optimizer == optimizers.Adam(beta1=0.8, beta2=0.99, epsilon=1e-6)
    layer.follow_optimizer(k.Ftrl(learning_rate_power=-0.4, l1_regularization_strength=0.01))
    assert layer.table_config.optimizer == optimizers.Ftrl(learning_rate_power=-0.4, l1=0.01)
    layer.follow_optimizer(k.LossScaleOptimizer(k.Adagrad(initial_accumulator_value=0.2)))
    assert layer.table_config.optimizer == optimizers.KerasAdagrad(initial_accumulator=0.2)
    layer.follow_optimizer(k.SGD(momentum=0.8, nesterov=True))
    assert layer.table_config.optimizer == optimizers.Momentum(momentum=0.8, nesterov=True)
    layer.follow_optimizer(k.AdamW(weight_decay=0.01))
    assert layer.table_config.optimizer == optimizers.Adam(weight_decay=0.01)
    layer.follow_optimizer(k.Adagrad(weight_decay=0.1))
    assert layer.table_config.optimizer.weight_decay == pytest.approx(0.1)
    excluding = k.AdamW(weight_decay=0.01)
    excluding.exclude_from_weight_decay(var_names=["follow"])
    layer.follow_optimizer(excluding)
    assert layer.table_config.optimizer == optimizers.Adam()
    for refused, match in (
        (k.RMSprop(), "RMSprop \\(a class tables do not follow\\).*SGD \\(with or without"),
        (k.Adam(amsgrad=True), "cannot follow the model's Adam.*amsgrad=True"),
        (k.Adam(clipnorm=1.0), "clipnorm=1.0"),
    ):
        with pytest.raises(ValueError, match=match):
            layer.follow_optimizer(refused)
    # Keras's third positional argument (the initializer) is is_distributed
    # here: refused, not taken as True.
    with pytest.raises(TypeError, match="is_distributed must be True or False, got 'zeros'"):
        Embedding(100, DIM, "zeros")
    explicit = Embedding(output_dim=DIM, is_distributed=True, optimizer="ftrl", name="explicit")
    explicit.follow_optimizer(k.Adagrad())
    assert explicit.table_config.optimizer.kind == "ftrl"  # the layer's own wins


def test_an_embedded_table_takes_the_compiled_optimizer_at_the_first_step() -> None:
    """Built before compile, the embedded table starts as SGD and becomes
    Adagrad (its rows kept) when training starts; once trained, another
    optimizer is refused with what to do."""
    weights = np.random.default_rng(1).normal(0, 0.1, (VOCAB, DIM)).astype("float32")
    ids = keras.Input((3,), dtype="int64")
    layer = Embedding(VOCAB, DIM, is_distributed=True, weights=weights, name="late_compile")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse")
    x, y = _data(2)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert layer.table_config.optimizer.kind == "keras_adagrad"
    assert layer.client is not None
    _, _, slots, steps = tf_dlt.embedded.rows("late_compile")
    assert slots.shape[1] == DIM and steps.max() > 0  # accumulators, trained
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.raises(errors.FailedPreconditionError, match="was trained with keras_adagrad"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_ids_without_a_row_read_as_zeros_in_predict_evaluate_and_both_exports(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    ids = keras.Input((2,), dtype="int64")
    emb = Embedding(output_dim=DIM, is_distributed=True, optimizer="adagrad",
                    learning_rate=0.1, name="unseen")  # fmt: skip
    model = keras.Model(ids, keras.layers.Flatten()(emb(ids)))
    model.compile(optimizer="sgd", loss="mse")
    model = tf_dlt.transpile(model, cluster.addresses)
    rng = np.random.default_rng(0)
    trained = rng.integers(0, 100, (64, 2))
    model.fit(trained, rng.normal(size=(64, 2 * DIM)), batch_size=16, verbose=0)
    unseen = np.array([[10**12, 7], [-5, 10**15]])  # 7 was trained
    live = model.predict(unseen, verbose=0)
    assert np.all(live[:, :DIM][0] == 0) and np.all(live[1] == 0)
    assert np.any(live[0, DIM:] != 0)
    assert model.evaluate(unseen, np.zeros((2, 2 * DIM)), verbose=0) > 0  # row of 7 only
    # Inference inserted nothing.
    with cluster.client() as client:
        assert client.list_tables()["unseen"]["rows"] == len(np.unique(trained))
    tf_dlt.export_saved_model(model, str(tmp_path / "remote"), mode="remote")
    tf_dlt.export_saved_model(model, str(tmp_path / "standalone"), mode="standalone")
    np.save(tmp_path / "x.npy", unseen)
    for mode in ("remote", "standalone"):
        code = (
            "import sys, numpy as np, tensorflow as tf, tf_dlt\n"
            "m = tf.saved_model.load(sys.argv[1])\n"
            "np.save(sys.argv[3], m.serve(tf.constant(np.load(sys.argv[2]))).numpy())\n"
        )
        out = tmp_path / f"{mode}.npy"
        subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / mode), str(tmp_path / "x.npy"), str(out)],
            check=True, timeout=300, cwd="/", env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )  # fmt: skip
        np.testing.assert_allclose(np.load(out), live, atol=1e-6, err_msg=mode)


class _Overflowing(keras.layers.Layer):  # type: ignore[misc]
    """Adds 0 x w: its weight w gets an infinite gradient, so only a dense
    gradient overflows."""

    def build(self, input_shape: object) -> None:
        self.w = self.add_weight(shape=(), initializer="zeros", name="w")

    def call(self, x: tf.Tensor) -> tf.Tensor:
        @tf.custom_gradient  # type: ignore[untyped-decorator]
        def zero_times(w: tf.Tensor) -> tuple[tf.Tensor, object]:
            return 0.0 * w, lambda dy: tf.constant(np.inf, w.dtype)

        return x + zero_times(tf.convert_to_tensor(self.w))


def test_a_step_skipped_for_a_dense_overflow_pushes_nothing() -> None:
    ids = keras.Input((3,), dtype="int64")
    layer = Embedding(VOCAB, DIM, is_distributed=True, optimizer="sgd", learning_rate=0.5,
                      sync_push=True, name="skipped")  # fmt: skip
    out = _Overflowing()(keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model = keras.Model(ids, out)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), 2.0**10)
    model.compile(optimizer=optimizer, loss="mse")
    model.build((None, 3))
    assert layer.client is not None
    before = ops.lookup(layer.client, np.arange(VOCAB), "skipped", DIM, training=False).numpy()
    x, y = _data(3)
    model.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0)
    after = ops.lookup(layer.client, np.arange(VOCAB), "skipped", DIM, training=False).numpy()
    np.testing.assert_array_equal(after, before)  # no row was pushed
    assert int(layer.pushes.numpy()) == 0
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**8  # halved at each skipped step


def test_transpile_takes_the_cluster_spec(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2)
    tf_config = {"cluster": {"ps": cluster.addresses, "worker": ["localhost:0"]},
                 "task": {"type": "worker", "index": 0}}  # fmt: skip
    spec = tf_dlt.cluster_from_env({"TF_CONFIG": json.dumps(tf_config)})
    ids = keras.Input((3,), dtype="int64")
    emb = Embedding(output_dim=DIM, is_distributed=True, optimizer="sgd", name="spec_table")
    model = keras.Model(ids, emb(ids))
    moved = tf_dlt.transpile(model, spec)
    assert moved.get_layer("spec_table").client.pservers == cluster.addresses
    with cluster.client() as client:
        assert "spec_table" in client.list_tables()
    embedded = tf_dlt.transpile(model, tf_dlt.cluster_from_env({}))
    assert embedded.get_layer("spec_table").client.embedded


def test_float_ids_are_taken_only_where_the_float_holds_the_id_exactly() -> None:
    """A Keras Input is float32 unless told otherwise. Small whole ids in it
    look up the rows int64 ids do; ids float32 cannot tell apart (1e12+1 and
    1e12+2 are one float32) or that are not whole are refused, naming the
    layer, instead of reading another id's row."""
    layer = Embedding(output_dim=4, is_distributed=True, name="float_ids")
    model = keras.Model(*(lambda x: (x, layer(x)))(keras.Input((2,))))
    as_int = keras.Model(*(lambda x: (x, layer(x)))(keras.Input((2,), dtype="int64")))
    small = np.array([[1, 2], [3, 16_777_216]])
    np.testing.assert_array_equal(
        model.predict(small.astype(np.float32), verbose=0), as_int.predict(small, verbose=0)
    )
    for bad in ([[1e12 + 1, 1e12 + 2]], [[1.5, 2.0]], [[float("nan"), 1.0]]):
        with pytest.raises(tf.errors.InvalidArgumentError, match="layer float_ids got float32 ids"):
            model.predict(np.array(bad, np.float32), verbose=0)
    # float64 ids stay float64 (the layer's inputs are never autocast, as in
    # keras.layers.Embedding): exact up to 2^53, refused past it.
    big = np.array([2**40 + 1, 2**40 + 2], np.int64)
    rows = np.array([[1.0] * 4, [2.0] * 4], np.float32)
    tf_dlt.embedded.table("float_ids").import_rows(big, rows)
    np.testing.assert_array_equal(layer(tf.constant([big], tf.float64))[0], rows)
    with pytest.raises(tf.errors.InvalidArgumentError, match="got float64 ids"):
        layer(tf.constant([[2.0**60 + 2**8, 1.0]], tf.float64))
    with pytest.raises(TypeError, match="takes integer ids, got string"):
        layer(tf.constant([["a"]]))
