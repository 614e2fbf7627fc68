"""Checkpoint files of one shard: HDF5 (h5py) written through fsspec.

Layout of a checkpoint directory (see docs/checkpoints.md):

    MANIFEST.json                          written last; commits the checkpoint
    shard-00000-of-00002.<save_id>.h5      one file per shard that saved

Each shard file holds, per table, the rows sorted by routing bucket with a
``bucket_offsets`` index, so a shard of any other shard count reads exactly
the row range of the buckets it owns; with them each row's update count and
last-touched stamp, the table's clock, and the admission sketch's slices of
the buckets the writer owned; in a delta, only the rows changed since its
base and the ids removed since. Every block of a file has its SHA-256 in the
manifest, checked before any of its rows is read (`verified`). Saving streams
rows in chunks; it never holds a second copy of the shard in memory. A load
applies each checkpoint of a chain in turn (`apply_link`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np

from tf_dlt import _native, errors
from tf_dlt.checkpoint import manifest as manifest_lib
from tf_dlt.checkpoint import verified
from tf_dlt.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    filesystem,
    is_local,
    shard_file_name,
)
from tf_dlt.routing import NUM_BUCKETS
from tf_dlt.table_config import difference, normalized

_CHUNK_BYTES = 8 << 20
# HDF5 places file metadata (the chunk indexes above all) in blocks of this
# size, so a load walks each dataset's index in a few verified blocks
# instead of one node in every block of the file.
_META_BLOCK_BYTES = 1 << 20


# One chunk of a table's rows in (bucket, id) order: ids, values, optimizer
# slots, update counts, routing buckets and last-touched stamps.
Chunk = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclasses.dataclass
class TableState:
    """What a table keeps besides its rows: its clock when the rows were
    read (stamps are saved relative to it for a push clock) and, with
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


def file_row_bytes(dim: int, slot_floats: int) -> int:
    """Bytes of one row in a shard file: values and slots (float32), id,
    update count and stamp."""
    return 4 * (dim + slot_floats) + 16


