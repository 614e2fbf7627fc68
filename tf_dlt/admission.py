"""Feature admission: which ids get a row in a distributed table.

Most ids of recommender traffic are seen once or twice and never again;
admission keeps them out of memory. An id without a row reads the table's
``unadmitted`` default ("zeros" or its "initial" value) and stores nothing;
once admitted, its row starts from its initial value.

- `All()`: every id gets a row on first use (the default).
- `Frequency(min_count)`: an id gets a row on the push that makes it pushed
  `min_count` times. Pushes are counted in a count-min sketch (4 rows of
  8-bit counters, conservative update, per routing bucket, halved after as
  many pushes as a row has counters) of `sketch_bytes` for the whole table;
  each shard holds the part of its buckets. A count is never
  under-estimated; docs/memory.md gives the over-estimate bound and how to
  size the sketch.
- `Probability(p)`: a pure function of (table seed, id) admits a fraction
  `p` of ids, on first use, identically on every shard and after restarts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tf_dlt import errors

# Default sketch memory of Frequency admission, for the whole table.
DEFAULT_SKETCH_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Admission:
    """Base class of admission policies."""

    kind = ""

    def policy_fields(self) -> dict[str, Any]:
        """This policy's fields of a table config's "policy" dict."""
        return {"admission": self.kind}


@dataclasses.dataclass(frozen=True)
class All(Admission):
    """Every id gets a row on first use."""

    kind = "all"


@dataclasses.dataclass(frozen=True)
class Frequency(Admission):
    """An id gets a row once it has been pushed `min_count` times.

    Args:
        min_count: pushes (each push counts an id once) before the row is
            made, 1..255.
        sketch_bytes: memory of the counting sketch for the whole table,
            at least 128 KiB; each shard holds its buckets' share.
    """

    kind = "frequency"
    min_count: int = 2
    sketch_bytes: int = DEFAULT_SKETCH_BYTES

    def __post_init__(self) -> None:
        _check_int("min_count", self.min_count, 1, 255)
        _check_int("sketch_bytes", self.sketch_bytes, 4096 * 4 * 8, 1 << 40)

    def policy_fields(self) -> dict[str, Any]:
        return {
            "admission": self.kind,
            "min_count": self.min_count,
            "sketch_bytes": self.sketch_bytes,
        }


@dataclasses.dataclass(frozen=True)
class Probability(Admission):
    """A fraction `p` of ids, chosen by a pure function of (seed, id).

    Args:
        p: the fraction of ids admitted, in (0, 1].
    """

    kind = "probability"
    p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise errors.InvalidArgumentError(f"Probability p must be in (0, 1], got {self.p!r}")

    def policy_fields(self) -> dict[str, Any]:
        return {"admission": self.kind, "probability": float(self.p)}


AdmissionLike = Admission | str | dict[str, Any] | None


def get(identifier: AdmissionLike) -> Admission:
    """An admission policy from an instance, None / "all", or the dict of
    `to_config`."""
    if identifier is None:
        return All()
    if isinstance(identifier, Admission):
        return identifier
    if isinstance(identifier, str) and identifier == "all":
        return All()
    if isinstance(identifier, dict) and identifier.get("kind") in _BY_KIND:
        cls = _BY_KIND[identifier["kind"]]
        fields = {k: v for k, v in identifier.items() if k != "kind"}
        known = {f.name for f in dataclasses.fields(cls)}
        if set(fields) <= known:
            return cls(**fields)
    raise errors.InvalidArgumentError(
        f"admission must be None, 'all', tf_dlt.admission.Frequency(min_count) or "
        f"tf_dlt.admission.Probability(p), got {identifier!r}"
    )


def to_config(admission: Admission) -> dict[str, Any]:
    """A JSON-friendly form that `get` reads back (for Keras configs)."""
    return {"kind": admission.kind, **dataclasses.asdict(admission)}


_BY_KIND: dict[str, type[Admission]] = {
    "all": All,
    "frequency": Frequency,
    "probability": Probability,
}


def from_policy(policy: dict[str, Any]) -> Admission:
    """The admission policy of a table config's "policy" dict."""
    kind = policy.get("admission") or "all"
    if kind == "frequency":
        return Frequency(int(policy["min_count"]), int(policy["sketch_bytes"]))
    if kind == "probability":
        return Probability(float(policy["probability"]))
    if kind == "all":
        return All()
    raise errors.InvalidArgumentError(f"unknown admission {kind!r}")


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise errors.InvalidArgumentError(
            f"{name} must be an int in [{low}, {high}], got {value!r}"
        )
