"""tf_dlt.save / tf_dlt.load and the ModelCheckpoint callback: tables (with
optimizer state) and dense weights come back together, embedded or on shard
processes, and a checkpoint moves between the two."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import tf_dlt
from tf_dlt import errors
from tf_dlt.checkpoint import manifest
from tf_dlt.layers import Embedding

from conftest import Cluster


def _model(name: str) -> keras.Model:
    inp = keras.Input((3,), dtype="int64")
    emb = Embedding(
        output_dim=4, is_distributed=True, optimizer="adam", learning_rate=0.05, name=name
    )
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="adam", loss="mse")
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.integers(0, 300, size=(96, 3)).astype("int64"), rng.normal(size=(96, 1)).astype(
        "float32"
    )


def _state(model: keras.Model, name: str) -> tuple[np.ndarray, ...]:
    layer = model.get_layer(name)
    ids, values, slots, steps = tf_dlt.embedded.rows(layer.table_name)
    order = np.argsort(ids)
    return ids[order], values[order], slots[order], steps[order]


def _assert_state(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_embedded_save_and_load_restore_rows_slots_and_dense_weights(tmp_path: Path) -> None:
    model = _model("ck_embedded")
    x, y = _data()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    tf_dlt.save(model, str(tmp_path / "ck"))
    expected = model.predict(x, verbose=0)
    state = _state(model, "ck_embedded")
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)  # moves everything on
    tf_dlt.load(model, str(tmp_path / "ck"))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)
    _assert_state(_state(model, "ck_embedded"), state)  # values, Adam slots and steps


def test_shard_save_loads_into_embedded_tables(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    remote = tf_dlt.transpile(_model("ck_remote"), cluster.addresses)
    x, y = _data()
    remote.fit(x, y, epochs=2, batch_size=16, verbose=0)
    tf_dlt.save(remote, str(tmp_path / "ck"))
    expected = remote.predict(x, verbose=0)
    remote.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.load(remote, str(tmp_path / "ck"))
    np.testing.assert_allclose(remote.predict(x, verbose=0), expected, atol=1e-6)
    local = _model("ck_remote")  # same table name, embedded tables
    tf_dlt.load(local, str(tmp_path / "ck"))
    np.testing.assert_allclose(local.predict(x, verbose=0), expected, atol=1e-6)


def test_checkpoint_callback_saves_every_epoch(tmp_path: Path) -> None:
    model = _model("ck_callback")
    x, y = _data()
    callback = tf_dlt.ModelCheckpoint(str(tmp_path / "epoch-{epoch}"))
    model.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[callback])
    assert callback.saved == [str(tmp_path / "epoch-1"), str(tmp_path / "epoch-2")]
    for path in callback.saved:
        assert (Path(path) / "tf_dlt_model.json").exists()
        assert (Path(path) / "tables" / "MANIFEST.json").exists()
    # Keras's ModelCheckpoint's path form, with the epoch's logs: a
    # `{val_loss}` stopped fit with a KeyError after epoch 1, saving nothing.
    logged = tf_dlt.ModelCheckpoint(str(tmp_path / "ck-{epoch:02d}-{val_loss:.3f}"))
    history = model.fit(
        x, y, epochs=2, batch_size=16, verbose=0, validation_split=0.25, callbacks=[logged]
    )
    losses = history.history["val_loss"]
    assert logged.saved == [str(tmp_path / f"ck-{e + 1:02d}-{v:.3f}") for e, v in enumerate(losses)]
    misnamed = tf_dlt.ModelCheckpoint(str(tmp_path / "ck-{val_los}"))
    with pytest.raises(KeyError, match=r"names 'val_los', which the logs of epoch 1 do not hold"):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0, callbacks=[misnamed])


def _following(name: str, trainable: bool = True) -> keras.Model:
    """A model whose table follows the model's optimizer (names none)."""
    inp = keras.Input((3,), dtype="int64")
    emb = Embedding(output_dim=4, is_distributed=True, name=name, trainable=trainable)
    return keras.Model(inp, keras.layers.Dense(1, name="head")(keras.layers.Flatten()(emb(inp))))