def chunk_rows(dim: int, slot_floats: int) -> int:
    """Rows per read or write batch (about 8 MiB)."""
    return max(1, _CHUNK_BYTES // file_row_bytes(dim, slot_floats))


def native_state(table: _native.Table, first_bucket: int, end_bucket: int) -> TableState:
    """A native table's clock and its sketch slices of [first_bucket,
    end_bucket)."""
    state = TableState(clock=table.now(), first_bucket=first_bucket)
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
    tracked, since, base_clock = table.begin_save(save_id, base) if save_id else (False, 0, 0)

    def chunks() -> Iterator[Chunk]:
        exporter = table.exporter(since if tracked else None)
        while (chunk := exporter.next(chunk_rows(table.dim, table.slot_floats))) is not None:
            yield chunk

    def state() -> TableState:
        out = native_state(table, layout.first_bucket, layout.end_bucket)
        if tracked:  # removals up to now: after every row was copied
            out.base_clock, out.removed = base_clock, table.removed_since(since)
        return out

    return TableRows(table.config, table.dim, table.slot_floats, chunks(), state)


def _write_table(group: h5py.Group, rows: TableRows) -> tuple[int, TableState]:
    """Streams one table's chunks into `group`; returns its row count and state."""
    group.attrs["config"] = json.dumps(rows.config, sort_keys=True)
    dim, slots = rows.dim, rows.slot_floats
    first = next(rows.chunks, None)
    # HDF5 chunks of about 1 MiB, never larger than a small table.
    per_row = file_row_bytes(dim, slots)
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
    infos."""
    infos = []
    with h5py.File(local_path, "w", meta_block_size=_META_BLOCK_BYTES) as f:
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
            n, state = _write_table(group.create_group(f"t{k:05d}"), rows)
            removed = 0 if state.removed is None else len(state.removed)
            infos.append({"config": rows.config, "rows": n, "mode": state.mode, "removed": removed})
    return infos


def save_shard(path: str, shard: _native.Shard, save_id: str, base: str = "") -> dict[str, Any]:
    """Writes this shard's file into checkpoint directory `path` (see
    `save_tables`); on top of save `base`, only what changed since."""
    layout = ShardLayout(shard.shard_index, shard.num_shards, shard.first_bucket, shard.end_bucket)
    tables = [native_rows(t, layout, save_id, base) for t in shard.tables()]
    return save_tables(path, layout, tables, save_id)


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
                sha, blocks = verified.file_digests(f)
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
                sha, blocks = verified.file_digests(f)
            size = os.path.getsize(local)
            fs.put_file(local, target)
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


def restore_rows(
    g: h5py.Group,
    table: _native.Table,
    buckets: tuple[int, int],
    offsets: np.ndarray,
    reader: verified.VerifiedBlocks | None,
) -> None:
    """Imports the rows of buckets [first, end) of file group `g` (whose
    checked `bucket_offsets` are `offsets`) into `table`, with their update
    counts and stamps, and the sketch slices the file has of those buckets;
    straight from `reader`'s verified blocks where it can. Stamps of a push
    clock count against the writer's own clock (each shard counts its
    pushes): they are restored as the same ages against `table`'s clock,
    whichever shards wrote them."""
    first, end = buckets
    saved_clock = int(g.attrs.get("clock", 0))
    seconds = table.config["policy"]["clock"] == "seconds"
    now = table.now()
    lo, hi = int(offsets[first]), int(offsets[end])
    step = chunk_rows(table.dim, table.slot_floats)
    slots = g["slots"] if "slots" in g else None
    touched = g["touched"] if "touched" in g else None
    raw = verified.RawRows(g, reader) if reader is not None else None
    if raw is not None and raw.ok:  # HDF5 chunk by HDF5 chunk, from the verified blocks

        def read(a: int, b: int) -> tuple[Any, ...]:
            assert raw is not None
            return tuple(raw.read(n, a, b) for n in ("ids", "values", "slots", "steps", "touched"))

        step = raw.chunk
    else:

        def read(a: int, b: int) -> tuple[Any, ...]:
            return (
                g["ids"][a:b], g["values"][a:b], None if slots is None else slots[a:b],
                g["steps"][a:b], None if touched is None else touched[a:b],
            )  # fmt: skip

    # One chunk is inserted (without the GIL) while the next is parsed.
    with ThreadPoolExecutor(1, thread_name_prefix="dlt-import") as importer:
        pending: Future[None] | None = None
        a = lo
        while a < hi:
            b = min(hi, a - a % step + step)
            ids, values, slot_rows, steps, stamps = read(a, b)
            a = b
            if stamps is not None:
                if not seconds:  # the same age against the table's clock (modulo 2^32)
                    age = (saved_clock - stamps.astype(np.int64)) % (1 << 32)
                    age[age >= 1 << 31] = 0  # newer than the clock (files of older builds)
                    stamps = (now - age) % (1 << 32)
            if pending is not None:
                pending.result()
            pending = importer.submit(table.import_rows, ids, values, slot_rows, steps, stamps)
        if pending is not None:
            pending.result()
    if "sketch" in g and table.sketch_slice_bytes:
        sketch_first = int(g.attrs["sketch_first_bucket"])
        added = g["sketch_added"]
        lo_b, hi_b = max(first, sketch_first), min(end, sketch_first + len(added))
        if lo_b < hi_b:
            rows = slice(lo_b - sketch_first, hi_b - sketch_first)
            table.write_sketch(
                lo_b, np.asarray(g["sketch"][rows], np.uint8), np.asarray(added[rows], np.uint32)
            )


NewTable = Callable[[dict[str, Any]], _native.Table]


def _offsets(g: h5py.Group, name: str, rows: int, where: str) -> np.ndarray:
    """A bucket offsets dataset, checked: NUM_BUCKETS + 1 non-decreasing
    offsets within the `rows` rows they index."""
    if name not in g:
        raise errors.FailedPreconditionError(f"{where} has no {name}")
    offsets = np.asarray(g[name][...], np.int64)
    if (
        offsets.shape != (NUM_BUCKETS + 1,)
        or offsets[0] != 0
        or np.any(np.diff(offsets) < 0)
        or offsets[-1] != rows
    ):
        raise errors.FailedPreconditionError(f"{where}: {name} is malformed")
    return offsets


def _apply_group(
    g: h5py.Group,
    entry: dict[str, Any],
    reader: verified.VerifiedBlocks | None,
    listed: dict[str, dict[str, Any]],
    tables: dict[str, _native.Table],
    new_table: NewTable,
    buckets: tuple[int, int],
    link: _LinkState,
) -> str:
    """Applies one table of one shard file to `tables` for buckets
    `buckets`: a full table's rows replace those of the file's buckets; a
    delta's removals go first, then its rows (changed or new) overwrite.
    Returns the table's name."""
    config = json.loads(g.attrs["config"])
    name = str(config["name"])
    where = f"{entry['file']} (table {name!r})"
    if name not in listed or normalized(listed[name]["config"]) != normalized(config):
        raise errors.FailedPreconditionError(
            f"{entry['file']} holds table {name!r} with a config the manifest does not list"
        )
    mode = str(g.attrs.get("mode", "full"))
    if mode not in ("full", "delta") or "ids" not in g or "values" not in g or "steps" not in g:
        raise errors.FailedPreconditionError(f"{where} is malformed")
    offsets = _offsets(g, "bucket_offsets", len(g["ids"]), where)
    table = tables.get(name)
    if table is None or normalized(table.config) != normalized(config):
        if mode != "full":
            raise errors.FailedPreconditionError(
                f"{entry['file']} holds changes to table {name!r} that the checkpoints before "
                "it do not have in this configuration: the chain is inconsistent"
            )
        table = tables[name] = new_table(config)
        link.fresh.add(name)
        link.clocks[name] = table.now()
    lo, hi = max(buckets[0], entry["first_bucket"]), min(buckets[1], entry["end_bucket"])
    if mode == "full":
        restore_rows(g, table, buckets, offsets, reader)
        if name not in link.fresh:
            # The rows of these buckets are the file's: the others go, after
            # the file's are in (a table in use never reads empty meanwhile).
            keep = np.asarray(g["ids"][int(offsets[lo]) : int(offsets[hi])], np.int64)
            table.erase_buckets(lo, hi, keep)
        return name
    if "base_clock" not in g.attrs:
        raise errors.FailedPreconditionError(f"{where} is a delta without its base_clock")
    removed = _offsets(g, "removed_offsets", len(g["removed"]) if "removed" in g else 0, where)
    table.erase(np.asarray(g["removed"][int(removed[lo]) : int(removed[hi])], np.int64))
    if config.get("policy", {}).get("clock") != "seconds":
        # Rows already here aged by the pushes the writer took since the
        # base; several writers of our buckets: the most of them.
        elapsed = (int(g.attrs["clock"]) - int(g.attrs["base_clock"])) % (1 << 32)
        target = (link.clocks.setdefault(name, table.now()) + elapsed) % (1 << 32)
        if (target - table.now()) % (1 << 32) < 1 << 31:
            table.set_push_clock(target)
    restore_rows(g, table, buckets, offsets, reader)
    return name


