"""export_saved_model: a TF SavedModel of a Keras model with distributed
embeddings, in one of two modes.

- "remote": the graph looks rows up on the shard servers (Dlt>Client and
  Dlt>Lookup only: custom gradients are not saved, so no push op is in it).
  Loading needs `import tf_dlt` first; TF_DLT_PSERVERS re-points it.
- "standalone": the rows are materialised into stock TensorFlow ops (an id ->
  index hash table and a dense variable), so plain TensorFlow and TF Serving
  load it without tf_dlt. Ids not exported read as zeros. It holds every row
  of each table, the rows of given ids, or the `most_frequent` rows (by the
  number of training pushes that touched each row, which the table counts).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_dlt import _native, embedded, errors
from tf_dlt import dlt_ops as ops
from tf_dlt.keras.walk import (
    clone_keeping_inputs,
    cluster_of,
    distributed_layers,
    walk_layers,
)
from tf_dlt.layers.embedding import exact_ids

MODES = ("remote", "standalone")
# Custom gradients are not saved: the graph then needs no push op.
_SAVE_OPTIONS = tf.saved_model.SaveOptions(experimental_custom_gradients=False)


@contextlib.contextmanager
def _serving(layers: list[Any]) -> Iterator[None]:
    for layer in layers:
        layer.serving = True
    try:
        yield
    finally:
        for layer in layers:
            layer.serving = False


def _call(model: keras.Model, xs: tuple[tf.Tensor, ...]) -> Any:
    """`model` on the endpoint's inputs `xs` (in the order of
    `model.inputs`), given in the structure the model takes: a dict of
    features was given as a list, and the export failed."""
    if len(xs) == 1:
        return model(xs[0], training=False)
    try:
        structure = model.input
    except (AttributeError, ValueError):  # never called on Inputs of its own
        structure = None
    if isinstance(structure, dict):
        return model(keras.tree.pack_sequence_as(structure, list(xs)), training=False)
    return model(list(xs), training=False)


def _composite(model: keras.Model) -> bool:
    """Whether an input of `model` is sparse or ragged."""
    return any(getattr(i, "sparse", False) or getattr(i, "ragged", False) for i in model.inputs)


def _track(archive: Any, model: keras.Model) -> None:
    """Tracks `model`'s variables in `archive`. A model with a sparse or
    ragged input is tracked layer by layer: saving a tracked model traces
    Keras's own default signature of it, with every input dense, which such
    a model cannot take."""
    if not _composite(model):
        archive.track(model)
        return
    for layer in walk_layers(model):
        if not isinstance(layer, keras.Model):
            archive.track(layer)


def _add_serve(archive: Any, model: keras.Model, called: keras.Model) -> None:
    """Adds the "serve" endpoint: `called` on inputs as dense, sparse or
    ragged as `model`'s. (The archive makes every input signature dense, so
    an endpoint with a sparse or ragged input is a tf.function of its own,
    traced here; ids per example for a layer with a combiner were taken
    dense, and the export failed or served the wrong shape.)"""
    specs = []
    for i in model.inputs:
        # Any batch size, as Keras's own export: a Sequential model built by
        # its first batch has that batch's size in its input's shape.
        shape = (None, *i.shape[1:])
        if getattr(i, "sparse", False):
            specs.append(tf.SparseTensorSpec(shape, i.dtype))
        elif getattr(i, "ragged", False):
            specs.append(tf.RaggedTensorSpec(shape, i.dtype, ragged_rank=len(shape) - 1))
        else:
            specs.append(tf.TensorSpec(shape, i.dtype, name=i.name))
    if not _composite(model):
        archive.add_endpoint("serve", lambda *xs: _call(called, xs), specs)
        return
    serve = tf.function(lambda *xs: _call(called, xs), input_signature=specs)
    serve.get_concrete_function()
    archive.add_endpoint("serve", serve)


def export_saved_model(
    model: keras.Model,
    path: str,
    mode: str = "remote",
    *,
    ids: dict[str, Sequence[int] | np.ndarray] | None = None,
    most_frequent: int | dict[str, int] | None = None,
    staging: str | None = None,
) -> None:
    """Writes `model` as a SavedModel with a "serve" endpoint.

    Args:
        model: a built Keras model (Functional or Sequential).
        path: output directory.
        mode: "remote" or "standalone" (see the module docstring).
        ids: standalone mode only: per table name, the ids to materialise;
            by default every row of the table.
        most_frequent: standalone mode only: keep only the K rows updated
            most often (ties: smaller id first), K for every table or per
            table name. Tables named in `ids` take those ids instead.
        staging: standalone mode, tables on shard servers: where the shards
            write a temporary checkpoint of the model's tables to read every
            row from (any fsspec path the servers and this process both
            reach, under their --checkpoint-root where they have one;
            default: a local temporary directory, right when the servers
            share this machine's filesystem). Removed after, with the
            directory itself where the export made it. Not needed when `ids`
            names every table.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "remote" and (ids or most_frequent is not None):
        raise ValueError("ids and most_frequent choose the rows of a standalone export")
    layers = distributed_layers(model)
    names = {layer.table_name for layer in layers}
    for what, given in (("ids", ids or {}), ("most_frequent", most_frequent)):
        unknown = sorted(set(given) - names) if isinstance(given, dict) else []
        if unknown:  # a misspelt name exported every row of the table meant
            raise ValueError(
                f"{what} names {unknown}, which no distributed layer of the model uses; its "
                f"tables are {sorted(names)}"
            )
    for layer in layers:  # every pending push lands before rows are read
        ops.flush(layer.client)
    if mode == "remote":
        for layer in layers:
            if layer.client.embedded:
                raise ValueError(
                    f"layer {layer.name!r} uses the embedded tables of this process, which a "
                    "remote SavedModel cannot reach: transpile the model onto shard servers "
                    "first, or export with mode='standalone'"
                )
        archive = keras.export.ExportArchive()
        _track(archive, model)
        for layer in layers:
            archive.track(layer.client)
        with _serving(layers):  # tracing may happen as late as write_out
            _add_serve(archive, model, model)
            archive.write_out(path, options=_SAVE_OPTIONS, verbose=False)
        return
    chosen = {layer.table_name: _chosen_rows(layer, ids or {}, most_frequent) for layer in layers}
    _export_standalone(model, path, layers, _read_rows(layers, chosen, staging))


@keras.saving.register_keras_serializable(package="tf_dlt")
class StandaloneEmbedding(keras.layers.Layer):  # type: ignore[misc]
    """A distributed table frozen into stock TF ops: id -> row index through a
    static hash table, rows in a variable, unknown ids read as zeros."""

    def __init__(
        self,
        keys: np.ndarray,
        rows: np.ndarray,
        combiner: str | None,
        mask_zero: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.autocast = False  # ids are ids (Embedding's)
        self.combiner = combiner
        self.mask_zero = mask_zero  # id 0 is padding, masked as the live layer masks it
        self.supports_masking = mask_zero
        self.output_dim = int(rows.shape[1])
        if len(keys) == 0:
            # A table without rows (never trained): TF's hash table takes no
            # empty initializer, and any id maps to the zero row, which is
            # what an id without a row reads anyway.
            keys, rows = np.zeros(1, np.int64), np.zeros((1, rows.shape[1]), np.float32)
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(keys, tf.int64), tf.range(len(keys), dtype=tf.int64)
            ),
            default_value=len(keys),
        )
        padded = np.concatenate([rows, np.zeros((1, rows.shape[1]), np.float32)])
        self.rows = tf.Variable(padded, trainable=False, name="rows")

    def call(self, inputs: Any) -> Any:
        from tf_dlt.layers.combiners import embed

        return embed(
            self,
            inputs,
            lambda ids: tf.cast(
                tf.gather(self.rows, self.table.lookup(exact_ids(ids, self.name))),
                self.compute_dtype,
            ),  # float32 rows leave in the compute dtype, as the live layer's do
        )

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return keras.ops.not_equal(inputs, 0) if self.mask_zero else None

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        from tf_dlt.layers import combiners

        return tuple(combiners.output_shape(self, input_shape))

    def compute_output_spec(self, inputs: Any) -> Any:
        from tf_dlt.layers import combiners

        return combiners.output_spec(self, inputs)


