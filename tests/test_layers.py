"""tf_dlt.layers.Embedding against keras.layers.Embedding as the oracle:
equal initial rows and SGD must give the same outputs, losses and rows, on the
embedded tables and on shard processes."""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dlt import dlt_ops as ops
from tf_dlt.layers import Embedding

from conftest import Cluster

VOCAB, DIM, STEPS = 50, 4, 20


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(8 * STEPS, 3)).astype("int64")
    y = rng.normal(size=(8 * STEPS, 1)).astype("float32")
    return x, y


def _model(layer: keras.layers.Layer) -> keras.Model:
    inp = keras.Input((3,), dtype="int64")
    dense = keras.layers.Dense(1, kernel_initializer="ones", bias_initializer="zeros")
    return keras.Model(inp, dense(keras.layers.Flatten()(layer(inp))))


def _rows(layer: Embedding) -> np.ndarray:
    """The table's rows of ids 0..VOCAB-1 (initial values where none yet)."""
    assert layer.client is not None
    ids = np.arange(VOCAB, dtype=np.int64)
    return ops.lookup(layer.client, ids, layer.table_name, DIM, training=False).numpy()


def _materialized(layer: Embedding) -> np.ndarray:
    """Gives ids 0..VOCAB-1 rows (their initial values) in the table: ids
    without a row read as zeros in inference."""
    rows = _rows(layer)
    assert layer.client is not None
    ops.assign(layer.client, np.arange(VOCAB, dtype=np.int64), rows, layer.table_name, DIM)
    return rows


def _pair(
    layer: Embedding, **compile_kwargs: object
) -> tuple[keras.Model, keras.Model, keras.layers.Embedding]:
    dist = _model(layer)
    keras_emb = keras.layers.Embedding(VOCAB, DIM)
    local = _model(keras_emb)
    keras_emb.set_weights([_materialized(layer)])
    for m in (dist, local):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", **compile_kwargs)
    return dist, local, keras_emb


def _distributed(name: str, **kwargs: object) -> Embedding:
    options: dict[str, object] = {"optimizer": "sgd", "learning_rate": 0.1, "sync_push": True}
    options.update(kwargs)
    return Embedding(output_dim=DIM, is_distributed=True, name=name, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_fit_matches_keras_embedding(steps_per_execution: int) -> None:
    layer = _distributed(f"fit_spe{steps_per_execution}")
    dist, local, keras_emb = _pair(layer, steps_per_execution=steps_per_execution)
    x, y = _data()
    np.testing.assert_allclose(dist.predict(x, verbose=0), local.predict(x, verbose=0), atol=1e-6)
    h1 = dist.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    h2 = local.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(_rows(layer), keras_emb.get_weights()[0], atol=1e-5)
    assert float(layer.anchor.numpy()) == 0.0
    assert int(layer.pushes.numpy()) == STEPS


@pytest.mark.parametrize("num_shards", [1, 2])
def test_fit_matches_keras_embedding_on_shard_processes(
    start_cluster: Callable[..., Cluster], num_shards: int
) -> None:
    cluster = start_cluster(num_shards)
    layer = _distributed("remote_emb")
    with cluster.client() as client:
        config = layer.table_config
        client.create_table(
            config.name, config.dim, config.initializer, config.optimizer, config.seed
        )
    layer.use_client(ops.ClientResource(cluster.addresses))
    dist, local, keras_emb = _pair(layer)
    x, y = _data()
    h1 = dist.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    h2 = local.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(_rows(layer), keras_emb.get_weights()[0], atol=1e-5)


def test_evaluate_and_predict_never_push_and_insert_nothing() -> None:
    layer = _distributed("infer_only")
    model = _model(layer)
    model.compile(optimizer="sgd", loss="mse")
    x, y = _data()
    model.evaluate(x, y, verbose=0)
    model.predict(x, verbose=0)
    assert int(layer.pushes.numpy()) == 0


def test_inference_sees_asynchronous_pushes() -> None:
    layer = Embedding(output_dim=DIM, is_distributed=True, learning_rate=1.0, name="async_emb")
    model = _model(layer)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = _data()
    before = model.predict(x, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # async pushes
    after = model.predict(x, verbose=0)  # flushes first
    rows_now = _rows(layer)
    expected = rows_now[x].reshape(len(x), -1).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-5)
    assert not np.allclose(before, after)


def test_custom_gradient_tape_loop_pushes() -> None:
    layer = _distributed("tape_loop")
    model = _model(layer)
    opt = keras.optimizers.SGD(0.1)
    x, y = _data()
    before = _rows(layer)

    @tf.function
    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb, training=True) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for i in range(3):
        step(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8])
    assert int(layer.pushes.numpy()) == 3
    assert not np.allclose(_rows(layer), before)


