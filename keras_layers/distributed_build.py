"""Ragged and sparse ids under a tf.distribute strategy in `model.fit`.

Keras 3's TensorFlow trainer, under a strategy, builds the model from the
first batch before fit / evaluate / predict run (`_maybe_symbolic_build`).
With several replicas it averages that batch across them
(`strategy.reduce("MEAN")`) only to read its shapes, and the reduce fails
on per-replica RaggedTensors and SparseTensors: `AttributeError:
'RaggedTensor' object has no attribute 'device'`, a plain Keras model's
too. Where the batch holds such values, one replica's batch is taken
instead (its shapes are the reduced batch's); any other batch goes through
Keras unchanged. Installed once, when `tf_dlt.layers` is imported.
"""

from __future__ import annotations

import inspect
from typing import Any

import tensorflow as tf


def _composite(value: Any) -> bool:
    return isinstance(value, (tf.RaggedTensor, tf.SparseTensor))


def _one_replicas_batch(strategy: Any, batch: Any) -> Any:
    """`batch` (per-replica values) with each value replaced by the first
    replica's, where any value is ragged or sparse; else None."""

    def local(value: Any) -> Any:
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    firsts = tf.nest.map_structure(local, batch, expand_composites=False)
    if not any(_composite(v) for v in tf.nest.flatten(firsts, expand_composites=False)):
        return None
    return firsts


def install() -> None:
    """Wraps the trainer's `_maybe_symbolic_build` (once; nothing where this
    Keras has no such method, or another signature)."""
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:
        return
    original = getattr(TensorFlowTrainer, "_maybe_symbolic_build", None)
    if original is None or getattr(original, "_tf_dlt", False):
        return
    if list(inspect.signature(original).parameters) != ["self", "iterator", "data_batch"]:
        return

    def _maybe_symbolic_build(self: Any, iterator: Any = None, data_batch: Any = None) -> Any:
        if getattr(self, "_distribute_strategy", None) is None or iterator is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            firsts = _one_replicas_batch(self.distribute_strategy, batch)
            if firsts is None:  # what Keras does with it, as it would
                return original(self, iterator=_Once(batch), data_batch=data_batch)
            return original(self, data_batch=firsts)
        return original(self, iterator=None, data_batch=data_batch)

    _maybe_symbolic_build._tf_dlt = True  # type: ignore[attr-defined]
    TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build


class _Once:
    """An epoch iterator's `for _, _, it in iterator` giving `batch` once
    (the one already taken from the real iterator)."""

    def __init__(self, batch: Any) -> None:
        self._batch = batch

    def __iter__(self) -> Any:
        yield None, None, iter([self._batch])


install()
