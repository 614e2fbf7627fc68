"""Expiry of a table's rows: a time to live (ttl) counted in pushes of the
table or in seconds. A row untouched (not pushed) for longer than its ttl is
removed by the shard's background sweep, which holds one stripe of the table
at a time. The row metadata behind it (update count and last-touched stamp)
fits the 8 bytes every row already had.

- `Pushes(n)`: the clock is the number of pushes this shard has taken for
  the table; a row last pushed at push t is removed once the clock passes
  t + n.
- `Seconds(s)`: the clock is wall-clock seconds; a row last pushed at time
  t is removed once the time passes t + s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tf_dlt import errors

# Largest ttl: stamps are 32-bit and compared modulo 2^32.
MAX_TTL = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Ttl:
    """Base class of ttls: `amount` units of `clock`."""

    clock = ""
    amount: int = 0

    def __post_init__(self) -> None:
        a = self.amount
        if isinstance(a, bool) or not isinstance(a, int) or not 1 <= a <= MAX_TTL:
            raise errors.InvalidArgumentError(
                f"ttl must be an int in [1, {MAX_TTL}] {self.clock}, got {a!r}"
            )


@dataclasses.dataclass(frozen=True)
class Pushes(Ttl):
    """Rows untouched for more than `amount` pushes of the table expire."""

    clock = "pushes"


@dataclasses.dataclass(frozen=True)
class Seconds(Ttl):
    """Rows untouched for more than `amount` seconds expire."""

    clock = "seconds"


def get(identifier: Ttl | dict[str, Any] | None) -> Ttl | None:
    """A ttl from an instance, None, or the dict of `to_config`."""
    if identifier is None or isinstance(identifier, Ttl):
        return identifier
    if isinstance(identifier, dict) and set(identifier) == {"clock", "amount"}:
        cls = {"pushes": Pushes, "seconds": Seconds}.get(identifier["clock"])
        if cls is not None:
            return cls(identifier["amount"])
    raise errors.InvalidArgumentError(
        f"ttl must be None, tf_dlt.expiry.Pushes(n) or tf_dlt.expiry.Seconds(s), got {identifier!r}"
    )


def to_config(ttl: Ttl | None) -> dict[str, Any] | None:
    """A JSON-friendly form that `get` reads back (for Keras configs)."""
    return None if ttl is None else {"clock": ttl.clock, "amount": ttl.amount}


def from_policy(clock: str, ttl: int) -> Ttl | None:
    """The ttl of a policy's "clock" and "ttl" fields (a config, a request;
    a clock left empty is pushes, the field's default)."""
    if clock not in ("pushes", "seconds", ""):
        raise errors.InvalidArgumentError(f"ttl clock must be 'pushes' or 'seconds', got {clock!r}")
    if ttl == 0:
        return None
    return Seconds(ttl) if clock == "seconds" else Pushes(ttl)
