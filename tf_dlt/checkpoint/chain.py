"""Checkpoint chains as a whole: listing them, keeping the newest N with
everything they need, and compacting a chain into one full checkpoint.

A chain is a full checkpoint and the deltas saved on top of it, each naming
its parent in its manifest (`manifest.resolve_chain`). Model checkpoints
(`tf_dlt.save`) keep their tables' chain in a ``tables/`` subdirectory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import posixpath
import re
from typing import Any

from tf_dlt import _native, errors
from tf_dlt.checkpoint import manifest as manifest_lib
from tf_dlt.checkpoint import shard_files
from tf_dlt.routing import NUM_BUCKETS

log = logging.getLogger("tf_dlt.checkpoint")

_key = manifest_lib.location_key  # a path in one normal form

# A model checkpoint (`tf_dlt.save`): its tables' checkpoint, its dense
# weights (`model.save_weights`), and, written last, what it holds.
TABLES_DIR = manifest_lib.TABLES_DIR
DENSE_FILE = "dense.weights.h5"  # before each save named its own (still read)
MODEL_FILE = "tf_dlt_model.json"
# A save's dense weights, and DENSE_FILE (no save id: older than any).
_OWN_DENSE = re.compile(rf"^dense\.(?:(?P<save_id>{manifest_lib.SAVE_ID})\.)?weights\.h5$")


def dense_file(save_id: str) -> str:
    """The name of model save `save_id`'s dense weights: a save writes its
    own before its tables commit, never over a committed save's."""
    return f"dense.{save_id}.weights.h5"


def read_model(path: str, tables: dict[str, Any] | None = None) -> dict[str, Any]:
    """What model checkpoint `path` holds: its model file, with "save_id"
    and "dense_file" (the dense weights' name) always set.

    A save's tables commit first and its model file last. A save to `path`
    stopped between the two (the trainer killed, the store failing) left
    that save whole but for its model file: its tables and its dense
    weights, written before them. That save is what `path` holds then (its
    "tables" and "kind" from its tables' manifest), the first save to
    `path` too. Raises NotFoundError without a model file or such a save,
    FailedPreconditionError when the tables are of no save whose dense
    weights are there. `tables`: the tables' manifest, when the caller read
    it already."""
    fs, root = manifest_lib.filesystem(path)
    try:
        info: dict[str, Any] = json.loads(manifest_lib.read_file(fs, f"{root}/{MODEL_FILE}"))
    except FileNotFoundError:
        info = {"format": "tf_dlt-model", "format_version": 1}  # a first save, stopped?
        try:
            tables = tables or manifest_lib.read_manifest(tables_path(path, TABLES_DIR))
        except (errors.NotFoundError, errors.FailedPreconditionError):
            tables = None
        if tables is None or not manifest_lib.exists(
            fs, f"{root}/{dense_file(str(tables['save_id']))}"
        ):
            raise errors.NotFoundError(f"no tf_dlt model checkpoint at {path!r}") from None
        return _held_by_tables(info, tables)
    committed = str(info.get("save_id", ""))
    if not info.get("tables"):  # no distributed tables: the dense weights alone
        return {**info, "save_id": committed, "dense_file": _dense_of(committed)}
    tables = tables or manifest_lib.read_manifest(tables_path(path, TABLES_DIR))
    saved = str(tables["save_id"])
    if saved == committed:
        return {**info, "dense_file": dense_file(saved)}
    if saved > committed and manifest_lib.exists(fs, f"{root}/{dense_file(saved)}"):
        return _held_by_tables(info, tables)
    if not committed:  # saved before saves named their dense weights
        return {**info, "save_id": "", "dense_file": DENSE_FILE}
    raise errors.FailedPreconditionError(
        f"model checkpoint {path!r}: its tables are save {saved}'s, its model file names save "
        f"{committed}, and the dense weights of save {saved} are not there (another program "
        "wrote into it?); nothing was loaded"
    )


