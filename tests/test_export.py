"""SavedModel export in both modes, each loaded in a fresh process and
checked against the live model's predictions."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dlt
import tf_dlt.checkpoint.manifest
from tf_dlt import errors
from tf_dlt.layers import Embedding
from tf_dlt.server.local import LocalCluster

from conftest import Cluster

LOAD_AND_SERVE = """
import sys
{guard}
import numpy as np, tensorflow as tf
{imports}
m = tf.saved_model.load(sys.argv[1])
x = np.load(sys.argv[2])
np.save(sys.argv[3], m.serve(tf.constant(x)).numpy())
assert {tf_dlt_loaded} ('tf_dlt' in sys.modules and sys.modules['tf_dlt'] is not None)
"""


def _serve_elsewhere(
    tmp: Path, path: Path, x: np.ndarray, *, with_tf_dlt: bool, env: dict[str, str] | None = None
) -> np.ndarray:
    script = LOAD_AND_SERVE.format(
        guard="" if with_tf_dlt else "sys.modules['tf_dlt'] = None  # plain TensorFlow only",
        imports="import tf_dlt" if with_tf_dlt else "",
        tf_dlt_loaded="" if with_tf_dlt else "not",
    )
    np.save(tmp / "x.npy", x)
    out = subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp / "x.npy"), str(tmp / "y.npy")],
        capture_output=True, text=True, cwd="/", timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return np.load(tmp / "y.npy")


def _model(name: str) -> keras.Model:
    inp = keras.Input((3,), dtype="int64", name="ids")
    emb = Embedding(
        output_dim=4, is_distributed=True, optimizer="adagrad", learning_rate=0.1, name=name
    )
    out = keras.layers.Dense(1, name="head")(keras.layers.Flatten()(emb(inp)))
    model = keras.Model(inp, out)
    model.compile(optimizer="adam", loss="mse")
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(4)
    return rng.integers(0, 200, size=(64, 3)).astype("int64"), rng.normal(size=(64, 1)).astype(
        "float32"
    )


@pytest.mark.parametrize("num_shards", [1, 2])
def test_remote_export_serves_from_the_shards_and_can_be_repointed(
    start_cluster: Callable[..., Cluster], tmp_path: Path, num_shards: int
) -> None:
    cluster = start_cluster(num_shards)
    model = tf_dlt.transpile(_model(f"exp_remote{num_shards}"), cluster.addresses)
    x, y = _data()
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)  # asynchronous pushes
    tf_dlt.export_saved_model(model, str(tmp_path / "remote"))  # flushes them first
    live = model.predict(x, verbose=0)
    graph = (tmp_path / "remote" / "saved_model.pb").read_bytes()
    assert b"Dlt>Lookup" in graph and b"Dlt>Push" not in graph
    np.testing.assert_allclose(
        _serve_elsewhere(tmp_path, tmp_path / "remote", x, with_tf_dlt=True), live, atol=1e-6
    )
    # The same rows on another cluster, reached through TF_DLT_PSERVERS.
    with cluster.client() as client:
        client.save(str(tmp_path / "ckpt"))
    with LocalCluster(
        3, "--load-from", str(tmp_path / "ckpt"), workdir=tmp_path / "other"
    ) as other:
        cluster.stop()
        moved = _serve_elsewhere(
            tmp_path, tmp_path / "remote", x, with_tf_dlt=True,
            env={"TF_DLT_PSERVERS": ",".join(other.addresses)},
        )  # fmt: skip
    np.testing.assert_allclose(moved, live, atol=1e-6)


def test_remote_export_of_embedded_tables_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="embedded tables"):
        tf_dlt.export_saved_model(_model("exp_embedded"), str(tmp_path / "m"))


def test_standalone_export_loads_with_plain_tensorflow(tmp_path: Path) -> None:
    model = _model("exp_standalone")
    x, y = _data()
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    tf_dlt.export_saved_model(model, str(tmp_path / "standalone"), mode="standalone")
    graph = (tmp_path / "standalone" / "saved_model.pb").read_bytes()
    assert b"Dlt>" not in graph
    served = _serve_elsewhere(tmp_path, tmp_path / "standalone", x, with_tf_dlt=False)
    np.testing.assert_allclose(served, model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.parametrize("where", ["embedded", "2shards"])
def test_an_adapted_lookup_keeps_its_vocabulary_through_transpile_and_export(
    start_cluster: Callable[..., Cluster], tmp_path: Path, where: str
) -> None:
    """A layer whose state is not in its weights (an adapted IntegerLookup's
    vocabulary) was made again from its config by transpile and by the
    standalone export: the transpiled model failed its first call, the
    export served `Table not initialized`."""
    raw = keras.Input((3,), dtype="int64")
    lookup = keras.layers.IntegerLookup(name="exp_lookup")
    lookup.adapt(np.array([[100, 200, 300], [400, 500, 600]]))
    emb = Embedding(output_dim=4, is_distributed=True, name=f"exp_lookup_{where}")
    out = keras.layers.Dense(1)(keras.layers.Flatten()(emb(lookup(raw))))
    model = keras.Model(raw, out)
    if where == "2shards":
        model = tf_dlt.transpile(model, start_cluster(2).addresses)
    model.compile(optimizer="sgd", loss="mse")
    x = np.array([[100, 200, 300], [400, 500, 600], [700, 100, 200]] * 4)
    model.fit(x, np.ones((12, 1)), verbose=0)
    expected = model.predict(x, verbose=0)
    tf_dlt.export_saved_model(model, str(tmp_path / "s"), mode="standalone")
    loaded = tf.saved_model.load(str(tmp_path / "s"))
    np.testing.assert_allclose(loaded.serve(tf.constant(x)).numpy(), expected, atol=1e-5)


def test_a_standalone_export_refuses_float_ids_it_cannot_tell_apart(tmp_path: Path) -> None:
    """The live layer refuses float ids past what the float holds exactly
    (2^24 in float32); the standalone export cast them and served a
    neighbouring id's row."""
    ids = keras.Input((1,))  # float32, Keras's default
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    layer = Embedding(4, 2, is_distributed=True, weights=rows, table_name="exp_float_ids")
    model = keras.Model(ids, keras.layers.Flatten()(layer(ids)))
    tf_dlt.export_saved_model(model, str(tmp_path / "s"), mode="standalone")
    loaded = tf.saved_model.load(str(tmp_path / "s"))
    np.testing.assert_array_equal(loaded.serve(tf.constant([[1.0], [3.0]])).numpy(), rows[[1, 3]])
    for bad in (2.0**24 + 2, 1.5):
        with pytest.raises(tf.errors.InvalidArgumentError, match="cannot tell ids apart"):
            loaded.serve(tf.constant([[bad]]))


