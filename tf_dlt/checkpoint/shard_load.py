"""Loading shard files: a checkpoint chain (a full base and its deltas, any
shard count each) applied link by link to new tables holding the buckets a
shard owns, every block verified before its rows are read; the tables are
staged, and installed in one step by the caller."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np

from tf_dlt import _native, errors
from tf_dlt.checkpoint import manifest as manifest_lib
from tf_dlt.checkpoint import verified
from tf_dlt.checkpoint.manifest import filesystem
from tf_dlt.checkpoint.shard_format import (
    chunk_rows,
    file_row_bytes,
    persisting,
    stored_dtype,
    table_dtypes,
    widen,
)
from tf_dlt.routing import NUM_BUCKETS
from tf_dlt.table_config import difference, normalized


def restore_rows(
    g: h5py.Group,
    table: _native.Table,
    buckets: tuple[int, int],
    offsets: np.ndarray,
    reader: verified.VerifiedBlocks | None,
    evict: bool = True,
) -> None:
    """Imports the rows of buckets [first, end) of file group `g` (whose
    checked `bucket_offsets` are `offsets`) into `table`, with their update
    counts and stamps, and the sketch slices the file has of those buckets;
    straight from `reader`'s verified blocks where it can. `evict` false:
    every row is taken, max_rows or not (`takes_every_row`). Stamps of a push
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
    value_dtype = _stored_as(g["values"], table.config, 0)
    slot_dtype = _stored_as(slots, table.config, 1) if slots is not None else "float32"
    # Rows stored in the table's own dtypes are imported as they are (16-bit
    # rows are not widened here to be rounded back in the table); rows a
    # file stores as float32 for a 16-bit table are widened and rounded.
    wanted = table_dtypes(table.config)
    as_stored = value_dtype == wanted[0] and (slots is None or slot_dtype == wanted[1])
    imports = table.import_stored_rows if as_stored else table.import_rows
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

    if table.has_tier:  # batches of whole buckets: each tier page written once
        read_batch, spans = _whole_buckets(read, step, offsets[first : end + 1], table)
    else:  # a chunk at a time (a view of the verified block, no copy)
        read_batch, spans = read, _chunk_spans(lo, hi, step)
    # One batch is inserted (without the GIL) while the next is parsed.
    with ThreadPoolExecutor(1, thread_name_prefix="dlt-import") as importer:
        pending: Future[None] | None = None
        for a, b in spans:
            ids, values, slot_rows, steps, stamps = read_batch(a, b)
            if not as_stored:
                values = widen(values, value_dtype)
                if slot_rows is not None:
                    slot_rows = widen(slot_rows, slot_dtype)
            if stamps is not None:
                if not seconds:  # the same age against the table's clock (modulo 2^32:
                    # the low 32 bits, a mask, which numpy applies far faster than %)
                    age = (saved_clock - stamps.astype(np.int64)) & 0xFFFFFFFF
                    age[age >= 1 << 31] = 0  # newer than the clock: pushed as the save ran
                    stamps = (now - age) & 0xFFFFFFFF
            if pending is not None:
                pending.result()
            pending = importer.submit(imports, ids, values, slot_rows, steps, stamps, evict)
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


# The most bytes (as float32 rows) a batch of whole buckets for a tiered
# table holds: a load keeps two such batches, within the budget's reserve
# for a load's buffers (PERSIST_RESERVE_BYTES) beside the verified blocks.
_TIER_BATCH_BYTES = 24 << 20

Read = Callable[[int, int], tuple[Any, ...]]


def _chunk_spans(a: int, b: int, step: int) -> Iterator[tuple[int, int]]:
    """Rows [a, b) as spans that each lie within one chunk of `step` rows."""
    while a < b:
        end = min(b, a - a % step + step)
        yield a, end
        a = end