def _held_by_tables(info: dict[str, Any], tables: dict[str, Any]) -> dict[str, Any]:
    """Model file `info` made to say what the save of the tables'
    manifest `tables` holds (a save stopped before its model file)."""
    saved = str(tables["save_id"])
    return {
        **{k: v for k, v in info.items() if k != "parent"},
        "save_id": saved,
        "dense_file": dense_file(saved),
        "tables": sorted(t["config"]["name"] for t in tables["tables"]),
        "kind": tables.get("kind", "full"),
        "created_unix": tables.get("created_unix", 0.0),
    }


def _dense_of(save_id: str) -> str:
    return dense_file(save_id) if save_id else DENSE_FILE


def remove_superseded_dense(path: str, save_id: str) -> None:
    """Removes the dense weights of model saves to `path` older than
    `save_id` (committed since, or stopped), once `save_id` committed."""
    fs, root = manifest_lib.filesystem(path)
    with contextlib.suppress(OSError):  # the save committed: the next one removes them
        manifest_lib.remove_superseded(fs, root, _OWN_DENSE, save_id)


def tables_path(path: str, tables_dir: str | None = None) -> str:
    """Where the table checkpoint of `path` is: `path` itself, or its
    `tables_dir` subdirectory for a model checkpoint."""
    return f"{path.rstrip('/')}/{tables_dir}" if tables_dir else path