@pytest.mark.parametrize("how", ["not_compiled", "frozen", "not_compiled_on_shards"])
def test_a_checkpoint_loads_into_a_model_whose_table_follows_an_optimizer_not_known_yet(
    start_cluster: Callable[..., Cluster], tmp_path: Path, how: str
) -> None:
    """An inference script (load, predict: no compile) and a fine-tune of
    the layers above a frozen embedding were refused: the table's config
    held the stand-in SGD it keeps until compile (`FailedPreconditionError
    ... optimizer.kind: sgd vs keras_adagrad`). The table takes the
    optimizer it was saved with; a compile that follows another optimizer
    is then refused as for any trained table."""
    name = f"ck_follow_{how}"
    cluster = start_cluster(2) if how.endswith("on_shards") else None

    def made(trainable: bool = True) -> keras.Model:
        model = _following(name, trainable)
        return tf_dlt.transpile(model, cluster.addresses) if cluster is not None else model

    model = made()
    model.compile(optimizer="adagrad", loss="mse")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.save(model, str(tmp_path / "ck"))
    expected = model.predict(x, verbose=0)
    if cluster is not None:
        with cluster.client() as client:
            client.drop_table(name)  # as for shards started afresh
    else:
        state = _state(model, name)
        tf_dlt.embedded.drop_table(name)  # as in a fresh process
    keras.backend.clear_session()
    again = made(trainable=how != "frozen")
    if how == "frozen":
        again.compile(optimizer="adam", loss="mse")
    tf_dlt.load(again, str(tmp_path / "ck"))
    np.testing.assert_allclose(again.predict(x, verbose=0), expected, atol=1e-6)
    if cluster is None:
        _assert_state(_state(again, name), state)
    if how == "frozen":
        again.fit(x, y, epochs=1, batch_size=16, verbose=0)  # the head only
        _assert_state(_state(again, name), state)
        return
    assert again.get_layer(name).table_config.optimizer.kind == "keras_adagrad"
    again.compile(optimizer="sgd", loss="mse")
    with pytest.raises(errors.FailedPreconditionError, match="settled .*with keras_adagrad"):
        again.fit(x, y, epochs=1, batch_size=16, verbose=0)
    again.compile(optimizer="adagrad", loss="mse")
    again.fit(x, y, epochs=1, batch_size=16, verbose=0)


MISMATCHED_LOAD = """
import sys
import keras, numpy as np, tf_dlt
from tf_dlt import errors
from tf_dlt.checkpoint import manifest
inp = keras.Input((3,), dtype="int64")
layer = tf_dlt.layers.Embedding(
    output_dim=4, is_distributed=True, optimizer="sgd", name=sys.argv[3])
model = keras.Model(inp, keras.layers.Dense(1, name="head")(keras.layers.Flatten()(layer(inp))))
x = np.load(sys.argv[2])
before = model.predict(x, verbose=0)
try:
    tf_dlt.load(model, sys.argv[1])
    raise SystemExit("a table with another optimizer was loaded")
except errors.FailedPreconditionError as e:
    print("refused:", e)
np.testing.assert_allclose(model.predict(x, verbose=0), before, atol=1e-6)
"""


