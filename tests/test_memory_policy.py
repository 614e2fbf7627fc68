"""Memory-bounded tables over the wire: admission decided alike on any shard
count, ttl sweeps, shrink, eviction, 16-bit rows, the counters in stats and
metrics, and checkpoint round trips (shards and embedded, re-sharded) that
keep rows, slots, update counts, ages and the admission sketch."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

import tf_dlt
from tf_dlt import admission, errors, expiry
from tf_dlt.checkpoint import manifest
from tf_dlt.tools.cluster_stats import format_stats

from conftest import Cluster, wait_until

DIM = 4


def _stream(seed: int, batches: int = 12, batch: int = 400) -> list[np.ndarray]:
    """Zipf-like ids: a few frequent, a long tail seen once."""
    rng = np.random.default_rng(seed)
    return [(rng.zipf(1.3, batch) % 5000).astype(np.int64) for _ in range(batches)]


def _train(client: tf_dlt.Client, table: str, stream: list[np.ndarray]) -> None:
    for ids in stream:
        client.pull(table, ids)
        grads = np.cos(ids[:, None] * np.arange(1, DIM + 1)).astype(np.float32) * 0.1
        client.push(table, ids, grads, learning_rate=0.1)


def _rows(client: tf_dlt.Client, table: str, ids: np.ndarray) -> np.ndarray:
    return client.pull(table, ids, training=False, missing="zeros")


@pytest.mark.parametrize(
    "policy",
    [admission.Frequency(min_count=3, sketch_bytes=1 << 22), admission.Probability(0.3)],
    ids=["frequency", "probability"],
)
def test_admission_decides_alike_on_1_and_3_shards(
    start_cluster: Callable[..., Cluster], policy: admission.Admission
) -> None:
    """Same stream, 1 and 3 shard processes: the same ids get rows, with the
    same values; unadmitted ids read zeros and store nothing."""
    stream = _stream(1)
    everything = np.unique(np.concatenate(stream))
    results = []
    for shards in (1, 3):
        cluster = start_cluster(shards)
        with cluster.client() as client:
            client.create_table("adm", DIM, "uniform", "adagrad", seed=5, admission=policy)
            _train(client, "adm", stream)
            rows = _rows(client, "adm", everything)
            info = client.list_tables()["adm"]
            assert info["rows"] == int(np.any(rows != 0, axis=1).sum())
            assert info["admitted"] == info["rows"]
            results.append(rows)
    np.testing.assert_array_equal(results[0], results[1])
    present = np.any(results[0] != 0, axis=1)
    assert 0 < present.sum() < len(everything)  # some kept out, some admitted
    if isinstance(policy, admission.Frequency):
        counts = {i: sum(int(i in set(b.tolist())) for b in stream) for i in everything.tolist()}
        # Small stream, large sketch: exact counts, so exactly the ids pushed
        # min_count times or more have rows.
        expected = np.array([counts[i] >= 3 for i in everything.tolist()])
        np.testing.assert_array_equal(present, expected)


def test_an_id_refused_counts_once_per_push_however_often_it_repeats(
    start_cluster: Callable[..., Cluster],
) -> None:
    """`refused` counts ids per push (docs/observability.md): an id three
    times in one push was counted three times."""
    with start_cluster(1).client() as client:
        grads = np.ones((4, DIM), np.float32)
        client.create_table("freq", DIM, "uniform", "sgd", admission=admission.Frequency(5))
        client.push("freq", np.array([5, 5, 5, 7], np.int64), grads, learning_rate=0.1)
        assert client.list_tables()["freq"]["refused"] == 2
        client.push("freq", np.array([5, 7, 7, 7], np.int64), grads, learning_rate=0.1)
        assert client.list_tables()["freq"]["refused"] == 4
        client.create_table("prob", DIM, "uniform", "sgd", admission=admission.Probability(0.3))
        ids = np.repeat(np.arange(100, dtype=np.int64), 3)
        client.push("prob", ids, np.ones((300, DIM), np.float32), learning_rate=0.1)
        info = client.list_tables()["prob"]
        assert 0 < info["rows"] < 100 and info["refused"] == 100 - info["rows"]
        # Id 0 (hash 0) and the one id whose hash is 1 are two ids in a push.
        hash_one = np.array([5818379579481681392], np.uint64).view(np.int64)[0]
        both = np.array([hash_one, 0], np.int64)
        client.create_table("zero", DIM, "uniform", "sgd", seed=1,
                            admission=admission.Probability(0.5))  # fmt: skip
        client.push("zero", both[1:], grads[:1], learning_rate=0.1)
        alone = client.list_tables()["zero"]["rows"]
        client.drop_table("zero")
        client.create_table("zero", DIM, "uniform", "sgd", seed=1,
                            admission=admission.Probability(0.5))  # fmt: skip
        client.push("zero", both, grads[:2], learning_rate=0.1)
        present = _rows(client, "zero", both[1:])
        assert alone == 1 and np.any(present != 0), "id 0 admitted alone, refused beside it"


def test_shrink_ttl_eviction_and_their_counters(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2, "--sweep-interval", "0.1")
    with cluster.client() as client:
        ids = np.arange(1000, dtype=np.int64)
        grads = np.ones((1000, DIM), np.float32)
        client.create_table("shr", DIM, "uniform", "sgd")
        client.push("shr", ids, grads, learning_rate=0.1)
        client.push("shr", ids[:100], grads[:100], learning_rate=0.1)
        assert client.shrink("shr", min_count=2) == 900
        assert client.list_tables()["shr"]["rows"] == 100
        with pytest.raises(errors.InvalidArgumentError, match="min_count or unseen_for"):
            client.shrink("shr")
        with pytest.raises(errors.NotFoundError):
            client.shrink("nope", min_count=1)

        # ttl of 2 pushes: the sweep (every 0.1 s) removes rows 3 pushes old.
        client.create_table("ttl", DIM, "uniform", "sgd", ttl=expiry.Pushes(2))
        old, fresh = ids[:50], ids[50:60]
        client.push("ttl", old, grads[:50], learning_rate=0.1)
        for _ in range(3):
            client.push("ttl", fresh, grads[:10], learning_rate=0.1)
        deadline = time.monotonic() + 10
        while client.list_tables()["ttl"]["rows"] > 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        info = client.list_tables()["ttl"]
        assert info["rows"] == 10 and info["expired"] == 50
        assert np.all(_rows(client, "ttl", old) == 0)

        # max_rows per shard with LFU: the frequent ids survive a flood.
        client.create_table("cap", DIM, "uniform", "sgd", max_rows=4096)
        hot = np.arange(64, dtype=np.int64)
        for k in range(10):
            client.push("cap", hot, grads[:64], learning_rate=0.1)
            flood = np.arange(10_000 + k * 1000, 11_000 + k * 1000, dtype=np.int64)
            client.push("cap", flood, grads, learning_rate=0.1)
        info = client.list_tables()["cap"]
        assert info["rows"] <= 2 * 4096 and info["evicted"] == info["admitted"] - info["rows"]
        assert info["evicted"] > 0
        assert np.all(np.any(_rows(client, "cap", hot) != 0, axis=1))
        text = format_stats(client.stats(), cluster.addresses)
        assert "evicted" in text and "expired" in text
        assert "rows  RAM MiB" in text  # the rows' bytes in RAM, not on a disk tier


def test_sixteen_bit_rows_take_less_memory_and_train(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1)
    ids = np.arange(20_000, dtype=np.int64)
    grads = np.full((len(ids), 16), 0.01, np.float32)
    with cluster.client() as client:
        sizes = {}
        for dtype in ("float32", "bfloat16", "float16"):
            name = f"r_{dtype}"
            client.create_table(name, 16, "uniform", "adagrad", value_dtype=dtype, slot_dtype=dtype)
            before = client.pull(name, ids)
            client.push(name, ids, grads, learning_rate=0.1)
            after = _rows(client, name, ids)
            assert np.all(after < before)  # every row moved against its gradient
            sizes[dtype] = client.list_tables()[name]["bytes"] / len(ids)
    assert sizes["bfloat16"] <= 0.6 * sizes["float32"]
    assert sizes["float16"] <= 0.6 * sizes["float32"]


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_checkpoint_keeps_every_option_across_shard_counts(
    start_cluster: Callable[..., Cluster], tmp_path: Path, value_dtype: str
) -> None:
    """2 shards save, 3 shards load: rows, slots and counts equal; ages kept
    (a shrink by age removes the same rows); the sketch kept (an id pushed
    twice before the save is admitted by its third push after the load)."""
    policy = dict(
        admission=admission.Frequency(min_count=3, sketch_bytes=1 << 22),
        ttl=expiry.Pushes(1000),
        max_rows=100_000,
        value_dtype=value_dtype,
        slot_dtype=value_dtype,
    )
    grads = np.ones((300, DIM), np.float32) * 0.1
    ids = np.arange(300, dtype=np.int64)
    pending = np.arange(1000, 1010, dtype=np.int64)  # pushed twice: not admitted yet
    two = start_cluster(2)
    with two.client() as client:
        client.create_table("ck", DIM, "uniform", "adam", seed=3, **policy)
        for _ in range(3):
            client.push("ck", ids, grads, learning_rate=0.1)
        for _ in range(2):
            client.push("ck", pending, grads[:10], learning_rate=0.1)
        # Rows 0..99 pushed again later: they are younger.
        for _ in range(5):
            client.push("ck", ids[:100], grads[:100], learning_rate=0.1)
        saved = _rows(client, "ck", ids)
        assert np.all(_rows(client, "ck", pending) == 0)
        client.save(str(tmp_path / "ck"))
    three = start_cluster(3)
    with three.client() as client:
        client.load(str(tmp_path / "ck"))
        info = client.list_tables()["ck"]
        assert info["config"].memory.admission == policy["admission"]
        assert info["config"].memory.value_dtype == value_dtype
        np.testing.assert_array_equal(_rows(client, "ck", ids), saved)
        client.push("ck", pending, grads[:10], learning_rate=0.1)  # third push: admitted
        assert np.all(np.any(_rows(client, "ck", pending) != 0, axis=1))
        # Rows 100..299 are at least 5 pushes old on their shard at save
        # time; rows 0..99 were touched last. A shrink by age takes the old.
        removed = client.shrink("ck", unseen_for=4)
        assert removed == 200
        assert np.all(np.any(_rows(client, "ck", ids[:100]) != 0, axis=1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_tables_are_checkpointed_as_sixteen_bits(
    start_cluster: Callable[..., Cluster], tmp_path: Path, dtype: str
) -> None:
    """Values and slots of a 16-bit table go to the file as 16 bits (a full
    checkpoint and a delta), load exactly onto another shard count, are
    listed by `tf-dlt checkpoint ls`, and take <= 0.6x the bytes of the same
    table at float32."""
    ids = np.random.default_rng(1).integers(-(2**62), 2**62, 150_000, dtype=np.int64)
    rng = np.random.default_rng(2)
    grads = rng.normal(size=(len(ids), 16)).astype(np.float32)
    with start_cluster(2).client() as client:
        for name, wide in (("half", dtype), ("wide", "float32")):
            client.create_table(
                name, 16, "uniform", "adam", seed=3, value_dtype=wide, slot_dtype=wide
            )
            client.push(name, ids, grads, learning_rate=0.1)
            client.save(str(tmp_path / name), tables=[name])
        client.push("half", ids[:500], grads[:500], learning_rate=0.1)
        client.save(str(tmp_path / "half-d1"), base=str(tmp_path / "half"), tables=["half"])
        saved = _rows(client, "half", ids)
    half, wide = (manifest.read_manifest(str(tmp_path / n)) for n in ("half", "wide"))
    assert half["format_version"] == 2 and wide["format_version"] == 1
    assert sum(f["bytes"] for f in half["files"]) <= 0.6 * sum(f["bytes"] for f in wide["files"])
    stored = np.float16 if dtype == "float16" else np.uint16
    for directory in ("half", "half-d1"):
        for entry in manifest.read_manifest(str(tmp_path / directory))["files"]:
            with h5py.File(tmp_path / directory / entry["file"]) as f:
                (group,) = f["tables"].values()
                for name in ("values", "slots"):
                    assert group[name].dtype == stored and group[name].attrs["dtype"] == dtype
    with start_cluster(3).client() as client:
        client.load(str(tmp_path / "half-d1"))
        assert client.list_tables()["half"]["config"].memory.value_dtype == dtype
        np.testing.assert_array_equal(_rows(client, "half", ids), saved)
    out = subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "checkpoint", "ls", str(tmp_path / "half-d1")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 3, out.stdout + out.stderr


def test_keras_layer_with_a_policy_trains_saves_and_restores(tmp_path: Path) -> None:
    """An embedded table with Frequency admission, a ttl and bfloat16 rows in
    a Functional model: fit, tf_dlt.save, a fresh model, tf_dlt.load: the same
    rows and the same sketch (admission continues where it was)."""
    import keras

    def build() -> keras.Model:
        ids = keras.Input((3,), dtype="int64")
        emb = tf_dlt.layers.Embedding(
            output_dim=DIM,
            is_distributed=True,
            optimizer="adagrad",
            admission=admission.Frequency(min_count=2, sketch_bytes=1 << 20),
            ttl=expiry.Seconds(86400),
            value_dtype="bfloat16",
            table_name="pol_emb",
            sync_push=True,
            name="pol_emb",
        )
        out = keras.layers.Dense(1)(keras.layers.Flatten()(emb(ids)))
        model = keras.Model(ids, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    model = build()
    layer = model.get_layer("pol_emb")
    config = layer.get_config()
    assert config["memory"]["admission"] == {
        "kind": "frequency", "min_count": 2, "sketch_bytes": 1 << 20
    }  # fmt: skip
    assert tf_dlt.layers.Embedding.from_config(config).table_config == layer.table_config
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (64, 3)).astype(np.int64)
    model.fit(x, rng.normal(size=(64, 1)), batch_size=16, epochs=1, verbose=0)
    once = np.array([[900, 901, 902]], np.int64)  # one push each: pending
    model.fit(once, np.zeros((1, 1)), batch_size=1, epochs=1, verbose=0)
    probe = np.concatenate([np.arange(50), [900, 901, 902]]).astype(np.int64)
    before = model.predict(probe.reshape(-1, 1).repeat(3, axis=1), verbose=0)
    tf_dlt.save(model, str(tmp_path / "m"))

    restored = build()
    tf_dlt.load(restored, str(tmp_path / "m"))
    after = restored.predict(probe.reshape(-1, 1).repeat(3, axis=1), verbose=0)
    np.testing.assert_allclose(after, before, rtol=1e-6)
    ids900, *_ = tf_dlt.embedded.rows("pol_emb")
    assert not set(ids900.tolist()) & {900, 901, 902}
    restored.fit(once, np.zeros((1, 1)), batch_size=1, epochs=1, verbose=0)  # second push
    ids_after, *_ = tf_dlt.embedded.rows("pol_emb")
    assert {900, 901, 902} <= set(ids_after.tolist())


def test_memory_policy_is_one_object_for_configs_clients_and_layers(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A tf_dlt.MemoryPolicy given as memory= makes the same table as its
    fields given as keywords, in TableConfig.create, Client.create_table and
    the layer (whose config round-trips it); the two forms together are
    refused, and each field's names are the native core's."""
    from tf_dlt import _native, memory_policy

    fields = dict(
        admission=admission.Frequency(min_count=3), unadmitted="initial",
        ttl=expiry.Pushes(50), max_rows=8192, eviction="lru", value_dtype="float16",
        slot_dtype="bfloat16", rounding="nearest",
    )  # fmt: skip
    policy = tf_dlt.MemoryPolicy.create(**fields)
    assert tf_dlt.MemoryPolicy.get(policy.get_config()) == policy
    assert tf_dlt.MemoryPolicy.from_dict(policy.to_dict()) == policy
    flat = tf_dlt.TableConfig.create("mp", DIM, "zeros", "adagrad", **fields)  # type: ignore[arg-type]
    nested = tf_dlt.TableConfig.create("mp", DIM, "zeros", "adagrad", memory=policy)
    assert flat == nested and nested.memory == policy
    assert tf_dlt.TableConfig.from_dict(nested.to_dict()).same_table(nested)
    with pytest.raises(ValueError, match="not both"):
        tf_dlt.TableConfig.create("mp", DIM, memory=policy, max_rows=4096)
    with pytest.raises(ValueError, match="unknown memory policy arguments"):
        tf_dlt.TableConfig.create("mp", DIM, max_row=4096)

    layer = tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, optimizer="adagrad", embeddings_initializer="zeros",
        memory=policy, name="mp",
    )  # fmt: skip
    assert layer.table_config == nested
    again = tf_dlt.layers.Embedding.from_config(layer.get_config())
    assert again.memory == policy and again.table_config.same_table(nested)
    shorthand = tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, optimizer="adagrad", embeddings_initializer="zeros",
        name="mp", **fields,
    )  # fmt: skip
    assert shorthand.table_config == nested
    with pytest.raises(ValueError, match="not both"):
        tf_dlt.layers.Embedding(
            output_dim=DIM, is_distributed=True, memory=policy, rounding="nearest"
        )

    cluster = start_cluster(1)
    with cluster.client() as client:
        client.create_table("mp", DIM, "zeros", "adagrad", memory=policy)
        assert client.list_tables()["mp"]["config"].memory == policy
        client.create_table("mp", DIM, "zeros", "adagrad", **fields)  # the same table: no-op

    for field in ("unadmitted", "eviction", "value_dtype", "slot_dtype", "rounding"):
        assert memory_policy.choices(field) == tuple(_native.POLICY_CHOICES[field])