def _whole_buckets(
    read: Read, step: int, bounds: np.ndarray, table: _native.Table
) -> tuple[Read, Iterator[tuple[int, int]]]:
    """Batches for a table with a disk tier: rows [bounds[0], bounds[-1])
    (`bounds`: the rows where each bucket starts) cut at bucket starts, at
    least a chunk each and at most _TIER_BATCH_BYTES, and a `read` of such
    a batch (chunk by chunk, joined). A tier places a bucket's rows over its
    own window of pages: a batch that holds the whole bucket writes each of
    those pages once; chunks cutting a bucket write them once per chunk."""
    most = max(step, _TIER_BATCH_BYTES // file_row_bytes(table.dim, table.slot_floats))
    lo, hi = int(bounds[0]), int(bounds[-1])

    def spans() -> Iterator[tuple[int, int]]:
        a = lo
        while a < hi:
            k = int(np.searchsorted(bounds, min(a + step, hi)))
            b = int(bounds[k]) if k < len(bounds) else hi
            yield a, min(b, a + most)
            a = min(b, a + most)

    def read_batch(a: int, b: int) -> tuple[Any, ...]:
        parts = [read(x, y) for x, y in _chunk_spans(a, b, step)]
        if len(parts) == 1:
            return parts[0]
        columns = zip(*parts, strict=True)
        return tuple(None if c[0] is None else np.concatenate(c) for c in columns)

    return read_batch, spans()


def _stored_as(ds: h5py.Dataset, config: dict[str, Any], which: int) -> str:
    """The dtype dataset `ds` (values or slots) stores: its "dtype"
    attribute (files of earlier versions: float32), checked against the
    HDF5 type and the table's own dtype."""
    stored = ds.attrs.get("dtype", "float32")
    stored = stored.decode() if isinstance(stored, bytes) else str(stored)
    wanted = table_dtypes(config)[which]
    if stored not in ("float32", wanted) or ds.dtype != np.dtype(stored_dtype(stored)):
        raise errors.FailedPreconditionError(
            f"{ds.file.filename}: {ds.name} holds {stored} ({ds.dtype}) rows; "
            f"the table stores {wanted}"
        )
    return stored


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
) -> str | None:
    """Applies one table of one shard file to `tables` for buckets
    `buckets`: a full table's rows replace those of the file's buckets; a
    delta's removals go first, then its rows (changed or new) overwrite.
    Returns the table's name (None: a table the load leaves out)."""
    checked = _check_group(g, entry, listed, lambda n: _config_of(tables, n), link.skipped)
    if checked is None:
        return None
    config, mode, offsets = checked
    name = str(config["name"])
    where = f"{entry['file']} (table {name!r})"
    table = tables.get(name)
    if table is None or normalized(table.config) != normalized(config):
        table = tables[name] = new_table(config)
        link.fresh.add(name)
        link.clocks[name] = table.now()
    lo, hi = _overlap(buckets, entry)
    if mode == "full":
        restore_rows(g, table, buckets, offsets, reader, link.evict)
        if name not in link.fresh:
            # The rows of these buckets are the file's: the others go, after
            # the file's are in (a table in use never reads empty meanwhile).
            keep = np.asarray(g["ids"][int(offsets[lo]) : int(offsets[hi])], np.int64)
            table.erase_buckets(lo, hi, keep)
        return name
    table.erase(_removed_ids(g, lo, hi, where))
    if config.get("policy", {}).get("clock") != "seconds":
        # Rows already here aged by the pushes the writer took since the
        # base; several writers of our buckets: the most of them.
        elapsed = (int(g.attrs["clock"]) - int(g.attrs["base_clock"])) % (1 << 32)
        target = (link.clocks.setdefault(name, table.now()) + elapsed) % (1 << 32)
        if (target - table.now()) % (1 << 32) < 1 << 31:
            table.set_push_clock(target)
    restore_rows(g, table, buckets, offsets, reader, link.evict)
    return name


