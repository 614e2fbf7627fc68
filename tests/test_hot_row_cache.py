"""tf_dlt.hot_row_cache: hot rows served from the trainer, with its own pushes
applied as the shards apply them (under sync_push=True training is the same
as without the cache), other trainers' pushes seen within the staleness
bound, failed pushes forgotten, and the counters ClientMetrics logs."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dlt
from tf_dlt import dlt_ops as ops
from tf_dlt import errors
from tf_dlt.layers import Embedding

import frames
from conftest import Cluster, freeze

VOCAB, DIM, BATCH = 40, 4, 16


def _data(n: int = 192) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(5)
    # Zipf-like ids: a few are in nearly every batch.
    items = np.minimum(rng.zipf(1.3, size=(n, 3)), VOCAB) - 1
    return {
        "items": items.astype("int64"),
        "price": rng.normal(size=(n, 2)).astype("float32"),
    }, rng.normal(size=(n, 1)).astype("float32")


def _model() -> keras.Model:
    items = keras.Input((3,), dtype="int64", name="items")
    price = keras.Input((2,), name="price")
    i = Embedding(output_dim=DIM, is_distributed=True, name="hc_emb", seed=2)(items)
    i = keras.layers.GlobalAveragePooling1D()(i)
    x = keras.layers.Concatenate()([i, price])
    x = keras.layers.Dense(8, activation="relu")(x)
    model = keras.Model({"items": items, "price": price}, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    return model


def _remote(model: keras.Model, cluster: Cluster) -> keras.Model:
    remote = tf_dlt.transpile(model, cluster.addresses)
    remote.get_layer("hc_emb").sync_push = True
    return remote


def _shard_rows(cluster: Cluster, table: str, ids: np.ndarray, dim: int = DIM) -> np.ndarray:
    """Rows as the shards hold them, read by a client of its own (no cache)."""
    reader = ops.ClientResource(cluster.addresses, request_timeout=29.0)
    return ops.lookup(reader, ids, table, dim, training=False, missing="zeros").numpy()


def _fresh_client(addresses: list[str]) -> ops.ClientResource:
    """A client resource no earlier test holds: resources are shared by
    addresses and options, and a cluster may get an earlier one's port
    (its cache and counters would carry over)."""
    return ops.ClientResource(addresses, instance=uuid.uuid4().hex)


def test_cache_trains_exactly_as_without_under_sync_push(
    start_cluster: Callable[..., Cluster],
) -> None:
    model = _model()
    plain_cluster, cached_cluster = start_cluster(2), start_cluster(2)
    plain = _remote(model, plain_cluster)
    cached = tf_dlt.hot_row_cache(_remote(model, cached_cluster), rows=16, max_staleness_steps=1000)
    x, y = _data()
    histories = []
    for m in (plain, cached):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        h = m.fit(ds, epochs=2, verbose=0, callbacks=[tf_dlt.ClientMetrics(logs="all")])
        histories.append(h.history)
    np.testing.assert_array_equal(histories[0]["loss"], histories[1]["loss"])
    for a, b in zip(plain.get_weights(), cached.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    ids = np.arange(VOCAB, dtype=np.int64)
    np.testing.assert_array_equal(
        _shard_rows(plain_cluster, "hc_emb", ids), _shard_rows(cached_cluster, "hc_emb", ids)
    )
    # The cache served, its rows follow the pushes, and it held its bound.
    logs = histories[1]
    stats = ops.client_stats(cached.get_layer("hc_emb").client)
    assert stats["cache_hits"] > 0 and stats["cache_applied_rows"] > 0
    assert 0 < stats["cache_rows"] <= 16
    assert sum(logs["dlt_cache_hits"]) == stats["cache_hits"]
    assert 0 < logs["dlt_cache_hit_rate"][-1] < 1
    assert sum(logs["dlt_cache_bytes_saved"]) == stats["cache_hits"] * (8 + 4 * DIM)
    assert logs["dlt_cache_capacity_bytes"][-1] >= logs["dlt_cache_bytes"][-1] > 0
    assert histories[0]["dlt_cache_hits"] == [0.0, 0.0]


def test_an_op_of_another_dim_than_its_cache_is_refused(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A cache keeps rows of its config's dim; a lookup or push of another
    dim sized its buffers by its own: it was served half of the next row
    (or a cut row), then the process aborted on a corrupt heap."""
    cluster = start_cluster(1)
    config = cluster.client().create_table("t", DIM, optimizer="adagrad", seed=4)
    mine = _fresh_client(cluster.addresses)
    ops.configure_cache(mine, config, rows=8, max_staleness_steps=100, min_count=1)
    ids = np.array([3, 11, -7], dtype=np.int64)
    first = ops.lookup(mine, ids, "t", DIM).numpy()
    for dim in (2 * DIM, DIM // 2):
        with pytest.raises(tf.errors.InvalidArgumentError, match="its hot-row cache's .* 4"):
            ops.lookup(mine, ids, "t", dim)
        grads = np.full((3, dim), 0.25, dtype=np.float32)
        with pytest.raises(tf.errors.InvalidArgumentError, match="its hot-row cache's .* 4"):
            ops.push(mine, ids, grads, 0.1, "t", dim, sync=True)
    # Nothing reached the cache or the shards.
    np.testing.assert_array_equal(ops.lookup(mine, ids, "t", DIM).numpy(), first)
    np.testing.assert_array_equal(_shard_rows(cluster, "t", ids), first)


def test_a_cache_config_that_is_not_the_tables_is_refused(
    start_cluster: Callable[..., Cluster],
) -> None:
    """The cache applies pushes with the config it is given: an FTRL cache
    of an Adam table (the same state width) served rows the shards never
    held, and an SGD one of an Adagrad table failed every lookup INTERNAL."""
    cluster = start_cluster(1)
    cluster.client().create_table("t", DIM, optimizer="adam", seed=4)
    mine = _fresh_client(cluster.addresses)
    for optimizer, dim, says in (
        ("ftrl", DIM, "optimizer.kind: adam vs ftrl"),
        ("adam", 2 * DIM, "dim: 4 vs 8"),
    ):
        other = tf_dlt.TableConfig.create("t", dim, optimizer=optimizer, seed=4)
        with pytest.raises(errors.FailedPreconditionError, match=says):
            ops.configure_cache(mine, other, rows=8, max_staleness_steps=100, min_count=1)
    assert ops.client_stats(mine)["cache_rows"] == 0
    # The table's own config is taken; a table not made yet is not checked.
    table = tf_dlt.TableConfig.create("t", DIM, optimizer="adam", seed=4)
    ops.configure_cache(mine, table, rows=8, max_staleness_steps=100, min_count=1)
    later = tf_dlt.TableConfig.create("later", DIM, optimizer="sgd")
    ops.configure_cache(mine, later, rows=8, max_staleness_steps=100, min_count=1)


def test_a_load_empties_the_cache(start_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    """tf_dlt.load (and resilient_fit, which calls it) replaces the shards'
    rows: the cache kept serving the rows and slots of before it, and the
    pushes applied to them mixed both into the shards' rows."""
    cluster = start_cluster(2)
    model = tf_dlt.hot_row_cache(_remote(_model(), cluster), rows=64, max_staleness_steps=1000)
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    ids = np.arange(VOCAB, dtype=np.int64)
    model.fit(ds, epochs=1, verbose=0)
    tf_dlt.save(model, str(tmp_path / "e1"))
    saved = _shard_rows(cluster, "hc_emb", ids)
    model.fit(ds, epochs=1, verbose=0)
    client = model.get_layer("hc_emb").client
    assert ops.client_stats(client)["cache_rows"] > 0
    tf_dlt.load(model, str(tmp_path / "e1"))
    served = ops.lookup(client, ids, "hc_emb", DIM, training=False, missing="zeros")
    np.testing.assert_array_equal(served.numpy(), saved)


def test_other_trainers_pushes_reach_cached_rows_within_the_staleness_bound(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(2)
    config = cluster.client().create_table("t", DIM, optimizer="adagrad", seed=4)
    mine = _fresh_client(cluster.addresses)
    other = ops.ClientResource(cluster.addresses, request_timeout=28.0)
    ops.configure_cache(mine, config, rows=8, max_staleness_steps=3, min_count=1)
    ids = np.array([3, 11, -7], dtype=np.int64)
    ops.lookup(other, ids, "t", DIM)  # the rows exist
    first = ops.lookup(mine, ids, "t", DIM).numpy()  # lookup 1: pulled and cached
    grads = np.full((3, DIM), 0.25, dtype=np.float32)
    ops.push(other, ids, grads, 0.1, "t", DIM, sync=True)
    fresh = _shard_rows(cluster, "t", ids)
    assert not np.array_equal(first, fresh)
    for _ in range(2):  # lookups 2 and 3: 1 and 2 lookups old, within the bound
        np.testing.assert_array_equal(ops.lookup(mine, ids, "t", DIM).numpy(), first)
    np.testing.assert_array_equal(ops.lookup(mine, ids, "t", DIM).numpy(), fresh)
    stats = ops.client_stats(mine)
    assert stats["cache_hits"] == 6 and stats["cache_refreshes"] == 3
    assert stats["cache_max_staleness_steps"] == 2
    # This trainer's own push is applied at once, as the shards apply it.
    ops.push(mine, ids, grads, 0.1, "t", DIM, sync=True)
    np.testing.assert_array_equal(
        ops.lookup(mine, ids, "t", DIM).numpy(), _shard_rows(cluster, "t", ids)
    )
    assert ops.client_stats(mine)["cache_hits"] == 9


def test_new_ids_are_made_and_cached_in_one_exchange(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A fill of ids the shards hold no row for yet makes their rows as a
    training lookup would and caches them: one state pull, no plain pull of
    the same ids after it."""
    cluster = start_cluster(2)
    config = cluster.client().create_table("t", DIM, optimizer="adagrad", seed=4)
    mine = _fresh_client(cluster.addresses)
    ops.configure_cache(mine, config, rows=8, max_staleness_steps=100, min_count=1)
    ids = np.array([3, 11, -7, 42], dtype=np.int64)
    first = ops.lookup(mine, ids, "t", DIM).numpy()
    stats = ops.client_stats(mine)
    assert stats["cache_fills"] == 4 and stats["cache_rows"] == 4
    assert stats["pulls"] == 1 and stats["pulled_rows"] == 4, stats
    np.testing.assert_array_equal(first, _shard_rows(cluster, "t", ids))  # made there
    assert np.count_nonzero(first) > 0  # initial values, not zeros
    np.testing.assert_array_equal(ops.lookup(mine, ids, "t", DIM).numpy(), first)
    stats = ops.client_stats(mine)
    assert stats["cache_hits"] == 4 and stats["pulls"] == 1


@pytest.mark.parametrize("missing", ["zeros", "init"])
def test_inference_lookups_through_a_cache_insert_nothing(
    start_cluster: Callable[..., Cluster], missing: str
) -> None:
    """An inference lookup's fills use the state pull that inserts nothing:
    ids without a row read what the lookup's mode reads, and stay absent."""
    cluster = start_cluster(1)
    config = cluster.client().create_table("t", DIM, optimizer="adagrad", seed=4)
    mine = _fresh_client(cluster.addresses)
    ops.configure_cache(mine, config, rows=8, max_staleness_steps=100, min_count=1)
    reader = ops.ClientResource(cluster.addresses, request_timeout=29.0)
    ops.lookup(reader, np.array([1, 2], dtype=np.int64), "t", DIM)  # rows 1 and 2 exist
    ids = np.array([1, 2, 99], dtype=np.int64)
    got = ops.lookup(mine, ids, "t", DIM, training=False, missing=missing).numpy()
    want = ops.lookup(reader, ids, "t", DIM, training=False, missing=missing).numpy()
    np.testing.assert_array_equal(got, want)
    assert (np.count_nonzero(got[2]) > 0) == (missing == "init")
    stats = ops.client_stats(mine)
    assert stats["cache_fills"] == 2 and stats["cache_rows"] == 2 and stats["pulls"] == 2
    assert cluster.client().list_tables()["t"]["rows"] == 2


@contextlib.contextmanager
def _shard_before_state_insert(address: str) -> Iterator[str]:
    """A loopback proxy to the shard at `address` that makes it answer as a
    shard older than pull mode 4 does: a mode-4 pull reaches it as mode 5,
    which it refuses (INVALID_ARGUMENT). Yields the proxy's address."""
    listener = socket.create_server(("127.0.0.1", 0))
    sockets: list[socket.socket] = [listener]

    def pump(src: socket.socket, dst: socket.socket, rewrite: bool) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                if not rewrite:
                    data = src.recv(1 << 16)
                    if not data:
                        break
                    dst.sendall(data)
                    continue
                header = bytearray(frames.recv_exact(src, frames.HEADER.size))
                payload = bytearray(frames.recv_exact(src, frames.HEADER.unpack(header)[5]))
                if header[5] == frames.PULL and len(payload) > 10 and payload[10] == 4:
                    payload[10] = 5
                dst.sendall(bytes(header + payload))
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = listener.accept()
                host, port = address.rsplit(":", 1)
                upstream = socket.create_connection((host, int(port)), timeout=30)
                upstream.settimeout(None)
                sockets.extend((client, upstream))
                for a, b, rewrite in ((client, upstream, True), (upstream, client, False)):
                    threading.Thread(target=pump, args=(a, b, rewrite), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()


def test_a_cache_on_shards_older_than_its_state_pull_falls_back(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Shards that refuse pull mode 4 (older than the trainer) are filled
    with mode 3, ids without a row pulled again plainly: lookups give the
    same rows, and the refusal is met once."""
    cluster = start_cluster(1)
    config = cluster.client().create_table("t", DIM, optimizer="adagrad", seed=4)
    ids = np.array([3, 11, -7, 42], dtype=np.int64)
    with _shard_before_state_insert(cluster.addresses[0]) as proxy:
        plain = ops.ClientResource([proxy])  # other modes pass as they are
        zeros = ops.lookup(plain, ids, "t", DIM, training=False, missing="zeros").numpy()
        np.testing.assert_array_equal(zeros, np.zeros((4, DIM)))
        raw = tf_dlt._native.Client([proxy])
        with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="got 5"):
            raw.pull_state("t", DIM, DIM, ids, insert=True)  # as an old shard refuses it
        mine = plain.private("cached")  # its own counters
        ops.configure_cache(mine, config, rows=8, max_staleness_steps=100, min_count=1)
        first = ops.lookup(mine, ids, "t", DIM).numpy()  # new ids: made by the plain pull
        np.testing.assert_array_equal(first, _shard_rows(cluster, "t", ids))
        more = np.array([3, 11, -7, 42, 5], dtype=np.int64)
        second = ops.lookup(mine, more, "t", DIM).numpy()
        np.testing.assert_array_equal(second, _shard_rows(cluster, "t", more))
        stats = ops.client_stats(mine)
    # Lookup 1: the refused pull and its mode-3 retry (one call), then the
    # 4 ids it found no row for pulled plainly (not cached); lookup 2: a
    # mode-3 fill of the 4, made now, and id 5 pulled plainly (no id looked
    # up once had been looked up again yet: no fill at count 1).
    assert stats["pulls"] == 4 and stats["pull_errors"] == 0, stats
    assert stats["pulled_rows"] == 4 + 4 + 4 + 1
    assert stats["cache_fills"] == 4 and stats["cache_rows"] == 4
    assert cluster.client().list_tables()["t"]["rows"] == 5


def _two_cached_rows(
    start_cluster: Callable[..., Cluster],
) -> tuple[Cluster, ops.ClientResource, np.ndarray, np.ndarray]:
    """A shard with an SGD table "t", and a client whose cache holds its
    rows 1 and 2: (the shard, the client, the ids, their rows)."""
    cluster = start_cluster(1)
    config = cluster.client().create_table("t", DIM, optimizer="sgd")
    mine = _fresh_client(cluster.addresses)
    ops.configure_cache(mine, config, rows=8, max_staleness_steps=100, min_count=1)
    ids = np.array([1, 2], dtype=np.int64)
    ops.lookup(mine, ids, "t", DIM)
    return cluster, mine, ids, ops.lookup(mine, ids, "t", DIM).numpy()  # cached now


def test_a_push_the_shards_would_refuse_is_refused_at_once_and_changes_no_cached_row(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A push of non-finite gradients (or a bad learning rate) fails as it is
    issued, asynchronous or not, before the cache applies it: a lookup while
    it waited to be sent was served its NaN rows from the cache."""
    cluster, mine, ids, before = _two_cached_rows(start_cluster)
    refreshes = ops.client_stats(mine)["cache_refreshes"]
    bad = np.full((2, DIM), np.nan, dtype=np.float32)
    for sync in (False, True):
        with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
            ops.push(mine, ids, bad, 0.1, "t", DIM, sync=sync)
    with pytest.raises(tf.errors.InvalidArgumentError, match="learning rate"):
        ops.push(mine, ids, np.ones((2, DIM), np.float32), -1.0, "t", DIM)
    np.testing.assert_array_equal(ops.lookup(mine, ids, "t", DIM).numpy(), before)
    assert ops.client_stats(mine)["cache_refreshes"] == refreshes  # served from the cache
    ops.flush(mine)  # nothing was sent
    np.testing.assert_array_equal(_shard_rows(cluster, "t", ids), before)


def test_a_row_the_shards_leave_as_it_was_is_never_served_changed(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A row whose repeats sum past what a shard takes is left as it was by
    the shards (the push's other rows applied, INVALID_ARGUMENT): while the
    push is on its way the cache reads that row again instead of serving
    its own update of it; the rest of the push it serves."""
    cluster, mine, ids, before = _two_cached_rows(start_cluster)
    for p in cluster.processes:
        freeze(p)
    served: list[np.ndarray] = []
    try:
        # Id 1 twice: 2 x 9e17 passes the 1e18 a gradient may reach.
        pushed = np.array([1, 1, 2], dtype=np.int64)
        ops.push(mine, pushed, np.full((3, DIM), 9e17, np.float32), 0.1, "t", DIM)
        reader = threading.Thread(
            target=lambda: served.append(ops.lookup(mine, ids, "t", DIM).numpy())
        )
        reader.start()
        reader.join(1.0)
        assert not served  # row 1 is read from the (frozen) shard, not served
    finally:
        for p in cluster.processes:
            p.send_signal(signal.SIGCONT)
    reader.join(30)
    with pytest.raises(tf.errors.InvalidArgumentError, match="sum past"):
        ops.flush(mine)
    np.testing.assert_array_equal(served[0][0], before[0])
    np.testing.assert_allclose(served[0][1], before[1] - 0.1 * 9e17, rtol=1e-6)
    np.testing.assert_array_equal(_shard_rows(cluster, "t", ids)[0], before[0])


def test_a_cache_whose_rows_with_their_state_pass_a_frame_says_so(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A cache pulls rows with their optimizer slots: a dim-512 Adam row
    fits a 4 KiB frame, with its slots it takes 6 KiB. The error said "one
    row of dim 512 exceeds the frame limit", which a plain lookup belied."""
    cluster = start_cluster(1)
    config = cluster.client().create_table("wide", 512, optimizer="adam")
    mine = ops.ClientResource(cluster.addresses, frame_bytes=4096, instance=uuid.uuid4().hex)
    ids = np.array([1, 2], dtype=np.int64)
    ops.lookup(mine, ids, "wide", 512)  # fits
    ops.configure_cache(mine, config, rows=8, max_staleness_steps=100, min_count=1)
    said = r"dim 512 with its optimizer state \(6148 bytes\)"
    with pytest.raises(tf.errors.ResourceExhaustedError, match=said):
        ops.lookup(mine, ids, "wide", 512)


def test_cached_tables_are_not_pulled_ahead(start_cluster: Callable[..., Cluster]) -> None:
    model = tf_dlt.pull_ahead(
        tf_dlt.hot_row_cache(_remote(_model(), start_cluster(1)), rows=8, max_staleness_ms=60000)
    )
    x, y = _data(64)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    stats = ops.client_stats(model.get_layer("hc_emb").client)
    assert stats["pulls_ahead"] == 0 and stats["cache_hits"] > 0


def test_hot_row_cache_errors_and_embedded_no_op(start_cluster: Callable[..., Cluster]) -> None:
    embedded = _model()
    embedded.build({"items": (None, 3), "price": (None, 2)})
    assert tf_dlt.hot_row_cache(embedded, rows=8) is embedded  # nothing to cache
    x, y = _data(32)
    embedded.fit(x, y, batch_size=BATCH, verbose=0)
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="rows must be an int"):
        tf_dlt.hot_row_cache(embedded, rows=-1)
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="max_staleness_steps or"):
        tf_dlt.hot_row_cache(embedded, rows=8, max_staleness_steps=None)
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="max_staleness_ms must be"):
        tf_dlt.hot_row_cache(embedded, rows=8, max_staleness_ms=0)
    for bad in (0, 256, 2.0, True):
        with pytest.raises(
            tf_dlt.errors.InvalidArgumentError, match=r"min_count must be .*\[1, 255\]"
        ):
            tf_dlt.hot_row_cache(embedded, rows=8, min_count=bad)
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="not a distributed Embedding"):
        tf_dlt.hot_row_cache(embedded, rows=8, layers=["price"])
    # A name alone was taken letter by letter ("'h' is not a distributed
    # Embedding"); True was a staleness of 1.
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="'hc_emb' alone"):
        tf_dlt.hot_row_cache(embedded, rows=8, layers="hc_emb")  # type: ignore[arg-type]
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="layers must be"):
        tf_dlt.hot_row_cache(embedded, rows=8, layers=3)  # type: ignore[arg-type]
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="max_staleness_steps must"):
        tf_dlt.hot_row_cache(embedded, rows=8, max_staleness_steps=True)
    dense_only = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="no distributed Embedding"):
        tf_dlt.hot_row_cache(dense_only, rows=8)
    cluster = start_cluster(1)
    config = cluster.client().create_table("t", DIM)
    with pytest.raises(tf.errors.InvalidArgumentError, match="min_count"):
        ops.configure_cache(ops.ClientResource(cluster.addresses), config, 8,
                            max_staleness_steps=2, min_count=0)  # fmt: skip