def test_load_refuses_a_mismatched_table_and_changes_nothing(tmp_path: Path) -> None:
    model = _model("ck_mismatch")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.save(model, str(tmp_path / "ck"))
    with pytest.raises(errors.NotFoundError):
        tf_dlt.load(model, str(tmp_path / "nothing-here"))
    # The same table name with another optimizer: embedded tables are one
    # per process, so the other model lives in a fresh process.
    np.save(tmp_path / "x.npy", x)
    args = [str(tmp_path / "ck"), str(tmp_path / "x.npy"), "ck_mismatch"]
    out = subprocess.run(
        [sys.executable, "-c", MISMATCHED_LOAD, *args], capture_output=True, text=True,
        timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: table 'ck_mismatch' differs from the checkpoint's" in out.stdout
    assert "optimizer" in out.stdout


@pytest.mark.parametrize("remote", [False, True], ids=["embedded", "2shards"])
def test_incremental_checkpoints_with_full_every_and_keep(
    start_cluster: Callable[..., Cluster], tmp_path: Path, remote: bool
) -> None:
    name = f"ck_delta_{int(remote)}"
    model = _model(name)
    addresses = start_cluster(2).addresses if remote else []
    if remote:
        model = tf_dlt.transpile(model, addresses)
    x, y = _data()
    run = tmp_path / "run"
    callback = tf_dlt.ModelCheckpoint(str(run / "epoch-{epoch}"), full_every=3, keep=2)
    model.fit(x, y, epochs=5, batch_size=16, verbose=0, callbacks=[callback])
    assert callback.kinds == ["full", "delta", "delta", "full", "delta"]
    # Keep 2 (epochs 4 and 5): epoch 5 is a delta on epoch 4, a full one.
    assert [p.rsplit("-", 1)[-1] for p in callback.deleted] == ["1", "2", "3"]
    assert sorted(p.name for p in run.iterdir()) == ["epoch-4", "epoch-5"]
    expected = model.predict(x, verbose=0)
    state = _state(model, name) if not remote else None
    fresh = _model(name)
    if remote:
        fresh = tf_dlt.transpile(fresh, addresses)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # moves everything on
    tf_dlt.load(fresh, str(run / "epoch-5"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), expected, atol=1e-6)
    if state is not None:
        _assert_state(_state(fresh, name), state)  # values, Adam slots and steps
    # A delta on top of the load holds only what training changes after it.
    fresh.fit(x[:16], y[:16], epochs=1, batch_size=16, verbose=0)
    info = tf_dlt.save(fresh, str(tmp_path / "after"), incremental=True)
    tables = manifest.read_manifest(str(tmp_path / "after" / "tables"))
    assert info["kind"] == "delta" and tables["chain_length"] == 3
    assert 0 < tables["tables"][0]["rows"] <= 48
    tf_dlt.load(model, str(tmp_path / "after"))
    np.testing.assert_allclose(model.predict(x, verbose=0), fresh.predict(x, verbose=0), atol=1e-6)


def test_checkpoints_pruned_by_another_program_stop_no_fit(tmp_path: Path) -> None:
    """A prune beside `ModelCheckpoint(full_every=..., keep=...)` (compact the
    newest, `prune --keep 1`) deleted the base of its next delta and the
    checkpoints its own clean-up meant to delete: `fit` stopped with
    NotFoundError after a save that succeeded. The delta is saved in full
    instead, and what is gone already counts as deleted."""
    import shutil

    model = _model("ck_pruned")
    x, y = _data()
    run = tmp_path / "run"

    class Prune(keras.callbacks.Callback):  # type: ignore[misc]
        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            if epoch == 2:  # before the third save: epochs 1 and 2 pruned
                for done in ("epoch-1", "epoch-2"):
                    shutil.rmtree(run / done)

    callback = tf_dlt.ModelCheckpoint(str(run / "epoch-{epoch}"), full_every=5, keep=2)
    model.fit(x, y, epochs=4, batch_size=16, verbose=0, callbacks=[Prune(), callback])
    assert callback.kinds == ["full", "delta", "full", "delta"]
    assert sorted(p.name for p in run.iterdir()) == ["epoch-3", "epoch-4"]
    expected = model.predict(x, verbose=0)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # moves everything on
    tf_dlt.load(model, str(run / "epoch-4"))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)


