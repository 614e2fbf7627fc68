"""Routing: the Python reference and the native core agree with the golden
vectors (also read by the C++ suite) and with each other."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tf_dlt import _native, routing

GOLDEN = Path(__file__).parent / "data" / "routing_golden.txt"


def _golden_rows() -> list[list[str]]:
    return [line.split() for line in GOLDEN.read_text().splitlines() if line and line[0] != "#"]


def test_python_routing_matches_golden_vectors() -> None:
    rows = _golden_rows()
    assert len(rows) >= 30
    ids = np.array([int(r[0]) for r in rows], np.int64)
    np.testing.assert_array_equal(routing.mix64(ids), [int(r[1], 16) for r in rows])
    np.testing.assert_array_equal(routing.bucket_of(ids), [int(r[2]) for r in rows])
    for k, n in enumerate((1, 2, 3, 7)):
        np.testing.assert_array_equal(routing.shard_of(ids, n), [int(r[3 + k]) for r in rows])


def test_native_bucket_matches_python_on_random_ids() -> None:
    ids = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 100_000, dtype=np.int64)
    np.testing.assert_array_equal(_native.bucket_of(ids), routing.bucket_of(ids))


def test_bucket_ranges_partition_all_buckets() -> None:
    for n in (1, 2, 3, 7, 64, 4096):
        owners = routing.shard_of_bucket(np.arange(routing.NUM_BUCKETS), n)
        for shard in range(n):
            first, end = routing.bucket_range(shard, n)
            np.testing.assert_array_equal(np.flatnonzero(owners == shard), np.arange(first, end))


def test_routing_is_balanced() -> None:
    ids = np.arange(300_000, dtype=np.int64)
    counts = np.bincount(routing.shard_of(ids, 3), minlength=3)
    assert counts.min() > 0.97 * counts.max(), counts
