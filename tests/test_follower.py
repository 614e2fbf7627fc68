"""Read-only shards following a checkpoint directory (tf-dlt server
--read-only --follow DIR): they serve the newest chain, apply each delta as
it is committed, refuse writes, and keep serving what they have when a
delta is broken, saying so in Stats and the health service."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import tf_dlt
from tf_dlt import errors
from tf_dlt.checkpoint import manifest

from conftest import Cluster, flip_byte, wait_until


def _wait_for(cluster: Cluster, done: Callable[[list[dict[str, Any]]], bool]) -> list[Any]:
    deadline = time.monotonic() + 60
    with cluster.client() as c:
        while True:
            stats = c.stats()
            if done(stats):
                return stats
            assert time.monotonic() < deadline, (stats, cluster.log(0)[-3000:])
            time.sleep(0.05)


def _serving(save_id: str) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda stats: all(s.get("serving_save_id") == save_id for s in stats)


def _follow_health(cluster: Cluster, shard: int = 0) -> tuple[int, int]:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[shard]}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        overall = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        follow = stub.Check(health_pb2.HealthCheckRequest(service="tf_dlt.follow"), timeout=10)
        return overall, follow.status


def _push(c: tf_dlt.Client, ids: np.ndarray, seed: int) -> None:
    c.pull("t", ids)
    c.push("t", ids, np.random.default_rng(seed).normal(size=(len(ids), 4)).astype(np.float32), 0.1)


def _start_run(c: tf_dlt.Client, ids: np.ndarray, run: Path) -> np.ndarray:
    """Table "t" trained on `ids` and saved in full as run/c1; its rows."""
    c.create_table("t", 4, "normal", "adagrad", seed=1)
    _push(c, ids, 1)
    c.save(str(run / "c1"))
    return c.pull("t", ids)


def _saved_twice(c: tf_dlt.Client, ids: np.ndarray, run: Path) -> tuple[dict[str, Any], Any]:
    """`_start_run`, then a delta run/c2 on it: its manifest and rows."""
    _start_run(c, ids, run)
    _push(c, ids[:10], 2)
    d2 = c.save(str(run / "c2"), base=str(run / "c1"))
    return d2, c.pull("t", ids)


def _corrupt_delta(c: tf_dlt.Client, ids: np.ndarray, run: Path, stage: Path) -> dict[str, Any]:
    """A delta run/c3 on run/c2 with a byte of a file flipped; its manifest.
    Written in `stage` and moved in whole once corrupt, so followers never
    see it intact (its parent path is relative)."""
    _push(c, ids[:10], 3)
    d3 = c.save(str(stage / "c3"), base=str(run / "c2"))
    flip_byte(stage / "c3" / d3["files"][0]["file"], 0.5)
    (stage / "c3").rename(run / "c3")
    return d3


def test_followers_track_training_through_deltas_and_refuse_writes(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    ids = np.arange(5000, dtype=np.int64)
    trainer = start_cluster(2)
    with trainer.client() as c:
        c1 = _start_run(c, ids, run)
    # Three serving shards follow what two training shards save.
    followers = start_cluster(
        3, "--read-only", "--follow", str(run), "--follow-interval", "0.1"
    )  # fmt: skip
    first = manifest.read_manifest(str(run / "c1"))["save_id"]
    _wait_for(followers, _serving(first))
    with followers.client() as f:
        np.testing.assert_array_equal(f.pull("t", ids), c1)
        with pytest.raises(errors.FailedPreconditionError, match="read-only"):
            f.push("t", ids[:3], np.ones((3, 4), np.float32), 0.1)
        with pytest.raises(errors.FailedPreconditionError, match="read-only"):
            f.save(str(tmp_path / "nope"))
        with pytest.raises(errors.FailedPreconditionError, match="read-only"):
            f.create_table("u", 2)
        with pytest.raises(errors.FailedPreconditionError, match="read-only"):
            f.load(str(run / "c1"))
        # A pull of an unknown id reads zeros and creates nothing; so does a
        # trainer's state pull (a hot-row cache's), known ids with their state.
        np.testing.assert_array_equal(f.pull("t", np.array([10**12])), np.zeros((1, 4)))
        states = f._data.pull_state("t", 4, 4, np.array([7, 10**12]), insert=True)
        np.testing.assert_array_equal(states[0, :4], c1[7])
        assert states[0, 8].view(np.uint32) == 1  # one push
        np.testing.assert_array_equal(states[1, :8], np.zeros(8))
        assert states[1, 8].view(np.uint32) == 0xFFFFFFFF
        assert f.list_tables()["t"]["rows"] == len(ids)
    with trainer.client() as c:
        _push(c, ids[:100], 2)
        assert c.shrink("t", min_count=2) == len(ids) - 100
        _push(c, np.arange(9000, 9010, dtype=np.int64), 3)
        d2 = c.save(str(run / "c2"), base=str(run / "c1"))
        c2 = c.pull("t", ids[:100])
        new = c.pull("t", np.arange(9000, 9010, dtype=np.int64))
    stats = _wait_for(followers, _serving(d2["save_id"]))
    assert all(s["follow_current"] and int(s["deltas_applied"]) == 1 for s in stats)
    with followers.client() as f:
        np.testing.assert_array_equal(f.pull("t", ids[:100]), c2)
        np.testing.assert_array_equal(f.pull("t", np.arange(9000, 9010, dtype=np.int64)), new)
        # Removed rows are gone (read zeros), not served stale.
        np.testing.assert_array_equal(f.pull("t", ids[100:]), np.zeros((len(ids) - 100, 4)))
        assert f.list_tables()["t"]["rows"] == 110
    assert _follow_health(followers) == (
        health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.SERVING
    )  # fmt: skip


def test_a_broken_delta_keeps_followers_serving_what_they_have(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    ids = np.arange(2000, dtype=np.int64)
    trainer = start_cluster(1)
    with trainer.client() as c:
        d2, served = _saved_twice(c, ids, run)
    followers = start_cluster(
        2, "--read-only", "--follow", str(run), "--follow-interval", "0.1"
    )  # fmt: skip
    _wait_for(followers, _serving(d2["save_id"]))
    with trainer.client() as c:
        d3 = _corrupt_delta(c, ids, run, tmp_path / "stage")
    stats = _wait_for(followers, lambda s: all(x.get("follow_error") for x in s))
    for s in stats:
        assert s["serving_save_id"] == d2["save_id"] and not s["follow_current"]
        assert d3["files"][0]["file"] in s["follow_error"] and s["follow_lag_seconds"] >= 0
    with followers.client() as f:
        np.testing.assert_array_equal(f.pull("t", ids), served)
    assert _follow_health(followers) == (
        health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    )  # fmt: skip
    # Tried again at every poll (0.1 s), said once a minute: it was said at
    # each (600 lines a minute).
    time.sleep(1.0)
    said = [line for line in followers.log(0).splitlines() if "following" in line and "c3" in line]
    assert len(said) == 1, said
    # A new full checkpoint: the followers load it and are current again.
    with trainer.client() as c:
        full = c.save(str(run / "c4"))
        latest = c.pull("t", ids)
    stats = _wait_for(followers, _serving(full["save_id"]))
    assert all(s["follow_current"] and not s["follow_error"] for s in stats)
    with followers.client() as f:
        np.testing.assert_array_equal(f.pull("t", ids), latest)


def test_a_checkpoint_that_fails_is_read_again_less_and_less_often(
    start_cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newest checkpoint that does not load (a corrupt file here; a full
    tier disk or a storage outage alike) was read again, whole, at every
    poll (--follow-interval): gigabytes a poll from shared storage, for as
    long as it stayed. It is read again after a pause that doubles from the
    poll interval up to a minute; a newer checkpoint is read at once."""
    from tf_dlt.server import follower as follower_module
    from tf_dlt.server.shard_server import ShardServer

    run = tmp_path / "run"
    ids = np.arange(500, dtype=np.int64)
    trainer = start_cluster(1)
    with trainer.client() as c:
        _start_run(c, ids, run)
        _push(c, ids[:10], 2)
        d2 = c.save(str(tmp_path / "stage" / "c2"), base=str(run / "c1"))
    flip_byte(tmp_path / "stage" / "c2" / d2["files"][0]["file"], 0.5)
    tries: list[str] = []  # the checkpoints the follower read, one entry a read
    resolve_chain = follower_module.manifest_lib.resolve_chain

    def counting(tables: Any, *args: Any) -> Any:
        tries.append(str(tables))
        return resolve_chain(tables, *args)

    monkeypatch.setattr(follower_module.manifest_lib, "resolve_chain", counting)
    with ShardServer(0, 1, read_only=True, follow=str(run), follow_interval_s=0.1) as follower:
        (tmp_path / "stage" / "c2").rename(run / "c2")
        wait_until(lambda: "c2" in follower.servicer.serving.get("follow_error", ""), "the error")
        tries.clear()
        time.sleep(4.0)  # 40 polls: read again at 0.2, 0.6, 1.4 and 3.0 s past the first
        assert 1 <= len(tries) <= 6, tries
        with trainer.client() as c:
            full = c.save(str(run / "c3"))
        wait_until(
            lambda: follower.servicer.serving.get("serving_save_id") == full["save_id"],
            "the follower to load the newer checkpoint",
            10,  # within 60 s only if it were read no sooner than c2
        )