@pytest.mark.parametrize("mode", ["standalone", "remote"])
def test_an_export_of_a_model_of_a_dict_of_features_serves_them_by_name(
    start_cluster: Callable[..., Cluster], tmp_path: Path, mode: str
) -> None:
    """A model taking a dict of features was called with a list of them:
    the export failed (`The structure of inputs doesn't match`)."""
    user = keras.Input((2,), dtype="int64", name="user")
    item = keras.Input((1,), dtype="int64", name="item")
    towers = [
        keras.layers.Flatten()(Embedding(output_dim=4, is_distributed=True, name=n)(i))
        for n, i in ((f"exp_duser_{mode}", user), (f"exp_ditem_{mode}", item))
    ]
    out = keras.layers.Dense(1)(keras.layers.Concatenate()(towers))
    model = keras.Model({"user": user, "item": item}, out)
    if mode == "remote":
        model = tf_dlt.transpile(model, start_cluster(2).addresses)
    model.compile(optimizer="adagrad", loss="mse")
    rng = np.random.default_rng(0)
    data = {"user": rng.integers(0, 20, (16, 2)), "item": rng.integers(0, 20, (16, 1))}
    model.fit(data, np.ones((16, 1)), verbose=0)
    expected = model.predict(data, verbose=0)
    tf_dlt.export_saved_model(model, str(tmp_path / "s"), mode=mode)
    serve = tf.saved_model.load(str(tmp_path / "s")).signatures["serve"]
    got = serve(user=tf.constant(data["user"]), item=tf.constant(data["item"]))
    np.testing.assert_allclose(next(iter(got.values())).numpy(), expected, atol=1e-5)