def test_a_checkpoint_path_that_repeats_is_saved_in_full_where_a_delta_cannot_be(
    tmp_path: Path,
) -> None:
    """A path that names no field changing each epoch (a fixed path, or
    ``{val_loss:.0f}``) with `full_every`: the delta due at a path its base
    loads through stopped `fit` with InvalidArgumentError. It is saved in
    full; a repeat of a path a newer delta loads through is refused before
    anything is written, and every checkpoint saved still loads."""
    model = _model("ck_repeats")
    x, y = _data()
    fixed = tf_dlt.ModelCheckpoint(str(tmp_path / "latest"), full_every=3)
    model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[fixed])
    assert fixed.kinds == ["full", "full", "full"]
    expected = model.predict(x, verbose=0)
    fresh = _model("ck_repeats")
    tf_dlt.load(fresh, str(tmp_path / "latest"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), expected, atol=1e-6)

    class Tag(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self, tags: str) -> None:
            super().__init__()
            self.tags = tags

        def on_epoch_end(self, epoch: int, logs: dict[str, object] | None = None) -> None:
            assert logs is not None
            logs["tag"] = self.tags[epoch]

    tagged = tf_dlt.ModelCheckpoint(str(tmp_path / "ck-{tag}"), full_every=5)
    model.fit(x, y, epochs=4, batch_size=16, verbose=0, callbacks=[Tag("abba"), tagged])
    # ck-b on ck-a; ck-b again: full; ck-a on the full ck-b, which no longer
    # needs the ck-a it replaces.
    assert tagged.kinds == ["full", "delta", "full", "delta"]
    expected = model.predict(x, verbose=0)
    tf_dlt.load(fresh, str(tmp_path / "ck-a"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), expected, atol=1e-6)

    # keep= counts paths, each at its newest save: a path saved again is
    # the newest, and one deleted and saved again is deleted again.
    kept = tf_dlt.ModelCheckpoint(str(tmp_path / "kept-{tag}"), keep=2)
    model.fit(x, y, epochs=6, batch_size=16, verbose=0, callbacks=[Tag("abcaab"), kept])
    assert [p.rsplit("-", 1)[-1] for p in kept.deleted] == ["a", "b", "c"]
    assert sorted(p.name for p in tmp_path.glob("kept-*")) == ["kept-a", "kept-b"]

    # ck-d is a delta on ck-c: a third save at ck-c would break it.
    broken = tf_dlt.ModelCheckpoint(str(tmp_path / "ck-{tag}"), full_every=5)
    with pytest.raises(errors.FailedPreconditionError, match=r"ck-d'? is a delta on top of"):
        model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[Tag("cdc"), broken])
    assert broken.kinds == ["full", "delta"]
    tf_dlt.load(fresh, str(tmp_path / "ck-c"))
    tf_dlt.load(fresh, str(tmp_path / "ck-d"))


def test_incremental_saves_to_one_path_stay_loadable(tmp_path: Path) -> None:
    """`incremental=True` on the path it saved last would overwrite its own
    base: it saves in full instead."""
    model = _model("ck_same_path")
    x, y = _data()
    for _ in range(3):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)
        info = tf_dlt.save(model, str(tmp_path / "latest"), incremental=True)
        assert info["kind"] == "full"
    expected = model.predict(x, verbose=0)
    fresh = _model("ck_same_path")
    tf_dlt.load(fresh, str(tmp_path / "latest"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), expected, atol=1e-6)


def test_a_model_delta_or_compact_inside_a_checkpoint_of_its_chain_is_refused(
    tmp_path: Path,
) -> None:
    """As for table checkpoints: a model checkpoint's delta (or compacted
    copy) inside a checkpoint its chain reads, or holding one, was taken
    (their tables/ directories are not inside one another)."""
    from tf_dlt.checkpoint import chain

    model = _model("ck_nested")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.save(model, str(tmp_path / "run" / "step-1"))
    for nested in (tmp_path / "run" / "step-1" / "inner", tmp_path / "run"):
        with pytest.raises(errors.InvalidArgumentError, match="lies inside, or holds"):
            tf_dlt.save(model, str(nested), incremental=True, base=str(tmp_path / "run" / "step-1"))
        with pytest.raises(errors.InvalidArgumentError, match="lies inside, or holds"):
            chain.compact_model(str(tmp_path / "run" / "step-1"), str(nested))
    assert not (tmp_path / "run" / "step-1" / "inner").exists()
    assert not (tmp_path / "run" / "tables").exists()