def _overlap(buckets: tuple[int, int], entry: dict[str, Any]) -> tuple[int, int]:
    """The buckets of `buckets` that manifest file entry `entry` holds."""
    return max(buckets[0], entry["first_bucket"]), min(buckets[1], entry["end_bucket"])


def _removed_ids(g: h5py.Group, lo: int, hi: int, where: str) -> np.ndarray:
    """The ids delta group `g` removed from buckets [lo, hi) (none when it
    holds no "removed")."""
    if "removed" not in g:
        return np.zeros(0, np.int64)
    at = _offsets(g, "removed_offsets", len(g["removed"]), where)
    return np.asarray(g["removed"][int(at[lo]) : int(at[hi])], np.int64)


def _config_of(tables: dict[str, _native.Table], name: str) -> dict[str, Any] | None:
    """The normalized config of table `name` of `tables` (None: none)."""
    table = tables.get(name)
    return None if table is None else normalized(table.config)


def _check_group(
    g: h5py.Group,
    entry: dict[str, Any],
    listed: dict[str, dict[str, Any]],
    config_of: Callable[[str], dict[str, Any] | None],
    skipped: frozenset[str],
) -> tuple[dict[str, Any], str, np.ndarray] | None:
    """What `_apply_group` checks of one table of one shard file before it
    changes anything, against `config_of` (the normalized config of the
    table of that name it would change, None: none): (config, mode, bucket
    offsets), or None for a table the load leaves out. Raises
    FailedPreconditionError naming the problem."""
    config = json.loads(g.attrs["config"])
    name = str(config["name"])
    if name in skipped:
        return None
    where = f"{entry['file']} (table {name!r})"
    if name not in listed or normalized(listed[name]["config"]) != normalized(config):
        raise errors.FailedPreconditionError(
            f"{entry['file']} holds table {name!r} with a config the manifest does not list"
        )
    mode = str(g.attrs.get("mode", "full"))
    if mode not in ("full", "delta") or "ids" not in g or "values" not in g or "steps" not in g:
        raise errors.FailedPreconditionError(f"{where} is malformed")
    offsets = _offsets(g, "bucket_offsets", len(g["ids"]), where)
    _stored_as(g["values"], config, 0)
    if "slots" in g:
        _stored_as(g["slots"], config, 1)
    if mode == "delta":
        if config_of(name) != normalized(config):
            raise errors.FailedPreconditionError(
                f"{entry['file']} holds changes to table {name!r} that the checkpoints before "
                "it do not have in this configuration: the chain is inconsistent"
            )
        if "base_clock" not in g.attrs:
            raise errors.FailedPreconditionError(f"{where} is a delta without its base_clock")
        _offsets(g, "removed_offsets", len(g["removed"]) if "removed" in g else 0, where)
    return config, mode, offsets


