"""tf_dlt.layers.Embedding: a drop-in `keras.layers.Embedding` whose rows can
live in a distributed lookup table.

Forward: `Dlt>Lookup`. Backward: a `tf.custom_gradient` on a scalar "anchor"
weight turns the gradient of the looked-up rows into one summed row per
distinct id (`Dlt>LookupGrad`) and keeps it for the step. Keras' optimizer
never sees the table: its apply step writes the anchor's gradient into the
anchor (`overwrite_with_gradient`), and that write pushes the kept rows
(`Dlt>Push`), so a step the optimizer skips (a LossScaleOptimizer on
overflow) pushes nothing. The shard applies the table's optimizer: the
compiled Keras optimizer's, unless the layer names its own. The trap itself is
gradient_trap.py; the combiners of ragged and sparse inputs combiners.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import record  # whether a tape records (no public API)

from tf_dlt import admission as admission_lib
from tf_dlt import dlt_ops as ops
from tf_dlt import embedded, errors, expiry, initializers, optimizers
from tf_dlt.memory_policy import MemoryPolicy
from tf_dlt.table_config import TableConfig, difference, memory_of

from . import combiners, keras_settings, table_home
from .combiners import COMBINERS, embed
from .gradient_trap import (
    Anchor,
    FlushAtEpochEnd,
    Pending,
    densify_gradient,
    model_optimizer,
    within,
)


class _VariablesOnly(threading.local):
    active = False


_variables_only = _VariablesOnly()


@contextlib.contextmanager
def variables_only() -> Iterator[None]:
    """Within it, Keras saving and loading (save_weights, load_weights)
    write and read the layers' variables but not the embedded tables' rows:
    tf_dlt.save and tf_dlt.load move those through the tables' checkpoint."""
    before = _variables_only.active
    _variables_only.active = True
    try:
        yield
    finally:
        _variables_only.active = before