@dataclasses.dataclass
class _LinkState:
    """What applying one checkpoint of a chain keeps across its files: the
    tables it created (nothing to replace in them) and each table's clock
    when the link started."""

    fresh: set[str]
    clocks: dict[str, int]


def apply_link(
    link: manifest_lib.Link,
    tables: dict[str, _native.Table],
    new_table: NewTable,
    buckets: tuple[int, int],
    *,
    in_use: bool = False,
    threads: int = 1,
) -> None:
    """Applies one checkpoint of a chain to `tables` (name -> table) for the
    routing buckets [first, end): a full checkpoint replaces them with new
    tables; a delta changes them in place (tables created, replaced and
    dropped by it are changed in `tables`).

    `in_use`: the tables serve meanwhile. Every file of the link is then
    copied locally and verified whole before anything changes, and a table a
    delta holds whole gets its new rows before the old ones go.
    """
    m = link.manifest
    listed = {normalized(i["config"])["name"]: i for i in m["tables"]}
    fs, root = filesystem(link.path)
    entries = [
        e for e in m["files"] if e["end_bucket"] > buckets[0] and e["first_bucket"] < buckets[1]
    ]
    state = _LinkState(set(), {})
    if link.kind == "full":
        tables.clear()
        owned = (buckets[1] - buckets[0]) / NUM_BUCKETS
        file_bytes = sum(int(e["bytes"]) for e in entries)
        for name, info in listed.items():
            tables[name] = table = new_table(info["config"])
            state.fresh.add(name)
            # Sized for its share of the rows, never more than the files hold.
            most = file_bytes // file_row_bytes(table.dim, table.slot_floats)
            table.reserve(min(int(int(info["rows"]) * owned * 1.02) + 1024, most), threads)
    for name in [n for n in tables if n not in listed]:
        del tables[name]  # dropped since the previous checkpoint
    state.clocks.update({name: t.now() for name, t in tables.items()})

    def apply_file(
        entry: dict[str, Any], f: h5py.File, reader: verified.VerifiedBlocks | None
    ) -> None:
        held = {
            _apply_group(g, entry, reader, listed, tables, new_table, buckets, state)
            for g in f["tables"].values()
        }
        # A table the writer did not have (it restarted empty, say) has no
        # rows in the writer's buckets, as in a full checkpoint.
        lo, hi = max(buckets[0], entry["first_bucket"]), min(buckets[1], entry["end_bucket"])
        for name in set(listed) - held:
            if name in tables:
                tables[name].erase_buckets(lo, hi)

    if not in_use:
        for entry in entries:
            with verified.open_verified(fs, root, entry) as (f, reader):
                apply_file(entry, f, reader)
        return
    with tempfile.TemporaryDirectory(prefix="tf_dlt-apply-") as spool:
        for entry in entries:  # every byte verified before any table changes
            verified.fetch_verified(fs, root, entry, spool)
        local, local_root = filesystem(spool)
        for entry in entries:
            with verified.open_verified(local, local_root, entry) as (f, reader):
                apply_file(entry, f, reader)


