"""Byte sizes written for people: "1.5GiB", "512MiB", "2G", "1048576"."""

from __future__ import annotations

import math

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip


def parse_bytes(text: str) -> int:
    """Bytes of a size such as "1.5GiB", "512Mi", "2G" or "4096"; ValueError
    naming the text when it is none."""
    s = str(text).strip().replace(" ", "")
    number = s.rstrip("BbKkMmGgTtIi")
    unit = s[len(number) :].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not (value >= 0 and math.isfinite(value)):
        raise ValueError(
            f"{text!r} is not a size: give bytes, or a number with KiB, MiB, GiB, TiB "
            "(powers of 1024) or K, M, G, T (powers of 1000)"
        )
    if value * _UNITS[unit] >= 2**64:
        # (a budget of 1e30 bytes reached the native core as a traceback)
        raise ValueError(f"{text!r} is 2^64 bytes or more: past any machine's")
    if value > 0 and int(value * _UNITS[unit]) == 0:
        # "0.5" (a unit left out) was taken as 0 bytes: no budget at all.
        raise ValueError(f"{text!r} is under one byte: a unit left out? (e.g. 0.5GiB)")
    return int(value * _UNITS[unit])
