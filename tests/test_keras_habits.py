"""What Keras users habitually do, beyond the documented path: save with
`model.save("m.keras")` and load in a fresh process after `import tf_dlt`
alone, compile before or after transpiling, rebuild models in one process
(notebooks, `keras.backend.clear_session()`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dlt
from tf_dlt import embedded, errors
from tf_dlt.layers import Embedding

from conftest import Cluster

DIM = 4


def _model(name: str, *, initializer: str = "uniform", optimizer: str | None = None) -> keras.Model:
    ids = keras.Input((3,), dtype="int64")
    emb = Embedding(
        output_dim=DIM, is_distributed=True, embeddings_initializer=initializer,
        optimizer=optimizer, learning_rate=0.1 if optimizer else None, name=name,
    )  # fmt: skip
    out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(emb(ids)))
    return keras.Model(ids, out)


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 50, (256, 3))
    return x, (x[:, 0] % 2).astype("float32")


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> None:
    """Runs `code` in a fresh Python process (outside the checkout)."""
    subprocess.run(
        [sys.executable, "-c", code, *args], check=True, timeout=300, cwd="/",
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
    )  # fmt: skip


_LOAD_AND_PREDICT = """
import sys
{imports}
import numpy as np
model = keras.models.load_model(sys.argv[1])
np.save(sys.argv[3], model.predict(np.load(sys.argv[2]), verbose=0))
if len(sys.argv) > 4:  # training goes on from the file's rows and optimizer state
    rows = tf_dlt.embedded.rows("{table}")
    np.save(sys.argv[4], np.concatenate([rows[1], rows[2]], axis=1))
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import tf_dlt\nimport keras",
        "import keras\nimport tf_dlt",
        "import tf_dlt\nimport tensorflow\nimport keras",  # TF probes for keras first
    ],
    ids=["tf_dlt_first", "keras_first", "tensorflow_between"],
)
def test_a_keras_file_of_an_embedded_model_carries_its_rows(imports: str, tmp_path: Path) -> None:
    """model.save(".keras") + keras.models.load_model in a fresh process
    after `import tf_dlt` (before or after keras): the same predictions, and
    the rows come back with their optimizer slots (Adagrad accumulators)."""
    table = f"habit_saved_{len(imports)}"
    model = _model(table)
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    x, y = _data()
    model.fit(x, y, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    np.save(tmp_path / "x.npy", x[:16])
    code = _LOAD_AND_PREDICT.format(imports=imports, table=table)
    _run(code, str(tmp_path / "m.keras"), str(tmp_path / "x.npy"), str(tmp_path / "p.npy"),
         str(tmp_path / "rows.npy"))  # fmt: skip
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), model.predict(x[:16], verbose=0))
    _, values, slots, _ = embedded.rows(table)
    saved = np.concatenate([values, slots], axis=1)
    np.testing.assert_array_equal(np.load(tmp_path / "rows.npy"), saved)


def test_keras_savedmodel_exports_of_embedded_tables_are_refused(tmp_path: Path) -> None:
    """`model.export()` and `tf.saved_model.save(model)` of a model on the
    embedded tables wrote a SavedModel that failed only when served: it looks
    its rows up in the serving process's embedded tables, which hold none.
    Both are refused, naming the export that carries the rows, which works."""
    model = _model("habit_export")
    model.compile(optimizer="adam", loss="binary_crossentropy")
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    for export in (model.export, lambda path: tf.saved_model.save(model, path)):
        with pytest.raises(ValueError, match="mode='standalone'"):
            export(str(tmp_path / "refused"))
    tf_dlt.export_saved_model(model, str(tmp_path / "standalone"), mode="standalone")
    loaded = tf.saved_model.load(str(tmp_path / "standalone"))
    served = loaded.serve(tf.constant(x[:8]))
    np.testing.assert_allclose(served, model.predict(x[:8], verbose=0), atol=1e-6)


def test_a_keras_file_reloaded_in_process_trains_on_with_the_same_state(tmp_path: Path) -> None:
    model = _model("habit_reloaded")
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    before = embedded.rows("habit_reloaded")
    model.fit(x, y, epochs=1, verbose=0)  # moves the rows on
    loaded = keras.models.load_model(tmp_path / "m.keras")  # puts the saved rows back
    for saved, now in zip(before, embedded.rows("habit_reloaded"), strict=True):
        np.testing.assert_array_equal(saved, now)
    loaded.fit(x, y, epochs=1, verbose=0)  # the saved Adagrad state, settled again
    assert embedded.table("habit_reloaded").config["optimizer"]["kind"] == "keras_adagrad"


_TRAIN_ANOTHER = """
import sys
import keras, numpy as np, tf_dlt
if len(sys.argv) > 4:  # fine-tunes a copy of a saved model
    model = keras.models.load_model(sys.argv[4])
else:
    ids = keras.Input((3,), dtype="int64")
    emb = tf_dlt.layers.Embedding(
        output_dim=4, is_distributed=True, embeddings_initializer="uniform", name=sys.argv[2])
    model = keras.Model(
        ids, keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(emb(ids))))
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
x = np.random.default_rng(int(sys.argv[3])).integers(0, 50, (256, 3))
model.fit(x, (x[:, 1] % 2).astype("float32"), epochs=2, verbose=0)
model.save(sys.argv[1])
"""


def _same_rows(table: str, rows: tuple[np.ndarray, ...]) -> None:
    for before, now in zip(rows, embedded.rows(table), strict=True):
        np.testing.assert_array_equal(before, now)


