"""The Dlt> TensorFlow ops against real shard processes and the embedded
transport. Oracles: tf_dlt.Client.pull (the Python client of the same
shards), the in-process table core, and tf.math.unsorted_segment_sum."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tf_dlt
from tf_dlt import _native, errors
from tf_dlt import dlt_ops as ops
from tf_dlt.table_config import TableConfig

import frames
from conftest import Cluster

DIM = 8


def _ids(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    ids[: n // 3] = ids[n // 3 : 2 * (n // 3)]  # duplicates
    ids[-2:] = [-(2**63), 2**63 - 1]
    return ids


def _remote(cluster: Cluster, optimizer: str = "adagrad", **kwargs: object) -> ops.ClientResource:
    with cluster.client() as client:
        client.create_table("emb", DIM, "uniform", optimizer, seed=4)
    return ops.ClientResource(cluster.addresses, **kwargs)  # type: ignore[arg-type]


def _oracle(optimizer: str = "adagrad") -> _native.Table:
    return _native.Table(TableConfig.create("emb", DIM, "uniform", optimizer, seed=4).to_dict())


def test_remote_lookup_equals_client_pull(cluster: Cluster) -> None:
    client = _remote(cluster)
    ids = _ids(3000).reshape(30, 100)
    rows = ops.lookup(client, ids, "emb", DIM)
    assert rows.shape == (30, 100, DIM) and rows.dtype == tf.float32
    with cluster.client() as py:
        np.testing.assert_array_equal(rows.numpy(), py.pull("emb", ids))


@pytest.mark.parametrize("dim", [3, 256])
def test_lookup_asks_each_distinct_id_once_and_fills_its_repeats(
    cluster: Cluster, dim: int
) -> None:
    """A remote lookup sends each distinct id once, places its row as the
    reply arrives and copies it to the id's repeats: the rows equal an
    in-process table's, with 4 KiB frames (many per shard) and 8 MiB ones,
    12-byte rows (reads end inside rows) and 1 KiB rows (a reply many times
    the client's staging buffer). The shards and the op's client stats count
    the distinct ids; the Python client's pull sends every id, as before."""
    with cluster.client() as py:
        py.create_table("rep", dim, "uniform", "adagrad", seed=4)
    oracle = _native.Table(TableConfig.create("rep", dim, "uniform", "adagrad", seed=4).to_dict())
    ids = _ids(20000, seed=7)
    distinct = len(np.unique(ids))
    assert distinct < len(ids)
    want = oracle.pull(ids)
    for frame_bytes in (4096, 8 << 20):
        with cluster.client(frame_bytes=frame_bytes) as py:
            before = sum(int(s["pulled_rows"]) for s in py.stats())
            resource = ops.ClientResource(cluster.addresses, frame_bytes=frame_bytes)
            got = ops.lookup(resource, ids.reshape(200, 100), "rep", dim).numpy()
            np.testing.assert_array_equal(got.reshape(-1, dim), want)
            assert sum(int(s["pulled_rows"]) for s in py.stats()) - before == distinct
            assert ops.client_stats(resource)["pulled_rows"] == distinct
            np.testing.assert_array_equal(py.pull("rep", ids), want)
            assert sum(int(s["pulled_rows"]) for s in py.stats()) - before == distinct + len(ids)


def test_push_then_lookup_shows_the_optimizer_update(cluster: Cluster) -> None:
    client = _remote(cluster)
    oracle = _oracle()
    ids = _ids(2000, seed=1)
    rows = ops.lookup(client, ids, "emb", DIM)
    np.testing.assert_array_equal(rows.numpy(), oracle.pull(ids))
    upstream = tf.random.stateless_normal((len(ids), DIM), seed=(1, 2))
    unique, summed = ops.lookup_grad(ids, upstream)
    ops.push(client, unique, summed, 0.1, "emb", DIM, sync=True)
    oracle.push(ids, upstream.numpy(), 0.1)  # the shards sum repeats the same way
    np.testing.assert_allclose(
        ops.lookup(client, ids, "emb", DIM).numpy(), oracle.pull(ids), atol=1e-6
    )


def test_async_pushes_are_all_applied_after_flush(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2)
    client = _remote(cluster, "sgd", max_inflight_pushes=2)
    ids = np.arange(500, dtype=np.int64)
    before = ops.lookup(client, ids, "emb", DIM).numpy()
    for _ in range(20):  # more than the bound: later ones wait for admission
        ops.push(client, ids, tf.ones((500, DIM)), 0.01, "emb", DIM)
    ops.flush(client)
    np.testing.assert_allclose(ops.lookup(client, ids, "emb", DIM).numpy(), before - 0.2, atol=1e-5)


def test_lookup_grad_equals_unsorted_segment_sum() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, size=(7, 40)).astype(np.int64)
    grads = rng.normal(size=(7, 40, 5)).astype(np.float32)
    unique, summed = ops.lookup_grad(ids, grads)
    flat = ids.reshape(-1)
    _, first = np.unique(flat, return_index=True)
    np.testing.assert_array_equal(unique.numpy(), flat[np.sort(first)])  # first-seen order
    inverse = np.searchsorted(unique.numpy(), flat, sorter=np.argsort(unique.numpy()))
    inverse = np.argsort(unique.numpy())[inverse]
    expected = tf.math.unsorted_segment_sum(grads.reshape(-1, 5), inverse, len(unique))
    np.testing.assert_allclose(summed.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="ids.shape"):
        ops.lookup_grad(ids, grads[:, :10])


