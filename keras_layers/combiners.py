"""How a distributed Embedding reduces the rows of each example of a ragged
or sparse input: "sum", "mean" or "sqrtn", as tf.nn.embedding_lookup_sparse
does (None: no reduction)."""

from __future__ import annotations

import tensorflow as tf

COMBINERS = (None, "sum", "mean", "sqrtn")


def combine(
    combiner: str | None, rows: tf.Tensor, segment_ids: tf.Tensor, n: tf.Tensor
) -> tf.Tensor:
    """Reduces the rows of each example ("sum", "mean" or "sqrtn"), as
    tf.nn.embedding_lookup_sparse does; empty examples give zeros."""
    segment_ids = tf.cast(segment_ids, tf.int32)
    n = tf.cast(n, tf.int32)
    total = tf.math.unsorted_segment_sum(rows, segment_ids, n)
    if combiner == "sum":
        return total
    counts = tf.math.unsorted_segment_sum(tf.ones_like(segment_ids, tf.float32), segment_ids, n)
    counts = tf.expand_dims(counts, -1)
    if combiner == "mean":
        return tf.math.divide_no_nan(total, counts)
    return tf.math.divide_no_nan(total, tf.sqrt(counts))
