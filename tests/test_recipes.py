"""A recommender recipe moved onto shard servers: the shape of the keras-rs
DCN example on MovieLens (one Keras Embedding per feature, a cross layer, a
deep tower, AdamW), written here on synthetic ratings, converted with
`tf_dlt.transpile(convert_keras_embeddings=True)` onto 2 shard processes.
The converted model must reach the local model's test RMSE within 2%."""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import pytest

import tf_dlt

from conftest import Cluster

FEATURES = {"user_id": 600, "movie_id": 400, "user_age": 7, "movie_genre": 18}
DIM = 8


class Cross(keras.layers.Layer):  # type: ignore[misc]
    """DCN's cross layer: x0 * (W x + b) + x."""

    def build(self, input_shape: tuple[int, ...]) -> None:
        self.dense = keras.layers.Dense(input_shape[-1])
        self.dense.build(input_shape)

    def call(self, x0: object, x: object) -> object:
        return x0 * self.dense(x) + x


def _ratings(n: int, seed: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Ratings 1-5: per-user, per-movie, genre and age effects, a user x
    movie taste term, noise."""
    rng = np.random.default_rng(seed)
    taste = np.random.default_rng(7)  # the same world for train and test
    bias = {name: taste.normal(0, 1, size) for name, size in FEATURES.items()}
    users = taste.normal(0, 1, (FEATURES["user_id"], 2))
    movies = taste.normal(0, 1, (FEATURES["movie_id"], 2))
    x = {name: rng.integers(0, size, n) for name, size in FEATURES.items()}
    score = 0.6 * bias["user_id"][x["user_id"]] + 0.6 * bias["movie_id"][x["movie_id"]]
    score += 0.4 * bias["movie_genre"][x["movie_genre"]] + 0.2 * bias["user_age"][x["user_age"]]
    score += 0.3 * np.sum(users[x["user_id"]] * movies[x["movie_id"]], axis=1)
    y = np.clip(3.0 + score + rng.normal(0, 0.3, n), 1.0, 5.0).astype("float32")
    return x, y


def _dcn() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = {name: keras.Input((), dtype="int64", name=name) for name in FEATURES}
    embedded = [
        keras.layers.Embedding(size, DIM, name=f"{name}_emb")(inputs[name])
        for name, size in FEATURES.items()
    ]
    x0 = keras.layers.Concatenate()(embedded)
    crossed = Cross()(x0, x0)
    deep = keras.layers.Dense(32, activation="relu")(crossed)
    out = keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(deep))
    return keras.Model(inputs, out)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "adam"])
def test_the_dcn_recipe_on_two_shards_matches_the_local_model(
    optimizer: str, start_cluster: Callable[..., Cluster]
) -> None:
    cluster = start_cluster(2)
    x, y = _ratings(12_000, seed=0)
    test_x, test_y = _ratings(3_000, seed=1)

    def make() -> keras.optimizers.Optimizer:
        if optimizer == "adamw":
            return keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.004)
        return keras.optimizers.Adam(learning_rate=0.01)

    local = _dcn()
    local.compile(optimizer=make(), loss="mse", metrics=[keras.metrics.RootMeanSquaredError()])
    remote = tf_dlt.transpile(local, cluster.addresses, convert_keras_embeddings=True)
    with cluster.client() as client:
        kinds = {name: t["config"].optimizer for name, t in client.list_tables().items()}
    expected = tf_dlt.optimizers.Adam(weight_decay=0.004 if optimizer == "adamw" else 0.0)
    assert kinds == {f"{name}_emb": expected for name in FEATURES}
    rmse = {}
    for name, model in (("local", local), ("remote", remote)):
        model.fit(x, y, batch_size=256, epochs=4, verbose=0, shuffle=False)
        rmse[name] = model.evaluate(test_x, test_y, batch_size=1024, verbose=0)[1]
    baseline = float(np.std(test_y))
    assert rmse["local"] < 0.75 * baseline  # it learned something
    print("test RMSE", optimizer, rmse)
    assert abs(rmse["remote"] - rmse["local"]) <= 0.02 * rmse["local"], rmse
