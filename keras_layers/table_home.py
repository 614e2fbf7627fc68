"""Where a layer's table lives, and for how long: creating it in the
process's embedded shard or on shard servers, settling its optimizer, and
the embedded tables' lifetime across Keras sessions.

- A layer following the model's optimizer creates its table before the
  optimizer is known (a *provisional* table, SGD until then); the first
  training step settles it with the compiled optimizer's server-side form.
  The shard replaces a provisional table nothing trained yet, in one step
  (rows kept, fresh slots): both `build -> compile -> fit` and
  `build -> transpile -> compile -> fit` work, and trainers racing agree.
- An embedded table belongs to the Keras session (`keras.backend.
  clear_session()` starts a new one) in which a layer made it. In a later
  session, a layer of the same table name takes it when the configs are the
  same, and gets a fresh table otherwise (the old rows are dropped, as a new
  `keras.layers.Embedding` starts from fresh weights). In the same session a
  different config is an error naming both and what to do.
"""

from __future__ import annotations

import dataclasses
import secrets
import weakref
from typing import Any, NamedTuple

import numpy as np

from tf_dlt import dlt_ops as ops
from tf_dlt import embedded, errors
from tf_dlt.client import Client
from tf_dlt.table_config import TableConfig, difference, normalized

# The Keras session each embedded table was made in (table name -> marker).
_made_in: dict[str, Any] = {}
# Each embedded table's lineage: tokens naming the line of training its
# rows descend from, oldest first. A token is made with the table, and
# again whenever a .keras file's rows are loaded into it (the line forks
# there: two processes loading one file and training on are two lines).
# A .keras file keeps the table's lineage; a file whose newest token the
# table's line lacks holds another model's rows. Empty: not known (rows
# restored by tf_dlt.load, or from a file from before lineages).
_lineages: dict[str, list[str]] = {}
_LINEAGE_TOKENS = 64  # the newest kept
# The built layers that use each embedded table.
_users: dict[str, weakref.WeakSet[Any]] = {}


def _session() -> Any:
    """The Keras session: the process-wide state object that
    `keras.backend.clear_session()` replaces (the same in every thread)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - Keras without that module
        return None
    return global_state.GLOBAL_STATE_TRACKER


def control_client(client: ops.ClientResource) -> Client:
    """A control-plane client of the shards `client` reaches: TF_DLT_PSERVERS
    re-points both, and without a token of this process both read
    TF_DLT_AUTH_TOKEN_FILE."""
    return Client(ops.overridden_pservers(client.pservers), auth_token=client.auth_token)


class Created(NamedTuple):
    """What `create` found: the table was taken from an earlier Keras
    session (`earlier`), made now (`made`: False where one like it was
    there already; embedded tables only, True on shards)."""

    earlier: bool
    made: bool


def create(
    layer: str, config: TableConfig, client: ops.ClientResource, provisional: bool
) -> Created:
    """Creates `config`'s table where `client` points (`Created`)."""
    if not client.embedded:
        try:
            _create(config, client, provisional)
        except errors.AlreadyExistsError as e:
            raise errors.AlreadyExistsError(
                f"layer {layer!r}: {e}. Name the layer (or its table_name=) differently, or "
                f"drop the shards' table first (tf_dlt.Client(...).drop_table({config.name!r}"
                "), which loses its rows)"
            ) from None
        return Created(earlier=False, made=True)
    session = _session()
    earlier = config.name in _made_in and _made_in[config.name]() is not session
    try:
        made = embedded.create_table(config, provisional=provisional)
    except errors.AlreadyExistsError:
        if not earlier:  # this session's, or not a layer's (tf_dlt.load, the user's)
            raise _conflict(layer, config, provisional) from None
        embedded.drop_table(config.name)  # an earlier session's table
        made = embedded.create_table(config, provisional=provisional)
    _made_in[config.name] = weakref.ref(session) if session is not None else lambda: None
    if made:
        _lineages[config.name] = [secrets.token_hex(8)]
    return Created(earlier=earlier and not made, made=bool(made))


