"""tf_dlt.pull_ahead: model.fit pulls the rows of coming batches in the input
pipeline; with sync_push=True training is the same as without, the pulled
rows are used, and ids the trainer pushed in between are pulled again."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dlt
from tf_dlt import dlt_ops as ops
from tf_dlt.layers import Embedding

from conftest import Cluster

VOCAB, DIM, BATCH = 50, 4, 8


def _data(n: int = 96) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(3)
    # Few ids: consecutive batches share many, so pushes hit pulled-ahead rows.
    return {
        "user": rng.integers(0, VOCAB, size=(n, 1)).astype("int32"),
        "items": rng.integers(-VOCAB, VOCAB, size=(n, 3)).astype("int64"),
        "price": rng.normal(size=(n, 2)).astype("float32"),
    }, rng.normal(size=(n, 1)).astype("float32")


def _model() -> keras.Model:
    """Two tables fed by model inputs, one ragged-free dense feature."""
    user = keras.Input((1,), dtype="int32", name="user")
    items = keras.Input((3,), dtype="int64", name="items")
    price = keras.Input((2,), name="price")
    u = keras.layers.Flatten()(
        Embedding(output_dim=DIM, is_distributed=True, name="u_emb", seed=1)(user)
    )
    i = Embedding(output_dim=DIM, is_distributed=True, name="i_emb", seed=2)(items)
    i = keras.layers.GlobalAveragePooling1D()(i)
    x = keras.layers.Concatenate()([u, i, price])
    x = keras.layers.Dense(8, activation="relu")(x)
    model = keras.Model({"user": user, "items": items, "price": price}, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def _remote(model: keras.Model, cluster: Cluster) -> keras.Model:
    remote = tf_dlt.transpile(model, cluster.addresses)
    for name in ("u_emb", "i_emb"):
        remote.get_layer(name).sync_push = True
    return remote


def _stats(model: keras.Model) -> dict[str, Any]:
    return ops.client_stats(model.get_layer("u_emb").client)


def _wait_for(done: Callable[[], bool]) -> None:
    """Waits (10 s at most) for work the client's worker threads do."""
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _rows(model: keras.Model, table: str) -> np.ndarray:
    ids = np.arange(-VOCAB, VOCAB, dtype=np.int64)
    return ops.lookup(
        model.get_layer(table).client, ids, table, DIM, training=False, missing="zeros"
    ).numpy()


