"""TensorFlow ops of tf_dlt: the Dlt> op library, loaded once, and typed
wrappers around it.

- `ClientResource(pservers)`: the handle the other ops take. ``pservers=None``
  (or empty) selects the embedded transport: the table core in this process,
  no sockets, shared by every embedded client of the process. Its tables
  are managed with `tf_dlt.embedded`.
- `lookup`, `lookup_grad`, `push`, `flush`: see each docstring.

All ops run eagerly and inside ``tf.function``; they are stateful and have no
XLA kernels (``jit_compile=True`` fails). ``TF_DLT_PSERVERS`` (comma-separated
``host:port``; see `override_pservers`) replaces the shard addresses of every
non-embedded client created after it is set, so a graph or SavedModel built
against one cluster can run against another.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import tensorflow as tf

from tf_dlt import _native, errors, table_config
from tf_dlt.client import Client, address_list, timeout_ms
from tf_dlt.table_config import TableConfig

LIBRARY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_dlt_ops.so")
PSERVERS_ENV = "TF_DLT_PSERVERS"
EMBEDDED_SHARED_NAME = "dlt_embedded"

_load_lock = threading.Lock()
_library: ModuleType | None = None


def load_library() -> ModuleType:
    """Loads _dlt_ops.so into TensorFlow once; raises ImportError naming the
    path, the TensorFlow version and the cause when that fails."""
    global _library
    with _load_lock:
        if _library is None:
            try:
                _library = tf.load_op_library(LIBRARY_PATH)
            except Exception as e:  # noqa: BLE001 - re-raised with context
                raise ImportError(
                    f"cannot load the tf_dlt op library {LIBRARY_PATH} into TensorFlow "
                    f"{tf.__version__} (tf_dlt is built for 2.21): {type(e).__name__}: {e}"
                ) from e
        return _library


def override_pservers(addresses: Sequence[str] | None) -> None:
    """Points clients created from now on at `addresses` (shard-index order)
    instead of the ones they were built with; None removes the override."""
    if addresses is None:
        os.environ.pop(PSERVERS_ENV, None)
    else:
        os.environ[PSERVERS_ENV] = ",".join(addresses)


def overridden_pservers(addresses: Sequence[str]) -> list[str]:
    """`addresses`, or those TF_DLT_PSERVERS names when it is set (as the
    Dlt>Client kernel reads it), for the Python side of a client."""
    override = os.environ.get(PSERVERS_ENV, "")
    return [a.strip() for a in override.split(",") if a.strip()] or list(addresses)


_token_numbers: dict[str, int] = {}


def _token_number(token: str) -> int:
    """A small number for each distinct token this process used (0: none)."""
    with _load_lock:
        return _token_numbers.setdefault(token, len(_token_numbers) + 1) if token else 0


class ClientResource(tf.saved_model.experimental.TrackableResource):  # type: ignore[misc]
    """The Dlt>Client handle: the cluster the ops talk to.

    Args:
        pservers: data-plane addresses of the shard servers in shard-index
            order, or None / [] for the embedded in-process tables.
        auth_token: token the shards require (empty: none).
        connect_timeout: seconds to connect to a shard and say Hello.
        request_timeout: deadline in seconds of one lookup or push.
        frame_bytes: target bytes per frame; bigger batches are split.
        max_inflight_pushes: asynchronous pushes in flight at once; more wait
            (backpressure).
        instance: "" (default): one client per set of shards and options in
            the process, shared by every ClientResource made with them;
            another string makes a client of its own (its connections,
            push queue, pulls ahead and hot-row caches), as `private` does.
    """

    def __init__(
        self,
        pservers: Sequence[str] | None = None,
        *,
        auth_token: str | None = "",
        connect_timeout: float = 5.0,
        request_timeout: float = 30.0,
        frame_bytes: int = 8 << 20,
        max_inflight_pushes: int = 4,
        instance: str = "",
    ) -> None:
        self.pservers = address_list(pservers) if pservers else []
        self.instance = instance
        self._options: dict[str, Any] = {
            "connect_timeout": connect_timeout, "request_timeout": request_timeout,
            "frame_bytes": frame_bytes, "max_inflight_pushes": max_inflight_pushes,
        }  # fmt: skip
        # The token is no attribute (attributes are written into graphs and
        # SavedModels): the kernel reads it from the core by client name.
        auth_token = (auth_token or "").strip()  # as tf_dlt.Client takes it (None: none)
        self._auth_token = auth_token
        self._attrs: dict[str, Any] = {
            "addresses": self.pservers,
            "connect_timeout_ms": timeout_ms("connect_timeout", connect_timeout),
            "request_timeout_ms": timeout_ms("request_timeout", request_timeout),
            "frame_bytes": int(frame_bytes),
            "max_inflight_pushes": int(max_inflight_pushes),
        }
        if self.pservers:
            # The kernel reads TF_DLT_PSERVERS when it makes the client: a
            # client made under another override is another client.
            override = overridden_pservers(self.pservers)
            override = [] if override == self.pservers else override
            key = repr((sorted(self._attrs.items()), override)) + (
                f"/{instance}" if instance else ""
            )
            digest = hashlib.sha256(key.encode()).hexdigest()
            # Clients differing only in their token are different clients;
            # the name holds a number per token, nothing derived from it.
            self._shared_name = f"dlt_tcp_{digest[:16]}_{_token_number(auth_token)}"
            _native.set_client_token(self._shared_name, auth_token)
        else:
            self._shared_name = EMBEDDED_SHARED_NAME
        super().__init__(device="/CPU:0")
        # Create the handle outside any function being traced, so one client
        # serves every tf.function and eager call, whichever comes first.
        with tf.init_scope():
            self._resource_handle = self._create_resource()

    @property
    def auth_token(self) -> str:
        return self._auth_token

    def private(self, instance: str) -> ClientResource:
        """A client of the same shards, token and options that no other
        ClientResource shares unless made with the same `instance`."""
        return ClientResource(
            self.pservers, auth_token=self._auth_token, instance=instance, **self._options
        )

    @property
    def embedded(self) -> bool:
        return not self.pservers

    @property
    def shared_name(self) -> str:
        """Clients with equal shared names are one client in the process
        (same transport, connections, push queue and counters)."""
        return self._shared_name

    def _create_resource(self) -> tf.Tensor:
        return load_library().dlt_client(shared_name=self._shared_name, **self._attrs)

    def _export_to_saved_model_graph(self, *args: Any, **kwargs: Any) -> Any:
        # A SavedModel of the embedded tables' client would look the rows up
        # in the serving process's own embedded tables, which hold none:
        # Keras's `model.export()` and `tf.saved_model.save(model)` wrote one
        # that failed only when served ("no table ... on shard 0").
        if self.embedded:
            raise ValueError(
                "a SavedModel cannot reach the embedded tables of this process (a serving "
                "process holds none of their rows): export with "
                "tf_dlt.export_saved_model(model, path, mode='standalone'), which writes the "
                "rows into it, or transpile the model onto shard servers first"
            )
        return super()._export_to_saved_model_graph(*args, **kwargs)


def configure_cache(
    client: ClientResource,
    config: TableConfig,
    rows: int,
    *,
    max_staleness_steps: int = 0,
    max_staleness_ms: int = 0,
    min_count: int = 2,
    check: bool = True,
) -> None:
    """Keeps a hot-row cache of `config`'s table in a client of shard
    servers (a no-op for the embedded client): at most `rows` rows of the ids
    looked up `min_count` times or more, with their optimizer state. The
    client's pushes are applied to the cached rows with the table's
    optimizer (so `config` must be the table's); a row is pulled again once
    it is `max_staleness_steps` lookups of the table or `max_staleness_ms`
    old (0: no bound of that kind; one is needed). `rows` 0 removes the
    cache. `tf_dlt.hot_row_cache` does this for a model's layers.
    FailedPreconditionError when the shards hold the table with another dim
    or optimizer than `config`'s (asked of them once, here, unless `check`
    is False: the config was checked before)."""
    if rows and check and not client.embedded:
        _check_cached_table(client, config)
    load_library().dlt_configure_cache(
        client=client.resource_handle, config=_native.encode_table_config(config.to_dict()),
        rows=int(rows), max_staleness_steps=int(max_staleness_steps),
        max_staleness_ms=int(max_staleness_ms), min_count=int(min_count),
    )  # fmt: skip


def held_table_config(client: ClientResource, name: str) -> TableConfig | None:
    """The config of the table the client's shards hold under `name`, or None
    where they hold none (asked of them, over the control plane)."""
    addresses = overridden_pservers(client.pservers)
    with Client(addresses, auth_token=client.auth_token) as shards:
        held = shards.list_tables().get(name)
    return None if held is None else held["config"]


def _check_cached_table(client: ClientResource, config: TableConfig) -> None:
    """Refuses a cache `config` whose dim or optimizer is not that of the
    table the shards hold under its name (a table not made yet is not
    checked): the cache applies this trainer's pushes with `config`'s
    optimizer, so it would serve rows the shards never hold, or pull state
    of another width."""
    held = held_table_config(client, config.name)
    if held is None:
        return
    given, theirs = config.to_dict(), held.to_dict()
    if given["dim"] != theirs["dim"] or given["optimizer"] != theirs["optimizer"]:
        raise errors.FailedPreconditionError(
            f"configure_cache: the shards' table {config.name!r} is not the config given "
            f"({table_config.difference(theirs, given)}, the shards' first); the cache applies "
            "pushes as the table does, so give it the table's config"
        )


def _dense(ids: Any, op: str) -> Any:
    """`ids` where it is not ragged or sparse; else TypeError naming what
    to do (the op took it as a plain value and failed on its len())."""
    if isinstance(ids, (tf.RaggedTensor, tf.SparseTensor)):
        raise TypeError(
            f"{op} takes a dense tensor of int64 ids, got a {type(ids).__name__}: pass its "
            "flat values (`.flat_values` or `.values`) and shape the rows back, or use "
            "tf_dlt.layers.Embedding, which takes ragged and sparse ids"
        )
    return ids


def lookup(
    client: ClientResource,
    ids: tf.Tensor,
    table: str,
    dim: int,
    *,
    training: bool = True,
    missing: str = "init",
) -> tf.Tensor:
    """Rows of int64 `ids` (any shape): float32 ``ids.shape + [dim]``.

    Distinct ids are pulled once; with the tcp transport each touched shard
    gets one pipelined request, all at once. With ``training=False`` nothing
    is inserted: unseen ids read as their initial value (``missing="init"``)
    or zeros (``missing="zeros"``).
    """
    return load_library().dlt_lookup(
        client=client.resource_handle, ids=_dense(ids, "lookup"), table=table, dim=dim,
        training=training, missing=missing,
    )  # fmt: skip


def pull_ahead(
    client: ClientResource,
    ids: tf.Tensor,
    table: str,
    dim: int,
    *,
    training: bool = True,
    missing: str = "init",
    refresh: bool = True,
    pulls_per_batch: int = 1,
) -> tf.Tensor:
    """Starts pulling the rows of int64 `ids` for a later `lookup` of exactly
    these ids (same `table`, `dim`, `training` and `missing`) and returns
    `ids` at once; run it in the input pipeline, a batch or more ahead.

    With `refresh`, every id this client pushes (or assigns) while the pull
    ahead waits is pulled again, ahead on the client's worker threads, and
    the lookup that takes the rows pulls what is still stale then, so it
    reads what a lookup without it would; without, it uses the rows as
    pulled. Pushes of other trainers are seen as of the pull ahead. At most
    8 pulls ahead wait per table; a lookup drops those of earlier batches
    that no lookup took. `pulls_per_batch`: how many pulls of this table
    each batch starts, one after another (a table two inputs share: 2), so
    a lookup never drops the other pulls of its own batch.
    Remote clients only: with the embedded tables it just returns `ids`.
    """
    return load_library().dlt_pull_ahead(
        client=client.resource_handle, ids=_dense(ids, "pull_ahead"), table=table, dim=dim,
        training=training, missing=missing, refresh=refresh, pulls_per_batch=int(pulls_per_batch),
    )  # fmt: skip


def drop_pulled_ahead(client: ClientResource) -> None:
    """Drops the client's pulls ahead that no lookup took yet (their input
    pipeline stopped); later lookups of those ids pull their rows.
    `tf_dlt.pull_ahead`'s fit does this when it returns or fails."""
    load_library().dlt_drop_pulled_ahead(client=client.resource_handle)


