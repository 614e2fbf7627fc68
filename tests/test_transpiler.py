"""tf_dlt.transpile: transpiled vs original models give the same predictions,
the input model is never changed, the rewrite is idempotent, and training on
shard processes matches a local model with the same optimizer math."""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dlt
from tf_dlt import dlt_ops as ops
from tf_dlt.layers import Embedding

from conftest import Cluster

VOCAB, DIM = 40, 4


def _data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.integers(0, VOCAB, size=(n, 3)).astype("int64"), rng.normal(size=(n, 1)).astype(
        "float32"
    )


def _functional(embedding: keras.layers.Layer) -> keras.Model:
    inp = keras.Input((3,), dtype="int64")
    x = keras.layers.Flatten()(embedding(inp))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(x)
    return keras.Model(inp, keras.layers.Dense(1, name="out")(x))


@pytest.mark.parametrize("num_shards", [1, 2])
def test_transpiled_model_predicts_like_the_original(
    start_cluster: Callable[..., Cluster], num_shards: int
) -> None:
    cluster = start_cluster(num_shards)
    name = f"t_emb{num_shards}"
    model = _functional(Embedding(output_dim=DIM, is_distributed=True, name=name))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = _data()
    before = model.predict(x, verbose=0)
    remote = tf_dlt.transpile(model, cluster.addresses)
    np.testing.assert_allclose(remote.predict(x, verbose=0), before, atol=1e-6)
    layer = remote.get_layer(name)
    assert layer.client is not None and layer.client.pservers == cluster.addresses
    assert remote.get_compile_config()["metrics"] == ["mae"]
    remote.fit(x, y, epochs=1, batch_size=8, verbose=0)
    # The input model is untouched: its weights and its (embedded) rows.
    np.testing.assert_allclose(model.predict(x, verbose=0), before, atol=1e-6)
    assert remote.predict(x, verbose=0).tolist() != before.tolist()
    with cluster.client() as client:
        assert client.list_tables()[name]["rows"] == len(np.unique(x))


def test_transpile_is_idempotent(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1)
    model = _functional(Embedding(output_dim=DIM, is_distributed=True, name="idem_emb"))
    x, _ = _data()
    once = tf_dlt.transpile(model, cluster.addresses)
    twice = tf_dlt.transpile(once, cluster.addresses)
    np.testing.assert_allclose(twice.predict(x, verbose=0), once.predict(x, verbose=0), atol=1e-6)


def test_keras_embeddings_are_converted_on_request(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2)
    seq = keras.Sequential(
        [keras.Input((3,), dtype="int64"), keras.layers.Embedding(VOCAB, DIM, name="kemb"),
         keras.layers.Flatten(), keras.layers.Dense(1, name="out")]
    )  # fmt: skip
    x, _ = _data()
    kept = tf_dlt.transpile(seq, cluster.addresses)
    assert isinstance(kept.get_layer("kemb"), keras.layers.Embedding)
    converted = tf_dlt.transpile(seq, cluster.addresses, convert_keras_embeddings=True)
    layer = converted.get_layer("kemb")
    assert isinstance(layer, Embedding) and layer.is_distributed
    np.testing.assert_allclose(
        converted.predict(x, verbose=0), seq.predict(x, verbose=0), atol=1e-6
    )