def _chosen_rows(
    layer: Any, ids: dict[str, Any], most_frequent: int | dict[str, int] | None
) -> np.ndarray | int | None:
    """A layer's choice: explicit ids, a most-frequent count, or None (all)."""
    if layer.table_name in ids:
        return np.unique(np.asarray(ids[layer.table_name], np.int64))
    k = most_frequent.get(layer.table_name) if isinstance(most_frequent, dict) else most_frequent
    if k is not None and (isinstance(k, bool) or int(k) < 1):
        raise ValueError(f"most_frequent must be a positive int, got {k!r}")
    return None if k is None else int(k)


def _read_rows(
    layers: list[Any], chosen: dict[str, np.ndarray | int | None], staging: str | None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(ids, values) to freeze per table name."""
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    scanned: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    on_shards = [
        layer
        for layer in layers
        if not layer.client.embedded and not isinstance(chosen[layer.table_name], np.ndarray)
    ]
    if on_shards:
        scanned.update(_scan_shards(on_shards, staging))
    for layer in layers:
        name, choice = layer.table_name, chosen[layer.table_name]
        if isinstance(choice, np.ndarray):
            values = ops.lookup(
                layer.client, choice, name, layer.output_dim, training=False, missing="zeros"
            )  # as the layer reads a row it does not hold
            rows[name] = (choice, values.numpy())
            continue
        if layer.client.embedded:
            keys, values, _, steps = embedded.rows(name)
            scanned[name] = (keys, values, steps)
        keys, values, steps = scanned[name]
        if choice is not None and choice < len(keys):
            top = np.lexsort((keys, -steps.astype(np.int64)))[:choice]
            keys, values = keys[top], values[top]
        rows[name] = (keys, values)
    return rows


def _scan_shards(
    layers: list[Any], staging: str | None
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every row (with its update count) of the layers' shard tables, read
    from a checkpoint the shards write to `staging`."""
    import secrets
    import tempfile

    from tf_dlt.checkpoint import manifest, shard_files
    from tf_dlt.client import Client

    addresses, token = cluster_of(layers)
    with tempfile.TemporaryDirectory(prefix="tf_dlt-export-") as tmp:
        # This export's own name: another export staging beside it keeps
        # its own checkpoint.
        path = f"{(staging or tmp).rstrip('/')}/export-rows-{secrets.token_hex(6)}"
        fs, root = manifest.filesystem(path)
        made = ""  # the staging directory, where this export made it
        if staging is not None:
            _, staged_in = manifest.filesystem(staging)
            there = staged_in and manifest.within_deadline(
                fs, lambda **o: fs.exists(staged_in, **o), "looking up", staged_in
            )
            if staged_in and not there:  # "": the filesystem's root
                made = staged_in
        try:
            with Client(addresses, auth_token=token) as client:
                try:
                    # The model's tables only: other models' on the same
                    # shards are not read, written nor held here.
                    client.save(path, tables=sorted({layer.table_name for layer in layers}))
                except errors.PermissionDeniedError as e:
                    raise errors.PermissionDeniedError(
                        f"{e.message}. A standalone export has the shards write the rows to "
                        "`staging` (default: a local temporary directory): pass staging= a "
                        "directory under their --checkpoint-root that this process reads too"
                    ) from e
            staged = _native.Shard(0, 1)
            shard_files.load_shard(path, staged)
        finally:
            if staging is not None:
                with contextlib.suppress(FileNotFoundError):
                    manifest.within_deadline(
                        fs, lambda **o: fs.rm(root, recursive=True, **o), "removing", root
                    )
                if made and manifest.is_local(fs):  # elsewhere no directory stays
                    with contextlib.suppress(OSError):
                        os.rmdir(made)  # only if nothing else came to it
    out = {}
    for layer in layers:
        exporter = staged.get_table(layer.table_name).exporter()
        chunks = []
        while (chunk := exporter.next(1 << 16)) is not None:
            chunks.append((chunk[0], chunk[1], chunk[3]))
        if not chunks:
            dim = layer.output_dim
            chunks = [
                (np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros(0, np.uint32))
            ]
        ids, values, steps = (np.concatenate(parts) for parts in zip(*chunks, strict=True))
        out[layer.table_name] = (ids, values, steps)
    return out


def _export_standalone(
    model: keras.Model,
    path: str,
    layers: list[Any],
    rows: dict[str, tuple[np.ndarray, np.ndarray]],
) -> None:

    distributed = {id(layer) for layer in layers}

    def freeze(layer: keras.layers.Layer) -> keras.layers.Layer:
        if id(layer) in distributed:
            keys, values = rows[layer.table_name]
            return StandaloneEmbedding(
                keys, values, layer.combiner, layer.mask_zero, name=layer.name,
                dtype=layer.dtype_policy,
            )  # fmt: skip
        # The layer itself: made again from its config, a layer whose state
        # is not in its weights lost it (an adapted IntegerLookup's
        # vocabulary: the export served "Table not initialized").
        return layer

    # A copy with no tf_dlt op or resource in it: plain TensorFlow loads it.
    frozen = clone_keeping_inputs(model, freeze)
    archive = keras.export.ExportArchive()
    _track(archive, frozen)
    _add_serve(archive, model, frozen)
    archive.write_out(path, options=_SAVE_OPTIONS, verbose=False)