def test_a_keras_file_of_another_models_table_never_replaces_a_live_models_rows(
    tmp_path: Path,
) -> None:
    """Two models whose layers Keras named alike (here both named so; by
    default both "embedding"), trained in different processes: loading one's
    .keras file where the other is alive and trained replaced the other's
    rows with no word (a later tf_dlt.save of it saved the file's rows). It
    is refused, nothing changed; an older file of the live model itself
    still puts its own rows back, as documented. Two copies of one saved
    model fine-tuned apart are two models too; after clear_session the
    live model's table is given up (as Keras sessions do) and the file
    loads."""
    table = "habit_same_name"
    _run(_TRAIN_ANOTHER, str(tmp_path / "other.keras"), table, "1")
    model = _model(table)
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "own.keras")
    saved = embedded.rows(table)
    model.fit(x, y, epochs=1, verbose=0)
    trained = embedded.rows(table)
    with pytest.raises(ValueError, match="holds the rows of another model's embedded table"):
        keras.models.load_model(tmp_path / "other.keras")
    _same_rows(table, trained)
    keras.models.load_model(tmp_path / "own.keras")
    _same_rows(table, saved)
    # Forks: two processes fine-tune copies of own.keras; here, in a new
    # Keras session (the models of the one before give their table up).
    for fork, seed in (("a", "2"), ("b", "3")):
        _run(_TRAIN_ANOTHER, str(tmp_path / f"{fork}.keras"), table, seed,
             str(tmp_path / "own.keras"))  # fmt: skip
    keras.backend.clear_session()
    fork_a = keras.models.load_model(tmp_path / "a.keras")
    rows_a = embedded.rows(table)
    with pytest.raises(ValueError, match="holds the rows of another model's embedded table"):
        keras.models.load_model(tmp_path / "b.keras")
    _same_rows(table, rows_a)
    keras.models.load_model(tmp_path / "own.keras")  # the line a.keras came from: its own
    _same_rows(table, saved)
    keras.backend.clear_session()
    other = keras.models.load_model(tmp_path / "other.keras")
    assert not np.array_equal(embedded.rows(table)[1], saved[1])
    del fork_a, other


_SHARED_TABLE_MODEL = """
import keras, tf_dlt
def shared():
    ids = keras.Input((3,), dtype="int64")
    first, second = (
        tf_dlt.layers.Embedding(output_dim=4, is_distributed=True,
                                embeddings_initializer="uniform", table_name="habit_shared",
                                name=name)
        for name in ("habit_first", "habit_second")
    )
    joined = keras.layers.Concatenate()([first(ids), second(ids)])
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(joined)))
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
    return model
"""


def test_layers_sharing_a_table_load_a_file_of_another_line_into_their_own_model(
    tmp_path: Path,
) -> None:
    """Two layers of one model sharing a table (table_name=) are not two
    models: the model trained here loads a file of another process's run
    into itself (its other layer was taken for another model's, and the
    load refused); and a model resumed with tf_dlt.load (whose checkpoints
    keep no lineage) takes its run's .keras file (refused as another
    model's)."""
    scope: dict[str, Any] = {}
    exec(_SHARED_TABLE_MODEL, scope)
    shared = scope["shared"]
    x, y = _data()
    model = shared()
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "run.keras")
    tf_dlt.save(model, str(tmp_path / "ck"))
    saved = embedded.rows("habit_shared")
    code = _SHARED_TABLE_MODEL + (
        "import sys, numpy as np\n"
        "m = shared()\n"
        "x = np.random.default_rng(5).integers(0, 50, (256, 3))\n"
        "m.fit(x, np.ones((256, 1), 'float32'), epochs=1, verbose=0)\n"
        "m.save(sys.argv[1])\n"
    )
    _run(code, str(tmp_path / "elsewhere.keras"))
    model.fit(x, y, epochs=1, verbose=0)
    model.load_weights(tmp_path / "elsewhere.keras")  # another run's, into itself
    assert not np.array_equal(embedded.rows("habit_shared")[1], saved[1])
    keras.backend.clear_session()
    resumed = shared()
    tf_dlt.load(resumed, str(tmp_path / "ck"))
    _same_rows("habit_shared", saved)
    keras.models.load_model(tmp_path / "run.keras")
    _same_rows("habit_shared", saved)
    # Saved once resumed, its table's line begins again: the other run's
    # file is another model's now.
    resumed.fit(x, y, epochs=1, verbose=0)
    resumed.save(tmp_path / "resumed.keras")
    trained = embedded.rows("habit_shared")
    with pytest.raises(ValueError, match="holds the rows of another model's embedded table"):
        keras.models.load_model(tmp_path / "elsewhere.keras")
    _same_rows("habit_shared", trained)


