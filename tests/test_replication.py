"""Hot standbys with real shard processes (docs/replication.md): a standby
takes its primary's tables and every change, a trainer's pulls and pushes
go on after the primary is killed (-9), and the standby then holds every row
and optimizer slot the primary acknowledged."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import tf_dlt
from tf_dlt import _native, errors
from tf_dlt.checkpoint import manifest
from tf_dlt.server import replication
from tf_dlt.server.local import LocalCluster
from tf_dlt.server.repeated import Repeated
from tf_dlt.server.shard_server import ShardServer
from tf_dlt.tools import cli, cluster_stats

from conftest import free_port, wait_until

DIM = 8


@pytest.fixture
def replicated(tmp_path) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    with LocalCluster(2, workdir=tmp_path / "cluster", replicas=2) as cluster:
        yield cluster


def _stats(cluster: LocalCluster, shard: int) -> dict:  # type: ignore[type-arg]
    """Stats of the process serving `shard` now (a fresh client finds it)."""
    return tf_dlt.Client(cluster.addresses).stats()[shard]


def _caught_up(cluster: LocalCluster, shard: int) -> bool:
    standbys = _stats(cluster, shard)["standbys"]
    return bool(standbys) and standbys[0]["caught_up"]


def test_a_standby_takes_over_with_every_acknowledged_row(replicated: LocalCluster) -> None:
    cluster = replicated
    client = tf_dlt.Client(cluster.addresses)
    client.create_table("emb", DIM, optimizer="adagrad")
    for shard in range(2):
        wait_until(lambda s=shard: _caught_up(cluster, s), f"shard {shard}'s standby")
    rng = np.random.default_rng(0)
    ids = np.arange(2000, dtype=np.int64)
    for _ in range(20):
        batch = rng.choice(ids, 512)
        client.push("emb", batch, rng.normal(size=(512, DIM)).astype(np.float32), 0.1)
    # Every push was acknowledged: both standbys hold it. The primary of
    # shard 1 dies; a state pull before and after must agree.
    before = client.pull("emb", ids)
    lineage = _stats(cluster, 1)["lineage"]
    cluster.kill(1)
    after = client.pull("emb", ids)  # waits for the standby to take over
    np.testing.assert_array_equal(before, after)
    stats = _stats(cluster, 1)
    assert stats["role"] == "primary" and stats["takeovers"] == 1 and stats["epoch"] == 2
    assert stats["lineage"] == lineage != 0  # the standby kept its primary's lineage
    # Training goes on against the new primary; the other shard's standby
    # still follows its primary.
    client.push("emb", ids[:64], np.ones((64, DIM), np.float32), 0.1)
    assert not np.array_equal(client.pull("emb", ids[:64]), after[:64])
    assert _stats(cluster, 0)["standbys"][0]["connected"]
    text = cluster_stats.format_stats(client.stats(), cluster.addresses)
    assert f"shard 1: took over from its primary (epoch 2, lineage {lineage:016x})" in text
    serving = cluster.process_addresses[3]  # its own standby is dead
    assert f"shard 1: WARNING no standby attached: it runs on one copy, {serving} (start" in text
    assert "shard 0: WARNING" not in text
    assert re.search(r"shard 0: primary \(epoch 1, lineage [0-9a-f]{16}\)", text)
    assert re.search(r"shard 0: sync standby 127\.0\.0\.1:\d+: caught up, \d+ rows sent", text)


def test_clients_given_only_the_primaries_learn_the_standbys(replicated: LocalCluster) -> None:
    cluster = replicated
    # A primary names its standby in its Hello once the standby attached.
    for shard in range(2):
        wait_until(lambda s=shard: bool(_stats(cluster, s)["standbys"]), f"shard {shard}'s standby")
    client = tf_dlt.Client(cluster.process_addresses[:2])  # no standby listed
    client.create_table("emb", DIM, optimizer="adagrad")
    ids = np.arange(500, dtype=np.int64)
    client.push("emb", ids, np.ones((500, DIM), np.float32), 0.1)
    before = client.pull("emb", ids)
    cluster.kill(1)
    np.testing.assert_array_equal(client.pull("emb", ids), before)
    client.push("emb", ids, np.ones((500, DIM), np.float32), 0.1)  # goes on, applied once
    assert _stats(cluster, 1)["pushes"] == 1  # the standby's own: the one after the kill


def test_an_assign_sent_across_a_takeover_lands_on_the_copy_that_took_over(
    replicated: LocalCluster,
) -> None:
    """An assign (an embedding uploaded) whose shard's primary died goes on
    to the standby that takes over, as pushes and pulls do: it failed
    UNAVAILABLE on the dead primary's connection."""
    cluster = replicated
    client = tf_dlt.Client(cluster.addresses)
    client.create_table("emb", DIM, optimizer="adagrad")
    wait_until(lambda: _caught_up(cluster, 1), "shard 1's standby")
    ids = np.arange(500, dtype=np.int64)
    client.push("emb", ids, np.ones((500, DIM), np.float32), 0.1)  # connections to both
    cluster.kill(1)
    values = np.random.default_rng(3).normal(size=(500, DIM)).astype(np.float32)
    client.assign("emb", ids, values)
    np.testing.assert_array_equal(client.pull("emb", ids), values)
    assert _stats(cluster, 1)["role"] == "primary"


