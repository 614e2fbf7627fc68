"""Checkpoint files of one shard: HDF5 (h5py) written through fsspec.

Layout of a checkpoint directory (see docs/checkpoints.md):

    MANIFEST.json                          written last; commits the checkpoint
    shard-00000-of-00002.<save_id>.h5      one file per shard that saved

Each shard file holds, per table, the rows sorted by routing bucket with a
``bucket_offsets`` index, so a shard of any other shard count reads exactly
the row range of the buckets it owns; with them each row's update count and
last-touched stamp, the table's clock, and the admission sketch's slices of
the buckets the writer owned. Every file's SHA-256 is recorded in the
manifest and checked before a row is read. Saving streams rows in chunks; it
never holds a second copy of the shard in memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import fsspec
import h5py
import numpy as np

from tf_dlt import _native, errors
from tf_dlt.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    filesystem,
    is_local,
    read_manifest,
    shard_file_name,
)
from tf_dlt.routing import NUM_BUCKETS
from tf_dlt.table_config import difference, normalized

_CHUNK_BYTES = 8 << 20
_HASH_BLOCK = 8 << 20
# Shard files up to this size are verified and parsed in memory.
_SPOOL_IN_MEMORY = 256 << 20


# One chunk of a table's rows in (bucket, id) order: ids, values, optimizer
# slots, update counts, routing buckets and last-touched stamps.
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclasses.dataclass
class TableState:
    """What a table keeps besides its rows: its clock when the rows were
    read (stamps are saved relative to it for a push clock) and, with
    Frequency admission, the sketch slices of buckets [first_bucket,
    first_bucket + len(added))."""

    clock: int = 0
    sketch: np.ndarray | None = None  # uint8 [buckets, slice bytes]
    added: np.ndarray | None = None  # uint32 [buckets]
    first_bucket: int = 0


@dataclasses.dataclass
class TableRows:
    """The rows of one table to write: its config (the native dict form),
    its row layout, its chunks in (bucket, id) order, produced one at a time
    so no second copy of the table is ever held, and its state, read once
    the last chunk was copied (so the clock is never older than a stamp)."""

    config: dict[str, Any]
    dim: int
    slot_floats: int
    chunks: Iterator[Chunk]
    state: Callable[[], TableState] = TableState


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Which shard of how many wrote a file, and the buckets it owned."""

    shard_index: int = 0
    num_shards: int = 1
    first_bucket: int = 0
    end_bucket: int = NUM_BUCKETS


