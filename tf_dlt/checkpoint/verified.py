"""Reading a shard file so that what is parsed is what was verified.

A save records each 16 MiB block's SHA-256 besides the whole file's; a load
hashes blocks ahead on worker threads and hands HDF5, or the rows themselves
(`RawRows`), only bytes of verified blocks.
Files of earlier versions (one whole-file SHA-256) are hashed as they are
copied into a private spool and parsed from it.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, cast

import fsspec
import h5py
import numpy as np

from tf_dlt import errors
from tf_dlt.checkpoint.manifest import (
    MAX_BLOCK_BYTES,
    has_deadlines,
    is_local,
    open_regular,
    within_deadline,
)

_HASH_BLOCK = 8 << 20
# Files are hashed in blocks of this size: the manifest lists each block's
# SHA-256, so a load verifies every block as it parses it, in parallel.
BLOCK_BYTES = MAX_BLOCK_BYTES
# Verified blocks a load keeps, and reads ahead (on two threads, so two
# blocks hash at once while the rows of a third are inserted). A file whose
# HDF5 metadata lies in blocks of its own (the manifest's meta_block_bytes;
# every file saved since) is read in file order, so a few blocks suffice; in an older
# file each dataset's chunk index is spread through the file, and the walk
# of each index re-reads blocks the cache let go. A save writes a chunk of
# rows dataset after dataset, so the rows a load reads at once may lie in
# two neighbouring blocks: the cache keeps the block before the one in use
# and those read ahead of it. native/core/shard.cc's Shard::kPersistReserve
# holds a lean load's bytes: on a shard with a memory budget, 3 blocks (two
# in use, one read ahead) whatever the layout.
_CACHED_BLOCKS = 6
_READ_AHEAD = 3
_SPREAD_CACHED_BLOCKS = 16
_SPREAD_READ_AHEAD = 2
_LEAN_CACHED_BLOCKS = 3
# The most blocks a load keeps for a file whose datasets' chunks of the same
# rows lie far apart (files saved with HDF5's chunk cache on, before
# 2026-11-26): three per place read in turn (measured: fewer re-read blocks
# as the streams pass each other), at most this many.
_MAX_STREAM_BLOCKS = 12
# And on a shard with a memory budget (96 MiB: Shard::kPersistReserve holds
# them and two staged chunks of 8 MiB).
_MAX_LEAN_STREAM_BLOCKS = 6
# Shard files up to this size are verified and parsed in memory.
_SPOOL_IN_MEMORY = 256 << 20


def file_digests(f: IO[bytes]) -> tuple[str, list[str]]:
    """(SHA-256 of the whole file, SHA-256 of each BLOCK_BYTES block) from
    one read; the whole-file hash runs on a second thread."""
    whole = hashlib.sha256()
    blocks = []
    with ThreadPoolExecutor(1, thread_name_prefix="dlt-hash") as pool:
        pending: Future[None] | None = None
        while block := f.read(BLOCK_BYTES):
            if pending is not None:
                pending.result()
            pending = pool.submit(whole.update, block)
            blocks.append(hashlib.sha256(block).hexdigest())
        if pending is not None:
            pending.result()
    return whole.hexdigest(), blocks


def _check_block(where: str, k: int, offset: int, data: bytes, digest: str) -> None:
    """Refuses block `k` of a file (at `offset`) unless its SHA-256 is the
    manifest's `digest`. The message never carries the digest of what was
    read: with a manifest choosing the block size, that would reveal a
    file's bytes one load at a time."""
    if hashlib.sha256(data).hexdigest() != digest:
        raise errors.FailedPreconditionError(
            f"checkpoint file {where} is corrupt: SHA-256 of block {k} ({offset} bytes in) "
            "differs from the manifest's"
        )


