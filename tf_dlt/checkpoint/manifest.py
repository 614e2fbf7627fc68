"""The checkpoint manifest: MANIFEST.json, written last, commits a checkpoint.

Shared by the shards (which read it on Load) and the client (which writes it
after every shard saved its part). No h5py here.
"""

from __future__ import annotations

import calendar
import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import logging
import os
import posixpath
import re
import secrets
import stat
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any, TypeVar, cast

import fsspec
import fsspec.asyn
import fsspec.exceptions

from tf_dlt import errors
from tf_dlt.routing import NUM_BUCKETS
from tf_dlt.table_config import TableConfig

MANIFEST = "MANIFEST.json"
FORMAT = "tf_dlt-checkpoint"
# 2: some table stores 16-bit values or slots as 16 bits (builds reading
# only version 1 refuse it rather than misread them); 1: every row float32.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)


log = logging.getLogger("tf_dlt.checkpoint")
_T = TypeVar("_T")

# Files a save writes: shard-<i>-of-<n>.<save id>.h5, and .tmp-<random>
# while it is written (exclusive_temp); save ids are "<UTC date>T<time>
# <microseconds>-<8 hex digits>" (new_save_id; ids of earlier versions lack
# the microseconds).
SAVE_ID = r"\d{8}T\d{6}(\d{6})?-[0-9a-f]{8}"  # new_save_id's form
_OWN_FILE = re.compile(
    rf"^shard-\d{{5}}-of-\d{{5}}\.(?P<save_id>{SAVE_ID})\.h5(?P<tmp>\.tmp-\w+)?$"
)
# Every save keeps a copy of its manifest, MANIFEST.<save id>.json, written
# once it committed (_commit_with_copy): when saves to one path race, each
# makes the path name the newest whole save again (hold_newest).
_OWN_COPY = re.compile(rf"^MANIFEST\.(?P<save_id>{SAVE_ID})\.json(?P<tmp>\.tmp-\w+)?$")
# How often a save looks again for the newest whole save while other saves
# to the path keep committing (each look lists the directory once).
_HOLD_TRIES = 5


def exclusive_temp(target: str) -> tuple[int, str]:
    """A new empty file beside local file `target` to write it in, opened
    for writing: created exclusively under a random name (mode 0600), so a
    file or link planted beside `target` is never written through. Returns
    (its descriptor, its path)."""
    directory, name = os.path.split(target)
    return tempfile.mkstemp(prefix=f"{name}.tmp-", dir=directory or ".")


@contextlib.contextmanager
def replaced_durably(target: str) -> Iterator[tuple[int, str]]:
    """A new empty file beside local file `target` (`exclusive_temp`): its
    descriptor and path, for the block to write through either. After the
    block it is fsynced, renamed over `target` and the directory synced, so
    a reader sees the old `target` or all of the new one, and a crash after
    it keeps the new one. The temp file goes if the block fails."""
    fd, tmp = exclusive_temp(target)
    try:
        yield fd, tmp
        os.fsync(fd)
        os.replace(tmp, target)
        sync_directory(os.path.dirname(target) or ".")
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def sync_directory(directory: str) -> None:
    """Makes a rename into local `directory` durable (a crash after it
    cannot lose the new name on filesystems that need the directory
    synced); a filesystem that cannot sync a directory is left as it is."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def is_save_id(text: str) -> bool:
    """Whether `text` has the form `new_save_id` gives."""
    return re.fullmatch(SAVE_ID, text) is not None


def new_save_id(after: str = "") -> str:
    """A save id: sorts by time (UTC, to the microsecond), unique by its
    random tail; and after save id `after` (one microsecond past its time
    where this host's clock has not reached it: saves beside each other
    keep the order they were made in across hosts whose clocks differ)."""
    micros = time.time_ns() // 1000
    if after:
        micros = max(micros, min(_micros_of(after) + 1, _LAST_MICROS))
    seconds, fraction = divmod(micros, 1_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds)) + f"{fraction:06d}"
    return f"{stamp}-{secrets.token_hex(4)}"


# The last time a save id can hold (its year has four digits): an id at it
# (one made up) is not followed, and sorts with the saves after it.
_LAST_MICROS = 253402300799_999_999


def _micros_of(save_id: str) -> int:
    """The time of save id `save_id` in microseconds since the epoch (an id
    of an earlier version, to the second: the last microsecond of it)."""
    if not is_save_id(save_id):
        raise errors.InvalidArgumentError(f"not a save id: {save_id!r}")
    stamp = save_id.split("-", 1)[0]
    seconds = calendar.timegm(time.strptime(stamp[:15], "%Y%m%dT%H%M%S"))
    return seconds * 1_000_000 + (int(stamp[15:]) if len(stamp) > 15 else 999_999)


def shard_file_name(shard_index: int, num_shards: int, save_id: str) -> str:
    return f"shard-{shard_index:05d}-of-{num_shards:05d}.{save_id}.h5"


def absolute(path: str) -> str:
    """A local path made absolute against this process's working directory
    (a shard server would resolve a relative one against its own); URLs as
    they are."""
    return path if "://" in path else os.path.abspath(path)


# HDFS client settings tf_dlt starts from (hdfs-native takes Hadoop's keys;
# the cluster's HADOOP_CONF_DIR files and fsspec's own configuration for
# "hdfs" come on top): a NameNode that cannot be reached fails the request
# after a few seconds of retries instead of blocking a shard's Save for
# minutes. hdfs-native (0.14) has no key that bounds a NameNode that
# accepts connections and never answers: it reads no ipc.client.* key (no
# connect or RPC timeout; a call waits for its reply for good, measured
# past 150 s), and dfs.client.socket-timeout (default 60 s) bounds only
# connecting to a DataNode and each wait for a DataNode's next bytes (not a
# DataNode that trickles). Every HDFS call tf_dlt makes therefore runs
# within the deadline of `within_deadline`, as on S3.
HDFS_DEFAULTS = {
    "dfs.client.failover.max.attempts": "4",
    "dfs.client.failover.sleep.base.millis": "200",
    "dfs.client.failover.sleep.max.millis": "2000",
}
# S3 client settings tf_dlt starts from (botocore's; fsspec's configuration
# for "s3" comes on top), and the times s3fs tries each call (its own retries
# around botocore's): an endpoint that accepts connections and never answers
# fails a request after about 3 minutes (183 s measured: 2 x 2 reads of 30 s
# and the connections' own retries), where the defaults went on for
# many minutes (a save was still waiting after 8, its shard taking no other
# save or load meanwhile).
S3_DEFAULTS = {
    "config_kwargs": {
        "connect_timeout": 10,
        "read_timeout": 30,
        "retries": {"max_attempts": 2, "mode": "standard"},
        # A shard file is read in ranges, each block checked against the
        # manifest's SHA-256; S3-compatible servers that send the whole
        # object's checksum with a range (rclone) failed botocore's check.
        "response_checksum_validation": "when_required",
    }
}
S3_CALL_TRIES = 2
# An upload to an object store ends within this many seconds plus one for
# each UPLOAD_FLOOR_BYTES_PER_S bytes (a slower link fails it, UNAVAILABLE):
# botocore's read timeout does not cover sending a request's body, and an
# endpoint that stopped reading it held a shard's save (and every save and
# load of the shard after it) until the endpoint woke, 8 minutes and more.
UPLOAD_DEADLINE_S = 60.0
UPLOAD_FLOOR_BYTES_PER_S = 2 << 20
# HDFS, reached through hdfs-native: its rename replaces a file atomically
# (a reader sees the old MANIFEST.json or the new one, never a part of it
# or none), and its calls take no timeout (each runs on a helper thread,
# `_on_helper_thread`).
_HDFS = frozenset({"hdfs", "viewfs"})


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of `path` and the path within it. A URL the
    store would read as another path is refused: s3fs cuts each key at
    '?versionId=', so every file of a save to `.../x?versionId=1` landed on
    one object `.../x` (and one to `.../MANIFEST.json?versionId=1` replaced
    another checkpoint's manifest); HDFS drops a query or fragment."""
    protocol = (fsspec.core.split_protocol(path)[0] or "file").lower()
    cut = (protocol in ("s3", "s3a") and "?versionId=" in path) or (
        protocol in _HDFS and bool(_query_or_fragment(path))
    )
    if cut:
        raise errors.InvalidArgumentError(
            f"checkpoint URL {path!r} holds a query or fragment ('?versionId=', or '?' or '#' "
            f"in an {protocol} URL), which the store does not read as part of the path"
        )
    options: dict[str, Any] = {}
    if protocol in _HDFS:
        options = dict(HDFS_DEFAULTS)
    elif protocol not in ("file", "local", "memory"):
        # Object stores: a listing must show what other processes wrote
        # since (a follower polling, a save removing superseded files),
        # never a copy cached by this one.
        options = {"use_listings_cache": False}
        if protocol in ("s3", "s3a"):
            options.update(S3_DEFAULTS)
    configured = fsspec.config.conf.get(protocol, {})
    options = {k: v for k, v in options.items() if k not in configured}
    fs, root = fsspec.core.url_to_fs(path, **options)
    if protocol in ("s3", "s3a") and "config_kwargs" in options:  # (not configured otherwise)
        fs.retries = S3_CALL_TRIES  # this instance's: s3fs's class attribute says 5
    return fs, root.rstrip("/")


