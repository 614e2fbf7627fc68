"""Writing one shard file: a native table's rows and state streamed chunk by
chunk into HDF5 (rows sorted by routing bucket, with each bucket's offsets),
spooled locally, digested block by block and put in place under a
save-specific name. Never a second copy of the shard in memory."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import re
import resource
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np

from tf_dlt import _native, errors
from tf_dlt.checkpoint import verified
from tf_dlt.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    filesystem,
    is_local,
    make_directory,
    put_durably,
    replaced_durably,
    shard_file_name,
)
from tf_dlt.checkpoint.shard_format import (
    Chunk,
    IncompleteDelta,
    ShardLayout,
    TableRows,
    TableState,
    chunk_rows,
    file_row_bytes,
    narrow,
    persisting,
    stored_dtype,
    table_dtypes,
)
from tf_dlt.routing import NUM_BUCKETS

# HDF5 places file metadata (the chunk indexes above all) in blocks of this
# size, so a load walks each dataset's index in a few verified blocks
# instead of one node in every block of the file.
_META_BLOCK_BYTES = 1 << 20
# HDF5's raw chunk cache while writing: none, so each chunk is placed in the
# file as it is written and the datasets' chunks of the same rows lie
# together (a load reads them from one or two verified blocks). With HDF5's
# default 1 MiB cache a chunk was placed when evicted, the small datasets'
# (ids, steps, stamps) trailing the wide ones' by tens of MiB, and a load
# cycled through more blocks than it kept (27 reads per block at 2M rows of
# dim 64).
_CHUNK_CACHE_BYTES = 0


def native_state(
    table: _native.Table, first_bucket: int, end_bucket: int, clock: int | None = None
) -> TableState:
    """A native table's clock (`clock`, else now) and its sketch slices of
    [first_bucket, end_bucket)."""
    state = TableState(clock=table.now() if clock is None else clock, first_bucket=first_bucket)
    if table.sketch_slice_bytes:
        state.sketch, state.added = table.read_sketch(first_bucket, end_bucket)
    return state


def native_rows(
    table: _native.Table, layout: ShardLayout, save_id: str = "", base: str = ""
) -> TableRows:
    """A native table's rows, copied out a chunk at a time. With a
    `save_id`, the copy is that save of the table (its change tracking
    starts a new generation): on top of save `base`, when the table tracks
    it, only the rows changed since, with the ids removed since."""
    # The file's clock is the table's as the save begins: its mark holds
    # that clock (Table::BeginSave), and a delta on it ages the rows it does
    # not hold from there. Read after the rows (as it was), it counted the
    # pushes taken during the save twice in a chain, in the base's ages and
    # again in the delta's, once per link: a Pushes ttl expired a loaded
    # chain's rows early. Read just before the mark, never after it: rows
    # pushed meanwhile load as young as at the save's start (a row stamped
    # after the clock loads as just touched), never older than they are.
    clock = table.now()
    tracked, since, base_clock = table.begin_save(save_id, base) if save_id else (False, 0, 0)

    def chunks(delta: bool) -> Iterator[Chunk]:
        exporter = table.exporter(since if delta else None)
        while (chunk := exporter.next(chunk_rows(table.dim, table.slot_floats))) is not None:
            yield chunk

    def state() -> TableState:
        return native_state(table, layout.first_bucket, layout.end_bucket, clock)

    def delta_state() -> TableState:
        out = state()
        try:  # removals up to now: after every row was copied
            out.base_clock, out.removed = base_clock, table.removed_since(since)
        except errors.FailedPreconditionError as e:
            raise IncompleteDelta(str(e)) from None
        return out

    # A row in the file: its id, values, slots and step, and its stamps (at
    # most its record in memory and its 8-byte id).
    max_bytes = table.size() * (table.record_bytes + 8)

    def whole() -> TableRows:
        return TableRows(
            table.config, table.dim, table.slot_floats, chunks(False), state, max_bytes=max_bytes
        )

    if not tracked:
        return whole()
    rows = TableRows(
        table.config, table.dim, table.slot_floats, chunks(True), delta_state, max_bytes=max_bytes
    )
    rows.whole = whole
    return rows


# Bytes of one HDF5 chunk of a table's datasets (float32 rows).
_STORAGE_CHUNK_BYTES = 1 << 20


def _write_table(group: h5py.Group, rows: TableRows) -> tuple[int, TableState]:
    """Streams one table's chunks into `group`; returns its row count and state."""
    group.attrs["config"] = json.dumps(rows.config, sort_keys=True)
    dim, slots = rows.dim, rows.slot_floats
    first = next(rows.chunks, None)
    # HDF5 chunks of about 1 MiB, never larger than a small table.
    per_row = file_row_bytes(dim, slots)
    storage = max(
        1, min(_STORAGE_CHUNK_BYTES // per_row, len(first[0]) if first is not None else 1)
    )

    def dataset(name: str, dtype: Any, width: int | None) -> h5py.Dataset:
        shape, chunks = ((0,), (storage,)) if width is None else ((0, width), (storage, width))
        maxshape = (None,) if width is None else (None, width)
        return group.create_dataset(name, shape, dtype, maxshape=maxshape, chunks=chunks)

    value_dtype, slot_dtype = table_dtypes(rows.config)
    ids = dataset("ids", np.int64, None)
    values = dataset("values", stored_dtype(value_dtype), dim)
    values.attrs["dtype"] = value_dtype
    steps = dataset("steps", np.uint32, None)
    touched = dataset("touched", np.uint32, None)
    slot_ds = dataset("slots", stored_dtype(slot_dtype), slots) if slots else None
    if slot_ds is not None:
        slot_ds.attrs["dtype"] = slot_dtype
    counts = np.zeros(NUM_BUCKETS, np.int64)
    n = 0
    for c_ids, c_values, c_slots, c_steps, c_buckets, c_touched in (
        itertools.chain([first], rows.chunks) if first is not None else ()
    ):
        m = len(c_ids)
        if m == 0:
            continue
        _refuse_non_finite(str(rows.config["name"]), c_ids, c_values, c_slots)
        for ds in (ids, values, slot_ds, steps, touched):
            if ds is not None:
                ds.resize(n + m, axis=0)
        ids[n : n + m] = c_ids
        values[n : n + m] = narrow(c_values, value_dtype)
        if slot_ds is not None:
            slot_ds[n : n + m] = narrow(c_slots, slot_dtype)
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
    group.attrs["mode"] = state.mode
    if state.base_clock is not None:
        removed = np.asarray(state.removed if state.removed is not None else [], np.int64)
        group.attrs["base_clock"] = state.base_clock
        group.create_dataset("removed", data=removed)
        group.create_dataset("removed_offsets", data=_bucket_offsets(removed))
    if state.sketch is not None and state.added is not None:
        group.create_dataset("sketch", data=state.sketch)
        group.create_dataset("sketch_added", data=state.added)
        group.attrs["sketch_first_bucket"] = state.first_bucket
    return n, state


def _refuse_non_finite(
    name: str, ids: np.ndarray, values: np.ndarray, slots: np.ndarray | None
) -> None:
    """A save never commits what its load would refuse: a row holding a
    non-finite value (which no push, assign or import lets in) fails it."""
    for what, data in (("values", values), ("optimizer slots", slots)):
        if data is None or data.size == 0:
            continue
        bad = ~np.isfinite(data).all(axis=1)
        if bad.any():
            raise errors.InternalError(
                f"table {name!r}: the {what} of id {int(ids[np.argmax(bad)])} are not finite; "
                "the save stops here, so no checkpoint holds them"
            )


def _bucket_offsets(ids: np.ndarray) -> np.ndarray:
    """Offsets [NUM_BUCKETS + 1] of ids sorted by bucket."""
    counts = np.bincount(_native.bucket_of(ids), minlength=NUM_BUCKETS) if len(ids) else 0
    offsets = np.zeros(NUM_BUCKETS + 1, np.int64)
    np.cumsum(np.broadcast_to(counts, (NUM_BUCKETS,)), out=offsets[1:])
    return offsets


def _write_shard_file(
    local_path: str, layout: ShardLayout, tables: list[TableRows], save_id: str
) -> list[dict[str, Any]]:
    """Streams `tables` (sorted by name) into an HDF5 file; returns table
    infos. A write that fails (a full disk) raises its OSError, not what
    HDF5's close then says of the file it could not finish."""
    _check_space(local_path, tables)
    f = h5py.File(
        local_path, "w", meta_block_size=_META_BLOCK_BYTES, rdcc_nbytes=_CHUNK_CACHE_BYTES
    )
    try:
        infos = _write_tables(f, layout, tables, save_id)
    except BaseException:
        with contextlib.suppress(Exception):
            f.close()
        raise
    try:
        f.close()  # flushes what HDF5 still holds: may meet the full disk
    except RuntimeError as e:  # "... errno = 28, error message = ..."
        found = re.search(r"errno = (\d+)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, f"{os.strerror(code)} (closing {local_path})") from e
    return infos


def _check_space(local_path: str, tables: list[TableRows]) -> None:
    """OSError (ENOSPC, or EFBIG past the process's file size limit) unless
    the file system holds room for the file at its largest: rows of a table
    at most its whole table's (a delta's too), its metadata blocks with a
    margin. HDF5 meeting a full disk while it flushes metadata (at a
    dataset's or the file's close) left the library broken and the shard
    crashed (SIGSEGV), losing every row since the last checkpoint."""
    rows = sum(t.max_bytes for t in tables)
    need = rows + rows // 20 + (2 + len(tables)) * _META_BLOCK_BYTES
    directory = os.path.dirname(local_path) or "."
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    mib = 1 << 20
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"{os.strerror(errno.ENOSPC)}: this shard file takes up to {need / mib:.1f} MiB, "
            f"{free / mib:.1f} MiB are free (checked before writing anything)",
        )
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < need:
        raise OSError(
            errno.EFBIG,
            f"{os.strerror(errno.EFBIG)}: this shard file takes up to {need / mib:.1f} MiB, "
            f"past this process's file size limit of {limit / mib:.1f} MiB (ulimit -f)",
        )


def _write_tables(
    f: h5py.File, layout: ShardLayout, tables: list[TableRows], save_id: str
) -> list[dict[str, Any]]:
    """The shard file's attributes and tables; returns table infos."""
    infos = []
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
        name = f"t{k:05d}"
        try:
            n, state = _write_table(group.create_group(name), rows)
        except IncompleteDelta:
            if rows.whole is None:
                raise
            # Removals the delta would miss: the table is written whole
            # instead, as a table whose changes are not tracked.
            del group[name]
            rows = rows.whole()
            # (the delta's rows keep their room in the file: room for the
            # whole table is made sure of again)
            group.file.flush()
            _check_space(group.file.filename, [rows])
            n, state = _write_table(group.create_group(name), rows)
        removed = 0 if state.removed is None else len(state.removed)
        infos.append({"config": rows.config, "rows": n, "mode": state.mode, "removed": removed})
    return infos


def save_shard(
    path: str,
    shard: _native.Shard,
    save_id: str,
    base: str = "",
    *,
    tables: list[str] | None = None,
) -> dict[str, Any]:
    """Writes this shard's file into checkpoint directory `path` (see
    `save_tables`); on top of save `base`, only what changed since.
    `tables`: only these (NOT_FOUND naming one the shard lacks); None:
    every table of the shard."""
    layout = ShardLayout(shard.shard_index, shard.num_shards, shard.first_bucket, shard.end_bucket)
    chosen = shard.tables() if tables is None else [shard.get_table(n) for n in sorted(set(tables))]
    with persisting(shard):
        rows = [native_rows(t, layout, save_id, base) for t in chosen]
        return save_tables(path, layout, rows, save_id)


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
    make_directory(fs, root)
    target = f"{root}/{name}"
    if is_local(fs):
        try:
            with replaced_durably(target) as (_, tmp):  # HDF5 opens it by name
                infos = _write_shard_file(tmp, layout, tables, save_id)
                with open(tmp, "rb") as f:
                    sha, blocks = verified.file_digests(f)
                # Before the rename: a newer save to the path may remove
                # the file as soon as it has its name (the manifest then
                # says so).
                size = os.path.getsize(tmp)
        except FileNotFoundError as e:
            if not os.path.isdir(root):
                raise  # the directory went (a prune?): NotFoundError naming it
            # A newer save to the path committed and removed this older
            # one's file as superseded while it was written.
            raise errors.FailedPreconditionError(
                f"{name} was removed from {path} while this save ({save_id}) wrote it (a newer "
                "save to the same path superseded it?); this save is dropped (one save to a "
                "path at a time)"
            ) from e
    else:
        with tempfile.TemporaryDirectory(prefix="tf_dlt-save-") as spool:
            local = os.path.join(spool, name)
            infos = _write_shard_file(local, layout, tables, save_id)
            with open(local, "rb") as f:
                sha, blocks = verified.file_digests(f)
            size = os.path.getsize(local)
            put_durably(fs, local, target)  # within a deadline
    return {
        "file": name,
        "sha256": sha,
        "block_bytes": verified.BLOCK_BYTES,
        "block_sha256": blocks,
        "meta_block_bytes": _META_BLOCK_BYTES,
        "bytes": size,
        "shard_index": layout.shard_index,
        "num_shards": layout.num_shards,
        "first_bucket": layout.first_bucket,
        "end_bucket": layout.end_bucket,
        "tables": infos,
        "seconds": time.monotonic() - start,
    }
