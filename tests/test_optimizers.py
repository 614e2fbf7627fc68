"""Server-side optimizers against TensorFlow's own apply kernels.

The oracle for each update_method is the TF kernel on a tf.Variable holding
the same initial rows, fed the gradients of each push with repeated ids summed
first (tf.math.unsorted_segment_sum), since the shards sum them before the
update. Values and slots must agree to 1e-6 after several pushes with a
changing learning rate.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dlt import _native
from tf_dlt.table_config import TableConfig

DIM = 6
STEPS = 5
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _export(table: Any) -> dict[int, tuple[np.ndarray, np.ndarray, int]]:
    rows: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}
    exporter = table.exporter()
    while (chunk := exporter.next(1000)) is not None:
        ids, values, slots, steps, _, _ = chunk
        for k, i in enumerate(ids):
            rows[int(i)] = (values[k], slots[k], int(steps[k]))
    return rows


def _pushes(seed: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for step in range(STEPS):
        ids = rng.integers(0, 40, size=64).astype(np.int64)  # many repeats
        grads = rng.normal(0, 1, size=(64, DIM)).astype(np.float32)
        out.append((ids, grads, 0.05 + 0.02 * step))
    return out


def _summed(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    unique, inverse = np.unique(ids, return_inverse=True)
    summed = tf.math.unsorted_segment_sum(grads, inverse, len(unique)).numpy()
    return unique, summed


def _table(optimizer: dict[str, Any]) -> tuple[Any, np.ndarray]:
    config = TableConfig.create("t", DIM, "normal", optimizer, seed=3).to_dict()
    table = _native.Table(config)
    initial = table.pull(np.arange(40, dtype=np.int64))  # creates rows 0..39
    return table, initial


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "ftrl"])
def test_sparse_optimizers_match_tf_kernels(optimizer: str) -> None:
    opt = {
        "sgd": {"kind": "sgd"},
        "adagrad": {"kind": "adagrad", "initial_accumulator": 0.1, "epsilon": 1e-7},
        "ftrl": {
            "kind": "ftrl",
            "learning_rate_power": -0.5,
            "l1": 0.01,
            "l2": 0.02,
            "initial_accumulator": 0.1,
        },
    }[optimizer]
    table, initial = _table(opt)
    var = tf.Variable(initial)
    accum = tf.Variable(np.full_like(initial, opt.get("initial_accumulator", 0.0)))
    linear = tf.Variable(np.zeros_like(initial))
    for ids, grads, lr in _pushes(1):
        table.push(ids, grads, lr)
        unique, summed = _summed(ids, grads)
        if optimizer == "sgd":
            tf.raw_ops.ResourceSparseApplyProximalGradientDescent(
                var=var.handle, alpha=lr, l1=0.0, l2=0.0, grad=summed, indices=unique
            )
        elif optimizer == "adagrad":
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=var.handle, accum=accum.handle, lr=lr, epsilon=1e-7, grad=summed,
                indices=unique,
            )  # fmt: skip
        else:
            tf.raw_ops.ResourceSparseApplyFtrl(
                var=var.handle, accum=accum.handle, linear=linear.handle, grad=summed,
                indices=unique, lr=lr, l1=0.01, l2=0.02, lr_power=-0.5,
            )  # fmt: skip
    rows = _export(table)
    got = np.stack([rows[i][0] for i in range(40)])
    np.testing.assert_allclose(got, var.numpy(), **TOL)
    if optimizer in ("adagrad", "ftrl"):
        np.testing.assert_allclose(
            np.stack([rows[i][1][:DIM] for i in range(40)]), accum.numpy(), **TOL
        )
    if optimizer == "ftrl":
        np.testing.assert_allclose(
            np.stack([rows[i][1][DIM:] for i in range(40)]), linear.numpy(), **TOL
        )


def _tf_adam(var: Any, m: Any, v: Any, t: int, lr: float, grad: np.ndarray) -> None:
    """TF's ResourceApplyAdam at step t (beta**t in float32 from the float32
    beta, as Keras takes it), default betas and epsilon."""
    tf.raw_ops.ResourceApplyAdam(
        var=var.handle, m=m.handle, v=v.handle,
        beta1_power=np.power(np.float32(0.9), np.float32(t)),
        beta2_power=np.power(np.float32(0.999), np.float32(t)),
        lr=np.float32(lr), beta1=np.float32(0.9), beta2=np.float32(0.999),
        epsilon=np.float32(1e-7), grad=grad,
    )  # fmt: skip


def test_adam_matches_tf_kernel_with_per_row_steps() -> None:
    opt = {"kind": "adam", "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-7}
    table, initial = _table(opt)
    values = initial.copy()
    m = np.zeros_like(values)
    v = np.zeros_like(values)
    steps = np.zeros(40, np.int64)
    for ids, grads, lr in _pushes(2):
        table.push(ids, grads, lr)
        unique, summed = _summed(ids, grads)
        steps[unique] += 1
        # Rows touched the same number of times share one bias correction;
        # beta**t is taken in float32 from the float32 beta, as Keras does.
        for t in np.unique(steps[unique]):
            rows = unique[steps[unique] == t]
            g = summed[steps[unique] == t]
            var, mv, vv = tf.Variable(values[rows]), tf.Variable(m[rows]), tf.Variable(v[rows])
            _tf_adam(var, mv, vv, int(t), lr, g)
            values[rows], m[rows], v[rows] = var.numpy(), mv.numpy(), vv.numpy()
    rows = _export(table)
    np.testing.assert_allclose(np.stack([rows[i][0] for i in range(40)]), values, **TOL)
    np.testing.assert_allclose(np.stack([rows[i][1][:DIM] for i in range(40)]), m, **TOL)
    np.testing.assert_allclose(np.stack([rows[i][1][DIM:] for i in range(40)]), v, **TOL)
    assert [rows[i][2] for i in range(40)] == list(steps)


def test_push_creates_unseen_rows_from_their_initial_value() -> None:
    table, _ = _table({"kind": "sgd"})
    fresh = np.array([1000, 1001], np.int64)
    initial = table.pull(fresh, mode=1)  # inference: not inserted
    assert table.size() == 40
    table.push(fresh, np.ones((2, DIM), np.float32), 0.5)
    np.testing.assert_allclose(table.pull(fresh), initial - 0.5, **TOL)


def test_keras_adagrad_matches_keras_on_sparse_gradients_with_repeated_ids() -> None:
    """The oracle is keras.optimizers.Adagrad applying the same pushes as
    tf.IndexedSlices (repeated ids and all): each occurrence's square goes
    into the accumulator, and the update divides by sqrt(acc + epsilon)."""
    import keras

    opt = {"kind": "keras_adagrad", "initial_accumulator": 0.1, "epsilon": 1e-7}
    table, initial = _table(opt)
    var = keras.Variable(initial)
    keras_opt = keras.optimizers.Adagrad(1.0, initial_accumulator_value=0.1, epsilon=1e-7)
    repeated = 0
    for ids, grads, lr in _pushes(3):
        repeated += len(ids) - len(np.unique(ids))
        table.push(ids, grads, lr)
        keras_opt.learning_rate = lr
        slices = tf.IndexedSlices(tf.constant(grads), tf.constant(ids), tf.constant(initial.shape))
        keras_opt.apply_gradients([(slices, var)])
    assert repeated > 0  # the case where Keras' arithmetic differs from TF's kernel
    rows = _export(table)
    np.testing.assert_allclose(np.stack([rows[i][0] for i in range(40)]), var.numpy(), **TOL)
    accumulator = keras_opt.variables[-1].numpy()
    np.testing.assert_allclose(np.stack([rows[i][1] for i in range(40)]), accumulator, **TOL)


def _every_row_pushes(seed: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """Pushes touching every row (and some twice), so a lazy update is the
    dense one Keras applies."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(STEPS):
        ids = np.concatenate([np.arange(40), rng.integers(0, 40, size=24)]).astype(np.int64)
        grads = rng.normal(0, 1, size=(64, DIM)).astype(np.float32)
        out.append((ids, grads, 0.05 + 0.02 * step))
    return out


