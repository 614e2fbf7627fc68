"""transpile(model, pservers): a new model whose distributed embeddings (and,
on request, plain Keras embeddings) are backed by the given shard servers.

A pure rewrite on `keras.models.clone_model`: the input model is never
changed; every other layer is rebuilt from its config and gets a copy of its
weights; the tables are created on the servers and the existing rows
uploaded; a compiled model comes back compiled the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from tf_dlt import dlt_ops as ops
from tf_dlt import embedded
from tf_dlt.cluster import ClusterSpec
from tf_dlt.keras.walk import clone_keeping_inputs, copy_weights, walk_layers
from tf_dlt.layers import keras_settings, table_home
from tf_dlt.layers.embedding import Embedding
from tf_dlt.progress import Progress

EMBEDDED = "embedded"
# Rows per upload call: bounded memory per call, and progress to show.
_UPLOAD_ROWS = 1 << 16


def _check_rewritable(model: keras.Model) -> None:
    if isinstance(model, keras.Sequential):
        return
    if not getattr(model, "_is_graph_network", False) and type(model).__name__ != "Functional":
        raise TypeError(
            f"transpile supports Sequential and Functional models (also nested); "
            f"{type(model).__name__} is a subclassed model: build it with the Functional API, "
            "or create its tf_dlt.layers.Embedding layers with a shard client "
            "(layer.use_client) before building it"
        )
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            _check_rewritable(layer)


def _is_local_embedding(layer: keras.layers.Layer) -> bool:
    return isinstance(layer, keras.layers.Embedding) or (
        isinstance(layer, Embedding) and not layer.is_distributed
    )


def _check_convertible(layer: keras.layers.Layer) -> None:
    """ValueError where `convert_keras_embeddings` cannot make a local
    embedding a table that reads and trains as it did: before anything is
    made (a table of an unbuilt layer was made, then an IndexError)."""
    if not _is_local_embedding(layer):
        return
    refuse = f"convert_keras_embeddings: layer {layer.name!r}"
    if not layer.built:
        raise ValueError(
            f"{refuse} is not built, so it has no rows to upload: build the model first (give "
            "it a keras.Input, or call it on a batch)"
        )
    if getattr(layer, "quantization_mode", None):
        raise ValueError(
            f"{refuse} is quantized ({layer.quantization_mode}); a table holds float rows: "
            "convert the model before quantizing it"
        )
    if getattr(layer, "lora_enabled", False):
        raise ValueError(
            f"{refuse} has LoRA enabled; a table holds and trains whole rows: convert the model "
            "before enabling LoRA, or leave its embeddings local"
        )
    for option in (
        "embeddings_regularizer", "activity_regularizer", "embeddings_constraint",
    ):  # fmt: skip
        if getattr(layer, option, None) is not None:
            raise ValueError(
                f"{refuse} has {option}, which a table does not apply: remove it, or leave the "
                "model's embeddings local (convert_keras_embeddings=False)"
            )


def _check_conversion(model: keras.Model) -> None:
    """`_check_convertible` for every layer, and ValueError where a
    converted layer's table would be another layer's: two towers made by
    one function each convert their "emb" into table "emb", and the second
    upload replaced the first's rows."""
    owners: dict[str, keras.layers.Layer] = {}
    for layer in walk_layers(model):
        _check_convertible(layer)
        if not isinstance(layer, (Embedding, keras.layers.Embedding)):
            continue
        table = layer.table_name if isinstance(layer, Embedding) else layer.name
        other = owners.setdefault(table, layer)
        if other is not layer and (_is_local_embedding(layer) or _is_local_embedding(other)):
            raise ValueError(
                f"convert_keras_embeddings: layers {other.name!r} and {layer.name!r} (of two "
                f"models) would both be table {table!r}: rename one of them (or give a tf_dlt "
                "Embedding its own table_name=)"
            )


def _distributed_like(layer: keras.layers.Layer) -> Embedding:
    """The distributed Embedding that takes local embedding `layer`'s place:
    a tf_dlt one keeps its whole config (combiner, optimizer, policies); a
    Keras one its size, mask, trainable flag and dtype policy (a mixed one
    still hands bfloat16 or float16 on)."""
    if isinstance(layer, Embedding):
        config = {**layer.get_config(), "is_distributed": True}
        config.pop("pservers", None)
        try:  # (its rows are uploaded: the initializer makes only later ids')
            keras_settings.table_initializer(
                config["embeddings_initializer"], layer.input_dim, layer.output_dim
            )
        except ValueError:  # one a table cannot apply row by row (Orthogonal): the default
            config.pop("embeddings_initializer")
        return Embedding.from_config(config)
    return Embedding(
        input_dim=layer.input_dim, output_dim=layer.output_dim, is_distributed=True,
        mask_zero=layer.mask_zero, name=layer.name, trainable=layer.trainable,
        dtype=layer.dtype_policy,
    )  # fmt: skip