def rows_to_size(rows: int, owned: float, file_bytes: int, table: _native.Table) -> int:
    """The rows a table loaded from a checkpoint of `rows` rows is sized
    for: its `owned` share, with a margin, never more than `file_bytes` of
    files could hold at the fewest bytes a file spends on a row (as the
    table stores it; a file that widened 16-bit rows holds fewer). A tiered
    table sized for too few rows takes too much RAM for rows and outgrows
    its budget when its tier files double for the rest."""
    least = file_row_bytes(table.dim, table.slot_floats, *table_dtypes(table.config))
    return min(int(rows * owned * 1.02) + 1024, file_bytes // least)


@dataclasses.dataclass
class _LinkState:
    """What applying one checkpoint of a chain keeps across its files: the
    tables it created (nothing to replace in them), each table's clock when
    the link started, and whether imports trim tables to max_rows."""

    fresh: set[str]
    clocks: dict[str, int]
    skipped: frozenset[str] = frozenset()
    evict: bool = True


def apply_link(
    link: manifest_lib.Link,
    tables: dict[str, _native.Table],
    new_table: NewTable,
    buckets: tuple[int, int],
    *,
    in_use: bool = False,
    threads: int = 1,
    lean: bool = False,
    every_row: bool = False,
) -> None:
    """Applies one checkpoint of a chain to `tables` (name -> table) for the
    routing buckets [first, end): a full checkpoint replaces them with new
    tables; a delta changes them in place (tables created, replaced and
    dropped by it are changed in `tables`).

    `in_use`: the tables serve meanwhile. Every file of the link is then
    copied locally and verified whole before anything changes, and a table a
    delta holds whole gets its new rows before the old ones go; a link that
    would evict rows (a stripe past its share of max_rows) is refused,
    `WouldEvict`, before anything changes.
    `lean`: buffer few verified blocks (a shard with a memory budget).
    `every_row`: no table is trimmed to its max_rows as rows come in
    (`takes_every_row`).
    """
    m = link.manifest
    listed = {normalized(i["config"])["name"]: i for i in m["tables"]}
    entries = [
        e for e in m["files"] if e["end_bucket"] > buckets[0] and e["first_bucket"] < buckets[1]
    ]
    state = _LinkState(set(), {}, link.skipped, evict=not every_row)
    sizes: list[tuple[_native.Table, int]] = []
    if link.kind == "full":
        tables.clear()
        owned = (buckets[1] - buckets[0]) / NUM_BUCKETS
        fs, root = filesystem(link.files_at)
        stored = verified.stored_bytes(fs, [f"{root}/{e['file']}" for e in entries])
        file_bytes = sum(min(int(e["bytes"]), n) for e, n in zip(entries, stored, strict=True))
        for name, info in listed.items():
            tables[name] = table = new_table(info["config"])
            state.fresh.add(name)
            if lean and not table.has_tier:  # within a budget: grown as rows arrive
                continue
            sizes.append((table, rows_to_size(int(info["rows"]), owned, file_bytes, table)))
    for name in [n for n in tables if n not in listed]:
        del tables[name]  # dropped since the previous checkpoint
    state.clocks.update({name: t.now() for name, t in tables.items()})

    def size_tables() -> None:
        for table, rows in sizes:
            table.reserve(rows, threads)
            if table.has_tier:  # the hottest rows to RAM, wherever they come in the load
                table.begin_hot_load(rows)

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="dlt-reserve") as sizer:
            # The tables are sized (memory touched, without the GIL) while the
            # first file opens and its first blocks are read and verified.
            sized = sizer.submit(size_tables)
            _apply_files(link, entries, tables, new_table, buckets, state, sized, in_use, lean)
            sized.result()  # a link with no file for these buckets: its failure too
    finally:
        for table, _ in sizes:
            table.end_hot_load()


