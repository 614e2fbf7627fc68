"""TableConfig: what a distributed table is (name, dim, seed, initializer,
optimizer, memory policy), and its conversions to the native dict and the
control-plane protobuf."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from tf_dlt import errors, initializers, optimizers
from tf_dlt.memory_policy import FIELDS as MEMORY_FIELDS
from tf_dlt.memory_policy import MemoryPolicy, as_float32

if TYPE_CHECKING:
    from tf_dlt.proto import dlt_pb2


# The widest row (the wire protocol carries at most this many values a row).
MAX_DIM = 65536


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """Configuration of one distributed table.

    Args:
        name: table name: letters, digits and ``_-./``, at most 255 bytes; no
            part between '/'s empty, '.' or '..'.
        dim: number of float32 values per row, 1..65536.
        initializer: how unseen rows start (name or `tf_dlt.initializers`).
        optimizer: server-side update_method (name or `tf_dlt.optimizers`).
        seed: seed of the deterministic initializer.
        memory: the memory policy (`tf_dlt.MemoryPolicy`): admission,
            expiry, a row bound and 16-bit storage; none by default.
    """

    name: str
    dim: int
    initializer: initializers.Initializer = dataclasses.field(
        default_factory=initializers.RandomUniform
    )
    optimizer: optimizers.Optimizer = dataclasses.field(default_factory=optimizers.SGD)
    seed: int = 0
    memory: MemoryPolicy = dataclasses.field(default_factory=MemoryPolicy)

    @classmethod
    def create(
        cls,
        name: str,
        dim: int,
        initializer: initializers.InitializerLike = "uniform",
        optimizer: optimizers.OptimizerLike = "sgd",
        seed: int = 0,
        memory: MemoryPolicy | dict[str, Any] | None = None,
        **policy: Any,
    ) -> TableConfig:
        """Builds and validates a config from names or objects. `policy`:
        the fields of `memory` as keywords (admission, unadmitted, ttl,
        max_rows, eviction, value_dtype, slot_dtype, rounding), a shorthand
        for ``memory=MemoryPolicy.create(...)``; not both."""
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
        if not 1 <= int(dim) <= MAX_DIM:
            raise errors.InvalidArgumentError(f"dim must be in [1, {MAX_DIM}], got {dim}")
        config = cls(
            name=name,
            dim=int(dim),
            initializer=initializers.get(initializer),
            optimizer=optimizers.get(optimizer),
            seed=int(seed),
            memory=memory_of(memory, **policy),
        )
        config.validate()
        return config

    def validate(self) -> None:
        """Raises InvalidArgumentError naming the first problem, if any."""
        from tf_dlt import _native

        _native.validate_table_config(self.to_dict())

    def policy(self) -> dict[str, Any]:
        """The memory policy as the config dict's "policy" part."""
        return self.memory.to_dict()

    @property
    def has_policy(self) -> bool:
        """True when any part of the memory policy differs from the default."""
        return not self.memory.is_default

    def to_dict(self) -> dict[str, Any]:
        """The plain-dict form the native core and checkpoints use."""
        return {
            "name": self.name,
            "dim": self.dim,
            "seed": self.seed,
            "initializer": as_float32(self.initializer.to_dict()),
            "optimizer": as_float32(self.optimizer.to_dict()),
            "policy": self.policy(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TableConfig:
        """The config `to_dict` gave; InvalidArgumentError naming the
        entries `d` lacks (a bare KeyError before)."""
        missing = [k for k in ("name", "dim", "seed", "initializer", "optimizer") if k not in d]
        if missing:
            raise errors.InvalidArgumentError(
                f"table config {d.get('name', '')!r} has no {', '.join(map(repr, missing))} "
                "(TableConfig.to_dict() gives a whole one)"
            )
        return cls(
            name=str(d["name"]),
            dim=int(d["dim"]),
            seed=int(d["seed"]),
            initializer=initializers.get(dict(d["initializer"])),
            optimizer=optimizers.get(dict(d["optimizer"])),
            memory=MemoryPolicy.from_dict(d.get("policy")),
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


def memory_of(memory: MemoryPolicy | dict[str, Any] | None = None, **policy: Any) -> MemoryPolicy:
    """The policy `memory` names, or the one its fields given as keywords
    make (never both)."""
    unknown = set(policy) - set(MEMORY_FIELDS)
    if unknown:
        raise errors.InvalidArgumentError(
            f"unknown memory policy arguments {sorted(unknown)}; known: {list(MEMORY_FIELDS)}"
        )
    if memory is not None and policy:
        raise errors.InvalidArgumentError(
            f"give the memory policy as memory= or as its fields ({sorted(policy)}), not both"
        )
    return MemoryPolicy.get(memory) if memory is not None else MemoryPolicy.create(**policy)


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