def test_a_standalone_export_of_a_sequential_model_keeps_its_mask_and_takes_any_batch(
    tmp_path: Path,
) -> None:
    """A Sequential model built by its first batch (no keras.Input), whose
    layer masks padding (mask_zero) for an LSTM. The export served the
    rows unmasked (the frozen layer made no mask), and only batches of the
    training batch's size (its input's shape was taken whole), where
    Keras's own export takes any."""
    rng = np.random.default_rng(3)
    x = rng.integers(1, 20, (64, 6)).astype("float32")
    x[:, 3:] = 0  # three ids, then padding
    model = keras.Sequential([
        Embedding(output_dim=4, is_distributed=True, mask_zero=True, name="exp_seq_mask"),
        keras.layers.LSTM(3), keras.layers.Dense(1),
    ])  # fmt: skip
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    model.fit(x, rng.normal(size=(64, 1)), epochs=1, batch_size=8, verbose=0)
    tf_dlt.export_saved_model(model, str(tmp_path / "m"), mode="standalone")
    served = _serve_elsewhere(tmp_path, tmp_path / "m", x[:5], with_tf_dlt=False)
    np.testing.assert_allclose(served, model.predict(x[:5], verbose=0), atol=1e-6)


def test_a_standalone_export_keeps_each_nested_models_own_layer_of_a_shared_name(
    tmp_path: Path,
) -> None:
    """Two towers made by one function, each with a Dense named "hidden":
    the frozen copy took one tower's weights for both (copied by name over
    all layers at once), so the export served other predictions."""

    def tower(name: str) -> keras.Model:
        inp = keras.Input((2,), dtype="int64", name=f"{name}_in")
        rows = Embedding(output_dim=4, is_distributed=True, name=f"exp_{name}")(inp)
        out = keras.layers.Dense(1, name="hidden")(keras.layers.Flatten()(rows))
        return keras.Model(inp, out, name=name)

    user, item = tower("user"), tower("item")
    a, b = keras.Input((2,), dtype="int64", name="a"), keras.Input((2,), dtype="int64", name="b")
    model = keras.Model([a, b], keras.layers.Concatenate()([user(a), item(b)]))
    x = [np.array([[1, 2]], np.int64), np.array([[3, 4]], np.int64)]
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, np.ones((1, 2)), verbose=0)  # rows exist
    for value, t in ((1.0, user), (2.0, item)):
        t.get_layer("hidden").set_weights([np.full((8, 1), value), np.zeros(1)])
    tf_dlt.export_saved_model(model, str(tmp_path / "m"), mode="standalone")
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    served = loaded.serve(*[tf.constant(v) for v in x])
    np.testing.assert_allclose(served.numpy(), model.predict(x, verbose=0), atol=1e-6)