def _apply_files(
    link: manifest_lib.Link,
    entries: list[dict[str, Any]],
    tables: dict[str, _native.Table],
    new_table: NewTable,
    buckets: tuple[int, int],
    state: _LinkState,
    sized: Future[None],
    in_use: bool,
    lean: bool,
) -> None:
    """Applies the files `entries` of `link` (apply_link's second half),
    each once `sized` (the tables' sizing) is done."""
    listed = {normalized(i["config"])["name"]: i for i in link.manifest["tables"]}
    fs, root = filesystem(link.files_at)

    def apply_file(
        entry: dict[str, Any], f: h5py.File, reader: verified.VerifiedBlocks | None
    ) -> None:
        sized.result()
        # The groups are listed first: h5py's iterators hold its global
        # lock while suspended, and one left suspended by an error would
        # keep it held (every later save and load of the process waits).
        groups = list(f["tables"].values())
        held = {
            _apply_group(g, entry, reader, listed, tables, new_table, buckets, state)
            for g in groups
        } - {None}
        # A table the writer did not have (it restarted empty, say) has no
        # rows in the writer's buckets, as in a full checkpoint; one made
        # since the base (on the other writers) is made here too, empty:
        # the shards loading only such writers' buckets lacked it.
        lo, hi = _overlap(buckets, entry)
        for name in set(listed) - held:
            config = listed[name]["config"]
            if name in tables and normalized(tables[name].config) == normalized(config):
                tables[name].erase_buckets(lo, hi)
            else:  # (or made again since the base, as another table)
                tables[name] = new_table(config)
                state.fresh.add(name)
                state.clocks[name] = tables[name].now()

    if not in_use:
        for entry in entries:
            with verified.open_verified(fs, root, entry, lean=lean) as (f, reader):
                apply_file(entry, f, reader)
        return
    with tempfile.TemporaryDirectory(prefix="tf_dlt-apply-") as spool:
        for entry in entries:  # every byte verified before any table changes
            verified.fetch_verified(fs, root, entry, spool)
        local, local_root = filesystem(spool)
        # And every table of every file checked: a file refused half way
        # would leave the tables serving with part of the link applied.
        configs = {n: normalized(t.config) for n, t in tables.items()}
        coming: dict[str, _Coming] = {}  # each capped table's rows and removals
        for entry in entries:
            with verified.open_verified(local, local_root, entry, lean=lean) as (f, _):
                for g in list(f["tables"].values()):
                    checked = _check_group(g, entry, listed, configs.get, state.skipped)
                    if checked is None:
                        continue
                    config, mode, offsets = checked
                    if mode == "full":
                        configs[str(config["name"])] = normalized(config)
                    if state.evict and config.get("policy", {}).get("max_rows"):
                        _note_coming(coming, g, entry, buckets, config, mode, offsets)
        _refuse_rows_past_quota(link, coming, tables, new_table)
        for entry in entries:
            with verified.open_verified(local, local_root, entry, lean=lean) as (f, reader):
                apply_file(entry, f, reader)


class WouldEvict(errors.FailedPreconditionError):
    """Applied in place, a link would evict rows (a table's stripe past its
    share of max_rows): nothing was changed."""


@dataclasses.dataclass
class _Coming:
    """What one link brings a table: its config, its rows' ids and the ids
    it removes first (a delta's), over the link's files."""

    config: dict[str, Any]
    ids: list[np.ndarray]
    removed: list[np.ndarray]


def _note_coming(
    coming: dict[str, _Coming],
    g: h5py.Group,
    entry: dict[str, Any],
    buckets: tuple[int, int],
    config: dict[str, Any],
    mode: str,
    offsets: np.ndarray,
) -> None:
    """Adds to `coming` the ids a file's table group `g` (checked:
    `config`, `mode`, `offsets`) brings buckets `buckets`, and removes."""
    lo, hi = _overlap(buckets, entry)
    into = coming.setdefault(str(config["name"]), _Coming(config, [], []))
    into.ids.append(np.asarray(g["ids"][int(offsets[lo]) : int(offsets[hi])], np.int64))
    if mode != "full":
        into.removed.append(_removed_ids(g, lo, hi, f"{entry['file']} (table {config['name']!r})"))


def _refuse_rows_past_quota(
    link: manifest_lib.Link,
    coming: dict[str, _Coming],
    tables: dict[str, _native.Table],
    new_table: NewTable,
) -> None:
    """WouldEvict where the rows `coming` into a table would take one of
    its stripes past its share of max_rows once the link's removals went:
    they would evict rows as they came in, and the shard would serve the
    link with rows lost."""
    none = np.zeros(0, np.int64)
    for name, came in coming.items():
        config = came.config
        table = tables.get(name)
        if table is not None and table.has_tier:
            continue  # its keeper keeps max_rows across tiers, later
        if table is None or normalized(table.config) != normalized(config):
            table = new_table(config)  # made by the link: empty
        past = table.rows_past_quota(
            np.concatenate(came.ids), np.concatenate([none, *came.removed])
        )  # fmt: skip
        if past:
            raise WouldEvict(
                f"table {name!r}: applying {link.path} in place would take {past} rows past its "
                f"max_rows of {config['policy']['max_rows']} per shard (kept per stripe: each "
                "holds its share), evicting them; nothing was changed"
            )