def test_embedded_equals_remote(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(3)
    remote = _remote(cluster, "adam")
    embedded = ops.ClientResource()
    tf_dlt.embedded.create_table(TableConfig.create("emb_adam", DIM, "uniform", "adam", seed=4))
    ids = _ids(1500, seed=5)
    for step in range(3):
        r = ops.lookup(remote, ids, "emb", DIM)
        e = ops.lookup(embedded, ids, "emb_adam", DIM)
        np.testing.assert_allclose(r.numpy(), e.numpy(), atol=1e-6)
        unique, summed = ops.lookup_grad(ids, tf.fill((len(ids), DIM), 0.1 * (step + 1)))
        ops.push(remote, unique, summed, 0.05, "emb", DIM, sync=True)
        ops.push(embedded, unique, summed, 0.05, "emb_adam", DIM, sync=True)


def test_ops_inside_tf_function_and_graph_shapes(cluster: Cluster) -> None:
    client = _remote(cluster, "sgd")
    oracle = _oracle("sgd")

    @tf.function
    def step(ids: tf.Tensor) -> tf.Tensor:
        rows = ops.lookup(client, ids, "emb", DIM)
        loss = tf.reduce_sum(rows * rows)
        grads = 2.0 * rows
        unique, summed = ops.lookup_grad(ids, grads)
        ops.push(client, unique, summed, 0.1, "emb", DIM, sync=True)
        return loss

    ids = _ids(600, seed=7).reshape(20, 30)
    for _ in range(3):
        rows = oracle.pull(ids.reshape(-1))
        expected = float(np.sum(rows.astype(np.float64) ** 2))
        assert float(step(tf.constant(ids))) == pytest.approx(expected, rel=1e-5)
        oracle.push(ids.reshape(-1), 2.0 * rows, 0.1)
    concrete = tf.function(lambda x: ops.lookup(client, x, "emb", DIM)).get_concrete_function(
        tf.TensorSpec([None, 3], tf.int64)
    )
    assert concrete.output_shapes.as_list() == [None, 3, DIM]


def test_client_first_used_inside_a_function_serves_everywhere() -> None:
    client = ops.ClientResource()
    tf_dlt.embedded.create_table(TableConfig.create("scoped", 4))
    first = tf.function(lambda x: ops.lookup(client, x, "scoped", 4))
    second = tf.function(lambda x: tf.reduce_sum(ops.lookup(client, x, "scoped", 4)))
    ids = tf.constant([1, 2], tf.int64)
    np.testing.assert_array_equal(first(ids).numpy(), ops.lookup(client, ids, "scoped", 4).numpy())
    assert float(second(ids)) == pytest.approx(float(tf.reduce_sum(first(ids))))


def test_inference_lookup_inserts_nothing(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1)
    client = _remote(cluster)
    ids = np.arange(10, dtype=np.int64)
    zeros = ops.lookup(client, ids, "emb", DIM, training=False, missing="zeros")
    np.testing.assert_array_equal(zeros.numpy(), 0)
    initial = ops.lookup(client, ids, "emb", DIM, training=False)
    np.testing.assert_array_equal(initial.numpy(), _oracle().pull(ids))
    with cluster.client() as py:
        assert py.list_tables()["emb"]["rows"] == 0


def test_big_batches_are_split_into_frames(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2, "--max-frame-bytes", "65536")
    client = _remote(cluster)
    ids = np.arange(100_000, dtype=np.int64)
    rows = ops.lookup(client, ids, "emb", DIM)
    np.testing.assert_array_equal(rows.numpy(), _oracle().pull(ids))
    ops.push(client, ids, tf.ones((100_000, DIM)), 0.1, "emb", DIM, sync=True)


@pytest.mark.parametrize("optimizer", ["adagrad", "keras_adagrad", "adam"])
def test_an_op_push_of_an_id_repeated_past_a_frame_updates_it_once(
    start_cluster: Callable[..., Cluster], optimizer: str
) -> None:
    """The ops push every occurrence of an id where Keras Adagrad needs each
    one (tf_dlt.layers.Embedding), and several calls' ids at once: 300
    occurrences of one id over 4 KiB frames (100 rows each) go in one frame,
    one update as the in-process table makes it; split, each frame updated
    the row again (Adagrad's step doubled)."""
    cluster = start_cluster(1)
    client = _remote(cluster, optimizer, frame_bytes=4096)
    oracle = _oracle(optimizer)
    ids = np.concatenate([np.arange(150), np.full(300, 7), np.arange(150, 300)]).astype(np.int64)
    grads = np.random.default_rng(3).normal(size=(len(ids), DIM)).astype(np.float32)
    oracle.pull(ids)
    ops.lookup(client, ids, "emb", DIM)
    ops.push(client, ids, grads, 0.1, "emb", DIM, sync=True)
    oracle.push(ids, grads, 0.1)
    got = ops.lookup(client, ids, "emb", DIM, training=False).numpy()
    np.testing.assert_allclose(got, oracle.pull(ids), rtol=1e-5, atol=1e-6)


def test_keras_adagrad_trains_the_same_whatever_the_frame_size(
    start_cluster: Callable[..., Cluster],
) -> None:
    """One step of a model with Keras Adagrad (its ids pushed per
    occurrence) gives the embedded tables' rows on shards with 8 MiB frames
    and with 4 KiB ones (a batch's 2,048 ids of 20 over many frames)."""
    import keras

    from tf_dlt.layers import Embedding

    def model() -> keras.Model:
        keras.utils.set_random_seed(1)
        items = keras.Input((4,), dtype="int64", name="items")
        e = Embedding(output_dim=DIM, is_distributed=True, name="kf_emb", seed=2)(items)
        x = keras.layers.GlobalAveragePooling1D()(e)
        m = keras.Model(items, keras.layers.Dense(1)(x))
        m.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
        return m

    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(512, 4)).astype(np.int64)
    y = (1000 * rng.normal(size=(512, 1))).astype(np.float32)
    ids = np.arange(20, dtype=np.int64)
    got = {}
    for frame_bytes in (8 << 20, 4096):
        cluster = start_cluster(1)
        remote = tf_dlt.transpile(model(), cluster.addresses, frame_bytes=frame_bytes)
        remote.get_layer("kf_emb").sync_push = True
        remote.fit(x, y, batch_size=512, epochs=1, verbose=0, shuffle=False)
        reader = ops.ClientResource(cluster.addresses, frame_bytes=frame_bytes)
        got[frame_bytes] = ops.lookup(reader, ids, "kf_emb", DIM, training=False).numpy()
    # Last: transpile carries an embedded table's rows to the shards.
    model().fit(x, y, batch_size=512, epochs=1, verbose=0, shuffle=False)
    want = ops.lookup(ops.ClientResource(None), ids, "kf_emb", DIM, training=False).numpy()
    for frame_bytes, rows in got.items():
        np.testing.assert_allclose(rows, want, rtol=1e-5, atol=1e-6, err_msg=f"{frame_bytes=}")


