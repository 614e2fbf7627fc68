"""The embedded tables of this process: one shard (index 0 of 1) of the
native core, the single-machine default.

The lookup ops' embedded transport and this module reach the same shard
(`_native.embedded_shard()`): the Python extension and the op library link
one libdlt_core.so, so a process holds one copy of the core. Tables are
created, dropped, read and written here, and saved and loaded with the same
checkpoint code as shard servers (tf_dlt.checkpoint.shard_files). Needs no
TensorFlow.
"""

from __future__ import annotations

import numpy as np

from tf_dlt import _native
from tf_dlt.table_config import TableConfig

_CHUNK = 1 << 16


def shard() -> _native.Shard:
    """The process's embedded shard."""
    return _native.embedded_shard()


def create_table(config: TableConfig, *, provisional: bool = False) -> bool:
    """Creates `config`'s table (a no-op when an identical one exists;
    AlreadyExistsError naming both when a different one does). Returns
    whether a table was made (or replaced).

    `provisional`: the optimizer is not known yet (a layer following a
    model not compiled yet); an existing table differing only in its
    optimizer is taken as it is. A later call that knows the optimizer
    settles a provisional table, replacing it (rows kept, fresh optimizer
    slots) while no push trained it.
    """
    return shard().create_table(config.to_dict(), provisional)


def drop_table(name: str) -> None:
    """Drops table `name` (NotFoundError when there is none)."""
    shard().drop_table(name)


def table(name: str) -> _native.Table:
    """Table `name` (NotFoundError naming the tables there are)."""
    return shard().get_table(name)


def rows(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids [n], values [n, dim], slots [n, k], steps [n]) of every row of
    table `name`, in (bucket, id) order."""
    t = table(name)
    parts: list[tuple[np.ndarray, ...]] = []
    exporter = t.exporter()
    while (chunk := exporter.next(_CHUNK)) is not None:
        parts.append(chunk[:4])
    if not parts:
        return (np.zeros(0, np.int64), np.zeros((0, t.dim), np.float32),
                np.zeros((0, t.slot_floats), np.float32), np.zeros(0, np.uint32))  # fmt: skip
    ids, values, slots, steps = (np.concatenate(column) for column in zip(*parts, strict=True))
    return ids, values, slots, steps