# Bytes a table's index takes per row besides its record (measured: about
# 27 at a million rows; more while it grows).
_INDEX_BYTES_PER_ROW = 32


def _check_room(
    chain: list[manifest_lib.Link], shard: _native.Shard, buckets: tuple[int, int]
) -> None:
    """A load stages its tables beside the installed ones (a failed load
    changes nothing). On a shard with a memory budget and no disk tier the
    staged rows must fit beside what the process holds now: otherwise the
    load is refused before anything is read (RESOURCE_EXHAUSTED), never
    made to fit by evicting rows."""
    memory = shard.memory_status()
    budget = int(memory["budget"])
    if not budget or memory["storage_dir"]:
        return
    rows: dict[str, tuple[dict[str, Any], int]] = {}
    for link in chain:  # the full base's rows, and at most every delta's
        if link.kind == "full":
            rows.clear()
        for info in link.manifest["tables"]:
            name = normalized(info["config"])["name"]
            before = rows.get(name, (None, 0))[1]
            rows[name] = (info["config"], before + int(info["rows"]))
    owned = (buckets[1] - buckets[0]) / NUM_BUCKETS
    need = sum(
        n * owned * (_native.record_bytes(normalized(config)) + _INDEX_BYTES_PER_ROW)
        for config, n in rows.values()
    )
    resident = max(int(memory["resident"]), _native.Shard.resident_bytes())
    # Staged beside the installed tables within the budget (the keeper
    # counts staged tables as tables: it moves no installed row for them),
    # and once installed, without the tables they replace, within the
    # fraction of it the keeper holds the process to: past it the loaded
    # rows were evicted (40% of 500,000).
    replaced = sum(t.bytes() for t in shard.tables() if t.name in rows)
    reserve = _native.PERSIST_RESERVE_BYTES
    room = budget * _native.MEMORY_TARGET_FRACTION
    if resident + need + reserve > budget or resident - replaced + need + reserve > room:
        mib = 1 << 20
        raise errors.ResourceExhaustedError(
            f"shard {shard.shard_index}: this load stages about {need / mib:.0f} MiB of rows "
            f"beside the {resident / mib:.0f} MiB the process holds and the "
            f"{_native.PERSIST_RESERVE_BYTES / mib:.0f} MiB its buffers take, past the "
            f"{room / mib:.0f} MiB its memory budget of {budget / mib:.0f} MiB keeps the process "
            "to, and with no --storage-dir to spill to; "
            "nothing was read or changed. Raise --memory-budget, give the shard a "
            "--storage-dir, load onto more shards, or drop the tables the load replaces first"
        )


def _refuse_overflow(staged: list[_native.Table], shard: _native.Shard) -> None:
    """The staged rows measured: on a shard with a memory budget and no
    disk tier, the rows it would hold once they are installed (the staged
    tables and the installed ones they do not replace) must fit the room
    the memory keeper leaves rows beside what the process now holds that is
    not rows (the load's lasting part included: a load of 400,000 rows that
    `_check_room` let through grew it by 5 MiB, and the keeper evicted
    62,082 of them). Otherwise the load is refused (RESOURCE_EXHAUSTED),
    nothing installed."""
    memory = shard.memory_status()
    budget = int(memory["budget"])
    if not budget or memory["storage_dir"]:
        return
    names = {t.name for t in staged}
    installed = shard.tables()  # one listing: a table dropped meanwhile counts once
    rows = sum(t.bytes() for t in staged) + sum(t.bytes() for t in installed if t.name not in names)
    replaced = sum(t.bytes() for t in installed if t.name in names)
    outside = max(0, _native.Shard.trimmed_resident_bytes() - rows - replaced)
    room = budget * _native.MEMORY_TARGET_FRACTION - outside - _native.PERSIST_RESERVE_BYTES
    # Within the keeper's low water: a load at the edge (390,000 rows) went
    # past it by what the process grew after, and a pass evicts 5% at once.
    room *= _native.MEMORY_LOW_WATER
    if rows > room:
        mib = 1 << 20
        raise errors.ResourceExhaustedError(
            f"shard {shard.shard_index}: the rows this load staged ({rows / mib:.0f} MiB with "
            f"the tables it keeps) do not fit the {max(room, 0) / mib:.0f} MiB its memory "
            f"budget of {budget / mib:.0f} MiB leaves them beside the {outside / mib:.0f} MiB "
            f"the process holds besides and the {_native.PERSIST_RESERVE_BYTES / mib:.0f} MiB "
            "its buffers take, and there is no --storage-dir to spill to; nothing was "
            "changed. Raise --memory-budget, give the shard a --storage-dir, or load onto "
            "more shards"
        )