def test_a_keras_file_of_a_model_on_shards_predicts_where_the_shards_are(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """The file holds the layer's config with the shard addresses (never a
    token) and the dense weights; loaded in a fresh process it reads the
    rows on the shards."""
    cluster = start_cluster(2, token="habit-token")
    model = _model("habit_remote")
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    model = tf_dlt.transpile(model, cluster.addresses, auth_token=cluster.token)
    x, y = _data()
    model.fit(x, y, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    assert b"habit-token" not in (tmp_path / "m.keras").read_bytes()
    np.save(tmp_path / "x.npy", x[:16])
    token_file = tmp_path / "token"
    token_file.write_text(cluster.token)
    expected = model.predict(x[:16], verbose=0)
    code = _LOAD_AND_PREDICT.format(imports="import tf_dlt, keras", table="habit_remote")
    code += "model.fit(np.load(sys.argv[2]), np.ones(16), verbose=0)\n"  # trains on, same table
    code += "import os\n"
    code += "assert model.get_layer('habit_remote').client.pservers == (\n"
    code += "    os.environ['TF_DLT_PSERVERS'].split(','))\n"
    # The file names dead addresses; TF_DLT_PSERVERS re-points the loaded model.
    with zipfile.ZipFile(tmp_path / "m.keras") as original:
        files = {n: original.read(n) for n in original.namelist()}
    dead = ["127.0.0.1:1", "127.0.0.1:2"]
    config = files["config.json"].decode()
    assert all(address in config for address in cluster.addresses)  # where the rows are
    for live, gone in zip(cluster.addresses, dead, strict=True):
        config = config.replace(live, gone)
    files["config.json"] = config.encode()
    with zipfile.ZipFile(tmp_path / "moved.keras", "w") as moved:
        for n, data in files.items():
            moved.writestr(n, data)
    _run(code, str(tmp_path / "moved.keras"), str(tmp_path / "x.npy"), str(tmp_path / "p.npy"),
         env={"TF_DLT_AUTH_TOKEN_FILE": str(token_file),
              "TF_DLT_PSERVERS": ",".join(cluster.addresses)})  # fmt: skip
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), expected)
    assert not np.allclose(model.predict(x[:16], verbose=0), expected)  # its pushes landed
    # An older weights file sets the dense weights back, not the shards' rows.
    model.save_weights(tmp_path / "w.weights.h5")
    model.fit(x, y, epochs=1, verbose=0)
    with pytest.warns(UserWarning, match="rows of its table 'habit_remote' stay as trained last"):
        model.load_weights(tmp_path / "w.weights.h5")


