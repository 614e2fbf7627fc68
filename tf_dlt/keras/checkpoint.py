"""tf_dlt.save / tf_dlt.load: a model's tables (every distributed embedding,
with optimizer state) and its dense weights, together, to any fsspec path.

Layout of `path`:

    tables/                      a tf_dlt checkpoint (docs/checkpoints.md): MANIFEST.json
                                 + shard files
    dense.<save id>.weights.h5   the Keras weights of the model (model.save_weights),
                                 written first, under the save's own name
    tf_dlt_model.json            written last: what the checkpoint holds, naming them

A save stopped after its tables committed leaves that save whole but for
its model file, which `chain.read_model` then reads from the tables.

Embedded tables are written in the same checkpoint format as shard servers
write theirs (one shard), so either kind loads the other's checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
from typing import Any

import keras

from tf_dlt import dlt_ops as ops
from tf_dlt import embedded, errors
from tf_dlt.checkpoint import chain, manifest, shard_files
from tf_dlt.client import Client, saved_despite_failovers
from tf_dlt.keras.row_cache import forget_cached_rows
from tf_dlt.keras.walk import cluster_of, distributed_layers, model_clients, table_holders
from tf_dlt.layers import table_home
from tf_dlt.layers.embedding import variables_only
from tf_dlt.table_config import TableConfig, difference, normalized

log = logging.getLogger("tf_dlt.keras.checkpoint")
MODEL_FILE = chain.MODEL_FILE
# The model attribute naming the checkpoint it last saved or loaded.
_LAST_CHECKPOINT = "_tf_dlt_last_checkpoint"
DENSE_FILE = chain.DENSE_FILE
TABLES_DIR = chain.TABLES_DIR


def save(
    model: keras.Model, path: str, *, incremental: bool = False, base: str | None = None
) -> dict[str, Any]:
    """Saves the tables of `model`'s distributed embeddings (waiting for
    pending pushes first) and its dense weights under `path`.

    Args:
        incremental: save the tables as a delta (the rows changed, and the
            ids removed, since the checkpoint this model last saved or
            loaded) when there is one; the dense weights are saved whole.
        base: the checkpoint to save a delta on top of (implies
            `incremental`); another directory than `path`.

    Returns what the checkpoint holds, with "kind" ("full" or "delta") and,
    for a delta, "parent". A save given up because a shard failed over as it
    wrote (`errors.FailedOverError`) is made again, under a new save id, on
    the copies serving (`tf_dlt.client.SAVE_TRIES` tries in all).
    """
    with errors.storage_errors(f"saving {path}"):
        return saved_despite_failovers(lambda: _save(model, path, incremental, base), path)


def _save(model: keras.Model, path: str, incremental: bool, base: str | None) -> dict[str, Any]:
    if base is None and incremental:
        base = _implied_base(model, path)
    if hasattr(getattr(model, "optimizer", None), "write_loaded_weights"):
        # A DenseOnShards not built yet (compiled, not trained: evaluate and
        # predict build none) holds no table to save: the checkpoint lacked
        # it, and its load was refused.
        _build_optimizer(model)
    layers = table_holders(model)
    _follow_compiled_optimizer(model)
    for layer in layers:
        if hasattr(layer, "write_loaded_weights"):  # DenseOnShards before its first step
            layer.write_loaded_weights(first_step=False)
        ops.flush(layer.client)
    addresses, token = cluster_of(layers)
    tables = _tables_of(path)
    base_tables = _tables_of(base) if base is not None else None
    if base_tables is not None:  # a delta refused (its path) before anything is written
        manifest.delta_parent(tables, base_tables, models=True)
    fs, root = manifest.filesystem(path)
    manifest.make_directory(fs, root)
    # The dense weights first, under the save's own name: when the tables
    # commit, the save is whole but for its model file (`chain.read_model`).
    save_id = chain.next_save_id(tables, base_tables)
    dense = chain.dense_file(save_id)
    with tempfile.TemporaryDirectory(prefix="tf_dlt-save-") as tmp:
        local = os.path.join(tmp, DENSE_FILE)
        with variables_only():  # the rows are in tables/
            model.save_weights(local)
        manifest.put_durably(fs, local, f"{root}/{dense}")
    written: dict[str, Any] = {"kind": "full"}
    try:
        if addresses:
            with Client(addresses, auth_token=token) as client:
                # The copies the model's ops wrote to, not a process
                # restarted empty since at a shard's address.
                lineages, layout_epoch = _met_lineages(layers)
                client.expect_lineages(lineages, layout_epoch=layout_epoch)
                # This model's tables only: other models' on the same shards
                # are theirs to save.
                written = client.save(
                    tables,
                    base=base_tables,
                    tables=[layer.table_name for layer in layers],
                    save_id=save_id,
                )
        elif layers:
            chain.refuse_breaking_dependents(tables)  # as Client.save does
            written = _save_embedded(layers, tables, base_tables, save_id)
    except BaseException:
        # Failed after its tables committed (in their cleanup, say): the
        # path holds this save now, dense weights included.
        if _holds_another_save(tables, save_id):
            with contextlib.suppress(FileNotFoundError, OSError):  # (UnavailableError too)
                gone = f"{root}/{dense}"
                manifest.within_deadline(fs, lambda **o: fs.rm(gone, **o), "removing", gone)
        raise
    info = {
        "format": "tf_dlt-model",
        "format_version": 1,
        "save_id": save_id,
        "dense_file": dense,
        "tables": [layer.table_name for layer in layers],
        "transport": "tcp" if addresses else "embedded",
        "created_unix": time.time(),
        "kind": written.get("kind", "full"),
    }
    if info["kind"] == "delta" and base is not None:
        info["parent"] = manifest.parent_reference(path, base)
    manifest.commit_file(fs, f"{root}/{MODEL_FILE}", json.dumps(info, indent=2).encode())
    chain.remove_superseded_dense(path, save_id)
    setattr(model, _LAST_CHECKPOINT, path)
    return info


def _met_lineages(layers: list[Any]) -> tuple[list[int], int]:
    """The lineage of the copy of each shard the layers' op clients met, and
    the layout epoch of those shards: the newest layout any of them knows,
    and of a shard 0 where none met it or two met different copies."""
    stats = [ops.client_stats(layer.client) for layer in layers if not layer.client.embedded]
    epoch = max((int(s["layout_epoch"]) for s in stats), default=0)
    met: list[int] = []
    for s in stats:
        if int(s["layout_epoch"]) != epoch:
            continue  # a client that has not learned the newest layout yet
        lineages = s["lineages"]
        met += [0] * (len(lineages) - len(met))
        for i, lineage in enumerate(lineages):
            if lineage and met[i] and met[i] != lineage:
                met[i] = -1  # two copies met: none is pinned
            elif lineage and not met[i]:
                met[i] = lineage
    return [max(m, 0) for m in met], epoch


def _holds_another_save(tables: str, save_id: str) -> bool:
    """Whether table checkpoint `tables` is known to hold no save, or one
    other than `save_id`. A manifest that cannot be read (a store's error)
    may be this save's: its dense weights are kept (an orphan a later save
    removes), where they were removed and the committed save lost them."""
    try:
        held = manifest.read_manifest(tables)["save_id"]
    except errors.NotFoundError:
        return True
    except Exception:  # noqa: BLE001 - unknown: kept
        log.warning(
            "saving %s: its manifest could not be read back: its dense weights stay", tables
        )
        return False
    return bool(held != save_id)


def _tables_of(path: str) -> str:
    return f"{path.rstrip('/')}/{TABLES_DIR}"


def _follow_compiled_optimizer(model: keras.Model, restoring: bool = False) -> None:
    """Tables following the compiled optimizer take (and settle) its form
    before a save writes their configs or a load (`restoring`) compares
    them with the checkpoint's: a table not trained yet is saved as the
    optimizer it will train with. A frozen layer's table keeps its own (the
    model may fine-tune the rest with an optimizer the table could not
    follow). A save of a trained layer whose table the shards lack is
    NotFoundError (it would save a table made afresh)."""
    if getattr(model, "compiled", False):
        for layer in distributed_layers(model):
            if layer.trainable:
                layer.follow_optimizer(model.optimizer, restoring=restoring)


def _implied_base(model: keras.Model, path: str) -> str | None:
    """The checkpoint an incremental save of `model` to `path` builds on:
    the one it last saved or loaded, unless that is gone or its chain reads
    `path` (saving there would break it); then None (a full save)."""
    last: str | None = getattr(model, _LAST_CHECKPOINT, None)
    if last is None or _unfit_base(last, path):
        return None
    return last


def _unfit_base(base: str, path: str) -> str | None:
    """Why a delta saved at `path` cannot stand on model checkpoint `base`:
    "gone" (its model file or its tables' chain is not there), "reads" (a
    load of `base` reads `path`'s tables: the delta would replace a link of
    its own chain), or None (it can). Each link is read once."""
    try:
        if not chain.read_model(base)["tables"]:  # the dense weights alone
            return None
        links = manifest.resolve_chain(_tables_of(base))
    except errors.DltError:
        return "gone"
    return "reads" if manifest.chain_holds(links, _tables_of(path)) else None


def _save_embedded(
    layers: list[Any], tables: str, base: str | None, save_id: str
) -> dict[str, Any]:
    """Writes the layers' embedded tables into a one-shard checkpoint at
    `tables`, as a shard server writes its own, as save `save_id`; a delta
    on top of `base` when given."""
    parent = manifest.delta_parent(tables, base, models=True) if base is not None else None
    layout = shard_files.ShardLayout()
    rows = [
        shard_files.native_rows(
            embedded.table(layer.table_name), layout, save_id, parent["save_id"] if parent else ""
        )
        for layer in layers
    ]
    part = shard_files.save_tables(tables, layout, rows, save_id)
    chain.refuse_breaking_dependents(tables)  # again, as Client.save does
    return manifest.write_manifest(tables, [part], save_id, parent)


def load(model: keras.Model, path: str) -> dict[str, Any]:
    """Restores what `save` wrote: the dense weights into `model` and the rows
    (with optimizer state) into the tables its layers use now, on shard
    servers or embedded, whichever held them at save time."""
    with errors.storage_errors(f"loading {path}"):
        return _load(model, path)


def _load(model: keras.Model, path: str) -> dict[str, Any]:
    info = chain.read_model(path)
    fs, root = manifest.filesystem(path)
    # A compiled optimizer built first: tf_dlt.DenseOnShards names its
    # table only once built (a model built afresh to resume).
    _build_optimizer(model)
    layers = table_holders(model)
    _follow_compiled_optimizer(model, restoring=True)
    missing = set(info["tables"]) - {layer.table_name for layer in layers}
    if missing:
        raise errors.FailedPreconditionError(
            f"the checkpoint holds tables {sorted(missing)} that the model has no layer for, "
            "nor a tf_dlt.DenseOnShards optimizer (compile the model as it was when saved)"
        )
    absent = {layer.table_name for layer in layers} - set(info["tables"])
    if absent:  # refused before any table changes (the dense weights could not load either)
        raise errors.FailedPreconditionError(
            f"the model's distributed tables {sorted(absent)} are not in the checkpoint (their "
            "layers were local, is_distributed=False, when it was saved, or it is another "
            "model's); nothing was changed"
        )
    with tempfile.TemporaryDirectory(prefix="tf_dlt-load-") as tmp:
        local = os.path.join(tmp, DENSE_FILE)
        weights = f"{root}/{info['dense_file']}"
        try:  # each request within its deadline (the download's of the size the HEAD gave)
            size = manifest.within_deadline(
                fs, lambda **o: fs.size(weights, **o), "looking up", weights
            )
            manifest.within_deadline(
                fs, lambda **o: fs.get_file(weights, local, **o), "downloading", weights,
                int(size or 0),
            )  # fmt: skip
        except FileNotFoundError:
            _refuse_saved_meanwhile(path, info)
            raise errors.NotFoundError(
                f"model checkpoint {path!r} lacks its dense weights {info['dense_file']}"
            ) from None
        # The dense weights first, then the tables (all or nothing): when
        # either fails, the dense weights go back as they were, so a failed
        # load changes nothing (but for a save to the path meanwhile: the
        # tables may then be the newer save's, AbortedError).
        before = [(v, v.numpy()) for v in _dense_variables(model)]
        try:
            with variables_only():
                model.load_weights(local)
            _load_tables(model, layers, _tables_of(path))
            _refuse_saved_meanwhile(path, info)
            for holder in layers:
                if hasattr(holder, "refresh"):  # DenseOnShards: its table is the newest
                    holder.refresh()
        except BaseException:
            _put_back(before)
            raise
    setattr(model, _LAST_CHECKPOINT, path)
    return info


def _put_back(values: list[tuple[Any, Any]]) -> None:
    """Assigns each variable its value from before a failed load; one that
    cannot take it (logged) never hides the load's own error."""
    with variables_only():  # a load, not a rollback: never warns
        for variable, value in values:
            try:
                variable.assign(value)
            except Exception as e:  # noqa: BLE001 - the load's error is the one to raise
                log.warning("could not put %s back after a failed load: %s", variable.path, e)