def _tables_of(path: str, tables_dir: str | None, tables: dict[str, str] | None) -> str:
    return tables[path] if tables is not None and path in tables else tables_path(path, tables_dir)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint found in a directory."""

    path: str  # what a user loads (a model checkpoint's directory, or the tables')
    tables: str  # the table checkpoint inside it
    manifest: dict[str, Any]


def find(
    directory: str,
    *,
    whole_models: bool = True,
    unread: list[str] | None = None,
    refused: list[str] | None = None,
) -> list[Checkpoint]:
    """The committed checkpoints in `directory` (itself, its
    subdirectories, and model checkpoints' ``tables/``), oldest first by
    save id (the time of the save), then by when each was written.
    `whole_models`: a model checkpoint only when it loads (its model file,
    or its dense weights, there: `read_model`); False: every committed
    table checkpoint (what a delta may stand on). `unread`: where given,
    what cannot be read (the listing, a manifest) is appended to it and
    passed over instead of raised. `refused`: where given, each manifest
    (or model checkpoint) a load would refuse is appended to it with why."""

    def pass_over(what: str, e: Exception) -> None:
        if unread is None:
            raise e
        unread.append(f"{what} ({e})")

    fs, root = manifest_lib.filesystem(directory)
    candidates = [directory]
    entries = []
    try:
        entries = manifest_lib.within_deadline(
            fs, lambda **o: fs.ls(root, detail=True, **o), "listing", root
        )
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - pass_over raises it again without `unread`
        pass_over(directory, e)
    for entry in entries:
        if entry["type"] == "directory":
            candidates.append(manifest_lib.url_of(fs, str(entry["name"]).rstrip("/")))
    found = []
    for path in candidates:
        for tables, tables_dir in ((path, None), (tables_path(path, TABLES_DIR), TABLES_DIR)):
            try:
                m = manifest_lib.read_manifest(tables)
            except errors.NotFoundError:
                continue
            except errors.FailedPreconditionError as e:
                if refused is not None:  # named: some messages leave the path out
                    refused.append(e.message if tables in e.message else f"{tables}: {e.message}")
                continue
            except Exception as e:  # noqa: BLE001 - as above
                pass_over(tables, e)
                break
            if tables_dir and whole_models:  # a model checkpoint: its dense weights too
                try:
                    read_model(path, m)
                except Exception as e:  # noqa: BLE001 - a model checkpoint a load refuses: not listed
                    if refused is not None:
                        refused.append(f"{path}: {getattr(e, 'message', e)}")
                    break
            found.append(Checkpoint(path, tables_path(path, tables_dir), m))
            break
    # Of two checkpoints of one save (a compacted copy keeps its save id),
    # the one written later counts as newer: prune keeps the copy.
    return sorted(
        found,
        key=lambda c: (str(c.manifest["save_id"]), float(c.manifest.get("created_unix", 0))),
    )


def needed(
    paths: list[str], tables_dir: str | None = None, tables: dict[str, str] | None = None
) -> set[str]:
    """The table checkpoints (in `_key` form) that loading any of `paths`
    reads: each one's chain."""
    out: set[str] = set()
    for path in paths:
        for link in manifest_lib.resolve_chain(_tables_of(path, tables_dir, tables)):
            out.add(_key(link.path))
    return out


def retain(
    paths: list[str],
    keep: int,
    tables_dir: str | None = None,
    tables: dict[str, str] | None = None,
    problems: list[str] | None = None,
    save_ids: dict[str, str] | None = None,
) -> list[str]:
    """Deletes the checkpoints of `paths` (oldest first) except the newest
    `keep` and every checkpoint their chains need; returns those deleted. A
    checkpoint whose chain cannot be read is kept, and so is all before it
    (why is appended to `problems`, if given). Each path's table checkpoint
    is `tables[path]` where given (a directory mixing model and table
    checkpoints), else `tables_path(path, tables_dir)`. `save_ids`: the
    save each path held when the caller listed them (`find`'s manifests);
    one that holds another save by its deletion (saved again since: the
    newest, maybe) is kept. Without them, what each holds as this starts."""
    if keep < 1:
        raise errors.InvalidArgumentError(f"keep must be >= 1, got {keep}")
    kept = paths[-keep:]
    listed = {
        path: (save_ids or {}).get(path) or _committed(_tables_of(path, tables_dir, tables))
        for path in paths[:-keep]
    }
    try:
        need = needed(kept, tables_dir, tables)
    except errors.DltError as e:
        if problems is not None:
            problems.append(f"nothing deleted: a kept checkpoint's chain cannot be read ({e})")
        return []  # a broken chain: never guess what it needs
    # A delta may have committed on one of them since the caller listed
    # them: what every other checkpoint beside them needs now stays too.
    refused: list[str] = []
    need |= _needed_beside([_tables_of(p, tables_dir, tables) for p in paths[:-keep]], refused)
    if refused:
        # A delta among them (a manifest mid-edit, say) may need any of
        # them: deleting its base lost it for good.
        if problems is not None:
            problems.append(
                "nothing deleted: a checkpoint beside them cannot be read, and any of them may "
                f"be its base ({'; '.join(refused[:3])}{'; ...' if len(refused) > 3 else ''})"
            )
        return []
    deleted = []
    for path in paths[:-keep]:
        own = _tables_of(path, tables_dir, tables)
        if _key(own) in need:
            continue
        if _committed(own) != listed[path]:  # saved again since: the newest, maybe
            if problems is not None:
                problems.append(f"{path} kept: a save committed there while the prune ran")
            continue
        fs, root = manifest_lib.filesystem(path)
        inside = _checkpoints_inside(fs, root, own)
        if inside:  # its directory is deleted whole: theirs would go with it
            if problems is not None:
                problems.append(
                    f"{path} kept: its directory holds other checkpoints ({', '.join(inside[:3])}"
                    f"{', ...' if len(inside) > 3 else ''}), which deleting it would delete"
                )
            continue
        with contextlib.suppress(FileNotFoundError):  # deleted already (another prune)
            _remove_tree(fs, root)
        deleted.append(path)
    return deleted


def _remove_tree(fs: Any, root: str) -> None:
    """Removes directory `root` and all in it, within its deadline."""
    manifest_lib.within_deadline(fs, lambda **o: fs.rm(root, recursive=True, **o), "removing", root)


def _committed(tables: str) -> str:
    """The save id committed at table checkpoint `tables` ("" if none)."""
    return manifest_lib.committed_save_id(*manifest_lib.filesystem(tables))


def checkpoints_inside(checkpoint: Checkpoint) -> list[str]:
    """The checkpoints saved inside `checkpoint`'s directory (its own table
    checkpoint apart), which `find` of the directory above does not list."""
    fs, root = manifest_lib.filesystem(checkpoint.path)
    return _checkpoints_inside(fs, root, checkpoint.tables)


def _checkpoints_inside(fs: Any, root: str, tables: str) -> list[str]:
    """The directories under `root` (a checkpoint's directory, its table
    checkpoint `tables` apart) that hold a manifest: other checkpoints saved
    inside it."""
    own = posixpath.join(manifest_lib.filesystem(tables)[1], manifest_lib.MANIFEST)
    try:
        files = manifest_lib.within_deadline(fs, lambda **o: fs.find(root, **o), "listing", root)
    except FileNotFoundError:
        return []
    skip = {
        posixpath.normpath(own),
        posixpath.join(posixpath.normpath(root), manifest_lib.MANIFEST),
    }
    return sorted(
        manifest_lib.url_of(fs, posixpath.dirname(f))
        for f in files
        if posixpath.basename(f) == manifest_lib.MANIFEST and posixpath.normpath(f) not in skip
    )


def _directories_beside(path: str) -> list[str]:
    """The directories of checkpoints beside table checkpoint `path`: its
    own parent, and for a model checkpoint's tables, the model
    checkpoint's parent too."""
    fs, root = manifest_lib.filesystem(path)
    if manifest_lib.is_local(fs):  # beside what a link names, not beside the link
        root = os.path.realpath(root)
    directories = [manifest_lib.url_of(fs, posixpath.dirname(root))]
    if posixpath.basename(root) == TABLES_DIR:  # a model checkpoint's tables
        directories.append(manifest_lib.url_of(fs, posixpath.dirname(posixpath.dirname(root))))
    return directories


def _needed_beside(deleting: list[str], refused: list[str]) -> set[str]:
    """What the checkpoints beside the table checkpoints `deleting`
    (`_directories_beside`), other than those, need (`needed`, in `_key`
    form). Why each one beside them that cannot be read (a load refuses
    its manifest) is appended to `refused`: what it needs is unknown."""
    going = {_key(p) for p in deleting}
    out: set[str] = set()
    for directory in sorted({d for path in deleting for d in _directories_beside(path)}):
        for c in find(directory, whole_models=False, refused=refused):
            if _key(c.tables) not in going:
                with contextlib.suppress(errors.NotFoundError, errors.FailedPreconditionError):
                    out |= needed([c.tables])  # a broken chain loads nothing to keep
    return out


def _raise_if_unreachable(error: Exception) -> None:
    """Raises `error` (as UNAVAILABLE) where the store did not answer in
    time: a save's checks passed over such a failure as "nothing there",
    each after the store's timeouts (3 minutes a call on S3), and a save to a
    store that stopped answering reached its shards after 12 minutes, its
    checks skipped. Other failures, a refused connection among them (fast),
    are passed over as before: the shards say why, refusing a URL outside
    their roots (PERMISSION_DENIED) before they would try it."""
    if not errors.is_timeout(error):
        return
    mapped = (
        error
        if isinstance(error, errors.DltError)
        else errors.error_for_storage(error, "reading the checkpoints")
    )
    if not isinstance(mapped, errors.UnavailableError):
        mapped = errors.UnavailableError(mapped.message)
    raise mapped from error


def next_save_id(path: str, base: str | None = None, unread: list[str] | None = None) -> str:
    """A save id for a new save into table checkpoint `path`: the time now,
    or later than every save beside it (its directory of checkpoints, as
    `find` lists them for prune and followers), than the save `path` holds
    and than its base (table checkpoint `base`). A host whose clock is
    behind theirs would otherwise make an older id: a prune would delete
    that newest checkpoint, followers would never take it, and a save into
    the same path would hand the path back to the save it replaced. What
    cannot be read (a directory or manifest this process may not read, the
    shards' own disks) is passed over with a warning: the save goes on, its
    id after what was read. With `unread`, what could not be read is added
    to it instead, for the caller to warn of once the save is taken
    (`warn_unread`: a save the shards refuse says why, and no more)."""
    ids = [_committed(base)] if base is not None else []
    warns = unread is None  # here, not by the caller
    unread = [] if unread is None else unread
    try:
        ids.append(_committed(path))
        directories = _directories_beside(path)
    except Exception as e:  # noqa: BLE001 - a URL the shards refuse: they say why
        _raise_if_unreachable(e)
        directories = []
        unread.append(f"{path} ({e})")
    for directory in directories:
        ids.extend(
            str(c.manifest["save_id"]) for c in find(directory, whole_models=False, unread=unread)
        )
    if warns:
        warn_unread(path, unread)
    # An id of another form (a manifest written by hand) has no time to follow.
    return manifest_lib.new_save_id(after=max(filter(manifest_lib.is_save_id, ids), default=""))


def warn_unread(path: str, unread: list[str]) -> None:
    """Warns that the save into `path` took its id after the saves beside it
    that could be read, not those of `unread` (next_save_id's)."""
    if unread:
        log.warning(
            "saving %s: its id follows the saves beside it that could be read, not %s: should "
            "one of those be newer and this host's clock behind, a prune takes this save as "
            "the older",
            path, "; ".join(unread[:3]) + ("; ..." if len(unread) > 3 else ""),
        )  # fmt: skip


def refuse_breaking_dependents(path: str) -> None:
    """Refuses a save into table checkpoint `path` that would replace a
    checkpoint a delta beside it was saved on top of (in the same directory
    of checkpoints: `path`'s siblings, or for a model checkpoint's tables,
    the model checkpoint's siblings): that delta's chain would break (its
    parent would hold another save). Deltas elsewhere are not looked for."""
    try:
        current = manifest_lib.read_manifest(path)
    except Exception as e:  # noqa: BLE001 - nothing committed there, or a URL the shards refuse
        _raise_if_unreachable(e)
        return
    here = _key(path)
    for directory in _directories_beside(path):
        for found in find(directory, whole_models=False):
            link = found.manifest.get("parent")
            if found.manifest.get("kind") != "delta" or not isinstance(link, dict):
                continue
            if _key(found.tables) == here or link.get("save_id") != current["save_id"]:
                continue
            base = manifest_lib.resolve_parent(found.tables, str(link.get("path", "")))
            if _key(base) == here:
                raise errors.FailedPreconditionError(
                    f"{found.path!r} is a delta on top of the checkpoint at {path!r}: a save there "
                    f"would replace it and break {found.path!r}'s chain; save into another "
                    f"directory (or delete {found.path!r} first)"
                )


def describe(path: str) -> list[dict[str, Any]]:
    """The chain a load of `path` reads, oldest first: per checkpoint its
    path, kind, save id, creation time, shard count, rows and removals
    written, and bytes of its files."""
    out = []
    for link in manifest_lib.resolve_chain(path):
        m = link.manifest
        out.append(
            {
                "path": link.path,
                "kind": link.kind,
                "save_id": link.save_id,
                "created_unix": m.get("created_unix", 0.0),
                "num_shards": m["num_shards"],
                "rows": sum(t["rows"] for t in m["tables"]),
                "removed": sum(t.get("removed", 0) for t in m["tables"]),
                "bytes": sum(f["bytes"] for f in m["files"]),
            }
        )
    return out


def compact(source: str, target: str, num_shards: int | None = None) -> dict[str, Any]:
    """Writes the state the chain of `source` loads as one full checkpoint
    at `target`, with `num_shards` files (default: the head's shard count).
    One file's share of the table is in memory at a time."""
    return _write_compacted(source, target, *_compaction(source, target, num_shards, False))


def _compaction(
    source: str, target: str, num_shards: int | None, models: bool
) -> tuple[int, str, float]:
    """Checks a compaction of `source` into `target` before anything is
    written (`models`: both are model checkpoints' `tables/`); returns its
    file count, save id, and the creation time of the checkpoint it copies
    (the copy's is later: it sorts as the newer)."""
    if num_shards is not None and not 1 <= num_shards <= NUM_BUCKETS:
        raise errors.InvalidArgumentError(
            f"compact: num_shards must be 1 to {NUM_BUCKETS} (a shard owns at least one "
            f"bucket), got {num_shards}"
        )
    links = manifest_lib.resolve_chain(source)
    here = _key(target)
    for link in links:
        there = _key(link.path)
        if here == there:
            raise errors.InvalidArgumentError(
                f"compact's target {target!r} is a checkpoint that loading {source!r} reads (the "
                "source, its base or one of its deltas): writing there would break the chain; "
                "give another target"
            )
        if manifest_lib.nested(here, there, models):
            raise errors.InvalidArgumentError(
                f"compact's target {target!r} lies inside, or holds, {link.path!r}, which loading "
                f"{source!r} reads: listings and prunes of the directory would mix them up; give "
                "a directory beside it"
            )
    refuse_breaking_dependents(target)
    head = links[-1].manifest
    n = num_shards if num_shards is not None else int(head["num_shards"])
    # The state of the save it compacts, so that save's id: it sorts where
    # that save does (prune's newest, a follower's next), not as the newest
    # checkpoint of all (a prune after a compact deleted newer ones).
    save_id = str(head["save_id"])
    fs, root = manifest_lib.filesystem(target)
    held = manifest_lib.committed_save_id(fs, root)
    if held > save_id:
        raise errors.FailedPreconditionError(
            f"compact's target {target!r} holds save {held}, newer than the save {save_id} "
            f"that {source!r} holds: the copy would replace newer state; give another target"
        )
    # A checkpoint of the other layout at the target (a model checkpoint's
    # tables/ under a table checkpoint's directory, or the reverse): the copy
    # hid it from listings, prunes and followers, which served the copy's
    # older rows in its place.
    other = posixpath.dirname(root.rstrip("/")) if models else f"{root.rstrip('/')}/{TABLES_DIR}"
    if manifest_lib.committed_save_id(fs, other):
        kinds = ("a model", "a table") if models else ("a table", "a model")
        raise errors.FailedPreconditionError(
            f"compact's target {posixpath.dirname(target) if models else target!r} holds "
            f"{kinds[1]} checkpoint ({manifest_lib.url_of(fs, other)}), which {kinds[0]} "
            "checkpoint written there would hide; give another target"
        )
    return n, save_id, float(head.get("created_unix", 0.0))


def _write_compacted(
    source: str, target: str, n: int, save_id: str, created_after: float
) -> dict[str, Any]:
    parts = []
    for index in range(n):
        shard = _native.Shard(index, n)
        staged = shard_files.prepare_load(source, shard, save_id=save_id)  # one save, all files
        shard.install_tables(staged["staged"])
        parts.append(shard_files.save_shard(target, shard, save_id))
        del shard, staged
    return manifest_lib.write_manifest(target, parts, save_id, created_after=created_after)


def compact_model(source: str, target: str, num_shards: int | None = None) -> dict[str, Any]:
    """`compact` of a model checkpoint: its tables' chain compacted into
    `target`/tables, its dense weights copied, and its model file written
    last (a full checkpoint, no parent), so `tf_dlt.load` takes `target`
    as it takes `source`. Returns the tables' manifest."""
    info = read_model(source)
    fs, root = manifest_lib.filesystem(source)
    target_fs, target_root = manifest_lib.filesystem(target)
    tables, target_tables = tables_path(source, TABLES_DIR), tables_path(target, TABLES_DIR)
    n, save_id, created = _compaction(tables, target_tables, num_shards, True)
    if info["save_id"] and info["save_id"] != save_id:
        raise errors.FailedPreconditionError(
            f"{source} was saved again as it was read (its tables hold save {save_id}, its "
            f"model file {info['save_id']}): compact it again once no save to it runs"
        )
    # The dense weights first, durably, under the save's name (the tables
    # keep its id; a checkpoint of before saves named their dense weights
    # has none in its model file): once the tables commit, `target` is
    # whole but for its model file, which `read_model` does without.
    dense = dense_file(save_id)
    manifest_lib.make_directory(target_fs, target_root)
    weights = manifest_lib.read_file(fs, f"{root}/{info['dense_file']}")
    manifest_lib.commit_file(target_fs, f"{target_root}/{dense}", weights)
    written = _write_compacted(tables, target_tables, n, save_id, created)
    info.pop("parent", None)
    info.update(
        kind="full",
        created_unix=written["created_unix"],
        save_id=written["save_id"],
        dense_file=dense,
    )
    manifest_lib.commit_file(
        target_fs, f"{target_root}/{MODEL_FILE}", json.dumps(info, indent=2).encode()
    )
    remove_superseded_dense(target, written["save_id"])
    return written