def takes_every_row(links: list[manifest_lib.Link], shard: _native.Shard) -> bool:
    """Whether `shard` takes every row `links` hold for it, max_rows or not:
    none was saved by more shards, so it holds no more rows than a saving
    shard held (a tiered table passes max_rows between the memory keeper's
    evictions, and a load of its checkpoint onto the same shard count was
    refused). Onto fewer shards, rows past max_rows are refused."""
    return all(0 < int(link.manifest.get("num_shards", 0)) <= shard.num_shards for link in links)


def _refuse_evictions(staged: list[_native.Table], shard: _native.Shard) -> None:
    """Rows past a staged table's max_rows (a checkpoint of more shards
    loaded onto fewer) would be lost: evicted as they were staged (one
    checkpoint, in RAM), or, staged whole (a chain), by the next rows made
    or the memory keeper (a tiered table keeps max_rows across its tiers
    there). The load is refused, naming the table and how many rows, and
    nothing changes. (Onto as many shards or more, every row is taken: one
    shard held them.)"""
    for t in staged:
        evicted = int(t.counters()["evicted"])
        max_rows = int(t.config["policy"]["max_rows"])
        if evicted:
            raise errors.FailedPreconditionError(
                f"table {t.name!r}: loading it onto shard {shard.shard_index} of "
                f"{shard.num_shards} evicted {evicted} rows: its rows there go past its "
                f"max_rows of {max_rows} per shard (kept per stripe: each of its stripes holds "
                "its share), so nothing was changed. Load onto more shards, or raise max_rows"
            )
        if max_rows and t.size() > max_rows:
            raise errors.FailedPreconditionError(
                f"table {t.name!r}: the checkpoint holds {t.size()} rows for shard "
                f"{shard.shard_index} of {shard.num_shards}, past its max_rows of {max_rows} per "
                f"shard; loading would drop at least {t.size() - max_rows} of them, so nothing "
                "was changed. Load onto more shards, or raise max_rows"
            )
        past = t.rows_held_past_quota()
        if past:  # (each of a table's stripes holds its share: one fills before the table)
            raise errors.FailedPreconditionError(
                f"table {t.name!r}: the checkpoint holds {t.size()} rows for shard "
                f"{shard.shard_index} of {shard.num_shards}, {past} of them past its max_rows of "
                f"{max_rows} per shard as kept per stripe (each of its stripes holds its share), "
                "where the next rows made would evict them; nothing was changed. Load onto more "
                "shards, or raise max_rows"
            )


def load_shard(
    path: str, shard: _native.Shard, allow: Callable[[str], str | None] | None = None
) -> dict[str, Any]:
    """Reads the rows this shard owns from checkpoint `path` and installs
    them (see `prepare_load`, and its `allow`); a failed load leaves the
    shard as it was."""
    staged = prepare_load(path, shard, allow)
    shard.install_tables(staged["staged"])
    return staged