@pytest.mark.parametrize(
    "make, table_optimizer",
    [
        (lambda: keras.optimizers.SGD(momentum=0.9), {"kind": "momentum", "momentum": 0.9}),
        (lambda: keras.optimizers.SGD(momentum=0.8, nesterov=True),
         {"kind": "momentum", "momentum": 0.8, "nesterov": 1.0}),
        (lambda: keras.optimizers.SGD(weight_decay=0.1), {"kind": "sgd", "weight_decay": 0.1}),
        (lambda: keras.optimizers.Adagrad(weight_decay=0.1),
         {"kind": "keras_adagrad", "initial_accumulator": 0.1, "weight_decay": 0.1}),
    ],
    ids=["momentum", "nesterov", "sgd_decay", "adagrad_decay"],
)  # fmt: skip
def test_momentum_and_weight_decay_match_keras_on_rows_touched_every_push(
    make: Any, table_optimizer: dict[str, Any]
) -> None:
    """The oracle is the Keras optimizer applying each push to a variable
    (its summed gradient; Adagrad's as tf.IndexedSlices, whose repeated ids
    it squares one by one): momentum, Nesterov and the decoupled weight
    decay as Keras computes them, learning rate changing each push."""
    table, initial = _table(table_optimizer)
    var = keras.Variable(initial)
    keras_opt = make()
    for ids, grads, lr in _every_row_pushes(4):
        table.push(ids, grads, lr)
        unique, summed = _summed(ids, grads)
        gradient: Any = np.zeros_like(initial)
        gradient[unique] = summed
        if isinstance(keras_opt, keras.optimizers.Adagrad):
            gradient = tf.IndexedSlices(tf.constant(grads), tf.constant(ids), initial.shape)
        keras_opt.learning_rate = lr
        keras_opt.apply_gradients([(gradient, var)])
    rows = _export(table)
    np.testing.assert_allclose(np.stack([rows[i][0] for i in range(40)]), var.numpy(), **TOL)
    slots = [v.numpy() for v in keras_opt.variables[2:]]  # after iterations, learning_rate
    for k, slot in enumerate(slots):
        got = np.stack([rows[i][1][k * DIM : (k + 1) * DIM] for i in range(40)])
        np.testing.assert_allclose(got, slot, **TOL)


