"""Row initializers of distributed tables.

A row's initial value is a pure function of (table seed, id), computed on the
shard with a counter-based generator: it does not depend on shard count,
insertion order or process. ``get("uniform")`` or an instance selects one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tf_dlt import errors


@dataclasses.dataclass(frozen=True)
class Initializer:
    """Base class; `kind` names the initializer on the wire."""

    kind = "zeros"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


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
    if isinstance(identifier, Initializer):
        return identifier
    if isinstance(identifier, dict):
        fields = dict(identifier)
        kind = fields.pop("kind", None)
        cls = _BY_NAME.get(str(kind))
        if cls is None:
            raise errors.InvalidArgumentError(
                f"unknown initializer kind {kind!r}; expected one of {sorted(_BY_NAME)}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: float(v) for k, v in fields.items() if k in names})
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]()
    raise errors.InvalidArgumentError(
        f"unknown initializer {identifier!r}; expected one of {sorted(_BY_NAME)} "
        "or a tf_dlt.initializers instance"
    )