def test_a_models_save_and_load_touch_only_its_own_tables(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """Two models train on the same shards: loading model B's checkpoint
    never rolls model A's table back, and B's checkpoint holds B's tables
    only; a whole-cluster Client.save/load still covers every table."""
    cluster = start_cluster(2)
    model_a = tf_dlt.transpile(_model("ck_model_a"), cluster.addresses)
    model_b = tf_dlt.transpile(_model("ck_model_b"), cluster.addresses)
    x, y = _data()
    for m in (model_a, model_b):
        m.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.save(model_b, str(tmp_path / "b"))
    held = manifest.read_manifest(str(tmp_path / "b" / "tables"))["tables"]
    assert [t["config"]["name"] for t in held] == [model_b.get_layer("ck_model_b").table_name]
    model_a.fit(x, y, epochs=1, batch_size=16, verbose=0)  # A moves on after B's save
    a_now = model_a.predict(x, verbose=0)
    b_saved = model_b.predict(x, verbose=0)
    model_b.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.load(model_b, str(tmp_path / "b"))
    np.testing.assert_allclose(model_b.predict(x, verbose=0), b_saved, atol=1e-6)
    np.testing.assert_array_equal(model_a.predict(x, verbose=0), a_now)  # untouched
    with cluster.client() as client:  # the whole cluster: every table
        whole = client.save(str(tmp_path / "all"))
        assert len(whole["tables"]) == 2


def test_compact_of_a_model_checkpoint_stays_loadable(tmp_path: Path) -> None:
    """`tf-dlt checkpoint compact` of a model checkpoint at the head of a
    delta chain writes a model checkpoint (tables, dense weights, model
    file) that tf_dlt.load takes, holding what the chain held."""
    import argparse

    from tf_dlt.tools import checkpoints

    model = _model("ck_compact")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.save(model, str(tmp_path / "m1"))
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert tf_dlt.save(model, str(tmp_path / "m2"), incremental=True)["kind"] == "delta"
    expected = model.predict(x, verbose=0)
    args = argparse.Namespace(
        verb="compact", source=str(tmp_path / "m2"), target=str(tmp_path / "m3"), num_shards=2
    )
    assert checkpoints.run(args) == 0
    held = manifest.read_manifest(str(tmp_path / "m3" / "tables"))
    assert held["kind"] == "full" and held["num_shards"] == 2
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # moves everything on
    info = tf_dlt.load(model, str(tmp_path / "m3"))
    assert info["kind"] == "full" and "parent" not in info
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)


def test_a_first_save_or_compaction_stopped_before_its_model_file_is_listed_only_if_it_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model checkpoint whose tables committed and whose model file was
    never written (the first save to its directory, or `tf-dlt checkpoint
    compact`, stopped between the two) was listed and kept by prune, which
    deleted the checkpoints before it, and tf_dlt.load refused it: nothing
    loadable was left. A save (or a compaction, which now copies the dense
    weights before its tables) stopped there loads whole; one missing its
    dense weights is listed by nothing and never counts for prune. A
    checkpoint another prune deleted first is taken as deleted."""
    from tf_dlt.checkpoint import chain

    model = _model("ck_first")
    x, y = _data()
    run = tmp_path / "run"
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.save(model, str(run / "step-1"))
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    expected = model.predict(x, verbose=0)
    commit = manifest.commit_file

    def stopped(fs: object, target: str, data: bytes) -> None:
        if target.endswith(chain.MODEL_FILE):
            raise OSError("the trainer was stopped here")
        commit(fs, target, data)

    monkeypatch.setattr(manifest, "commit_file", stopped)
    with pytest.raises(errors.DltError):
        tf_dlt.save(model, str(run / "step-2"))
    with pytest.raises(OSError):
        chain.compact_model(str(run / "step-2"), str(run / "step-2-full"))
    monkeypatch.undo()
    listed = [c.path for c in chain.find(str(run))]
    assert listed == [str(run / p) for p in ("step-1", "step-2", "step-2-full")]
    for path in ("step-2", "step-2-full"):
        model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # moves everything on
        info = tf_dlt.load(model, str(run / path))
        assert info["tables"] == [model.get_layer("ck_first").table_name]
        np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)
    for dense in (run / "step-2-full").glob("dense*.h5"):
        dense.unlink()  # as a compaction of before this change left it
    listed = [c.path for c in chain.find(str(run))]
    assert listed == [str(run / p) for p in ("step-1", "step-2")]
    paths = [str(run / "step-1"), str(run / "step-2")]
    gone = str(run / "step-0")  # deleted by another prune as this one ran
    assert chain.retain([gone, *paths], keep=2, tables_dir=chain.TABLES_DIR) == [gone]


def test_a_save_that_fails_after_its_commit_keeps_its_dense_weights_when_unsure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save whose tables committed and which failed after (in a cleanup)
    removes its dense weights only when the path is known to hold another
    save: a manifest it could not read back (a store's error) was taken for
    "none", and the committed save lost its dense weights (no load)."""
    from tf_dlt.keras import checkpoint as keras_checkpoint

    model = _model("ck_unsure")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    expected = model.predict(x, verbose=0)
    save_embedded, read_bytes = keras_checkpoint._save_embedded, manifest._read_manifest_bytes
    store_down = []

    def unreadable(*args: Any) -> bytes:
        if store_down:
            raise OSError(errno.EIO, "Input/output error")
        return read_bytes(*args)

    def committed_then_failed(*args: Any) -> Any:
        save_embedded(*args)
        store_down.append(True)
        raise RuntimeError("failed in its cleanup, after the commit")

    monkeypatch.setattr(manifest, "_read_manifest_bytes", unreadable)
    monkeypatch.setattr(keras_checkpoint, "_save_embedded", committed_then_failed)
    with pytest.raises(RuntimeError, match="after the commit"):
        tf_dlt.save(model, str(tmp_path / "ck"))
    monkeypatch.undo()
    assert list((tmp_path / "ck").glob("dense*.h5"))
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # moves everything on
    tf_dlt.load(model, str(tmp_path / "ck"))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)