def test_adamw_is_keras_weight_decay_then_the_tf_adam_kernel() -> None:
    """AdamW on rows touched every push: Keras's decoupled decay
    (`w - w * wd * lr`, computed as Keras computes it) and then TF's
    ResourceApplyAdam, the kernel the table's Adam is held to. (Keras's own
    Adam differs from that kernel by float32 rounding, ~1e-5 relative after
    a few steps, whether or not it decays.)"""
    decay = 0.05
    table, initial = _table({"kind": "adam", "weight_decay": decay})
    var = tf.Variable(initial)
    m, v = tf.Variable(np.zeros_like(initial)), tf.Variable(np.zeros_like(initial))
    for t, (ids, grads, lr) in enumerate(_every_row_pushes(5), start=1):
        table.push(ids, grads, lr)
        unique, summed = _summed(ids, grads)
        dense = np.zeros_like(initial)
        dense[unique] = summed
        var.assign(var - var * np.float32(decay) * np.float32(lr))
        _tf_adam(var, m, v, t, lr, dense)
    rows = _export(table)
    np.testing.assert_allclose(np.stack([rows[i][0] for i in range(40)]), var.numpy(), **TOL)
    np.testing.assert_allclose(np.stack([rows[i][1][:DIM] for i in range(40)]), m.numpy(), **TOL)
    np.testing.assert_allclose(np.stack([rows[i][1][DIM:] for i in range(40)]), v.numpy(), **TOL)
