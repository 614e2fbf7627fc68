"""export_saved_model: a TF SavedModel of a Keras model with distributed
embeddings, in one of two modes.

- "remote": the graph looks rows up on the shard servers (Dlt>Client and
  Dlt>Lookup only: custom gradients are not saved, so no push op is in it).
  Loading needs `import tf_dlt` first; TF_DLT_PSERVERS re-points it.
- "standalone": the rows are materialised into stock TensorFlow ops (an id ->
  index hash table and a dense variable), so plain TensorFlow and TF Serving
  load it without tf_dlt. Ids not exported read as zeros.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_dlt import dlt_ops as ops
from tf_dlt.layers.embedding import distributed_layers

MODES = ("remote", "standalone")


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
    return model(xs[0] if len(xs) == 1 else list(xs), training=False)


def _signature(model: keras.Model) -> list[tf.TensorSpec]:
    return [tf.TensorSpec(i.shape, i.dtype, name=i.name) for i in model.inputs]


def export_saved_model(
    model: keras.Model,
    path: str,
    mode: str = "remote",
    *,
    ids: dict[str, Sequence[int] | np.ndarray] | None = None,
) -> None:
    """Writes `model` as a SavedModel with a "serve" endpoint.

    Args:
        model: a built Keras model (Functional or Sequential).
        path: output directory.
        mode: "remote" or "standalone" (see the module docstring).
        ids: standalone mode only: per table name, the ids to materialise
            (e.g. the most frequent ones); by default every row of the table.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    layers = distributed_layers(model)
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
        archive.track(model)
        for layer in layers:
            archive.track(layer.client)
        with _serving(layers):  # tracing may happen as late as write_out
            archive.add_endpoint("serve", lambda *xs: _call(model, xs), _signature(model))
            archive.write_out(
                path, options=tf.saved_model.SaveOptions(experimental_custom_gradients=False)
            )
        return
    _export_standalone(model, path, layers, ids or {})


@keras.saving.register_keras_serializable(package="tf_dlt")
class StandaloneEmbedding(keras.layers.Layer):  # type: ignore[misc]
    """A distributed table frozen into stock TF ops: id -> row index through a
    static hash table, rows in a variable, unknown ids read as zeros."""

    def __init__(
        self, keys: np.ndarray, rows: np.ndarray, combiner: str | None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.combiner = combiner
        self.output_dim = int(rows.shape[1])
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(keys, tf.int64), tf.range(len(keys), dtype=tf.int64)
            ),
            default_value=len(keys),
        )
        padded = np.concatenate([rows, np.zeros((1, rows.shape[1]), np.float32)])
        self.rows = tf.Variable(padded, trainable=False, name="rows")

    def call(self, inputs: Any) -> Any:
        from tf_dlt.layers.embedding import combine

        if isinstance(inputs, tf.SparseTensor):
            inputs = tf.RaggedTensor.from_sparse(inputs)
        if isinstance(inputs, tf.RaggedTensor):
            found = tf.gather(self.rows, self.table.lookup(tf.cast(inputs.flat_values, tf.int64)))
            return combine(self.combiner, found, inputs.value_rowids(), inputs.nrows())
        return tf.gather(self.rows, self.table.lookup(tf.cast(inputs, tf.int64)))


def _rows_of(
    layer: Any, wanted: Sequence[int] | np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    if wanted is not None:
        keys = np.unique(np.asarray(wanted, np.int64))
        values = ops.lookup(layer.client, keys, layer.table_name, layer.output_dim, training=False)
        return keys, values.numpy()
    if not layer.client.embedded:
        raise ValueError(
            f"layer {layer.name!r} is on shard servers: pass ids={{{layer.table_name!r}: [...]}} "
            "to choose the rows a standalone model holds"
        )
    keys, values, _, _ = ops.export_table(layer.client, layer.table_name, layer.output_dim)
    return keys.numpy(), values.numpy()


def _export_standalone(
    model: keras.Model, path: str, layers: list[Any], ids: dict[str, Any]
) -> None:
    from tf_dlt.transpiler.transpile import copy_weights

    distributed = {id(layer) for layer in layers}

    def freeze(layer: keras.layers.Layer) -> keras.layers.Layer:
        if id(layer) in distributed:
            keys, values = _rows_of(layer, ids.get(layer.table_name))
            return StandaloneEmbedding(keys, values, layer.combiner, name=layer.name)
        return layer.__class__.from_config(layer.get_config())

    # A copy with no tf_dlt op or resource in it: plain TensorFlow loads it.
    frozen = keras.models.clone_model(model, clone_function=freeze, recursive=True)
    copy_weights(model, frozen)
    archive = keras.export.ExportArchive()
    archive.track(frozen)
    archive.add_endpoint("serve", lambda *xs: _call(frozen, xs), _signature(model))
    archive.write_out(path, options=tf.saved_model.SaveOptions(experimental_custom_gradients=False))
