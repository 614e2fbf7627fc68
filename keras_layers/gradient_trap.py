"""The gradient trap of a distributed Embedding: how its table's gradient
reaches the shards without passing through Keras' optimizer.

A `tf.custom_gradient` on a scalar "anchor" weight turns the gradient of
the looked-up rows into one summed row per distinct id and keeps it for the
step (`Pending`). Keras' optimizer writes the anchor's gradient into the
anchor (`overwrite_with_gradient`), and that write (`Anchor.assign`) pushes
the kept rows, so a step the optimizer skips pushes nothing.
`FlushAtEpochEnd` waits for the pushes when Keras reads its metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tf_dlt import dlt_ops as ops


@tf.custom_gradient  # type: ignore[untyped-decorator]
def densify_gradient(table: tf.Tensor) -> tuple[tf.Tensor, Any]:
    """Identity whose gradient is converted to a dense tensor."""
    return tf.identity(table), lambda dy: tf.convert_to_tensor(dy)


class FlushAtEpochEnd(keras.metrics.Metric):  # type: ignore[misc]
    """Waits for a layer's pending pushes when Keras reads the metrics
    eagerly (end of a fit epoch, end of evaluate); inside the traced train
    step it does nothing. Reports no value."""

    def __init__(self, layer: Any) -> None:
        super().__init__(name=f"{layer.name}_flush")
        # A function, not the layer: saving walks attributes, and a metric
        # holding its own layer would be a cycle.
        self._client: Callable[[], ops.ClientResource | None] = lambda: layer.client

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def reset_state(self) -> None:
        pass

    def result(self) -> dict[str, Any]:
        client = self._client()
        if client is not None and tf.executing_eagerly():
            ops.flush(client)
        return {}


def model_optimizer(layer: keras.layers.Layer) -> Any:
    """The optimizer of the model whose call reaches `layer` (the entry
    layer of the current Keras call), or None."""
    context = layer._get_call_context()
    optimizer = getattr(getattr(context, "entry_layer", None), "optimizer", None)
    return optimizer if isinstance(optimizer, keras.optimizers.Optimizer) else None


@dataclasses.dataclass
class Pending:
    """One step's rows, summed per distinct id in the backward pass, waiting
    for the optimizer's apply step, and the graph they belong to."""

    graph: Any
    ids: tf.Tensor
    grads: tf.Tensor
    optimizer: Any
    # Whether the rows were looked up for training (an inference lookup's
    # gradient is traced, by tf.saved_model.save too, but never pushed).
    training: bool = True


def within(graph: Any) -> bool:
    """True when the current graph is `graph` or nested in it (a cond
    branch, a while body)."""
    current = tf.compat.v1.get_default_graph()
    while current is not None:
        if current is graph:
            return True
        current = getattr(current, "outer_graph", None)
    return False


class Anchor(keras.Variable):  # type: ignore[misc]
    """The scalar anchor weight: the optimizer overwrites it with its
    gradient in the apply step, and that is when the layer pushes the step's
    rows."""

    def __init__(self, on_apply: Callable[[Any], Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._on_apply = on_apply

    def assign(self, value: Any) -> Any:
        pushed = self._on_apply(value)
        if pushed is None:
            return super().assign(value)
        with tf.control_dependencies([pushed]):
            return super().assign(tf.identity(value))