def test_a_trained_keras_file_refuses_to_train_on_shards_that_lost_its_table(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """The shards were started again without --load-from: a loaded model
    whose layer follows the compiled optimizer made its table afresh in
    fit and trained from initial rows under the trained dense weights,
    without a word (one naming its optimizer, or predict, met NotFound).
    fit refuses now, and makes nothing."""
    cluster = start_cluster(2)
    model = _model("habit_lost")
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    model = tf_dlt.transpile(model, cluster.addresses)
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    model.save(tmp_path / "m.keras")
    tf_dlt.save(model, str(tmp_path / "ck"))
    expected = model.predict(x[:16], verbose=0)
    admin = tf_dlt.Client(cluster.addresses)
    admin.drop_table("habit_lost")  # as shards started again, empty
    loaded = keras.models.load_model(tmp_path / "m.keras")
    with pytest.raises(tf_dlt.errors.NotFoundError, match="do not have it"):
        loaded.fit(x, y, epochs=1, verbose=0)
    with pytest.raises(tf_dlt.errors.NotFoundError, match="do not have it"):
        tf_dlt.save(loaded, str(tmp_path / "empty"))  # a table made afresh, saved
    # resilient_fit took the refusal for a shard restarted empty and made
    # the table afresh (untrained, SGD); a load that failed made it too.
    with pytest.raises(tf_dlt.errors.NotFoundError, match="do not have it"):
        tf_dlt.resilient_fit(loaded, x, y, epochs=1, verbose=0, checkpoint=str(tmp_path / "rf"))
    other = tf_dlt.transpile(_model("habit_other"), cluster.addresses)
    other.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    other.fit(x, y, epochs=1, verbose=0)
    tf_dlt.save(other, str(tmp_path / "other"))
    with pytest.raises(tf_dlt.errors.FailedPreconditionError, match="no layer for"):
        tf_dlt.load(loaded, str(tmp_path / "other"))
    with pytest.raises(tf_dlt.errors.NotFoundError, match="do not have it"):
        loaded.fit(x, y, epochs=1, verbose=0)
    assert "habit_lost" not in admin.list_tables()
    # Its checkpoint loaded, training goes on from its rows.
    tf_dlt.load(loaded, str(tmp_path / "ck"))
    np.testing.assert_allclose(loaded.predict(x[:16], verbose=0), expected)
    loaded.fit(x, y, epochs=1, verbose=0)
    admin.drop_table("habit_lost")
    # A new model of the same layer trains afresh, as the error says.
    fresh = tf_dlt.transpile(_model("habit_lost"), cluster.addresses)
    fresh.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    fresh.fit(x, y, epochs=1, verbose=0)
    assert "habit_lost" in admin.list_tables()


def test_an_embedded_keras_file_refuses_a_layer_on_shards_rather_than_differ(
    tmp_path: Path,
) -> None:
    model = _model("habit_no_rows")
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    model.save(tmp_path / "m.keras")
    layer = model.get_layer("habit_no_rows")
    store: dict[str, np.ndarray] = {}
    layer.save_own_variables(store)
    assert {"table_ids", "table_values", "table_config"} <= set(store)
    del store["table_ids"], store["table_values"], store["table_slots"], store["table_steps"]
    del store["table_config"]
    with pytest.raises(errors.FailedPreconditionError, match="holds none"):
        layer.load_own_variables(store)


def test_an_embedded_keras_file_of_another_table_config_changes_nothing(tmp_path: Path) -> None:
    """A weights file whose embedded table was saved with another config
    (here its initializer) is refused before the layer's weights or rows
    change, and without the warning that weights were set back."""
    model = _model("habit_other_config")
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    layer = model.get_layer("habit_other_config")
    saved: dict[str, Any] = {}
    layer.save_own_variables(saved)  # Keras stores its variables themselves
    store = {key: np.array(value) for key, value in saved.items()}
    config = json.loads(bytes(store["table_config"]).decode())
    config["initializer"] = {"kind": "zeros"}
    store["table_config"] = np.frombuffer(json.dumps(config).encode(), np.uint8)
    model.fit(x, y, epochs=1, verbose=0)
    weights = [w.numpy() for w in layer.weights]
    rows = embedded.rows("habit_other_config")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(errors.FailedPreconditionError, match="saved with another config"):
            layer.load_own_variables(store)
    for before, now in zip(weights, layer.weights, strict=True):
        np.testing.assert_array_equal(before, now.numpy())
    for before, now in zip(rows, embedded.rows("habit_other_config"), strict=True):
        np.testing.assert_array_equal(before, now)


@pytest.mark.parametrize("order", ["compile_then_transpile", "transpile_then_compile"])
def test_both_compile_orders_train_on_shards_with_the_compiled_optimizer(
    order: str, start_cluster: Callable[..., Cluster]
) -> None:
    cluster = start_cluster(2)
    model = _model("habit_order")

    def compile_args() -> dict[str, object]:
        return {"optimizer": keras.optimizers.Adagrad(0.5), "loss": "binary_crossentropy"}

    if order == "compile_then_transpile":
        model.compile(**compile_args())
        model = tf_dlt.transpile(model, cluster.addresses)
    else:
        model = tf_dlt.transpile(model, cluster.addresses)
        with cluster.client() as client:
            info = client.list_tables()["habit_order"]
            assert info["config"].optimizer.kind == "sgd"  # until the optimizer is known
        model.compile(**compile_args())
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    with cluster.client() as client:
        assert client.list_tables()["habit_order"]["config"].optimizer.kind == "keras_adagrad"
    # A second trainer doing the same agrees; one compiled otherwise is refused.
    again = tf_dlt.transpile(_model("habit_order"), cluster.addresses)
    again.compile(**compile_args())
    again.fit(x, y, epochs=1, verbose=0)
    other = tf_dlt.transpile(_model("habit_order"), cluster.addresses)
    other.compile(optimizer="adam", loss="binary_crossentropy")
    with pytest.raises(errors.FailedPreconditionError, match="was trained with keras_adagrad"):
        other.fit(x, y, epochs=1, verbose=0)


def test_racing_creates_of_a_provisional_table_agree(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2)
    config = tf_dlt.TableConfig.create("habit_race", DIM, "zeros", "sgd", 0)
    adagrad = tf_dlt.TableConfig.create("habit_race", DIM, "zeros", "adagrad", 0)
    adam = tf_dlt.TableConfig.create("habit_race", DIM, "zeros", "adam", 0)
    with cluster.client() as first, cluster.client() as second:
        first.create_table_from_config(config, provisional=True)
        first.assign("habit_race", np.arange(10), np.ones((10, DIM), np.float32))
        second.create_table_from_config(adam, provisional=True)  # takes it as it is
        assert first.list_tables()["habit_race"]["config"].optimizer.kind == "sgd"
        first.create_table_from_config(adagrad)  # settles it, rows kept
        with pytest.raises(errors.AlreadyExistsError, match="adagrad.*cannot create.*adam"):
            second.create_table_from_config(adam)
        second.create_table_from_config(adagrad)  # agrees
        info = first.list_tables()["habit_race"]
        assert info["config"].optimizer.kind == "adagrad" and info["rows"] == 10
        np.testing.assert_array_equal(
            first.pull("habit_race", np.arange(10), training=False), np.ones((10, DIM))
        )


def test_a_multi_trainer_compile_config_round_trips() -> None:
    """DenseOnShards sits in the compile config: it is registered, and a
    model compiled with it saves and loads its compile config."""
    optimizer = tf_dlt.DenseOnShards(["127.0.0.1:1"], "adagrad", 0.01, table="habit_dense")
    again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(again, tf_dlt.DenseOnShards)
    assert again.pservers == ["127.0.0.1:1"] and again.table_config == optimizer.table_config


def test_after_clear_session_a_new_layer_of_the_same_name_gets_a_fresh_table() -> None:
    """Notebook habits: rebuilding after keras.backend.clear_session() with
    another initializer or optimizer gets a fresh table; with the same
    config it reuses the old rows; in one session a different config is an
    error naming the table, both configs and what to do."""
    x, y = _data()
    first = _model("habit_notebook", initializer="zeros")
    first.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    first.fit(x, y, epochs=1, verbose=0)
    trained = embedded.rows("habit_notebook")[1]
    refused = "habit_notebook.*clear_session.*drop_table"
    with pytest.raises(errors.AlreadyExistsError, match=refused):
        _model("habit_notebook", initializer="ones")
    keras.backend.clear_session()
    same = _model("habit_notebook", initializer="zeros")  # same config: the rows stay
    np.testing.assert_array_equal(embedded.rows("habit_notebook")[1], trained)
    same.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    same.fit(x, y, epochs=1, verbose=0)  # another optimizer: a fresh table
    assert embedded.table("habit_notebook").config["optimizer"]["kind"] == "adam"
    keras.backend.clear_session()
    other = _model("habit_notebook", initializer="ones")  # another initializer: fresh
    other.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    other.predict(x[:4], verbose=0)
    assert embedded.table("habit_notebook").size() == 0
    other.fit(x, y, epochs=1, verbose=0)
    assert embedded.table("habit_notebook").config["optimizer"]["kind"] == "keras_adagrad"


def _sequential(name: str, with_input: bool) -> keras.Sequential:
    layers = [
        Embedding(output_dim=DIM, is_distributed=True, name=name),
        keras.layers.Flatten(),
        keras.layers.Dense(1, activation="sigmoid"),
    ]
    if with_input:
        layers.insert(0, keras.Input((3,), dtype="int64"))
    return keras.Sequential(layers)


@pytest.mark.parametrize("with_input", [True, False], ids=["input", "no_input"])
def test_sequential_models_with_and_without_an_input_train_on_both_homes(
    with_input: bool, start_cluster: Callable[..., Cluster]
) -> None:
    cluster = start_cluster(2)
    x, y = _data()
    name = f"habit_seq_{int(with_input)}"
    local = _sequential(name, with_input)
    local.compile(optimizer="adagrad", loss="binary_crossentropy")
    local.fit(x, y, batch_size=32, epochs=1, verbose=0)
    unbuilt = _sequential(name + "_remote", with_input)
    unbuilt.compile(optimizer="adagrad", loss="binary_crossentropy")
    for model in (tf_dlt.transpile(local, cluster.addresses),
                  tf_dlt.transpile(unbuilt, cluster.addresses)):  # fmt: skip
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        assert model.evaluate(x, y, verbose=0) > 0
    remote = tf_dlt.transpile(local, cluster.addresses)
    np.testing.assert_allclose(
        remote.predict(x[:8], verbose=0), local.predict(x[:8], verbose=0), atol=1e-6
    )


def test_a_hot_row_cache_belongs_to_its_model(start_cluster: Callable[..., Cluster]) -> None:
    """A cache lives in the model's own client: a later model of the same
    shards in the process keeps pulling ahead (it once found the cache of
    the first and silently pulled nothing ahead)."""
    cluster = start_cluster(2)
    x, y = _data()
    cached = tf_dlt.transpile(_model("habit_cached"), cluster.addresses)
    cached.compile(optimizer="adagrad", loss="binary_crossentropy")
    tf_dlt.hot_row_cache(cached, rows=1000)
    cached.fit(x, y, batch_size=32, epochs=1, verbose=0)
    layer = cached.get_layer("habit_cached")
    assert tf_dlt.ops.client_stats(layer.client)["cache_hits"] > 0
    later = tf_dlt.transpile(_model("habit_cached"), cluster.addresses)
    later.compile(optimizer="adagrad", loss="binary_crossentropy")
    tf_dlt.pull_ahead(later)
    later.fit(x, y, batch_size=32, epochs=1, verbose=0)
    stats = tf_dlt.ops.client_stats(later.get_layer("habit_cached").client)
    assert stats["pulls_ahead_used"] == len(x) // 32 and stats["cache_hits"] == 0


def test_a_gpu_scope_on_a_machine_without_one_runs_the_ops_on_the_cpu() -> None:
    """On a GPU machine the ops (CPU kernels only) are placed on the CPU;
    here, without a GPU, a GPU scope must fall back as cleanly."""
    assert not tf.config.list_physical_devices("GPU")
    x, y = _data()
    with tf.device("/GPU:0"):
        model = _model("habit_gpu")
        model.compile(optimizer="adagrad", loss="binary_crossentropy")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        rows = model.get_layer("habit_gpu")(tf.constant(x[:4]))
    assert rows.device.endswith("CPU:0")
    assert embedded.table("habit_gpu").size() > 0


def test_model_summary_shows_what_a_distributed_table_is() -> None:
    model = _model("habit_summary")
    lines: list[str] = []
    model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
    assert "2 + table dim" in "".join(lines)  # the cell wraps
    layer = model.get_layer("habit_summary")
    assert f"{layer.count_params():,}" == "2 + table dim 4, embedded"  # as summary formats it
    assert int(layer.count_params()) == 2  # Keras's totals count the weights


def test_a_keras_file_saved_before_training_still_takes_the_compiled_optimizer(
    tmp_path: Path,
) -> None:
    model = _model("habit_untrained")
    model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="binary_crossentropy")
    model.save(tmp_path / "m.keras")  # its table is still provisional (SGD)
    loaded = keras.models.load_model(tmp_path / "m.keras")
    loaded.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    x, y = _data()
    loaded.fit(x, y, epochs=1, verbose=0)
    assert embedded.table("habit_untrained").config["optimizer"]["kind"] == "adam"