def test_xla_is_refused(start_cluster: Callable[..., Cluster]) -> None:
    client = ops.ClientResource()
    tf_dlt.embedded.create_table(TableConfig.create("xla", 4))

    @tf.function(jit_compile=True)
    def f(ids: tf.Tensor) -> tf.Tensor:
        return ops.lookup(client, ids, "xla", 4)

    with pytest.raises((tf.errors.InvalidArgumentError, tf.errors.UnimplementedError)):
        f(tf.constant([1, 2], tf.int64))


# Error kinds, one by one -----------------------------------------------------


def test_non_int64_ids_are_rejected() -> None:
    client = ops.ClientResource()
    tf_dlt.embedded.create_table(TableConfig.create("typed", 4))
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError)):
        ops.lookup(client, tf.constant([1.0, 2.0]), "typed", 4)
    with pytest.raises((TypeError, tf.errors.InvalidArgumentError)):
        ops.lookup(client, tf.constant([1, 2], tf.int32), "typed", 4)
    # Ragged and sparse ids are named, with what to do (a ValueError about
    # len() of a RaggedTensor, or "Attempt to convert a value", before).
    ragged = tf.ragged.constant([[1, 2], [3]], tf.int64)
    sparse = tf.sparse.from_dense(tf.constant([[1, 0], [3, 4]], tf.int64))
    for ids, kind in ((ragged, "RaggedTensor"), (sparse, "SparseTensor")):
        says = f"dense tensor of int64 ids, got a {kind}"
        with pytest.raises(TypeError, match=says):
            ops.lookup(client, ids, "typed", 4)
        with pytest.raises(TypeError, match=says):
            ops.pull_ahead(client, ids, "typed", 4)
        with pytest.raises(TypeError, match=says):
            ops.lookup_grad(ids, tf.zeros((3, 4)))