def commit_file(fs: fsspec.AbstractFileSystem, target: str, data: bytes) -> None:
    """Writes small file `target` (a manifest) so that a reader sees either
    the file it replaces or all of `data`: on a local disk a synced temp
    file renamed over it; on HDFS a temp file renamed over it (the
    NameNode's rename is atomic); on an object store one PUT (objects
    appear whole)."""
    if is_local(fs):
        with replaced_durably(target) as (fd, _):
            _write_all(fd, data)  # through our descriptor: never a file planted by name
        return
    if _renames_atomically(fs):  # each call within its deadline (`within_deadline`)
        tmp = f"{target}.tmp-{secrets.token_hex(8)}"
        _upload_within_deadline(fs, lambda **o: fs.pipe_file(tmp, data, **o), tmp, len(data))
        try:
            within_deadline(
                fs, lambda **o: fs.mv(tmp, target, overwrite=True, **o), "renaming", tmp
            )
        except errors.UnavailableError:
            raise  # past its deadline: no further call waits on a store that stopped answering
        except BaseException:
            _remove_quietly(fs, tmp)
            raise
        return
    _upload_within_deadline(fs, lambda **o: fs.pipe_file(target, data, **o), target, len(data))


def _query_or_fragment(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return parts.query or parts.fragment


def transfer_deadline(size: int) -> float:
    """Seconds a request to an object store or HDFS moving `size` bytes may
    take (0: no deadline): an upload's, a ranged read of a shard file's,
    and the small requests' (a HEAD or a NameNode's file status, a listing,
    a manifest's read, a rename: `size` 0, or the size a HEAD gave).
    TF_DLT_UPLOAD_DEADLINE_S (default UPLOAD_DEADLINE_S; 0: no deadline)
    plus a second per TF_DLT_UPLOAD_MIN_BYTES_PER_S (default
    UPLOAD_FLOOR_BYTES_PER_S), read from the environment of the process
    making the request (shard servers upload and read their files; the
    client the manifest)."""
    base = float(os.environ.get("TF_DLT_UPLOAD_DEADLINE_S", UPLOAD_DEADLINE_S))
    floor = float(os.environ.get("TF_DLT_UPLOAD_MIN_BYTES_PER_S", UPLOAD_FLOOR_BYTES_PER_S))
    if base <= 0:
        return 0.0
    return base + (size / floor if floor > 0 else 0.0)


def has_deadlines(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `within_deadline` bounds the calls to `fs`: an object store
    (fsspec's asynchronous filesystems) or HDFS; not a local disk or
    memory."""
    return isinstance(fs, fsspec.asyn.AsyncFileSystem) or _is_hdfs(fs)


class _PastDeadline(Exception):
    """A call run on a helper thread (`_on_helper_thread`) went past its
    deadline."""


def _on_helper_thread(call: Callable[[], _T], deadline: float, name: str) -> _T:
    """`call()` on a daemon thread of its own, waited for `deadline`
    seconds; _PastDeadline past it. hdfs-native's client is synchronous,
    takes no timeout and has no setting that bounds a NameNode that never
    answers (HDFS_DEFAULTS): the only way to stop waiting for such a call is
    to leave it. The thread left behind stays blocked in the client (the
    GIL released) until the store answers or drops the connection, then
    ends: its result or error is dropped, and nothing else is held for it
    (no lock of tf_dlt's, no file of the caller's; a file the call opened
    itself it closes as it ends). Like an S3 request past its deadline, a
    call left may still take effect later (a rename, an upload of a file
    no manifest names yet): callers treat UnavailableError as "not known
    to have happened". (A thread left that returns just as the interpreter
    exits is ended inside hdfs-native, which can abort the exit: "FATAL:
    exception not rethrown"; one still blocked is not.)"""
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.append((False, e))
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(deadline):
        raise _PastDeadline
    ok, value = outcome.pop()
    if not ok:
        raise value
    return cast(_T, value)


def within_deadline(
    fs: fsspec.AbstractFileSystem,
    call: Callable[..., _T],
    what: str,
    target: str,
    size: int = 0,
    on_timeout: Callable[[], None] | None = None,
) -> _T:
    """`call(**options)`, a request to `fs` about `target` (`what` it does:
    "listing", "uploading 5 bytes to") moving about `size` bytes; to an
    object store or HDFS (`has_deadlines`) within `transfer_deadline(size)`,
    else UnavailableError naming `what` and `target` (`on_timeout()` called
    first). botocore's read timeout bounds each socket read, not a request:
    a store that sent a byte now and then held a HEAD, a listing or a
    manifest's read (a save's checks, a load, a follower's poll, `tf-dlt
    checkpoint ls`, a process past SIGTERM) for as long as it went on; a
    NameNode that accepted connections and never answered held them for
    good. Object stores (fsspec's asynchronous filesystems) take
    `timeout=`; HDFS (hdfs-native: synchronous, no timeout) is called with
    no options on a helper thread, left past the deadline
    (`_on_helper_thread`). Local files and memory are called as they are."""
    deadline = transfer_deadline(size)
    if not deadline or not has_deadlines(fs):
        return call()
    started = time.monotonic()
    try:
        if isinstance(fs, fsspec.asyn.AsyncFileSystem):
            return call(timeout=deadline)
        return _on_helper_thread(call, deadline, f"tf_dlt-hdfs {what}")
    except (fsspec.exceptions.FSTimeoutError, _PastDeadline):
        took = time.monotonic() - started
        if on_timeout is not None:
            on_timeout()
        raise errors.UnavailableError(
            f"{what} {url_of(fs, target)} timed out after {took:.0f} s (its deadline "
            f"{deadline:.0f} s: TF_DLT_UPLOAD_DEADLINE_S plus a second per "
            "TF_DLT_UPLOAD_MIN_BYTES_PER_S; the store stopped answering?)"
        ) from None


def read_file(fs: fsspec.AbstractFileSystem, target: str, limit: int | None = None) -> bytes:
    """The bytes of file `target` (a manifest, a model file, dense
    weights); FailedPreconditionError when it holds more than `limit`. On
    an object store a HEAD, then one ranged GET of the object as it is
    then, each within its deadline (`within_deadline`: the GET's of the
    size the HEAD gave); on HDFS the same (a file status, then a read);
    elsewhere read through `fs.open`."""
    too_large = errors.FailedPreconditionError(f"{target} is larger than {limit} bytes")
    if not has_deadlines(fs):
        with fs.open(target, "rb") as f:
            data = f.read(-1 if limit is None else limit + 1)
    else:
        info = within_deadline(fs, lambda **o: fs.info(target, **o), "looking up", target)
        size = info.get("size") if isinstance(info.get("size"), int) else None
        if limit is not None and size is not None and size > limit:
            raise too_large
        if size == 0:
            return b""  # (a range of an empty object is refused: 416)
        end = None if limit is None else limit + 1
        data = within_deadline(
            fs, lambda **o: fs.cat_file(target, start=0, end=end, **o), "reading", target, size or 0
        )
    if limit is not None and len(data) > limit:
        raise too_large
    return bytes(data)


def _abort_multipart_uploads(fs: fsspec.AbstractFileSystem, target: str) -> None:
    """Aborts the incomplete multipart uploads of `target` on S3, best
    effort, 10 s a call: s3fs aborts its own only on an Exception, and one
    cancelled by a deadline left its parts stored (and billed) for good."""
    call, split = getattr(fs, "call_s3", None), getattr(fs, "split_path", None)
    if call is None or split is None:
        return
    try:
        bucket, key, _ = split(target)
        listed = call("list_multipart_uploads", Bucket=bucket, Prefix=key, timeout=10)
        for upload in listed.get("Uploads", []):
            if upload.get("Key") == key:
                call(
                    "abort_multipart_upload", Bucket=bucket, Key=key,
                    UploadId=upload["UploadId"], timeout=10,
                )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - best effort: the upload's own error is raised
        log.warning("could not abort the incomplete uploads of %s: %s", target, e)


def _upload_within_deadline(
    fs: fsspec.AbstractFileSystem, upload: Callable[..., Any], target: str, size: int
) -> None:
    """`upload(**options)` (fs.put_file or fs.pipe_file of `size` bytes to
    `target`) within `transfer_deadline(size)` on an object store
    (`within_deadline`), else UnavailableError (its incomplete multipart
    upload aborted)."""
    within_deadline(
        fs, upload, f"uploading {size} bytes to", target, size,
        on_timeout=lambda: _abort_multipart_uploads(fs, target),
    )  # fmt: skip


def put_durably(fs: fsspec.AbstractFileSystem, local: str, target: str) -> None:
    """Copies local file `local` to `target` (a file no reader opens before
    a manifest naming it commits): on a local disk synced before the
    commit can be, so a crash after the commit never finds it short; an
    upload elsewhere (an object appears whole, HDFS keeps its replicas)."""
    if not is_local(fs):
        size = os.path.getsize(local)
        _upload_within_deadline(fs, lambda **o: fs.put_file(local, target, **o), target, size)
        return
    with replaced_durably(target) as (fd, _), open(local, "rb") as source:
        while chunk := source.read(8 << 20):
            _write_all(fd, chunk)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def url_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A path within `fs` as something `filesystem` opens again: as it is
    for local files, else with its protocol."""
    return path if is_local(fs) else str(fs.unstrip_protocol(path))


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols


# Filesystems with directories of their own (object stores have keys only).
_DIRECTORIES = frozenset({"file", "local", "memory", "hdfs", "viewfs"})


def make_directory(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """Makes directory `root` and its parents where `fs` has directories;
    on an object store nothing (a key needs none): s3fs's makedirs creates a
    missing bucket, so a save to a bucket whose name had a typo made that
    bucket, without the intended one's policies (encryption, retention), and
    wrote there; the save now fails on the missing bucket."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if _DIRECTORIES.intersection(protocols):
        within_deadline(
            fs, lambda **o: fs.makedirs(root, exist_ok=True, **o), "making the directory", root
        )


def parent_reference(path: str, parent: str) -> str:
    """How a delta at `path` names its parent checkpoint `parent`: a path
    relative to `path` when both are on one filesystem (a run directory can
    be moved or copied whole), else `parent` as given. One filesystem is one
    instance with the same options: the same protocol and, for HDFS, the
    same NameNode (its host is not part of the path, so a relative reference
    across NameNodes would name a directory of the delta's own)."""
    fs, root = filesystem(path)
    parent_fs, parent_root = filesystem(parent)
    if fs == parent_fs:
        if is_local(fs):
            return os.path.relpath(os.path.abspath(parent_root), os.path.abspath(root))
        # posixpath: object-store keys are "/"-separated on every platform.
        return posixpath.relpath(parent_root, root)
    return parent


def resolve_parent(path: str, reference: str) -> str:
    """The parent checkpoint's path from a child at `path` and its
    `parent_reference`."""
    if "://" in reference or os.path.isabs(reference):
        return reference
    fs, root = filesystem(path)
    return url_of(fs, os.path.normpath(os.path.join(root, reference)))


def write_manifest(
    path: str,
    parts: list[dict[str, Any]],
    save_id: str,
    parent: dict[str, Any] | None = None,
    *,
    created_after: float = 0.0,
) -> dict[str, Any]:
    """Commits a checkpoint: writes MANIFEST.json atomically, then removes
    files of earlier saves at `path` that the new manifest does not name.

    With `parent` ({"path", "save_id", "chain_length"} of the checkpoint a
    delta was saved on top of) the manifest is a delta naming it, unless
    every shard wrote every table in full (then it is a full checkpoint).
    `created_after`: its creation time is later than this one (a compacted
    copy's, than its source's: of two checkpoints of one save, the one
    written later sorts as the newer), whatever this host's clock says."""
    parts = sorted(parts, key=lambda p: p["shard_index"])
    num_shards = parts[0]["num_shards"] if parts else 0
    if num_shards != len(parts) or [p["shard_index"] for p in parts] != list(range(len(parts))):
        raise errors.InvalidArgumentError("a checkpoint needs one part from every shard")
    # The parts' buckets tile the whole range, in shard order: a part from
    # a shard of another layout (a save across a re-shard) would leave rows
    # out, or hold some twice.
    if parts and not _one_from_each_shard(parts, num_shards):
        ranges = [(p["first_bucket"], p["end_bucket"]) for p in parts]
        raise errors.FailedPreconditionError(
            f"the shards' bucket ranges {ranges} do not cover the {NUM_BUCKETS} buckets once "
            "each (shards of different layouts: a re-shard during the save?)"
        )
    tables: dict[str, dict[str, Any]] = {}
    every_table_full = True
    for part in parts:
        for info in part["tables"]:
            config = info["config"]
            known = tables.setdefault(
                config["name"], {"config": config, "rows": 0, "removed": 0, "full_files": 0}
            )
            if known["config"] != config:
                raise errors.FailedPreconditionError(
                    f"table {config['name']!r} differs between shards: "
                    f"{known['config']} vs {config}"
                )
            known["rows"] += info["rows"]
            known["removed"] += info.get("removed", 0)
            full = info.get("mode", "full") == "full"
            known["full_files"] += int(full)
            every_table_full &= full
    delta = parent is not None and not every_table_full
    sixteen_bit = any(
        t["config"].get("policy", {}).get(k, "float32") != "float32"
        for t in tables.values()
        for k in ("value_dtype", "slot_dtype")
    )
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if sixteen_bit else 1,
        "save_id": save_id,
        "created_unix": max(time.time(), created_after + 0.001),
        "kind": "delta" if delta else "full",
        "num_shards": num_shards,
        "num_buckets": NUM_BUCKETS,
        "tables": [tables[name] for name in sorted(tables)],
        "files": [
            {
                k: p[k]
                for k in (
                    "file",
                    "sha256",
                    "bytes",
                    "shard_index",
                    "first_bucket",
                    "end_bucket",
                    "block_bytes",
                    "block_sha256",
                    "meta_block_bytes",
                )  # fmt: skip
                if k in p
            }
            for p in parts
        ],
    }
    if delta and parent is not None:
        manifest["parent"] = {
            "path": parent_reference(path, parent["path"]),
            "save_id": parent["save_id"],
        }
        manifest["chain_length"] = int(parent.get("chain_length", 1)) + 1
    else:
        manifest["chain_length"] = 1
    fs, root = filesystem(path)
    # Saves to one path at once (docs/checkpoints.md: one at a time): the
    # newest that committed holds it, and removed the others' files.
    newer = committed_save_id(fs, root)
    if newer > save_id:
        raise errors.FailedPreconditionError(
            f"a newer save ({newer}) committed to {path} while this one ({save_id}) ran: it "
            "holds the path, and this save is dropped"
        )
    if delta and parent is not None:
        _check_base(path, parent, save_id, committed=False)
    for part in parts:  # a concurrent save to the same path may have removed them
        if not exists(fs, f"{root}/{part['file']}"):
            raise errors.FailedPreconditionError(
                f"{part['file']} is gone from {path} before its manifest was written (another "
                "save to the same path removed it?); the checkpoint there is unchanged"
            )
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    files = {p["file"] for p in parts}
    copy = _commit_with_copy(fs, root, save_id, data, path)
    try:
        remove_superseded(fs, root, (_OWN_FILE, _OWN_COPY), save_id, keep=files)
    except OSError as e:  # committed: the next save removes them
        log.warning("saved %s; removing the files of earlier saves failed: %s", path, e)
    # Another save may have committed between the checks above and this
    # commit and removed this one's files, or an older one committed after
    # it and lost its files to the removal above: the path holds the newest
    # whole save again.
    try:
        held = hold_newest(fs, root, data)
        dropped = held != save_id and not _all_there(fs, root, files)
    except Exception as e:  # committed (a store that refuses listings, say)
        if not errors.is_storage_error(e):
            raise
        log.warning(
            "saved %s; checking that no other save to it raced this one failed: %s", path, e
        )
        return manifest
    if dropped:
        _remove_quietly(fs, copy)
        there = f"save {held} holds it" if held else f"save to {path} again"
        raise errors.FailedPreconditionError(
            f"another save to {path} removed this save's files as it committed: this save "
            f"({save_id}) is dropped; {there} (one save to a path at a time)"
        )
    if delta and parent is not None:
        _check_base(path, parent, save_id, committed=True)
    return manifest


def _check_base(path: str, parent: dict[str, Any], save_id: str, *, committed: bool) -> None:
    """Refuses a delta whose base no longer holds the save it was taken on
    top of: saved again, pruned or compacted over while the delta was
    written (its chain would be broken)."""
    base = str(parent["path"])
    try:
        held = resolve_chain(base)[-1].save_id
        reason = "" if held == parent["save_id"] else f"now holds save {held}"
    except (errors.NotFoundError, errors.FailedPreconditionError) as e:
        reason = f"no longer loads ({e.message})"
    except Exception as e:
        if not committed or not errors.is_storage_error(e):
            raise
        log.warning("saved %s; checking that its base %s still holds it failed: %s", path, base, e)
        return
    if not reason:
        return
    what = (
        f"{path} holds this delta, which cannot load: save it again in full (no base)"
        if committed
        else f"this delta ({save_id}) is dropped and {path} is unchanged: save again, in full "
        "or on a base that stays"
    )
    raise errors.FailedPreconditionError(
        f"the base {base} of the delta at {path} was taken at save {parent['save_id']} and "
        f"{reason} (saved again, pruned or compacted over while the delta was written): {what}"
    )


def _commit_with_copy(
    fs: fsspec.AbstractFileSystem, root: str, save_id: str, data: bytes, path: str
) -> str:
    """Commits `data` as MANIFEST.json at `root`, then places its copy
    (manifest_copy; returns its path): a copy names a save that committed,
    never one whose commit failed, for hold_newest to put back. On HDFS,
    where closing any file written waits about 0.5 s, the copy is written
    under a temp name while the manifest commits and renamed after."""
    copy = f"{root}/{manifest_copy(save_id)}"
    staged = f"{copy}.tmp-{secrets.token_hex(8)}" if _renames_atomically(fs) else ""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stage = lambda **o: fs.pipe_file(staged, data, **o)  # noqa: E731
        staging = (
            pool.submit(_upload_within_deadline, fs, stage, staged, len(data)) if staged else None
        )
        try:
            commit_file(fs, f"{root}/{MANIFEST}", data)
        except BaseException as e:
            if staging is not None:
                concurrent.futures.wait([staging])  # (within its deadline)
                if not isinstance(e, errors.UnavailableError):  # past a deadline: left for
                    _remove_quietly(fs, staged)  # a later save (remove_superseded)
            raise
    try:
        if staging is not None:
            staging.result()
            within_deadline(
                fs, lambda **o: fs.mv(staged, copy, overwrite=True, **o), "renaming", staged
            )
        elif is_local(fs):
            commit_file(fs, copy, data)  # never written through a link planted at its name
        else:
            # One PUT: an object appears whole.
            _upload_within_deadline(fs, lambda **o: fs.pipe_file(copy, data, **o), copy, len(data))
    except FileNotFoundError:
        pass  # a newer save removed its temp name as superseded: hold_newest finds that one
    except OSError as e:
        if staged and not isinstance(e, errors.UnavailableError):  # (see above)
            _remove_quietly(fs, staged)
        log.warning("saved %s; writing the manifest's copy failed: %s", path, e)
    return copy


def _is_hdfs(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` is HDFS (`_HDFS`)."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return bool(_HDFS & set(protocols))


def _renames_atomically(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` (not a local disk) replaces a file by rename atomically."""
    return _is_hdfs(fs)


def manifest_copy(save_id: str) -> str:
    """The name of save `save_id`'s copy of its manifest (_OWN_COPY)."""
    return f"MANIFEST.{save_id}.json"


def hold_newest(fs: fsspec.AbstractFileSystem, root: str, own: bytes | None = None) -> str:
    """Makes MANIFEST.json at `root` name the newest committed save whose
    files are all there: when it names a save with a file missing, or a
    newer save's copy (MANIFEST.<save id>.json, written once that save
    committed) or `own` (the manifest of the caller's save, which need not
    be listed yet) names only files that are there, it commits the newest
    such. Returns the save it holds ("" when no save there is whole, or
    saves kept committing past _HOLD_TRIES looks). Whether a file is there
    is asked of the store file by file, never of a listing (another
    S3-compatible store may lag its listings, not its objects): a listing
    only finds the copies."""
    for _ in range(_HOLD_TRIES):
        held = _whole(fs, root, MANIFEST)
        newest = _newest_whole(fs, root, held[0] if held else "", own)
        if newest is None:
            return held[0] if held else ""
        commit_file(fs, f"{root}/{MANIFEST}", newest[1])
    held = _whole(fs, root, MANIFEST)
    return held[0] if held else ""


def _whole(
    fs: fsspec.AbstractFileSystem, root: str, name: str, data: bytes | None = None
) -> tuple[str, bytes] | None:
    """(save id, bytes) of manifest `name` at `root` (or of `data`) when a
    load takes it and every file it names is there; None otherwise."""
    try:
        if data is None:
            data = _read_manifest_bytes(fs, f"{root}/{name}")
        manifest = _parse_manifest(data, root)
    except FileNotFoundError:
        return None  # removed meanwhile
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise  # the store failed: hold_newest stops (write_manifest warns)
        return None  # a link at its name: never followed
    except errors.DltError:
        return None  # not a manifest this build loads
    files = [str(f["file"]) for f in manifest["files"]]
    return (manifest["save_id"], data) if _all_there(fs, root, files) else None


def _newest_whole(
    fs: fsspec.AbstractFileSystem, root: str, newer_than: str, own: bytes | None
) -> tuple[str, bytes] | None:
    """(save id, bytes) of the newest of the manifest copies at `root` and
    `own` whose save is newer than `newer_than` and whole; None when none
    is."""
    candidates: list[tuple[str, str, bytes | None]] = [
        (m.group("save_id"), name, None)
        for name in _names(fs, root)
        if (m := _OWN_COPY.match(name)) is not None and m.group("tmp") is None
    ]
    if own is not None:
        candidates.append((str(json.loads(own)["save_id"]), MANIFEST, own))
    for save_id, name, data in sorted(candidates, key=lambda c: c[0], reverse=True):
        if save_id <= newer_than:
            break
        whole = _whole(fs, root, name, data)
        if whole is not None and whole[0] == save_id:
            return whole
    return None


def _all_there(fs: fsspec.AbstractFileSystem, root: str, files: Iterable[str]) -> bool:
    """Whether every one of `files` is at `root` (asked one by one)."""
    return all(exists(fs, f"{root}/{name}") for name in files)


def exists(fs: fsspec.AbstractFileSystem, target: str) -> bool:
    """Whether file `target` exists, asked within its deadline. Unlike
    fsspec's `exists`, a store that fails to answer raises (OSError;
    UnavailableError past its deadline) rather than reading as "not
    there"."""
    try:
        within_deadline(fs, lambda **o: fs.info(target, **o), "looking up", target)
    except FileNotFoundError:
        return False
    return True


def _names(fs: fsspec.AbstractFileSystem, root: str) -> set[str]:
    """The names in directory `root` (listed within its deadline)."""
    listed = within_deadline(fs, lambda **o: fs.ls(root, detail=False, **o), "listing", root)
    return {str(e).rstrip("/").rsplit("/", 1)[-1] for e in listed}


def _remove_quietly(fs: fsspec.AbstractFileSystem, target: str) -> None:
    with contextlib.suppress(OSError):  # gone already, the store refused or timed out
        within_deadline(fs, lambda **o: fs.rm(target, **o), "removing", target)


def committed_save_id(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """The save id of the manifest committed at `root`; "" when none (or
    one this build cannot read: the save replaces it). A store that fails
    to answer raises the DltError `errors.error_for_storage` gives
    (UNAVAILABLE when it cannot be reached or timed out): before, it read
    as "nothing committed", and a save checking for a newer one went on."""
    target = f"{root}/{MANIFEST}"
    try:
        data = _read_manifest_bytes(fs, target)
    except errors.FailedPreconditionError:
        return ""  # not a regular file, or too large: the save replaces it
    except errors.DltError:
        raise  # the store did not answer within its deadline
    except Exception as e:
        if not errors.is_storage_error(e):
            raise
        if isinstance(e, OSError) and e.errno == errno.ELOOP:
            return ""  # a link at its name: never followed, the save replaces it
        error = errors.error_for_storage(e, f"cannot read {url_of(fs, target)}")
        if isinstance(error, errors.NotFoundError):
            return ""
        raise error from e
    try:
        save_id = json.loads(data).get("save_id", "")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return ""
    return save_id if isinstance(save_id, str) else ""


def remove_superseded(
    fs: fsspec.AbstractFileSystem,
    root: str,
    own: re.Pattern[str] | tuple[re.Pattern[str], ...],
    save_id: str,
    keep: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Removes files that earlier saves to `root` wrote (the previous
    checkpoint's, and those of saves that never committed): names that
    `own` (a pattern, or any of several) matches, with a save id (its
    "save_id" group; none: older than any) older than `save_id`, except
    `keep`; and the temporary files (a "tmp" group) of `save_id` itself,
    which committed without them (a shard process killed while it wrote,
    its part written again by the copy that took over). Anything else in
    the directory, and files of a newer save still in progress, stay."""
    patterns = own if isinstance(own, tuple) else (own,)
    for name in _names(fs, root):
        match = next((m for p in patterns if (m := p.match(name)) is not None), None)
        if match is None or name in keep:
            continue
        of = match.group("save_id") or ""
        if of > save_id or (of == save_id and not match.groupdict().get("tmp")):
            continue
        _remove_quietly(fs, f"{root}/{name}")


# The largest MANIFEST.json a load reads (a million-file checkpoint's is
# far below it).
MAX_MANIFEST_BYTES = 256 << 20


def open_regular(path: str) -> tuple[IO[bytes], int]:
    """Opens local file `path` to read, never through a link (OSError
    ELOOP), and only a regular file (a FIFO or a device would block or
    never end): FailedPreconditionError otherwise. Returns the file and its
    size."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise errors.FailedPreconditionError(f"{path} is not a regular file; not read")
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _read_manifest_bytes(fs: fsspec.AbstractFileSystem, target: str) -> bytes:
    """MANIFEST.json's bytes: on a local disk a regular file only, never
    through a link (nor a FIFO or a device); at most MAX_MANIFEST_BYTES; on
    an object store within deadlines (`read_file`)."""
    if not is_local(fs):
        return read_file(fs, target, MAX_MANIFEST_BYTES)
    f, _ = open_regular(target)
    with f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise errors.FailedPreconditionError(f"{target} is larger than {MAX_MANIFEST_BYTES} bytes")
    return bytes(data)


def read_manifest(path: str, source: str = "") -> dict[str, Any]:
    """Reads and checks MANIFEST.json; NOT_FOUND when `path` holds none.
    `source`: where to read `path` through (a directory held open:
    `paths.CheckpointRoots.confined`); errors name `path`."""
    fs, root = filesystem(source or path)
    try:
        data = _read_manifest_bytes(fs, f"{root}/{MANIFEST}")
    except FileNotFoundError:
        raise errors.NotFoundError(
            f"no committed checkpoint at {path!r}: {MANIFEST} is missing"
            + _model_save_hint(fs, root, path)
        ) from None
    except OSError as e:  # a link (ELOOP), a name too long, no permission
        raise errors.error_for_storage(e, f"cannot read {path}/{MANIFEST}") from None
    return _parse_manifest(data, path)


def _model_save_hint(fs: fsspec.AbstractFileSystem, root: str, path: str) -> str:
    """Where the tables are when `path` is a model's save (tf_dlt.save,
    tf_dlt.ModelCheckpoint), whose tables are a checkpoint in its `tables/`."""
    try:
        held = f"{root}/tables/{MANIFEST}"
        if within_deadline(fs, lambda **o: fs.isfile(held, **o), "looking up", held):
            return f" (it holds a model's save: its tables are the checkpoint at {path}/tables)"
    except Exception:  # noqa: BLE001 - only a hint: the NotFoundError is what counts
        pass
    return ""


def _parse_manifest(data: bytes, path: str) -> dict[str, Any]:
    """Checks manifest `data` as a load would use it: FailedPreconditionError
    naming `path`'s MANIFEST.json when it is not one this build reads."""
    try:
        manifest: dict[str, Any] = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.FailedPreconditionError(f"{path}/{MANIFEST} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict):
        raise errors.FailedPreconditionError(f"{path}/{MANIFEST} is not a JSON object")
    if manifest.get("format") != FORMAT or manifest.get("format_version") not in READABLE_VERSIONS:
        raise errors.FailedPreconditionError(
            f"{path}/{MANIFEST} is not a {FORMAT} manifest of a version this build reads "
            f"({', '.join(f'v{v}' for v in READABLE_VERSIONS)})"
        )
    if manifest.get("num_buckets") != NUM_BUCKETS:
        raise errors.FailedPreconditionError(
            f"checkpoint routes over {manifest.get('num_buckets')} buckets, this build over "
            f"{NUM_BUCKETS}"
        )
    _check_files(manifest, path)
    return manifest


_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# A committed shard file's name (any save id `save_tables` accepts): never a path.
_SHARD_FILE = re.compile(r"^shard-\d{5}-of-\d{5}\.[A-Za-z0-9_-]+\.h5$")
# Block sizes a manifest may name (a save writes BLOCK_BYTES).
# Blocks a manifest may name: at most what saves write (verified.BLOCK_BYTES,
# 16 MiB since block hashes began), as a load keeps several in memory; up to
# 1 GiB was taken, and a sparse file of a few KB with 1 GiB blocks made a
# load hold 3 GB past the shard's memory budget.
MIN_BLOCK_BYTES, MAX_BLOCK_BYTES = 4096, 16 << 20


def _one_from_each_shard(parts: list[dict[str, Any]], num_shards: object) -> bool:
    """Whether `parts` (a save's parts or a manifest's file entries, each
    with shard_index, first_bucket and end_bucket) are one from each of
    `num_shards` shards whose bucket ranges, in shard order, hold each of
    the NUM_BUCKETS buckets once."""
    parts = sorted(parts, key=lambda p: int(p["shard_index"]))
    ranges = [(int(p["first_bucket"]), int(p["end_bucket"])) for p in parts]
    return (
        not isinstance(num_shards, bool)
        and isinstance(num_shards, int)
        # (a count before the range: range(10**20) raised OverflowError)
        and num_shards == len(parts)
        and [int(p["shard_index"]) for p in parts] == list(range(len(parts)))
        and bool(ranges)
        and ranges[0][0] == 0
        and ranges[-1][1] == NUM_BUCKETS
        and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        and all(first <= end for first, end in ranges)
    )


def _check_files(manifest: dict[str, Any], path: str) -> None:
    """Refuses a manifest whose file entries a load could not use safely: a
    name that is not a shard file of this directory (no paths), checksums
    that are not SHA-256 hex digests, sizes or bucket ranges out of range."""

    def bad(why: str) -> errors.FailedPreconditionError:
        return errors.FailedPreconditionError(f"{path}/{MANIFEST} is malformed: {why}")

    if not isinstance(manifest.get("save_id"), str) or not manifest["save_id"]:
        raise bad("it has no save_id")
    if manifest.get("kind", "full") not in ("full", "delta"):
        raise bad(f"kind {manifest.get('kind')!r} is neither 'full' nor 'delta'")
    created = manifest.get("created_unix", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise bad("created_unix is not a number")
    files = manifest.get("files")
    tables = manifest.get("tables")
    if not isinstance(files, list) or not isinstance(tables, list):
        raise bad("it lists no files or tables")
    for entry in files:
        if not isinstance(entry, dict):
            raise bad("a file entry is not an object")
        name = entry.get("file")
        if not isinstance(name, str) or _SHARD_FILE.match(name) is None:
            raise bad(f"file {name!r} is not a shard file name")
        ints: dict[str, int] = {}
        for key in ("bytes", "first_bucket", "end_bucket", "shard_index"):
            value = entry.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(f"{name}: {key} must be an integer >= 0, got {value!r}")
            ints[key] = value
        if not ints["first_bucket"] < ints["end_bucket"] <= NUM_BUCKETS:
            raise bad(f"{name}: bucket range [{ints['first_bucket']}, {ints['end_bucket']})")
        if not isinstance(entry.get("sha256"), str) or not _HEX64.match(entry["sha256"]):
            raise bad(f"{name}: sha256 is not a SHA-256 hex digest")
        if "block_sha256" in entry:
            block, digests = entry.get("block_bytes"), entry["block_sha256"]
            if (
                isinstance(block, bool)
                or not isinstance(block, int)
                or not (MIN_BLOCK_BYTES <= block <= MAX_BLOCK_BYTES)
            ):
                raise bad(
                    f"{name}: block_bytes {block!r} is outside [{MIN_BLOCK_BYTES}, "
                    f"{MAX_BLOCK_BYTES}] (16 MiB, the blocks saves write)"
                )
            if (
                not isinstance(digests, list)
                or len(digests) != -(-ints["bytes"] // block)
                or not all(isinstance(d, str) and _HEX64.match(d) for d in digests)
            ):
                raise bad(f"{name}: block_sha256 does not hold one SHA-256 per block")
        meta = entry.get("meta_block_bytes", 0)
        if isinstance(meta, bool) or not isinstance(meta, int) or not 0 <= meta <= MAX_BLOCK_BYTES:
            raise bad(f"{name}: meta_block_bytes {meta!r} is outside [0, {MAX_BLOCK_BYTES}]")
    # One file from each shard, their buckets every bucket once: a manifest
    # that left a file out loaded the others' rows alone, and the cluster
    # lost the rest of its table without a word.
    num_shards = manifest.get("num_shards")
    if not _one_from_each_shard(files, num_shards):
        raise bad(
            f"its files ({len(files)} for num_shards {num_shards!r}) are not one from each shard "
            f"covering the {NUM_BUCKETS} buckets once"
        )
    for info in tables:
        if not isinstance(info, dict) or not isinstance(info.get("config"), dict):
            raise bad("a table entry has no config")
        for key in ("rows", "removed"):
            count = info.get(key, 0)
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise bad(f"a table's {key} must be an integer >= 0, got {count!r}")
        # A config a load would make a table of (a hand-edited "dim": "x"
        # came out of a load, a compaction or a shard as ValueError).
        try:
            TableConfig.from_dict(info["config"]).validate()
        except (errors.DltError, ValueError, TypeError, KeyError, AttributeError) as e:
            name = info["config"].get("name")
            raise bad(f"table {name!r} has a config no table can have ({e})") from None


# A chain longer than this is refused (a cycle, or a chain that should have
# been compacted long ago).
MAX_CHAIN = 10000


@dataclasses.dataclass(frozen=True)
class Link:
    """One checkpoint of a chain: where it is and its manifest."""

    path: str
    manifest: dict[str, Any]
    # Tables of the checkpoint a load leaves out (`only`).
    skipped: frozenset[str] = frozenset()
    # Where its files are read through, if not `path` (a directory held
    # open: `paths.CheckpointRoots.confined`).
    source: str = ""

    @property
    def files_at(self) -> str:
        return self.source or self.path

    def only(self, names: set[str]) -> Link:
        """This link with only the tables named in `names` (a model's)."""
        kept = [t for t in self.manifest["tables"] if t["config"]["name"] in names]
        left_out = {t["config"]["name"] for t in self.manifest["tables"]} - names
        return dataclasses.replace(
            self, manifest={**self.manifest, "tables": kept}, skipped=frozenset(left_out)
        )

    @property
    def save_id(self) -> str:
        return str(self.manifest["save_id"])

    @property
    def kind(self) -> str:
        return str(self.manifest.get("kind", "full"))


def resolve_chain(path: str, allow: Callable[[str], str | None] | None = None) -> list[Link]:
    """The checkpoints a load of `path` reads, oldest first: the full base,
    then every delta up to `path`. Each link's manifest is read and checked,
    and each delta's parent must be the very save it was taken on top of;
    a broken link is refused (FailedPreconditionError) naming it. `allow`
    raises for a path of the chain the caller may not read (checkpoint
    roots), and may return where to read it through (`Link.source`)."""
    links: list[Link] = []
    seen: set[tuple[str, str]] = set()
    current, expected = path, ""
    while True:
        if (location_key(current), expected) in seen:
            raise errors.FailedPreconditionError(
                f"checkpoint chain of {path!r} is a cycle through {current!r}"
            )
        seen.add((location_key(current), expected))
        try:
            source = (allow(current) if allow is not None else None) or ""
            manifest = read_manifest(current, source)
        except errors.NotFoundError:
            if not links:
                raise
            raise errors.FailedPreconditionError(
                f"broken checkpoint chain: {links[-1].path!r} is a delta on top of save "
                f"{expected} at {current!r}, which holds no committed checkpoint; load a "
                "checkpoint before it, or restore the missing one"
            ) from None
        if links and manifest["save_id"] != expected:
            raise errors.FailedPreconditionError(
                f"broken checkpoint chain: {links[-1].path!r} is a delta on top of save "
                f"{expected} at {current!r}, which now holds save {manifest['save_id']}"
            )
        links.append(Link(current, manifest, source=source))
        if links[-1].kind == "full":
            return links[::-1]
        parent = manifest.get("parent")
        if not isinstance(parent, dict) or not parent.get("path") or not parent.get("save_id"):
            raise errors.FailedPreconditionError(
                f"{current}/{MANIFEST} is a delta that names no parent checkpoint"
            )
        if len(links) >= MAX_CHAIN:
            raise errors.FailedPreconditionError(
                f"checkpoint chain of {path!r} is longer than {MAX_CHAIN} links (a cycle?)"
            )
        expected = str(parent["save_id"])
        current = resolve_parent(current, str(parent["path"]))


def location_key(path: str) -> str:
    """A checkpoint's location in one normal form, to compare two paths
    (local ones with symbolic links resolved: a link to a checkpoint is that
    checkpoint, and a compact through one overwrote its source's base)."""
    fs, root = filesystem(path)
    return os.path.realpath(root) if is_local(fs) else root


# A model checkpoint's table checkpoint, in its directory.
TABLES_DIR = "tables"


def nested(a: str, b: str, models: bool = False) -> bool:
    """Whether one of two checkpoint locations (`location_key` forms) lies
    inside the other: listings and prunes of a directory would mix them.
    `models`: both are model checkpoints' `tables/`, and the model
    checkpoints' directories are compared too (a table checkpoint may be
    named `tables` itself: its siblings are no model's)."""

    def places(key: str) -> list[str]:
        suffix = "/" + TABLES_DIR
        return [key, key[: -len(suffix)]] if models and key.endswith(suffix) else [key]

    return any(
        x.startswith(y.rstrip("/") + "/") or y.startswith(x.rstrip("/") + "/")
        for x in places(a)
        for y in places(b)
    )


def chain_holds(links: list[Link], path: str) -> bool:
    """Whether a chain (resolve_chain's `links`) reads the checkpoint at
    `path` (so saving into `path` would break it)."""
    here = location_key(path)
    return any(location_key(link.path) == here for link in links)


def delta_parent(path: str, base: str, models: bool = False) -> dict[str, Any]:
    """The parent record of a delta to be saved at `path` on top of `base`
    (write_manifest's `parent`, with the names of the tables `base` holds);
    refuses a `path` that `base`'s chain reads, which the save would
    overwrite, or one nested in one of its checkpoints or holding one
    (`models`: model checkpoints' `tables/`, see `nested`)."""
    links = resolve_chain(base)
    here = location_key(path)
    for link in links:
        there = location_key(link.path)
        if there == here:
            raise errors.InvalidArgumentError(
                f"a delta at {path!r} would overwrite {link.path!r}, which its base {base!r} "
                "needs: save a delta into a directory of its own"
            )
        if nested(here, there, models):
            raise errors.InvalidArgumentError(
                f"a delta at {path!r} lies inside, or holds, {link.path!r}, which its base "
                f"{base!r} needs: listings and prunes of the directory would mix them up (a "
                "prune of one deletes the other); save it into a directory beside it"
            )
    head = links[-1].manifest
    return {
        "path": base,
        "save_id": head["save_id"],
        "chain_length": head.get("chain_length", 1),
        "tables": sorted(t["config"]["name"] for t in head["tables"]),
    }
