"""Row initializers of distributed tables.

A row's initial value is a pure function of (table seed, id), computed on the
shard with a counter-based generator: it does not depend on shard count,
insertion order or process. ``get("uniform")`` or an instance selects one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tf_dlt import _spec


@dataclasses.dataclass(frozen=True)
class Initializer(_spec.Spec):
    """Base class of initializers."""


@dataclasses.dataclass(frozen=True)
class Zeros(Initializer):
    """All values 0."""

    kind = "zeros"


@dataclasses.dataclass(frozen=True)
class Constant(Initializer):
    """All values `value`.

    Args:
        value: the value of every element.
    """

    kind = "constant"
    value: float = 0.0


@dataclasses.dataclass(frozen=True)
class RandomUniform(Initializer):
    """Uniform in [minval, maxval) (Keras' "uniform" default is +-0.05).

    Args:
        minval: lower bound, inclusive.
        maxval: upper bound, exclusive; must exceed `minval`.
    """

    kind = "uniform"
    minval: float = -0.05
    maxval: float = 0.05


@dataclasses.dataclass(frozen=True)
class RandomNormal(Initializer):
    """Normal with `mean` and `stddev`.

    Args:
        mean: mean of the distribution.
        stddev: standard deviation, > 0.
    """

    kind = "normal"
    mean: float = 0.0
    stddev: float = 0.05


@dataclasses.dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """Normal with values beyond 2 standard deviations redrawn.

    Args:
        mean: mean of the distribution.
        stddev: standard deviation before truncation, > 0.
    """

    kind = "truncated_normal"
    mean: float = 0.0
    stddev: float = 0.05


_BY_NAME: dict[str, type[Initializer]] = {
    "zeros": Zeros,
    "constant": Constant,
    "uniform": RandomUniform,
    "random_uniform": RandomUniform,
    "normal": RandomNormal,
    "random_normal": RandomNormal,
    "truncated_normal": TruncatedNormal,
}

InitializerLike = str | Initializer | dict[str, Any]


def get(identifier: InitializerLike) -> Initializer:
    """Returns an initializer from a name, an instance or a `to_dict()` dict."""
    return _spec.resolve(identifier, Initializer, _BY_NAME, "initializer")
