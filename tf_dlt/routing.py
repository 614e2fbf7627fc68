"""Routing of ids to shards: id -> bucket = mix64(id) mod NUM_BUCKETS -> shard.

The reference implementation in Python, mirrored by native/core/routing.h and
pinned for both by tests/data/routing_golden.txt. Shard ``i`` of ``n`` owns the
contiguous bucket range ``[first_bucket(i, n), first_bucket(i + 1, n))``, so a
checkpoint grouped by bucket can be loaded onto any shard count.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

NUM_BUCKETS = 4096
"""Number of routing buckets; fixed forever, checkpoints are grouped by it."""

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def mix64(ids: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """The MurmurHash3 64-bit finalizer of each id (as uint64)."""
    x = np.array(ids, dtype=np.int64, copy=True).view(np.uint64)
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


def bucket_of(ids: npt.ArrayLike) -> npt.NDArray[np.uint32]:
    """The routing bucket of each id."""
    return (mix64(ids) % np.uint64(NUM_BUCKETS)).astype(np.uint32)


def shard_of_bucket(buckets: npt.ArrayLike, num_shards: int) -> npt.NDArray[np.uint32]:
    """The shard owning each bucket under the default contiguous bucket map."""
    b = np.asarray(buckets, dtype=np.uint64)
    return (b * np.uint64(num_shards) // np.uint64(NUM_BUCKETS)).astype(np.uint32)


def shard_of(ids: npt.ArrayLike, num_shards: int) -> npt.NDArray[np.uint32]:
    """The shard each id routes to."""
    return shard_of_bucket(bucket_of(ids), num_shards)


def first_bucket(shard: int, num_shards: int) -> int:
    """The first bucket shard `shard` of `num_shards` owns."""
    return (shard * NUM_BUCKETS + num_shards - 1) // num_shards


def bucket_range(shard: int, num_shards: int) -> tuple[int, int]:
    """The half-open bucket range [first, end) shard `shard` owns."""
    return first_bucket(shard, num_shards), first_bucket(shard + 1, num_shards)
