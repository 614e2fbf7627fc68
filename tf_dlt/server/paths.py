"""Where a shard's Save and Load may go: the checkpoint roots it was started
with (`--checkpoint-root`). A client names a URL in each request; the shard
writes and reads only under its roots, so nobody who reaches the control
plane can make it write elsewhere, fetch arbitrary URLs or fill its memory.

With no roots, local paths and object stores are allowed (the shard logs a
warning); ``memory://`` and every other filesystem (http, ftp, ...) only when
a root names them.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence

import fsspec

from tf_dlt import errors

# Filesystems allowed when no root is given: local disks and object stores.
DEFAULT_PROTOCOLS = frozenset(
    {"file", "local", "s3", "s3a", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "az", "adl"}
)


def _split(url: str) -> tuple[str, str]:
    """(protocol, normalized path) of `url`; a plain path is "file". Refuses
    what the check would read otherwise than the filesystem does: chained
    URLs (fsspec opens the part before '::', which the check takes for a
    file name), empty segments of an object store's key ('//': the check
    would collapse them, the store keeps them) and a scheme not in
    lowercase (the check would take it, fsspec would not)."""
    if "::" in url:
        raise errors.PermissionDeniedError(f"checkpoint URL {url!r} chains filesystems ('::')")
    protocol, path = fsspec.core.split_protocol(url)
    if protocol is not None and protocol != protocol.lower():
        raise errors.InvalidArgumentError(
            f"checkpoint URL {url!r}: write its scheme in lowercase ({protocol.lower()}://)"
        )
    protocol = protocol or "file"
    if protocol in ("file", "local"):
        return "file", os.path.realpath(os.path.abspath(path))
    key = path.strip("/")
    segments = key.split("/") if key else []
    if ".." in segments or "." in segments:
        raise errors.PermissionDeniedError(f"checkpoint URL {url!r} holds '.' or '..' segments")
    if "" in segments:
        raise errors.PermissionDeniedError(f"checkpoint URL {url!r} holds an empty segment ('//')")
    return protocol, posixpath.normpath("/" + path).lstrip("/") if path else ""


class CheckpointRoots:
    """The checkpoint locations a shard accepts.

    Args:
        roots: URL or path prefixes (``/data/ckpt``, ``s3://bucket/run``,
            ``memory://``); empty: any local path or object-store URL.
    """

    def __init__(self, roots: Sequence[str] = ()) -> None:
        self.roots = list(roots)
        self._prefixes = [_split(root) for root in roots]

    def check(self, url: str, action: str) -> None:
        """Raises PermissionDeniedError unless `action` ("Save", "Load") may
        use `url`."""
        protocol, path = _split(url)
        if not self._prefixes:
            if protocol not in DEFAULT_PROTOCOLS:
                stores = ", ".join(sorted(DEFAULT_PROTOCOLS - {"file", "local"}))
                raise errors.PermissionDeniedError(
                    f"{action} to {url!r}: {protocol}:// needs a --checkpoint-root naming it "
                    f"(without roots: local paths and {stores})"
                )
            return
        for root_protocol, root in self._prefixes:
            if protocol != root_protocol:
                continue
            if not root or path == root or path.startswith(root.rstrip("/") + "/"):
                return
        raise errors.PermissionDeniedError(
            f"{action} to {url!r} is outside this shard's checkpoint roots {self.roots}"
        )
