"""tf_dlt.DenseOnShards: dense weights trained in a shard table. With SGD on
the table a single trainer matches Keras SGD step for step; a second trainer
starts from the chief's weights; a table of another model is refused."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest

import tf_dlt
from tf_dlt import errors

from conftest import Cluster


def _model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6,))
    hidden = keras.layers.Dense(5, activation="tanh")(inp)
    return keras.Model(inp, keras.layers.Dense(1)(hidden))


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.normal(size=(160, 6)).astype("float32"), rng.normal(size=(160, 1)).astype("float32")


@pytest.mark.parametrize("num_shards", [0, 2])
def test_sgd_on_the_table_matches_keras_sgd(
    start_cluster: Callable[..., Cluster], num_shards: int
) -> None:
    pservers = start_cluster(num_shards).addresses if num_shards else []
    shared, local = _model(0), _model(0)
    shared.compile(
        optimizer=tf_dlt.DenseOnShards(pservers, "sgd", 0.05, table=f"dense_sgd{num_shards}"),
        loss="mse",
    )
    local.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = _data()
    h1 = shared.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    h2 = local.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], rtol=1e-5)
    for a, b in zip(shared.get_weights(), local.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(
    "option",
    [
        {"global_clipnorm": 1e-3},
        {"clipnorm": 1.0},
        {"clipvalue": 1e-3},
        {"loss_scale_factor": 1000.0},
        {"use_ema": True},
        {"gradient_accumulation_steps": 2},
    ],
)
def test_keras_options_the_dense_table_would_not_apply_are_refused(option: dict) -> None:
    """They were taken and never applied (a step moved a weight 200.0
    where Keras SGD with global_clipnorm=1e-3 moved it 0.0007; a loss
    scale of 1000 was not undone)."""
    with pytest.raises(ValueError, match=f"DenseOnShards: {next(iter(option))} is not applied"):
        tf_dlt.DenseOnShards([], "sgd", 1.0, table="dense_options", **option)
    tf_dlt.DenseOnShards([], "sgd", 1.0, table="dense_options", gradient_accumulation_steps=None)


def test_second_trainer_starts_from_the_chiefs_weights(
    start_cluster: Callable[..., Cluster],
) -> None:
    pservers = start_cluster(2).addresses
    chief, other = _model(1), _model(2)  # different initial weights
    x, y = _data()
    chief.compile(optimizer=tf_dlt.DenseOnShards(pservers, "adam", 0.01), loss="mse")
    chief.fit(x, y, batch_size=16, epochs=1, verbose=0)
    spec = tf_dlt.ClusterSpec(pservers, ["a:1", "b:1"], "worker", 1)
    other.compile(optimizer=tf_dlt.DenseOnShards(spec, "adam", 0.01), loss="mse")
    other.optimizer.build(other.trainable_variables)
    for a, b in zip(chief.get_weights(), other.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # A chief that restarts reads the table instead of overwriting it.
    again = _model(3)
    again.compile(optimizer=tf_dlt.DenseOnShards(pservers, "adam", 0.01), loss="mse")
    again.optimizer.build(again.trainable_variables)
    np.testing.assert_allclose(again.get_weights()[0], chief.get_weights()[0], atol=1e-6)


def test_another_models_table_is_refused_and_a_missing_chief_times_out() -> None:
    first = _model(0)
    first.compile(optimizer=tf_dlt.DenseOnShards([], table="dense_layout"), loss="mse")
    first.optimizer.build(first.trainable_variables)
    inp = keras.Input((7,))
    other = keras.Model(inp, keras.layers.Dense(1)(inp))
    other.compile(optimizer=tf_dlt.DenseOnShards([], table="dense_layout"), loss="mse")
    with pytest.raises(errors.FailedPreconditionError, match="another model's weights"):
        other.optimizer.build(other.trainable_variables)
    # As many variables and floats, of other shapes: the error names the
    # sizes (it showed the equal count and total alone).
    inp = keras.Input((8,))
    alike = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(4)(inp)))
    alike.compile(optimizer=tf_dlt.DenseOnShards([], table="dense_layout"), loss="mse")
    with pytest.raises(
        errors.FailedPreconditionError,
        match=r"sized \[30, 5, 5, 1\]; this model: .* sized \[32, 4, 4, 1\]",
    ):
        alike.optimizer.build(alike.trainable_variables)
    waiting = tf_dlt.DenseOnShards([], table="dense_nobody", is_chief=False, start_timeout=0.5)
    with pytest.raises(errors.DeadlineExceededError, match="the chief wrote no initial weights"):
        waiting.build(_model(0).trainable_variables)


def test_a_model_built_afresh_resumes_from_a_dense_table_checkpoint(tmp_path: Path) -> None:
    """Resuming in a new process: the model built afresh, compiled with
    DenseOnShards and loaded. The load refused it ("the checkpoint holds
    tables ['dense_resume'] that the model has no layer for": the optimizer
    names its table only once built), and the dense weights it would have
    loaded were the saving trainer's own copy, not the table's newer ones.
    Now it loads, and the model holds the table's weights."""
    model = _model(5)
    model.compile(optimizer=tf_dlt.DenseOnShards([], "adam", 0.01, table="dense_resume"),
                  loss="mse")  # fmt: skip
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    saved = model.predict(x, verbose=0)
    tf_dlt.save(model, str(tmp_path / "ck"))
    # Another trainer's push after this one's last step: the table moved on.
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    newest = model.predict(x, verbose=0)
    tf_dlt.save(model, str(tmp_path / "ck2"))
    model.set_weights([w * 0 for w in model.get_weights()])  # this trainer's own copy, stale
    tf_dlt.save(model, str(tmp_path / "ck2-own-copy-stale"))
    fresh = _model(6)  # built afresh, never trained
    fresh.compile(optimizer=tf_dlt.DenseOnShards([], "adam", 0.01, table="dense_resume"),
                  loss="mse")  # fmt: skip
    tf_dlt.load(fresh, str(tmp_path / "ck"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), saved, atol=1e-6)
    tf_dlt.load(fresh, str(tmp_path / "ck2-own-copy-stale"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), newest, atol=1e-6)


