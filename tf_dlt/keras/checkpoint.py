"""tf_dlt.save / tf_dlt.load: a model's tables (every distributed embedding,
with optimizer state) and its dense weights, together, to any fsspec path.

Layout of `path`:

    tables/            a tf_dlt checkpoint (docs/checkpoints.md): MANIFEST.json + shard files
    dense.weights.h5   the Keras weights of the model (model.save_weights)
    tf_dlt_model.json  written last: what the checkpoint holds; commits it

Embedded tables are written in the same checkpoint format as shard servers
write theirs (one shard), so either kind loads the other's checkpoint.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from typing import Any

import keras
import numpy as np

from tf_dlt import _native, errors, routing
from tf_dlt import dlt_ops as ops
from tf_dlt.checkpoint import manifest, shard_files
from tf_dlt.client import Client
from tf_dlt.keras.walk import cluster_of, distributed_layers, table_holders
from tf_dlt.table_config import difference, normalized

MODEL_FILE = "tf_dlt_model.json"
DENSE_FILE = "dense.weights.h5"
TABLES_DIR = "tables"
_CHUNK = 1 << 16


def save(model: keras.Model, path: str) -> dict[str, Any]:
    """Saves the tables of `model`'s distributed embeddings (waiting for
    pending pushes first) and its dense weights under `path`."""
    layers = table_holders(model)
    for layer in layers:
        ops.flush(layer.client)
    addresses, token = cluster_of(layers)
    fs, root = manifest.filesystem(path)
    fs.makedirs(root, exist_ok=True)
    tables = f"{path.rstrip('/')}/{TABLES_DIR}"
    if addresses:
        with Client(addresses, auth_token=token) as client:
            client.save(tables)
    elif layers:
        # Straight from the embedded tables into the file, a chunk at a time.
        rows = []
        for layer in layers:
            config = layer.table_config.to_dict()
            slot_floats = _native.Table(config).slot_floats
            state = functools.partial(_embedded_state, layer)
            chunks = ops.export_chunks(
                layer.client, layer.table_name, layer.output_dim,
                shard_files.chunk_rows(layer.output_dim, slot_floats),
            )  # fmt: skip
            rows.append(shard_files.TableRows(config, layer.output_dim, slot_floats, chunks, state))
        save_id = manifest.new_save_id()
        part = shard_files.save_tables(tables, shard_files.ShardLayout(), rows, save_id)
        manifest.write_manifest(tables, [part], save_id)
    with tempfile.TemporaryDirectory(prefix="tf_dlt-save-") as tmp:
        local = os.path.join(tmp, DENSE_FILE)
        model.save_weights(local)
        fs.put_file(local, f"{root}/{DENSE_FILE}")
    info = {
        "format": "tf_dlt-model",
        "format_version": 1,
        "tables": [layer.table_name for layer in layers],
        "transport": "tcp" if addresses else "embedded",
        "created_unix": time.time(),
    }
    fs.pipe_file(f"{root}/{MODEL_FILE}", json.dumps(info, indent=2).encode())
    return info


def load(model: keras.Model, path: str) -> dict[str, Any]:
    """Restores what `save` wrote: the dense weights into `model` and the rows
    (with optimizer state) into the tables its layers use now, on shard
    servers or embedded, whichever held them at save time."""
    fs, root = manifest.filesystem(path)
    try:
        info: dict[str, Any] = json.loads(fs.cat_file(f"{root}/{MODEL_FILE}"))
    except FileNotFoundError:
        raise errors.NotFoundError(f"no tf_dlt model checkpoint at {path!r}") from None
    layers = table_holders(model)
    # Tables following the compiled optimizer take its form before their
    # configs are compared with the checkpoint's.
    if getattr(model, "compiled", False):
        for layer in distributed_layers(model):
            layer.follow_optimizer(model.optimizer)
    missing = set(info["tables"]) - {layer.table_name for layer in layers}
    if missing:
        raise errors.FailedPreconditionError(
            f"the checkpoint holds tables {sorted(missing)} that the model has no layer for"
        )
    addresses, token = cluster_of(layers)
    tables = f"{path.rstrip('/')}/{TABLES_DIR}"
    if layers and addresses:
        with Client(addresses, auth_token=token) as client:
            client.load(tables)
    elif layers:
        _load_embedded(tables, layers)
    with tempfile.TemporaryDirectory(prefix="tf_dlt-load-") as tmp:
        local = os.path.join(tmp, DENSE_FILE)
        fs.get_file(f"{root}/{DENSE_FILE}", local)
        model.load_weights(local)
    return info


def _embedded_state(layer: Any) -> shard_files.TableState:
    """An embedded table's clock and sketch (all buckets), as a shard file
    records them."""
    clock, sketch, added = ops.table_state(layer.client, layer.table_name, layer.output_dim)
    if not len(added):
        return shard_files.TableState(clock)
    return shard_files.TableState(clock, sketch, added.astype(np.uint32))


def _load_embedded(tables: str, layers: list[Any]) -> None:
    staged = _native.Shard(0, 1)
    shard_files.load_shard(tables, staged)  # verified: checksums, configs
    by_name = {t.name: t for t in staged.tables()}
    for layer in layers:  # check everything before changing anything
        t = by_name.get(layer.table_name)
        if t is not None and normalized(t.config) != layer.table_config.to_dict():
            raise errors.FailedPreconditionError(
                f"table {layer.table_name!r} differs from the checkpoint's "
                f"({difference(layer.table_config.to_dict(), t.config)})"
            )
    for layer in layers:
        t = by_name.get(layer.table_name)
        if t is None:
            continue
        # The clock and sketch first: the stamps imported below are ages
        # against that clock.
        state = shard_files.native_state(t, 0, routing.NUM_BUCKETS)
        ops.set_table_state(
            layer.client, layer.table_name, layer.output_dim, state.clock, 0, state.sketch,
            state.added,
        )  # fmt: skip
        exporter = t.exporter()
        while (chunk := exporter.next(_CHUNK)) is not None:
            ids, values, slots, steps, _, touched = chunk
            ops.import_table(
                layer.client, layer.table_name, layer.output_dim, ids, values, slots,
                steps.astype(np.int64), touched.astype(np.int64),
            )  # fmt: skip


class ModelCheckpoint(keras.callbacks.Callback):  # type: ignore[misc]
    """Saves the model's tables and dense weights with `tf_dlt.save` every
    `every_n_epochs` epochs, to `path` formatted with ``epoch`` (1-based).

    Args:
        path: e.g. "s3://bucket/run/epoch-{epoch}".
        every_n_epochs: how often, in epochs.
    """

    def __init__(self, path: str, every_n_epochs: int = 1) -> None:
        super().__init__()
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        self.path = path
        self.every_n_epochs = every_n_epochs
        self.saved: list[str] = []
        self.epochs: list[int] = []  # epochs completed at each saved path

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if (epoch + 1) % self.every_n_epochs == 0:
            target = self.path.format(epoch=epoch + 1)
            save(self.model, target)
            self.saved.append(target)
            self.epochs.append(epoch + 1)