def test_unknown_table_is_not_found(cluster: Cluster) -> None:
    client = _remote(cluster)
    with pytest.raises(
        tf.errors.NotFoundError, match=r"shard \d \(127.0.0.1:\d+\) Pull: no table 'nope'"
    ):
        ops.lookup(client, np.arange(100, dtype=np.int64), "nope", DIM)
    with pytest.raises(tf.errors.NotFoundError, match="embedded table 'nope'"):
        ops.lookup(ops.ClientResource(), np.arange(3, dtype=np.int64), "nope", DIM)


def test_dim_mismatch_is_invalid_argument(start_cluster: Callable[..., Cluster]) -> None:
    client = _remote(start_cluster(1))
    with pytest.raises(tf.errors.InvalidArgumentError, match="has dim 8, the request says 4"):
        ops.lookup(client, np.arange(3, dtype=np.int64), "emb", 4)


def test_wrong_token_is_unauthenticated(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1, token="tok")
    with cluster.client() as py:
        py.create_table("emb", DIM)
    ok = ops.ClientResource(cluster.addresses, auth_token="tok")
    ops.lookup(ok, np.arange(3, dtype=np.int64), "emb", DIM)
    bad = ops.ClientResource(cluster.addresses, auth_token="wrong")
    with pytest.raises(tf.errors.UnauthenticatedError, match=r"shard 0 \(127.0.0.1:\d+\)"):
        ops.lookup(bad, np.arange(3, dtype=np.int64), "emb", DIM)


def test_row_above_the_frame_limit_is_resource_exhausted(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1, "--max-frame-bytes", "4096")
    with cluster.client() as py:
        py.create_table("wide", 2048)
    client = ops.ClientResource(cluster.addresses)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="exceeds the frame limit"):
        ops.lookup(client, np.arange(3, dtype=np.int64), "wide", 2048)


def test_down_shard_is_unavailable_within_the_deadline() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = ops.ClientResource([f"127.0.0.1:{port}"], connect_timeout=1.0)
    with pytest.raises(tf.errors.UnavailableError, match=rf"shard 0 \(127.0.0.1:{port}\)"):
        ops.lookup(client, np.arange(3, dtype=np.int64), "emb", DIM)


