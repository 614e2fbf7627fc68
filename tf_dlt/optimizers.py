"""Server-side optimizers of distributed tables (the "update_method").

Shards apply them to the rows a push touches, with the same arithmetic as
TensorFlow's sparse apply kernels (Keras's for `KerasAdagrad` and
`Momentum`). Repeated ids in one push are summed first. The learning rate
travels with every push, so client-side schedules work; the
hyper-parameters below are fixed when the table is created.

Every optimizer takes `weight_decay` (keyword only): Keras's decoupled weight
decay (`AdamW`, or any Keras optimizer's `weight_decay`), applied to a row
when a push touches it, before the update: ``w -= w * weight_decay * lr``.
Like the lazy Adam, it is lazy: a row no push touches is not decayed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tf_dlt import _spec, errors


@dataclasses.dataclass(frozen=True)
class Optimizer(_spec.Spec):
    """Base class of optimizers."""

    weight_decay: float = dataclasses.field(default=0.0, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if not d["weight_decay"]:
            del d["weight_decay"]  # the default: configs without it stay as they were
        return d


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


@dataclasses.dataclass(frozen=True)
class Momentum(Optimizer):
    """SGD with momentum as ``keras.optimizers.SGD(momentum=, nesterov=)``,
    on each touched row (lazy, as `Adam`): ``v = momentum * v - lr * g``;
    ``w += v``, or with Nesterov ``w += momentum * v - lr * g``. The
    velocity holds the learning rate, as Keras's does.

    Args:
        momentum: in [0, 1].
        nesterov: Nesterov momentum.
    """

    kind = "momentum"
    momentum: float = 0.9
    nesterov: bool = False

    def __post_init__(self) -> None:
        if self.nesterov not in (0, 1):  # True, False, 1.0, 0.0
            raise errors.InvalidArgumentError(
                f"nesterov must be a bool (or 0 / 1), got {self.nesterov!r}"
            )
        object.__setattr__(self, "nesterov", bool(self.nesterov))

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["nesterov"] = 1.0 if self.nesterov else 0.0
        return d


_BY_NAME: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adagrad": Adagrad,
    "adam": Adam,
    "ftrl": Ftrl,
    "keras_adagrad": KerasAdagrad,
    "momentum": Momentum,
}

OptimizerLike = str | Optimizer | dict[str, Any]


def get(identifier: OptimizerLike) -> Optimizer:
    """Returns an optimizer from a name, an instance or a `to_dict()` dict."""
    return _spec.resolve(identifier, Optimizer, _BY_NAME, "optimizer")