def test_learning_rate_schedule_counts_pushes() -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    layer = _distributed("scheduled", learning_rate=schedule)
    layer.build()
    assert float(layer._current_learning_rate(None)) == pytest.approx(0.1)
    layer.pushes.assign(2)
    assert float(layer._current_learning_rate(None)) == pytest.approx(0.025)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_ragged_and_sparse_combiners_match_embedding_lookup_sparse(combiner: str) -> None:
    layer = Embedding(
        output_dim=DIM, is_distributed=True, combiner=combiner, name=f"comb_{combiner}"
    )
    ragged = tf.ragged.constant([[1, 2, 2], [7], [3, 4, 5, 6]], dtype=tf.int64)
    layer.build()
    table = tf.constant(_materialized(layer))
    out_ragged = layer(ragged)
    out_sparse = layer(ragged.to_sparse())
    expected = tf.nn.embedding_lookup_sparse(table, ragged.to_sparse(), None, combiner=combiner)
    np.testing.assert_allclose(out_ragged.numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out_sparse.numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)
    # Ids anywhere in their row (a multi-hot feature, tf.sparse.from_dense):
    # refused as "not right-ragged" before; an empty example gives zeros.
    scattered = tf.sparse.from_dense(tf.constant([[0, 3, 0], [1, 0, 2], [0, 0, 0]], tf.int64))
    expected = tf.nn.safe_embedding_lookup_sparse(table, scattered, combiner=combiner)
    np.testing.assert_allclose(layer(scattered).numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("is_distributed", [True, False], ids=["distributed", "local"])
def test_a_combiner_reduces_every_id_of_an_example_however_nested(is_distributed: bool) -> None:
    """Ids of ragged_rank 2 (or a uniform inner dim): the rows of the flat
    ids were summed by the outer rows' ids, into other examples (example 0
    got row 1 here), or failed in UnsortedSegmentSum."""
    weights = np.arange(20, dtype=np.float32).reshape(10, 2)
    layer = Embedding(10, 2, is_distributed=is_distributed, combiner="sum", weights=weights,
                      name=f"comb_nested_{is_distributed}")  # fmt: skip
    nested = tf.ragged.constant([[[]], [[1, 2], [3]]], dtype=tf.int64)
    np.testing.assert_allclose(
        layer(nested).numpy(), [[0, 0], weights[1] + weights[2] + weights[3]]
    )
    uniform = tf.RaggedTensor.from_row_lengths(
        tf.constant([[1, 2], [3, 4], [5, 6]], tf.int64), [1, 2]
    )
    np.testing.assert_allclose(
        layer(uniform).numpy(), [weights[1] + weights[2], weights[3:7].sum(axis=0)]
    )


@pytest.mark.parametrize("num_shards", [1, 2])
def test_combiners_on_shard_processes(
    start_cluster: Callable[..., Cluster], num_shards: int
) -> None:
    cluster = start_cluster(num_shards)
    ragged = tf.ragged.constant([[1, 2, 2], [7], [], [3, 4, 5, 6]], dtype=tf.int64)
    for combiner in ("sum", "mean", "sqrtn"):
        layer = Embedding(output_dim=DIM, is_distributed=True, combiner=combiner, name=combiner)
        with cluster.client() as client:
            c = layer.table_config
            client.create_table(c.name, c.dim, c.initializer, c.optimizer, c.seed)
        layer.use_client(ops.ClientResource(cluster.addresses))
        table = tf.constant(_materialized(layer))
        sparse = ragged.to_sparse()
        expected = tf.nn.embedding_lookup_sparse(table, sparse, None, combiner=combiner)
        np.testing.assert_allclose(layer(ragged).numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(layer(sparse).numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)


def test_any_rank_ids_and_mask_zero() -> None:
    layer = Embedding(output_dim=DIM, is_distributed=True, mask_zero=True, name="ranked")
    ids = tf.constant([[[0, 5], [2**62, -3]]], tf.int64)
    assert layer(ids).shape == (1, 2, 2, DIM)
    np.testing.assert_array_equal(layer.compute_mask(ids).numpy(), [[[False, True], [True, True]]])
    local = Embedding(VOCAB, DIM, mask_zero=True)
    keras_emb = keras.layers.Embedding(VOCAB, DIM, mask_zero=True)
    small = tf.constant([[0, 3]])
    np.testing.assert_array_equal(
        local.compute_mask(small).numpy(), keras_emb.compute_mask(small).numpy()
    )


def test_local_mode_is_keras_embedding_with_chosen_gradient_kind() -> None:
    for is_sparse, kind in ((True, tf.IndexedSlices), (False, tf.Tensor)):
        layer = Embedding(VOCAB, DIM, is_sparse=is_sparse)
        ids = tf.constant([[1, 2], [2, 3]])
        with tf.GradientTape() as tape:
            out = layer(ids)
            loss = tf.reduce_sum(out)
        assert out.shape == (2, 2, DIM)
        grad = tape.gradient(loss, layer.trainable_variables)[0]
        assert isinstance(grad, kind)
        np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy()[2], np.full(DIM, 2.0))


def test_validation_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match="output_dim must be a positive int, got None"):
        Embedding(100)
    with pytest.raises(ValueError, match="input_dim must be a positive int for a local table"):
        Embedding(output_dim=8)
    with pytest.raises(ValueError, match=r"combiner must be one of .*'max'"):
        Embedding(output_dim=8, is_distributed=True, combiner="max")
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
        Embedding(output_dim=8, is_distributed=True, optimizer="rmsprop")
    layer = Embedding(output_dim=8, is_distributed=True, combiner="sum", name="needs_ragged")
    with pytest.raises(ValueError, match="feed a RaggedTensor or SparseTensor"):
        layer(tf.constant([[1, 2]], tf.int64))
    with pytest.raises(ValueError, match=r"weights must have shape \(input_dim, output_dim\)"):
        Embedding(10, 8, weights=np.zeros((10, 4)))