def regreet(client: ClientResource) -> None:
    """Greets every shard again as a new client would, forgetting the copies
    it met: a shard restarted since (another lineage, docs/replication.md)
    fails none of its later calls with DataLossError. `tf_dlt.load` and
    `resilient_fit` call it before loading a checkpoint onto every shard."""
    load_library().dlt_regreet(client=client.resource_handle)


def lookup_grad(ids: tf.Tensor, grads: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(unique_ids, summed_grads): the gradient of looked-up rows
    (``ids.shape + [dim]``) summed per distinct id, in first-seen order."""
    out = load_library().dlt_lookup_grad(ids=_dense(ids, "lookup_grad"), grads=grads)
    return out.unique_ids, out.summed_grads


def push(
    client: ClientResource,
    unique_ids: tf.Tensor,
    grads: tf.Tensor,
    learning_rate: tf.Tensor | float,
    table: str,
    dim: int,
    *,
    sync: bool = False,
) -> tf.Operation | None:
    """Sends gradient rows (``[n, dim]`` for ``n`` distinct ids) to the shards,
    which apply the table's optimizer with `learning_rate`.

    Asynchronous by default: it returns once admitted (at most
    ``max_inflight_pushes`` in flight); an error surfaces at the next push or
    `flush`. ``sync=True`` returns after the shards applied it.
    """
    return load_library().dlt_push(
        client=client.resource_handle, unique_ids=unique_ids, grads=grads,
        learning_rate=tf.cast(learning_rate, tf.float32), table=table, dim=dim, sync=sync,
    )  # fmt: skip


def assign(
    client: ClientResource, ids: tf.Tensor, values: tf.Tensor, table: str, dim: int
) -> tf.Operation | None:
    """Sets the rows of `ids` ([n]) to `values` ([n, dim]) with fresh optimizer
    slots (uploads an existing embedding). Synchronous."""
    return load_library().dlt_assign(
        client=client.resource_handle, ids=ids, values=values, table=table, dim=dim
    )


def flush(client: ClientResource) -> tf.Operation | None:
    """Waits until every push issued before it was applied; raises the first
    error among them."""
    return load_library().dlt_flush(client=client.resource_handle)


def client_stats(client: ClientResource) -> dict[str, Any]:
    """This client's counters (eager): pulls, pushes, pulled / pushed rows,
    payload bytes, failed calls, pushes in flight and waiting, and pull /
    push latency histograms ({"sum_us", "buckets"}, buckets bounded by
    `tf_dlt._native.latency_bucket_bounds_us()`), and the lineage of the copy
    of each shard it met (`lineages`, 0 where none; none when embedded), of
    the shards of layout epoch `layout_epoch` (0 when embedded)."""
    text = load_library().dlt_client_stats(client=client.resource_handle)
    stats: dict[str, Any] = json.loads(text.numpy().decode())
    stats["lineages"] = [int(v) for v in stats["lineages"]]
    return stats