def test_a_model_made_afresh_resumes_with_the_optimizer_and_schedule_it_saved(
    tmp_path: Path,
) -> None:
    """Resuming in a new process builds the model and compiles it, then
    `tf_dlt.load`: Keras skipped the saved optimizer's variables (the new
    one was not built), so training began again at step 0 of the learning
    rate schedule, with no dense slots. Now the resumed run equals one that
    never stopped: every row, slot and step, and the predictions."""

    def made(name: str) -> keras.Model:
        inp = keras.Input((3,), dtype="int64")
        emb = Embedding(output_dim=4, is_distributed=True, name=name, sync_push=True, seed=5)
        out = keras.layers.Dense(1, name="head", kernel_initializer="ones")(
            keras.layers.Flatten()(emb(inp))
        )
        model = keras.Model(inp, out)
        schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5)
        model.compile(optimizer=keras.optimizers.Adam(schedule), loss="mse")
        return model

    x, y = _data()
    first = made("ck_resume")
    first.fit(x, y, epochs=2, batch_size=16, verbose=0, shuffle=False)
    tf_dlt.save(first, str(tmp_path / "ck"))
    first.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    expected, state = first.predict(x, verbose=0), _state(first, "ck_resume")
    steps = int(first.optimizer.iterations.numpy())
    resumed = made("ck_resume")  # the same table: its rows are replaced by the load
    tf_dlt.load(resumed, str(tmp_path / "ck"))
    assert int(resumed.optimizer.iterations.numpy()) == steps - 6  # 96 examples / 16
    resumed.fit(x, y, epochs=1, batch_size=16, verbose=0, shuffle=False)
    np.testing.assert_array_equal(resumed.predict(x, verbose=0), expected)
    _assert_state(_state(resumed, "ck_resume"), state)


def test_a_layer_local_when_saved_and_distributed_now_is_refused_before_any_change(
    tmp_path: Path,
) -> None:
    """A checkpoint whose layer was local (its rows in the dense weights)
    loaded into a model where that layer is distributed: the other tables
    were replaced, then the dense weights failed to load. It is refused
    first, naming the table, and no table changes."""

    def two(distributed_b: bool) -> keras.Model:
        inp = keras.Input((3,), dtype="int64")
        a = Embedding(300, 4, is_distributed=True, name="ck_two_a", sync_push=True)(inp)
        b = Embedding(300, 4, is_distributed=distributed_b, name="ck_two_b")(inp)
        out = keras.layers.Dense(1)(keras.layers.Flatten()(keras.layers.Concatenate()([a, b])))
        model = keras.Model(inp, out)
        model.compile(optimizer="adagrad", loss="mse")
        return model

    x, y = _data()
    saved = two(distributed_b=False)
    saved.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.save(saved, str(tmp_path / "ck"))
    saved.fit(x, y, epochs=1, batch_size=16, verbose=0)  # the table moves on
    before = _state(saved, "ck_two_a")
    now = two(distributed_b=True)
    now(x[:1])
    with pytest.raises(errors.FailedPreconditionError, match=r"\['ck_two_b'\] are not in the"):
        tf_dlt.load(now, str(tmp_path / "ck"))
    _assert_state(_state(saved, "ck_two_a"), before)