def test_a_table_taken_from_an_earlier_session_is_kept_once_this_session_trained_it() -> None:
    """Fresh-after-clear_session applies to the first settle only: once this
    session trained the table, another optimizer is refused, never a silent
    empty table. A fresh table gets the layer's `weights=` again."""
    x, y = _data()
    weights = np.full((50, DIM), 7.0, np.float32)

    def model(optimizer: keras.optimizers.Optimizer) -> keras.Model:
        ids = keras.Input((3,), dtype="int64")
        emb = Embedding(50, DIM, is_distributed=True, weights=weights, name="habit_kept")
        out = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Flatten()(emb(ids)))
        built = keras.Model(ids, out)
        built.compile(optimizer=optimizer, loss="binary_crossentropy")
        return built

    model(keras.optimizers.SGD(0.1)).fit(x, y, epochs=1, verbose=0)
    keras.backend.clear_session()
    fresh = model(keras.optimizers.SGD(0.1, momentum=0.9))  # another optimizer: fresh table
    fresh.fit(x[:1], y[:1], batch_size=1, epochs=1, verbose=0)
    _, values, _, steps = embedded.rows("habit_kept")
    assert steps.sum() == 3 and np.sum(np.abs(values - 7.0) < 0.5) >= len(values) - 3
    fresh.fit(x, y, epochs=1, verbose=0)
    fresh.compile(optimizer=keras.optimizers.Adam(), loss="binary_crossentropy")
    with pytest.raises(errors.FailedPreconditionError, match="was trained with momentum"):
        fresh.fit(x, y, epochs=1, verbose=0)
    # The same kind with other hyperparameters is named by them (it said
    # "trained with momentum; compiled for momentum: give optimizer='momentum'").
    fresh.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="binary_crossentropy")
    with pytest.raises(errors.FailedPreconditionError) as same_kind:
        fresh.fit(x, y, epochs=1, verbose=0)
    assert "trained with Momentum(weight_decay=0.0, momentum=0.9," in same_kind.value.message
    assert "compiled for Momentum(weight_decay=0.0, momentum=0.5," in same_kind.value.message
    assert "optimizer=tf_dlt.optimizers.Momentum(weight_decay=0.0, momentum=0.9," in (
        same_kind.value.message
    )
    assert embedded.rows("habit_kept")[3].sum() > 3  # still the trained table


