"""TableConfig: what a distributed table is (name, dim, seed, initializer,
optimizer, memory policy), and its conversions to the native dict and the
control-plane protobuf."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from tf_dlt import admission as admission_lib
from tf_dlt import errors, expiry, initializers, optimizers

if TYPE_CHECKING:
    from tf_dlt.proto import dlt_pb2


def _as_float32(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(np.float32(v)) if isinstance(v, float) else v) for k, v in fields.items()}


# Choices of the policy's named fields (the first is the default).
UNADMITTED = ("zeros", "initial")
EVICTION = ("lfu", "lru")
DTYPES = ("float32", "bfloat16", "float16")
ROUNDING = ("stochastic", "nearest")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise errors.InvalidArgumentError(f"{name} must be one of {list(choices)}, got {value!r}")
    return str(value)


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """Configuration of one distributed table.

    Args:
        name: table name: letters, digits and ``_-./``, at most 255 bytes.
        dim: number of float32 values per row, 1..65536.
        initializer: how unseen rows start (name or `tf_dlt.initializers`).
        optimizer: server-side update_method (name or `tf_dlt.optimizers`).
        seed: seed of the deterministic initializer.
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

    name: str
    dim: int
    initializer: initializers.Initializer = dataclasses.field(
        default_factory=initializers.RandomUniform
    )
    optimizer: optimizers.Optimizer = dataclasses.field(default_factory=optimizers.SGD)
    seed: int = 0
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
        name: str,
        dim: int,
        initializer: initializers.InitializerLike = "uniform",
        optimizer: optimizers.OptimizerLike = "sgd",
        seed: int = 0,
        admission: admission_lib.AdmissionLike = None,
        unadmitted: str = "zeros",
        ttl: expiry.Ttl | None = None,
        max_rows: int = 0,
        eviction: str = "lfu",
        value_dtype: str = "float32",
        slot_dtype: str = "float32",
        rounding: str = "stochastic",
    ) -> TableConfig:
        """Builds and validates a config from names or objects."""
        if not isinstance(name, str):
            raise errors.InvalidArgumentError(f"table name must be a str, got {name!r}")
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise errors.InvalidArgumentError(f"dim must be an int, got {dim!r}")
        if (
            isinstance(seed, bool)
            or not isinstance(seed, (int, np.integer))
            or not (0 <= seed < 2**64)
        ):
            raise errors.InvalidArgumentError(f"seed must be an int in [0, 2**64), got {seed!r}")
        if not 1 <= int(dim) <= 65536:
            raise errors.InvalidArgumentError(f"dim must be in [1, 65536], got {dim}")
        if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)):
            raise errors.InvalidArgumentError(f"max_rows must be an int >= 0, got {max_rows!r}")
        if max_rows != 0 and not 4096 <= max_rows <= 2**40:
            raise errors.InvalidArgumentError(
                f"max_rows must be 0 (unbounded) or in [4096, 2**40], got {max_rows!r}"
            )
        config = cls(
            name=name,
            dim=int(dim),
            initializer=initializers.get(initializer),
            optimizer=optimizers.get(optimizer),
            seed=int(seed),
            admission=admission_lib.get(admission),
            unadmitted=_choice("unadmitted", unadmitted, UNADMITTED),
            ttl=expiry.get(ttl),
            max_rows=int(max_rows),
            eviction=_choice("eviction", eviction, EVICTION),
            value_dtype=_choice("value_dtype", value_dtype, DTYPES),
            slot_dtype=_choice("slot_dtype", slot_dtype, DTYPES),
            rounding=_choice("rounding", rounding, ROUNDING),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Raises InvalidArgumentError naming the first problem, if any."""
        from tf_dlt import _native

        _native.validate_table_config(self.to_dict())

    def policy(self) -> dict[str, Any]:
        """The memory policy as the config dict's "policy" part: every field,
        the unused ones at their defaults."""
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
        return _as_float32(policy)

    @property
    def has_policy(self) -> bool:
        """True when any part of the memory policy differs from the default."""
        return self.policy() != TableConfig(self.name, self.dim).policy()

    def to_dict(self) -> dict[str, Any]:
        """The plain-dict form the native core and checkpoints use."""
        return {
            "name": self.name,
            "dim": self.dim,
            "seed": self.seed,
            "initializer": _as_float32(self.initializer.to_dict()),
            "optimizer": _as_float32(self.optimizer.to_dict()),
            "policy": self.policy(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableConfig:
        p = {k: v for k, v in dict(d.get("policy") or {}).items() if v not in ("", None)}
        return cls(
            name=str(d["name"]),
            dim=int(d["dim"]),
            seed=int(d["seed"]),
            initializer=initializers.get(dict(d["initializer"])),
            optimizer=optimizers.get(dict(d["optimizer"])),
            admission=admission_lib.from_policy(p),
            unadmitted=str(p.get("unadmitted", "zeros")),
            ttl=expiry.from_policy(str(p.get("clock", "pushes")), int(p.get("ttl", 0))),
            max_rows=int(p.get("max_rows", 0)),
            eviction=str(p.get("eviction", "lfu")),
            value_dtype=str(p.get("value_dtype", "float32")),
            slot_dtype=str(p.get("slot_dtype", "float32")),
            rounding=str(p.get("rounding", "stochastic")),
        )

    def same_table(self, other: TableConfig) -> bool:
        """True when both describe the same table (at float32 precision)."""
        return self.to_dict() == other.to_dict()

    def to_proto(self) -> dlt_pb2.TableConfig:
        from tf_dlt.proto import dlt_pb2

        d = self.to_dict()
        return dlt_pb2.TableConfig(
            name=d["name"],
            dim=d["dim"],
            seed=d["seed"],
            initializer=dlt_pb2.InitializerConfig(**d["initializer"]),
            optimizer=dlt_pb2.OptimizerConfig(**d["optimizer"]),
            policy=dlt_pb2.PolicyConfig(**d["policy"]),
        )

    @classmethod
    def from_proto(cls, p: dlt_pb2.TableConfig) -> TableConfig:
        from google.protobuf import json_format

        d = json_format.MessageToDict(
            p, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        d["seed"] = int(d.get("seed", 0))
        return cls.from_dict(d)


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a native or checkpoint dict) with only the fields its
    initializer and optimizer use, at float32 precision."""
    return TableConfig.from_dict(config).to_dict()


def difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The fields in which two config dicts differ, e.g. "dim: 8 vs 16"."""
    left, right = normalized(a), normalized(b)
    diffs = []
    for key in ("name", "dim", "seed"):
        if left[key] != right[key]:
            diffs.append(f"{key}: {left[key]} vs {right[key]}")
    for part in ("initializer", "optimizer", "policy"):
        for key in sorted(set(left[part]) | set(right[part])):
            x, y = left[part].get(key), right[part].get(key)
            if x != y:
                diffs.append(f"{part}.{key}: {x} vs {y}")
    return ", ".join(diffs) or "none"