def test_standalone_export_of_chosen_ids(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(1)
    model = tf_dlt.transpile(_model("exp_subset"), cluster.addresses)
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    known = np.unique(x[:32])
    # Ids chosen but never trained hold no row: frozen as the model reads
    # them (zeros), not as the initial values a training pull would make.
    untrained = np.array([10**15, -3], np.int64)
    tf_dlt.export_saved_model(
        model, str(tmp_path / "subset"), mode="standalone",
        ids={"exp_subset": np.concatenate([known, untrained])},
    )  # fmt: skip
    served = _serve_elsewhere(tmp_path, tmp_path / "subset", x[:32], with_tf_dlt=False)
    np.testing.assert_allclose(served, model.predict(x[:32], verbose=0), atol=1e-6)
    mixed = np.array([[untrained[0], untrained[1], x[0, 0]]], np.int64)
    np.testing.assert_allclose(
        _serve_elsewhere(tmp_path, tmp_path / "subset", mixed, with_tf_dlt=False),
        model.predict(mixed, verbose=0), atol=1e-6,
    )  # fmt: skip
    # Ids that were not exported read as zeros.
    unknown = np.full((2, 3), 10**12, np.int64)
    bias = model.get_layer("head").get_weights()[1]
    np.testing.assert_allclose(
        _serve_elsewhere(tmp_path, tmp_path / "subset", unknown, with_tf_dlt=False),
        np.tile(bias, (2, 1)), atol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("num_shards", [1, 2])
def test_standalone_export_of_every_row_on_shard_processes(
    start_cluster: Callable[..., Cluster], tmp_path: Path, num_shards: int
) -> None:
    cluster = start_cluster(num_shards)
    model = tf_dlt.transpile(_model(f"exp_all{num_shards}"), cluster.addresses)
    x, y = _data()
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    tf_dlt.export_saved_model(model, str(tmp_path / "all"), mode="standalone")
    served = _serve_elsewhere(tmp_path, tmp_path / "all", x, with_tf_dlt=False)
    np.testing.assert_allclose(served, model.predict(x, verbose=0), atol=1e-6)


def test_standalone_export_stages_only_the_models_tables_where_the_shards_may_write(
    start_cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards confined to a checkpoint root refuse the default staging (a
    local temporary directory): the error says to pass `staging=`. Staged
    there, only the model's tables are saved (another model's table on the
    same shards was saved and held in this process too), and the staging
    directory the export made is removed after (its empty folder stayed)."""
    root = tmp_path / "root"
    root.mkdir()
    cluster = start_cluster(1, "--checkpoint-root", str(root))
    with tf_dlt.Client(cluster.addresses) as other_model:
        other_model.create_table("other", 4)
        other_model.pull("other", np.arange(1000))
    model = tf_dlt.transpile(_model("exp_confined"), cluster.addresses)
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    with pytest.raises(errors.PermissionDeniedError, match="pass staging= a directory under"):
        tf_dlt.export_saved_model(model, str(tmp_path / "refused"), mode="standalone")
    saved: list[object] = []
    save = tf_dlt.Client.save

    def spy(self: tf_dlt.Client, path: str, **kwargs: Any) -> Any:
        saved.append(kwargs.get("tables"))
        return save(self, path, **kwargs)

    monkeypatch.setattr(tf_dlt.Client, "save", spy)
    stage = root / "stage"
    tf_dlt.export_saved_model(model, str(tmp_path / "out"), mode="standalone", staging=str(stage))
    assert saved == [["exp_confined"]]
    assert not stage.exists() and os.listdir(root) == []
    served = _serve_elsewhere(tmp_path, tmp_path / "out", x, with_tf_dlt=False)
    np.testing.assert_allclose(served, model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.parametrize("where", ["embedded", "shards"])
def test_standalone_export_of_the_most_frequent_rows(
    start_cluster: Callable[..., Cluster], tmp_path: Path, where: str
) -> None:
    model = _model(f"exp_frequent_{where}")
    if where == "shards":
        model = tf_dlt.transpile(model, start_cluster(2).addresses)
    # Id i appears in the first 8 - i batches: frequencies 8, 7, ..., 1.
    x = np.array([[i, i, i] if i < 8 - b else [99, 99, 99] for b in range(8) for i in range(8)])
    model.fit(x, np.ones((len(x), 1), np.float32), epochs=1, batch_size=8, shuffle=False, verbose=0)
    tf_dlt.export_saved_model(model, str(tmp_path / "top"), mode="standalone", most_frequent=4)
    # 99 (in every batch) and ids 0, 1, 2 are kept; others read as zeros.
    probe = np.repeat(np.array([99, 0, 1, 2, 3, 4, 7])[:, None], 3, axis=1)
    served = _serve_elsewhere(tmp_path, tmp_path / "top", probe, with_tf_dlt=False)
    live = model.predict(probe, verbose=0)
    bias = model.get_layer("head").get_weights()[1]
    np.testing.assert_allclose(served[:4], live[:4], atol=1e-6)
    np.testing.assert_allclose(served[4:], np.tile(bias, (3, 1)), atol=1e-6)
    with pytest.raises(ValueError, match="most_frequent must be a positive int"):
        tf_dlt.export_saved_model(model, str(tmp_path / "x"), mode="standalone", most_frequent=0)
    with pytest.raises(ValueError, match="choose the rows of a standalone export"):
        tf_dlt.export_saved_model(model, str(tmp_path / "x"), most_frequent=3)
    # A misspelt table name exported every row of the table meant.
    for chosen in ({"ids": {"nope": [1, 2]}}, {"most_frequent": {"nope": 5}}):
        with pytest.raises(ValueError, match=r"names \['nope'\], which no distributed layer"):
            tf_dlt.export_saved_model(model, str(tmp_path / "x"), mode="standalone", **chosen)
    assert not (tmp_path / "x").exists()


def test_remote_export_served_by_followers_tracks_training_deltas(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """The serving fleet follows the trainer's checkpoint directory: the
    remote SavedModel, pointed at it with TF_DLT_PSERVERS, predicts what
    the model predicted at each committed delta."""
    trainer = start_cluster(2)
    model = tf_dlt.transpile(_model("exp_follow"), trainer.addresses)
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    run = tmp_path / "run"
    tf_dlt.save(model, str(run / "c1"))
    tf_dlt.export_saved_model(model, str(tmp_path / "remote"))
    followers = start_cluster(
        3, "--read-only", "--follow", str(run), "--follow-interval", "0.1"
    )  # fmt: skip
    env = {"TF_DLT_PSERVERS": ",".join(followers.addresses)}
    # Dense weights stay as exported; only the tables move on.
    head = model.get_layer("head").get_weights()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    model.get_layer("head").set_weights(head)
    info = tf_dlt.save(model, str(run / "c2"), incremental=True)
    assert info["kind"] == "delta"
    live = model.predict(x, verbose=0)
    target = tf_dlt.checkpoint.manifest.read_manifest(str(run / "c2" / "tables"))["save_id"]
    with followers.client() as f:
        for _ in range(600):
            if all(s.get("serving_save_id") == target for s in f.stats()):
                break
            time.sleep(0.05)
        assert all(s.get("serving_save_id") == target for s in f.stats())
    served = _serve_elsewhere(tmp_path, tmp_path / "remote", x, with_tf_dlt=True, env=env)
    np.testing.assert_allclose(served, live, atol=1e-6)


def test_no_auth_token_is_written_into_an_exported_model(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """The shards' token reaches the trainer's lookups, but no file of a
    remote SavedModel (nor a Keras export of the live model) holds it, nor
    anything derived from it in the client's name; a serving process names
    the token in a file through TF_DLT_AUTH_TOKEN_FILE, and without it is
    refused by the shards."""
    token = "tok-" + "8c1f" * 8
    cluster = start_cluster(1, token=token)
    model = tf_dlt.transpile(_model("exp_token"), cluster.addresses, auth_token=token)
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    live = model.predict(x, verbose=0)
    tf_dlt.export_saved_model(model, str(tmp_path / "remote"))
    tf.saved_model.save(model, str(tmp_path / "plain"))  # a user's own export
    for root in (tmp_path / "remote", tmp_path / "plain"):
        files = [p for p in root.rglob("*") if p.is_file()]
        assert files
        for path in files:
            data = path.read_bytes()
            assert token.encode() not in data, path
            assert hashlib.sha256(token.encode()).hexdigest()[:16].encode() not in data, path
    token_file = tmp_path / "serving-token"
    token_file.write_text(token + "\n")
    served = _serve_elsewhere(
        tmp_path, tmp_path / "remote", x, with_tf_dlt=True,
        env={"TF_DLT_AUTH_TOKEN_FILE": str(token_file)},
    )  # fmt: skip
    np.testing.assert_allclose(served, live, atol=1e-6)
    with pytest.raises(AssertionError, match="Unauthenticated|UNAUTHENTICATED|token"):
        _serve_elsewhere(tmp_path, tmp_path / "remote", x, with_tf_dlt=True)
    # The token pasted where its file's path goes is never echoed.
    with pytest.raises(AssertionError, match="cannot read the auth token file") as refused:
        _serve_elsewhere(
            tmp_path, tmp_path / "remote", x, with_tf_dlt=True,
            env={"TF_DLT_AUTH_TOKEN_FILE": token},
        )  # fmt: skip
    assert token not in str(refused.value)
    # A FIFO named as the file: the serving process's first lookup blocked
    # on it for good (the op kernel read it to its end).
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(AssertionError, match="not a regular file"):
        _serve_elsewhere(
            tmp_path, tmp_path / "remote", x, with_tf_dlt=True,
            env={"TF_DLT_AUTH_TOKEN_FILE": str(tmp_path / "fifo")},
        )  # fmt: skip
    # Loaded in this process, which gave the client its token: the loader
    # renames the client's shared_name, and its lookups went unauthenticated.
    assert "TF_DLT_AUTH_TOKEN_FILE" not in os.environ
    loaded = tf.saved_model.load(str(tmp_path / "remote"))
    np.testing.assert_allclose(loaded.serve(x).numpy(), live, atol=1e-6)


SERVE_COMPOSITE = """
import sys
sys.modules['tf_dlt'] = None  # plain TensorFlow only
import numpy as np, tensorflow as tf
kind, path, data, out = sys.argv[1:]
d = np.load(data)
hist = tf.RaggedTensor.from_row_lengths(d["values"], d["lengths"])
if kind == "sparse":
    hist = hist.to_sparse()
    hist = tf.SparseTensor(hist.indices, hist.values, [len(d["lengths"]), 5])
loaded = tf.saved_model.load(path)  # (held: the endpoint's variables are its)
served = loaded.serve(tf.constant(d["users"]), hist)
np.save(out, served.numpy())
"""


TRAINS: dict[str, Any] = {"optimizer": "adagrad", "learning_rate": 0.1}


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_standalone_export_of_ids_per_example_reduced_by_a_combiner(
    tmp_path: Path, kind: str
) -> None:
    """A layer reducing a ragged or sparse input of ids per example
    (combiner="mean") beside a dense one: the standalone export failed
    (Concatenate met a ragged rank-3 input: the frozen copy's inputs were
    made dense), and a model with the combiner's output alone exported an
    endpoint taking dense ids that served the wrong shape. It serves what
    the model predicts, from plain TensorFlow."""
    users = keras.Input((1,), dtype="int64", name="user")
    hist = keras.Input((None,) if kind == "ragged" else (5,), dtype="int64", name="hist",
                       **{kind: True})  # fmt: skip
    user_rows = keras.layers.Flatten()(
        Embedding(output_dim=4, is_distributed=True, name=f"cu_{kind}", **TRAINS)(users)
    )
    pooled = Embedding(
        output_dim=4, is_distributed=True, combiner="mean", name=f"ch_{kind}", **TRAINS
    )(hist)
    model = keras.Model(
        [users, hist], keras.layers.Dense(1)(keras.layers.Concatenate()([user_rows, pooled]))
    )
    lengths = np.array([3, 1, 2, 4], np.int64)
    values = np.arange(10, dtype=np.int64) * 7
    u = np.array([[1], [2], [3], [1]], np.int64)
    ragged = tf.RaggedTensor.from_row_lengths(values, lengths)
    x = ragged if kind == "ragged" else tf.SparseTensor(
        ragged.to_sparse().indices, values, [len(lengths), 5]
    )  # fmt: skip
    model([tf.constant(u), x], training=True)  # makes the rows
    live = model([tf.constant(u), x], training=False).numpy()
    tf_dlt.export_saved_model(model, str(tmp_path / "m"), mode="standalone")
    np.savez(tmp_path / "d.npz", users=u, values=values, lengths=lengths)
    out = subprocess.run(
        [sys.executable, "-c", SERVE_COMPOSITE, kind, str(tmp_path / "m"),
         str(tmp_path / "d.npz"), str(tmp_path / "y.npy")],
        capture_output=True, text=True, cwd="/", timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), live, atol=1e-6)


class _SumOverIds(keras.layers.Layer):  # type: ignore[misc]
    """Sums an example's rows (a model's own reduction of ragged rows)."""

    def call(self, rows: Any) -> Any:
        return tf.reduce_sum(rows, axis=1)

    def compute_output_shape(self, shape: Any) -> tuple[Any, ...]:
        return (shape[0], shape[-1])


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_standalone_export_of_ids_per_example_without_a_combiner(tmp_path: Path, kind: str) -> None:
    """Without a combiner, a ragged input gives ragged rows and a sparse one
    the rows of the dense tensor it stands for (an absent entry reads id
    0), as the live layer and keras.layers.Embedding give. The frozen
    layer reduced both by "sqrtn": the sparse model served zeros for an
    example with no id, and the ragged one failed to export."""
    start = (np.arange(20, dtype=np.float32).reshape(5, 4) + 1) / 10  # row 0 is not zeros
    layer = Embedding(5, 4, is_distributed=True, weights=start, name=f"nocomb_{kind}")
    if kind == "sparse":
        ids = keras.Input((1,), dtype="int64", sparse=True)
        rows = keras.layers.Flatten()(layer(ids))
        x: Any = tf.SparseTensor([[0, 0], [2, 0]], tf.constant([3, 2], tf.int64), [3, 1])
    else:
        ids = keras.Input((None,), dtype="int64", ragged=True)
        rows = _SumOverIds()(layer(ids))
        x = tf.ragged.constant([[1, 2, 3], [4], [0, 1]], dtype=tf.int64)
    model = keras.Model(ids, keras.layers.Dense(1, kernel_initializer="ones")(rows))
    live = model(x, training=False).numpy()
    tf_dlt.export_saved_model(model, str(tmp_path / "m"), mode="standalone")
    served = tf.saved_model.load(str(tmp_path / "m"))  # (held: the call reads its variables)
    np.testing.assert_allclose(served.serve(x), live, atol=1e-6)


@pytest.mark.parametrize("mode", ["standalone", "remote"])
def test_an_export_under_mixed_precision_gives_rows_in_the_compute_dtype(
    tmp_path: Path, cluster: Cluster, mode: str
) -> None:
    """A layer under mixed_float16 gives its rows in float16, as
    keras.layers.Embedding does; the standalone export's frozen layer gave
    float32 (its own dtype policy was the default one). Served from either
    export, the rows are the live layer's, in the live layer's dtype."""
    start = (np.arange(12, dtype=np.float32).reshape(3, 4) + 1) / 8  # exact in float16
    layer = Embedding(3, 4, is_distributed=True, weights=start, dtype="mixed_float16",
                      name=f"mixed_{mode}")  # fmt: skip
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, layer(ids))
    if mode == "remote":
        model = tf_dlt.transpile(model, cluster.addresses)
    x = np.array([[0, 2], [1, 1]], np.int64)
    live = model(x, training=False)
    assert live.dtype == tf.float16
    tf_dlt.export_saved_model(model, str(tmp_path / "m"), mode=mode)
    served = tf.saved_model.load(str(tmp_path / "m"))  # (held: the call reads its variables)
    rows = served.serve(tf.constant(x))
    assert rows.dtype == tf.float16
    np.testing.assert_array_equal(rows.numpy(), live.numpy())


def test_a_standalone_export_of_a_model_with_dense_weights_on_the_shards(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A model compiled with `tf_dlt.DenseOnShards(auth_token=...)`: its
    standalone export failed UNAUTHENTICATED, the frozen copy compiled
    anew with an optimizer made from its config, which holds no token (and
    which, with the token in the environment, made a table on the shards).
    The copy is not compiled: the export needs no optimizer."""
    token = "tok-" + "5a9e" * 8
    cluster = start_cluster(1, token=token)
    model = tf_dlt.transpile(_model("exp_dense"), cluster.addresses, auth_token=token)
    model.compile(
        optimizer=tf_dlt.DenseOnShards(cluster.addresses, auth_token=token, is_chief=True),
        loss="mse",
    )
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    live = model.predict(x, verbose=0)
    with tf_dlt.Client(cluster.addresses, auth_token=token) as client:
        tables = sorted(client.list_tables())
    tf_dlt.export_saved_model(model, str(tmp_path / "m"), mode="standalone")
    served = _serve_elsewhere(tmp_path, tmp_path / "m", x, with_tf_dlt=False)
    np.testing.assert_allclose(served, live, atol=1e-6)
    with tf_dlt.Client(cluster.addresses, auth_token=token) as client:
        assert sorted(client.list_tables()) == tables


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_a_combiner_under_mixed_precision_trains_and_exports(tmp_path: Path, combiner: str) -> None:
    """combiner="mean" or "sqrtn" under mixed_float16: the layer's float16
    rows met the combiner's float32 counts, and fit, predict and the
    standalone export failed TypeError. Each trains, and the export serves
    what the model predicts, in float16."""
    ids = keras.Input((None,), dtype="int64", ragged=True)
    layer = Embedding(output_dim=4, is_distributed=True, combiner=combiner,
                      dtype="mixed_float16", name=f"mixed_{combiner}", **TRAINS)  # fmt: skip
    model = keras.Model(ids, layer(ids))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x = tf.ragged.constant([[1, 2, 3], [4], [2, 2]], dtype=tf.int64)
    model.fit(x, np.ones((3, 4), np.float32), epochs=2, verbose=0)
    live = model(x, training=False)
    assert live.dtype == tf.float16
    tf_dlt.export_saved_model(model, str(tmp_path / "m"), mode="standalone")
    served = tf.saved_model.load(str(tmp_path / "m"))  # (held: the call reads its variables)
    rows = served.serve(x)
    assert rows.dtype == tf.float16
    np.testing.assert_array_equal(rows.numpy(), live.numpy())