def prepare_load(
    path: str,
    shard: _native.Shard,
    allow: Callable[[str], str | None] | None = None,
    *,
    replace: bool = False,
    tables: list[str] | None = None,
    save_id: str = "",
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
    `allow` raises for a checkpoint of the chain the caller may not read,
    and may return where to read it through (`manifest.resolve_chain`).
    `replace`: a same-named table of another configuration on the shard is
    to be replaced (a follower), not a reason to refuse. `tables`: stage
    only these of the checkpoint's tables (a model's); None: all of them.
    `save_id`: the save the caller read at `path` (other shards read it
    too); another one there is refused (FailedPreconditionError). Empty:
    whichever is there.
    """
    with persisting(shard):
        try:
            return _prepare_load(path, shard, allow, replace, tables, save_id)
        except BaseException as e:
            _free_frames(e)
            raise


def _free_frames(e: BaseException) -> None:
    """Clears the locals of the finished frames that `e`, and the errors it
    was raised from, passed through: the tables a failed load staged, which
    they hold, are freed now (their RAM and tier files), not whenever a
    garbage collection meets a cycle that keeps the error (a server's
    handling of it made one)."""
    pending: list[BaseException | None] = [e]
    seen = set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def _refuse_saved_again(link: manifest_lib.Link, missing: errors.DltError) -> None:
    """Raises FailedPreconditionError saying so when checkpoint `link`,
    whose files failed to read, holds another save now: a save to its path
    committed while this load read it and removed the files it replaced."""
    try:
        now = manifest_lib.committed_save_id(*manifest_lib.filesystem(link.files_at))
    except Exception:  # noqa: BLE001 - the file not found is the error to report
        return
    if now and now != link.save_id:
        raise errors.FailedPreconditionError(
            f"{link.path} was saved again as it was read: it holds save {now}, and the read "
            f"began at save {link.save_id}, whose files that save removed ({missing.message}); "
            "nothing was taken from it: read it again once no save to it runs"
        ) from missing


def _prepare_load(
    path: str,
    shard: _native.Shard,
    allow: Callable[[str], str | None] | None,
    replace: bool,
    only: list[str] | None,
    save_id: str,
) -> dict[str, Any]:
    start = time.monotonic()
    chain = manifest_lib.resolve_chain(path, allow)
    if save_id and chain[-1].save_id != save_id:
        raise errors.FailedPreconditionError(
            f"{path} was saved again as it was read: it holds save {chain[-1].save_id}, and "
            f"the read began at save {save_id} (other shards read that one); nothing was "
            "taken from it: read it again once no save to it runs"
        )
    if only is not None:
        chain = [link.only(set(only)) for link in chain]
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
    buckets = (shard.first_bucket, shard.end_bucket)
    _check_room(chain, shard, buckets)
    tables: dict[str, _native.Table] = {}
    lean = bool(shard.memory_status()["budget"])
    whole = takes_every_row(chain, shard)
    # A chain is staged whole, trimmed by none: what counts is what its head
    # holds (a base past max_rows whose deltas removed rows since fits, and
    # was refused as it evicted link by link). One checkpoint is trimmed as
    # it comes in (its rows past max_rows never all held), and refused.
    chained = len(chain) > 1

    try:
        for link in chain:
            try:
                apply_link(
                    link, tables, shard.new_table, buckets,
                    threads=os.cpu_count() or 1, lean=lean, every_row=whole or chained,
                )  # fmt: skip
            except (errors.NotFoundError, errors.FailedPreconditionError) as e:
                _refuse_saved_again(link, e)  # its files removed by a save meanwhile?
                raise
        staged = list(tables.values())
        if not whole:
            _refuse_evictions(staged, shard)
        _refuse_overflow(staged, shard)
    except BaseException:
        # The functions that applied the files hold `tables` in a cycle
        # (with the error's frames); emptied, it frees the staged tables.
        tables.clear()
        raise
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
