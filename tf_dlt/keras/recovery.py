"""resilient_fit: `model.fit` that survives a shard crash without a human.

A shard that dies (kill -9, a lost node) makes the running step fail with
UnavailableError (or DeadlineExceededError) within the client's request
deadline; a shard with standbys whose every process died fails it with
DataLossError once its restarted replica set serves. Its supervisor
(Kubernetes, systemd; `tf-dlt launch` only for a shard with standbys,
`--replicas 2` or more: a lone shard's death ends a launch) restarts it at
the same address.
resilient_fit then:

1. waits until every shard of the model answers again (bounded);
2. drops what the failed step left in the clients (a pending push error);
3. restores the last committed checkpoint written by its checkpoint callback
   (`tf_dlt.load`: every shard and the dense weights, so the shards agree
   again; the restarted shard's rows since that checkpoint are lost, none of
   the checkpoint's);
4. continues fit from the epoch after that checkpoint.

Before the first epoch it writes a checkpoint of the starting state
(``epoch-<initial_epoch>``), so a shard lost in the first epoch has a
consistent point to return to too. A shard lost while that first checkpoint
is written gets its tables created again (their rows start from the
tables' initializers) before the checkpoint is retried, unless the model
holds trained rows (it trained, or rows were loaded into it) that no
checkpoint keeps yet: then the error propagates, where the tables made
afresh would train from initial rows.

After `max_restarts` recoveries, or on any other error, the error propagates.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_dlt import dlt_ops as ops
from tf_dlt import errors
from tf_dlt.client import Client
from tf_dlt.keras.checkpoint import ModelCheckpoint, load, save
from tf_dlt.keras.walk import cluster_of, distributed_layers, model_clients, table_holders

log = logging.getLogger("tf_dlt.keras.recovery")

# What a crashed or unreachable shard raises, in TF ops and in the client;
# DATA_LOSS: a shard whose every process restarted (its replica set began
# again), which the clients then use.
SHARD_LOST = (
    tf.errors.UnavailableError,
    tf.errors.DeadlineExceededError,
    tf.errors.DataLossError,
    errors.UnavailableError,
    errors.DeadlineExceededError,
    errors.DataLossError,
)


def _lacks_tables(model: keras.Model, pservers: Sequence[str], token: str) -> bool:
    """Whether some shard now holds none of one of the model's tables (it
    restarted empty), or cannot say (it is down)."""
    names = {holder.table_name for holder in table_holders(model)}
    try:
        with Client(list(pservers), auth_token=token) as client:
            stats = client.stats()
    except errors.DltError:
        return True
    return any(not names <= {t["config"]["name"] for t in s.get("tables", [])} for s in stats)


def wait_for_shards(
    pservers: Sequence[str], auth_token: str = "", timeout: float = 600.0, poll: float = 1.0
) -> float:
    """Blocks until every shard answers a control-plane call; returns the
    seconds waited. Raises DeadlineExceededError after `timeout`."""
    start = time.monotonic()
    while True:
        try:
            with Client(pservers, auth_token=auth_token, connect_timeout=2, request_timeout=5) as c:
                c.list_tables()
            return time.monotonic() - start
        except errors.DltError as e:
            if time.monotonic() - start > timeout:
                raise errors.DeadlineExceededError(
                    f"shards {list(pservers)} not back after {timeout} s: {e}"
                ) from None
            time.sleep(poll)


def _drain(model: keras.Model) -> None:
    """Clears errors a failed step left in the model's clients."""
    for layer in distributed_layers(model):
        try:
            ops.flush(layer.client)
        except tf.errors.OpError:
            pass


def _rows_to_lose(layers: list[Any], saver: ModelCheckpoint) -> bool:
    """Whether making lost tables afresh would lose trained rows: before
    this run's first checkpoint (its first save failed) a recovery makes
    the tables a shard lacks afresh, and a layer holds rows (it trained, or
    a .keras file's or a checkpoint's were loaded into it) that no
    checkpoint of this run keeps. A shard that lost the table of such a
    layer made its first save raise NotFoundError, and a recovery made the
    table afresh, untrained, with another optimizer (the loaded model's was
    not settled yet). A shard that comes back with its tables (a slow
    save, a standby that took over) loses nothing: that recovery goes on."""
    return not saver.saved and any(layer.holds_rows() for layer in layers)