@pytest.mark.parametrize("stop", ["dense", "after_tables", "model_file"])
def test_a_save_stopped_part_way_loads_one_save_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: str
) -> None:
    """Saving again to the path of a committed model checkpoint, stopped
    part way (the trainer killed, the store failing): stopped after the
    tables committed and before the dense weights were written, the path
    held the new save's tables and the old one's dense weights, and
    tf_dlt.load took that mix without a word. Now a save writes its dense
    weights under its own name before its tables commit, and the model
    file names them: the path loads one save whole, the old one (stopped
    before its tables committed) or the new one (stopped after: its dense
    weights are kept even when the tables' own cleanup failed)."""
    model = _model(f"ck_torn_{stop}")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    path = str(tmp_path / "latest")
    tf_dlt.save(model, path)
    old = model.predict(x, verbose=0), _state(model, f"ck_torn_{stop}")
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    new = model.predict(x, verbose=0), _state(model, f"ck_torn_{stop}")
    if stop == "dense":

        def failing(*args: object, **kw: object) -> None:
            raise OSError("no space left on device")

        monkeypatch.setattr(model, "save_weights", failing)
    elif stop == "after_tables":  # interrupted in the tables' cleanup, after their commit

        def interrupted(*args: object, **kw: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(manifest, "remove_superseded", interrupted)
    else:
        commit = manifest.commit_file

        def stopped(fs: object, target: str, data: bytes) -> None:
            if target.endswith("tf_dlt_model.json"):
                raise OSError("the trainer was stopped here")
            commit(fs, target, data)

        monkeypatch.setattr(manifest, "commit_file", stopped)
    with pytest.raises((errors.DltError, KeyboardInterrupt)):
        tf_dlt.save(model, path)
    monkeypatch.undo()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # moves everything on
    info = tf_dlt.load(model, path)
    assert info["tables"] == [model.get_layer(f"ck_torn_{stop}").table_name]
    expected, state = old if stop == "dense" else new
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)
    _assert_state(_state(model, f"ck_torn_{stop}"), state)
    # The next save to the path leaves one dense file: its own.
    tf_dlt.save(model, path)
    assert len(list((tmp_path / "latest").glob("dense*.h5"))) == 1


def test_dense_weights_that_cannot_load_change_no_table(tmp_path: Path) -> None:
    """A model checkpoint whose dense weights do not fit the model (another
    head): the tables were replaced, then load_weights refused. Now nothing
    of the model changes: neither its tables nor its dense weights."""
    model = _model("ck_dense_misfit")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.save(model, str(tmp_path / "ck"))
    inp = keras.Input((3,), dtype="int64")
    emb = Embedding(output_dim=4, is_distributed=True, optimizer="adam", learning_rate=0.05,
                    name="ck_dense_misfit")  # fmt: skip
    hidden = keras.layers.Dense(3, name="hidden")(keras.layers.Flatten()(emb(inp)))
    other = keras.Model(inp, keras.layers.Dense(1, name="head")(hidden))
    other.compile(optimizer="adam", loss="mse")
    other.fit(x, y, epochs=1, batch_size=16, verbose=0)  # its own rows, same table
    before, state = other.predict(x, verbose=0), _state(other, "ck_dense_misfit")
    with pytest.raises((ValueError, errors.DltError)):
        tf_dlt.load(other, str(tmp_path / "ck"))
    np.testing.assert_array_equal(other.predict(x, verbose=0), before)
    _assert_state(_state(other, "ck_dense_misfit"), state)


def test_a_checkpoint_saved_before_dense_files_were_named_per_save_loads(
    tmp_path: Path,
) -> None:
    """Model checkpoints written before each save named its dense weights
    (one `dense.weights.h5`, no save id in the model file) load and compact
    as before, and the next save to that path removes the old dense file.
    A model file that does not parse leaves the rest of its directory
    listed."""
    import json

    from tf_dlt.checkpoint import chain

    model = _model("ck_legacy")
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    path = tmp_path / "ck"
    info = tf_dlt.save(model, str(path))
    (path / info["dense_file"]).rename(path / "dense.weights.h5")
    legacy = {k: v for k, v in info.items() if k not in ("save_id", "dense_file")}
    (path / "tf_dlt_model.json").write_text(json.dumps(legacy))
    expected = model.predict(x, verbose=0)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.load(model, str(path))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)
    chain.compact_model(str(path), str(tmp_path / "compacted"))
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    tf_dlt.load(model, str(tmp_path / "compacted"))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "tf_dlt_model.json").write_text("{not json")
    shutil.copytree(path / "tables", tmp_path / "torn" / "tables")
    assert [c.path for c in chain.find(str(tmp_path))] == [str(path), str(tmp_path / "compacted")]
    tf_dlt.save(model, str(path))
    assert [p.name for p in path.glob("dense*.h5")] == [
        json.loads((path / "tf_dlt_model.json").read_text())["dense_file"]
    ]


