"""Walking a Keras model for what tf_dlt keeps outside it: every layer
(nested models included), the distributed embeddings, the cluster their
tables live on, and everything that holds a table (the embeddings and a
`tf_dlt.DenseOnShards` optimizer)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import keras

from tf_dlt import dlt_ops as ops
from tf_dlt import errors
from tf_dlt.layers.embedding import Embedding


def walk_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer of `model`, nested models' layers included (after the
    nested model itself)."""
    out: list[keras.layers.Layer] = []
    for layer in model.layers:
        out.append(layer)
        if isinstance(layer, keras.Model):
            out += walk_layers(layer)
    return out


def distributed_layers(model: keras.Model) -> list[Embedding]:
    """The distributed `Embedding` layers of `model`, nested ones included."""
    return [
        layer
        for layer in walk_layers(model)
        if isinstance(layer, Embedding) and layer.is_distributed
    ]


def model_clients(model: keras.Model) -> list[ops.ClientResource]:
    """The distinct clients of the model's tables (and of its optimizer's
    dense table, under tf_dlt.DenseOnShards)."""
    found: dict[str, ops.ClientResource] = {}
    candidates = [layer.client for layer in distributed_layers(model)]
    candidates.append(getattr(getattr(model, "optimizer", None), "client", None))
    for client in candidates:
        if isinstance(client, ops.ClientResource):
            found.setdefault(client.shared_name, client)
    return list(found.values())


def chosen_layers(model: keras.Model, wanted: list[Any] | None, caller: str) -> list[Embedding]:
    """The distributed `Embedding` layers of `model` that `wanted` names
    (layer objects or names; None: all of them); `caller` prefixes errors."""
    candidates = distributed_layers(model)
    if wanted is None:
        return candidates
    if isinstance(wanted, (str, bytes, keras.layers.Layer)) or not isinstance(wanted, Iterable):
        raise errors.InvalidArgumentError(
            f"{caller}: layers must be a list of distributed Embedding layers or their names, "
            f"got {getattr(wanted, 'name', wanted)!r} alone (one layer: layers=[...])"
        )
    by_name = {layer.name: layer for layer in candidates}
    chosen = []
    for item in wanted:
        layer = by_name.get(item) if isinstance(item, str) else item
        if layer is None or not any(layer is c for c in candidates):
            raise errors.InvalidArgumentError(
                f"{caller}: {getattr(item, 'name', item)!r} is not a distributed Embedding of "
                f"model {model.name!r}"
            )
        chosen.append(layer)
    return chosen


def cluster_of(layers: list[Any]) -> tuple[list[str], str]:
    """(addresses, auth token) shared by the layers' clients; [] if embedded."""
    kinds = {tuple(layer.client.pservers) for layer in layers}
    if len(kinds) > 1:
        raise errors.InvalidArgumentError(
            f"the model's tables are on {len(kinds)} different clusters ({sorted(kinds)}); "
            "tf_dlt.save and export_saved_model handle one cluster (or the embedded tables) "
            "per model"
        )
    addresses = list(kinds.pop()) if kinds else []
    token = layers[0].client.auth_token if layers else ""
    return addresses, token


def table_holders(model: keras.Model) -> list[Any]:
    """What holds the model's tables: its distributed layers, and its
    optimizer when that keeps the dense weights in a table
    (tf_dlt.DenseOnShards). Each has client, table_name, output_dim and
    table_config."""
    holders: list[Any] = list(distributed_layers(model))
    optimizer = getattr(model, "optimizer", None)
    if getattr(optimizer, "client", None) is not None and hasattr(optimizer, "table_config"):
        holders.append(optimizer)
    return holders


def _paired(
    source: keras.Model, target: keras.Model
) -> Iterator[tuple[keras.layers.Layer, keras.layers.Layer]]:
    """(layer of `source`, layer of `target`) of the same name in the same
    model, nested models' layers paired inside them: a name is unique
    within one model only (two towers made by one function each hold a
    "hidden"), so layers are never paired across models."""
    old = {layer.name: layer for layer in source.layers}
    for layer in target.layers:
        match = old.get(layer.name)
        if match is None:
            continue
        yield match, layer
        if isinstance(layer, keras.Model) and isinstance(match, keras.Model):
            yield from _paired(match, layer)