class _PushCount(keras.Variable):  # type: ignore[misc]
    """A distributed layer's `pushes` weight. An eager assign of fewer pushes
    than it holds sets the layer's Keras weights back without its table's
    rows (`Model.set_weights`, which `EarlyStopping(restore_best_weights=
    True)` calls; `load_weights` of an older file when the rows are on
    shard servers): `on_rollback(held, given)` is called first."""

    def __init__(self, on_rollback: Callable[[int, int], None], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._on_rollback = on_rollback

    def assign(self, value: Any) -> Any:
        if tf.executing_eagerly() and np.ndim(value) == 0:  # (a wrong shape: Keras says so)
            held, given = int(self.numpy()), int(np.asarray(value))
            if given < held:
                self._on_rollback(held, given)
        return super().assign(value)


# What save_own_variables adds to the layer's weights for an embedded table.
_ROWS_KEYS = ("table_ids", "table_values", "table_slots", "table_steps", "table_config")
# The table's lineage (table_home), beside its rows in files since 2026-12-06.
_LINEAGE_KEY = "table_lineage"

# Bits of integer a float type holds exactly: beyond 2^bits it cannot tell
# neighbouring ids apart.
_EXACT_INTEGER_BITS = {tf.float16: 11, tf.bfloat16: 8, tf.float32: 24, tf.float64: 53}


def exact_ids(values: Any, layer: str) -> tf.Tensor:
    """`values` as int64 ids of `layer`. Integers are cast; floats (a Keras
    Input's default dtype; never autocast: see Embedding.__init__) only
    where every value is an integer the float type holds exactly (|v| <=
    2^24 for float32, 2^53 for float64): above that, distinct ids would
    round to one row, so InvalidArgumentError names the layer instead. The
    live layer and its standalone export both check (the export read
    another id's row)."""
    values = tf.convert_to_tensor(values)
    if values.dtype.is_integer:
        return tf.cast(values, tf.int64)
    if not values.dtype.is_floating:
        raise TypeError(f"layer {layer!r} takes integer ids, got {values.dtype.name}")
    exact = float(2 ** _EXACT_INTEGER_BITS[values.dtype])
    whole = tf.reduce_all((tf.floor(values) == values) & (tf.abs(values) <= exact))
    message = (
        f"layer {layer} got {values.dtype.name} ids that are not whole numbers or are "
        f"beyond +-{exact:.0f}, where {values.dtype.name} cannot tell ids apart: feed int64 "
        "ids (a keras.Input of dtype int64)"
    )
    check = tf.debugging.Assert(whole, [message], name="ids_are_exact")
    with tf.control_dependencies([check]):
        return tf.cast(values, tf.int64)


@keras.saving.register_keras_serializable(package="tf_dlt")
class Embedding(keras.layers.Layer):  # type: ignore[misc]
    """Turns int ids into dense vectors, like `keras.layers.Embedding`.

    Args:
        input_dim: vocabulary size; required for local tables
            (``is_distributed=False``); optional for distributed ones (any
            int64 id is valid there), where it sizes shape-dependent Keras
            initializers (Glorot, He, ...) and must match `weights`.
        output_dim: size of each vector; always required.
        is_distributed: False keeps the rows in a local Keras variable, as
            `keras.layers.Embedding` does; True keeps them in the distributed
            lookup table (embedded shards in this process until the model is
            transpiled onto shard servers).
        is_sparse: local tables only: gradients as `tf.IndexedSlices` (True)
            or dense (False). Distributed tables always push sparse rows.
        embeddings_initializer: any Keras initializer (object, name or
            config) or a `tf_dlt.initializers` object. Local tables use it as
            `keras.layers.Embedding` does; distributed rows start from the
            per-id deterministic form of RandomNormal, RandomUniform,
            TruncatedNormal, Zeros, Ones, Constant (arguments and seed kept)
            and, with `input_dim`, VarianceScaling / Glorot / He / Lecun.
        optimizer: distributed tables: the server-side update_method, a name
            ("sgd", "adagrad", "adam", "ftrl", "momentum") or a `tf_dlt.optimizers`
            object. None (default): the compiled Keras optimizer's (SGD,
            Adagrad, Adam and Ftrl, with their hyper-parameters).
        learning_rate: distributed tables: the learning rate sent with every
            push, a float or a `keras.optimizers.schedules.LearningRateSchedule`
            evaluated at the number of pushes this layer has made. None
            (default): the compiled Keras optimizer's current learning rate
            (a schedule evaluated at its iterations).
        combiner: None for dense ids of any rank (a `tf.RaggedTensor` gives
            ragged rows, a `tf.SparseTensor` is looked up as the dense tensor
            it stands for, absent entries being id 0, as Keras does); "sum",
            "mean" or "sqrtn" to reduce the rows of each example of a ragged
            or sparse input, as `tf.nn.embedding_lookup_sparse` does.
        mask_zero: as in Keras: id 0 is padding and produces a mask.
        weights: initial rows, a `(input_dim, output_dim)` array (or a list
            holding one), as `keras.layers.Embedding` takes; distributed
            tables get them as ids 0..input_dim-1.
        seed: distributed tables: seed of the deterministic initializer
            (default: the Keras initializer's seed, else 0: tables left
            without one start with the same row for the same id; give
            tables over overlapping id spaces seeds of their own).
        table_name: distributed tables: name of the table (default: the layer
            name).
        sync_push: distributed tables: wait for every push to be applied
            before the training step ends (deterministic runs, tests).
        name: layer name.
        memory: distributed tables: the table's memory policy, a
            `tf_dlt.MemoryPolicy` (admission, what unadmitted ids read in
            training, expiry, a row bound with its eviction, 16-bit storage)
            or its config dict; None: none. Inference reads zeros for an id
            without a row, whatever the policy.
        admission, unadmitted, ttl, max_rows, eviction, value_dtype,
            slot_dtype, rounding: the fields of `memory` as keywords, a
            shorthand for ``memory=tf_dlt.MemoryPolicy.create(...)`` (not
            both).
    """

    def __init__(
        self,
        input_dim: int | None = None,
        output_dim: int | None = None,
        is_distributed: bool = False,
        is_sparse: bool = False,
        embeddings_initializer: Any = "uniform",
        optimizer: optimizers.OptimizerLike | None = None,
        combiner: str | None = None,
        mask_zero: bool = False,
        learning_rate: float | keras.optimizers.schedules.LearningRateSchedule | None = None,
        seed: int | None = None,
        table_name: str | None = None,
        sync_push: bool = False,
        name: str | None = None,
        weights: Any = None,
        memory: MemoryPolicy | dict[str, Any] | None = None,
        admission: admission_lib.AdmissionLike = None,
        unadmitted: str | None = None,
        ttl: expiry.Ttl | dict[str, Any] | None = None,
        max_rows: int | None = None,
        eviction: str | None = None,
        value_dtype: str | None = None,
        slot_dtype: str | None = None,
        rounding: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name=name, **kwargs)
        # Ids are ids, never cast to a mixed precision compute dtype (as in
        # keras.layers.Embedding): cast to bfloat16, float id 257 read row
        # 256 and 1000 was refused as "bfloat16 ids".
        self.autocast = False
        shorthand = {
            "admission": admission, "unadmitted": unadmitted, "ttl": ttl, "max_rows": max_rows,
            "eviction": eviction, "value_dtype": value_dtype, "slot_dtype": slot_dtype,
            "rounding": rounding,
        }  # fmt: skip
        self.memory = memory_of(memory, **{k: v for k, v in shorthand.items() if v is not None})
        if output_dim is None or isinstance(output_dim, bool) or int(output_dim) < 1:
            raise ValueError(f"output_dim must be a positive int, got {output_dim!r}")
        if input_dim is not None and (isinstance(input_dim, bool) or int(input_dim) < 1):
            raise ValueError(f"input_dim must be a positive int, got {input_dim!r}")
        if not is_distributed and input_dim is None:
            raise ValueError(
                "input_dim must be a positive int for a local table (is_distributed=False), "
                "got None"
            )
        if combiner not in COMBINERS:
            raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
        if mask_zero and combiner is not None:
            raise ValueError("mask_zero applies to dense ids; it cannot go with a combiner")
        self.input_dim = None if input_dim is None else int(input_dim)
        self.output_dim = int(output_dim)
        if not isinstance(is_distributed, (bool, np.bool_)):
            # Embedding(100, 4, "zeros") reads as keras.layers.Embedding's
            # (input_dim, output_dim, embeddings_initializer): here the third
            # argument is is_distributed, and "zeros" was taken as True.
            raise TypeError(
                f"is_distributed must be True or False, got {is_distributed!r}: after input_dim "
                "and output_dim, give this layer's arguments by keyword "
                "(embeddings_initializer=..., is_distributed=...)"
            )
        self.is_distributed = bool(is_distributed)
        self.is_sparse = bool(is_sparse)
        if isinstance(embeddings_initializer, dict) and "class_name" in embeddings_initializer:
            embeddings_initializer = keras.initializers.deserialize(embeddings_initializer)
        self.embeddings_initializer = embeddings_initializer
        self.combiner = combiner
        self.mask_zero = bool(mask_zero)
        self.supports_masking = self.mask_zero
        self.learning_rate = learning_rate
        self.table_name = table_name or self.name
        self.sync_push = bool(sync_push)
        # None: the table follows the compiled Keras optimizer.
        self.optimizer = None if optimizer is None else optimizers.get(optimizer)
        self.seed = seed
        self.initial_weights = _initial_weights(weights, self.input_dim, self.output_dim)
        if self.initial_weights is not None and self.input_dim is None:
            self.input_dim = len(self.initial_weights)
        if self.is_distributed:
            initializer, keras_seed = keras_settings.table_initializer(
                embeddings_initializer, self.input_dim, self.output_dim
            )
            self.table_config = TableConfig.create(
                self.table_name,
                self.output_dim,
                initializer,
                self.optimizer or optimizers.SGD(),  # until the model's is known
                seed if seed is not None else (keras_seed or 0),
                self.memory,
            )
            # The ops have no XLA kernels: Keras turns jit_compile "auto" off.
            self.supports_jit = False
        elif not self.memory.is_default:
            raise ValueError(
                "a memory policy (memory=, or admission, unadmitted, ttl, max_rows, eviction, "
                "value_dtype, slot_dtype, rounding) applies to distributed tables "
                "(is_distributed=True)"
            )
        self.client: ops.ClientResource | None = None
        # The table has the compiled optimizer where it lives (follow_optimizer).
        self._settled = False
        # The embedded table was taken from an earlier Keras session.
        self._from_earlier_session = False
        # A file's rows were loaded into the table (table_home: holds_rows).
        self._rows_loaded = False
        # Set while a serving graph is traced: its lookups must not wait for
        # pushes (a serving process has none), so the graph holds only lookups.
        self.serving = False
        self._pending: Pending | None = None
        # Whether the variables being assigned come with the table's rows
        # (an embedded table's rows in a .keras file): no rollback warning.
        self._rows_follow = False
        if self.initial_weights is not None and not self.is_distributed:
            self.build()

    # Building --------------------------------------------------------------

    def build(self, input_shape: Any = None) -> None:
        if getattr(self, "built", False):
            return
        if self.is_distributed:
            with keras.name_scope(self.name):
                self.anchor = Anchor(
                    self._push_pending, initializer="zeros", shape=(), trainable=True,
                    name="anchor",
                )  # fmt: skip
            self.anchor.overwrite_with_gradient = True
            if not self.trainable:
                # As add_weight does for a frozen layer (trainable=False given
                # to the constructor, from_config of a frozen layer: transpile,
                # a .keras file): tracked as trainable, so unfreezing trains
                # it again, and not trained while frozen. Assigned, the
                # anchor stayed in the model's trainable weights, and every
                # step pushed.
                self.anchor.trainable = False
            # Pushes made (the step of a learning-rate schedule); under a
            # MirroredStrategy the replicas push together, once per step.
            # (In the layer's own scope, as add_weight would make it.)
            self.pushes = _PushCount(
                self._rolled_back, initializer="zeros", shape=(), dtype="int64",
                trainable=False, aggregation="only_first_replica", name="pushes",
            )  # fmt: skip
            self.flush_at_epoch_end = FlushAtEpochEnd(self)
            if self.client is None:
                self.client = ops.ClientResource()
            if self.client.embedded and self._create_embedded_table():
                self._upload_initial_weights()
            elif self.client.embedded and self.initial_weights is not None:
                # Another layer's table of this session, or one kept from
                # an earlier session (a cell run again): weights= replaced
                # the rows a live model had trained.
                warnings.warn(
                    f"layer {self.name!r}: table {self.table_name!r} exists already (another "
                    "layer's, or kept from an earlier Keras session), and its rows are kept: "
                    "weights= is not applied (give the layer another name or table_name= for a "
                    "table of its own)",
                    stacklevel=2,
                )
        else:
            self.embeddings = self.add_weight(
                shape=(self.input_dim, self.output_dim),
                initializer=keras_settings.keras_initializer(self.embeddings_initializer),
                name="embeddings",
            )
            if self.initial_weights is not None:
                self.embeddings.assign(self.initial_weights)
        self.built = True

    def _upload_initial_weights(self) -> None:
        if self.initial_weights is None or self.client is None:
            return
        ids = np.arange(len(self.initial_weights), dtype=np.int64)
        # Now, wherever the layer is built: a subclassed model builds its
        # layers in a scratch graph, where the assign never ran (weights=
        # was dropped without a word).
        with tf.init_scope():
            ops.assign(self.client, ids, self.initial_weights, self.table_name, self.output_dim)

    def use_client(self, client: ops.ClientResource) -> None:
        """Backs this layer's table with `client` (the transpiler's hook)."""
        self.client = client
        self._settled = False
        if self.built and client.embedded:
            self._create_embedded_table()

    def _create_embedded_table(self) -> bool:
        """Makes (or takes) the layer's embedded table; whether it was made
        now."""
        assert self.client is not None
        # Following the model's optimizer: not known before compile.
        provisional = self.optimizer is None
        created = table_home.create(self.name, self.table_config, self.client, provisional)
        self._from_earlier_session = created.earlier
        table_home.use(self)
        return created.made

    def holds_rows(self) -> bool:
        """Whether this layer trained its table, or rows were loaded into
        it (rows a load of another table's must not replace)."""
        pushes = getattr(self, "pushes", None)
        # (No value yet while Keras builds the layer symbolically: an empty
        # array.)
        count = np.asarray(pushes.numpy()) if pushes is not None else np.zeros(0)
        return self._rows_loaded or (count.size == 1 and int(count) > 0)

    def configure_row_cache(
        self, config: TableConfig, settings: tuple[int, int, int, int], check: bool = True
    ) -> None:
        """Keeps a hot-row cache of this layer's table in its client
        (`tf_dlt.hot_row_cache`: `settings` are its rows, staleness bounds
        in steps and ms, and min_count; rows 0 removes it), applying
        pushes as `config` (the table's) does."""
        rows, steps, ms, min_count = settings
        assert self.client is not None
        ops.configure_cache(
            self.client, config, rows,
            max_staleness_steps=steps, max_staleness_ms=ms, min_count=min_count, check=check,
        )  # fmt: skip
        # (a tuple: Keras tracks a layer's lists and dicts)
        self._dlt_row_cache = (config, settings) if rows else None

    def refuse_cached_16_bit_pushes(self, caller: str) -> None:
        """InvalidArgumentError where this layer trains a table of 16-bit
        rows or slots through a hot-row cache (`tf_dlt.hot_row_cache`):
        the shards round each update into 16 bits, and the cache, applying
        this trainer's pushes in float32, would serve rows they do not hold."""
        memory = self.table_config.memory
        narrow = [d for d in (memory.value_dtype, memory.slot_dtype) if d != "float32"]
        if narrow and self.trainable and self.client is not None and not self.client.embedded:
            raise errors.InvalidArgumentError(
                f"{caller}: layer {self.name!r} trains table {self.table_name!r}, whose "
                f"rows are stored as {memory.value_dtype} (slots {memory.slot_dtype}), through "
                "a hot-row cache: the shards round each update into 16 bits, and the cache, "
                "applying this trainer's pushes in float32, would serve rows they do not hold. "
                "Leave it out of hot_row_cache (layers=), or use tf_dlt.pull_ahead, which "
                "reads the shards' rows"
            )

    def follow_optimizer(self, optimizer: Any, restoring: bool = False) -> None:
        """Gives the table the server-side form of the Keras `optimizer`,
        when the layer names none itself. The first call on a built layer
        settles the table where it lives: one made before the optimizer was
        known is replaced (rows kept, fresh slots) if no push trained it;
        one trained with another optimizer is a FailedPreconditionError
        saying what to do (see table_home); shards that lack the table of a
        layer that trained it, NotFoundError, unless `restoring` (a load
        is about to put its rows there: the table is then left to the load
        to make, and the layer unsettled, so a load that fails makes
        nothing and the next fit still refuses)."""
        if not self.is_distributed or self.optimizer is not None or optimizer is None:
            return
        self._settle_optimizer(keras_settings.table_optimizer(optimizer, self), restoring)

    def _settle_optimizer(self, wanted: optimizers.Optimizer, restoring: bool) -> None:
        """follow_optimizer's body: the table takes `wanted`."""
        if wanted == self.table_config.optimizer and self._settled:
            return
        config = dataclasses.replace(self.table_config, optimizer=wanted)
        if self.built and self.client is not None:
            with tf.init_scope():
                trained = self.holds_rows()
                if restoring and trained and table_home.lost(self.table_name, self.client):
                    self.table_config = config
                    return
                fresh = table_home.settle(
                    self.name, config, self.client, self._from_earlier_session,
                    trained=trained and not restoring,
                )  # fmt: skip
                self.table_config = config
                cached = getattr(self, "_dlt_row_cache", None)
                if cached is not None and cached[0].optimizer != config.optimizer:
                    # The table took this optimizer (a frozen layer's cache
                    # took the one it had): the cache applies pushes as it.
                    self.configure_row_cache(config, cached[1], check=False)
                if fresh:  # an earlier session's table gave way to an empty one
                    self._upload_initial_weights()
            self._settled = True
            self._from_earlier_session = False  # ours now: never thrown away again
        self.table_config = config

    def takes_saved_optimizer(self) -> bool:
        """Whether a load gives the table the optimizer it was saved with:
        the layer follows the model's optimizer, which has not settled its
        table (the model is not compiled yet, or the layer is frozen and
        trains with none). A load for inference, or to fine-tune the layers
        above, was refused for the stand-in optimizer's config."""
        return self.is_distributed and self.optimizer is None and not self._settled

    def took_saved_optimizer(self, saved: TableConfig) -> None:
        """After a load into the embedded tables (`takes_saved_optimizer`):
        the table's config names the optimizer the rows were saved with (a
        compile that follows another is then refused as for any trained
        table)."""
        self.table_config = dataclasses.replace(self.table_config, optimizer=saved.optimizer)

    def settle_saved_optimizer(self, saved: TableConfig) -> None:
        """Before a load onto shard servers (`takes_saved_optimizer`): the
        table takes the optimizer the rows were saved with where it lives
        (the shards refuse to load over a table of another config)."""
        self._settle_optimizer(saved.optimizer, restoring=True)

    # Forward ---------------------------------------------------------------

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return embed(self, inputs, lambda ids: self._rows(self._ids(ids), training))

    def _ids(self, values: Any) -> tf.Tensor:
        return exact_ids(values, self.name)

    def _rows(self, ids: tf.Tensor, training: bool | None) -> tf.Tensor:
        if not self.is_distributed:
            table = self.embeddings.value  # the backing tf.Variable
            if self.is_sparse:
                rows = tf.gather(table, ids)  # tf.IndexedSlices gradient
            else:
                rows = tf.gather(densify_gradient(table), ids)
            return tf.cast(rows, self.compute_dtype)
        assert self.client is not None
        client, table_name, dim = self.client, self.table_name, self.output_dim
        if training is None:
            # No flag reached the layer (a subclassed model whose call()
            # takes no `training` passes none from fit): a lookup under a
            # recording gradient tape trains, as the gradient it will get
            # says; else it is inference.
            training = record.could_possibly_record()
        lookup_training = bool(training)
        # A frozen layer reads as inference does, making no row: ids it has
        # no row for read zeros (as evaluate and both exports read them),
        # and its lookups never evict trained rows past max_rows.
        makes_rows = lookup_training and self.trainable
        optimizer = model_optimizer(self) if lookup_training else None
        if lookup_training and self.trainable:
            # (A frozen layer pushes nothing: the table keeps the optimizer
            # it has, whatever trains the rest of the model.)
            self._check_optimizer(optimizer)
            self.follow_optimizer(optimizer)
        if lookup_training:
            self._pending = None  # a new step: rows never applied are dropped
        dynamic_scale = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        scaled = dynamic_scale or getattr(optimizer, "loss_scale_factor", None) is not None
        layer = self
        per_occurrence = self.table_config.optimizer.kind == "keras_adagrad"

        @tf.custom_gradient  # type: ignore[untyped-decorator]
        def lookup(anchor: tf.Tensor) -> tuple[tf.Tensor, Any]:
            # Inference (evaluate, predict, serving) first waits for pending
            # asynchronous pushes, so it reads every applied update; ids
            # without a row read as zeros there, as in both exports.
            flushed = None if lookup_training or layer.serving else ops.flush(client)
            with tf.control_dependencies([flushed] if flushed is not None else []):
                rows = ops.lookup(
                    client, ids, table_name, dim, training=makes_rows, missing="zeros"
                )

            def grad(dy: tf.Tensor) -> tf.Tensor:
                dy = tf.cast(tf.convert_to_tensor(dy), tf.float32)
                if scaled and optimizer is not None:
                    # Unscaled before rows of repeated ids are summed: the
                    # sum of scaled rows can overflow where Keras' own
                    # (unsummed) sparse gradients would not.
                    scale = optimizer.scale_loss(tf.constant(1.0))
                    dy = dy / tf.cast(scale, tf.float32)
                if per_occurrence:
                    # Keras' Adagrad squares each occurrence of an id: the
                    # shard gets them unsummed.
                    unique, summed = tf.reshape(ids, [-1]), tf.reshape(dy, [-1, dim])
                else:
                    unique, summed = ops.lookup_grad(ids, dy)
                anchor_grad = tf.zeros_like(anchor)
                if dynamic_scale:
                    # An overflow is normal under dynamic loss scaling: the
                    # optimizer sees a NaN and skips the step, pushing
                    # nothing (see _push_pending).
                    finite = tf.reduce_all(tf.math.is_finite(summed))
                    anchor_grad = tf.where(finite, anchor_grad, tf.constant(np.nan, anchor.dtype))
                layer._keep_for_apply(unique, summed, optimizer, lookup_training)
                return anchor_grad

            return rows, grad

        rows = lookup(tf.convert_to_tensor(self.anchor))
        # Mixed precision: the rows are float32 in the table, like the
        # variable of keras.layers.Embedding, and leave in the compute dtype.
        return tf.cast(rows, self.compute_dtype)

    # Pushing in the optimizer's apply step ------------------------------------

    def _keep_for_apply(
        self, unique: tf.Tensor, summed: tf.Tensor, optimizer: Any, training: bool
    ) -> None:
        """Keeps one step's rows until the optimizer applies the step. Replicas
        of a MirroredStrategy meet first (`merge_call`, after every replica's
        lookups) and keep their rows together, as the all-reduced gradient
        Keras applies to a variable. A layer called on several inputs (two
        towers sharing a table) keeps every call's rows of the step, as
        Keras sums a shared variable's gradients: the last call's alone were
        pushed, and the others' gradients were lost without a word."""
        graph = tf.compat.v1.get_default_graph()

        def keep(ids: tf.Tensor, grads: tf.Tensor) -> None:
            kept = self._pending
            trains = training
            if kept is not None and kept.graph is graph:  # another call of this step
                ids, grads = tf.concat([kept.ids, ids], 0), tf.concat([kept.grads, grads], 0)
                trains = trains and kept.training
            self._pending = Pending(graph, ids, grads, optimizer, trains)

        replica = tf.distribute.get_replica_context()
        if not tf.distribute.has_strategy() or replica is None or replica.num_replicas_in_sync == 1:
            keep(unique, summed)
            return

        def merged(strategy: tf.distribute.Strategy, unique: Any, summed: Any) -> None:
            keep(
                tf.concat(strategy.experimental_local_results(unique), 0),
                tf.concat(strategy.experimental_local_results(summed), 0),
            )

        replica.merge_call(merged, args=(unique, summed))

    def _push_pending(self, value: Any) -> tf.Tensor | None:
        """Called as the optimizer writes the anchor: pushes the rows kept
        for this step (once, for every replica). None when nothing of this
        step is pending (a restore or another write of the anchor)."""
        pending = self._pending
        if pending is None or not within(pending.graph):
            return None
        replica = tf.distribute.get_replica_context()
        if (
            tf.distribute.has_strategy()
            and replica is not None
            and replica.num_replicas_in_sync > 1
        ):

            def merged(strategy: tf.distribute.Strategy) -> tf.Tensor:
                self._pending = None
                return self._push(pending)

            return replica.merge_call(merged)
        self._pending = None
        return self._push(pending)

    def _push(self, pending: Pending) -> tf.Tensor:
        """Pushes the rows (the shard sums repeated ids); True once queued
        (or applied, with sync_push)."""
        client = self.client
        assert client is not None
        if not pending.training:
            raise ValueError(
                f"layer {self.name!r}: a gradient reached rows looked up with training=False, "
                "which made no rows and know no optimizer to push with: call the layer with "
                "training=True (or pass the model's `training` argument through) where it trains"
            )
        if getattr(self, "_dlt_row_cache", None) is not None:
            # (A layer frozen when its cache was made, trained since.)
            self.refuse_cached_16_bit_pushes("training")
        lr = self._current_learning_rate(pending.optimizer)
        pushed = ops.push(
            client, pending.ids, pending.grads, lr, self.table_name, self.output_dim,
            sync=self.sync_push,
        )  # fmt: skip
        count = self.pushes.assign_add(1)
        deps = [d for d in (pushed, count) if d is not None]
        with tf.control_dependencies(deps):
            return tf.constant(True)

    def _check_optimizer(self, optimizer: Any) -> None:
        inner = keras_settings.inner(optimizer)
        steps = getattr(inner, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"layer {self.name!r}: the model's optimizer accumulates gradients over "
                f"{steps} steps (gradient_accumulation_steps), which distributed tables do "
                "not support: their rows are pushed every step. Use a larger batch instead."
            )
        if optimizer is None and (self.optimizer is None or self.learning_rate is None):
            entry = getattr(self._get_call_context(), "entry_layer", None)
            if isinstance(entry, keras.Model) and entry is not self:
                # A custom train_step calling a sub-model: the compiled
                # model's optimizer is not the call's.
                raise ValueError(
                    f"layer {self.name!r} follows the model's optimizer (optimizer=None or "
                    f"learning_rate=None), and it trains in a call of model {entry.name!r}, "
                    "which is not compiled (a train_step calling a sub-model itself): call the "
                    "compiled model (self(x, training=True)), compile "
                    f"{entry.name!r} with the compiled model's optimizer object too, or give the "
                    "layer optimizer= and learning_rate="
                )
            raise ValueError(
                f"layer {self.name!r} follows the model's optimizer (optimizer=None or "
                "learning_rate=None), but it trains outside a compiled model: compile the model, "
                "or give the layer optimizer= and learning_rate="
            )

    def _current_learning_rate(self, optimizer: Any) -> tf.Tensor:
        lr = self.learning_rate
        if lr is None:
            return keras_settings.current_learning_rate(optimizer)
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            return tf.cast(lr(tf.cast(self.pushes, tf.float32)), tf.float32)
        return tf.constant(float(lr), tf.float32)

    def count_params(self) -> int:
        """The layer's own weights (what Keras totals); for a distributed
        table, `model.summary()` also shows its dim and where its rows are."""
        count = int(super().count_params())
        if not self.is_distributed:
            return count
        where = (
            "embedded"
            if self.client is None or self.client.embedded
            else (f"{len(self.client.pservers)} shards")
        )
        return _TableParams(count, f"table dim {self.output_dim}, {where}")

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if not self.mask_zero:
            return None
        return keras.ops.not_equal(inputs, 0)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return combiners.output_shape(self, input_shape)

    def compute_output_spec(self, inputs: Any, training: Any = None) -> Any:
        return combiners.output_spec(self, inputs)

    # Serialization -----------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        init = self.embeddings_initializer
        if isinstance(init, initializers.Initializer):
            init = init.to_dict()
        elif not isinstance(init, (str, dict)):
            init = keras.initializers.serialize(init)
        lr = self.learning_rate
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            lr = keras.optimizers.schedules.serialize(lr)
        config.update(
            input_dim=self.input_dim,
            output_dim=self.output_dim,
            is_distributed=self.is_distributed,
            is_sparse=self.is_sparse,
            embeddings_initializer=init,
            optimizer=None if self.optimizer is None else self.optimizer.to_dict(),
            combiner=self.combiner,
            mask_zero=self.mask_zero,
            learning_rate=lr,
            seed=self.seed,
            table_name=self.table_name,
            sync_push=self.sync_push,
            memory=self.memory.get_config(),
        )
        if self.client is not None and not self.client.embedded:
            # Where the rows are (never the token: TF_DLT_AUTH_TOKEN_FILE).
            config["pservers"] = list(self.client.pservers)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Embedding:
        config = dict(config)
        lr = config.get("learning_rate")
        if isinstance(lr, dict):
            config["learning_rate"] = keras.optimizers.schedules.deserialize(lr)
        pservers = config.pop("pservers", None)
        layer = cls(**config)
        if pservers:  # TF_DLT_PSERVERS re-points a loaded model
            layer.use_client(ops.ClientResource(ops.overridden_pservers(pservers)))
        return layer

    # Keras saving (.keras, .weights.h5) ------------------------------------------

    def save_own_variables(self, store: Any) -> None:
        """Saves the layer's weights and, for an embedded table, its rows
        (values, optimizer slots, update counts) and config: they are this
        process's state, as a Keras Embedding's weights are. Rows on shard
        servers stay there (save them with tf_dlt.save). Within
        `variables_only()` (tf_dlt.save, which writes the tables itself),
        the weights only."""
        super().save_own_variables(store)
        if _variables_only.active or not self.is_distributed or not self.built:
            return
        if self.client is None or not self.client.embedded:
            return
        with tf.init_scope():
            ops.flush(self.client)
        ids, values, slots, steps = embedded.rows(self.table_name)
        config = json.dumps(embedded.table(self.table_name).config, sort_keys=True)
        store[_ROWS_KEYS[0]] = ids
        store[_ROWS_KEYS[1]] = values
        store[_ROWS_KEYS[2]] = slots
        store[_ROWS_KEYS[3]] = steps
        store[_ROWS_KEYS[4]] = np.frombuffer(config.encode(), np.uint8)
        lineage = "|".join(table_home.lineage(self.table_name))
        store[_LINEAGE_KEY] = np.frombuffer(lineage.encode(), np.uint8)

    def load_own_variables(self, store: Any) -> None:
        keys = set(store.keys())
        variables = self._trainable_variables + self._non_trainable_variables
        if sorted(keys - {*_ROWS_KEYS, _LINEAGE_KEY}) != sorted(
            str(i) for i in range(len(variables))
        ):
            raise ValueError(
                f"layer {self.name!r} has {len(variables)} variables; the file holds {sorted(keys)}"
            )
        has_rows = set(_ROWS_KEYS) <= keys
        on_shards = self.client is not None and not self.client.embedded
        # Refused, or the rows staged, before any weight changes: a file
        # this layer cannot take leaves it as it was.
        staged = None
        if self.is_distributed and not _variables_only.active:
            if has_rows and on_shards:
                raise errors.FailedPreconditionError(
                    f"layer {self.name!r} is on shard servers, but the file holds the rows of an "
                    "embedded table: load the file into a model on the embedded tables, then "
                    "tf_dlt.transpile it onto the shards (which uploads its rows)"
                )
            if not has_rows and not on_shards:
                raise errors.FailedPreconditionError(
                    f"layer {self.name!r} keeps its rows in the embedded tables, but the file "
                    "holds none (written by a model whose table is on shard servers, whose rows "
                    "stay there; or before .keras files carried them; or for another layer): "
                    "restore them with tf_dlt.load from a tf_dlt.save checkpoint"
                )
            if has_rows:
                lineage = bytes(np.asarray(store[_LINEAGE_KEY])).decode() if (
                    _LINEAGE_KEY in keys
                ) else ""  # fmt: skip
                lineage_of_file = [token for token in lineage.split("|") if token]
                table_home.check_replacing_rows(self, lineage_of_file)
                staged = (*self._stage_rows(store), lineage_of_file)
        self._rows_follow = has_rows and not on_shards  # imported below: no rollback
        try:
            for i, variable in enumerate(variables):
                variable.assign(store[str(i)])
        finally:
            self._rows_follow = False
        if staged is not None:
            self._install_rows(*staged)

    def _rolled_back(self, held: int, given: int) -> None:
        """Warns that the layer's Keras weights were set back (from `held`
        pushes to `given`) while its table's rows stay as trained last,
        unless the rows are restored with them (tf_dlt.load, a .keras file
        holding an embedded table's rows)."""
        if _variables_only.active or self._rows_follow:
            return
        warnings.warn(
            f"layer {self.name!r}: its Keras weights were set back from {held} pushes to "
            f"{given} (Model.set_weights, which EarlyStopping(restore_best_weights=True) "
            "calls, or load_weights of an older file), but the rows of its table "
            f"{self.table_name!r} stay as trained last: the model now pairs older dense "
            "weights with newer rows. To restore an epoch whole, save with "
            "tf_dlt.ModelCheckpoint and tf_dlt.load that epoch's checkpoint (docs/keras.md)",
            UserWarning,
            stacklevel=4,
        )

    def _stage_rows(self, store: Any) -> tuple[Any, TableConfig]:
        """A new embedded table holding the file's rows, and its config
        (not installed yet); FailedPreconditionError when the file's table
        was saved with another config."""
        assert self.client is not None
        saved = TableConfig.from_dict(json.loads(bytes(np.asarray(store[_ROWS_KEYS[4]])).decode()))
        mine = self.table_config
        if self.optimizer is None:  # following the model: the saved table's optimizer
            mine = dataclasses.replace(mine, optimizer=saved.optimizer)
        differs = difference(saved.to_dict(), dataclasses.replace(mine, name=saved.name).to_dict())
        if differs != "none":
            raise errors.FailedPreconditionError(
                f"layer {self.name!r}: the file's table was saved with another config "
                f"(file vs layer: {differs})"
            )
        config = dataclasses.replace(saved, name=self.table_name)
        with tf.init_scope():
            table = embedded.shard().new_table(config.to_dict())
            steps = np.asarray(store[_ROWS_KEYS[3]], np.uint32)
            table.import_rows(
                np.asarray(store[_ROWS_KEYS[0]], np.int64),
                np.asarray(store[_ROWS_KEYS[1]], np.float32),
                np.asarray(store[_ROWS_KEYS[2]], np.float32),
                steps,
            )
            # Saved before any push: the first training step still settles
            # its optimizer (the model's compiled one).
            table.provisional = self.optimizer is None and not steps.any()
        return table, config

    def _install_rows(self, table: Any, config: TableConfig, lineage: list[str]) -> None:
        """Serves `table` (from _stage_rows) as this layer's embedded table,
        of lineage `lineage` (the file's)."""
        assert self.client is not None
        with tf.init_scope():
            ops.flush(self.client)
            embedded.shard().install_tables([table])
        table_home.rows_replaced(self.table_name, lineage)
        self.table_config = config
        self._settled = False
        self._from_earlier_session = False
        self._rows_loaded = True


class _TableParams(int):
    """A parameter count that `model.summary()` prints with what the table
    is (Keras formats it with "," and totals the weights, not this)."""

    note: str

    def __new__(cls, count: int, note: str) -> _TableParams:
        value = super().__new__(cls, count)
        value.note = note
        return value

    def __format__(self, spec: str) -> str:
        return f"{int(self):{spec}} + {self.note}"


def _initial_weights(weights: Any, input_dim: int | None, output_dim: int) -> np.ndarray | None:
    """`weights` as keras.layers.Embedding takes them: one (input_dim,
    output_dim) matrix, alone or in a list."""
    if weights is None:
        return None
    if isinstance(weights, (list, tuple)):
        if len(weights) != 1:
            raise ValueError(f"weights must hold one matrix, got {len(weights)}")
        weights = weights[0]
    matrix = np.asarray(weights, dtype=np.float32)
    rows = input_dim if input_dim is not None else (matrix.shape[0] if matrix.ndim == 2 else None)
    if matrix.ndim != 2 or matrix.shape != (rows, output_dim):
        raise ValueError(
            f"weights must have shape (input_dim, output_dim) = ({input_dim}, {output_dim}), "
            f"got {matrix.shape}"
        )
    return matrix
