"""Pulling the rows of the next batches while the current one trains.

`pull_ahead(model)` makes the model's `fit` start, in the input pipeline, the
pull of each batch's ids (`tf_dlt.ops.pull_ahead`) for the distributed
`Embedding` layers that a model input feeds directly; the training step's
lookup then finds the rows there instead of waiting for the shards. It works
with a `tf.data.Dataset` and with NumPy (or tensor) inputs, which go through
Keras's own data adapter first (batching, shuffling, class weights and
validation_split as `fit` does them).
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import keras
import tensorflow as tf
from keras.src.trainers import data_adapters
from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils

from tf_dlt import dlt_ops as ops
from tf_dlt import errors
from tf_dlt.keras.walk import chosen_layers, model_clients
from tf_dlt.layers.embedding import Embedding

# Batches prepared (and pulled) ahead of the one training: with refresh, 2;
# without, 1, so a row misses at most the push of the step just before.
_DEPTH = {True: 2, False: 1}


def pull_ahead(
    model: keras.Model, layers: list[Any] | None = None, *, refresh: bool = True
) -> keras.Model:
    """Makes `model.fit` pull the rows of coming batches ahead; returns `model`.

    Args:
        model: a compiled or uncompiled Functional or Sequential model whose
            tables are on shard servers (after `tf_dlt.transpile`; call this
            on the transpiled model). With the embedded tables it changes
            nothing that matters: there is nothing to wait for.
        layers: the distributed `Embedding` layers (objects or names) to pull
            ahead for; None: every one that a model input feeds directly.
        refresh: True: ids this trainer pushes while a pull ahead waits are
            pulled again, at once on the client's worker threads (the step's
            lookup pulls only what is still stale when it comes); False:
            they are not, and pulls start 1 batch ahead instead of 2.

    Consistency: with `refresh`, a pulled-ahead row reflects every push of
    this trainer that completed before the training step's lookup, as
    without pulling ahead, and with ``sync_push=True`` training is the same
    as without; other trainers' pushes are seen as of the pull ahead, at
    most 2 batches before. Without `refresh`, a row may miss the push of the
    step just before its own (staleness bounded to one step), and other
    trainers' pushes of that step. Evaluation and prediction are not pulled
    ahead.
    """
    feeds = _feeds(model, layers)
    if getattr(model, "distribute_strategy", None) is not None and (
        model.distribute_strategy.num_replicas_in_sync > 1
    ):
        raise errors.InvalidArgumentError(
            f"pull_ahead: the model trains on {model.distribute_strategy.num_replicas_in_sync} "
            "replicas; each looks up a part of the batch, so rows pulled for whole batches would "
            "never be used. Pull ahead works with one replica per trainer."
        )
    fit = getattr(model, "_dlt_plain_fit", None) or model.fit
    model._dlt_plain_fit = fit
    model._dlt_pull_ahead_feeds = feeds
    model._dlt_pull_ahead_refresh = bool(refresh)
    model.fit = functools.partial(_fit_pulling_ahead, model, fit)
    return model


def _feeds(model: keras.Model, wanted: list[Any] | None) -> list[tuple[int, Embedding]]:
    """(index in model.inputs, layer) for each call of a chosen layer on a
    model input: a layer whose table two inputs share (a two-tower model)
    has a feed per input."""
    inputs = list(getattr(model, "inputs", None) or [])
    if not inputs:
        raise errors.InvalidArgumentError(
            f"pull_ahead: model {model.name!r} has no symbolic inputs; it needs a Functional or "
            "Sequential model (built), whose inputs show which ids each layer looks up"
        )
    candidates = chosen_layers(model, wanted, "pull_ahead")
    feeds: list[tuple[int, Embedding]] = []
    for layer in candidates:
        fed = _input_indices(layer, inputs)
        if not fed and wanted is not None:
            raise errors.InvalidArgumentError(
                f"pull_ahead: layer {layer.name!r} is not called on a model input (its ids are "
                "computed in the step, so they are not known ahead); pull ahead for layers "
                "called on an Input of dense or ragged ids"
            )
        feeds.extend((index, layer) for index in fed)
    if not feeds:
        raise errors.InvalidArgumentError(
            f"pull_ahead: no distributed Embedding of model {model.name!r} is called on a model "
            "input of dense or ragged ids"
        )
    return feeds


def _input_indices(layer: Embedding, inputs: list[Any]) -> list[int]:
    """Which of `inputs` the layer is called on, once per call (a call on
    something else, or on a sparse input, is skipped)."""
    found: list[int] = []
    for node in getattr(layer, "_inbound_nodes", []):
        args = node.arguments.keras_tensors
        if len(args) != 1 or getattr(args[0], "sparse", False):
            continue
        found.extend(i for i, tensor in enumerate(inputs) if args[0] is tensor)
    return found


def _fit_pulling_ahead(
    model: keras.Model,
    plain_fit: Any,
    x: Any = None,
    y: Any = None,
    batch_size: int | None = None,
    epochs: int = 1,
    verbose: Any = "auto",
    callbacks: Any = None,
    validation_split: float = 0.0,
    validation_data: Any = None,
    shuffle: Any = True,
    class_weight: Any = None,
    sample_weight: Any = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int = 1,
) -> Any:
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
            (x, y, sample_weight), validation_split=validation_split
        )
    if not isinstance(x, tf.data.Dataset):
        adapter = data_adapters.get_data_adapter(
            x=x,
            y=y,
            sample_weight=sample_weight,
            batch_size=batch_size,
            steps_per_epoch=steps_per_epoch,
            shuffle=shuffle,
            class_weight=class_weight,
        )
        # Batched, shuffled and weighted by the adapter already.
        x, y, sample_weight, class_weight = adapter.get_tf_dataset(), None, None, None
        if adapter.num_batches is not None:
            # Keras counts the steps of an epoch from the dataset's length.
            x = x.apply(tf.data.experimental.assert_cardinality(adapter.num_batches))
        batch_size, shuffle = None, False
    if steps_per_epoch is None and epochs - initial_epoch > 1:
        x, steps_per_epoch = _one_iterator(x, epochs, model.steps_per_execution)
    depth = _DEPTH[model._dlt_pull_ahead_refresh]
    dataset = x.map(functools.partial(_start_pulls, model)).prefetch(depth)
    try:
        return plain_fit(
            x=dataset,
            y=y,
            batch_size=batch_size,
            epochs=epochs,
            verbose=verbose,
            callbacks=callbacks,
            validation_data=validation_data,
            shuffle=shuffle,
            class_weight=class_weight,
            sample_weight=sample_weight,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
        )
    finally:
        # Pulls the pipeline began for batches no step took (the fit ended
        # early, failed, or the pipeline ran past its last step) must not
        # serve a later lookup of the same ids with rows as they were then.
        for client in model_clients(model):
            ops.drop_pulled_ahead(client)


def _one_iterator(
    data: tf.data.Dataset, epochs: int, steps_per_execution: int
) -> tuple[tf.data.Dataset, int | None]:
    """`data` repeated for the fit's `epochs`, with its length as
    steps_per_epoch, when that length is known (and a multiple of
    `steps_per_execution`, whose calls would otherwise run across the end of
    a pass): Keras then iterates it with one iterator for the whole fit
    instead of one per epoch. Each epoch is still one pass over the data (a
    shuffle that reshuffles each iteration still does), and the pipeline
    pulls the next epoch's first batches ahead while the last steps of the
    epoch before train. It also avoids a tf.data stall of up to the
    autotuner's optimization period (seconds, growing with the fit's
    length) when an epoch's iterator is destroyed; the fit's one iterator
    can still meet it when the fit returns: docs/keras.md."""
    batches = int(data.cardinality())
    if batches <= 0 or batches % max(1, int(steps_per_execution)):
        return data, None  # Keras's own iteration, one iterator per epoch
    return data.repeat(epochs), batches


def _start_pulls(model: keras.Model, *element: Any) -> Any:
    """One batch of the input pipeline, unchanged, once the pulls of its ids
    have started."""
    batch = element if len(element) > 1 else element[0]
    x, _, _ = data_adapter_utils.unpack_x_y_sample_weight(batch)
    flat = _model_inputs_of(model, x)
    feeds = model._dlt_pull_ahead_feeds
    # Pulls of one table per batch: a lookup takes its own and drops only
    # those of earlier batches, never those of the other calls of its batch.
    per_batch = collections.Counter(
        (layer.client.shared_name, layer.table_name) for _, layer in feeds
    )
    started = []
    for index, layer in feeds:
        ids = flat[index]
        if isinstance(ids, tf.RaggedTensor):
            ids = ids.flat_values
        elif isinstance(ids, tf.SparseTensor):
            continue
        started.append(
            ops.pull_ahead(
                layer.client,
                tf.cast(ids, tf.int64),
                layer.table_name,
                layer.output_dim,
                training=bool(layer.trainable),  # as the layer's lookup (a frozen one makes no row)
                missing="zeros",
                refresh=model._dlt_pull_ahead_refresh,
                pulls_per_batch=per_batch[(layer.client.shared_name, layer.table_name)],
            )
        )
    with tf.control_dependencies(started):
        return tf.nest.map_structure(tf.identity, batch)


def _model_inputs_of(model: keras.Model, x: Any) -> list[Any]:
    """`x` as the list of the model's inputs, in model.inputs order."""
    inputs = model.inputs
    if isinstance(x, dict):
        struct = getattr(model, "_inputs_struct", None)
        if isinstance(struct, dict):
            names = [next(k for k, t in struct.items() if t is inp) for inp in inputs]
        else:
            names = [t.name for t in inputs]
        missing = [n for n in names if n not in x]
        if missing:
            raise errors.InvalidArgumentError(
                f"pull_ahead: the batch has keys {sorted(x)}, not the model inputs {missing}"
            )
        return [x[n] for n in names]
    flat = list(x) if isinstance(x, (list, tuple)) else [x]
    if len(flat) != len(inputs):
        raise errors.InvalidArgumentError(
            f"pull_ahead: the batch has {len(flat)} inputs, model {model.name!r} takes "
            f"{len(inputs)}"
        )
    return flat
