"""Where a shard's Save and Load may go: the checkpoint roots it was started
with (`--checkpoint-root`). A client names a URL in each request; the shard
writes and reads only under its roots, so nobody who reaches the control
plane can make it write elsewhere, fetch arbitrary URLs or fill its memory.

With no roots, local paths and object stores are allowed (the shard logs a
warning), and HDFS without a host in the URL (``hdfs:///path``: the
configured namenode); ``memory://``, a URL naming an HDFS host and every other
filesystem (http, ftp, ...) only when a root names them.

A local path is checked as its real path (links resolved). So that a link
swapped in after the check (a directory of the path replaced by a link out
of the roots, by someone who may write under them) cannot redirect the
request, a shard with roots reads and writes a local checkpoint through its
directory held open (`confined`): opened from ``/`` one component at a time,
never through a link, and named ``/proc/self/fd/N`` from then on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
import urllib.parse
from collections.abc import Callable, Iterator, Sequence

import fsspec

from tf_dlt import errors

# Filesystems allowed when no root is given: local disks and object stores.
DEFAULT_PROTOCOLS = frozenset(
    {"file", "local", "s3", "s3a", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "az", "adl"}
)
# Of those, the ones whose URL may name the host and port to connect to
# (hdfs://namenode:8020/...): allowed without a root only without one (the
# cluster's configured namenode), else a caller could make the shard connect
# anywhere, as http:// would.
_HOST_NAMING_PROTOCOLS = frozenset({"hdfs", "viewfs"})
# The longest path a Save or Load may name (Linux's PATH_MAX), and the most
# directories deep: a path of 2,000 levels was made, one mkdir a level, and
# broke ordinary tools (a recursive delete) on what it left.
MAX_PATH_BYTES = 4096
MAX_PATH_DEPTH = 64


def _split(url: str) -> tuple[str, str]:
    """(protocol, normalized path) of `url`; a plain path is "file". Refuses
    what the check would read otherwise than the filesystem does: chained
    URLs (fsspec opens the part before '::', which the check takes for a
    file name), empty segments of an object store's key ('//': the check
    would collapse them, the store keeps them) and a scheme not in
    lowercase (the check would take it, fsspec would not)."""
    if "\x00" in url:
        raise errors.InvalidArgumentError(f"checkpoint URL {url!r} holds a NUL byte")
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


def _place(url: str) -> tuple[str, str, str]:
    """(protocol, host, path) of `url` as `_split` reads it; the host (the
    URL's authority, lowercase) of a protocol whose URL names where to
    connect (hdfs://namenode:8020/...), else ""."""
    protocol, path = _split(url)
    if protocol not in _HOST_NAMING_PROTOCOLS:
        return protocol, "", path
    parts = urllib.parse.urlsplit(url)
    return protocol, parts.netloc.lower(), parts.path.strip("/")


class CheckpointRoots:
    """The checkpoint locations a shard accepts.

    Args:
        roots: URL or path prefixes (``/data/ckpt``, ``s3://bucket/run``,
            ``memory://``); empty: any local path or object-store URL.
    """

    def __init__(self, roots: Sequence[str] = ()) -> None:
        self.roots = list(roots)
        self._prefixes = [_place(root) for root in roots]

    def check(self, url: str, action: str) -> None:
        """Raises PermissionDeniedError unless `action` ("Save", "Load") may
        use `url`."""
        preposition = "to" if action == "Save" else "of"
        if len(url.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
            raise errors.InvalidArgumentError(
                f"{action} {preposition} a path of {len(url.encode('utf-8', 'surrogatepass'))} "
                f"bytes: at most {MAX_PATH_BYTES}"
            )
        protocol, host, path = _place(url)
        depth = sum(1 for part in path.split("/") if part)
        if depth > MAX_PATH_DEPTH:
            raise errors.InvalidArgumentError(
                f"{action} {preposition} {url[:200]!r}...: {depth} directories deep, at most "
                f"{MAX_PATH_DEPTH}"
            )
        if not self._prefixes:
            if protocol not in DEFAULT_PROTOCOLS:
                stores = ", ".join(sorted(DEFAULT_PROTOCOLS - {"file", "local"}))
                raise errors.PermissionDeniedError(
                    f"{action} {preposition} {url!r}: {protocol}:// needs a --checkpoint-root "
                    f"naming it (without roots: local paths and {stores})"
                )
            if host:
                raise errors.PermissionDeniedError(
                    f"{action} {preposition} {url!r}: an HDFS URL that names its host needs a "
                    f"--checkpoint-root naming that host (without roots: {protocol}:///path, "
                    "on the configured NameNode)"
                )
            return
        for root_protocol, root_host, root in self._prefixes:
            # An HDFS root's host is matched whole: "hdfs:///ctr" is no
            # root of hdfs://ctr/..., nor "hdfs:///" of any named host.
            if protocol != root_protocol or host != root_host:
                continue
            if not root or path == root or path.startswith(root.rstrip("/") + "/"):
                return
        raise errors.PermissionDeniedError(
            f"{action} {preposition} {url!r} is outside this shard's checkpoint roots {self.roots}"
        )

    def confined(
        self, url: str, action: str, held: contextlib.ExitStack, *, create: bool = False
    ) -> str:
        """`url` checked (`check`), and what to read or write it through:
        for a local path when this shard has roots, its directory held open
        in `held` (`hold_directory`; `create`: made where missing), as
        ``/proc/self/fd/N``; else `url` itself."""
        self.check(url, action)
        protocol, path = _split(url)
        if not self._prefixes or protocol != "file":
            return url
        fd = hold_directory(path, url, action, create)
        held.callback(os.close, fd)
        return f"/proc/self/fd/{fd}"

    @contextlib.contextmanager
    def holding(self, action: str, *, create: bool = False) -> Iterator[Callable[[str], str]]:
        """A function that takes each path `action` uses (a save's
        directory, each checkpoint of a chain a load reads) to what to use
        it through (`confined`). The directories it holds are closed when
        the block ends, and a tf_dlt error raised in the block names the
        paths as given, not as held (``/proc/self/fd/N``)."""
        given: dict[str, str] = {}

        def confine(url: str) -> str:
            where = self.confined(url, action, held, create=create)
            if where != url:
                given[where] = url
            return where

        with contextlib.ExitStack() as held:
            try:
                yield confine
            except errors.DltError as e:
                message = e.message
                for where, url in sorted(given.items(), key=lambda p: -len(p[0])):
                    message = message.replace(where, url)
                if message == e.message:
                    raise
                raise type(e)(message) from e


def hold_directory(path: str, url: str, action: str, create: bool) -> int:
    """A descriptor (O_PATH) of local directory `path` (absolute, as the
    roots check resolved it), opened from ``/`` one component at a time
    without following links: a component that is a link now (swapped in
    since the check) or not a directory is refused. `create`: a missing
    component is made (mode 0777 less the umask)."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    walked = ""

    def opened(name: str) -> int:
        """`name` in `fd` opened as a directory, never through a link."""
        try:
            return os.open(
                name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise errors.PermissionDeniedError(
                    f"{action} of {url!r}: {walked} is a link (swapped in after the check of "
                    "the checkpoint roots?); links are not followed there"
                ) from None
            raise errors.InvalidArgumentError(
                f"{action} of {url!r}: {walked} is a file, not a directory (a checkpoint "
                "is a directory)"
            ) from None

    try:
        for name in [part for part in path.split("/") if part]:
            walked += "/" + name
            try:
                child = opened(name)
            except FileNotFoundError:
                if not create:
                    raise errors.NotFoundError(
                        f"no committed checkpoint at {url!r}: its directory is missing"
                    ) from None
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o777, dir_fd=fd)
                child = opened(name)  # (a link or file made meanwhile: refused as above)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise
