"""DenseOnShards: a Keras optimizer that keeps a model's dense weights in a
table on the shard servers, so several trainer processes share them (the
pserver mode of the Paddle distributed lookup table; docs/multi-trainer.md).

Each dense variable is cut into rows of `ROW` floats, stored under ids
`offset..offset+n` of one table; the table's server-side optimizer (the
`update_method`) applies every trainer's gradients as they arrive. A step
pushes the dense gradients (synchronously) and pulls the fresh weights back
into the model's variables, so every trainer trains the same dense weights,
asynchronously, as it trains the same embedding rows.

The chief (worker 0) writes the initial weights, then a marker row (id -1)
recording the layout; the other trainers wait for the marker and start from
the chief's weights. A table that already holds a marker (a restarted job, a
loaded checkpoint) is read, not overwritten.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_dlt import dlt_ops as ops
from tf_dlt import embedded, errors, initializers, optimizers
from tf_dlt.cluster import ClusterSpec
from tf_dlt.table_config import TableConfig

ROW = 64
MARKER_ID = -1
_MARKER_FORMAT = 1.0
# Per (shards, table): the weights this process's chief wrote at build, as
# long as no step has run on them (write_loaded_weights): an optimizer built
# again on the table before it (a model compiled again) takes the watch over.
_WRITTEN: dict[tuple[tuple[str, ...], str], np.ndarray | None] = {}


def _layout(variables: Sequence[Any]) -> tuple[list[int], list[int], int]:
    """(sizes, first row of each variable, total rows)."""
    sizes = [int(np.prod(v.shape)) for v in variables]
    offsets, rows = [], 0
    for size in sizes:
        offsets.append(rows)
        rows += -(-size // ROW)
    return sizes, offsets, rows


def _marker(sizes: list[int]) -> np.ndarray:
    """The marker row: format, variable count, total size, then sizes (mod
    2**24, exact in float32) of up to ROW - 3 variables."""
    row = np.zeros(ROW, np.float32)
    row[:3] = (_MARKER_FORMAT, len(sizes), sum(sizes) % (1 << 24))
    tail = [s % (1 << 24) for s in sizes[: ROW - 3]]
    row[3 : 3 + len(tail)] = tail
    return row


def _described(marker: np.ndarray) -> str:
    """A marker row (`_marker`) in words: its format, variable count, total
    size and the sizes of the variables it lists."""
    count = int(marker[1])
    sizes = [int(size) for size in marker[3 : 3 + min(count, ROW - 3)]]
    more = f" and {count - len(sizes)} more" if count > len(sizes) else ""
    return (
        f"format {int(marker[0])}, {count} variables of {int(marker[2])} floats in all, "
        f"sized {sizes}{more}"
    )


def _overwritten(variable: Any) -> bool:
    """Variables Keras overwrites with their gradient (the embeddings'
    anchors) are not dense weights."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


# keras.optimizers.Optimizer's options that act on the gradients in the
# base class's apply, which DenseOnShards replaces.
_UNAPPLIED = (
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "loss_scale_factor",
    "use_ema",
    "gradient_accumulation_steps",
)