def copy_weights(source: keras.Model, target: keras.Model) -> None:
    """Copies the weights of every layer of `source` into its counterpart in
    `target` (`_paired`), except distributed tables (their rows live in the
    tables) and layers whose weights differ in shape (rewritten layers); and
    the state a layer keeps in assets, as a .keras file does (an adapted
    IntegerLookup's vocabulary: made again from its config, the layer had
    none, and the transpiled model failed its first call with "Table not
    initialized")."""
    for old, layer in _paired(source, target):
        if isinstance(layer, keras.Model) or (
            isinstance(layer, Embedding) and layer.is_distributed
        ):
            continue
        if callable(getattr(old, "save_assets", None)) and type(old) is type(layer):
            with tempfile.TemporaryDirectory(prefix="tf_dlt-assets-") as assets:
                old.save_assets(assets)
                layer.load_assets(assets)
        if not old.get_weights() or not layer.get_weights():
            continue
        if [w.shape for w in old.get_weights()] == [w.shape for w in layer.get_weights()]:
            layer.set_weights(old.get_weights())


def clone_keeping_inputs(model: keras.Model, clone_layer: Any) -> keras.Model:
    """`keras.models.clone_model(model, clone_function=clone_layer,
    recursive=True)`, but every Functional or Sequential model in it (the
    model itself, models nested in it) gets inputs as sparse or ragged as
    its own: clone_model's drop both, so a model fed SparseTensor ids could
    no longer take them once transpiled or frozen for export. A layer or
    model used twice is cloned once, as clone_model's own recursion does.
    The copy is not compiled: clone_model compiles a compiled model's copy
    from its compile config, which made a `tf_dlt.DenseOnShards` optimizer
    anew, connecting to the shards without the token it was given."""
    from keras.src.models.functional import Functional

    done: dict[int, Any] = {}

    def clone(layer: Any) -> Any:
        if id(layer) not in done:
            if isinstance(layer, (keras.Sequential, Functional)):
                done[id(layer)] = clone_model(layer)
            else:
                done[id(layer)] = clone_layer(layer)
        return done[id(layer)]

    def clone_model(m: keras.Model) -> keras.Model:
        inputs = _inputs_like(m)
        if inputs is not None and isinstance(m, keras.Sequential):
            # (clone_model's Input(tensor=...) of a Sequential drops them too)
            return keras.Sequential(
                [inputs, *(clone(layer) for layer in m.layers)], name=m.name, trainable=m.trainable
            )
        compiled, m.compiled = m.compiled, False  # (what clone_model reads)
        try:
            return keras.models.clone_model(m, input_tensors=inputs, clone_function=clone)
        finally:
            m.compiled = compiled

    return clone_model(model)


def _inputs_like(model: keras.Model) -> Any:
    """New inputs like `model`'s, each as sparse or ragged as its own, for
    clone_model's `input_tensors`; None where all are dense (clone_model's
    own inputs then), or for a model that has none."""
    try:  # (a Sequential has `inputs` before it was ever called; `input` after)
        inputs = model.inputs[0] if isinstance(model, keras.Sequential) else model.input
    except (AttributeError, ValueError, IndexError, TypeError):  # not built on inputs
        return None
    if not any(getattr(i, "sparse", False) or getattr(i, "ragged", False)
               for i in keras.tree.flatten(inputs)):  # fmt: skip
        return None

    def like(tensor: Any) -> Any:
        return keras.Input(
            batch_shape=tensor.shape, dtype=tensor.dtype, name=tensor.name,
            sparse=bool(getattr(tensor, "sparse", False)),
            ragged=bool(getattr(tensor, "ragged", False)),
        )  # fmt: skip

    return keras.tree.map_structure(like, inputs)