@pytest.fixture
def stalled_shard() -> Iterator[str]:
    """A shard that answers Hello and then never answers anything."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            frames.read_frame(conn)
            # The fixed part, then the topology part clients ask for: epoch 1, no standbys.
            reply = struct.pack("<6IQI", 1, 0, 1, 4096, 0, 1 << 20, 1, 0)
            conn.sendall(frames.frame(frames.HELLO, 0, reply, frames.RESPONSE))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for c in conns:
        c.close()
    listener.close()


def test_stalled_shard_hits_the_deadline(stalled_shard: str) -> None:
    client = ops.ClientResource([stalled_shard], request_timeout=0.5)
    with pytest.raises(tf.errors.DeadlineExceededError, match=r"shard 0 \(127.0.0.1:\d+\) Pull"):
        ops.lookup(client, np.arange(3, dtype=np.int64), "emb", DIM)
    with pytest.raises(tf.errors.DeadlineExceededError, match="Push"):
        ops.push(
            client, np.arange(3, dtype=np.int64), tf.ones((3, DIM)), 0.1, "emb", DIM, sync=True
        )


def test_async_push_error_surfaces_at_flush(start_cluster: Callable[..., Cluster]) -> None:
    client = _remote(start_cluster(1))
    ops.push(client, np.arange(3, dtype=np.int64), tf.ones((3, DIM)), 0.1, "missing", DIM)
    with pytest.raises(tf.errors.NotFoundError, match="no table 'missing'"):
        ops.flush(client)
    ops.flush(client)  # reported once


def test_a_push_that_reports_an_earlier_error_says_it_was_not_sent(
    start_cluster: Callable[..., Cluster],
) -> None:
    """The push that raises an earlier asynchronous push's error is not
    sent (sent and then raised, a caller retrying it would apply it twice):
    its error says so, where it named only the earlier push."""
    cluster = start_cluster(1)
    client = _remote(cluster, optimizer="sgd")
    ids = np.arange(3, dtype=np.int64)
    before = ops.lookup(client, ids, "emb", DIM, training=False).numpy()
    ops.push(client, ids, tf.ones((3, DIM)), 0.1, "missing", DIM)
    for _ in range(400):  # until the client took the failed push's reply
        if ops.client_stats(client)["pushes_in_flight"] == 0:
            break
        time.sleep(0.05)
    with pytest.raises(tf.errors.NotFoundError, match=r"this push was not sent: .*'missing'"):
        ops.push(client, ids, tf.ones((3, DIM)), 0.1, "emb", DIM)
    ops.flush(client)
    np.testing.assert_array_equal(ops.lookup(client, ids, "emb", DIM, training=False), before)


def test_an_empty_push_raises_an_earlier_pushs_error(start_cluster: Callable[..., Cluster]) -> None:
    """docs/ops.md: an asynchronous push's error surfaces on the next push
    or flush, an empty one too (it returned at once, and the error went to
    whichever push came after it)."""
    client = _remote(start_cluster(1))
    ops.push(client, np.arange(3, dtype=np.int64), tf.ones((3, DIM)), 0.1, "missing", DIM)
    for _ in range(400):  # until the client took the failed push's reply
        if ops.client_stats(client)["pushes_in_flight"] == 0:
            break
        time.sleep(0.05)
    empty = np.zeros([0], dtype=np.int64)
    with pytest.raises(tf.errors.NotFoundError, match="no table 'missing'"):
        ops.push(client, empty, tf.zeros((0, DIM)), 0.1, "emb", DIM)
    ops.push(client, empty, tf.zeros((0, DIM)), 0.1, "emb", DIM)  # reported once
    ops.flush(client)


def test_pservers_override(
    start_cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = start_cluster(1)
    with cluster.client() as py:
        py.create_table("emb", DIM)
    monkeypatch.setenv(ops.PSERVERS_ENV, cluster.addresses[0])
    client = ops.ClientResource(["127.0.0.1:1"])  # overridden
    assert ops.lookup(client, np.arange(3, dtype=np.int64), "emb", DIM).shape == (3, DIM)


def test_the_pservers_override_reaches_a_client_equal_to_an_earlier_one(
    start_cluster: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client made under TF_DLT_PSERVERS goes where it says, though one
    made earlier with the same arguments went elsewhere (they were one
    shared client), and the variable is read as Python reads it: spaces
    around each address dropped; a malformed address is named."""
    first, second = start_cluster(1), start_cluster(1)
    for cluster, table in ((first, "in_first"), (second, "in_second")):
        with cluster.client() as py:
            py.create_table(table, DIM)
    ids = np.arange(3, dtype=np.int64)
    before = ops.ClientResource(first.addresses)
    assert ops.lookup(before, ids, "in_first", DIM).shape == (3, DIM)
    monkeypatch.setenv(ops.PSERVERS_ENV, f" {second.addresses[0]} , ")
    after = ops.ClientResource(first.addresses)
    assert ops.lookup(after, ids, "in_second", DIM).shape == (3, DIM)
    monkeypatch.setenv(ops.PSERVERS_ENV, "127.0.0.1")
    with pytest.raises(tf.errors.InvalidArgumentError, match="TF_DLT_PSERVERS.*must be host:port"):
        ops.ClientResource(first.addresses)


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf"), 30 * 86400.0])
def test_a_timeout_the_kernel_cannot_keep_is_refused(seconds: float) -> None:
    """Timeouts are milliseconds in an int: 30 days wrapped to a negative
    deadline (some calls failed at random), inf overflowed, 0 became 1 ms."""
    with pytest.raises(errors.InvalidArgumentError, match="request_timeout must be more than 0"):
        ops.ClientResource(["127.0.0.1:1"], request_timeout=seconds)
    with pytest.raises(errors.InvalidArgumentError, match="connect_timeout must be more than 0"):
        ops.ClientResource(["127.0.0.1:1"], connect_timeout=seconds)
    with pytest.raises(errors.InvalidArgumentError, match="request_timeout must be more than 0"):
        tf_dlt.Client(["127.0.0.1:1"], request_timeout=seconds)