@keras.saving.register_keras_serializable(package="tf_dlt")
class DenseOnShards(keras.optimizers.Optimizer):  # type: ignore[misc]
    """Trains a model's dense weights in a shard table shared by trainers.

    Args:
        cluster: a `tf_dlt.ClusterSpec` (e.g. `tf_dlt.cluster_from_env()`) or
            the shard addresses; no shards means the embedded tables.
        update_method: the server-side optimizer of the dense table, a name
            ("sgd", "adagrad", "adam", "ftrl", "momentum") or a `tf_dlt.optimizers` object.
        learning_rate: float or Keras schedule (of this trainer's steps).
        table: name of the dense table (one per model).
        is_chief: whether this trainer writes the initial weights (default:
            the cluster's worker 0).
        auth_token: token of the shard servers.
        start_timeout: seconds a non-chief waits for the chief's weights.
    """

    def __init__(
        self,
        cluster: ClusterSpec | Sequence[str],
        update_method: optimizers.OptimizerLike = "adam",
        learning_rate: float | keras.optimizers.schedules.LearningRateSchedule = 0.001,
        table: str = "dense",
        *,
        is_chief: bool | None = None,
        auth_token: str = "",
        start_timeout: float = 300.0,
        name: str = "dense_on_shards",
        **kwargs: Any,
    ) -> None:
        ignored = sorted(
            k
            for k in _UNAPPLIED
            if kwargs.get(k) and not (k == "gradient_accumulation_steps" and kwargs[k] == 1)
        )
        if ignored:
            # Accepted by keras.optimizers.Optimizer and never applied: the
            # gradients go to the dense table as they are (the loss scale
            # was not undone, a clip not made).
            raise ValueError(
                f"DenseOnShards: {', '.join(ignored)} is not applied to the dense table's "
                "gradients (the shards apply update_method to them as they come): clip or "
                "scale the gradients in the model (a custom train_step), or use a Keras "
                "optimizer for the dense weights"
            )
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        spec = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(list(cluster))
        self.pservers = list(spec.pservers)
        self.is_chief = spec.is_chief if is_chief is None else bool(is_chief)
        self.table = table
        self.auth_token = auth_token
        self.start_timeout = float(start_timeout)
        self.table_config = TableConfig.create(
            table, ROW, initializers.Zeros(), optimizers.get(update_method), 0
        )
        self.client: ops.ClientResource | None = None

    @property
    def table_name(self) -> str:
        return self.table

    @property
    def output_dim(self) -> int:
        return ROW

    # Set-up -------------------------------------------------------------------

    def build(self, variables: Sequence[Any]) -> None:
        if self.built:
            return
        # Talks to the shards now, even when first called while a train step
        # is being traced.
        with tf.init_scope():
            super().build(variables)
            self._connect(
                [v for v in variables if not getattr(v, "overwrite_with_gradient", False)]
            )

    def _connect(self, dense: list[Any]) -> None:
        self.client = ops.ClientResource(self.pservers, auth_token=self.auth_token)
        self._create_table()
        self._dense = dense
        self._sizes, self._offsets, self._rows = _layout(dense)
        self._ids = tf.constant(np.arange(self._rows, dtype=np.int64))
        marker = _marker(self._sizes)
        self._key = (tuple(self.pservers), self.table)
        written = None  # the initial weights, where this chief writes them
        if self.is_chief and not self._has_marker():
            written = self._pack(dense).numpy()
            ops.assign(self.client, self._ids, written, self.table, ROW)
            ops.assign(
                self.client, tf.constant([MARKER_ID], tf.int64), marker[None], self.table, ROW
            )
        else:
            self._wait_for_marker()
        found = self._pull([MARKER_ID])[0]
        if not np.array_equal(found, marker):
            raise errors.FailedPreconditionError(
                f"dense table {self.table!r} holds another model's weights "
                f"({_described(found)}; this model: {_described(marker)}); use another table "
                "name. (The same model with layers frozen since counts fewer: its trainable "
                "variables are laid out when the optimizer is built. To freeze layers, compile "
                "again with the optimizer it has, model.compile(optimizer=model.optimizer, ...))"
            )
        earlier = _WRITTEN.get(self._key) if self.is_chief and written is None else None
        if earlier is not None and earlier.shape == (self._rows, ROW):
            # Built here before, and no step since: the model's weights are
            # the ones to keep (a compile of another optimizer after a load).
            written = earlier
        else:
            self.refresh()
        self._watch(written)  # until its first step (write_loaded_weights)

    def _watch(self, written: np.ndarray | None) -> None:
        """Records the weights this process's chief wrote into the table
        (None: nothing to watch)."""
        if written is None:
            _WRITTEN.pop(self._key, None)
        else:
            _WRITTEN[self._key] = written

    def refresh(self) -> None:
        """Pulls the dense table's weights into the model's variables: the
        table, which every trainer pushes to, holds the newest (after a
        load, the checkpoint's, where the weights file holds the saving
        trainer's own copy as of its last step)."""
        if hasattr(self, "_key"):
            self._watch(None)  # the table's weights are the model's now
        self._unpack_into(self._dense, tf.constant(self._pull(np.arange(self._rows))))

    def _create_table(self) -> None:
        assert self.client is not None
        if self.client.embedded:
            embedded.create_table(self.table_config)
            return
        from tf_dlt.client import Client

        with Client(self.pservers, auth_token=self.auth_token) as control:
            control.create_table_from_config(self.table_config)

    def _pull(self, ids: Any) -> np.ndarray:
        assert self.client is not None
        ids = tf.constant(np.asarray(ids, np.int64))
        rows = ops.lookup(self.client, ids, self.table, ROW, training=False, missing="zeros")
        return np.asarray(rows.numpy())

    def _has_marker(self) -> bool:
        return bool(self._pull([MARKER_ID])[0][0] != 0.0)

    def _wait_for_marker(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while not self._has_marker():
            if time.monotonic() > deadline:
                raise errors.DeadlineExceededError(
                    f"the chief wrote no initial weights into dense table {self.table!r} "
                    f"within {self.start_timeout} s"
                )
            time.sleep(0.2)

    # Packing ------------------------------------------------------------------

    def _pack(self, tensors: Sequence[Any], sizes: Sequence[int] | None = None) -> tf.Tensor:
        """Variables (or their gradients) as [rows, ROW] float32: all the
        dense variables', or those of `sizes`."""
        parts = []
        for t, size in zip(tensors, self._sizes if sizes is None else sizes, strict=True):
            flat = tf.reshape(tf.cast(tf.convert_to_tensor(t), tf.float32), [-1])
            parts.append(tf.pad(flat, [[0, -(-size // ROW) * ROW - size]]))
        if not parts:
            return tf.zeros([0, ROW], tf.float32)
        return tf.reshape(tf.concat(parts, 0), [-1, ROW])

    def _unpack_into(self, variables: Sequence[Any], rows: tf.Tensor) -> list[Any]:
        flat = tf.reshape(rows, [-1])
        updates = []
        for v, size, offset in zip(variables, self._sizes, self._offsets, strict=True):
            piece = flat[offset * ROW : offset * ROW + size]
            updates.append(v.assign(tf.cast(tf.reshape(piece, v.shape), v.dtype)))
        return updates

    # Steps --------------------------------------------------------------------

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
        variables = list(trainable_variables or self._trainable_variables)
        replica = tf.distribute.get_replica_context()
        if (
            tf.distribute.has_strategy()
            and replica is not None
            and replica.num_replicas_in_sync > 1
        ):
            raise errors.InvalidArgumentError(
                "DenseOnShards: the model trains on "
                f"{replica.num_replicas_in_sync} replicas (a MirroredStrategy), and each would "
                "push its own part of the batch's gradients as a step: train with one replica "
                "per trainer process (several trainers share the dense table), or use a Keras "
                "optimizer for the dense weights"
            )
        if not self.built:
            self.build(variables)
        grads_of: dict[int, Any] = {}
        for g, v in zip(grads, variables, strict=True):
            if _overwritten(v):
                if g is not None:
                    v.assign(g)
            elif g is not None:  # (none: not trained this step, as Keras skips it)
                grads_of[id(v)] = g
        assert self.client is not None
        self.write_loaded_weights(first_step=True)
        # The variables trained now: fewer than at build where layers were
        # frozen since, or a variable has no gradient this step (their rows
        # are read, never pushed); never others.
        built = {id(v) for v in self._dense}
        unknown = [v for v in variables if id(v) in grads_of and id(v) not in built]
        if unknown:
            raise errors.FailedPreconditionError(
                f"DenseOnShards: variable {unknown[0].path!r} was not trainable when the "
                "optimizer was built, so the dense table has no rows for it: compile the model "
                "with a new DenseOnShards (and a new table) to train it"
            )
        trained = [i for i, v in enumerate(self._dense) if id(v) in grads_of]
        if trained:
            ids = self._ids
            if len(trained) < len(self._dense):
                ids = tf.constant(np.concatenate([self._rows_of(i) for i in trained]))
            dense_grads = [grads_of[id(self._dense[i])] for i in trained]
            lr = tf.cast(self._get_current_learning_rate(), tf.float32)
            packed = self._pack(dense_grads, [self._sizes[i] for i in trained])
            pushed = ops.push(self.client, ids, packed, lr, self.table, ROW, sync=True)
            with tf.control_dependencies([pushed] if pushed is not None else []):
                rows = ops.lookup(self.client, self._ids, self.table, ROW, training=False)
            self._unpack_into(self._dense, rows)
        self._iterations.assign_add(1)

    def _rows_of(self, index: int) -> np.ndarray:
        """The table ids of dense variable `index`."""
        first = self._offsets[index]
        return np.arange(first, first + -(-self._sizes[index] // ROW), dtype=np.int64)

    def write_loaded_weights(self, first_step: bool = True) -> None:
        """Where this process's chief wrote the initial weights at build and
        nothing has changed the table since: weights given to the model
        since (keras.models.load_model builds the optimizer while it
        compiles, then sets the file's weights; set_weights, load_weights)
        go into the table, which every step reads back (the file's weights
        were replaced by the random ones written at build, without a word).
        Called at the first step (as it is traced), which ends the watch,
        and by tf_dlt.save. A table changed since (a tf_dlt.load, another
        trainer's pushes) is left as it is."""
        written = _WRITTEN.get(self._key) if hasattr(self, "_key") else None
        if written is None:
            return
        assert self.client is not None
        with tf.init_scope():
            now = self._pack(self._dense).numpy()
            if not np.array_equal(now, written):
                if np.array_equal(self._pull(np.arange(self._rows)), written):
                    ops.assign(self.client, self._ids, now, self.table, ROW)
                    written = now
                else:
                    written = None  # the table moved on: it wins
        self._watch(None if first_step else written)

    def update_step(self, gradient: Any, variable: Any, learning_rate: Any) -> None:
        raise NotImplementedError("DenseOnShards applies every variable at once in apply()")

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            cluster=list(self.pservers),
            update_method=self.table_config.optimizer.to_dict(),
            table=self.table,
            is_chief=self.is_chief,
            start_timeout=self.start_timeout,
        )
        return config