def load_shard(path: str, shard: _native.Shard) -> dict[str, Any]:
    """Reads the rows this shard owns from checkpoint `path` and installs
    them (see `prepare_load`); a failed load leaves the shard as it was."""
    staged = prepare_load(path, shard)
    shard.install_tables(staged["staged"])
    return staged


def prepare_load(
    path: str,
    shard: _native.Shard,
    allow: Callable[[str], None] | None = None,
    *,
    replace: bool = False,
) -> dict[str, Any]:
    """Reads and verifies the rows this shard owns from checkpoint `path`
    (the chain of its full base and every delta up to it) into new tables,
    returned under "staged" and not installed.

    Works with any shard count at save time, and a different one for each
    checkpoint of the chain: rows are picked by routing bucket. Installing
    the staged tables (`shard.install_tables`) replaces same-named tables in
    one step, so a cluster can verify on every shard before any shard
    changes. The staged tables track changes from `path` on, so a delta
    saved on top of it later holds only what changed after the load.
    `allow` raises for a checkpoint of the chain the caller may not read.
    `replace`: a same-named table of another configuration on the shard is
    to be replaced (a follower), not a reason to refuse.
    """
    start = time.monotonic()
    chain = manifest_lib.resolve_chain(path, allow)
    head = chain[-1].manifest
    existing = {t.name: normalized(t.config) for t in shard.tables()}
    for info in head["tables"]:
        config = normalized(info["config"])
        name = config["name"]
        if not replace and name in existing and existing[name] != config:
            raise errors.FailedPreconditionError(
                f"table {name!r} on this shard differs from the checkpoint's "
                f"({difference(existing[name], config)}); drop the table first to load it"
            )
    tables: dict[str, _native.Table] = {}
    buckets = (shard.first_bucket, shard.end_bucket)
    for link in chain:
        apply_link(link, tables, shard.new_table, buckets, threads=os.cpu_count() or 1)
    staged = list(tables.values())
    for t in staged:
        t.mark_loaded(head["save_id"])
    return {
        "staged": staged,
        "save_id": head["save_id"],
        "links": len(chain),
        "tables": [
            {
                "config": t.config,
                "rows": t.size(),
                "bytes": t.bytes(),
                "record_bytes": t.record_bytes,
            }
            for t in staged
        ],
        "seconds": time.monotonic() - start,
    }