def test_a_primary_restarted_empty_never_wipes_its_standby(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A primary killed and started again at its address before its standby
    took over (a supervisor restarting it at once) holds none of the rows:
    the standby takes over instead of copying the empty restart, and
    clients take the standby (its epoch is newer). A client that met the
    primary never uses the restart (another lineage) while the standby of
    the copy it met may take over: its calls wait, then go on against the
    standby. Before, it used the empty restart for good (NotFoundError)."""
    with LocalCluster(
        1, "--takeover-after", "30", workdir=tmp_path / "cluster", replicas=2
    ) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, optimizer="adagrad")
        ids = np.arange(300, dtype=np.int64)
        client.push("emb", ids, np.ones((300, DIM), np.float32), 0.1)
        before = client.pull("emb", ids)
        wait_until(lambda: _caught_up(cluster, 0), "the standby")
        cluster.kill(0)
        cluster.restart(0, rejoin=False)  # an empty primary at the same address, at once
        np.testing.assert_array_equal(client.pull("emb", ids), before)
        client.push("emb", ids, np.ones((300, DIM), np.float32), 0.1)
        pushed = client.pull("emb", ids)
        assert not np.array_equal(pushed, before)
        wait_until(lambda: _stats(cluster, 0)["takeovers"] == 1, "the standby to take over")
        fresh = tf_dlt.Client(cluster.addresses)  # greets both: takes the newest copy
        np.testing.assert_array_equal(fresh.pull("emb", ids), pushed)
        assert "restarted with none of its rows: taking over" in cluster.log(1)


def test_admin_writes_never_go_to_a_primary_restarted_empty(tmp_path: Path) -> None:
    """A primary killed and started again at once at its address (same data
    and admin ports) holds none of the rows. A client that met it (on the
    admin plane alone) saves and makes a table: both go to the standby that
    took over (the copy of the lineage it met), and the checkpoint holds
    every row. Before, the save wrote the empty restart's shard and
    committed a checkpoint without a row."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        _, ids, rows = _trained_with_standby(cluster, 0, 300)
        client = tf_dlt.Client(cluster.addresses, request_timeout=20)
        client.stats()
        lineage = client.stats()[0]["lineage"]
        cluster.kill(0)
        cluster.restart(0, rejoin=False)  # an empty primary at the same address, at once
        client.save(str(tmp_path / "ck"))
        client.create_table("late", DIM)
        assert _stats(cluster, 0)["lineage"] == lineage
        with LocalCluster(1, workdir=tmp_path / "check") as check:
            loader = tf_dlt.Client(check.addresses)
            loader.load(str(tmp_path / "ck"))
            np.testing.assert_array_equal(loader.pull("emb", ids, training=False), rows)
        assert "late" in tf_dlt.Client(cluster.addresses).list_tables()


def test_killed_processes_rejoin_as_standbys_and_take_over_in_turn(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """As Kubernetes restarts a pod under its old name: the killed primary
    comes back (--replica-set), follows the standby that took over, catches
    up, and takes over in turn when that one is killed; every acknowledged
    row survives both kills."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, optimizer="adagrad")
        ids = np.arange(400, dtype=np.int64)
        rng = np.random.default_rng(1)

        def train() -> None:
            for _ in range(5):
                client.push("emb", ids, rng.normal(size=(400, DIM)).astype(np.float32), 0.1)

        wait_until(lambda: _caught_up(cluster, 0), "the standby")
        train()
        for dead, live in ((0, 1), (1, 0)):
            before = client.pull("emb", ids)
            cluster.kill(dead)
            np.testing.assert_array_equal(client.pull("emb", ids), before)
            live_port = int(cluster.process_addresses[live].rsplit(":", 1)[1])
            assert _stats(cluster, 0)["data_port"] == live_port  # it took over
            cluster.restart(dead)
            wait_until(
                lambda d=dead: (
                    _stats(cluster, 0)["standbys"]
                    and _stats(cluster, 0)["standbys"][0]["address"] == cluster.process_addresses[d]
                    and _stats(cluster, 0)["standbys"][0]["caught_up"]
                ),
                f"process {dead} to rejoin as a standby",
            )
            # The client's control plane may still point at `dead`, now a
            # standby: it moves on to the process that serves.
            assert client.stats()[0]["data_port"] == live_port
            client.save(str(tmp_path / f"after-kill-{dead}"))
            train()  # sync: on both
        stats = _stats(cluster, 0)
        assert stats["epoch"] == 3 and stats["takeovers"] == 1
        assert "follows" in cluster.log(1) or "following it" in cluster.log(1)
        fresh = tf_dlt.Client(cluster.addresses)
        np.testing.assert_array_equal(fresh.pull("emb", ids), client.pull("emb", ids))
        cluster.kill(1)  # the last primary: process 0 took over from it
        np.testing.assert_array_equal(client.pull("emb", ids), fresh.pull("emb", ids))


def _replica_set(
    ports: list[int], members: list[str], start_last_first: bool = False
) -> list[ShardServer]:
    """A replica set of shard 0 of 1 in this process, one server per member
    (started in order, or the last first); returns once the first serves
    and the second is its caught-up standby."""
    servers = [
        ShardServer(0, 1, port=p, replica_set=members, advertise=m, takeover_after_s=1.0)
        for p, m in zip(ports, members, strict=True)
    ]
    try:
        for server in reversed(servers) if start_last_first else servers:
            server.start()
        wait_until(
            lambda: (
                servers[0].servicer.snapshot()["role"] == "primary"
                and bool(servers[1].servicer.snapshot().get("caught_up"))
            ),
            "one primary and its standby",
        )
    except BaseException:
        for server in servers:
            server.stop(0)
        raise
    return servers


def test_a_replica_set_started_together_elects_one_primary() -> None:
    """Both processes of a shard started at once with --replica-set (a
    Kubernetes job's first start): the first begins as the primary, the
    other follows it; a member of another shard is refused by name."""
    ports = [free_port(), free_port()]
    members = [f"127.0.0.1:{p}" for p in ports]
    servers = _replica_set(ports, members, start_last_first=True)
    try:
        assert servers[1].servicer.snapshot()["role"] == "standby"
        assert servers[0].shard.epoch == 1  # it began; it took over from nobody
        client = tf_dlt.Client(["|".join(members)])
        client.create_table("emb", DIM)
        client.push("emb", np.arange(10), np.ones((10, DIM), np.float32), 0.1)
        rows = client.pull("emb", np.arange(10))
        servers[0].stop(0)
        np.testing.assert_array_equal(client.pull("emb", np.arange(10)), rows)
        assert servers[1].shard.epoch == 2
    finally:
        for server in servers:
            server.stop(0)
    with pytest.raises(ValueError, match="replica set has 2 to 5 distinct members"):
        ShardServer(0, 1, replica_set=members, advertise="127.0.0.1:1")


def _copy_health(server: ShardServer | int) -> int:
    """The health status of COPY_SERVICE (readiness) of `server`, or of the
    process whose admin port it is."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tf_dlt.server.shard_server import COPY_SERVICE

    port = server if isinstance(server, int) else server.admin_port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=COPY_SERVICE)
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status)


def test_a_replica_set_member_is_ready_once_it_holds_a_whole_copy(tmp_path: Path) -> None:
    """Readiness (health's tf_dlt.copy) waits for a whole copy: a member
    that begins as the primary is ready once its --load-from loaded, a
    standby once it caught up. Before, a member answered SERVING from its
    start, while it learned its role and loaded: Kubernetes counted it
    available (a drain or a rolling restart could then stop the shard's
    other process, its only whole copy)."""
    from grpc_health.v1 import health_pb2

    from tf_dlt.checkpoint import shard_files

    serving = health_pb2.HealthCheckResponse.SERVING
    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", DIM).to_dict())
    ids = np.arange(100_000, dtype=np.int64)
    shard.get_table("t").push(ids, np.ones((len(ids), DIM), np.float32), 0.1)
    save_id = manifest.new_save_id()
    part = shard_files.save_shard(str(tmp_path / "ck"), shard, save_id)
    manifest.write_manifest(str(tmp_path / "ck"), [part], save_id)
    ports = [free_port(), free_port()]
    members = [f"127.0.0.1:{p}" for p in ports]
    first = ShardServer(
        0, 1, port=ports[0], replica_set=members, advertise=members[0],
        load_from=str(tmp_path / "ck"), checkpoint_roots=[str(tmp_path)], takeover_after_s=1.0,
    ).start()  # fmt: skip
    second = None
    try:
        seen = [_copy_health(first)]
        while seen[-1] != serving:
            seen.append(_copy_health(first))
            assert len(seen) < 10_000, "the member never became ready"
        assert first.shard.get_table("t").size() == len(ids)  # loaded before ready
        assert seen[0] != serving  # not ready while it learned its role and loaded
        second = ShardServer(
            0, 1, port=ports[1], replica_set=members, advertise=members[1],
            takeover_after_s=1.0,
        ).start()  # fmt: skip
        wait_until(lambda: _copy_health(second) == serving, "the standby to be ready")
        assert second.servicer.snapshot()["role"] == "standby"
        assert second.servicer.snapshot().get("caught_up")
        first.stop(0)  # the standby takes over: it stays ready
        wait_until(lambda: second.servicer.snapshot()["role"] == "primary", "the takeover")
        assert _copy_health(second) == serving
    finally:
        first.stop(0)
        if second is not None:
            second.stop(0)


def test_a_member_that_began_between_two_greetings_is_followed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member surveyed as it began as the primary: its trainer Hello was
    refused (it was joining), its replica Hello taken, and by the Stats
    after them it was the primary. That counted as "no whole copy" and the
    second member began too (both primaries, writes lost on one)."""
    members = ["127.0.0.1:7100", "127.0.0.1:7101"]
    link = replication.StandbyLink(
        None, members[1], 0, 1, "", take_over=lambda: None, caught_up=lambda: False,
        replica_set=members, begin=lambda: None, step_down=lambda primary: None,
        epoch=lambda: 0,
    )  # fmt: skip

    def greet(address: str, replica: bool = False) -> dict[str, object]:
        if not replica:
            raise errors.UnavailableError("a standby (joining) answers trainers UNAVAILABLE")
        return {"admin_port": 7200}

    monkeypatch.setattr(link, "_greet", greet)
    for role, verdict in (("primary", members[0]), ("beginning", replication._WAIT)):
        stats = type("Stats", (), {"role": role, "caught_up": False, "epoch": 1})()
        monkeypatch.setattr(replication, "member_stats", lambda *a, s=stats: s)
        assert link._survey() == verdict
    # Beside an older primary that still answers trainers, the newer epoch's
    # is followed.
    members.append("127.0.0.1:7102")
    link._replica_set = members
    stats = type("Stats", (), {"role": "primary", "caught_up": False, "epoch": 3})()
    monkeypatch.setattr(replication, "member_stats", lambda *a: stats)

    def greet_old_primary(address: str, replica: bool = False) -> dict[str, object]:
        if address == members[2]:
            return {"epoch": 2}
        return greet(address, replica)

    monkeypatch.setattr(link, "_greet", greet_old_primary)
    assert link._survey() == members[0]


def test_a_standby_of_its_own_address_is_refused_at_start() -> None:
    """`--standby-of` naming the server itself (a copy-paste of its own
    flags) retried its Hello to itself for ever, saying only that the
    address is a standby; it now refuses to start, saying why."""
    port = free_port()
    for own in ({"port": port}, {"advertise": f"127.0.0.1:{port}"}):
        with pytest.raises(ValueError, match="is this server's own address"):
            ShardServer(0, 1, standby_of=f"127.0.0.1:{port}", **own)  # type: ignore[arg-type]
    run = subprocess.run(
        [sys.executable, "-m", "tf_dlt.server", "--port", str(port), "--bind", "127.0.0.1",
         "--standby-of", f"localhost:{port}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "is this server's own address" in run.stderr, run.stderr


def test_a_trainer_follows_a_replica_set_restarted_whole() -> None:
    """Every process of a shard restarted (its nodes replaced, say): the set
    begins afresh at epoch 1, older than the epoch 2 a long-lived trainer
    met after a takeover. Its client refused that set until the trainer
    itself restarted (resilient_fit's reload through it failed too); it now
    follows the set's new lineage, since no copy of the old one serves,
    after one DataLossError."""
    ports = [free_port(), free_port()]
    members = [f"127.0.0.1:{p}" for p in ports]
    ids = np.arange(10)
    servers = _replica_set(ports, members)
    try:
        client = tf_dlt.Client(["|".join(members)])
        client.create_table("emb", DIM)
        client.push("emb", ids, np.ones((10, DIM), np.float32), 0.1)
        rows = client.pull("emb", ids)
        servers[0].stop(0)
        np.testing.assert_array_equal(client.pull("emb", ids), rows)
        assert servers[1].shard.epoch == 2
        old_lineage = servers[1].shard.lineage
        servers[1].stop(0)

        servers = _replica_set(ports, members)
        assert servers[0].shard.epoch == 1 and servers[0].shard.lineage != old_lineage
        assert servers[1].shard.lineage == servers[0].shard.lineage  # its standby's
        fresh = tf_dlt.Client(["|".join(members)])
        fresh.create_table("emb", DIM)  # it began empty (no --load-from)
        # An operator sees it in the stats: a new lineage, epoch 1.
        stats = fresh.stats()[0]
        assert (stats["lineage"], stats["epoch"]) == (servers[0].shard.lineage, 1)
        with pytest.raises(errors.DataLossError, match="every copy of the shard at epoch 2"):
            client.pull("emb", ids)  # once: the trainer learns its rows are gone
        np.testing.assert_array_equal(client.pull("emb", ids), fresh.pull("emb", ids))
        client.push("emb", ids, np.ones((10, DIM), np.float32), 0.1)
        np.testing.assert_array_equal(fresh.pull("emb", ids), client.pull("emb", ids))
    finally:
        for server in servers:
            server.stop(0)


@pytest.mark.parametrize("failure", ["killed", "silent"])
def test_a_save_caught_by_a_failover_ends_in_seconds_and_the_next_lands_on_the_new_primary(
    tmp_path: Path, failure: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Save in flight on a primary that froze. Killed (-9) before its
    standby took over, its connections reset and the Save is given up once
    the standby serves and made again there under a new save id (the same
    id could meet a part the old copy still wrote: a process past its
    --stop-grace goes on writing as it exits): it commits with every
    acknowledged row. Left
    frozen (a host that lost power: nothing answers, nothing resets), the
    Save is given up (FailedOverError, UNAVAILABLE) once the standby serves
    (it waited out the persist timeout, an hour by default), and the next
    goes to the new primary; the old one, woken, never spoils it. A follower serving the
    run's directory moves to each checkpoint, and a delta on it succeeds."""
    run = tmp_path / "run"
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, optimizer="adagrad")
        ids = np.arange(3000, dtype=np.int64)
        client.push("emb", ids, np.ones((3000, DIM), np.float32), 0.1)
        client.save(str(run / "c1"))
        follower = ShardServer(0, 1, read_only=True, follow=str(run), follow_interval_s=0.1)
        with follower:
            wait_until(lambda: _serving(follower) == manifest_id(run / "c1"), "the follower")
            client.push("emb", ids[:100], np.ones((100, DIM), np.float32), 0.1)
            rows = client.pull("emb", ids)
            wait_until(lambda: _caught_up(cluster, 0), "the standby")
            cluster.processes[0].send_signal(signal.SIGSTOP)  # the Save to it hangs
            saved: list[object] = []

            def save() -> None:
                # Silent: its own save id, so given up, not made again; killed:
                # made again under a new one (Client.save).
                save_id = manifest.new_save_id() if failure == "silent" else None
                try:
                    saved.append(client.save(str(run / "c2"), save_id=save_id))
                except errors.DltError as e:
                    saved.append(e)

            # The Save is on its way to the frozen primary (its greeting of
            # the shard's copies done) before the kill: else, under load, it
            # could meet the standby serving already and go there at once.
            aimed = threading.Event()
            to_newest_copy = tf_dlt.Client._to_newest_copy

            def aiming(self: tf_dlt.Client, *args: object) -> None:
                to_newest_copy(self, *args)  # type: ignore[arg-type]
                aimed.set()

            monkeypatch.setattr(tf_dlt.Client, "_to_newest_copy", aiming)
            saver = threading.Thread(target=save)
            saver.start()
            if failure == "killed":
                assert aimed.wait(30)
                cluster.kill(0)  # its connections reset: the Save goes to the new primary
            # (Its log, not Stats: a fresh client would wait on the frozen
            # primary's Hello first.)
            wait_until(lambda: "taking over" in cluster.log(1), "the standby to take over", 60)
            saver.join(60)
            assert not saver.is_alive()
            if failure == "killed":
                assert "under a new save id" in caplog.text  # not sent again under its own
            if failure == "silent":
                assert isinstance(saved[0], errors.FailedOverError), saved
                assert "standby took over" in saved[0].message
                assert manifest_id(run / "c2") == ""  # nothing committed
                saved[:] = [client.save(str(run / "c2"))]
            assert saved[0]["save_id"] == manifest_id(run / "c2")  # type: ignore[index]
            wait_until(lambda: _serving(follower) == manifest_id(run / "c2"), "the follower")
            np.testing.assert_array_equal(follower_rows(follower, ids), rows)
            if failure == "silent":
                # Woken, the old primary runs the Save it was sent (it had
                # not read it): its part of that save id, never committed,
                # is not the checkpoint's.
                cluster.processes[0].send_signal(signal.SIGCONT)
                wait_until(lambda: not _serves(cluster.process_addresses[0]), "it to step down")
                cluster.kill(0)
                assert saved[0]["save_id"] == manifest_id(run / "c2")  # type: ignore[index]
            client.push("emb", ids[:10], np.ones((10, DIM), np.float32), 0.1)
            client.save(str(run / "c3"), base=str(run / "c2"))
            wait_until(lambda: _serving(follower) == manifest_id(run / "c3"), "the follower")
            np.testing.assert_array_equal(follower_rows(follower, ids), client.pull("emb", ids))
            client.load(str(run / "c2"))
            np.testing.assert_array_equal(client.pull("emb", ids), rows)


@pytest.mark.parametrize("rows", [5000, 200_000])
def test_a_load_is_acknowledged_once_the_standby_holds_it(tmp_path: Path, rows: int) -> None:
    """The primary killed the moment `Client.load` returns: its standby takes
    over with the checkpoint's rows, not the ones it held before the load
    (a load was acknowledged before the standby's next round copied it)."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, initializer="zeros")
        ids = np.arange(rows, dtype=np.int64)
        ones = np.ones((rows, DIM), np.float32)
        client.push("emb", ids, ones, 1.0)
        saved = client.pull("emb", ids)
        client.save(str(tmp_path / "ckpt"))
        for _ in range(3):
            client.push("emb", ids, ones, 1.0)
        wait_until(lambda: _caught_up(cluster, 0), "the standby to catch up")
        client.load(str(tmp_path / "ckpt"))
        cluster.kill(0)
        np.testing.assert_array_equal(client.pull("emb", ids, training=False), saved)
        assert _stats(cluster, 0)["takeovers"] == 1


def _saved_then_trained(
    cluster: LocalCluster, path: Path, n: int
) -> tuple[tf_dlt.Client, np.ndarray, np.ndarray]:
    """A client of `cluster` that made "emb", pushed to `n` ids, saved to
    `path` and pushed again once every shard's standby caught up: the
    client, the ids, and their rows in the checkpoint."""
    client = tf_dlt.Client(cluster.addresses)
    client.create_table("emb", DIM, optimizer="adagrad")
    ids = np.arange(n, dtype=np.int64)
    client.push("emb", ids, np.ones((n, DIM), np.float32), 0.1)
    client.save(str(path))
    saved = client.pull("emb", ids, training=False)
    client.push("emb", ids, np.ones((n, DIM), np.float32), 0.1)
    for shard in range(len(cluster.addresses)):
        wait_until(lambda s=shard: _caught_up(cluster, s), f"shard {shard}'s standby")
    return client, ids, saved


def _after_prepare(client: tf_dlt.Client, then: Callable[[], None]) -> None:
    """Runs `then` as soon as the client's loads have PREPAREd."""
    prepare = client._prepare_load

    def prepare_then(*args: Any, **kwargs: Any) -> None:
        prepare(*args, **kwargs)
        then()

    client._prepare_load = prepare_then  # type: ignore[method-assign]


def test_a_load_prepared_on_a_primary_that_died_commits_on_its_standby(tmp_path: Path) -> None:
    """A primary killed between a load's PREPARE and its COMMIT: the standby
    that took over never staged the load, so the client prepares it there
    and commits; every shard holds the checkpoint. Before, the load failed
    ("no load prepared") and was rolled back everywhere."""
    with LocalCluster(2, workdir=tmp_path / "cluster", replicas=2) as cluster:
        client, ids, saved = _saved_then_trained(cluster, tmp_path / "ckpt", 4000)
        _after_prepare(client, lambda: cluster.kill(1))
        loaded = client.load(str(tmp_path / "ckpt"))
        assert loaded["emb"]["rows"] == 4000
        np.testing.assert_array_equal(client.pull("emb", ids, training=False), saved)
        stats = tf_dlt.Client(cluster.addresses).stats()
        assert stats[1]["takeovers"] == 1 and [s["pending_load"] for s in stats] == ["", ""]


def test_a_load_never_commits_on_a_primary_restarted_empty_in_its_place(tmp_path: Path) -> None:
    """The primary dies after the load's PREPARE and is restarted at once at
    its address (a plain supervisor): the client's COMMIT, sent again, goes
    to the standby that takes over (the lineage the client met), prepares
    and commits there, and the rows the trainer then pulls are the
    checkpoint's. The empty restart is never loaded (it answered first, and
    took the load while the trainer pulled the standby's old rows)."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        client, ids, saved = _saved_then_trained(cluster, tmp_path / "ckpt", 1000)

        def restart_empty() -> None:
            cluster.kill(0)
            cluster.restart(0, rejoin=False)  # empty, at the same address, at once

        _after_prepare(client, restart_empty)
        client.load(str(tmp_path / "ckpt"))
        np.testing.assert_array_equal(client.pull("emb", ids, training=False), saved)
        restarted = tf_dlt.Client([cluster.process_addresses[0]]).stats()[0]
        assert restarted["tables"] == [] and restarted["pending_load"] == ""


def manifest_id(path: Path) -> str:
    """The save id of the checkpoint committed at `path` ("" while none is)."""
    try:
        return str(manifest.read_manifest(str(path))["save_id"])
    except (errors.DltError, OSError):
        return ""


def _serving(server: ShardServer) -> str:
    return str(server.servicer.serving.get("serving_save_id", ""))


def follower_rows(server: ShardServer, ids: np.ndarray) -> np.ndarray:
    return tf_dlt.Client([server.address]).pull("emb", ids, training=False)


def test_a_member_that_began_beside_a_newer_copy_steps_down_and_follows_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed primary that comes back and, unable to read its peer's
    Stats, begins as the primary beside the standby (which then takes over,
    a newer epoch) stops serving once it sees that newer copy, drops its
    tables and follows it: the replica set ends with one primary again and
    every row kept."""
    caplog.set_level(logging.INFO, logger="tf_dlt.server")
    ports = [free_port(), free_port()]
    members = [f"127.0.0.1:{p}" for p in ports]

    def member(i: int, takeover_after_s: float = 1.0) -> ShardServer:
        return ShardServer(
            0, 1, port=ports[i], replica_set=members, advertise=members[i],
            takeover_after_s=takeover_after_s,
        )  # fmt: skip

    # The standby takes over only on seeing a new process at its primary's
    # address, so the restart below always comes first.
    first, second = member(0), member(1, takeover_after_s=60)
    restarted: ShardServer | None = None
    try:
        first.start()
        second.start()
        wait_until(lambda: bool(second.servicer.snapshot().get("caught_up")), "the standby")
        client = tf_dlt.Client(["|".join(members)])
        client.create_table("emb", DIM)
        ids = np.arange(200, dtype=np.int64)
        client.push("emb", ids, np.ones((200, DIM), np.float32), 0.1)
        rows = client.pull("emb", ids)
        first.stop(0)

        def unreadable(*args: object) -> None:
            raise errors.UnavailableError("its control plane does not answer")

        monkeypatch.setattr(replication, "member_stats", unreadable)
        restarted = member(0).start()  # begins: it cannot tell the standby is caught up
        wait_until(
            lambda: second.servicer.snapshot()["role"] == "primary", "the standby to take over"
        )
        wait_until(
            lambda: (
                restarted is not None
                and restarted.servicer.snapshot()["role"] == "standby"
                and bool(restarted.servicer.snapshot().get("caught_up"))
            ),
            "the restarted member to step down and follow",
        )
        assert second.shard.epoch == 2
        assert "serves epoch 2, newer than this copy's 1: following it" in caplog.text
        np.testing.assert_array_equal(tf_dlt.Client(["|".join(members)]).pull("emb", ids), rows)
        second.stop(0)  # and it takes over in turn, with every row
        np.testing.assert_array_equal(client.pull("emb", ids), rows)
    finally:
        for server in (first, second, restarted):
            if server is not None:
                server.stop(0)


def _trained_with_standby(
    cluster: LocalCluster, shard: int, n: int, **client_options: Any
) -> tuple[tf_dlt.Client, np.ndarray, np.ndarray]:
    """A client of `cluster` (`client_options`) that made table "emb"
    (Adagrad) and pushed to `n` ids once `shard`'s standby caught up: the
    client, the ids, their rows."""
    client = tf_dlt.Client(cluster.addresses, **client_options)
    client.create_table("emb", DIM, optimizer="adagrad")
    wait_until(lambda: _caught_up(cluster, shard), f"shard {shard}'s standby")
    ids = np.arange(n, dtype=np.int64)
    client.push("emb", ids, np.ones((n, DIM), np.float32), 0.1)
    return client, ids, client.pull("emb", ids)


def test_a_client_given_the_primaries_alone_follows_a_takeover_on_both_planes(
    replicated: LocalCluster, tmp_path: Path
) -> None:
    """A client given only each shard's primary learns the standbys from
    their Hellos: its pulls followed a takeover, but its admin calls (save,
    stats, create_table) failed UNAVAILABLE for good. They follow too."""
    cluster = replicated
    _, ids, rows = _trained_with_standby(cluster, 1, 500)
    primaries = tf_dlt.Client(cluster.process_addresses[:2])
    primaries.stats()  # met both primaries, on both planes
    cluster.kill(1)
    np.testing.assert_array_equal(primaries.pull("emb", ids), rows)
    assert primaries.stats()[1]["role"] == "primary"
    primaries.save(str(tmp_path / "ck"))
    primaries.create_table("after", DIM)
    primaries.push("emb", ids, np.ones((500, DIM), np.float32), 0.1)
    primaries.load(str(tmp_path / "ck"))
    np.testing.assert_array_equal(primaries.pull("emb", ids), rows)


def test_a_client_made_during_a_takeover_waits_for_it(replicated: LocalCluster) -> None:
    """A trainer that first greets a shard while its standby takes over
    (its primary refuses, the standby still answers "a standby") waits for
    the takeover, on the data plane and the admin plane alike."""
    cluster = replicated
    _, ids, rows = _trained_with_standby(cluster, 1, 500)
    cluster.kill(1)
    fresh = tf_dlt.Client(cluster.addresses)  # met no shard before the kill
    np.testing.assert_array_equal(fresh.pull("emb", ids), rows)
    assert tf_dlt.Client(cluster.addresses).stats()[1]["role"] == "primary"


def test_a_save_begun_during_a_takeover_waits_for_it(
    replicated: LocalCluster, tmp_path: Path
) -> None:
    """A client that met the shard saves while its standby takes over: the
    Save goes to the new primary once it serves (it failed with gRPC's own
    "failed to connect to all addresses")."""
    cluster = replicated
    client, ids, rows = _trained_with_standby(cluster, 1, 500)
    client.stats()  # the admin plane met every shard
    cluster.kill(1)
    client.save(str(tmp_path / "ckpt"))
    restored = tf_dlt.Client(cluster.addresses)
    restored.load(str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(restored.pull("emb", ids), rows)


def test_a_shard_none_of_whose_addresses_greets_says_what_each_said(
    replicated: LocalCluster,
) -> None:
    standby = replicated.process_addresses[2]  # shard 0's
    gone = f"127.0.0.1:{free_port()}"
    client = tf_dlt.Client([f"{gone}|{standby}", replicated.addresses[1]], request_timeout=1.0)
    with pytest.raises(errors.UnavailableError) as raised:
        client.stats()
    message = str(raised.value)
    assert f"shard 0 ({gone}|{standby}) greeting: " in message
    assert f"{gone}: connect: " in message
    assert f"{standby}: Hello: shard 0 here is a standby" in message


def _serves(address: str) -> bool:
    try:
        _native.hello(address, "", timeout_ms=1000)
        return True
    except errors.DltError:
        return False


def _pause_past_takeover(cluster: LocalCluster, trainer: tf_dlt.Client, ids: np.ndarray) -> None:
    """Pauses shard 0's primary (SIGSTOP) until its standby took over and
    `trainer` pushed to `ids` there, then wakes it."""
    cluster.processes[0].send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: _serves(cluster.process_addresses[1]), "the standby to take over")
        trainer.push("emb", ids, np.ones((len(ids), DIM), np.float32), 0.1)  # on the new primary
    finally:
        cluster.processes[0].send_signal(signal.SIGCONT)


def test_a_primary_paused_past_its_only_standbys_takeover_is_fenced_when_it_wakes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A primary paused past the takeover of its only standby (no other
    standby is left to tell it the newer epoch) wakes: its standby, now
    serving, refuses to follow it, and a Hello tells it that one serves its
    shard at a newer epoch, so it is replaced. A trainer that lists only its
    address gets UNAVAILABLE, never the rows it held before the pause."""
    with LocalCluster(1, "--io-timeout", "2", workdir=tmp_path / "cluster", replicas=2) as cluster:
        old, standby = cluster.process_addresses
        client, ids, stale = _trained_with_standby(cluster, 0, 200)
        _pause_past_takeover(cluster, client, ids)
        newest = client.pull("emb", ids)
        assert not np.array_equal(newest, stale)

        def replaced() -> bool:
            try:
                _native.hello(old, "", timeout_ms=2000)
                return False
            except errors.UnavailableError as e:
                assert "was replaced" in str(e)
                return True

        wait_until(replaced, "the old primary to be fenced")
        # Not ready once replaced (its rows are older than the shard's): it
        # said SERVING for good, started as a primary without --replica-set.
        from grpc_health.v1 import health_pb2

        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: _copy_health(cluster.admin_ports[0]) == not_serving, "not ready")
        # The refusal and the old primary's log name the copy that replaced it.
        with pytest.raises(
            errors.UnavailableError, match=f"was replaced.*{re.escape(standby)} took over"
        ):
            tf_dlt.Client([old]).pull("emb", ids)
        wait_until(lambda: "this primary was replaced" in cluster.log(0), "the replacement logged")
        assert f"its standby {standby} took over, at epoch 2" in cluster.log(0)
        assert cli.main(["stats", "--pservers", old]) == 1  # and says who replaced it
        assert f"{standby} took over, at epoch 2" in capsys.readouterr().err
        np.testing.assert_array_equal(tf_dlt.Client(cluster.addresses).pull("emb", ids), newest)
        # Its admin plane refuses writes too: a save there missed the push
        # the new primary took (it saved the rows of before the pause).
        import grpc

        from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[0]}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                dlt_pb2_grpc.ShardAdminStub(channel).Save(
                    dlt_pb2.SaveRequest(
                        path=str(tmp_path / "stale"), save_id=manifest.new_save_id()
                    ),
                    timeout=30,
                )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "was replaced" in (refused.value.details() or "")
        # The client that met the old primary saves on the new one.
        client.save(str(tmp_path / "ck"))
        client.push("emb", ids, np.ones((200, DIM), np.float32), 0.1)
        client.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(client.pull("emb", ids), newest)


def test_writes_made_as_a_replaced_primary_wakes_go_to_the_copy_that_replaced_it(
    tmp_path: Path,
) -> None:
    """A client whose admin plane is on a primary paused past its standby's
    takeover saves, then makes a table, the moment the primary wakes, before
    it learns it was replaced (it takes writes for a few seconds): both go
    to the copy serving at the newer epoch. Before, both went to the woken
    primary: the table change failed UNAVAILABLE (the copy that replaced it
    refuses its frames), and a save it took before it learned held the rows
    of before the pause, without the pushes the new primary took."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        trainer, ids, stale = _trained_with_standby(cluster, 0, 200)
        admin = tf_dlt.Client(cluster.addresses)
        admin.stats()  # its admin plane on the primary; it pulls nothing
        _pause_past_takeover(cluster, trainer, ids)
        admin.save(str(tmp_path / "ck"))
        newest = trainer.pull("emb", ids)
        assert not np.array_equal(newest, stale)
        trainer.push("emb", ids, np.ones((200, DIM), np.float32), 0.1)
        trainer.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(trainer.pull("emb", ids), newest)
        admin.create_table("late", DIM)
        assert "late" in trainer.list_tables()


def test_a_save_never_goes_to_a_primary_older_than_the_copy_met(tmp_path: Path) -> None:
    """A primary paused past its standby's takeover; the trainer meets the
    standby (epoch 2) and pushes there; the standby dies and the old
    primary wakes, with nobody left to tell it it was replaced: it greets at
    epoch 1. The trainer's save fails UNAVAILABLE naming that epoch, and no
    checkpoint commits. Before, the save went to the woken primary and
    committed the rows of before the pause, without the acknowledged push."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        # Each refusal below retries until the request deadline (30 s by default).
        trainer, ids, _ = _trained_with_standby(cluster, 0, 200, request_timeout=8)
        _pause_past_takeover(cluster, trainer, ids)  # met at epoch 2, woken
        cluster.processes[0].send_signal(signal.SIGSTOP)  # (so it hears of no one first)
        cluster.kill(1)
        cluster.processes[0].send_signal(signal.SIGCONT)
        with pytest.raises(errors.UnavailableError, match="older than epoch 2"):
            trainer.save(str(tmp_path / "ck"))
        assert manifest_id(tmp_path / "ck") == ""
        with pytest.raises(errors.UnavailableError, match="older than epoch 2"):
            trainer.create_table("late", DIM)


def test_a_live_primarys_own_unavailable_is_not_taken_for_a_failover(tmp_path: Path) -> None:
    """The standby stalls (SIGSTOP) and the primary, alive, refuses a table
    change it cannot copy to it (UNAVAILABLE). The caller gets that refusal,
    not a search for another copy: before, the client took it for a dead
    primary, looked for a copy until its deadline and raised
    DeadlineExceededError "no copy serves"."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        _trained_with_standby(cluster, 0, 100)
        client = tf_dlt.Client(cluster.addresses, request_timeout=10)
        client.list_tables()
        cluster.processes[1].send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(errors.DltError):
                client.create_table("t1", DIM)  # waits for the stalled standby
            with pytest.raises(errors.UnavailableError) as refused:
                client.create_table("t2", DIM)
            assert "standbys do not hold it" in refused.value.message
            assert "no other copy serves" not in refused.value.message
        finally:
            cluster.processes[1].send_signal(signal.SIGCONT)


def test_admin_writes_after_every_process_of_a_shard_restarted_fail_data_loss(
    tmp_path: Path,
) -> None:
    """Every process of a shard's replica set killed and restarted (new
    lineages, the standbys refusing trainers): a save and a table change
    fail DataLossError, as the data plane does, not UNAVAILABLE after a
    request timeout spent waiting for a copy of the lineage met."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        client, ids, _ = _trained_with_standby(cluster, 0, 100)
        client = tf_dlt.Client(cluster.addresses, request_timeout=5)
        client.list_tables()
        for process in range(2):
            cluster.kill(process)
        for process in range(2):
            cluster.restart(process)
        wait_until(lambda: _serves(cluster.process_addresses[0]), "the set to serve again")
        with pytest.raises(errors.DataLossError, match="every process of it started since"):
            client.save(str(tmp_path / "ck"))
        with pytest.raises(errors.DataLossError, match="every process of it started since"):
            client.create_table("late", DIM)
        assert manifest_id(tmp_path / "ck") == ""


def test_admin_writes_to_a_primary_stopping_go_on_to_its_standby(tmp_path: Path) -> None:
    """SIGTERM to a primary whose admin port refuses new calls while it
    stops (UNAVAILABLE "the shard is stopping": as while a save in hand
    finishes within --stop-grace; held 3 s here by a hook the shard
    processes load) and whose data plane still greets. A table change and
    a save sent then go to the standby once it takes over; before, the
    client took the stopping copy's refusal for its own and raised it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import time\n"
        "from tf_dlt.server import admin_server\n"
        "stop = admin_server.AdminServer.stop\n"
        "def slow_stop(self, grace_s):\n"
        "    self._stopping = True\n"
        "    time.sleep(3)\n"
        "    return stop(self, grace_s)\n"
        "admin_server.AdminServer.stop = slow_stop\n"
    )
    env = {"PYTHONPATH": f"{hook}:{Path(tf_dlt.__file__).parent.parent}"}
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2, env=env) as cluster:
        _, ids, rows = _trained_with_standby(cluster, 0, 100)
        client = tf_dlt.Client(cluster.addresses, request_timeout=20)
        client.list_tables()
        cluster.processes[0].send_signal(signal.SIGTERM)

        def refusing() -> bool:
            import grpc

            from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc

            admin = f"127.0.0.1:{cluster.admin_ports[0]}"
            with grpc.insecure_channel(admin) as channel:
                try:
                    dlt_pb2_grpc.ShardAdminStub(channel).ListTables(
                        dlt_pb2.ListTablesRequest(), timeout=5
                    )
                except grpc.RpcError as e:
                    return "the shard is stopping" in (e.details() or "")
            return False

        wait_until(refusing, "the primary's admin port to refuse calls as it stops")
        client.create_table("late", DIM)
        client.save(str(tmp_path / "ck"))
        assert sorted(client.list_tables()) == ["emb", "late"]
        client.push("emb", ids, np.ones((len(ids), DIM), np.float32), 0.1)
        client.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(client.pull("emb", ids), rows)


