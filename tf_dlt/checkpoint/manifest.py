"""The checkpoint manifest: MANIFEST.json, written last, commits a checkpoint.

Shared by the shards (which read it on Load) and the client (which writes it
after every shard saved its part). No h5py here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import time
from typing import Any

import fsspec

from tf_dlt import errors
from tf_dlt.routing import NUM_BUCKETS

MANIFEST = "MANIFEST.json"
FORMAT = "tf_dlt-checkpoint"
FORMAT_VERSION = 1


# Files a save writes: shard-<i>-of-<n>.<save id>.h5, and .tmp-<pid> while
# it is written; save ids are "<UTC date>T<time><microseconds>-<8 hex
# digits>" (new_save_id; ids of earlier versions lack the microseconds).
_OWN_FILE = re.compile(
    r"^shard-\d{5}-of-\d{5}\.(?P<save_id>\d{8}T\d{6}(\d{6})?-[0-9a-f]{8})\.h5(\.tmp-\d+)?$"
)


def new_save_id() -> str:
    """A save id: sorts by time (UTC, to the microsecond), unique by its
    random tail."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1e6):06d}"
    return f"{stamp}-{secrets.token_hex(4)}"


def shard_file_name(shard_index: int, num_shards: int, save_id: str) -> str:
    return f"shard-{shard_index:05d}-of-{num_shards:05d}.{save_id}.h5"


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of `path` and the path within it."""
    fs, root = fsspec.core.url_to_fs(path)
    return fs, root.rstrip("/")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocols


def write_manifest(path: str, parts: list[dict[str, Any]], save_id: str) -> dict[str, Any]:
    """Commits a checkpoint: writes MANIFEST.json atomically, then removes
    files of earlier saves at `path` that the new manifest does not name."""
    parts = sorted(parts, key=lambda p: p["shard_index"])
    num_shards = parts[0]["num_shards"] if parts else 0
    if [p["shard_index"] for p in parts] != list(range(num_shards)):
        raise errors.InvalidArgumentError("a checkpoint needs one part from every shard")
    tables: dict[str, dict[str, Any]] = {}
    for part in parts:
        for info in part["tables"]:
            config = info["config"]
            known = tables.setdefault(config["name"], {"config": config, "rows": 0})
            if known["config"] != config:
                raise errors.FailedPreconditionError(
                    f"table {config['name']!r} differs between shards: "
                    f"{known['config']} vs {config}"
                )
            known["rows"] += info["rows"]
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "save_id": save_id,
        "created_unix": time.time(),
        "num_shards": num_shards,
        "num_buckets": NUM_BUCKETS,
        "tables": [tables[name] for name in sorted(tables)],
        "files": [
            {
                k: p[k]
                for k in ("file", "sha256", "bytes", "shard_index", "first_bucket", "end_bucket")
            }
            for p in parts
        ],
    }
    fs, root = filesystem(path)
    for part in parts:  # a concurrent save to the same path may have removed them
        if not fs.exists(f"{root}/{part['file']}"):
            raise errors.FailedPreconditionError(
                f"{part['file']} is gone from {path} before its manifest was written (another "
                "save to the same path removed it?); the checkpoint there is unchanged"
            )
    data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    if is_local(fs):
        tmp = f"{root}/{MANIFEST}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, f"{root}/{MANIFEST}")
    else:
        fs.pipe_file(f"{root}/{MANIFEST}", data)
    _remove_superseded(fs, root, {p["file"] for p in parts}, save_id)
    return manifest


def _remove_superseded(
    fs: fsspec.AbstractFileSystem, root: str, keep: set[str], save_id: str
) -> None:
    """Removes files that earlier saves to `root` wrote (the previous
    checkpoint's, and those of saves that never committed): tf_dlt's own
    file names only, with a save id older than `save_id`. Anything else in
    the directory, and files of a newer save still in progress, stay."""
    for entry in fs.ls(root, detail=False):
        name = str(entry).rstrip("/").rsplit("/", 1)[-1]
        match = _OWN_FILE.match(name)
        if match is None or name in keep or match.group("save_id") >= save_id:
            continue
        with contextlib.suppress(FileNotFoundError, OSError):
            fs.rm(f"{root}/{name}")


def read_manifest(path: str) -> dict[str, Any]:
    """Reads and checks MANIFEST.json; NOT_FOUND when `path` holds none."""
    fs, root = filesystem(path)
    try:
        with fs.open(f"{root}/{MANIFEST}", "rb") as f:
            manifest: dict[str, Any] = json.loads(f.read())
    except FileNotFoundError:
        raise errors.NotFoundError(
            f"no committed checkpoint at {path!r}: {MANIFEST} is missing"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.FailedPreconditionError(f"{path}/{MANIFEST} is not valid JSON: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise errors.FailedPreconditionError(
            f"{path}/{MANIFEST} is not a {FORMAT} v{FORMAT_VERSION} manifest"
        )
    if manifest.get("num_buckets") != NUM_BUCKETS:
        raise errors.FailedPreconditionError(
            f"checkpoint routes over {manifest.get('num_buckets')} buckets, this build over "
            f"{NUM_BUCKETS}"
        )
    return manifest