def test_save_and_load_include_the_dense_table(tmp_path: Path) -> None:
    model = _model(5)
    model.compile(optimizer=tf_dlt.DenseOnShards([], "adam", 0.01, table="dense_ck"), loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    saved = model.predict(x, verbose=0)
    tf_dlt.save(model, str(tmp_path / "ck"))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert not np.allclose(model.predict(x, verbose=0), saved)
    tf_dlt.load(model, str(tmp_path / "ck"))
    np.testing.assert_allclose(model.predict(x, verbose=0), saved, atol=1e-6)
    # The table was restored too: a step that changes nothing (learning rate
    # 0) pulls the table's weights into the model, and they are the saved ones.
    model.optimizer.learning_rate = 0.0
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    np.testing.assert_allclose(model.predict(x, verbose=0), saved, atol=1e-6)


_IN_A_NEW_PROCESS = """
import sys, numpy as np, keras, tf_dlt
d, how = sys.argv[1], sys.argv[2]
x, y = np.load(d + "/x.npy"), np.load(d + "/y.npy")
keras.utils.set_random_seed(123)
if how == "load_model":  # then a step at learning rate 0
    m = keras.models.load_model(d + "/m.keras")
    m.optimizer.learning_rate.assign(0.0)
    m.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
elif how == "load_model_and_save":  # no step
    m = keras.models.load_model(d + "/m.keras")
    tf_dlt.save(m, d + "/saved")
else:  # built afresh, tf_dlt.load, then the step the saving process took next
    inp = keras.Input((6,))
    m = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(5, activation="tanh")(inp)))
    m.compile(optimizer=tf_dlt.DenseOnShards([], "adam", 0.01, table="dense_file"), loss="mse")
    tf_dlt.load(m, d + "/ck")
    m.fit(x[:16], y[:16], batch_size=16, epochs=1, shuffle=False, verbose=0)
np.save(d + "/after.npy", m.predict(x, verbose=0))
"""


def test_a_chief_in_a_new_process_trains_on_from_the_weights_it_loaded(tmp_path: Path) -> None:
    """keras.models.load_model builds the optimizer as it compiles, before
    it sets the file's weights: the chief wrote the model's fresh random
    weights into the new dense table then, and its first step read them
    back over the file's (at learning rate 0, the trained model became an
    untrained one, without a word), as a tf_dlt.save before any step
    saved them. A tf_dlt.load into a model built afresh resumes with the
    table's Adam state (a first fix rewrote the loaded rows, slots reset)."""
    model = _model(7)
    model.compile(optimizer=tf_dlt.DenseOnShards([], "adam", 0.01, table="dense_file"),
                  loss="mse")  # fmt: skip
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    tf_dlt.save(model, str(tmp_path / "ck"))
    trained = model.predict(x, verbose=0)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)

    def in_a_new_process(how: str) -> np.ndarray:
        out = subprocess.run(
            [sys.executable, "-c", _IN_A_NEW_PROCESS, str(tmp_path), how], capture_output=True,
            text=True, timeout=300, cwd="/",
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return np.asarray(np.load(tmp_path / "after.npy"))

    np.testing.assert_allclose(in_a_new_process("load_model"), trained, atol=1e-6)
    in_a_new_process("load_model_and_save")
    resumed = in_a_new_process("tf_dlt.load")
    model.fit(x[:16], y[:16], batch_size=16, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(resumed, model.predict(x, verbose=0), atol=1e-6)
    tf_dlt.load(model, str(tmp_path / "saved"))  # what the process that saved at once saved
    np.testing.assert_allclose(model.predict(x, verbose=0), trained, atol=1e-6)


def test_a_layer_frozen_between_fits_stays_as_it_is_and_the_others_train_as_with_keras() -> None:
    """Fine-tuning: a layer frozen after a fit, the model compiled again
    with its optimizer. The next fit failed with a bare ValueError ("zip()
    argument 2 is longer than argument 1"). The frozen layer's rows are now
    read and never pushed, and the rest trains as Keras SGD trains it."""
    x, y = _data()
    models = {"shared": _model(8), "local": _model(8)}
    optimizers = {
        "shared": tf_dlt.DenseOnShards([], "sgd", 0.05, table="dense_frozen"),
        "local": keras.optimizers.SGD(0.05),
    }
    losses = {}
    for name, model in models.items():
        model.compile(optimizer=optimizers[name], loss="mse")
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.layers[1].trainable = False  # the hidden Dense
        frozen = model.layers[1].get_weights()
        model.compile(optimizer=model.optimizer, loss="mse")
        history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        losses[name] = history.history["loss"]
        for a, b in zip(model.layers[1].get_weights(), frozen, strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(losses["shared"], losses["local"], rtol=1e-5)
    for a, b in zip(models["shared"].get_weights(), models["local"].get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # Unfrozen again: the optimizer has its rows (laid out at build).
    models["shared"].layers[1].trainable = True
    models["shared"].compile(optimizer=models["shared"].optimizer, loss="mse")
    models["shared"].fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_weights_set_before_the_first_step_reach_the_table_however_the_chief_gets_there(
    tmp_path: Path,
) -> None:
    """A chief's weights set between its build and its first step (a
    .keras load, set_weights) reach the table also where the model was
    compiled again with a new DenseOnShards first (the new one read the
    build's weights back over them) or a tf_dlt.save came between (the
    save ended the watch). A tf_dlt.save before the optimizer was built
    saved no dense table, and its load was refused."""
    x, y = _data()
    wanted = _model(11).get_weights()

    def chief(table: str) -> keras.Model:
        model = _model(10)
        model.compile(optimizer=tf_dlt.DenseOnShards([], "sgd", 0.0, table=table), loss="mse")
        model.optimizer.build(model.trainable_variables)  # as load_model builds it
        return model

    def trains_on_wanted(model: keras.Model) -> None:
        model.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)  # learning rate 0
        for a, b in zip(model.get_weights(), wanted, strict=True):
            np.testing.assert_array_equal(a, b)

    again = chief("dense_again")
    again.set_weights(wanted)
    again.compile(optimizer=tf_dlt.DenseOnShards([], "sgd", 0.0, table="dense_again"), loss="mse")
    trains_on_wanted(again)
    saved_first = chief("dense_saved_first")
    tf_dlt.save(saved_first, str(tmp_path / "first"))
    saved_first.set_weights(wanted)
    trains_on_wanted(saved_first)
    unbuilt = _model(12)
    unbuilt.compile(optimizer=tf_dlt.DenseOnShards([], "adam", 0.01, table="dense_unbuilt"),
                    loss="mse")  # fmt: skip
    tf_dlt.save(unbuilt, str(tmp_path / "unbuilt"))
    fresh = _model(13)
    fresh.compile(optimizer=tf_dlt.DenseOnShards([], "adam", 0.01, table="dense_unbuilt"),
                  loss="mse")  # fmt: skip
    tf_dlt.load(fresh, str(tmp_path / "unbuilt"))
    np.testing.assert_allclose(fresh.predict(x, verbose=0), unbuilt.predict(x, verbose=0),
                               atol=1e-6)  # fmt: skip