def test_admin_calls_follow_the_data_plane_off_a_silent_primary(tmp_path: Path) -> None:
    """A primary paused (SIGSTOP) for good. A trainer's saves, loads and
    table changes go to the standby that took over once its pulls went
    there; a client that pulls nothing finds that standby while its call
    waits (a table change, Stats, ListTables) and sends the call there.
    Before, both waited on the silent primary's admin port until their
    deadline (a save: the persist timeout, an hour by default)."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        standby = cluster.process_addresses[1]
        _, ids, _ = _trained_with_standby(cluster, 0, 200)
        trainer = tf_dlt.Client(cluster.addresses, request_timeout=20, persist_timeout=20)
        trainer.pull("emb", ids)  # both planes met the primary
        reader = tf_dlt.Client(cluster.addresses, request_timeout=20)
        reader.stats()
        cluster.processes[0].send_signal(signal.SIGSTOP)
        try:
            reader.create_table("early", DIM)  # sent to the standby once it took over
            assert _serves(standby)
            trainer.push("emb", ids, np.ones((200, DIM), np.float32), 0.1)  # on the new primary
            rows = trainer.pull("emb", ids)
            trainer.save(str(tmp_path / "ck"))
            trainer.create_table("late", DIM)
            trainer.push("emb", ids, np.ones((200, DIM), np.float32), 0.1)
            trainer.load(str(tmp_path / "ck"))
            np.testing.assert_array_equal(trainer.pull("emb", ids), rows)
            assert reader.stats()[0]["takeovers"] == 1
            assert sorted(reader.list_tables()) == ["early", "emb", "late"]
        finally:
            cluster.processes[0].send_signal(signal.SIGCONT)


def test_a_drop_table_sent_on_to_the_copy_that_took_over_finds_it_done(tmp_path: Path) -> None:
    """A DropTable sent to a primary that went silent is sent on to the
    standby that took over. The primary may have dropped the table, and its
    standby with it, before it went silent: the copy serving then holds no
    such table, and the drop is done. Before, it raised NotFoundError. Here
    another client dropped it just before the pause; the copy serving cannot
    tell the two apart, nor can the client."""
    with LocalCluster(
        1, "--takeover-after", "4", workdir=tmp_path / "cluster", replicas=2
    ) as cluster:
        _trained_with_standby(cluster, 0, 200)
        writer = tf_dlt.Client(cluster.addresses, request_timeout=30)
        writer.create_table("gone", DIM)
        reader = tf_dlt.Client(cluster.addresses, request_timeout=30)
        reader.stats()
        writer.drop_table("gone")
        wait_until(lambda: _caught_up(cluster, 0), "the standby to catch up")
        cluster.processes[0].send_signal(signal.SIGSTOP)
        try:
            reader.drop_table("gone")  # sent on once the standby took over
            assert _serves(cluster.process_addresses[1])
            with pytest.raises(errors.NotFoundError, match="gone"):
                reader.drop_table("gone")  # a drop sent once is told the truth
        finally:
            cluster.processes[0].send_signal(signal.SIGCONT)


def test_an_async_primarys_load_is_acknowledged_once_its_standby_holds_it(tmp_path: Path) -> None:
    """With --replication async a push is acknowledged at once, but a load
    (and a table change) waits for the standbys to hold it: a primary killed
    right after a load left its standby, still copying the loaded table, to
    take over with the rows of before the load, the load silently undone. A
    standby that does not answer still fails no async write: it is
    acknowledged after the standby timeout, as before."""
    with LocalCluster(
        1, "--replication", "async", "--standby-timeout", "2",
        workdir=tmp_path / "cluster", replicas=2,
    ) as cluster:  # fmt: skip
        client = tf_dlt.Client(cluster.addresses, request_timeout=20)
        client.create_table("emb", 16, optimizer="adagrad")
        ids = np.arange(200_000, dtype=np.int64)
        client.push("emb", ids, np.ones((len(ids), 16), np.float32), 0.1)
        client.save(str(tmp_path / "ck"))
        saved = client.pull("emb", ids)
        client.push("emb", ids, np.ones((len(ids), 16), np.float32), 0.1)
        wait_until(lambda: _caught_up(cluster, 0), "the standby to catch up")
        cluster.processes[1].send_signal(signal.SIGSTOP)
        try:
            client.create_table("made_while_stalled", DIM)  # acknowledged all the same
        finally:
            cluster.processes[1].send_signal(signal.SIGCONT)
        wait_until(lambda: _caught_up(cluster, 0), "the standby to catch up again")
        client.load(str(tmp_path / "ck"))
        cluster.kill(0)  # at once: the standby takes over
        np.testing.assert_array_equal(client.pull("emb", ids), saved)


def test_tf_dlt_stats_of_a_standby_listed_alone_shows_its_own(
    replicated: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """A standby serves no trainer, so no client can be made of it; `tf-dlt
    stats` listing it alone shows its own Stats (from its admin plane)."""
    cluster = replicated
    tf_dlt.Client(cluster.addresses).create_table("emb", DIM)
    wait_until(lambda: _caught_up(cluster, 0), "the standby to catch up")
    primary, standby = cluster.process_addresses[0], cluster.process_addresses[2]
    assert cli.main(["stats", "--pservers", standby]) == 0
    out, err = capsys.readouterr()
    assert "here is a standby" in err and "each one's own stats follow" in err
    assert f"shard 0: standby of {primary}: caught up (epoch 1, lineage" in out
    assert "read-only, serving" not in out  # it said "serving  (save )" too
    assert cli.main(["stats", "--pservers", "127.0.0.1:1"]) == 1  # nothing answers: an error


def test_a_standby_serves_no_trainer_and_reports_its_primary(replicated: LocalCluster) -> None:
    cluster = replicated
    with pytest.raises(errors.UnavailableError, match="standby"):
        tf_dlt.Client([cluster.process_addresses[2]]).pull("emb", np.arange(3))
    # Its admin plane answers Stats, and refuses writes.
    stats = tf_dlt.Client(cluster.addresses).stats()
    assert [s["role"] for s in stats] == ["primary", "primary"]
    assert stats[0]["replication"] == "sync"


@pytest.mark.parametrize("failure", ["kill", "silence"])
def test_fit_goes_on_across_a_failed_primary_with_every_row_as_without(
    tmp_path,  # type: ignore[no-untyped-def]
    failure: str,
) -> None:
    """model.fit on 2 shards with sync standbys, sync pushes; one primary
    fails mid-epoch, by kill -9 (its connections reset) or by going silent
    (SIGSTOP: connections stay open and nothing answers, as when a host
    loses power or its network): fit raises nothing, reloads nothing, and
    every row, optimizer slot and step equals a run without the failure; a
    save after the takeover works."""
    import keras

    from conftest import assert_same_training, fit_data, fit_outcome, two_table_model

    data = fit_data()
    model = two_table_model(DIM)

    class FailAt(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self, cluster: LocalCluster, batch: int) -> None:
            super().__init__()
            self.cluster, self.batch, self.failed = cluster, batch, False

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if batch == self.batch and not self.failed:
                self.failed = True
                if failure == "kill":
                    self.cluster.kill(1)
                else:
                    self.cluster.processes[1].send_signal(signal.SIGSTOP)

    results = []
    for fail in (False, True):
        with LocalCluster(2, workdir=tmp_path / f"fail{fail}", replicas=2) as cluster:
            try:
                remote = tf_dlt.transpile(model, cluster.addresses)
                for name in ("u", "i"):
                    remote.get_layer(name).sync_push = True
                callbacks = [FailAt(cluster, 13)] if fail else []
                history = remote.fit(data, epochs=2, verbose=0, callbacks=callbacks)
                if fail:  # shard 1's primary failed; its standby served the rest
                    assert _stats(cluster, 1)["takeovers"] == 1
                path = str(tmp_path / f"ckpt{fail}")
                results.append(fit_outcome(history, remote, cluster.addresses, path))
            finally:
                cluster.kill(1)  # a stopped process answers no SIGTERM
    assert_same_training(*results)
    assert results[0][2] == results[1][2]


def test_a_model_save_never_reaches_a_primary_restarted_empty(tmp_path: Path) -> None:
    """tf_dlt.save makes a client for each save, which would take a primary
    restarted empty at its address (the newest copy that greets, before its
    standby took over): the save carries the lineage the model's op clients
    met, so it waits for the standby and holds every row trained. Before,
    it failed (NotFoundError: the restart held none of the model's tables;
    a Client.save naming no tables committed an empty shard there)."""
    from conftest import fit_data, staged_rows, two_table_model

    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        remote = tf_dlt.transpile(two_table_model(DIM), cluster.addresses)
        remote.fit(fit_data(batches=8), epochs=1, verbose=0)
        wait_until(lambda: _caught_up(cluster, 0), "the standby")
        tf_dlt.Client(cluster.addresses).save(str(tmp_path / "before"))
        cluster.kill(0)
        cluster.restart(0, rejoin=False)  # empty, at the same address, at once
        tf_dlt.save(remote, str(tmp_path / "model"))
        trained = staged_rows(str(tmp_path / "before"), 1)
        assert len(trained["u"]) > 50 and len(trained["i"]) > 50
        assert staged_rows(str(tmp_path / "model" / "tables"), 1) == trained


def test_a_complaint_that_repeats_is_logged_once_in_a_while(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A standby that cannot attach (or take over) says so the first time,
    then once every 30 s with how often it came meanwhile (it logged every
    0.5 s, or 0.2 s, for as long as it lasted)."""
    now = [100.0]
    repeated = Repeated(replication.log, every_s=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=replication.log.name):
        for _ in range(10):
            repeated.log("attach", logging.WARNING, "standby: %s; trying again", "refused")
            now[0] += 0.5
        now[0] += 30.0
        repeated.log("attach", logging.WARNING, "standby: %s; trying again", "refused")
        repeated.log("not caught up", logging.ERROR, "not taking over")
        repeated.log("attach", logging.WARNING, "standby: %s; trying again", "refused")  # in turn
        repeated.clear()  # over: said again at once when it comes back
        repeated.log("attach", logging.WARNING, "standby: %s; trying again", "refused")
    assert [r.getMessage() for r in caplog.records] == [
        "standby: refused; trying again",
        "standby: refused; trying again (and 9 times in the last 35 s)",
        "not taking over",
        "standby: refused; trying again",
    ]