def stored_bytes(fs: fsspec.AbstractFileSystem, targets: list[str]) -> list[int]:
    """The size of each shard file of `targets`, to size a load's tables by
    before any file is read (never to check one: the open does); 0 where it
    cannot be found or the store does not say (tables then grow as rows
    come). A manifest's own
    `bytes` and `rows` said what to size for, and a 1 KB manifest made a
    shard reserve gigabytes before its file was seen. (Its blocks on disk
    would undercount: saves leave holes, and a sparse copy of a table of
    zeros stores a tenth of its size.)"""

    def one(target: str) -> int:
        try:
            if is_local(fs):
                return os.stat(target).st_size  # (a link is refused when it is opened)
            size = within_deadline(fs, lambda **o: fs.size(target, **o), "looking up", target)
            return int(size or 0)
        except (OSError, ValueError, TypeError):  # FileNotFoundError, UnavailableError among them
            return 0

    if is_local(fs) or len(targets) < 2:
        return [one(t) for t in targets]
    with ThreadPoolExecutor(min(16, len(targets))) as pool:  # a request a file
        return list(pool.map(one, targets))


def open_shard_file(fs: fsspec.AbstractFileSystem, target: str, entry: dict[str, Any]) -> IO[bytes]:
    """Opens shard file `target` (of manifest entry `entry`) to read. On a
    local disk only a regular file of the manifest's size is opened, and
    never through a link: a link planted among the files (to a file outside
    the checkpoint roots, say), a FIFO or a device is refused before a byte
    is read."""
    missing = errors.FailedPreconditionError(
        f"checkpoint file {target} named in the manifest is missing"
    )
    if has_deadlines(fs):  # an object store or HDFS: HEAD (file status) within its deadline
        try:
            info = within_deadline(fs, lambda **o: fs.info(target, **o), "looking up", target)
        except FileNotFoundError:
            raise missing from None
        stored = info.get("size")
        if isinstance(stored, int):
            if stored != int(entry["bytes"]):
                raise _other_size(target, stored, entry)
            return cast(IO[bytes], _RangedRemote(fs, target, stored))
    if not is_local(fs):
        try:
            remote: IO[bytes] = fs.open(target, "rb")
        except FileNotFoundError:
            raise missing from None
        # The store's size of it, where its file object knows one (bytes
        # appended after the blocks were read past unseen on S3 and HDFS).
        stored = getattr(remote, "size", None)
        if isinstance(stored, int) and stored != int(entry["bytes"]):
            remote.close()
            raise _other_size(target, stored, entry)
        return remote
    try:
        f, size = open_regular(target)
    except FileNotFoundError:
        raise missing from None
    except OSError as e:  # ELOOP: a link
        raise errors.FailedPreconditionError(
            f"checkpoint file {target} is not a regular file (a link?); not read ({e.strerror})"
        ) from None
    except errors.FailedPreconditionError:
        raise errors.FailedPreconditionError(
            f"checkpoint file {target} is not a regular file; not read"
        ) from None
    if size != int(entry["bytes"]):
        f.close()
        raise _other_size(target, size, entry)
    return f


def _other_size(target: str, size: int, entry: dict[str, Any]) -> errors.FailedPreconditionError:
    return errors.FailedPreconditionError(
        f"checkpoint file {target} holds {size} bytes, the manifest says {entry['bytes']}"
    )


def fetch_verified(
    fs: fsspec.AbstractFileSystem, root: str, entry: dict[str, Any], directory: str
) -> str:
    """Copies a shard file into `directory`, checking every block (or the
    whole file, for files of earlier versions) on the way; returns the copy's
    path. Nothing of a file that fails is used."""
    target = f"{root}/{entry['file']}"
    local = f"{directory}/{entry['file']}"
    if "block_sha256" not in entry:
        with open(local, "wb") as out:
            _copy_whole(fs, target, entry, out)
        return local
    block = int(entry["block_bytes"])
    with open_shard_file(fs, target, entry) as f, open(local, "wb") as out:
        for k, digest in enumerate(entry["block_sha256"]):
            data = f.read(block)
            _check_block(target, k, k * block, data, digest)
            out.write(data)
        if f.read(1):
            raise errors.FailedPreconditionError(
                f"checkpoint file {target} is longer than the manifest says"
            )
    return local