def _create_tables(model: keras.Model, pservers: Sequence[str], token: str) -> None:
    """Creates the model's tables on every shard where they are missing (a
    shard restarted empty); existing ones are left as they are. The model's
    clients take the shards' processes serving now (a shard restarted since
    they met it fails none of their calls with DataLossError: its rows
    start again from the tables' initializers, as resilient_fit says)."""
    for model_client in model_clients(model):
        ops.regreet(model_client)
    with Client(pservers, auth_token=token) as client:
        for holder in table_holders(model):
            client.create_table_from_config(holder.table_config)


class _EpochLogs(keras.callbacks.Callback):  # type: ignore[misc]
    """Every epoch's logs over all of resilient_fit's fits: an epoch run
    again after a recovery replaces what its first run logged."""

    def __init__(self) -> None:
        super().__init__()
        self.logs: dict[int, dict[str, Any]] = {}

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.logs[epoch] = dict(logs or {})

    def into(self, history: keras.callbacks.History) -> keras.callbacks.History:
        """`history` (the last fit's) holding every epoch's logs."""
        history.epoch = sorted(self.logs)
        keys = sorted({k for logs in self.logs.values() for k in logs})
        history.history = {k: [self.logs[e].get(k) for e in history.epoch] for k in keys}
        return history


def resilient_fit(
    model: keras.Model,
    *args: Any,
    checkpoint: str,
    every_n_epochs: int = 1,
    keep: int | None = None,
    max_restarts: int = 3,
    wait_timeout: float = 600.0,
    callbacks: list[keras.callbacks.Callback] | None = None,
    **kwargs: Any,
) -> keras.callbacks.History:
    """`model.fit(*args, **kwargs)` with a `tf_dlt.ModelCheckpoint` writing
    to ``checkpoint`` + "/epoch-{epoch}" every `every_n_epochs` epochs, and
    recovery from lost shards as the module docstring describes. The model's
    tables must be on shard servers. `keep`: after each save, delete the
    checkpoints this run wrote except the newest `keep` (None: keep all).
    Returns the last fit's History holding every epoch's logs (an epoch run
    again after a recovery: its last run's); its `restarts` attribute counts
    the recoveries."""
    layers = distributed_layers(model)
    pservers, token = cluster_of(layers)
    if not pservers:
        raise ValueError("resilient_fit recovers shard servers: transpile the model onto them")
    saver = ModelCheckpoint(checkpoint.rstrip("/") + "/epoch-{epoch}", every_n_epochs, keep=keep)
    epoch_logs = _EpochLogs()
    epochs = int(kwargs.pop("epochs", 1))
    initial_epoch = int(kwargs.pop("initial_epoch", 0))
    restarts = 0
    while True:
        try:
            if not saver.saved:
                start = saver.path.format(epoch=initial_epoch)
                saver.record(start, initial_epoch, save(model, start))
            history = model.fit(
                *args, epochs=epochs, initial_epoch=initial_epoch,
                callbacks=[*(callbacks or []), epoch_logs, saver], **kwargs,
            )  # fmt: skip
            history = epoch_logs.into(history)
            history.restarts = restarts
            return history
        except SHARD_LOST as e:
            if restarts >= max_restarts:
                raise
            restarts += 1
            log.warning("lost a shard (%s); recovery %d of %d", e, restarts, max_restarts)
        except (tf.errors.NotFoundError, errors.NotFoundError) as e:
            # A shard restarted before its clients noticed (no standby, or a
            # replica set whose reload went to a member that then followed
            # the other): it answers, without the model's tables.
            if (
                restarts >= max_restarts
                or _rows_to_lose(layers, saver)
                or not _lacks_tables(model, pservers, token)
            ):
                raise
            restarts += 1
            log.warning(
                "a shard lacks the model's tables (%s): it restarted empty; recovery %d of %d",
                e, restarts, max_restarts,
            )  # fmt: skip
        waited = wait_for_shards(pservers, token, wait_timeout)
        _drain(model)
        if saver.saved:
            last = saver.saved[-1]
            load(model, last)
            initial_epoch = saver.epochs[-1]
            log.warning("shards back after %.1f s; resumed from %s", waited, last)
        else:
            if _rows_to_lose(layers, saver) and _lacks_tables(model, pservers, token):
                raise errors.NotFoundError(
                    "a shard came back without the model's tables before resilient_fit's first "
                    "checkpoint, and the model holds trained rows that no checkpoint of this run "
                    "keeps (made afresh, its tables would train from initial rows): load the "
                    "model's last checkpoint (tf_dlt.load) and call resilient_fit again"
                )
            _create_tables(model, pservers, token)
            log.warning("shards back after %.1f s before the first checkpoint: tables created "
                        "again where missing", waited)  # fmt: skip
