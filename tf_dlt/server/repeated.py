"""Log lines for conditions that repeat: a standby trying to attach every
0.5 s, a follower finding every poll that the newest checkpoint still does
not load. Said the first time, then once in a while with how often."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


class Repeated:
    """One log line on `logger` for a condition that repeats: the first
    time, then at most once every `every_s` with how many times it came
    meanwhile, each `key` on its own (two conditions in turn do not log each
    other). Used by one thread."""

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._every_s = every_s
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # key: when logged, times since

    def log(self, key: str, level: int, msg: str, *args: Any, exc_info: bool = False) -> None:
        """`msg % args` at `level`, if `key` was not said within `every_s`
        (`exc_info`: with the exception being handled, as `Logger.log`)."""
        now = self._clock()
        logged, since = self._seen.get(key, (None, 0))
        if logged is not None and now - logged < self._every_s:
            self._seen[key] = (logged, since + 1)
            return
        if logged is not None and since:
            msg += f" (and {since} times in the last {now - logged:.0f} s)"
        self._seen[key] = (now, 0)
        self._logger.log(level, msg, *args, exc_info=exc_info)

    def clear(self, key: str | None = None) -> None:
        """The condition `key` (None: every one) is over: its next coming is
        said at once."""
        if key is None:
            self._seen.clear()
        else:
            self._seen.pop(key, None)