def test_a_save_pins_only_the_copies_every_op_client_of_the_newest_layout_met(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tf_dlt.save pins each shard to the lineage the model's op clients met:
    only clients of the newest layout epoch count (one that has not learned
    a re-shard yet names the old layout's shards), and a shard two of them
    met at different copies is not pinned (either could be the empty
    restart; the save client greets as a new client there)."""
    from tf_dlt.keras import checkpoint

    stats = {
        "a": {"layout_epoch": 2, "lineages": [11, 0, 33]},
        "b": {"layout_epoch": 2, "lineages": [11, 22, 44]},
        "old": {"layout_epoch": 1, "lineages": [99, 99]},
        "unmet": {"layout_epoch": 2, "lineages": [0, 0, 0]},
    }

    class Layer:
        def __init__(self, name: str, embedded: bool = False) -> None:
            self.client = types.SimpleNamespace(name=name, embedded=embedded)

    monkeypatch.setattr(checkpoint.ops, "client_stats", lambda client: stats[client.name])
    layers = [Layer("a"), Layer("old"), Layer("b"), Layer("unmet"), Layer("x", embedded=True)]
    assert checkpoint._met_lineages(layers) == ([11, 22, 0], 2)
    assert checkpoint._met_lineages([Layer("x", embedded=True)]) == ([], 0)


def test_a_save_given_up_as_a_shard_fails_over_is_made_again(
    start_cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model save whose tables' save a shard gave up as it failed over
    (errors.FailedOverError: the primary writing it went silent and its
    standby took over; test_several_standbys.py and test_replication.py
    show it with real processes) is made once more under a new save id:
    tf_dlt.save returns, the path loads, and the first try's dense weights
    are gone."""
    cluster = start_cluster(1)
    model = tf_dlt.transpile(_model("ck_failed_over"), cluster.addresses)
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    expected = model.predict(x, verbose=0)
    save = tf_dlt.Client.save
    tries: list[str] = []

    def failing_over_once(self: tf_dlt.Client, path: str, **kwargs: object) -> object:
        tries.append(str(kwargs["save_id"]))
        if len(tries) == 1:
            raise errors.FailedOverError("shard 0 Save: ... its standby took over ...")
        return save(self, path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tf_dlt.Client, "save", failing_over_once)
    info = tf_dlt.save(model, str(tmp_path / "ck"))
    monkeypatch.undo()
    assert len(tries) == 2 and tries[0] != tries[1] and info["save_id"] == tries[1]
    dense = [p.name for p in (tmp_path / "ck").glob("dense*.h5")]
    assert dense == [f"dense.{tries[1]}.weights.h5"]
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # moves everything on
    tf_dlt.load(model, str(tmp_path / "ck"))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)


def test_a_store_failing_to_answer_for_the_dense_weights_is_no_missing_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether a model save's dense weights are there was asked through
    fsspec's `exists`, which reads a store that fails to answer as "not
    there": a save stopped before its model file then read as no checkpoint
    at all (NotFoundError, and a trainer starts afresh). The store's failure
    is raised."""
    from fsspec.implementations.memory import MemoryFileSystem

    from tf_dlt.checkpoint import chain

    class FailingStore(MemoryFileSystem):  # type: ignore[misc]
        def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    fs = FailingStore(skip_instance_cache=True)
    monkeypatch.setattr(manifest, "filesystem", lambda path: (fs, "/failing/model"))
    tables = {"save_id": manifest.new_save_id(), "tables": []}
    with pytest.raises(ConnectionResetError, match="Connection reset"):
        chain.read_model("memory://failing/model", tables)