def _refuse_saved_meanwhile(path: str, info: dict[str, Any]) -> None:
    """Raises AbortedError when `path` was saved again while it loaded: the
    shards may have read the newer save's tables, or its cleanup removed
    the dense weights the load was to read."""
    if not info["save_id"]:
        return
    now = chain.read_model(path)["save_id"]
    if now != info["save_id"]:
        raise errors.AbortedError(
            f"{path} was saved again while it loaded (save {now} after {info['save_id']}): the "
            "tables loaded may be the newer save's; load it again"
        )


def _dense_variables(model: keras.Model) -> list[Any]:
    """What `load_weights` may assign: the model's variables and its
    optimizer's."""
    optimizer = getattr(model, "optimizer", None)
    extra = list(optimizer.variables) if optimizer is not None else []
    return list({id(v): v for v in [*model.weights, *extra]}.values())


def _load_tables(model: keras.Model, layers: list[Any], tables: str) -> None:
    """Replaces the rows of `layers`' tables with checkpoint `tables`' (all
    or nothing), on shard servers or embedded."""
    addresses, token = cluster_of(layers)
    if layers and addresses:
        for model_client in model_clients(model):
            # The load replaces the rows of a shard restarted since these
            # clients met it: their calls take it without DataLossError.
            ops.regreet(model_client)
        taking = [layer for layer in layers if _takes_saved_optimizer(layer)]
        if taking:
            with errors.storage_errors(f"reading {tables}"):
                saved = {
                    t["config"]["name"]: TableConfig.from_dict(t["config"])
                    for t in manifest.resolve_chain(tables)[-1].manifest["tables"]
                }
            for layer in taking:
                if layer.table_name in saved:
                    layer.settle_saved_optimizer(saved[layer.table_name])
        with Client(addresses, auth_token=token) as client:
            # This model's tables only: other models' on the same shards
            # are left as they are.
            client.load(tables, tables=[layer.table_name for layer in layers])
        forget_cached_rows(layers)
        for model_client in model_clients(model):
            # Rows an input pipeline pulled ahead before the load (a load in
            # a callback of a pull_ahead fit) are not the table's any more:
            # the next steps trained on them.
            ops.drop_pulled_ahead(model_client)
    elif layers:
        _load_embedded(tables, layers)