def test_capacity_reads_the_record_layout_from_the_core() -> None:
    from tf_dlt import _native
    from tf_dlt.tools import capacity

    for optimizer in _native.OPTIMIZER_SLOTS:
        for value_dtype in _native.DTYPE_BYTES:
            for slot_dtype in _native.DTYPE_BYTES:
                config = tf_dlt.TableConfig.create(
                    "plan", 12, optimizer=optimizer, value_dtype=value_dtype, slot_dtype=slot_dtype
                )
                table = _native.Table(config.to_dict())
                got = capacity.raw_record_bytes(12, optimizer, value_dtype, slot_dtype)
                assert got == table.record_bytes, (optimizer, value_dtype, slot_dtype)


def test_policy_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="applies to distributed tables"):
        tf_dlt.layers.Embedding(10, DIM, admission=admission.Probability(0.5))
    with pytest.raises(ValueError, match=r"min_count must be an int in \[1, 255\]"):
        admission.Frequency(min_count=0)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\]"):
        admission.Probability(1.5)
    with pytest.raises(ValueError, match="ttl must be an int"):
        expiry.Pushes(0)
    with pytest.raises(ValueError, match="value_dtype must be one of"):
        tf_dlt.TableConfig.create("t", 4, value_dtype="int8")
    with pytest.raises(ValueError, match="eviction must be one of"):
        tf_dlt.layers.Embedding(output_dim=DIM, is_distributed=True, eviction="fifo")
    for rows in (100, 2**41):
        with pytest.raises(ValueError, match=r"max_rows must be 0 \(unbounded\) or in \[4096"):
            tf_dlt.TableConfig.create("t", 4, max_rows=rows)
    with pytest.raises(ValueError, match="admission must be"):
        admission.get({"kind": "frequency", "min_cnt": 2})
    # A request's config naming a clock there is none of (another client's)
    # was taken as pushes.
    raw = tf_dlt.TableConfig.create("t", 4).to_proto()
    raw.policy.clock, raw.policy.ttl = "minutes", 5
    with pytest.raises(errors.InvalidArgumentError, match="ttl clock must be 'pushes' or"):
        tf_dlt.TableConfig.from_proto(raw)
    # Distributed layers turn XLA off (their ops have no XLA kernels), with a
    # memory policy or without; local ones leave it to Keras.
    assert not tf_dlt.layers.Embedding(output_dim=DIM, is_distributed=True).supports_jit
    with_policy = tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, admission=admission.Probability(0.5)
    )
    assert not with_policy.supports_jit
    assert tf_dlt.layers.Embedding(10, DIM).supports_jit