def test_a_table_refused_for_another_field_than_its_optimizer_names_that_field() -> None:
    """A table whose optimizer is the one asked for (Adam: its floats held
    at float32, 0.9 as 0.8999999761581421) refused for another field (its
    seed): the refusal named the same optimizer twice, and not the field."""
    from tf_dlt import dlt_ops as ops
    from tf_dlt import initializers, optimizers
    from tf_dlt.layers import table_home

    def config(seed: int) -> tf_dlt.TableConfig:
        return tf_dlt.TableConfig.create(
            "habit_seeded", 8, initializers.Zeros(), optimizers.get("adam"), seed
        )

    embedded.create_table(config(0))
    with pytest.raises(errors.FailedPreconditionError) as refused:
        table_home.settle("emb", config(7), ops.ClientResource([]), fresh=False, trained=False)
    assert "exists with another config" in refused.value.message
    assert "seed: 0 vs 7" in refused.value.message


def test_a_conflicting_layer_in_another_thread_of_the_session_is_refused() -> None:
    _model("habit_threads", initializer="zeros")
    failures: list[BaseException] = []

    def build() -> None:
        try:
            _model("habit_threads", initializer="ones")
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            failures.append(e)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert len(failures) == 1 and isinstance(failures[0], errors.AlreadyExistsError)


class SubclassedModel(keras.Model):  # type: ignore[misc]
    """A subclassed model whose call() takes no `training` (Keras then
    passes none to its layers)."""

    def __init__(self, name: str, passes_training: bool) -> None:
        super().__init__()
        self.emb = Embedding(output_dim=DIM, is_distributed=True, name=name, seed=3, sync_push=True)
        self.head = keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones")
        self.passes_training = passes_training

    def call(self, ids: tf.Tensor, **kwargs: object) -> tf.Tensor:
        rows = self.emb(ids, **kwargs) if self.passes_training else self.emb(ids)
        return self.head(keras.ops.sum(rows, axis=1))


def test_a_subclassed_model_without_a_training_argument_trains_as_one_that_has_it() -> None:
    """Keras passes no `training` to the layers of a subclassed model whose
    call() takes none: the layer looked rows up for inference (absent ids
    read zeros) and its push failed (`'NoneType' object has no attribute
    'learning_rate'`). A lookup under fit's gradient tape now trains, so
    the model trains exactly as one that passes `training` through, and
    predict still reads for inference."""
    x, y = _data()
    states = []
    for passes in (True, False):
        model = SubclassedModel(f"habit_sub_{int(passes)}", passes)
        model.compile(optimizer="adagrad", loss="binary_crossentropy")
        losses = model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False).history["loss"]
        ids, values, slots, _ = embedded.rows(model.emb.table_name)
        order = np.argsort(ids)
        states.append((losses, ids[order], values[order], slots[order]))
        rows = len(ids)
        model.predict(np.full((4, 3), 10_000), verbose=0)  # unseen ids: no rows made
        assert len(embedded.rows(model.emb.table_name)[0]) == rows
    for got, want in zip(states[1], states[0], strict=True):
        np.testing.assert_array_equal(got, want)


def test_rows_looked_up_for_inference_refuse_a_gradient_clearly() -> None:
    layer = Embedding(input_dim=100, output_dim=DIM, is_distributed=True, name="habit_inference",
                      optimizer="sgd", learning_rate=0.1)  # fmt: skip
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([[1, 2]], tf.int64), training=False))
    grads = tape.gradient(loss, layer.trainable_variables)  # traced (a SavedModel's save does)
    pairs = list(zip(grads, layer.trainable_variables, strict=True))
    with pytest.raises(ValueError, match="looked up with training=False"):
        keras.optimizers.SGD(0.1).apply_gradients(pairs)


