"""Progress of long operations (checkpoint saves and loads, row uploads) on
stderr: on a terminal a `rich` progress bar (rich comes with Keras); off a
terminal (logs), or without rich, one plain line per step."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """`update(n)` adds n of `total` units; `close()` ends the display.

    Args:
        label: what is in progress ("saving s3://bucket/ck").
        total: units to do.
        unit: their name ("shards", "rows").
        enabled: show it (None: only when `stream` is a terminal).
        stream: where to draw (stderr).
    """

    def __init__(
        self,
        label: str,
        total: int,
        unit: str,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = self.tty if enabled is None else enabled
        self.label, self.total, self.unit = label, max(total, 0), unit
        self.done = 0
        self._start = time.monotonic()
        self._bar: Any = None
        if self.enabled and self.tty:
            self._bar = _rich_bar(self.stream, label, self.total, unit)

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            bar, task = self._bar
            bar.update(task, advance=n, note=note)
            return
        text = (
            f"{self.label}: {self.done}/{self.total} {self.unit} "
            f"{time.monotonic() - self._start:.1f} s{' ' + note if note else ''}"
        )
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar[0].stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rich_bar(stream: TextIO, label: str, total: int, unit: str) -> tuple[Any, Any] | None:
    """A started rich progress bar and its task, or None without rich."""
    try:
        from rich import console, progress
    except ImportError:
        return None
    bar = progress.Progress(
        progress.TextColumn("{task.description}"),
        progress.BarColumn(),
        progress.MofNCompleteColumn(),
        progress.TextColumn(unit),
        progress.TimeElapsedColumn(),
        progress.TextColumn("{task.fields[note]}"),
        console=console.Console(file=stream),
    )
    task = bar.add_task(label, total=total, note="")
    bar.start()
    return bar, task