def test_sketch_slices_outside_the_table_are_refused() -> None:
    from tf_dlt import _native

    config = tf_dlt.TableConfig.create("s", 4, admission=admission.Frequency(2, 1 << 20))
    table = _native.Table(config.to_dict(), 100, 200)
    counters, added = table.read_sketch(100, 200)
    assert counters.shape == (100, table.sketch_slice_bytes)
    with pytest.raises(ValueError, match="not the table's sketch's"):
        table.write_sketch(0, counters, added)
    with pytest.raises(ValueError, match="not the table's sketch's"):
        table.read_sketch(150, 250)


def test_stamps_newer_than_the_saved_clock_load_as_fresh(tmp_path: Path) -> None:
    """Rows pushed while a save copies them carry stamps up to the clock read
    after the copy; a file whose stamps are newer than its clock (older
    builds read it first) loads them as age 0, never as 2^32 pushes old."""
    from tf_dlt import _native
    from tf_dlt.checkpoint import manifest, shard_files

    config = tf_dlt.TableConfig.create("st", 2, "zeros", "sgd", ttl=expiry.Pushes(100))
    ids = np.arange(4, dtype=np.int64)
    buckets = tf_dlt.routing.bucket_of(ids)
    order = np.lexsort((ids, buckets))
    chunk = (ids[order], np.ones((4, 2), np.float32), np.zeros((4, 0), np.float32),
             np.ones(4, np.uint32), buckets[order].astype(np.uint32),
             np.array([5, 10, 15, 20], np.uint32))  # fmt: skip
    rows = shard_files.TableRows(
        config.to_dict(), 2, 0, iter([chunk]), lambda: shard_files.TableState(clock=12)
    )
    save_id = manifest.new_save_id()
    path = str(tmp_path / "ck")
    part = shard_files.save_tables(path, shard_files.ShardLayout(), [rows], save_id)
    manifest.write_manifest(path, [part], save_id)
    shard = _native.Shard(0, 1)
    shard_files.load_shard(path, shard)
    table = shard.get_table("st")
    stamps = dict(zip(*table.exporter().next(10)[::5], strict=True))
    # Ages against the new clock 0: 7 and 2 (saved 12 - 5, 12 - 10); 0 for 15, 20.
    age = {int(i): (-int(stamps[i])) % 2**32 for i in stamps}
    assert sorted(age.values()) == [0, 0, 2, 7]
    assert table.shrink(unseen_for=5) == 1  # only the row 7 pushes old