def _takes_saved_optimizer(layer: Any) -> bool:
    """Whether a load gives `layer`'s table the optimizer it was saved
    with (`Embedding.takes_saved_optimizer`; a DenseOnShards' table: no)."""
    return bool(getattr(layer, "takes_saved_optimizer", lambda: False)())


def _build_optimizer(model: keras.Model) -> None:
    """Builds a compiled model's optimizer that has not trained yet (a model
    made afresh to resume training): Keras loads an optimizer's variables
    (its step count, hence the learning-rate schedule the tables' pushes
    follow, and the dense weights' slots) only into a built one, and skipped
    them with a warning, so training resumed from step 0."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built and model.trainable_variables:
        optimizer.build(model.trainable_variables)


def _load_embedded(tables: str, layers: list[Any]) -> None:
    """Loads checkpoint `tables` into the embedded tables as a shard server
    loads its own: every table is read and verified into new tables first,
    then the layers' tables are replaced in one step."""
    ours = sorted({layer.table_name for layer in layers})
    loaded = shard_files.prepare_load(tables, embedded.shard(), replace=True, tables=ours)
    by_name = {t.name: t for t in loaded["staged"]}
    taking = []  # (layer, the checkpoint's config): layers given its optimizer
    for layer in layers:  # check everything before changing anything
        t = by_name.get(layer.table_name)
        if t is None:
            continue
        saved = TableConfig.from_dict(t.config)
        mine = layer.table_config
        if _takes_saved_optimizer(layer):
            mine = dataclasses.replace(mine, optimizer=saved.optimizer)
            taking.append((layer, saved))
        if normalized(t.config) != mine.to_dict():
            raise errors.FailedPreconditionError(
                f"table {layer.table_name!r} differs from the checkpoint's "
                f"({difference(mine.to_dict(), t.config)})"
            )
    embedded.shard().install_tables(loaded["staged"])
    for layer, saved in taking:
        layer.took_saved_optimizer(saved)
    for name in by_name:
        table_home.rows_restored(name)  # checkpoints keep no lineage (.keras files do)