def test_a_follower_serves_the_newest_checkpoint_that_loads_and_follows_a_withdrawal(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """Started while the newest checkpoint has a corrupt file, a follower
    served nothing (NotFoundError to every pull) though the chain before it
    loads: it serves that, not current, naming the bad one. A checkpoint
    served that is then removed from the directory (a bad model rolled
    back) was served on, reported current: the newest left is served, as a
    follower started then would serve it."""
    run = tmp_path / "run"
    ids = np.arange(500, dtype=np.int64)
    trainer = start_cluster(1)
    with trainer.client() as c:
        d2, c2 = _saved_twice(c, ids, run)
        _corrupt_delta(c, ids, run, tmp_path / "stage")
    followers = start_cluster(1, "--read-only", "--follow", str(run), "--follow-interval", "0.1")
    [stats] = _wait_for(followers, _serving(d2["save_id"]))
    assert not stats["follow_current"] and "c3" in stats["follow_error"]
    with followers.client() as f:
        np.testing.assert_array_equal(f.pull("t", ids), c2)
    shutil.rmtree(run / "c3")
    [stats] = _wait_for(followers, lambda s: s[0]["follow_current"])
    assert stats["serving_save_id"] == d2["save_id"] and not stats["follow_error"]
    with trainer.client() as c:
        _push(c, ids, 4)
        c.save(str(run / "c4"))
        _push(c, ids, 5)
        d4 = c.save(str(run / "c4"))  # saved again at its path: newer, not withdrawn
    _wait_for(followers, _serving(d4["save_id"]))
    assert "withdrawn" not in followers.log(0)
    shutil.rmtree(run / "c4")  # withdrawn
    [stats] = _wait_for(followers, _serving(d2["save_id"]))
    with followers.client() as f:
        np.testing.assert_array_equal(f.pull("t", ids), c2)
    [stats] = _wait_for(followers, lambda s: s[0]["follow_current"])
    assert "withdrawn" in followers.log(0)


def test_a_failure_every_checkpoint_shares_reads_two_not_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the newest checkpoint fails, the one before it is tried (a file
    of the newest damaged); where the failure is one they all share (a
    damaged base of a chain of deltas), each poll read every checkpoint."""
    from tf_dlt.checkpoint import shard_files
    from tf_dlt.server import follower as follower_module

    shard = tf_dlt._native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    run = tmp_path / "run"
    before = ("", "")  # the last save's path and id
    for k in range(6):  # a full base and 5 deltas
        shard.get_table("t").push(np.arange(10, dtype=np.int64), np.ones((10, 2), np.float32), 0.1)
        save_id = manifest.new_save_id()
        where = str(run / f"c{k}")
        part = shard_files.save_shard(where, shard, save_id, base=before[1])
        parent = manifest.delta_parent(where, before[0]) if k else None
        manifest.write_manifest(where, [part], save_id, parent=parent)
        before = (where, save_id)
    base = manifest.read_manifest(str(run / "c0"))["files"][0]["file"]
    flip_byte(run / "c0" / base, 0.5)
    tries: list[str] = []
    resolve_chain = follower_module.manifest_lib.resolve_chain

    def counting(tables: Any, *args: Any) -> Any:
        tries.append(str(tables))
        return resolve_chain(tables, *args)

    monkeypatch.setattr(follower_module.manifest_lib, "resolve_chain", counting)
    status = follower_module.Follower(tf_dlt._native.Shard(0, 1), str(run), interval_s=60).poll()
    assert not status.serving_save_id and base in status.error
    assert sorted({Path(t).name for t in tries}) == ["c4", "c5"], tries  # of c0 to c5


def test_a_followers_status_says_it_is_catching_up_while_it_reads(tmp_path: Path) -> None:
    """A poll reading a newer checkpoint (a large one, a slow store) left
    the status it had before, "current", for as long as it read, and
    status() waited for the poll."""
    import threading

    from tf_dlt.checkpoint import shard_files
    from tf_dlt.server import follower as follower_module

    shard = tf_dlt._native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    run = tmp_path / "run"

    def save(name: str) -> str:
        shard.get_table("t").push(np.arange(10, dtype=np.int64), np.ones((10, 2), np.float32), 0.1)
        save_id = manifest.new_save_id()
        part = shard_files.save_shard(str(run / name), shard, save_id)
        manifest.write_manifest(str(run / name), [part], save_id)
        return save_id

    first = save("c1")
    served = tf_dlt._native.Shard(0, 1)
    follower = follower_module.Follower(served, str(run), interval_s=60)
    assert follower.poll().current
    save("c2")
    reading, go_on = threading.Event(), threading.Event()
    prepare_load = shard_files.prepare_load

    def slow(*args: Any, **kwargs: Any) -> Any:
        reading.set()
        assert go_on.wait(30)
        return prepare_load(*args, **kwargs)

    follower_module.shard_files.prepare_load = slow  # type: ignore[assignment]
    try:
        poll = threading.Thread(target=follower.poll)
        poll.start()
        assert reading.wait(30)
        status = follower.status()  # not waiting for the poll
        assert (status.current, status.serving_save_id) == (False, first)
        go_on.set()
        poll.join(30)
    finally:
        follower_module.shard_files.prepare_load = prepare_load  # type: ignore[assignment]
    assert follower.status().current and follower.status().serving_save_id != first


def test_a_follower_restarted_serves_its_clients_on(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A read-only shard serves checkpoints, not rows written to one process:
    a client that met a follower goes on, with no error, against the
    follower restarted in its place (a training shard restarted fails the
    next call DataLossError: tests/test_faults.py)."""
    run = tmp_path / "run"
    ids = np.arange(500, dtype=np.int64)
    with start_cluster(1).client() as c:
        c1 = _start_run(c, ids, run)
    followers = start_cluster(1, "--read-only", "--follow", str(run), "--follow-interval", "0.1")
    first = manifest.read_manifest(str(run / "c1"))["save_id"]
    _wait_for(followers, _serving(first))
    with followers.client() as f:
        np.testing.assert_array_equal(f.pull("t", ids), c1)
        followers.kill(0)
        followers.restart(0)
        _wait_for(followers, _serving(first))
        np.testing.assert_array_equal(f.pull("t", ids), c1)


@pytest.mark.cluster
def test_follower_reports_in_stats_and_metrics(tmp_path: Path) -> None:
    from urllib.request import urlopen

    from tf_dlt.server import ShardServer
    from tf_dlt.tools.cluster_stats import format_stats

    shard = tf_dlt._native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    shard.get_table("t").push(np.arange(10, dtype=np.int64), np.ones((10, 2), np.float32), 0.1)
    from tf_dlt.checkpoint import shard_files

    save_id = manifest.new_save_id()
    part = shard_files.save_shard(str(tmp_path / "run" / "c1"), shard, save_id)
    manifest.write_manifest(str(tmp_path / "run" / "c1"), [part], save_id)
    with ShardServer(
        read_only=True, follow=str(tmp_path / "run"), follow_interval_s=0.1, metrics_port=0
    ) as server:
        text = urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read()
        assert b"tf_dlt_read_only 1.0" in text and b"tf_dlt_follow_current 1.0" in text
        assert f'save_id="{save_id}"'.encode() in text
        with tf_dlt.Client([server.address]) as c:
            out = format_stats(c.stats(), [server.address])
        assert f"read-only, serving {tmp_path / 'run' / 'c1'} (save {save_id})" in out
        assert "current, 0 deltas" in out
    with pytest.raises(ValueError, match="read_only"):
        ShardServer(follow=str(tmp_path / "run"))


def test_a_delta_corrupt_past_its_first_block_changes_nothing(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A delta is verified whole before a follower changes anything: a bad
    byte among the second table's rows leaves the first table as it was
    too, and a later table of another shape is followed."""
    run = tmp_path / "run"
    ids = np.arange(50_000, dtype=np.int64)  # a delta of ~53 MB: four blocks
    trainer = start_cluster(1)
    with trainer.client() as c:
        for name in ("a", "b"):
            c.create_table(name, 64, "normal", "adagrad", seed=1)
            c.pull(name, ids)
        c.save(str(run / "c1"))
        served = {name: c.pull(name, ids) for name in ("a", "b")}
    followers = start_cluster(
        1, "--read-only", "--follow", str(run), "--follow-interval", "0.1"
    )  # fmt: skip
    _wait_for(followers, _serving(manifest.read_manifest(str(run / "c1"))["save_id"]))
    with trainer.client() as c:
        for name in ("a", "b"):
            c.push(name, ids, np.ones((len(ids), 64), np.float32), 0.1)
        d2 = c.save(str(tmp_path / "stage" / "c2"), base=str(run / "c1"))
    victim = tmp_path / "stage" / "c2" / d2["files"][0]["file"]
    assert victim.stat().st_size > 48 << 20
    flip_byte(victim, 0.75)  # among table b's rows, after all of a's
    (tmp_path / "stage" / "c2").rename(run / "c2")
    _wait_for(followers, lambda s: all(x.get("follow_error") for x in s))
    with followers.client() as f:
        for name in ("a", "b"):
            np.testing.assert_array_equal(f.pull(name, ids), served[name])
    # Training replaces a table with another shape: followers follow.
    with trainer.client() as c:
        c.drop_table("a")
        c.create_table("a", 8, "zeros", "sgd")
        c.pull("a", ids[:10])
        full = c.save(str(run / "c3"))
    _wait_for(followers, _serving(full["save_id"]))
    with followers.client() as f:
        assert f.list_tables()["a"]["config"].dim == 8
        np.testing.assert_array_equal(f.pull("a", ids[:10]), np.zeros((10, 8)))


def test_a_delta_past_a_followers_max_rows_is_refused_not_half_applied(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A follower of fewer shards than training holds more rows a shard; a
    delta that takes a table past its max_rows there was applied in place,
    evicting rows while the follower reported itself current. It is now
    refused as a load of the chain is: the follower keeps serving every row
    it had and says why; within the cap a delta still applies in place."""
    run = tmp_path / "run"
    trainer = start_cluster(2)
    with trainer.client() as c:
        c.create_table("t", 4, "normal", "adagrad", seed=1, max_rows=4096)
        first = np.arange(3000, dtype=np.int64)
        _push(c, first, 1)
        full = c.save(str(run / "c1"))
    followers = start_cluster(1, "--read-only", "--follow", str(run), "--follow-interval", "0.1")
    _wait_for(followers, _serving(full["save_id"]))
    with followers.client() as f:
        served = f.pull("t", first, training=False)
    with trainer.client() as c:
        _push(c, first[:100], 2)  # within the cap: applied in place
        d2 = c.save(str(run / "c2"), base=str(run / "c1"))
        served = c.pull("t", first, training=False)
    stats = _wait_for(followers, _serving(d2["save_id"]))
    assert stats[0]["deltas_applied"] == 1
    with trainer.client() as c:
        _push(c, np.arange(3000, 6000, dtype=np.int64), 3)  # 6,000 rows for 1 shard of 4,096
        c.save(str(run / "c3"), base=str(run / "c2"))
    stats = _wait_for(followers, lambda s: all(x.get("follow_error") for x in s))
    assert "past its max_rows" in stats[0]["follow_error"], stats[0]["follow_error"]
    assert stats[0]["serving_save_id"] == d2["save_id"] and not stats[0]["follow_current"]
    with followers.client() as f:
        table = f.list_tables()["t"]
        assert table["rows"] == 3000 and table["evicted"] == 0, table
        np.testing.assert_array_equal(f.pull("t", first, training=False), served)


def test_a_delta_within_max_rows_that_fills_a_stripe_is_refused_not_half_applied(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A table's stripes each hold their share of max_rows: one fills before
    the table does. A delta that took the rows a follower holds to 3,000 of
    4,096 passed the follower's check of the table's total, and applied in
    place it evicted 9 rows (read as zeros) while the follower reported
    itself current. It is refused, and every row served stays."""
    run = tmp_path / "run"
    trainer = start_cluster(2)
    ids = np.arange(2000, 5000, dtype=np.int64)
    with trainer.client() as c:
        c.create_table("t", 4, "normal", "adagrad", seed=1, max_rows=4096)
        _push(c, ids[:1000], 1)
        full = c.save(str(run / "c1"))
    followers = start_cluster(1, "--read-only", "--follow", str(run), "--follow-interval", "0.1")
    _wait_for(followers, _serving(full["save_id"]))
    with followers.client() as f:
        served = f.pull("t", ids[:1000], training=False)
    with trainer.client() as c:
        _push(c, ids[1000:], 2)
        c.save(str(run / "c2"), base=str(run / "c1"))
    [stats] = _wait_for(followers, lambda s: all(x.get("follow_error") for x in s))
    assert "past its max_rows" in stats["follow_error"], stats["follow_error"]
    assert stats["serving_save_id"] == full["save_id"] and not stats["follow_current"]
    with followers.client() as f:
        table = f.list_tables()["t"]
        assert table["rows"] == 1000 and table["evicted"] == 0, table
        np.testing.assert_array_equal(f.pull("t", ids[:1000], training=False), served)


def test_a_follower_of_a_table_past_max_rows_applies_its_deltas_in_place(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A checkpoint past max_rows (a tiered table's, saved between its
    evictions) loads whole onto as many shards. A follower of it applied
    no delta in place after that (held rows and the delta's passed the
    cap): each one was a staged load of the whole chain. Saved by as many
    shards, a delta is taken whole in place."""
    from tf_dlt import _native
    from tf_dlt.checkpoint import shard_files
    from tf_dlt.table_config import TableConfig

    source = _native.Shard(0, 1)
    config = TableConfig.create("t", 4, "normal", "adagrad", seed=1, max_rows=4096)
    source.create_table(config.to_dict())
    ids = np.arange(4200, dtype=np.int64)
    # Past max_rows, as a tiered table holds them between evictions.
    source.get_table("t").import_rows(ids, np.ones((len(ids), 4), np.float32), evict=False)
    save_id = manifest.new_save_id()
    part = shard_files.save_shard(str(tmp_path / "past"), source, save_id)
    manifest.write_manifest(str(tmp_path / "past"), [part], save_id)
    run = tmp_path / "run"
    trainer = start_cluster(1)
    with trainer.client() as c:
        c.load(str(tmp_path / "past"))
        full = c.save(str(run / "c1"))
    followers = start_cluster(1, "--read-only", "--follow", str(run), "--follow-interval", "0.1")
    _wait_for(followers, _serving(full["save_id"]))
    with trainer.client() as c:
        c.push("t", ids[:100], np.ones((100, 4), np.float32), 0.1)  # rows it holds: no eviction
        d2 = c.save(str(run / "c2"), base=str(run / "c1"))
        expected = c.pull("t", ids, training=False)
    stats = _wait_for(followers, _serving(d2["save_id"]))
    assert stats[0]["deltas_applied"] == 1, stats[0]
    with followers.client() as f:
        assert f.list_tables()["t"]["rows"] == len(ids)
        np.testing.assert_array_equal(f.pull("t", ids, training=False), expected)
