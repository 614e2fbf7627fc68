"""Checkpoint files of one shard: HDF5 (h5py) written through fsspec.

Layout of a checkpoint directory (see docs/checkpoints.md):

    MANIFEST.json                          written last; commits the checkpoint
    MANIFEST.<save_id>.json                its copy, written just before
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

The format's shared parts are in `shard_format`, writing in `shard_save`
and reading in `shard_load`; this module names what the rest of tf_dlt uses.
"""

from tf_dlt.checkpoint.shard_format import (
    Chunk,
    ShardLayout,
    TableRows,
    TableState,
    chunk_rows,
    file_row_bytes,
)
from tf_dlt.checkpoint.shard_load import (
    WouldEvict,
    apply_link,
    load_shard,
    prepare_load,
    restore_rows,
    takes_every_row,
)
from tf_dlt.checkpoint.shard_save import native_rows, native_state, save_shard, save_tables

__all__ = [
    "Chunk",
    "ShardLayout",
    "TableRows",
    "TableState",
    "WouldEvict",
    "apply_link",
    "chunk_rows",
    "file_row_bytes",
    "load_shard",
    "native_rows",
    "native_state",
    "prepare_load",
    "restore_rows",
    "save_shard",
    "save_tables",
    "takes_every_row",
]