def test_restoring_best_weights_warns_that_the_rows_stay_as_trained_last(tmp_path: Path) -> None:
    # EarlyStopping(restore_best_weights=True) sets the model's Keras weights
    # back to its best epoch's; a distributed layer's rows are not among them.
    model = _model("habit_best")
    model.compile(optimizer="adam", loss="binary_crossentropy")
    x, y = _data()
    # The first epoch is "best" (mode max on a falling loss): the restore
    # sets the weights back one epoch.
    stop = keras.callbacks.EarlyStopping(
        monitor="loss", mode="max", patience=1, restore_best_weights=True
    )
    with pytest.warns(UserWarning, match="rows of its table 'habit_best' stay as trained last"):
        model.fit(x, y, epochs=4, verbose=0, callbacks=[stop])
    assert stop.best_epoch == 0 and stop.stopped_epoch > 0
    # Nothing to warn of where the rows are set back with the weights: a
    # tf_dlt.load of an earlier checkpoint, an older weights file holding an
    # embedded table's rows, a restore to the same step.
    tf_dlt.save(model, str(tmp_path / "ck"))
    model.save_weights(tmp_path / "w.weights.h5")
    model.fit(x, y, epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tf_dlt.load(model, str(tmp_path / "ck"))
        model.fit(x, y, epochs=1, verbose=0)
        model.load_weights(tmp_path / "w.weights.h5")
        model.set_weights(model.get_weights())


@pytest.mark.parametrize("where", ["embedded", "remote, pulled ahead"])
def test_a_layer_called_on_two_inputs_trains_with_both_calls_gradients(
    where: str, start_cluster: Callable[..., Cluster]
) -> None:
    """One layer called on two inputs (two towers sharing a table, history
    and target item) gets the sum of both calls' gradients, as a Keras
    variable used twice does. The last call's rows alone were pushed: the
    other call's gradients were lost without a word (0.024 off Keras after
    one SGD step, and equal to a Keras model whose first call was
    stop_gradient'ed)."""
    vocab, dim = 10, 4
    start = np.arange(vocab * dim, dtype=np.float32).reshape(vocab, dim) / 40.0 - 0.5
    rng = np.random.default_rng(0)
    x = (rng.integers(0, vocab, (8, 3)), rng.integers(0, vocab, (8, 3)))
    y = rng.random((8, 1)).astype(np.float32)
    table = f"habit_two_calls_{where.split(',')[0]}"

    def trained(layer: keras.layers.Layer, remote: bool = False) -> keras.Model:
        a, b = keras.Input((3,), dtype="int64"), keras.Input((3,), dtype="int64")
        h = keras.layers.Concatenate()(
            [keras.layers.Flatten()(layer(a)), keras.layers.Flatten()(layer(b))]
        )
        head = keras.layers.Dense(1, kernel_initializer="ones", trainable=False)
        model = keras.Model([a, b], head(h))
        model.compile(keras.optimizers.SGD(0.01), "mse")
        if remote:
            model = tf_dlt.pull_ahead(tf_dlt.transpile(model, start_cluster(1).addresses))
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        return model

    oracle = keras.layers.Embedding(vocab, dim, weights=[start])
    trained(oracle)
    ours = Embedding(
        vocab, dim, is_distributed=True, weights=start, table_name=table, sync_push=True
    )
    model = trained(ours, remote=where != "embedded")
    if where == "embedded":
        ids, values, _, _ = embedded.rows(table)
    else:
        layer = next(m for m in model.layers if isinstance(m, Embedding))
        assert layer.client is not None
        ids = np.arange(vocab, dtype=np.int64)
        values = tf_dlt.Client(layer.client.pservers).pull(table, ids, training=False)
    np.testing.assert_allclose(values[np.argsort(ids)], np.asarray(oracle.embeddings), atol=1e-6)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_float_ids_under_mixed_precision_read_their_own_rows(policy: str) -> None:
    """A keras.Input's default float32 ids under a mixed precision policy:
    Keras cast them to the compute dtype before the layer saw them (its own
    Embedding turns that off), so bfloat16 id 257 read row 256 and 1000 was
    refused as "bfloat16 ids"; float16 id 2049 read row 2048. Each reads
    its own row, as in keras.layers.Embedding, and leaves in the compute
    dtype."""
    bits = ((np.arange(3000)[:, None] >> np.arange(12)) & 1).astype(np.float32)  # row k: k's bits
    ids = keras.Input((1,))
    layer = Embedding(3000, 12, is_distributed=True, weights=bits, dtype=policy,
                      table_name=f"habit_{policy}")  # fmt: skip
    out = keras.Model(ids, layer(ids))(np.array([[257], [1000], [2049]], np.float32))
    assert out.dtype == keras.mixed_precision.Policy(policy).compute_dtype
    read = (np.asarray(out, np.float32)[:, 0].round() * 2 ** np.arange(12)).sum(axis=1)
    assert read.tolist() == [257, 1000, 2049]


def test_a_frozen_layer_lets_the_head_train_with_any_optimizer(tmp_path: Path) -> None:
    """Fine-tuning the head only (the layer's trainable=False): the table
    followed the compiled optimizer all the same, so RMSprop or clipnorm
    were refused, and a table trained with Adagrad refused a recompile
    with Adam (offering to drop the table). A frozen layer pushes nothing:
    the head trains, and the rows stay as they were."""
    x = np.random.default_rng(0).integers(0, 10, (8, 3))
    y = np.ones((8, 1), np.float32)
    ids = keras.Input((3,), dtype="int64")
    layer = Embedding(10, 4, is_distributed=True, table_name="habit_frozen")
    head = keras.layers.Dense(1)
    model = keras.Model(ids, head(keras.layers.Flatten()(layer(ids))))
    model.compile(keras.optimizers.Adagrad(0.1), "mse")
    model.fit(x, y, verbose=0)
    pretrained, kernel = embedded.rows("habit_frozen")[1], head.get_weights()[0]
    layer.trainable = False
    for optimizer in (keras.optimizers.Adam(0.01, clipnorm=1.0), keras.optimizers.RMSprop(0.01)):
        model.compile(optimizer, "mse")
        # (A ModelCheckpoint's save made the table follow it all the same.)
        model.fit(x, y, verbose=0, callbacks=[tf_dlt.ModelCheckpoint(str(tmp_path / "ck"))])
    np.testing.assert_array_equal(embedded.rows("habit_frozen")[1], pretrained)
    assert not np.array_equal(head.get_weights()[0], kernel)
    tf_dlt.load(model, str(tmp_path / "ck"))
    np.testing.assert_array_equal(embedded.rows("habit_frozen")[1], pretrained)


def test_a_layer_frozen_before_it_is_built_pushes_nothing(
    start_cluster: Callable[..., Cluster],
) -> None:
    """`Embedding(..., trainable=False)`, and the frozen layer transpile
    makes from its config: the anchor was made trainable after Keras froze
    the layer, stayed in the model's trainable weights, and every step
    pushed (the rows trained). It is frozen as add_weight freezes a
    variable; unfreezing (and recompiling) trains the table again."""
    start = np.arange(40, dtype=np.float32).reshape(10, 4) / 40.0
    x, y = np.random.default_rng(0).integers(0, 10, (8, 3)), np.ones((8, 1), np.float32)
    ids = keras.Input((3,), dtype="int64")
    layer = Embedding(10, 4, is_distributed=True, weights=start, trainable=False,
                      table_name="habit_frozen_ctor")  # fmt: skip
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    model.compile(keras.optimizers.Adagrad(0.1), "mse")
    assert not any(w is layer.anchor for w in model.trainable_weights)
    model.fit(x, y, verbose=0)
    table_ids, values, _, _ = embedded.rows("habit_frozen_ctor")
    np.testing.assert_array_equal(values[np.argsort(table_ids)], start)
    remote = tf_dlt.transpile(model, start_cluster(2).addresses)
    remote.compile(keras.optimizers.Adagrad(0.1), "mse")
    frozen = remote.get_layer(layer.name)
    assert not frozen.trainable

    def rows() -> np.ndarray:
        return np.asarray(frozen(np.arange(10)[:, None], training=False))[:, 0]

    np.testing.assert_array_equal(rows(), start)
    remote.fit(x, y, verbose=0)
    np.testing.assert_array_equal(rows(), start)
    frozen.trainable = True
    remote.compile(keras.optimizers.Adagrad(0.1), "mse")
    remote.fit(x, y, verbose=0)
    assert not np.array_equal(rows(), start)


def test_weights_reach_the_table_of_a_layer_a_subclassed_model_builds() -> None:
    """A subclassed model builds its layers in a scratch graph: the upload of
    `weights=` ran there, never executed, and the table held the
    initializer's rows without a word (0.54 off). They are the table's."""
    start = np.arange(40, dtype=np.float32).reshape(10, 4) / 40.0

    class Model(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.emb = Embedding(10, 4, is_distributed=True, weights=start,
                                 table_name="habit_subclassed")  # fmt: skip

        def call(self, ids: Any) -> Any:
            return self.emb(ids)

    Model()(np.array([[1, 2, 3]]))
    ids, values, _, _ = embedded.rows("habit_subclassed")
    np.testing.assert_array_equal(values[np.argsort(ids)], start)


def test_weights_never_replace_the_rows_a_live_model_trained() -> None:
    """A second model built with `weights=` (a cell run again, a model for
    evaluation) uploaded them over the table the first had trained, which
    it takes by its name: the first model's predictions changed without a
    word. The rows are kept, and the build says why weights= is not
    applied."""
    start = np.full((10, 4), 0.5, np.float32)

    def made() -> keras.Model:
        inp = keras.Input((3,), dtype="int64")
        emb = Embedding(10, 4, is_distributed=True, weights=start, name="habit_weights")
        model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
        model.compile(optimizer="sgd", loss="mse")
        return model

    x = np.random.default_rng(0).integers(0, 10, (64, 3))
    first = made()
    ids, values, _, _ = embedded.rows("habit_weights")
    np.testing.assert_array_equal(values[np.argsort(ids)], start)  # applied to a new table
    first.fit(x, np.ones((64, 1), "float32"), verbose=0, epochs=3)
    before = first.predict(x, verbose=0)
    trained = embedded.rows("habit_weights")[1]
    with pytest.warns(UserWarning, match="habit_weights.*rows are kept: weights= is not applied"):
        made()
    np.testing.assert_array_equal(embedded.rows("habit_weights")[1], trained)
    np.testing.assert_allclose(first.predict(x, verbose=0), before, atol=1e-6)


class TwoTowerModel(keras.Model):  # type: ignore[misc]
    """keras.io's "Customizing what happens in fit()": a train_step that
    calls a sub-model itself."""

    def __init__(self, name: str) -> None:
        super().__init__()
        ids = keras.Input((3,), dtype="int64")
        emb = Embedding(output_dim=4, is_distributed=True, name=name)
        self.tower = keras.Model(ids, keras.layers.Flatten()(emb(ids)), name="habit_tower")
        self.head = keras.layers.Dense(1)

    def call(self, x: Any, training: Any = None) -> Any:
        return self.head(self.tower(x, training=training))

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self.head(self.tower(x, training=True)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss}


def test_a_train_step_calling_a_sub_model_is_told_what_to_do_and_trains_so() -> None:
    """It was told "trains outside a compiled model: compile the model",
    of a compiled model. The error names the sub-model the call went
    through; compiled with the model's optimizer too, it trains."""
    x = np.random.default_rng(0).integers(0, 30, (32, 3))
    y = np.ones((32, 1), "float32")
    refused = TwoTowerModel("habit_tower_refused")
    refused.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    with pytest.raises(ValueError, match="model 'habit_tower', which is not compiled"):
        refused.fit(x, y, verbose=0, batch_size=8)
    model = TwoTowerModel("habit_tower_trained")
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    model.tower.compile(optimizer=model.optimizer)
    before = model.predict(x, verbose=0)
    model.fit(x, y, verbose=0, batch_size=8)
    assert int(model.tower.get_layer("habit_tower_trained").pushes.numpy()) == 4
    assert not np.allclose(model.predict(x, verbose=0), before)