def test_config_round_trip_and_keras_file(tmp_path: object) -> None:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    layer = Embedding(
        output_dim=DIM, is_distributed=True, optimizer="adagrad", learning_rate=schedule,
        combiner=None, seed=3, name="roundtrip",
    )  # fmt: skip
    clone = Embedding.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    assert clone.table_config.same_table(layer.table_config)
    model = _model(layer)
    path = f"{tmp_path}/model.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.get_layer("roundtrip").get_config() == layer.get_config()
    x, _ = _data()
    # Both read the same embedded table in this process.
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def _loss_scaled(layer: Embedding, initial_scale: float) -> tuple[keras.Model, ...]:
    dist, local, keras_emb = _pair(layer)
    for m in (dist, local):
        inner = keras.optimizers.SGD(0.1)
        opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=initial_scale)
        m.compile(optimizer=opt, loss="mse")
    return dist, local, keras_emb


def test_loss_scale_optimizer_pushes_unscaled_gradients() -> None:
    layer = _distributed("loss_scaled")
    dist, local, keras_emb = _loss_scaled(layer, 2.0**10)
    x, y = _data()
    h1 = dist.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    h2 = local.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(_rows(layer), keras_emb.get_weights()[0], atol=1e-5)
    assert int(layer.pushes.numpy()) == STEPS


def test_loss_scale_optimizer_overflow_pushes_nothing_and_skips_the_step() -> None:
    # At 2**127 the scaled loss is infinite until the scale has come down:
    # those steps must push nothing (a shard refuses non-finite gradients)
    # and be skipped by the optimizer.
    layer = _distributed("loss_overflow")
    dist, _, _ = _loss_scaled(layer, 2.0**127)
    x, y = _data()
    before = _rows(layer)
    pushed = []

    class Pushes(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            pushed.append(int(layer.pushes.numpy()))

    dist.fit(x, y * 100, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[Pushes()])
    assert pushed[0] == 0 and 0 < pushed[-1] < STEPS
    scale = float(dist.optimizer.dynamic_scale.numpy())
    assert scale <= 2.0 ** (127 - (STEPS - pushed[-1]))
    rows = _rows(layer)
    assert np.isfinite(rows).all() and not np.allclose(rows, before)
    assert not np.isnan(layer.anchor.numpy())


def test_static_loss_scale_factor_is_divided_out() -> None:
    layer = _distributed("loss_factor")
    # Keras cannot divide sparse gradients by loss_scale_factor: the local
    # oracle is this package's local Embedding with dense gradients.
    local_emb = Embedding(VOCAB, DIM)
    dist, local = _model(layer), _model(local_emb)
    local_emb.set_weights([_rows(layer)])
    for m in (dist, local):
        m.compile(optimizer=keras.optimizers.SGD(0.1, loss_scale_factor=64.0), loss="mse")
    x, y = _data()
    dist.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    local.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(_rows(layer), local_emb.get_weights()[0], atol=1e-5)


def test_gradient_accumulation_is_refused_with_a_clear_error() -> None:
    model = _model(_distributed("accumulating"))
    model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
    x, y = _data()
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_pending_pushes_are_flushed_at_the_end_of_every_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = Embedding(output_dim=DIM, is_distributed=True, learning_rate=0.1, name="epoch_flush")
    model = _model(layer)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    events: list[str] = []
    flush = ops.flush

    def recording_flush(client: ops.ClientResource) -> object:
        if tf.executing_eagerly():
            events.append("flush")
        return flush(client)

    monkeypatch.setattr(ops, "flush", recording_flush)

    class Recorder(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            events.append("batch")

        def on_epoch_end(self, epoch: int, logs: dict[str, object] | None = None) -> None:
            assert logs is not None and set(logs) == {"loss"}  # nothing added to the logs
            events.append("epoch_end")

    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[Recorder()])
    assert events == (["batch"] * STEPS + ["flush", "epoch_end"]) * 2


def test_mixed_precision_output_dtype_matches_keras() -> None:
    layer = Embedding(output_dim=DIM, is_distributed=True, dtype="mixed_float16", name="mixed")
    keras_emb = keras.layers.Embedding(VOCAB, DIM, dtype="mixed_float16")
    ids = tf.constant([[1, 2]], tf.int64)
    assert layer(ids).dtype == keras_emb(ids).dtype == tf.float16