@pytest.mark.unit
def test_a_standby_stopping_with_its_primary_says_so_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At a launch's end the primary stops as its standby tells it it
    stops: the primary's server cancels that call, which was logged as a
    WARNING ("could not tell ... CANCELLED") on every clean shutdown, as
    if something had failed. It is the same as a primary that stops too."""
    from concurrent import futures

    import grpc

    from tf_dlt.proto import dlt_pb2_grpc

    class Stopping(dlt_pb2_grpc.ShardAdminServicer):  # type: ignore[misc]
        def AttachStandby(self, request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    server = grpc.server(futures.ThreadPoolExecutor(1))
    dlt_pb2_grpc.add_ShardAdminServicer_to_server(Stopping(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        link = replication.StandbyLink(
            "127.0.0.1:1", "127.0.0.1:2", 0, 1, "", take_over=lambda: None,
            caught_up=lambda: True,
        )  # fmt: skip
        link._incarnation, link._admin = 7, f"127.0.0.1:{port}"  # attached once
        with caplog.at_level(logging.INFO, logger="tf_dlt"):
            link._leave()
        said = [(r.levelno, r.getMessage()) for r in caplog.records]
        assert said and all(level == logging.INFO for level, _ in said), said
        assert "as this standby stops" in said[-1][1]
        link._close_channel()
    finally:
        server.stop(None)


def _exit_within(args: list[str], seconds: float) -> tuple[int | None, str]:
    """Runs `tf-dlt server ARGS`: its exit code (None: still running after
    `seconds`, then stopped) and its log."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_dlt.server", "--bind", "127.0.0.1", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=seconds)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return None, out


