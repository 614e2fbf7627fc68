"""Server-side optimizers of distributed tables (the "update_method").

Shards apply them to the rows a push touches, with the same arithmetic as
TensorFlow's sparse apply kernels. Repeated ids in one push are summed first.
The learning rate travels with every push, so client-side schedules work; the
hyper-parameters below are fixed when the table is created.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tf_dlt import _spec


@dataclasses.dataclass(frozen=True)
class Optimizer(_spec.Spec):
    """Base class of optimizers."""


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """Plain SGD: ``w -= lr * g``."""

    kind = "sgd"


@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """Adagrad as ``ResourceSparseApplyAdagradV2``.

    ``acc += g^2; w -= lr * g / (sqrt(acc) + epsilon)``.

    Args:
        initial_accumulator: starting accumulator value, >= 0.
        epsilon: added to the denominator, >= 0.
    """

    kind = "adagrad"
    initial_accumulator: float = 0.1
    epsilon: float = 1e-7


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """Adam as ``ResourceApplyAdam`` on each touched row, with a per-row step.

    A row's step count grows by one each time a push touches it, and its bias
    correction uses that count ("lazy" Adam, as sparse Adam variants do).

    Args:
        beta1: decay of the first moment, in [0, 1).
        beta2: decay of the second moment, in [0, 1).
        epsilon: added to the denominator, > 0.
    """

    kind = "adam"
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-7


@dataclasses.dataclass(frozen=True)
class Ftrl(Optimizer):
    """FTRL-Proximal as ``ResourceSparseApplyFtrl``.

    Args:
        learning_rate_power: <= 0; -0.5 is the usual choice.
        l1: L1 regularization strength, >= 0.
        l2: L2 regularization strength, >= 0.
        initial_accumulator: starting accumulator value, > 0.
    """

    kind = "ftrl"
    learning_rate_power: float = -0.5
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator: float = 0.1


@dataclasses.dataclass(frozen=True)
class KerasAdagrad(Optimizer):
    """Adagrad with the arithmetic of ``keras.optimizers.Adagrad`` on sparse
    gradients (what a table follows when the model is compiled with Keras'
    Adagrad): the accumulator takes the square of each occurrence of an id
    in a push, not of their sum, and ``w -= lr * g / sqrt(acc + epsilon)``.

    Args:
        initial_accumulator: starting accumulator value, >= 0.
        epsilon: added under the square root, >= 0.
    """

    kind = "keras_adagrad"
    initial_accumulator: float = 0.1
    epsilon: float = 1e-7


_BY_NAME: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adagrad": Adagrad,
    "adam": Adam,
    "ftrl": Ftrl,
    "keras_adagrad": KerasAdagrad,
}

OptimizerLike = str | Optimizer | dict[str, Any]


def get(identifier: OptimizerLike) -> Optimizer:
    """Returns an optimizer from a name, an instance or a `to_dict()` dict."""
    return _spec.resolve(identifier, Optimizer, _BY_NAME, "optimizer")