def use(layer: Any) -> None:
    """Counts built `layer` among the users of its embedded table, in this
    Keras session."""
    session = _session()
    layer._built_in_session = weakref.ref(session) if session is not None else lambda: None
    _users.setdefault(layer.table_name, weakref.WeakSet()).add(layer)


def lineage(table: str) -> list[str]:
    """Embedded table `table`'s lineage, as a .keras file keeps it: one
    begun now for a table that has none (made by tf_dlt.embedded) or whose
    lineage is not known (restored by tf_dlt.load: its files are checked
    from now on)."""
    if not _lineages.get(table):
        _lineages[table] = [secrets.token_hex(8)]
    return list(_lineages[table])


def check_replacing_rows(layer: Any, lineage_of_file: list[str]) -> None:
    """Checks that the rows of a .keras file of lineage `lineage_of_file`
    (empty: not known) may replace the rows of `layer`'s embedded table
    (`rows_replaced` once they did). Refused (FailedPreconditionError) when
    the file holds another line's rows than the table's while a layer of
    the same name in another model, alive and built in this Keras session,
    trained the table or holds rows loaded into it: that model's layer got
    the table by its name only (Keras names layers alike, `embedding` by
    default), and Keras's loads never change another model's weights. A
    file of the table's own line (an older file of the model that trains
    it) puts its rows back, as documented; so does any file where either
    lineage is not known."""
    table = layer.table_name
    line = _lineages.get(table)
    if not lineage_of_file or not line or lineage_of_file[-1] in line:
        return
    session = _session()
    holders = [
        other
        for other in list(_users.get(table, ()))
        if other is not layer
        and other.name == layer.name  # siblings sharing a table have names of their own
        and other.table_name == table
        and other.client is not None
        and other.client.embedded
        and getattr(other, "_built_in_session", lambda: None)() is session
        and other.holds_rows()
    ]
    if holders:
        raise errors.FailedPreconditionError(
            f"layer {layer.name!r}: the file holds the rows of another model's embedded table "
            f"{table!r} than the one layer {holders[0].name!r} of a model alive in this Keras "
            "session trained or loaded (Keras names layers alike, so both got the table by "
            "name): loading it would replace that model's rows. Load the file in another "
            "process, or call keras.backend.clear_session() first (the other model's table is "
            "then given up); to keep both, name their layers (or table_name=) apart"
        )


def rows_replaced(table: str, lineage_of_file: list[str]) -> None:
    """Embedded table `table` holds the rows of a .keras file of lineage
    `lineage_of_file` now: its line goes on from there, forked."""
    _lineages[table] = [*lineage_of_file, secrets.token_hex(8)][-_LINEAGE_TOKENS:]


def rows_restored(table: str) -> None:
    """Embedded table `table` holds rows restored by tf_dlt.load, whose
    checkpoints keep no lineage: not known (any file is taken) until a
    .keras file of it is saved."""
    _lineages[table] = []


