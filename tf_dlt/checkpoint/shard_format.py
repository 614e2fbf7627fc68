"""The shard file format's parts shared by saving and loading: a chunk of
rows, what a table keeps besides its rows, the rows to write and the layout
of the shard that writes them, and row sizes. The layout of a checkpoint is
in shard_files' docstring and docs/checkpoints.md."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tf_dlt import _native
from tf_dlt.routing import NUM_BUCKETS

_CHUNK_BYTES = 8 << 20


# One chunk of a table's rows in (bucket, id) order: ids, values, optimizer
# slots, update counts, routing buckets and last-touched stamps.
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclasses.dataclass
class TableState:
    """What a table keeps besides its rows: its clock as the save began
    (stamps are saved relative to it for a push clock; a row stamped after
    it, pushed while the save ran, loads as just touched) and, with
    Frequency admission, the sketch slices of buckets [first_bucket,
    first_bucket + len(added)). For a delta (rows changed since a base):
    the clock at the base and the ids removed since, in (bucket, id) order."""

    clock: int = 0
    sketch: np.ndarray | None = None  # uint8 [buckets, slice bytes]
    added: np.ndarray | None = None  # uint32 [buckets]
    first_bucket: int = 0
    base_clock: int | None = None  # None: every row was written (mode "full")
    removed: np.ndarray | None = None  # int64 ids

    @property
    def mode(self) -> str:
        return "full" if self.base_clock is None else "delta"


@dataclasses.dataclass
class TableRows:
    """The rows of one table to write: its config (the native dict form),
    its row layout, its chunks in (bucket, id) order, produced one at a time
    so no second copy of the table is ever held, and its state, read once
    the last chunk was copied (its clock is the one as the save began:
    stamps may be newer, docs/checkpoints.md)."""

    config: dict[str, Any]
    dim: int
    slot_floats: int
    chunks: Iterator[Chunk]
    state: Callable[[], TableState] = TableState
    # For a delta: the table's rows in full, written instead when `state`
    # raises IncompleteDelta.
    whole: Callable[[], TableRows] | None = None
    # At most this many bytes of rows to write (0: not known): the room a
    # save makes sure of before it writes.
    max_bytes: int = 0


class IncompleteDelta(Exception):
    """A delta's removals are incomplete (the table's removal log
    overflowed while the save ran): the table is to be written whole."""


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which shard of how many wrote a file, and the buckets it owned."""

    shard_index: int = 0
    num_shards: int = 1
    first_bucket: int = 0
    end_bucket: int = NUM_BUCKETS


# A 16-bit table's values and slots are stored as 16 bits: float16 as HDF5's
# half float, bfloat16 (which HDF5 lacks) as its bits in uint16, the
# dataset's attribute "dtype" naming it. Exact both ways: the table widens
# a 16-bit value to float32 exactly, and narrowing it back loses nothing.
_STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def stored_dtype(dtype: str) -> Any:
    """The numpy dtype a file stores values or slots of table dtype `dtype`
    ("float32", "float16", "bfloat16") in."""
    return _STORED[dtype]


def narrow(rows: np.ndarray, dtype: str) -> np.ndarray:
    """float32 `rows` (16-bit values widened) as a file stores `dtype`."""
    if dtype == "bfloat16":
        return (np.ascontiguousarray(rows, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.asarray(rows, _STORED[dtype])


def widen(rows: np.ndarray, dtype: str) -> np.ndarray:
    """Rows read from a file storing `dtype`, as float32."""
    if dtype == "bfloat16":
        if rows.dtype != np.uint16:
            raise ValueError(f"bfloat16 rows stored as {rows.dtype}, not uint16")
        return (rows.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(rows, np.float32)


def table_dtypes(config: dict[str, Any]) -> tuple[str, str]:
    """(values, slots) dtype names of a table config (native dict form)."""
    policy = config.get("policy", {})
    return str(policy.get("value_dtype", "float32")), str(policy.get("slot_dtype", "float32"))


def file_row_bytes(
    dim: int, slot_floats: int, value_dtype: str = "float32", slot_dtype: str = "float32"
) -> int:
    """Bytes of one row in a shard file: values and slots (as stored for
    their table dtypes), id, update count and stamp."""
    value = int(np.dtype(stored_dtype(value_dtype)).itemsize)
    slot = int(np.dtype(stored_dtype(slot_dtype)).itemsize)
    return value * dim + slot * slot_floats + 16


def chunk_rows(dim: int, slot_floats: int) -> int:
    """Rows per read or write batch (about 8 MiB)."""
    return max(1, _CHUNK_BYTES // file_row_bytes(dim, slot_floats))


@contextlib.contextmanager
def persisting(shard: _native.Shard) -> Iterator[None]:
    """Marks a save or load of `shard` as running: its memory keeper then
    sizes the rows by what the process held before it, so the buffers it
    takes (within the budget's reserve for them) never move rows."""
    shard.set_persisting(True)
    try:
        yield
    finally:
        shard.set_persisting(False)