@pytest.mark.parametrize("flags", ["replica_set_without_port", "advertise_without_port"])
def test_a_peer_address_without_a_port_is_refused_at_start(flags: str) -> None:
    """A replica set's member or a standby's --advertise without its port
    (`--replica-set "h:7000|h"`, `--advertise h`) was taken: the member
    logged "must be host:port" and stayed "joining" for good; the standby
    attached under an address its primary never reached, and every sync
    push failed in doubt. Refused at start (exit 2), as --standby-of is."""
    port = free_port()
    own = f"127.0.0.1:{port}"
    primary = None
    if flags == "replica_set_without_port":
        args = ["--port", str(port), "--replica-set", f"{own}|127.0.0.1", "--advertise", own]
    else:
        primary = ShardServer(0, 1).start()
        args = ["--port", str(port), "--standby-of", primary.address, "--advertise", "nohost"]
    try:
        code, out = _exit_within(args, 15)
    finally:
        if primary is not None:
            primary.stop(0)
    assert code == 2 and "must be host:port" in out, f"exit code {code}; log:\n{out[-1500:]}"


def _push_error(client: tf_dlt.Client) -> str:
    """ "" when a push goes through, else its error."""
    try:
        client.push("emb", np.arange(10), np.ones((10, 4), np.float32), 0.1)
    except errors.DltError as e:
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.mark.parametrize("mistake", ["advertises_its_primary", "token_its_primary_lacks"])
def test_a_standby_its_primary_cannot_replicate_to_is_refused_and_stops_no_write(
    mistake: str,
) -> None:
    """A standby whose --advertise names its primary (on two hosts it
    happens by default: `--bind 0.0.0.0` and one port on both advertise
    127.0.0.1:PORT), or one given a token its primary lacks: the primary
    attached it (itself, in the first case), could never replicate to it,
    and every sync push of the healthy primary failed "in doubt" for as long
    as the standby ran (the last standby is never detached). The primary now
    greets a standby before attaching it: the attach is refused, the
    standby's stats say why, and writes go on."""
    primary = ShardServer(0, 1).start()
    standby = None
    try:
        client = tf_dlt.Client([primary.address], request_timeout=5)
        client.create_table("emb", 4)
        if mistake == "advertises_its_primary":
            standby = ShardServer(
                0, 1, standby_of=primary.address, advertise=f"localhost:{primary.port}"
            ).start()
            said = "does not answer as a standby"
        else:
            standby = ShardServer(0, 1, auth_token="tok", standby_of=primary.address).start()
            said = "cannot greet standby"
        link = standby.servicer.standby_link
        wait_until(lambda: said in link.error, "the standby's attach to be refused")
        assert _push_error(client) == ""
        assert not replication.member_stats(primary.address, primary.admin_port, "").standbys
        assert not _native.hello(primary.address, "", timeout_ms=1000)["standbys"]
        token = "tok" if mistake == "token_its_primary_lacks" else ""
        stats = replication.member_stats(standby.address, standby.admin_port, token)
        assert said in stats.standby_error
    finally:
        if standby is not None:
            standby.stop(0)
        primary.stop(0)