def _formatted(path: str, epoch: int, logs: dict[str, Any]) -> str:
    """`path` formatted as keras.callbacks.ModelCheckpoint formats its
    file path: with ``epoch`` (1-based) and the epoch's logs
    (``{val_loss:.3f}``)."""
    try:
        return path.format(**{**logs, "epoch": epoch})
    except KeyError as e:
        raise KeyError(
            f"tf_dlt.ModelCheckpoint: path {path!r} names {e}, which the logs of epoch {epoch} "
            f"do not hold (they hold epoch and {sorted(logs)}): name one of those"
        ) from None


class ModelCheckpoint(keras.callbacks.Callback):  # type: ignore[misc]
    """Saves the model's tables and dense weights with `tf_dlt.save` every
    `every_n_epochs` epochs, to `path` formatted with ``epoch`` (1-based)
    and the epoch's logs, as keras.callbacks.ModelCheckpoint formats its
    file path.

    Args:
        path: e.g. "s3://bucket/run/epoch-{epoch}" or
            "run/epoch-{epoch:02d}-{val_loss:.3f}".
        every_n_epochs: how often, in epochs.
        full_every: every this many saves a full checkpoint, and deltas
            (rows changed since the save before) in between; None: every
            save is full.
        keep: after each save, delete the checkpoints this callback saved
            except the newest `keep` and those they need (the base and
            deltas a kept delta loads through); None: delete nothing.

    A delta whose base no longer loads (another program pruned it), or
    whose path its base loads through (a path that repeats: a fixed one, or
    ``{val_loss:.0f}``), is saved in full instead, with a warning. A save
    at a path a newer delta loads through is refused
    (`errors.FailedPreconditionError`): put ``{epoch}`` in the path.
    """

    def __init__(
        self,
        path: str,
        every_n_epochs: int = 1,
        *,
        full_every: int | None = None,
        keep: int | None = None,
    ) -> None:
        super().__init__()
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        if full_every is not None and full_every < 1:
            raise ValueError(f"full_every must be >= 1 or None, got {full_every}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        self.path = path
        self.every_n_epochs = every_n_epochs
        self.full_every = full_every
        self.keep = keep
        self.saved: list[str] = []
        self.epochs: list[int] = []  # epochs completed at each saved path
        self.kinds: list[str] = []  # "full" or "delta", per saved path
        self._save_ids: dict[str, str] = {}  # the save each path got (a prune's snapshot)
        # The paths saved and not deleted since, each once, in the order of
        # their newest saves (a path that repeats moves to the end).
        self._live: list[str] = []
        self.deleted: list[str] = []

    def record(self, path: str, epochs: int, info: dict[str, Any]) -> None:
        """Counts the save of `path` after `epochs` epochs (`tf_dlt.save`'s
        `info`) as one of this callback's: the next delta may stand on it,
        and `keep` deletes it in turn (resilient_fit's first save)."""
        self.saved.append(path)
        self.epochs.append(epochs)
        self.kinds.append(info["kind"])
        self._save_ids[path] = str(info["save_id"])
        self._live = [p for p in self._live if p != path] + [path]

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if (epoch + 1) % self.every_n_epochs != 0:
            return
        target = _formatted(self.path, epoch + 1, logs or {})
        base = None
        if self.full_every is not None and self.saved and len(self.saved) % self.full_every:
            base = self.saved[-1]
            unfit = _unfit_base(base, target)
            if unfit == "gone":
                log.warning(
                    "ModelCheckpoint: %s, the base of the delta due now, no longer loads "
                    "(deleted by a prune?): saving %s in full", base, target,
                )  # fmt: skip
                base = None
            elif unfit == "reads":
                log.warning(
                    "ModelCheckpoint: %s repeats a path the delta due now would load "
                    "through (the path names no field that changes each epoch, such as "
                    "{epoch}): saving it in full", target,
                )  # fmt: skip
                base = None
        self.record(target, epoch + 1, save(self.model, target, base=base))
        if self.keep is not None:
            with errors.storage_errors(f"removing checkpoints older than the last {self.keep}"):
                problems: list[str] = []
                gone = chain.retain(
                    self._live, self.keep, tables_dir=TABLES_DIR, save_ids=self._save_ids,
                    problems=problems,
                )  # fmt: skip
            for problem in problems:  # (kept: a chain it cannot read, a save meanwhile)
                log.warning("ModelCheckpoint: %s", problem)
            self.deleted.extend(gone)
            self._live = [p for p in self._live if p not in gone]