def test_shrink_takes_every_matching_row_of_a_large_table() -> None:
    """A removal shifts later entries of its probe run back into the part of
    the index a pass examined already: a shrink of 1M rows passed 25 of the
    900,000 matching ones over. It takes every one, in one call."""
    from tf_dlt import _native
    from tf_dlt.table_config import TableConfig

    table = _native.Table(TableConfig.create("big", 4, "uniform", "sgd").to_dict())
    ids = np.arange(1_000_000, dtype=np.int64)
    table.push(ids, np.ones((len(ids), 4), np.float32), 0.1)
    table.push(ids[::10], np.ones((len(ids) // 10, 4), np.float32), 0.1)
    assert table.shrink(min_count=2) == 900_000
    assert table.size() == 100_000
    assert table.shrink(min_count=2) == 0


def test_transpiled_filtered_table_exports_what_predict_serves(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A model with Frequency admission and bfloat16 rows, transpiled onto 2
    shards: the shard tables carry the policy; ids kept out by admission
    predict zeros live and in the standalone export, which holds only the
    admitted rows."""
    import os
    import subprocess
    import sys

    import keras

    cluster = start_cluster(2)
    ids = keras.Input((2,), dtype="int64")
    emb = tf_dlt.layers.Embedding(
        output_dim=DIM, is_distributed=True, optimizer="adagrad", learning_rate=0.1,
        admission=admission.Frequency(min_count=2), value_dtype="bfloat16", name="filt",
    )  # fmt: skip
    model = keras.Model(ids, keras.layers.Flatten()(emb(ids)))
    model.compile(optimizer="sgd", loss="mse")
    model = tf_dlt.transpile(model, cluster.addresses)
    with cluster.client() as client:
        config = client.list_tables()["filt"]["config"]
    assert config.memory.admission == admission.Frequency(min_count=2)
    assert config.memory.value_dtype == "bfloat16"
    rng = np.random.default_rng(0)
    frequent = np.tile(np.arange(20).reshape(10, 2), (4, 1))  # each id in 4 batches
    rare = 1000 + np.arange(16).reshape(8, 2)  # each id once
    x = np.concatenate([frequent, rare])
    model.fit(x, rng.normal(size=(len(x), 2 * DIM)), batch_size=8, shuffle=False, verbose=0)
    probe = np.array([[0, 1000], [19, 10**12]])
    live = model.predict(probe, verbose=0)
    assert np.all(live[:, DIM:] == 0) and np.all(live[:, :DIM] != 0)
    tf_dlt.export_saved_model(model, str(tmp_path / "standalone"), mode="standalone")
    np.save(tmp_path / "x.npy", probe)
    code = (
        "import sys, numpy as np, tensorflow as tf\n"
        "m = tf.saved_model.load(sys.argv[1])\n"
        "np.save(sys.argv[3], m.serve(tf.constant(np.load(sys.argv[2]))).numpy())\n"
    )
    out = tmp_path / "standalone.npy"
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "standalone"), str(tmp_path / "x.npy"),
         str(out)],
        check=True, timeout=300, cwd="/", env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    np.testing.assert_allclose(np.load(out), live, atol=1e-6)
    with cluster.client() as client:
        assert client.list_tables()["filt"]["rows"] == 20


def test_sixteen_bit_storage_equals_the_reference_conversions() -> None:
    """Nearest rounding stores exactly what numpy (float16) and TensorFlow
    (bfloat16) round to; stochastic rounding is unbiased where nearest
    loses small updates."""
    import tensorflow as tf

    from tf_dlt import _native

    rng = np.random.default_rng(7)
    values = (rng.standard_normal((4096, 8)) * np.exp(rng.uniform(-12, 8, (4096, 8)))).astype(
        np.float32
    )
    values[:, 0] = rng.uniform(-70000, 70000, 4096)  # beyond float16's range: saturates
    ids = np.arange(4096, dtype=np.int64)
    for dtype, reference in (
        ("float16", np.clip(values, -65504, 65504).astype(np.float16).astype(np.float32)),
        ("bfloat16", tf.cast(tf.cast(values, tf.bfloat16), tf.float32).numpy()),
    ):
        config = tf_dlt.TableConfig.create("r", 8, "zeros", "sgd", value_dtype=dtype,
                                           rounding="nearest")  # fmt: skip
        table = _native.Table(config.to_dict())
        table.import_rows(ids, values)
        np.testing.assert_array_equal(table.pull(ids, 2), reference, err_msg=dtype)

    # 1000 SGD steps of 1e-4 on rows at 1.0: a bfloat16 step near 1 is 2^-7,
    # so nearest never moves; stochastic lands on average where float32 does.
    def train(rounding: str) -> np.ndarray:
        config = tf_dlt.TableConfig.create("s", 8, "zeros", "sgd", value_dtype="bfloat16",
                                           rounding=rounding)  # fmt: skip
        table = _native.Table(config.to_dict())
        table.import_rows(ids, np.ones((4096, 8), np.float32))
        grads = np.full((4096, 8), 1e-4, np.float32)
        for _ in range(1000):
            table.push(ids, grads, 1.0)
        return table.pull(ids, 2)

    assert np.all(train("nearest") == 1.0)
    stochastic = train("stochastic")
    assert abs(float(stochastic.mean()) - 0.9) < 0.002  # float32: 1 - 1000 x 1e-4
    # Reproducible: the random bits are a function of (seed, id, update).
    np.testing.assert_array_equal(train("stochastic"), stochastic)


@pytest.mark.parametrize("tiered", [False, True])
def test_loading_onto_fewer_shards_never_evicts_silently(
    start_cluster: Callable[..., Cluster], tmp_path: Path, tiered: bool
) -> None:
    """24,000 rows saved by 4 shards of max_rows 8,000 do not fit 2 such
    shards: the load is refused naming the table and the rows it would drop,
    and nothing changes; onto 4 shards it loads whole. The same onto shards
    with a disk tier, whose tables keep max_rows in the memory keeper (the
    load was taken whole, and the keeper dropped the rows past it)."""

    def tier(name: str) -> list[str]:
        return (
            ["--memory-budget", "300MiB", "--storage-dir", str(tmp_path / name)] if tiered else []
        )

    ids = np.arange(24_000, dtype=np.int64)
    with start_cluster(4).client() as c:
        c.create_table("t", DIM, "normal", "adagrad", seed=3, max_rows=8000)
        c.push("t", ids, np.ones((len(ids), DIM), np.float32), 0.1)
        assert c.list_tables()["t"]["rows"] == len(ids)
        trained = c.pull("t", ids)
        c.save(str(tmp_path / "ck"))
    with start_cluster(2, *tier("ssd2")).client() as c:
        c.create_table("t", DIM, "normal", "adagrad", seed=3, max_rows=8000)
        c.push("t", ids[:100], np.ones((100, DIM), np.float32), 0.1)
        before = c.pull("t", ids[:100])
        with pytest.raises(
            errors.FailedPreconditionError,
            match=r"table 't': (the checkpoint holds 1\d{4} rows for shard \d of 2, past its "
            r"max_rows of 8000 per shard; loading would drop at least \d+ of them|loading it "
            r"onto shard \d of 2 evicted \d+ rows: its rows there go past its max_rows of 8000 "
            r"per shard)",
        ):
            c.load(str(tmp_path / "ck"))
        assert c.list_tables()["t"]["rows"] == 100
        np.testing.assert_array_equal(c.pull("t", ids[:100]), before)
    with start_cluster(4, *tier("ssd4")).client() as c:
        c.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(c.pull("t", ids), trained)


def test_a_chain_whose_head_fits_max_rows_loads_onto_fewer_shards(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A base of 12,000 rows saved by 2 shards (6,000 each) does not fit 1
    shard of max_rows 8,192; a delta that removed 8,000 of them since does
    (4,000 rows). Its chain was refused all the same ("evicted 4064 rows":
    each link was trimmed to max_rows as it came in), and so was its
    compaction onto 1 shard and a follower of it on 1 shard (which served
    nothing). It loads, every row as the 2 shards held it, compacts and is
    followed; the base alone is still refused."""
    ids = np.arange(12_000, dtype=np.int64) * 7919
    run = tmp_path / "run"
    with start_cluster(2).client() as c:
        c.create_table("t", DIM, "normal", "adagrad", seed=3, max_rows=8192)
        c.push("t", ids, np.ones((len(ids), DIM), np.float32), 0.1)
        c.save(str(run / "base"))
        c.push("t", ids[:4000], np.ones((4000, DIM), np.float32), 0.1)  # pushed twice
        c.shrink("t", min_count=2)
        assert c.list_tables()["t"]["rows"] == 4000
        trained = c.pull("t", ids[:4000])
        head = c.save(str(run / "head"), base=str(run / "base"))["save_id"]
    compacted = tmp_path / "compacted"
    out = subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "checkpoint", "compact",
         str(run / "head"), str(compacted), "--num-shards", "1"],
        capture_output=True, text=True, timeout=300, cwd="/",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for path in (run / "head", compacted):
        with start_cluster(1).client() as c:
            c.load(str(path))
            assert c.list_tables()["t"]["rows"] == 4000
            np.testing.assert_array_equal(c.pull("t", ids[:4000]), trained)
    with start_cluster(1, "--read-only", "--follow", str(run)).client() as f:
        wait_until(lambda: f.stats()[0].get("serving_save_id") == head, "the follower at head")
        np.testing.assert_array_equal(f.pull("t", ids[:4000], training=False), trained)
    with start_cluster(1).client() as c:
        with pytest.raises(errors.FailedPreconditionError, match="past its max_rows of 8192"):
            c.load(str(run / "base"))
        assert "t" not in c.list_tables()


def test_a_checkpoint_past_max_rows_loads_whole_onto_as_many_shards(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A tiered table passes max_rows between the memory keeper's evictions
    (it keeps max_rows across its tiers every few passes), and a save then
    holds more rows than max_rows: the same shard count refused to load it
    ("would drop at least 624"), and a shard without a tier evicted a
    sixth of them as they came in. Onto as many shards, every row loads."""
    from tf_dlt import _native
    from tf_dlt.checkpoint import manifest, shard_files
    from tf_dlt.table_config import TableConfig

    source = _native.Shard(0, 1)
    config = TableConfig.create("t", DIM, "normal", "adagrad", seed=3, max_rows=8000)
    source.create_table(config.to_dict())
    table = source.get_table("t")
    ids = np.arange(8400, dtype=np.int64) * 7
    values = np.random.default_rng(1).normal(size=(len(ids), DIM)).astype(np.float32)
    table.import_rows(ids, values, evict=False)  # as a tiered table holds them between evictions
    assert table.size() == len(ids)
    save_id = manifest.new_save_id()
    part = shard_files.save_shard(str(tmp_path / "ck"), source, save_id)
    manifest.write_manifest(str(tmp_path / "ck"), [part], save_id)
    for args in ((), ("--memory-budget", "300MiB", "--storage-dir", str(tmp_path / "ssd"))):
        with start_cluster(1, *args).client() as c:
            c.load(str(tmp_path / "ck"))
            if not args:  # (a tiered table's keeper may trim the excess soon after)
                np.testing.assert_array_equal(c.pull("t", ids, training=False), values)
    # A standby takes the rows as its primary holds them: it trimmed them to
    # max_rows, and after a takeover 639 ids read their initial values.
    from tf_dlt.server.local import LocalCluster

    with LocalCluster(1, replicas=2, workdir=tmp_path / "replicated") as cluster:
        c = tf_dlt.Client(cluster.addresses)
        c.load(str(tmp_path / "ck"))
        deadline = time.monotonic() + 60
        while not (c.stats()[0]["standbys"] or [{}])[0].get("caught_up"):
            assert time.monotonic() < deadline, c.stats()[0]["standbys"]
            time.sleep(0.1)
        cluster.kill(0)
        np.testing.assert_array_equal(c.pull("t", ids, training=False), values)


def test_a_sixteen_bit_table_saved_as_float32_by_earlier_versions_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tf_dlt import _native
    from tf_dlt.checkpoint import shard_files, shard_save
    from tf_dlt.table_config import TableConfig

    config = TableConfig.create("old", 8, "uniform", "adagrad", value_dtype="bfloat16",
                                slot_dtype="bfloat16").to_dict()  # fmt: skip
    table = _native.Table(config)
    ids = np.arange(5000, dtype=np.int64)
    table.pull(ids)
    shard = _native.Shard(0, 1)
    shard.install_tables([table])
    with monkeypatch.context() as m:  # how files were written before 16-bit storage
        m.setattr(shard_save, "table_dtypes", lambda config: ("float32", "float32"))
        part = shard_files.save_shard(str(tmp_path / "ck"), shard, "old1")
    manifest.write_manifest(str(tmp_path / "ck"), [part], "old1")
    with h5py.File(tmp_path / "ck" / part["file"]) as f:
        assert f["tables/t00000/values"].dtype == np.float32
    fresh = _native.Shard(0, 1)
    shard_files.load_shard(str(tmp_path / "ck"), fresh)
    np.testing.assert_array_equal(fresh.get_table("old").pull(ids), table.pull(ids))


def test_a_dtype_object_is_taken_by_its_name() -> None:
    """`MemoryPolicy.create(value_dtype=tf.bfloat16)`: tf.DType equals its
    name, so the check passed and the policy held "<dtype: 'bfloat16'>",
    refused later by the table as an unknown dtype."""
    import tensorflow as tf

    policy = tf_dlt.MemoryPolicy.create(value_dtype=tf.bfloat16, slot_dtype=np.dtype("float16"))
    assert (policy.value_dtype, policy.slot_dtype) == ("bfloat16", "float16")
    assert tf_dlt.MemoryPolicy.create(value_dtype=tf.float32) == tf_dlt.MemoryPolicy()
    with pytest.raises(errors.InvalidArgumentError, match="value_dtype must be one of"):
        tf_dlt.MemoryPolicy.create(value_dtype=tf.int8)


def test_a_table_whose_sketch_leaves_its_rows_no_room_is_refused(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A shard with a 265 MiB budget and no disk tier, a table with
    Frequency admission and its default 64 MiB sketch: it was made, and the
    keeper evicted every row it got (rows 0, evicted 5,000; only the
    eviction counter said so). Refused now, naming the sketch and the
    budget; a sketch that fits is taken and keeps its rows."""
    shard = start_cluster(1, "--memory-budget", "265MiB")
    with shard.client() as c:
        with pytest.raises(errors.ResourceExhaustedError, match="admission sketch takes 64 MiB"):
            c.create_table("t", 8, "normal", "adagrad", admission=admission.Frequency(min_count=1))
        assert "t" not in c.list_tables()
        c.create_table(
            "t", 8, "normal", "adagrad",
            admission=admission.Frequency(min_count=1, sketch_bytes=1 << 20),
        )  # fmt: skip
        ids = np.arange(5000, dtype=np.int64)
        c.push("t", ids, np.ones((len(ids), 8), np.float32), 0.1)
        time.sleep(1.0)  # the keeper's passes
        assert c.list_tables()["t"]["rows"] == len(ids)
