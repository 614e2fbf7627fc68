"""MemoryPolicy: how a table bounds its memory (docs/memory.md), in one
object: admission, what unadmitted ids read, expiry, a row bound with its
eviction, and 16-bit storage. It mirrors the native core's PolicyConfig and
the proto's, field for field; the names each field may take are the core's
(`_native.POLICY_CHOICES`), not copies.

`TableConfig`, `tf_dlt.Client.create_table` and `tf_dlt.layers.Embedding`
take one as ``memory=``; their flat keywords (``max_rows=``, ...) are a
shorthand for the same fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tf_dlt import _native, errors, expiry
from tf_dlt import admission as admission_lib

# The policy's fields, as MemoryPolicy and the flat keywords name them.
FIELDS = (
    "admission", "unadmitted", "ttl", "max_rows", "eviction", "value_dtype", "slot_dtype",
    "rounding",
)  # fmt: skip


def choices(field: str) -> tuple[str, ...]:
    """The names policy field `field` may take (the first is the default)."""
    return tuple(_native.POLICY_CHOICES[field])


def _choice(field: str, value: object) -> str:
    """`value` as the name of one of `field`'s choices; a dtype (TensorFlow's
    or NumPy's) by its name (tf.bfloat16 passed `in`, being equal to the
    string, and was kept as "<dtype: 'bfloat16'>", refused later)."""
    allowed = choices(field)
    name = value if isinstance(value, str) else getattr(value, "name", value)
    if not isinstance(name, str) or name not in allowed:
        raise errors.InvalidArgumentError(f"{field} must be one of {list(allowed)}, got {value!r}")
    return name


def as_float32(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(np.float32(v)) if isinstance(v, float) else v) for k, v in fields.items()}


@dataclasses.dataclass(frozen=True)
class MemoryPolicy:
    """How a table bounds its memory.

    Args:
        admission: which ids get a row (`tf_dlt.admission`; every id by
            default).
        unadmitted: what an id without a row reads: "zeros" or "initial"
            (its initial value).
        ttl: rows untouched for longer are removed (`tf_dlt.expiry.Pushes`
            or `tf_dlt.expiry.Seconds`); None keeps them.
        max_rows: rows per shard; past it the lowest-scoring rows are
            evicted (0: unbounded).
        eviction: "lfu" (fewest updates, then oldest) or "lru" (oldest).
        value_dtype: how values are stored: "float32", "bfloat16" or
            "float16" (always float32 on the wire and in TensorFlow).
        slot_dtype: how optimizer slots are stored, the same choices.
        rounding: how 16-bit updates round: "stochastic" (unbiased,
            deterministic per seed, id and update) or "nearest".
    """

    admission: admission_lib.Admission = dataclasses.field(default_factory=admission_lib.All)
    unadmitted: str = "zeros"
    ttl: expiry.Ttl | None = None
    max_rows: int = 0
    eviction: str = "lfu"
    value_dtype: str = "float32"
    slot_dtype: str = "float32"
    rounding: str = "stochastic"

    @classmethod
    def create(
        cls,
        admission: admission_lib.AdmissionLike = None,
        unadmitted: str = "zeros",
        ttl: expiry.Ttl | dict[str, Any] | None = None,
        max_rows: int = 0,
        eviction: str = "lfu",
        value_dtype: str = "float32",
        slot_dtype: str = "float32",
        rounding: str = "stochastic",
    ) -> MemoryPolicy:
        """Builds and checks a policy from names, objects or their configs;
        InvalidArgumentError names the first bad argument."""
        if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)):
            raise errors.InvalidArgumentError(f"max_rows must be an int >= 0, got {max_rows!r}")
        if max_rows != 0 and not 4096 <= max_rows <= 2**40:
            raise errors.InvalidArgumentError(
                f"max_rows must be 0 (unbounded) or in [4096, 2**40], got {max_rows!r}"
            )
        return cls(
            admission=admission_lib.get(admission),
            unadmitted=_choice("unadmitted", unadmitted),
            ttl=expiry.get(ttl),
            max_rows=int(max_rows),
            eviction=_choice("eviction", eviction),
            value_dtype=_choice("value_dtype", value_dtype),
            slot_dtype=_choice("slot_dtype", slot_dtype),
            rounding=_choice("rounding", rounding),
        )

    @classmethod
    def get(cls, identifier: MemoryPolicy | dict[str, Any] | None) -> MemoryPolicy:
        """A policy from itself, its `get_config()` dict, or None (the
        default)."""
        if identifier is None:
            return cls()
        if isinstance(identifier, MemoryPolicy):
            return identifier
        if isinstance(identifier, dict):
            unknown = set(identifier) - set(FIELDS)
            if unknown:
                raise errors.InvalidArgumentError(
                    f"unknown memory policy fields {sorted(unknown)}; known: {list(FIELDS)}"
                )
            return cls.create(**identifier)
        raise errors.InvalidArgumentError(
            f"memory must be a tf_dlt.MemoryPolicy, its config dict or None, got {identifier!r}"
        )

    @property
    def is_default(self) -> bool:
        return self.to_dict() == MemoryPolicy().to_dict()

    def to_dict(self) -> dict[str, Any]:
        """The config dict's "policy" part (the native core's and the proto's
        PolicyConfig): every field, the unused ones at their defaults."""
        policy: dict[str, Any] = {
            "admission": "all",
            "min_count": 1,
            "sketch_bytes": 0,
            "probability": 1.0,
            "unadmitted": self.unadmitted,
            "clock": self.ttl.clock if self.ttl else "pushes",
            "ttl": self.ttl.amount if self.ttl else 0,
            "max_rows": self.max_rows,
            "eviction": self.eviction,
            "value_dtype": self.value_dtype,
            "slot_dtype": self.slot_dtype,
            "rounding": self.rounding,
        }
        policy.update(self.admission.policy_fields())
        return as_float32(policy)

    @classmethod
    def from_dict(cls, policy: dict[str, Any] | None) -> MemoryPolicy:
        """The policy of a config dict's "policy" part (`to_dict`)."""
        p = {k: v for k, v in dict(policy or {}).items() if v not in ("", None)}
        return cls(
            admission=admission_lib.from_policy(p),
            unadmitted=str(p.get("unadmitted", "zeros")),
            ttl=expiry.from_policy(str(p.get("clock", "pushes")), int(p.get("ttl", 0))),
            max_rows=int(p.get("max_rows", 0)),
            eviction=str(p.get("eviction", "lfu")),
            value_dtype=str(p.get("value_dtype", "float32")),
            slot_dtype=str(p.get("slot_dtype", "float32")),
            rounding=str(p.get("rounding", "stochastic")),
        )

    def get_config(self) -> dict[str, Any]:
        """A JSON-able dict `MemoryPolicy.get` takes back (Keras configs)."""
        config = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        config["admission"] = admission_lib.to_config(self.admission)
        config["ttl"] = expiry.to_config(self.ttl)
        return config