def test_converted_embeddings_keep_what_they_were_or_are_refused(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A frozen Keras Embedding stays frozen (it became trainable and fit
    changed its rows), a mixed-precision one mixed; a local tf_dlt Embedding keeps its combiner and
    optimizer (they were dropped: the mean over a bag became a row per id);
    what a table cannot keep (a regularizer, LoRA, an unbuilt layer) is
    refused before any table is made (an unbuilt one made its table, then
    an IndexError)."""
    cluster = start_cluster(1)
    x, y = _data()
    frozen = keras.layers.Embedding(VOCAB, DIM, name="conv_frozen", trainable=False)
    model = _functional(frozen)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    converted = tf_dlt.transpile(model, cluster.addresses, convert_keras_embeddings=True)
    assert not converted.get_layer("conv_frozen").trainable
    converted.fit(x, y, epochs=1, batch_size=16, verbose=0)
    with cluster.client() as client:
        np.testing.assert_array_equal(
            client.pull("conv_frozen", np.arange(VOCAB)), frozen.get_weights()[0]
        )
    mixed = keras.layers.Embedding(VOCAB, DIM, name="conv_mixed", dtype="mixed_bfloat16")
    converted = tf_dlt.transpile(
        _functional(mixed), cluster.addresses, convert_keras_embeddings=True
    )
    layer = converted.get_layer("conv_mixed")  # it handed float32 on
    assert layer.dtype_policy.name == "mixed_bfloat16"
    assert layer(x[:1]).dtype == mixed(x[:1]).dtype == tf.bfloat16
    bags = keras.Input((None,), dtype="int64", ragged=True)
    local = Embedding(VOCAB, DIM, combiner="mean", optimizer="adagrad", name="conv_bag")
    model = keras.Model(bags, keras.layers.Dense(1)(local(bags)))
    ragged = tf.ragged.constant([[1, 2, 3], [4]], tf.int64)
    converted = tf_dlt.transpile(model, cluster.addresses, convert_keras_embeddings=True)
    layer = converted.get_layer("conv_bag")
    assert layer.is_distributed and layer.combiner == "mean"
    assert layer.table_config.optimizer.kind == "adagrad"
    np.testing.assert_allclose(converted.predict(ragged, verbose=0),
                               model.predict(ragged, verbose=0), atol=1e-6)  # fmt: skip

    def refused(embedding: keras.layers.Layer, says: str, build: bool = True) -> None:
        model = keras.Sequential([embedding, keras.layers.Flatten(), keras.layers.Dense(1)])
        if build:
            model(x[:1])
        with pytest.raises(ValueError, match=says):
            tf_dlt.transpile(model, cluster.addresses, convert_keras_embeddings=True)
        with cluster.client() as client:
            assert embedding.name not in client.list_tables()

    refused(keras.layers.Embedding(VOCAB, DIM, name="conv_unbuilt"), "not built", build=False)
    refused(
        keras.layers.Embedding(VOCAB, DIM, embeddings_regularizer="l2", name="conv_l2"),
        "has embeddings_regularizer",
    )
    lora = keras.layers.Embedding(VOCAB, DIM, name="conv_lora")
    lora.build()
    lora.enable_lora(2)
    refused(lora, "has LoRA enabled")

    # Two towers made by one function, each converting its "emb" into table
    # "emb": the second upload replaced the first's rows.
    def tower(name: str) -> keras.Model:
        inp = keras.Input((3,), dtype="int64", name=f"{name}_in")
        rows = keras.layers.Embedding(VOCAB, DIM, name="conv_tower_emb")(inp)
        return keras.Model(inp, keras.layers.Flatten()(rows), name=name)

    ids = keras.Input((3,), dtype="int64")
    towers = keras.Model(ids, keras.layers.Concatenate()([tower("u")(ids), tower("i")(ids)]))
    with pytest.raises(ValueError, match="would both be table 'conv_tower_emb'"):
        tf_dlt.transpile(towers, cluster.addresses, convert_keras_embeddings=True)
    # An initializer a table cannot apply row by row (its rows are uploaded).
    orthogonal = Embedding(VOCAB, DIM, embeddings_initializer="orthogonal", name="conv_orth")
    model = _functional(orthogonal)
    converted = tf_dlt.transpile(model, cluster.addresses, convert_keras_embeddings=True)
    np.testing.assert_allclose(converted.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-6)  # fmt: skip
    with cluster.client() as client:
        assert "conv_tower_emb" not in client.list_tables()


def test_nested_models(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1)
    inner_in = keras.Input((3,), dtype="int64")
    inner = keras.Model(
        inner_in,
        keras.layers.Flatten()(
            Embedding(output_dim=DIM, is_distributed=True, name="n_emb")(inner_in)
        ),
        name="inner",
    )
    outer_in = keras.Input((3,), dtype="int64")
    outer = keras.Model(outer_in, keras.layers.Dense(1, name="head")(inner(outer_in)))
    x, _ = _data()
    remote = tf_dlt.transpile(outer, cluster.addresses)
    np.testing.assert_allclose(remote.predict(x, verbose=0), outer.predict(x, verbose=0), atol=1e-6)
    assert remote.get_layer("inner").get_layer("n_emb").client.pservers == cluster.addresses


def _towers() -> tuple[keras.Model, list[np.ndarray]]:
    """Two towers made by one function, each with a Dense named "hidden"
    (its kernel all 1s in one tower, all 2s in the other), and an input."""

    def tower(name: str) -> keras.Model:
        inp = keras.Input((2,), name=f"{name}_in")
        return keras.Model(inp, keras.layers.Dense(1, name="hidden")(inp), name=name)

    user, item = tower("user_tower"), tower("item_tower")
    a, b = keras.Input((2,), name="a"), keras.Input((2,), name="b")
    model = keras.Model([a, b], keras.layers.Concatenate()([user(a), item(b)]))
    for value, t in ((1.0, user), (2.0, item)):
        t.get_layer("hidden").set_weights([np.full((2, 1), value), np.zeros(1)])
    return model, [np.array([[1, 2]], np.float32), np.array([[3, 4]], np.float32)]


def test_layers_of_the_same_name_in_two_nested_models_keep_their_own_weights(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Each tower's "hidden" keeps its trained weights: weights were copied
    by name over all layers at once, so one tower got the other's and the
    other kept fresh random ones, without a word."""
    cluster = start_cluster(1)
    model, x = _towers()
    np.testing.assert_allclose(model.predict(x, verbose=0), [[3.0, 14.0]])
    remote = tf_dlt.transpile(model, cluster.addresses)
    np.testing.assert_allclose(remote.predict(x, verbose=0), [[3.0, 14.0]])


@pytest.mark.parametrize("shape", ["functional", "sequential", "nested"])
@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_sparse_and_ragged_inputs_stay_so(
    start_cluster: Callable[..., Cluster], kind: str, shape: str
) -> None:
    """A model fed a SparseTensor (or RaggedTensor) of ids per example, its
    layer reducing them (combiner="mean"): clone_model made its inputs
    dense, so the transpiled model could not be called with them (sparse:
    "feed a RaggedTensor or SparseTensor of ids")."""
    import tensorflow as tf

    cluster = start_cluster(1)

    def embedding() -> Embedding:
        return Embedding(output_dim=DIM, is_distributed=True, combiner="mean", name=f"{kind}_emb")

    ids = keras.Input((None,), dtype="int64", **{kind: True})
    if shape == "functional":
        model = keras.Model(ids, keras.layers.Dense(1, name="head")(embedding()(ids)))
    elif shape == "sequential":  # (clone_model's Sequential dropped them too)
        model = keras.Sequential([ids, embedding(), keras.layers.Dense(1, name="head")])
    else:  # a nested model's own inputs (clone_model's recursion dropped them)
        inner = keras.Model(ids, embedding()(ids), name="inner")
        outer = keras.Input((None,), dtype="int64", **{kind: True})
        model = keras.Model(outer, keras.layers.Dense(1, name="head")(inner(outer)))
    rows = tf.ragged.constant([[1, 2, 3], [4], [5, 6]], dtype=tf.int64)
    x = rows.to_sparse() if kind == "sparse" else rows
    before = model(x).numpy()
    remote = tf_dlt.transpile(model, cluster.addresses)
    assert getattr(remote.inputs[0], kind)
    np.testing.assert_allclose(remote(x).numpy(), before, atol=1e-6)


def test_subclassed_models_get_a_clear_error() -> None:
    class Tower(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.emb = Embedding(output_dim=DIM, is_distributed=True, name="sub_emb")

        def call(self, x):  # type: ignore[no-untyped-def]
            return self.emb(x)

    with pytest.raises(TypeError, match="subclassed model"):
        tf_dlt.transpile(Tower(), "embedded")


@pytest.mark.parametrize("num_shards", [1, 2])
def test_sync_training_matches_a_local_model(
    start_cluster: Callable[..., Cluster], num_shards: int
) -> None:
    cluster = start_cluster(num_shards)
    local_emb = keras.layers.Embedding(VOCAB, DIM, name="emb")
    local = _functional(local_emb)
    local.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    remote = tf_dlt.transpile(local, cluster.addresses, convert_keras_embeddings=True)
    remote.get_layer("emb").sync_push = True  # deterministic: each step waits for its push
    x, y = _data(160)
    h_remote = remote.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    h_local = local.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(h_remote.history["loss"], h_local.history["loss"], rtol=1e-5)
    rows = ops.lookup(
        remote.get_layer("emb").client, np.arange(VOCAB, dtype=np.int64), "emb", DIM,
        training=False,
    ).numpy()  # fmt: skip
    np.testing.assert_allclose(rows, local_emb.get_weights()[0], atol=1e-5)


def test_a_model_transpiled_onto_shards_started_again_trains(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A local cluster started again at the same addresses (a notebook): the
    ops' client of those addresses, shared by name in the process, met the
    processes before; a model transpiled afresh takes the new ones (it
    failed its first step DataLossError)."""
    cluster = start_cluster(1)
    x, y = _data()

    def fit_one() -> None:
        inp = keras.Input((3,), dtype="int64")
        emb = Embedding(input_dim=1000, output_dim=4, is_distributed=True, name="again")
        model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
        model.compile(optimizer="adam", loss="mse")
        model = tf_dlt.transpile(model, cluster.addresses)
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)

    fit_one()
    cluster.kill(0)
    cluster.restart(0)
    fit_one()