def chunk_rows(dim: int, slot_floats: int) -> int:
    """Rows per read or write batch (about 8 MiB)."""
    return max(1, _CHUNK_BYTES // (4 * (dim + slot_floats) + 16))


def native_state(table: _native.Table, first_bucket: int, end_bucket: int) -> TableState:
    """A native table's clock and its sketch slices of [first_bucket,
    end_bucket)."""
    state = TableState(clock=table.now(), first_bucket=first_bucket)
    if table.sketch_slice_bytes:
        state.sketch, state.added = table.read_sketch(first_bucket, end_bucket)
    return state


def native_rows(table: _native.Table, layout: ShardLayout) -> TableRows:
    """A native table's rows, copied out a chunk at a time."""

    def chunks() -> Iterator[Chunk]:
        exporter = table.exporter()
        while (chunk := exporter.next(chunk_rows(table.dim, table.slot_floats))) is not None:
            yield chunk

    def state() -> TableState:
        return native_state(table, layout.first_bucket, layout.end_bucket)

    return TableRows(table.config, table.dim, table.slot_floats, chunks(), state)


def _sha256_of(f: IO[bytes]) -> str:
    digest = hashlib.sha256()
    while block := f.read(_HASH_BLOCK):
        digest.update(block)
    return digest.hexdigest()


def _write_table(group: h5py.Group, rows: TableRows) -> int:
    """Streams one table's chunks into `group`; returns its row count."""
    group.attrs["config"] = json.dumps(rows.config, sort_keys=True)
    dim, slots = rows.dim, rows.slot_floats
    first = next(rows.chunks, None)
    # HDF5 chunks of about 1 MiB, never larger than a small table.
    per_row = 4 * (dim + slots) + 16
    storage = max(1, min((1 << 20) // per_row, len(first[0]) if first is not None else 1))

    def dataset(name: str, dtype: Any, width: int | None) -> h5py.Dataset:
        shape, chunks = ((0,), (storage,)) if width is None else ((0, width), (storage, width))
        maxshape = (None,) if width is None else (None, width)
        return group.create_dataset(name, shape, dtype, maxshape=maxshape, chunks=chunks)

    ids = dataset("ids", np.int64, None)
    values = dataset("values", np.float32, dim)
    steps = dataset("steps", np.uint32, None)
    touched = dataset("touched", np.uint32, None)
    slot_ds = dataset("slots", np.float32, slots) if slots else None
    counts = np.zeros(NUM_BUCKETS, np.int64)
    n = 0
    for c_ids, c_values, c_slots, c_steps, c_buckets, c_touched in (
        itertools.chain([first], rows.chunks) if first is not None else ()
    ):
        m = len(c_ids)
        if m == 0:
            continue
        for ds in (ids, values, slot_ds, steps, touched):
            if ds is not None:
                ds.resize(n + m, axis=0)
        ids[n : n + m] = c_ids
        values[n : n + m] = c_values
        if slot_ds is not None:
            slot_ds[n : n + m] = c_slots
        steps[n : n + m] = c_steps
        touched[n : n + m] = c_touched
        counts += np.bincount(c_buckets, minlength=NUM_BUCKETS)
        n += m
    offsets = np.zeros(NUM_BUCKETS + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    group.create_dataset("bucket_offsets", data=offsets)
    # Read after the rows: rows pushed while they were copied carry stamps up
    # to this clock, never beyond it.
    state = rows.state()
    group.attrs["clock"] = state.clock
    if state.sketch is not None and state.added is not None:
        group.create_dataset("sketch", data=state.sketch)
        group.create_dataset("sketch_added", data=state.added)
        group.attrs["sketch_first_bucket"] = state.first_bucket
    return n


def _write_shard_file(
    local_path: str, layout: ShardLayout, tables: list[TableRows], save_id: str
) -> list[dict[str, Any]]:
    """Streams `tables` (sorted by name) into an HDF5 file; returns table
    infos."""
    infos = []
    with h5py.File(local_path, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["save_id"] = save_id
        f.attrs["shard_index"] = layout.shard_index
        f.attrs["num_shards"] = layout.num_shards
        f.attrs["first_bucket"] = layout.first_bucket
        f.attrs["end_bucket"] = layout.end_bucket
        f.attrs["num_buckets"] = NUM_BUCKETS
        group = f.create_group("tables")
        for k, rows in enumerate(sorted(tables, key=lambda t: str(t.config["name"]))):
            n = _write_table(group.create_group(f"t{k:05d}"), rows)
            infos.append({"config": rows.config, "rows": n})
    return infos


def save_shard(path: str, shard: _native.Shard, save_id: str) -> dict[str, Any]:
    """Writes this shard's file into checkpoint directory `path` (see
    `save_tables`)."""
    layout = ShardLayout(shard.shard_index, shard.num_shards, shard.first_bucket, shard.end_bucket)
    return save_tables(path, layout, [native_rows(t, layout) for t in shard.tables()], save_id)


def save_tables(
    path: str, layout: ShardLayout, tables: list[TableRows], save_id: str
) -> dict[str, Any]:
    """Writes one shard file of `tables` into checkpoint directory `path`.

    The file gets a save-specific name, so a committed checkpoint at the same
    path is never overwritten; only the manifest (written by the caller after
    every shard succeeded) makes the new files part of a checkpoint.
    """
    if not save_id or not all(c.isalnum() or c in "-_" for c in save_id):
        raise errors.InvalidArgumentError(f"save_id must be alphanumeric, got {save_id!r}")
    start = time.monotonic()
    fs, root = filesystem(path)
    name = shard_file_name(layout.shard_index, layout.num_shards, save_id)
    fs.makedirs(root, exist_ok=True)
    target = f"{root}/{name}"
    if is_local(fs):
        tmp = f"{target}.tmp-{os.getpid()}"
        try:
            infos = _write_shard_file(tmp, layout, tables, save_id)
            with open(tmp, "rb") as f:
                sha = _sha256_of(f)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        size = os.path.getsize(target)
    else:
        with tempfile.TemporaryDirectory(prefix="tf_dlt-save-") as spool:
            local = os.path.join(spool, name)
            infos = _write_shard_file(local, layout, tables, save_id)
            with open(local, "rb") as f:
                sha = _sha256_of(f)
            size = os.path.getsize(local)
            fs.put_file(local, target)
    return {
        "file": name,
        "sha256": sha,
        "bytes": size,
        "shard_index": layout.shard_index,
        "num_shards": layout.num_shards,
        "first_bucket": layout.first_bucket,
        "end_bucket": layout.end_bucket,
        "tables": infos,
        "seconds": time.monotonic() - start,
    }


@contextlib.contextmanager
def _open_verified(
    fs: fsspec.AbstractFileSystem, root: str, entry: dict[str, Any]
) -> Iterator[h5py.File]:
    """Opens a shard file whose bytes match the manifest's SHA-256. The file
    is read once, hashed as it is copied into a private spool (memory up to
    256 MiB, else a temporary file), and the rows are parsed from the spool:
    the bytes loaded are the bytes hashed, even if the file changes meanwhile.
    """
    target = f"{root}/{entry['file']}"
    digest = hashlib.sha256()
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY, prefix="tf_dlt-load-") as spool:
        try:
            with fs.open(target, "rb") as f:
                while block := f.read(_HASH_BLOCK):
                    digest.update(block)
                    spool.write(block)
        except FileNotFoundError:
            raise errors.FailedPreconditionError(
                f"checkpoint file {target} named in the manifest is missing"
            ) from None
        if digest.hexdigest() != entry["sha256"]:
            raise errors.FailedPreconditionError(
                f"checkpoint file {target} is corrupt: SHA-256 {digest.hexdigest()} != manifest "
                f"{entry['sha256']}"
            )
        spool.seek(0)
        with h5py.File(spool, "r") as h5:
            yield h5


def restore_rows(g: h5py.Group, table: _native.Table, first: int, end: int) -> None:
    """Imports the rows of buckets [first, end) of file group `g` into a
    fresh `table`, with their update counts and stamps, and the sketch slices
    the file has of those buckets. Stamps of a push clock count against the
    writer's own clock (each shard counts its pushes): they are restored as
    the same ages against the fresh table's clock, 0, whichever shards wrote
    them."""
    saved_clock = int(g.attrs.get("clock", 0))
    seconds = json.loads(g.attrs["config"]).get("policy", {}).get("clock") == "seconds"
    offsets = g["bucket_offsets"][...]
    lo, hi = int(offsets[first]), int(offsets[end])
    step = chunk_rows(table.dim, table.slot_floats)
    slots = g["slots"] if "slots" in g else None
    touched = g["touched"] if "touched" in g else None
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        stamps = None
        if touched is not None:
            stamps = touched[a:b]
            if not seconds:  # the same age against clock 0 (modulo 2^32)
                age = (saved_clock - stamps.astype(np.int64)) % (1 << 32)
                age[age >= 1 << 31] = 0  # newer than the clock (files of older builds)
                stamps = (-age) % (1 << 32)
        table.import_rows(
            g["ids"][a:b],
            g["values"][a:b],
            None if slots is None else slots[a:b],
            g["steps"][a:b],
            stamps,
        )
    if "sketch" in g and table.sketch_slice_bytes:
        sketch_first = int(g.attrs["sketch_first_bucket"])
        added = g["sketch_added"]
        lo_b, hi_b = max(first, sketch_first), min(end, sketch_first + len(added))
        if lo_b < hi_b:
            rows = slice(lo_b - sketch_first, hi_b - sketch_first)
            table.write_sketch(
                lo_b, np.asarray(g["sketch"][rows], np.uint8), np.asarray(added[rows], np.uint32)
            )


def load_shard(path: str, shard: _native.Shard) -> dict[str, Any]:
    """Reads the rows this shard owns from checkpoint `path` and installs
    them (see `prepare_load`); a failed load leaves the shard as it was."""
    staged = prepare_load(path, shard)
    shard.install_tables(staged["staged"])
    return staged


def prepare_load(path: str, shard: _native.Shard) -> dict[str, Any]:
    """Reads and verifies the rows this shard owns from checkpoint `path` into
    new tables, returned under "staged" and not installed.

    Works with any shard count at save time: rows are picked by routing
    bucket. Installing the staged tables (`shard.install_tables`) replaces
    same-named tables in one step, so a cluster can verify on every shard
    before any shard changes.
    """
    start = time.monotonic()
    manifest = read_manifest(path)
    first, end = shard.first_bucket, shard.end_bucket
    existing = {t.name: normalized(t.config) for t in shard.tables()}
    fresh: dict[str, Any] = {}
    for info in manifest["tables"]:
        config = normalized(info["config"])
        name = config["name"]
        if name in existing and existing[name] != config:
            raise errors.FailedPreconditionError(
                f"table {name!r} on this shard differs from the checkpoint's "
                f"({difference(existing[name], config)}); drop the table first to load it"
            )
        fresh[name] = shard.new_table(config)
    fs, root = filesystem(path)
    for entry in manifest["files"]:
        if entry["end_bucket"] <= first or entry["first_bucket"] >= end:
            continue  # that shard owned none of our buckets
        with _open_verified(fs, root, entry) as f:
            for g in f["tables"].values():
                config = json.loads(g.attrs["config"])
                table = fresh.get(config["name"])
                if table is None or normalized(table.config) != normalized(config):
                    raise errors.FailedPreconditionError(
                        f"{entry['file']} holds table {config['name']!r} with a config the "
                        "manifest does not list"
                    )
                restore_rows(g, table, first, end)
    tables = list(fresh.values())
    return {
        "staged": tables,
        "tables": [
            {
                "config": t.config,
                "rows": t.size(),
                "bytes": t.bytes(),
                "record_bytes": t.record_bytes,
            }
            for t in tables
        ],
        "seconds": time.monotonic() - start,
    }
