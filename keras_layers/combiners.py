"""How a distributed Embedding reduces the rows of each example of a ragged
or sparse input: "sum", "mean" or "sqrtn", as tf.nn.embedding_lookup_sparse
does (None: no reduction)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

COMBINERS = (None, "sum", "mean", "sqrtn")


def embed(
    layer: Any, inputs: Any, rows_of: Callable[[tf.Tensor], tf.Tensor]
) -> tf.Tensor | tf.RaggedTensor:
    """A lookup layer's output (`combiner`, `name`) for dense, ragged or
    sparse `inputs`, whose ids' rows `rows_of` reads: a row per id (ragged
    rows for ragged ids), or with a combiner one per example of a ragged or
    sparse input. A sparse input without a combiner is the dense tensor it
    stands for (absent entries: id 0), as in keras.layers.Embedding. The
    live layer and its standalone export both answer so (the export
    reduced such inputs by "sqrtn", or failed to trace)."""
    if isinstance(inputs, tf.SparseTensor) and layer.combiner is None:
        inputs = tf.sparse.to_dense(inputs)
    if isinstance(inputs, tf.SparseTensor) and inputs.shape.rank == 2:
        # Each id's example is its row index, wherever in the row it sits
        # (RaggedTensor.from_sparse refused ids not left-aligned).
        rows = rows_of(inputs.values)
        return combine(layer.combiner, rows, inputs.indices[:, 0], inputs.dense_shape[0])
    if isinstance(inputs, tf.SparseTensor):
        inputs = tf.RaggedTensor.from_sparse(inputs)
    if layer.combiner is not None and _placeholder_of_keras_build(inputs):
        # Keras builds a model under a tf.distribute strategy from a dense
        # placeholder of the first batch's shape, ragged or not: only the
        # output's shape is read there.
        inputs = tf.RaggedTensor.from_tensor(inputs)
    if isinstance(inputs, tf.RaggedTensor):
        if layer.combiner is not None and inputs.shape.rank > 2:
            # Every id of an example, however nested (ragged_rank 2, or
            # uniform inner dims): the rows of its flat values were summed
            # by the outer rows' ids, into other examples.
            inputs = inputs.merge_dims(1, -1)
        rows = rows_of(inputs.flat_values)
        if layer.combiner is None:
            return inputs.with_flat_values(rows)
        return combine(layer.combiner, rows, inputs.value_rowids(), inputs.nrows())
    if layer.combiner is not None:
        raise ValueError(
            f"layer {layer.name!r} has combiner {layer.combiner!r}: feed a RaggedTensor or "
            "SparseTensor of ids"
        )
    return rows_of(inputs)


def _placeholder_of_keras_build(inputs: Any) -> bool:
    """Whether `inputs` is the dense stand-in Keras's symbolic build
    (`compute_output_spec`, in its symbolic scope) gives a layer for a
    ragged or sparse batch: a dense tensor of rank 2 or more."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return (
        in_symbolic_scope()
        and tf.is_tensor(inputs)
        and not isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor))
        and inputs.shape.rank is not None
        and inputs.shape.rank >= 2
    )


def combine(
    combiner: str | None, rows: tf.Tensor, segment_ids: tf.Tensor, n: tf.Tensor
) -> tf.Tensor:
    """Reduces the rows of each example ("sum", "mean" or "sqrtn"), as
    tf.nn.embedding_lookup_sparse does; empty examples give zeros. Summed
    and divided in float32 and given back in the rows' dtype (a mixed
    precision layer's float16 rows met float32 counts and failed)."""
    segment_ids = tf.cast(segment_ids, tf.int32)
    n = tf.cast(n, tf.int32)
    total = tf.math.unsorted_segment_sum(tf.cast(rows, tf.float32), segment_ids, n)
    if combiner == "sum":
        return tf.cast(total, rows.dtype)
    counts = tf.math.unsorted_segment_sum(tf.ones_like(segment_ids, tf.float32), segment_ids, n)
    counts = tf.expand_dims(counts, -1)
    if combiner == "mean":
        return tf.cast(tf.math.divide_no_nan(total, counts), rows.dtype)
    return tf.cast(tf.math.divide_no_nan(total, tf.sqrt(counts)), rows.dtype)


def output_spec(layer: Any, inputs: Any) -> Any:
    """The symbolic output of a lookup layer (`output_dim`, `combiner`,
    `compute_dtype`) on `inputs`: ragged rows out of a ragged input without
    a combiner, one row per example with one."""
    import keras

    shape = output_shape(layer, inputs.shape)
    ragged = getattr(inputs, "ragged", False) and layer.combiner is None
    return keras.KerasTensor(shape, dtype=layer.compute_dtype, ragged=ragged)


def output_shape(layer: Any, input_shape: Any) -> tuple[Any, ...]:
    """The shape of a lookup layer's output for `input_shape`."""
    if layer.combiner is not None:
        return (input_shape[0], layer.output_dim)
    return (*tuple(input_shape), layer.output_dim)
