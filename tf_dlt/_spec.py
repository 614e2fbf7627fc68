"""The one way initializers and optimizers are named: a frozen dataclass per
kind, resolved from a name, an instance or its `to_dict()` form."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from tf_dlt import errors


@dataclasses.dataclass(frozen=True)
class Spec:
    """Base of initializer and optimizer specs; `kind` names it on the wire."""

    kind = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}


S = TypeVar("S", bound=Spec)


def resolve(identifier: object, base: type[S], by_name: dict[str, type[S]], what: str) -> S:
    """An instance of `base` from an instance, a name in `by_name` or a dict
    with "kind" (fields the kind does not use are ignored)."""
    if isinstance(identifier, base):
        return identifier
    if isinstance(identifier, dict):
        fields = dict(identifier)
        kind = fields.pop("kind", None)
        cls = by_name.get(str(kind))
        if cls is None:
            raise errors.InvalidArgumentError(
                f"unknown {what} kind {kind!r}; expected one of {sorted(by_name)}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: float(v) for k, v in fields.items() if k in names})
    if isinstance(identifier, str) and identifier.lower() in by_name:
        return by_name[identifier.lower()]()
    raise errors.InvalidArgumentError(
        f"unknown {what} {identifier!r}; expected one of {sorted(by_name)} "
        f"or a tf_dlt.{what}s instance"
    )