@pytest.mark.parametrize("source", ["dataset", "numpy"])
def test_pulling_ahead_trains_exactly_as_without_under_sync_push(
    start_cluster: Callable[..., Cluster], source: str
) -> None:
    model = _model()
    plain = _remote(model, start_cluster(2))
    ahead = tf_dlt.pull_ahead(_remote(model, start_cluster(2)))
    x, y = _data()

    def fit(m: keras.Model) -> list[float]:
        if source == "dataset":
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
            history = m.fit(ds, epochs=2, verbose=0)
        else:
            history = m.fit(
                x, y, batch_size=BATCH, epochs=2, shuffle=False, validation_split=0.25, verbose=0
            )
            assert len(history.history["val_loss"]) == 2
        return list(history.history["loss"])

    np.testing.assert_array_equal(fit(ahead), fit(plain))
    for table in ("u_emb", "i_emb"):
        np.testing.assert_array_equal(_rows(ahead, table), _rows(plain, table))
    for a, b in zip(ahead.get_weights(), plain.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    steps = 2 * (len(y) * (3 if source == "numpy" else 4) // 4 // BATCH)
    stats = _stats(ahead)
    # Both layers share the transpiled client: 2 lookups per step, each
    # served by its pull ahead; ids pushed by the step before were pulled again.
    assert stats["pulls_ahead_used"] == 2 * steps
    assert stats["pulls_ahead"] == stats["pulls_ahead_used"] + stats["pulls_ahead_dropped"]
    assert stats["pulled_ahead_stale_rows"] > 0
    assert _stats(plain)["pulls_ahead"] == 0


def test_a_load_inside_a_pull_ahead_fit_is_seen_by_the_next_steps(
    start_cluster: Callable[..., Cluster], tmp_path: Any
) -> None:
    """A `tf_dlt.load` in a callback (a restore on divergence, say): the rows
    the pipeline had pulled ahead for the next epoch's first batches were
    served to them as they were before the load (the epoch after the load
    lost 1.240626 where a plain fit repeats epoch 0's 1.240926)."""
    model = _model()
    plain = _remote(model, start_cluster(2))
    ahead = tf_dlt.pull_ahead(_remote(model, start_cluster(2)))
    x, y = _data()

    def fit(m: keras.Model, tag: str) -> list[float]:
        checkpoint = str(tmp_path / tag)
        tf_dlt.save(m, checkpoint)

        class Restore(keras.callbacks.Callback):  # type: ignore[misc]
            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                if epoch == 0:
                    time.sleep(0.5)  # the pipeline's pulls for epoch 1 land
                    tf_dlt.load(self.model, checkpoint)

        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        return list(m.fit(ds, epochs=2, verbose=0, callbacks=[Restore()]).history["loss"])

    losses = fit(ahead, "ahead")
    assert losses == fit(plain, "plain")
    assert losses[0] == losses[1]  # the epoch after the load trains from the checkpoint
    for table in ("u_emb", "i_emb"):
        np.testing.assert_array_equal(_rows(ahead, table), _rows(plain, table))


def test_a_fit_pulls_ahead_across_epochs_with_one_iterator(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A dataset of known length is iterated once for the whole fit: the
    next epoch's first batches are pulled ahead before the epoch before it
    ends, and the pipeline ends with the fit's last step."""
    remote = tf_dlt.pull_ahead(_remote(_model(), start_cluster(1)))
    x, y = _data()
    ahead_at_epoch_end: list[int] = []

    class EpochEnd(keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            if epoch < 2:
                _wait_for(
                    lambda: _stats(remote)["pulls_ahead"] > _stats(remote)["pulls_ahead_used"]
                )
            stats = _stats(remote)
            ahead_at_epoch_end.append(stats["pulls_ahead"] - stats["pulls_ahead_used"])

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    history = remote.fit(ds, epochs=3, verbose=0, callbacks=[EpochEnd()])
    assert len(history.history["loss"]) == 3
    assert ahead_at_epoch_end[0] > 0 and ahead_at_epoch_end[2] == 0
    stats = _stats(remote)
    steps = 3 * len(y) // BATCH
    assert stats["pulls_ahead"] == stats["pulls_ahead_used"] == 2 * steps
    assert stats["pulls_ahead_dropped"] == 0
    # From epoch 1 of 3: two passes; what the pipeline began past them is dropped.
    history = remote.fit(ds, epochs=3, initial_epoch=1, verbose=0)
    assert len(history.history["loss"]) == 2
    stats = _stats(remote)
    assert stats["pulls_ahead_used"] == 2 * (steps + 2 * len(y) // BATCH)
    assert stats["pulls_ahead"] == stats["pulls_ahead_used"] + stats["pulls_ahead_dropped"]


def test_a_fit_keeps_its_epochs_under_steps_per_execution_and_drops_what_it_left(
    start_cluster: Callable[..., Cluster],
) -> None:
    """12 batches in calls of 5 steps: each epoch stays one pass (no
    iteration across epochs, whose calls would run across a pass's end). A
    fit stopped early leaves no pull ahead waiting."""
    model = _model()
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse", steps_per_execution=5)
    remote = tf_dlt.pull_ahead(_remote(model, start_cluster(1)))
    x, y = _data()
    used: list[int] = []

    class Used(keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            used.append(_stats(remote)["pulls_ahead_used"])

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    remote.fit(ds, epochs=3, verbose=0, callbacks=[Used()])
    steps = len(y) // BATCH
    assert used == [2 * steps, 4 * steps, 6 * steps]

    before = _stats(remote)

    class Stop(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if batch >= 4:
                # Once the input pipeline has begun pulls for batches past
                # this call (on a loaded machine it may not have yet).
                deadline = time.monotonic() + 30
                while _stats(remote)["pulls_ahead"] - before["pulls_ahead"] <= 2 * 5:
                    assert time.monotonic() < deadline, "the pipeline never got ahead"
                    time.sleep(0.01)
                self.model.stop_training = True

    remote.fit(ds, epochs=3, verbose=0, callbacks=[Stop()])
    stats = {k: v - before[k] for k, v in _stats(remote).items() if k.startswith("pulls_ahead")}
    assert stats["pulls_ahead_used"] == 2 * 5  # one call of 5 steps
    assert stats["pulls_ahead_dropped"] > 0  # begun for batches no step took
    assert stats["pulls_ahead"] == stats["pulls_ahead_used"] + stats["pulls_ahead_dropped"]


@pytest.mark.parametrize("refresh", [True, False])
def test_client_metrics_report_pulls_ahead_and_lookup_time(
    start_cluster: Callable[..., Cluster], refresh: bool
) -> None:
    remote = tf_dlt.pull_ahead(_remote(_model(), start_cluster(1)), refresh=refresh)
    x, y = _data()
    history = remote.fit(
        x, y, batch_size=BATCH, epochs=1, callbacks=[tf_dlt.ClientMetrics(logs="all")], verbose=0
    ).history
    assert history["dlt_pulls_ahead_used"] == [2.0 * len(y) // BATCH]
    assert history["dlt_lookup_s"][0] > 0 and history["dlt_lookup_p50_ms"][0] > 0
    # Without refresh nothing is pulled again: rows may miss one step's push.
    assert (history["dlt_pulled_ahead_stale_rows"][0] > 0) == refresh


def test_a_lookup_without_its_pull_ahead_still_pulls_and_old_ones_are_dropped(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1)
    client = ops.ClientResource(cluster.addresses)
    with cluster.client() as control:
        control.create_table("t", DIM)
    ids = tf.constant([[3, 1], [3, 7]], tf.int64)
    for _ in range(9):  # one more than wait per table
        ops.pull_ahead(client, ids + 100, "t", DIM)
    ops.pull_ahead(client, ids, "t", DIM)
    rows = ops.lookup(client, ids, "t", DIM)
    np.testing.assert_array_equal(rows[0, 0], rows[1, 0])
    # Other ids, mode or dim: a plain pull, equal to the pulled-ahead rows.
    np.testing.assert_array_equal(ops.lookup(client, ids, "t", DIM, training=False), rows)
    stats = ops.client_stats(client)
    assert stats["pulls_ahead"] == 10 and stats["pulls_ahead_used"] == 1
    assert stats["pulls_ahead_dropped"] == 9
    # A push between the pull ahead and its lookup: the pushed row is fresh.
    ops.pull_ahead(client, ids, "t", DIM)
    ops.push(client, tf.constant([7], tf.int64), tf.ones([1, DIM]), 1.0, "t", DIM, sync=True)
    np.testing.assert_array_equal(
        ops.lookup(client, ids, "t", DIM), ops.lookup(client, ids, "t", DIM, training=False)
    )
    assert ops.client_stats(client)["pulled_ahead_stale_rows"] == 1
    # A push once the pull ahead is done: the pushed id is pulled again at
    # once (a refresh ahead), so the lookup pulls nothing and is fresh.
    # (The push before may have been refreshed ahead too, or not.)
    before = ops.client_stats(client)
    pulls, refreshed = before["pulls"], before["pulled_ahead_refreshed_rows"]
    ops.pull_ahead(client, ids, "t", DIM)
    _wait_for(lambda: ops.client_stats(client)["pulls"] == pulls + 1)
    ops.push(client, tf.constant([1, 9], tf.int64), tf.ones([2, DIM]), 1.0, "t", DIM, sync=True)
    _wait_for(lambda: ops.client_stats(client)["pulled_ahead_refreshed_rows"] == refreshed + 1)
    rows = ops.lookup(client, ids, "t", DIM)
    stats = ops.client_stats(client)
    assert stats["pulls"] == pulls + 2 and stats["pulled_ahead_stale_rows"] == 2
    np.testing.assert_array_equal(rows, ops.lookup(client, ids, "t", DIM, training=False))
    # Without refresh the lookup keeps the rows as pulled: a push after the
    # pull (waited for: the pull runs on a worker thread) is missed.
    before = ops.lookup(client, ids, "t", DIM, training=False)
    pulls = ops.client_stats(client)["pulls"]
    ops.pull_ahead(client, ids, "t", DIM, refresh=False)
    _wait_for(lambda: ops.client_stats(client)["pulls"] == pulls + 1)
    ops.push(client, tf.constant([7], tf.int64), tf.ones([1, DIM]), 1.0, "t", DIM, sync=True)
    np.testing.assert_array_equal(ops.lookup(client, ids, "t", DIM), before)
    assert not np.array_equal(ops.lookup(client, ids, "t", DIM, training=False), before)
    assert ops.client_stats(client)["pulled_ahead_stale_rows"] == 2
    assert ops.client_stats(client)["pulled_ahead_refreshed_rows"] == refreshed + 1


def test_a_pull_ahead_left_by_a_stopped_pipeline_is_never_served(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A fit that failed (or ended) leaves the pulls its input pipeline began
    for batches it never trained; rows then change without a push of this
    client (a checkpoint loaded, another trainer). The next fit's lookup of
    the same ids takes its own, newer pull ahead, not the left one; and the
    fit drops what it left when it returns."""
    cluster = start_cluster(1)
    client = ops.ClientResource(cluster.addresses)
    ids = tf.constant([5, 6, 5], tf.int64)
    with cluster.client() as control:
        control.create_table("t", DIM)
        ops.pull_ahead(client, ids, "t", DIM, refresh=False)  # left by the stopped fit
        _wait_for(lambda: ops.client_stats(client)["pulls"] == 1)
        control.assign("t", [5, 6], np.full((2, DIM), 3.0, np.float32))
    ops.pull_ahead(client, ids, "t", DIM, refresh=False)  # the next fit's own
    np.testing.assert_array_equal(ops.lookup(client, ids, "t", DIM), np.full((3, DIM), 3.0))
    stats = ops.client_stats(client)
    assert stats["pulls_ahead_used"] == 1 and stats["pulls_ahead_dropped"] == 1
    assert stats["pulls"] == 2
    # Dropped when the fit ends: a lookup without a pull ahead of its own
    # (a custom loop, train_on_batch) then pulls the rows as they are.
    ops.pull_ahead(client, ids, "t", DIM, refresh=False)
    _wait_for(lambda: ops.client_stats(client)["pulls"] == 3)
    with cluster.client() as control:
        control.assign("t", [5, 6], np.full((2, DIM), 4.0, np.float32))
    ops.drop_pulled_ahead(client)
    np.testing.assert_array_equal(ops.lookup(client, ids, "t", DIM), np.full((3, DIM), 4.0))
    stats = ops.client_stats(client)
    assert stats["pulls_ahead_used"] == 1 and stats["pulls_ahead_dropped"] == 2


def test_embedded_tables_and_models_pull_ahead_cannot_serve(tmp_path: Any) -> None:
    model = _model()
    tf_dlt.pull_ahead(model)  # embedded: fits as before, nothing pulled
    x, y = _data(32)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert _stats(model)["pulls_ahead"] == 0

    class Tower(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.emb = Embedding(output_dim=DIM, is_distributed=True)

        def call(self, ids: Any) -> Any:
            return self.emb(ids)

    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="no symbolic inputs"):
        tf_dlt.pull_ahead(Tower())
    ids = keras.Input((2,), dtype="int64")
    emb = Embedding(output_dim=DIM, is_distributed=True, name="shifted")
    computed = keras.Model(ids, emb(keras.ops.add(ids, 1)))
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="is not called on a model input"):
        tf_dlt.pull_ahead(computed, layers=["shifted"])
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="no distributed Embedding"):
        tf_dlt.pull_ahead(computed)
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="is not a distributed"):
        tf_dlt.pull_ahead(model, layers=["dense"])


def test_a_pull_ahead_that_failed_on_a_killed_shard_fails_its_lookup_then_recovers(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(2)
    with cluster.client() as control:
        control.create_table("t", DIM)
    client = ops.ClientResource(cluster.addresses, request_timeout=5.0)
    ids = tf.range(100, dtype=tf.int64)
    cluster.kill(1)
    ops.pull_ahead(client, ids, "t", DIM)  # its pull fails; the op itself returns at once
    # The lookup takes the failed pull ahead, pulls again, and names the shard.
    with pytest.raises(tf.errors.UnavailableError, match="shard 1"):
        ops.lookup(client, ids, "t", DIM)
    assert ops.client_stats(client)["pulls_ahead_used"] == 1
    cluster.restart(1)
    with cluster.client() as control:
        control.create_table("t", DIM)
    ops.pull_ahead(client, ids, "t", DIM)
    np.testing.assert_array_equal(
        ops.lookup(client, ids, "t", DIM), ops.lookup(client, ids, "t", DIM, training=False)
    )
    assert ops.client_stats(client)["pulls_ahead_used"] == 2


def test_a_table_two_inputs_share_is_pulled_ahead_for_each(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A two-tower model whose towers share one table (one layer called on
    two inputs): both lookups of every step take their own pull ahead, and
    none is dropped for the other."""
    cluster = start_cluster(1)
    users, items = keras.Input((2,), dtype="int64"), keras.Input((2,), dtype="int64")
    shared = Embedding(output_dim=4, is_distributed=True, name="towers_emb")
    tower = keras.layers.Flatten()
    dot = keras.layers.Dot(axes=1)([tower(shared(users)), keras.layers.Flatten()(shared(items))])
    model = keras.Model([users, items], dot)
    model.compile(optimizer="sgd", loss="mse")
    remote = tf_dlt.pull_ahead(tf_dlt.transpile(model, cluster.addresses))
    rng = np.random.default_rng(0)
    x = [rng.integers(0, 50, (64, 2)), rng.integers(50, 100, (64, 2))]
    remote.fit(x, rng.normal(size=(64, 1)), batch_size=BATCH, epochs=2, verbose=0)
    stats = ops.client_stats(remote.get_layer("towers_emb").client)
    steps = 2 * 64 // BATCH
    assert stats["pulls_ahead_used"] == 2 * steps  # every lookup took its own


def test_a_frozen_layer_makes_no_rows_and_its_pulls_ahead_serve_it(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Fine-tuning with one table frozen (trainable=False): its training
    lookups made a row for every id they met (rows that evicted trained
    ones past max_rows), and read the initializer's values where evaluate
    and the exports read zeros. A frozen layer reads as inference does,
    its pulls ahead alike (each one served), and its table keeps the rows
    it had."""
    cluster = start_cluster(2)
    model = _remote(_model(), cluster)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    trained = _rows(model, "u_emb")
    with cluster.client() as client:
        held = client.list_tables()["u_emb"]["rows"]
    frozen = model.get_layer("u_emb")
    frozen.trainable = False
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    unseen = {**x, "user": x["user"] + 3 * VOCAB}  # ids no row was made for
    before = _stats(model)
    tf_dlt.pull_ahead(model).fit(unseen, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with cluster.client() as client:
        assert client.list_tables()["u_emb"]["rows"] == held  # (it grew by every unseen id)
    np.testing.assert_array_equal(_rows(model, "u_emb"), trained)
    steps = len(y) // BATCH
    assert _stats(model)["pulls_ahead_used"] - before["pulls_ahead_used"] == 2 * steps
    # Zeros for ids without a row, as evaluate reads them (not initial values).
    assert not np.any(frozen(unseen["user"][:4], training=True).numpy())