def _copy_whole(
    fs: fsspec.AbstractFileSystem, target: str, entry: dict[str, Any], out: IO[bytes]
) -> None:
    """Copies a file of an earlier version (one whole-file SHA-256) into
    `out`, hashing it on the way; refuses it unless it matches. Reads at
    most the manifest's size (and a byte to see the file is no longer)."""
    digest = hashlib.sha256()
    left = int(entry["bytes"])
    with open_shard_file(fs, target, entry) as f:
        while left > 0 and (block := f.read(min(_HASH_BLOCK, left))):
            digest.update(block)
            out.write(block)
            left -= len(block)
        if left or f.read(1):
            raise errors.FailedPreconditionError(
                f"checkpoint file {target} differs in size from the manifest's {entry['bytes']} "
                "bytes"
            )
    if digest.hexdigest() != entry["sha256"]:
        raise errors.FailedPreconditionError(
            f"checkpoint file {target} is corrupt: its SHA-256 differs from the manifest's"
        )


class _SizedFile(io.RawIOBase):
    """A read-only, seekable file of `size` bytes that keeps its own
    position; subclasses read from it (`readinto`)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self._pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


class _RangedRemote(_SizedFile):
    """A shard file on an object store (fsspec's asynchronous filesystems)
    or HDFS read by ranged GETs (on HDFS an open and a read of the range),
    each within a deadline of its size (`manifest.within_deadline`), else
    UnavailableError naming the file. botocore's read timeout bounds each
    socket read, not a request: a store that sent a byte now and then (a
    degraded link, a stalled proxy) held a shard's load, and every save and
    load of the shard after it, for as long as it went on, and the process
    past SIGTERM; hdfs-native has no deadline of its own. Each read has a
    file of its own: one left past its deadline shares nothing with the
    next."""

    def __init__(self, fs: fsspec.AbstractFileSystem, target: str, size: int) -> None:
        super().__init__(size)
        self._fs, self._target = fs, target

    def read(self, n: int | None = -1) -> bytes:
        left = max(0, self.size - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        if n == 0:
            return b""
        start, fs, target = self._pos, self._fs, self._target
        data = within_deadline(
            fs, lambda **o: fs.cat_file(target, start=start, end=start + n, **o),
            f"reading {n} bytes of", target, n,
        )  # fmt: skip
        self._pos += len(data)
        return bytes(data)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer)))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)


class VerifiedBlocks(_SizedFile):
    """A shard file read through blocks checked against the manifest's
    per-block SHA-256 before any byte of them is returned: what HDF5 parses
    is what was verified, even if the file changes meanwhile. Blocks are
    read and hashed ahead on worker threads while the caller parses."""

    def __init__(
        self, f: IO[bytes], entry: dict[str, Any], where: str, *, lean: bool = False
    ) -> None:
        super().__init__(int(entry["bytes"]))
        self._f = f
        self.where = where
        self._block = self.block_bytes = int(entry["block_bytes"])
        self._digests = list(entry["block_sha256"])  # checked by manifest.read_manifest
        clustered = int(entry.get("meta_block_bytes", 0)) > 0
        self._cached = _CACHED_BLOCKS if clustered else _SPREAD_CACHED_BLOCKS
        self._ahead = _READ_AHEAD if clustered else _SPREAD_READ_AHEAD
        self._lean = lean
        if lean:  # within a memory budget: fewer blocks, more reads
            self._cached, self._ahead = _LEAN_CACHED_BLOCKS, 1
        self.reads = 0  # blocks read and verified
        # Blocks a read waited for from the start, not read ahead of it.
        self.on_demand = 0
        self._io = threading.Lock()
        self._cache: collections.OrderedDict[int, Future[memoryview]] = collections.OrderedDict()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="dlt-verify")
        self.error: errors.DltError | None = None

    def hold_streams(self, streams: int) -> None:
        """Keeps enough blocks for `streams` places of the file read in
        turn (datasets whose chunks of the same rows lie apart) so none is
        read twice (within a cap, a lower one for a lean load). Such a file
        reads no block ahead: a stream stays in its block for many reads,
        and a block read ahead for it would be let go before its turn."""
        if streams > 1:
            self._ahead = 0
        most = _MAX_LEAN_STREAM_BLOCKS if self._lean else _MAX_STREAM_BLOCKS
        self._cached = max(self._cached, min(3 * streams, most))

    def _read_block(self, k: int) -> memoryview:
        offset = k * self._block
        want = min(self._block, self.size - offset)
        with self._io:
            self._f.seek(offset)
            data = self._f.read(want)
            self.reads += 1
        if len(data) != want:
            raise errors.FailedPreconditionError(
                f"checkpoint file {self.where} is shorter than the manifest's {self.size} bytes"
            )
        _check_block(self.where, k, offset, data, self._digests[k])
        return memoryview(data)

    def _get(self, k: int) -> memoryview:
        if k not in self._cache:
            self.on_demand += 1
        ahead = range(k, min(k + self._ahead + 1, len(self._digests)))
        for a in ahead:
            if a not in self._cache:
                self._cache[a] = self._pool.submit(self._read_block, a)
        self._cache.move_to_end(k)
        # The least recently used block goes, never one read ahead of k nor
        # the one before it (rows straddling two blocks read both in turn:
        # with 2 kept and 1 read ahead, a lean load re-read each block
        # about 14 times).
        keep = range(k - 1, ahead.stop)
        while len(self._cache) > self._cached:
            del self._cache[
                next((b for b in self._cache if b not in keep), next(iter(self._cache)))
            ]
        try:
            return self._cache[k].result()
        except errors.DltError as e:
            self.error = e
            raise

    def view(self, offset: int, size: int) -> memoryview:
        """Bytes [offset, offset + size) of the file, verified: a view of
        one block when they lie in one, else a copy."""
        if offset < 0 or offset + size > self.size:
            raise errors.FailedPreconditionError(
                f"{self.where}: a dataset chunk lies outside the file"
            )
        k, within = divmod(offset, self._block)
        if within + size <= self._block:
            return self._get(k)[within : within + size]
        out = bytearray(size)
        self.seek(offset)
        self.readinto(out)
        return memoryview(out)

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), self.size - self._pos))
        done = 0
        while done < n:
            k, within = divmod(self._pos + done, self._block)
            data = self._get(k)
            take = min(n - done, len(data) - within)
            out[done : done + take] = data[within : within + take]
            done += take
        self._pos += n
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._cache.clear()
        super().close()


class RawRows:
    """Reads rows of a table group's datasets straight from verified blocks
    (each HDF5 chunk located once, no HDF5 copy). `ok` is False unless every
    dataset is stored in unfiltered chunks of whole rows, the same rows for
    all; then the caller reads through HDF5 instead."""

    def __init__(self, g: h5py.Group, reader: VerifiedBlocks) -> None:
        self._reader = reader
        self._sets = {name: g[name] for name in ("ids", "values", "slots", "steps", "touched")
                      if name in g}  # fmt: skip
        sets = self._sets.values()
        self.ok = (
            all(
                ds.chunks is not None
                and ds.chunks[1:] == ds.shape[1:]
                and ds.id.get_create_plist().get_nfilters() == 0
                for ds in sets
            )
            and len({ds.chunks[0] for ds in sets}) == 1
        )
        self.chunk = next(iter(sets)).chunks[0] if self.ok else 0
        # (file offset of each chunk by first row, dtype, row shape, bytes
        # per row): the chunk index is walked once, not searched once per
        # chunk (each search may read index blocks the block cache let go).
        self._layout = {
            name: (
                self._chunk_offsets(ds) if self.ok else {},
                ds.dtype,
                ds.shape[1:],
                ds.dtype.itemsize * int(np.prod(ds.shape[1:])),
            )  # fmt: skip
            for name, ds in self._sets.items()
        }
        if self.ok:
            reader.hold_streams(self._streams())

    def _streams(self) -> int:
        """How many blocks apart the datasets' chunks of the same rows lie
        (the most over the table's chunks): 1 when they lie together."""
        block = self._reader.block_bytes
        most = 1
        for start in self._layout["ids"][0]:
            blocks = sorted({
                offsets[start] // block
                for offsets, _, _, _ in self._layout.values()
                if start in offsets
            })  # fmt: skip
            # Chunks in two neighbouring blocks (straddling a boundary) are
            # one place: a read in file order reads the blocks in turn.
            most = max(most, 1 if blocks[-1] - blocks[0] <= 1 else len(blocks))
        return most

    @staticmethod
    def _chunk_offsets(ds: h5py.Dataset) -> dict[int, int]:
        offsets: dict[int, int] = {}

        def visit(info: Any) -> None:
            if info.byte_offset is not None:
                offsets[int(info.chunk_offset[0])] = int(info.byte_offset)

        ds.id.chunk_iter(visit)
        return offsets

    def read(self, name: str, a: int, b: int) -> np.ndarray | None:
        """Rows [a, b) of dataset `name` (None if absent); [a, b) must lie
        within one chunk."""
        layout = self._layout.get(name)
        if layout is None:
            return None
        offsets, dtype, row_shape, row_bytes = layout
        start = a - a % self.chunk
        if start not in offsets:
            raise errors.FailedPreconditionError(
                f"{self._reader.where}: dataset {name} has no stored chunk at row {start}"
            )
        raw = self._reader.view(offsets[start] + (a - start) * row_bytes, (b - a) * row_bytes)
        return np.frombuffer(raw, dtype).reshape((b - a, *row_shape))


def check_structure(h5: h5py.File, where: str, size: int) -> None:
    """Refuses (FailedPreconditionError) a shard file whose reading would
    touch anything but its own verified bytes, or take more memory than it
    stores. A manifest's digests prove only that the file is the one whoever
    wrote the checkpoint meant, so a checkpoint directory written by someone
    else is checked before any dataset is read: every link a hard one (an
    external or soft link names another file or place), every dataset stored
    in this file (not in external files, which HDF5 opens by any path, a FIFO
    too, nor virtual), unfiltered (saves compress nothing: a compressed
    dataset of a few bytes may unpack to terabytes), and with at least the
    bytes it declares allocated (unwritten chunks read as fill values) and
    no more than the file's `size` (the manifest's byte count)."""

    def problem(name: str, link: Any) -> str | None:
        """Why link `name` is refused, or None. (A visit that raises leaves
        HDF5 mid-iteration: what it returns ends the visit instead.)"""
        if not isinstance(link, h5py.HardLink):
            return f"is a link to another place ({type(link).__name__})"
        dataset = h5.get(name)
        if not isinstance(dataset, h5py.Dataset):
            return None
        plist = dataset.id.get_create_plist()
        if dataset.is_virtual:
            return "is a virtual dataset (its data lies in other files)"
        if plist.get_external_count():
            return "has its data in external files"
        if plist.get_nfilters():
            return "is stored through filters (compressed)"
        stored = dataset.id.get_storage_size()
        if stored < dataset.nbytes:
            return f"declares {dataset.nbytes} bytes but stores {stored} (unwritten parts)"
        if dataset.nbytes > size:
            return f"declares {dataset.nbytes} bytes, more than the file's {size}"
        return None

    found = h5.visititems_links(
        lambda name, link: (name, why) if (why := problem(name, link)) else None
    )
    if found is not None:
        name, why = found
        raise errors.FailedPreconditionError(
            f"{where}: {name} {why}; a shard file this project wrote has none (refused before "
            "reading it: a checkpoint written by someone else cannot read other files or "
            "take more memory than it stores)"
        )


@contextlib.contextmanager
def open_verified(
    fs: fsspec.AbstractFileSystem, root: str, entry: dict[str, Any], *, lean: bool = False
) -> Iterator[tuple[h5py.File, VerifiedBlocks | None]]:
    """Opens a shard file whose bytes match the manifest: (the HDF5 file,
    its verified reader for `RawRows`, or None). With per-block checksums
    (files of this version), each block is verified as it is read
    (`VerifiedBlocks`); older files are read once, hashed whole as they are
    copied into a private spool, and parsed from it. Either way the bytes
    parsed are the bytes verified, even if the file changes meanwhile.
    `lean`: keep few verified blocks (a shard with a memory budget)."""
    target = f"{root}/{entry['file']}"
    if "block_sha256" in entry:
        f = open_shard_file(fs, target, entry)
        with f, VerifiedBlocks(f, entry, target, lean=lean) as blocks:
            try:
                with h5py.File(blocks, "r") as h5:
                    check_structure(h5, target, int(entry["bytes"]))
                    yield h5, blocks
            except Exception:
                error, blocks.error = blocks.error, None  # no cycle through the reader
                if error is not None:  # HDF5 hides the reader's error
                    raise error from None
                raise
        return
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY, prefix="tf_dlt-load-") as spool:
        _copy_whole(fs, target, entry, spool)
        spool.seek(0)
        with h5py.File(spool, "r") as h5:
            check_structure(h5, target, int(entry["bytes"]))
            yield h5, None
