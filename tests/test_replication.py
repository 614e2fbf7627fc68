"""Hot standbys with real shard processes (docs/replication.md): a standby
takes its primary's tables and every change, a trainer's pulls and pushes
go on after the primary is killed (-9), and the standby then holds every row
and optimizer slot the primary acknowledged."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import numpy as np
import pytest

import tf_dlt
from tf_dlt import errors
from tf_dlt.server.local import LocalCluster
from tf_dlt.tools import cluster_stats

DIM = 8


@pytest.fixture
def replicated(tmp_path) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    with LocalCluster(2, workdir=tmp_path / "cluster", replicas=2) as cluster:
        yield cluster


def _stats(cluster: LocalCluster, shard: int) -> dict:  # type: ignore[type-arg]
    """Stats of the process serving `shard` now (a fresh client finds it)."""
    return tf_dlt.Client(cluster.addresses).stats()[shard]


def _wait(predicate, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _caught_up(cluster: LocalCluster, shard: int) -> bool:
    standbys = _stats(cluster, shard)["standbys"]
    return bool(standbys) and standbys[0]["caught_up"]


def test_a_standby_takes_over_with_every_acknowledged_row(replicated: LocalCluster) -> None:
    cluster = replicated
    client = tf_dlt.Client(cluster.addresses)
    client.create_table("emb", DIM, optimizer="adagrad")
    for shard in range(2):
        _wait(lambda s=shard: _caught_up(cluster, s), f"shard {shard}'s standby")
    rng = np.random.default_rng(0)
    ids = np.arange(2000, dtype=np.int64)
    for _ in range(20):
        batch = rng.choice(ids, 512)
        client.push("emb", batch, rng.normal(size=(512, DIM)).astype(np.float32), 0.1)
    # Every push was acknowledged: both standbys hold it. The primary of
    # shard 1 dies; a state pull before and after must agree.
    before = client.pull("emb", ids)
    cluster.kill(1)
    after = client.pull("emb", ids)  # waits for the standby to take over
    np.testing.assert_array_equal(before, after)
    stats = _stats(cluster, 1)
    assert stats["role"] == "primary" and stats["takeovers"] == 1
    # Training goes on against the new primary; the other shard's standby
    # still follows its primary.
    client.push("emb", ids[:64], np.ones((64, DIM), np.float32), 0.1)
    assert not np.array_equal(client.pull("emb", ids[:64]), after[:64])
    assert _stats(cluster, 0)["standbys"][0]["connected"]
    text = cluster_stats.format_stats(client.stats(), cluster.addresses)
    assert "shard 1: took over from its primary" in text
    assert re.search(r"shard 0: sync standby 127\.0\.0\.1:\d+: caught up, \d+ rows sent", text)


def test_a_standby_serves_no_trainer_and_reports_its_primary(replicated: LocalCluster) -> None:
    cluster = replicated
    with pytest.raises(errors.UnavailableError, match="standby"):
        tf_dlt.Client([cluster.process_addresses[2]]).pull("emb", np.arange(3))
    # Its admin plane answers Stats, and refuses writes.
    stats = tf_dlt.Client(cluster.addresses).stats()
    assert [s["role"] for s in stats] == ["primary", "primary"]
    assert stats[0]["replication"] == "sync"
