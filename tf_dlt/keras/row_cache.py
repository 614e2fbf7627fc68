"""A hot-row cache on the trainer for a model's distributed tables.

`hot_row_cache(model, rows=...)` makes the trainer keep the rows of each
table's most frequent ids, with their optimizer state, so their lookups skip
the shards. The trainer's own pushes are applied to the cached rows with the
table's optimizer, the shards' arithmetic, so one trainer reads what the
shards hold; other trainers' pushes reach a cached row when it is pulled
again, once it is `max_staleness_steps` lookups or `max_staleness_ms` old.
"""

from __future__ import annotations

import uuid
from typing import Any

import keras

from tf_dlt import dlt_ops as ops
from tf_dlt import errors
from tf_dlt.keras.walk import chosen_layers, distributed_layers


def hot_row_cache(
    model: keras.Model,
    rows: int,
    *,
    max_staleness_steps: int | None = 16,
    max_staleness_ms: int | None = None,
    min_count: int = 2,
    layers: list[Any] | None = None,
) -> keras.Model:
    """Caches the hot rows of the model's tables on this trainer; returns `model`.

    Args:
        model: a model whose tables are on shard servers (after
            `tf_dlt.transpile`, and compiled: the cache applies pushes with
            the table's optimizer). With the embedded tables it changes
            nothing: the rows are in the process already.
        rows: rows cached per table at most, the memory bound: each takes
            its values and optimizer slots in float32 plus at most 92 bytes,
            and a frequency sketch of 40 bytes per row (4 to 16 MiB) per
            table (`dlt_cache_capacity_bytes` in `tf_dlt.ClientMetrics`). 0
            removes the caches.
        max_staleness_steps: a cached row is pulled again once the table was
            looked up this many times since its pull (a training step looks
            a table up once per layer that uses it). None: no such bound.
        max_staleness_ms: the same in milliseconds. None: no such bound.
            At least one bound is needed.
        min_count: an id is cached once it was looked up this many times
            (1 to 255; counted in a small frequency sketch) and, with
            `max_staleness_steps`, often enough that its expected lookups
            within the bound repay its fill and refreshes (each pulls the
            optimizer state too); a new id is filled at a count only while
            enough of the ids that reached it were looked up again to repay
            the fill's extra bytes (docs/keras.md); when the cache is full,
            a newcomer replaces the rarest of a few sampled rows if it is
            more frequent.
        layers: the distributed `Embedding` layers (objects or names) whose
            tables to cache; None: every one. Every layer of the model that
            uses one of their tables (`table_name=`) looks it up through
            the cache too (the cache is the table's: a sibling outside it
            pushed past it, and the cached rows missed those pushes).

    Tables whose rows or slots are stored in 16 bits (`value_dtype`,
    `slot_dtype`) are refused where the layer trains (and a frozen one's
    first training step, once unfrozen): the shard rounds each update into
    16 bits, which the cache, applying pushes in float32, would not (its
    rows drifted from the shards' with every push).

    Consistency: a cached row reflects every push of this trainer, each
    applied to it as the push leaves (a push that fails is forgotten: its
    rows are pulled again). Pushes of other trainers are seen within the
    staleness bound. A push still in flight when a row is pulled again may
    be missing from it until its next refresh, as it would be from a pull
    without the cache. Tables with a cache are not pulled ahead
    (`tf_dlt.pull_ahead`): their lookups serve hot rows from the cache and
    pull the rest.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise errors.InvalidArgumentError(f"hot_row_cache: rows must be an int >= 0, got {rows!r}")
    if rows and max_staleness_steps is None and max_staleness_ms is None:
        raise errors.InvalidArgumentError(
            "hot_row_cache: give max_staleness_steps or max_staleness_ms: other trainers' "
            "pushes reach cached rows only when they are pulled again"
        )
    for name, value in (("max_staleness_steps", max_staleness_steps),
                        ("max_staleness_ms", max_staleness_ms)):  # fmt: skip
        counted = isinstance(value, int) and not isinstance(value, bool)
        if value is not None and (not counted or value < 1):
            raise errors.InvalidArgumentError(
                f"hot_row_cache: {name} must be an int >= 1 or None, got {value!r}"
            )
    if isinstance(min_count, bool) or not isinstance(min_count, int) or not 1 <= min_count <= 255:
        raise errors.InvalidArgumentError(
            f"hot_row_cache: min_count must be an int in [1, 255], got {min_count!r}"
        )
    chosen = chosen_layers(model, layers, "hot_row_cache")
    if not chosen:
        raise errors.InvalidArgumentError(
            f"hot_row_cache: model {model.name!r} has no distributed Embedding"
        )
    for layer in chosen:
        if not layer.built or layer.client is None:
            raise errors.FailedPreconditionError(
                f"hot_row_cache: layer {layer.name!r} is not built yet; build the model "
                "(tf_dlt.transpile does) first"
            )
    chosen = _with_siblings(model, chosen)
    for layer in chosen if rows else ():
        layer.refuse_cached_16_bit_pushes("hot_row_cache")
    _own_clients(model, chosen)
    for layer in chosen:
        assert layer.client is not None
        config = layer.table_config
        if layer.optimizer is None and not layer.trainable:
            # A frozen layer pushes nothing and leaves its table's optimizer
            # as it is (whatever the model is compiled with): its cache
            # pulls the rows' state as the shards hold it.
            config = ops.held_table_config(layer.client, layer.table_name) or config
        elif layer.optimizer is None:  # the cache applies the table's optimizer: settle it
            if not getattr(model, "compiled", False):
                raise errors.FailedPreconditionError(
                    f"hot_row_cache: layer {layer.name!r} follows the model's optimizer, and "
                    f"model {model.name!r} is not compiled: compile it first (the cache applies "
                    "pushes with the table's optimizer)"
                )
            layer.follow_optimizer(model.optimizer)
            config = layer.table_config
        settings = (rows, max_staleness_steps or 0, max_staleness_ms or 0, min_count)
        layer.configure_row_cache(config, settings)
    return model


def forget_cached_rows(layers: list[Any]) -> None:
    """Empties the hot-row caches of `layers` (each configured again as it
    was): after a load (tf_dlt.load, resilient_fit) the rows and slots they
    hold are not the shards' any more, and lookups served them, and pushes
    were applied to them, until each was pulled again."""
    for layer in layers:
        cached = getattr(layer, "_dlt_row_cache", None)
        if cached and layer.client is not None:
            # Checked when made; no round trip that could fail a load done.
            config, settings = cached
            layer.configure_row_cache(config, settings, check=False)


def _with_siblings(model: keras.Model, chosen: list[Any]) -> list[Any]:
    """`chosen` and every other distributed layer of `model` that uses one
    of their tables (same shards, same table_name): a table's cache lives
    in the client, so they all look it up there."""
    tables = {(layer.client.shared_name, layer.table_name) for layer in chosen}
    out = list(chosen)
    for layer in distributed_layers(model):
        if layer.client is None or any(layer is c for c in out):
            continue
        if (layer.client.shared_name, layer.table_name) in tables:
            out.append(layer)
    return out


def _own_clients(model: keras.Model, chosen: list[Any]) -> None:
    """Gives the chosen layers a client of this model's own, so the caches
    (which live in a client) belong to this model: another model of the
    same shards in this process, or a later one, keeps its own lookups and
    pull-ahead. The model's step functions are traced again for it."""
    tag = getattr(model, "_dlt_cache_client", None)
    if tag is None:
        tag = model._dlt_cache_client = f"hot_rows_{uuid.uuid4().hex[:12]}"
    private: dict[str, ops.ClientResource] = {}
    for layer in chosen:
        client = layer.client
        if client.embedded or client.instance == tag:
            continue
        if client.shared_name not in private:
            private[client.shared_name] = client.private(tag)
        layer.use_client(private[client.shared_name])
        model.train_function = model.test_function = model.predict_function = None