def settle(
    layer: str, config: TableConfig, client: ops.ClientResource, fresh: bool, trained: bool
) -> bool:
    """Gives the table the optimizer of `config` (which knows it). `fresh`:
    the table came from an earlier Keras session (and this layer has not
    settled it yet), so one trained with another optimizer is replaced by
    a fresh, empty one instead of refused; returns True then. `trained`:
    the layer trained its table, or holds its rows (a .keras file's
    `pushes`): on shards that lack the table (restarted without
    --load-from), NotFoundError, where a table made afresh would train
    from initial rows under the trained dense weights, without a word."""
    if trained and lost(config.name, client):
        shards = ",".join(ops.overridden_pservers(client.pservers))
        raise errors.NotFoundError(
            f"layer {layer!r} trained table {config.name!r}, and the shards at {shards} do not "
            "have it (started again without --load-from?): training on would make it afresh "
            "and lose its rows. Load its checkpoint onto the shards (tf-dlt server "
            "--load-from, or tf_dlt.load(model, ...)) and train on; to train afresh, build a "
            "new model"
        )
    try:
        _create(config, client, provisional=False)
        return False
    except errors.AlreadyExistsError as e:
        if fresh and client.embedded:
            embedded.drop_table(config.name)
            create(layer, config, client, provisional=False)
            return True
        trained = "was trained" in str(e)  # the shard's word for pushes applied
        have = _existing(config.name, client)
    same = have is not None and _optimizer_of(have) == _optimizer_of(config)
    if have is not None and same:  # refused for another field
        raise errors.FailedPreconditionError(
            f"table {config.name!r} exists with another config than layer {layer!r} asks for "
            f"({difference(have.to_dict(), config.to_dict())}, the table's first)"
        )
    kind = have.optimizer.kind if have is not None else "another optimizer"
    wanted, keep = config.optimizer.kind, repr(kind)
    if have is not None and kind == wanted:  # the same kind: its hyperparameters differ
        kind, wanted = _spelled(have.optimizer), _spelled(config.optimizer)
        keep = f"tf_dlt.optimizers.{kind}"
    how = (
        "was trained with"
        if trained
        else "was settled (by an earlier compile of this model, another model or a trainer) with"
    )
    raise errors.FailedPreconditionError(
        f"table {config.name!r} {how} {kind}; this model is compiled for "
        f"{wanted}: give layer {layer!r} optimizer={keep} to keep training it, "
        "start from a checkpoint saved with the new optimizer, or drop the table "
        f"(tf_dlt.embedded.drop_table / tf_dlt.Client.drop_table({config.name!r}), which loses "
        "its rows) to train it afresh"
    )


def _optimizer_of(config: TableConfig) -> Any:
    """`config`'s optimizer at float32 precision, as a shard holds it."""
    return normalized(config.to_dict())["optimizer"]


def _spelled(optimizer: Any) -> str:
    """`optimizer` as its constructor call, each float as the shortest that
    float32 reads back as it (a shard's config holds 0.9 as
    0.8999999761581421; two that differ in float32 are told apart)."""
    args = ", ".join(
        f"{f.name}={str(np.float32(getattr(optimizer, f.name)))}"  # float32 shortest
        if isinstance(getattr(optimizer, f.name), float)
        else f"{f.name}={getattr(optimizer, f.name)!r}"
        for f in dataclasses.fields(optimizer)
    )
    return f"{type(optimizer).__name__}({args})"


def _create(config: TableConfig, client: ops.ClientResource, provisional: bool) -> None:
    """The shard's CreateTable: AlreadyExistsError as the shard words it
    (saying whether the table was trained)."""
    if client.embedded:
        embedded.create_table(config, provisional=provisional)
        return
    with control_client(client) as control:
        control.create_table_from_config(config, provisional=provisional)


def lost(name: str, client: ops.ClientResource) -> bool:
    """Whether the shards `client` reaches lack table `name` (embedded
    tables are never lost: they are the process's)."""
    return not client.embedded and _existing(name, client) is None


def _existing(name: str, client: ops.ClientResource) -> TableConfig | None:
    if client.embedded:
        return TableConfig.from_dict(embedded.table(name).config)
    with control_client(client) as control:
        entry = control.list_tables().get(name)
    return None if entry is None else entry["config"]


def _conflict(layer: str, config: TableConfig, provisional: bool) -> errors.AlreadyExistsError:
    have = TableConfig.from_dict(embedded.table(config.name).config)
    wanted = config.to_dict()
    if provisional:
        wanted["optimizer"] = have.to_dict()["optimizer"]  # not known yet: not a difference
    return errors.AlreadyExistsError(
        f"layer {layer!r} wants the embedded table {config.name!r}, which exists with another "
        f"config (existing vs wanted: {difference(have.to_dict(), wanted)}), made in this Keras "
        f"session by another layer or by tf_dlt.embedded / tf_dlt.load. Give "
        f"this layer another name (or table_name=); or call keras.backend.clear_session() "
        f"before building the new model (a layer built after it gets a fresh table where the "
        f"config differs); or drop the old table, losing its rows: "
        f"tf_dlt.embedded.drop_table({config.name!r})"
    )