def test_a_cache_of_one_of_two_layers_sharing_a_table_trains_as_without(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Two layers share a table (table_name=); a cache of one of them moved
    it alone to a client of the model's own, and the other's pushes went
    past the cache: losses and rows differed from a run without it. Every
    layer of the table looks it up through the cache."""
    items = keras.Input((3,), dtype="int64", name="items")
    price = keras.Input((2,), name="price")
    pooled = [
        keras.layers.GlobalAveragePooling1D()(
            Embedding(
                output_dim=DIM, is_distributed=True, name=name, table_name="hc_shared", seed=2
            )(ids)
        )
        for name, ids in (("hc_a", items), ("hc_b", keras.ops.flip(items, axis=1)))
    ]
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([*pooled, price]))
    model = keras.Model({"items": items, "price": price}, out)
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    x, y = _data()
    runs = []
    for cache in (False, True):
        cluster = start_cluster(2)
        remote = tf_dlt.transpile(model, cluster.addresses)
        for name in ("hc_a", "hc_b"):
            remote.get_layer(name).sync_push = True
        if cache:
            tf_dlt.hot_row_cache(remote, rows=16, max_staleness_steps=1000, layers=["hc_a"])
        history = remote.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
        losses = history["loss"]
        runs.append((losses, _shard_rows(cluster, "hc_shared", np.arange(VOCAB, dtype=np.int64))))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert ops.client_stats(remote.get_layer("hc_b").client)["cache_hits"] > 0


def test_a_cache_of_a_table_trained_in_16_bits_is_refused(
    start_cluster: Callable[..., Cluster],
) -> None:
    """The shards round each update of a bfloat16 or float16 table into 16
    bits; the cache applied this trainer's pushes in float32, and served
    rows that drifted from the shards' with every push (bitwise equal
    training was promised)."""
    items = keras.Input((3,), dtype="int64", name="items")
    emb = Embedding(output_dim=DIM, is_distributed=True, name="hc_bf16", value_dtype="bfloat16")
    model = keras.Model(items, keras.layers.Dense(1)(keras.layers.Flatten()(emb(items))))
    model.compile(optimizer="adagrad", loss="mse")
    remote = tf_dlt.transpile(model, start_cluster(1).addresses)
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="stored as bfloat16"):
        tf_dlt.hot_row_cache(remote, rows=16)
    tf_dlt.pull_ahead(remote)  # what it says to use instead
    remote.fit(_data(32)[0]["items"], np.ones(32), batch_size=BATCH, verbose=0)
    # Frozen, it is cached (it pushes nothing); unfrozen, its first
    # training step is refused the same way (its pushes went through the
    # cache in float32).
    frozen = tf_dlt.transpile(model, start_cluster(1).addresses)
    frozen.get_layer("hc_bf16").trainable = False
    frozen.compile(optimizer="adagrad", loss="mse")
    tf_dlt.hot_row_cache(frozen, rows=16, max_staleness_steps=1000, min_count=1)
    frozen.fit(_data(32)[0]["items"], np.ones(32), batch_size=BATCH, verbose=0)
    frozen.get_layer("hc_bf16").trainable = True
    frozen.compile(optimizer="adagrad", loss="mse")
    with pytest.raises(tf_dlt.errors.InvalidArgumentError, match="through a hot-row cache"):
        frozen.fit(_data(32)[0]["items"], np.ones(32), batch_size=BATCH, verbose=0)


def test_a_frozen_layers_cache_takes_the_tables_optimizer_as_the_shards_hold_it(
    start_cluster: Callable[..., Cluster],
) -> None:
    """Fine-tuning the head with RMSprop, the table frozen: hot_row_cache
    made the table follow the compiled optimizer (ValueError: RMSprop has no
    table form) though a frozen layer pushes nothing. The cache takes the
    table's config as the shards hold it (Adagrad here), serves its hot
    rows, and the table keeps its rows."""
    cluster = start_cluster(2)
    model = _remote(_model(), cluster)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    ids = np.arange(VOCAB, dtype=np.int64)
    trained = _shard_rows(cluster, "hc_emb", ids)
    model.get_layer("hc_emb").trainable = False
    model.compile(optimizer=keras.optimizers.RMSprop(0.01), loss="mse")
    tf_dlt.hot_row_cache(model, rows=16, max_staleness_steps=1000, min_count=1)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    stats = ops.client_stats(model.get_layer("hc_emb").client)
    assert stats["cache_hits"] > 0
    np.testing.assert_array_equal(_shard_rows(cluster, "hc_emb", ids), trained)


def test_a_cache_taken_frozen_follows_the_optimizer_the_table_takes_when_unfrozen(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A frozen layer's cache takes the table's optimizer as the shards
    hold it. Unfrozen and recompiled with another optimizer (the table,
    never trained, takes it), the cache kept the old one: Adam's state
    pulls failed ("reply of 580 bytes; the request expects 404"). It
    follows the table, and trains as without the cache."""
    x, y = _data()
    base = _model()

    def run(cached: bool) -> list[float]:
        model = _remote(base, start_cluster(1))
        layer = model.get_layer("hc_emb")
        layer.trainable = False
        model.compile(optimizer=keras.optimizers.RMSprop(0.01), loss="mse")
        if cached:
            tf_dlt.hot_row_cache(model, rows=16, max_staleness_steps=1000, min_count=1)
        model.predict(x, batch_size=BATCH, verbose=0)
        layer.trainable = True
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return list(history.history["loss"])

    np.testing.assert_allclose(run(cached=True), run(cached=False), rtol=1e-6)