@pytest.mark.parametrize("address", ["", "nohost", "127.0.0.1:0", "127.0.0.1:1|127.0.0.1:2"])
def test_attach_standby_refuses_an_address_that_is_not_host_port(address: str) -> None:
    """AttachStandby took any string, even "a:1|b:2", which the primary
    published in its Hello's "|"-separated standbys (clients learned two
    made-up standbys). INVALID_ARGUMENT now, and nothing attached."""
    from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc

    primary = ShardServer(0, 1).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{primary.admin_port}") as channel:
            stub = dlt_pb2_grpc.ShardAdminStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.AttachStandby(
                    dlt_pb2.AttachStandbyRequest(address=address, shard_index=0, num_shards=1),
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not _native.hello(primary.address, "", timeout_ms=1000)["standbys"]
    finally:
        primary.stop(0)


def test_tf_dlt_stats_of_a_standby_that_cannot_attach_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A standby started with the wrong --shard-index (1 of 2 behind shard
    0's primary): `tf-dlt stats` of it said only "not caught up: it may not
    take over yet", as of one still copying, and its primary's stats show
    no standby. It now shows why it does not follow."""
    primary = ShardServer(0, 2).start()
    standby = ShardServer(1, 2, standby_of=primary.address).start()
    try:
        wait_until(lambda: standby.servicer.standby_link.error, "the standby's first attach")
        assert cli.main(["stats", "--pservers", standby.address]) == 0
        out = capsys.readouterr().out
        assert "not caught up" in out and "shard 0 of 2" in out, out[-800:]
    finally:
        standby.stop(0)
        primary.stop(0)