def test_the_longest_timeouts_are_kept_and_the_kernel_checks_its_own() -> None:
    kept = ops.ClientResource(["127.0.0.1:1"], request_timeout=24 * 86400.0)
    assert kept._attrs["request_timeout_ms"] == 24 * 86400 * 1000
    # A graph's attributes that no ClientResource checked.
    with pytest.raises(tf.errors.InvalidArgumentError, match="timeouts must be in"):
        ops.load_library().dlt_client(
            addresses=["127.0.0.1:1"], connect_timeout_ms=1000, request_timeout_ms=2**31,
            frame_bytes=8 << 20, max_inflight_pushes=4, shared_name="dlt_timeouts_unchecked",
        )  # fmt: skip
    # An int: 2**32 wrapped to 0, which the push queue took as 1.
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_inflight_pushes must be in"):
        ops.load_library().dlt_client(
            addresses=["127.0.0.1:1"], connect_timeout_ms=1000, request_timeout_ms=1000,
            frame_bytes=8 << 20, max_inflight_pushes=2**32, shared_name="dlt_inflight_unchecked",
        )  # fmt: skip


def _needed(library: str) -> set[str]:
    out = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True)
    needed = [line for line in out.stdout.splitlines() if "NEEDED" in line]
    return {line.split("[")[1].split("]")[0] for line in needed}


def _defined(library: str) -> list[str]:
    """The demangled names `library` defines (its whole symbol table)."""
    out = subprocess.run(
        ["nm", "--defined-only", "-C", library], capture_output=True, text=True, check=True
    ).stdout  # fmt: skip
    return [line.split(" ", 2)[2] for line in out.splitlines() if line.count(" ") >= 2]


def test_op_library_exports_no_foreign_symbols() -> None:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", "-C", ops.LIBRARY_PATH], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    names = [line.split(" ", 2)[2] for line in out.splitlines() if line.count(" ") >= 2]
    # Only vague-linkage instantiations of the C++ standard library remain.
    foreign = [n for n in names if not ("std::" in n or "__gnu_cxx" in n)]
    assert foreign == []
    # Linked against TensorFlow's framework, the native core and the C/C++
    # runtime only.
    system = {"libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6", "ld-linux-x86-64.so.2"}
    assert _needed(ops.LIBRARY_PATH) - system == {"libtensorflow_framework.so.2", "libdlt_core.so"}