def transpile(
    model: keras.Model,
    pservers: Sequence[str] | str | ClusterSpec = EMBEDDED,
    *,
    convert_keras_embeddings: bool = False,
    auth_token: str = "",
    **client_options: Any,
) -> keras.Model:
    """Returns a copy of `model` whose distributed tables live on `pservers`.

    Args:
        model: a Sequential or Functional Keras model (nested ones too).
        pservers: shard data addresses in shard-index order, a
            `tf_dlt.ClusterSpec` (`tf_dlt.cluster_from_env()`; no shards:
            embedded), or "embedded" for the in-process tables.
        convert_keras_embeddings: also turn `keras.layers.Embedding` (and local
            `tf_dlt.layers.Embedding`) layers into distributed ones, their
            weights uploaded as ids 0..input_dim-1.

        Tables whose layers name no optimizer are created for the model's
        compiled optimizer (its server-side form, same hyper-parameters; the
        learning rate follows it step by step); compiled later or again,
        the first training step gives them its optimizer (while nothing
        trained them).
        auth_token: token of the shard servers.
        **client_options: more `tf_dlt.ops.ClientResource` options
            (timeouts, frame_bytes, max_inflight_pushes).

    Returns:
        A new model; `model` is not modified. Rows are copied with fresh
        optimizer slots. Transpiling a model already backed by `pservers`
        again gives an equivalent model and moves no rows.
    """
    _check_rewritable(model)
    if convert_keras_embeddings:
        _check_conversion(model)
    if isinstance(pservers, ClusterSpec):
        addresses = list(pservers.pservers)
    elif isinstance(pservers, str):
        addresses = [] if pservers == EMBEDDED else [p for p in pservers.split(",") if p]
    else:
        addresses = list(pservers)
    compiled_optimizer = (
        getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None
    )
    target = ops.ClientResource(addresses, auth_token=auth_token, **client_options)
    if not target.embedded:
        # A model made afresh starts from the shards' processes serving now:
        # a client of these shards this process kept (the op's resource is
        # shared by name) may have met processes that restarted since.
        ops.regreet(target)
    uploads: list[tuple[Embedding, Any]] = []

    def create(layer: Embedding) -> None:
        layer.follow_optimizer(compiled_optimizer)
        if not target.embedded:
            # Following the model: provisional until the first training step
            # settles it (the model may be compiled again before training).
            provisional = layer.optimizer is None
            table_home.create(layer.name, layer.table_config, target, provisional)

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        if isinstance(layer, Embedding) and layer.is_distributed:
            config = layer.get_config()
            config.pop("pservers", None)  # the target's, below
            new = Embedding.from_config(config)
            new.use_client(target)
            create(new)
            source = layer.client
            if source is not None and source.pservers != target.pservers:
                if not source.embedded:
                    raise ValueError(
                        f"layer {layer.name!r} is already on other shard servers "
                        f"({source.pservers}); to move its rows, tf_dlt.save(model, path), "
                        "build the model on the target (the embedded tables or other shards) "
                        "and tf_dlt.load(model, path) into it (docs/keras.md)"
                    )
                ids, values, _, _ = embedded.rows(layer.table_name)
                uploads.append((new, (ids, values)))
            return new
        if convert_keras_embeddings and _is_local_embedding(layer):
            new = _distributed_like(layer)
            new.use_client(target)
            create(new)
            weights = keras.ops.convert_to_numpy(layer.embeddings)
            uploads.append((new, (np.arange(len(weights), dtype=np.int64), weights)))
            return new
        return layer.__class__.from_config(layer.get_config())

    new_model = clone_keeping_inputs(model, clone)
    copy_weights(model, new_model)
    for layer, (ids, values) in uploads:
        total = int(len(ids))
        with Progress(f"uploading {layer.table_name}", total, "rows") as bar:
            for start in range(0, total, _UPLOAD_ROWS):
                end = min(start + _UPLOAD_ROWS, total)
                ops.assign(
                    target, ids[start:end], values[start:end], layer.table_name, layer.output_dim
                )
                bar.update(end - start)
    if getattr(model, "compiled", False):
        # Same loss, metrics and options; a fresh optimizer from its config.
        new_model.compile_from_config(model.get_compile_config())
    return new_model