def test_one_native_core_per_process() -> None:
    """The op library and the Python extension both link libdlt_core.so and
    hold no code of the core themselves, so the embedded tables Python
    makes are the ones the ops serve, and the other way round."""
    core = str(Path(ops.LIBRARY_PATH).with_name("libdlt_core.so"))
    # Functions the core's .cc files define (no inline copies in headers).
    core_code = ("dlt::Table::Pull(", "dlt::Shard::CreateTable(", "dlt::Client::Pull(",
                 "dlt::EmbeddedShard()")  # fmt: skip
    for library in (ops.LIBRARY_PATH, _native.__file__):
        assert "libdlt_core.so" in _needed(library), library
        assert not [n for n in _defined(library) if n.startswith(core_code)], library
    assert len({n.split("(")[0] for n in _defined(core) if n.startswith(core_code)}) == 4
    mapped = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if line.endswith("/libdlt_core.so")]  # fmt: skip
    assert set(mapped) == {os.path.realpath(core)}

    config = TableConfig.create("one_core", DIM, "uniform", "sgd", seed=3)
    tf_dlt.embedded.create_table(config)
    table = tf_dlt.embedded.table("one_core")
    client = ops.ClientResource()
    ids = np.array([7, 1, 7, 40], np.int64)
    rows = ops.lookup(client, ids, "one_core", DIM).numpy()  # the op inserts the rows
    assert table.size() == 3
    np.testing.assert_array_equal(rows, table.pull(ids, mode=2))  # read back from Python
    ops.push(client, ids, tf.ones((4, DIM)), 0.5, "one_core", DIM, sync=True)
    np.testing.assert_allclose(table.pull(ids, mode=2), rows - 0.5 * np.array([[2], [1], [2], [1]]))
    table.import_rows(np.array([99], np.int64), np.full((1, DIM), 3.0, np.float32))
    np.testing.assert_array_equal(ops.lookup(client, np.array([99]), "one_core", DIM).numpy(), 3.0)
    tf_dlt.embedded.drop_table("one_core")
    with pytest.raises(tf.errors.NotFoundError, match="one_core"):
        ops.lookup(client, ids, "one_core", DIM)


def test_library_loads_once_and_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Path(ops.LIBRARY_PATH).exists()
    assert ops.load_library() is ops.load_library()
    monkeypatch.setattr(ops, "_library", None)
    monkeypatch.setattr(ops, "LIBRARY_PATH", "/nonexistent/_dlt_ops.so")
    with pytest.raises(ImportError, match=r"/nonexistent/_dlt_ops.so into TensorFlow 2\.21"):
        ops.load_library()


def test_lookup_checks_its_size_before_allocating_the_output() -> None:
    """2^20 ids of dim 4096 would be a 16 GiB output: refused from the
    shapes, before any memory is taken (the table does not even exist)."""
    client = ops.ClientResource()
    ids = tf.zeros([1 << 20], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="at most 2\\^31-1 values"):
        ops.lookup(client, ids, "absent", 4096)


def test_native_import_refuses_non_finite_rows_and_truncated_steps() -> None:
    table = _oracle()
    ids = np.array([5, 6])
    values = np.ones((2, DIM), np.float32)
    with pytest.raises(ValueError, match="non-finite"):
        table.import_rows(ids, np.where(np.eye(2, DIM) > 0, np.nan, values).astype(np.float32))
    for steps in (np.array([1, 1 << 32]), np.array([-1, 0]), np.array([0, 2**64 - 1], np.uint64)):
        with pytest.raises(ValueError, match="outside \\[0, 2\\^32-1\\]"):
            table.import_rows(ids, values, None, steps)
    with pytest.raises(ValueError, match="integer array"):
        table.import_rows(ids, values, None, np.array([1.5, 2.0]))
    assert table.size() == 0
    table.import_rows(ids, values, None, np.array([7, (1 << 32) - 1], np.int64))
    assert table.size() == 2
