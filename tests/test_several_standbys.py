"""Shards with several hot standbys (docs/replication.md, "Several
standbys"), with real shard processes: writes are acknowledged once every
standby of the in-sync set holds them and go on while one standby is down;
when the primary dies exactly one standby takes over and the others follow
it; a standby the primary left out of the in-sync set never takes over."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tf_dlt
from tf_dlt import _native, errors
from tf_dlt.server import replication
from tf_dlt.server.local import LocalCluster
from tf_dlt.server.shard_server import ShardServer
from tf_dlt.tools import cluster_stats

from conftest import free_port, freeze, wait_until

DIM = 8
IDS = np.arange(600, dtype=np.int64)


def _stats_of(cluster: LocalCluster, process: int) -> Any:
    """Stats of one process (primary or standby), by its admin port."""
    return replication.member_stats(
        cluster.process_addresses[process], cluster.admin_ports[process], ""
    )


def _all_caught_up(cluster: LocalCluster, primary: int, standbys: list[int]) -> bool:
    stats = _stats_of(cluster, primary)
    caught_up = {s.address for s in stats.standbys if s.caught_up}
    return {cluster.process_addresses[p] for p in standbys} <= caught_up and len(
        stats.insync
    ) == len(standbys)


def test_greetings_of_standbys_are_not_counted_among_their_errors(tmp_path: Path) -> None:
    """Before each admin write a client greets every copy of the shard, to
    write to the one serving at the newest epoch. A standby refuses a
    trainer's Hello; it counted the refusal among its errors: one per write
    per standby, an error count that told an operator nothing."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=3) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM)
        wait_until(lambda: _all_caught_up(cluster, 0, [1, 2]), "both standbys to catch up")
        for i in range(3):
            client.create_table(f"t{i}", DIM)
            client.drop_table(f"t{i}")
        for standby in (1, 2):
            assert dict(_stats_of(cluster, standby).errors) == {}, standby


def _train(client: tf_dlt.Client, seed: int, steps: int = 4) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = rng.choice(IDS, 256)
        client.push("emb", batch, rng.normal(size=(256, DIM)).astype(np.float32), 0.1)


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_standby_stopped_leaves_and_writes_go_on_without_it(
    tmp_path: Path, replicas: int
) -> None:
    """A standby stopped with SIGTERM (a planned restart, a rolling update)
    tells its primary, which stops replicating to it at once. Its last
    standby: the primary's pushes and table changes failed UNAVAILABLE, in
    doubt, until the standby came back (for good while it stayed down, as
    the last standby is never detached); now they go on, the primary alone
    holding them, and the standby started again is copied afresh and holds
    every row when it takes over. One of two: the primary listed it, down,
    until --detach-standby-after (a minute), and each write waited the
    standby timeout before it left the in-sync set."""
    with LocalCluster(
        1, "--standby-timeout", "2", workdir=tmp_path / "cluster", replicas=replicas
    ) as cluster:
        client = tf_dlt.Client(cluster.addresses, request_timeout=10)
        client.create_table("emb", DIM, optimizer="adagrad")
        others = list(range(2, replicas))
        wait_until(lambda: _all_caught_up(cluster, 0, [1, *others]), "the standbys to catch up")
        _train(client, 0)
        cluster.processes[1].send_signal(signal.SIGTERM)
        assert cluster.processes[1].wait(30) == 0
        listed = {s.address for s in _stats_of(cluster, 0).standbys}
        assert listed == {cluster.process_addresses[p] for p in others}
        _train(client, 1)  # acknowledged by the primary (and the standby left)
        client.create_table("made_alone", DIM)
        rows = client.pull("emb", IDS)
        cluster.restart(1)
        wait_until(lambda: _all_caught_up(cluster, 0, [1, *others]), "the standby copied afresh")
        cluster.kill(0)  # a standby takes over (with two, either: both hold every row)
        np.testing.assert_array_equal(client.pull("emb", IDS), rows)
        assert sorted(client.list_tables()) == ["emb", "made_alone"]


def test_a_standby_left_out_before_the_last_one_stopped_never_takes_over(tmp_path: Path) -> None:
    """B is frozen and left out of the in-sync set (then detached); C, the
    last standby, stops and leaves; C started again catches up and holds
    every write. The primary dies and B wakes: C takes over, not B. Where
    the primary made a new replica group for C (its in-sync set's version
    counted from 0 again), B's old view outranked C's, C granted B's claim,
    and B served its stale rows: the writes acknowledged since were lost."""

    def push(client: tf_dlt.Client) -> None:
        client.push("emb", IDS[:64], np.ones((64, DIM), np.float32), 1.0)

    with LocalCluster(
        1, "--detach-standby-after", "2", "--standby-timeout", "1",
        workdir=tmp_path / "cluster", replicas=3,
    ) as cluster:  # fmt: skip
        client = tf_dlt.Client(cluster.addresses, request_timeout=20)
        client.create_table("emb", DIM, optimizer="sgd", initializer="zeros")
        wait_until(lambda: _all_caught_up(cluster, 0, [1, 2]), "both standbys to catch up")
        push(client)
        cluster.processes[1].send_signal(signal.SIGSTOP)
        b = cluster.process_addresses[1]
        try:
            # B leaves the in-sync set at the next push, and is detached.
            wait_until(
                lambda: (
                    push(client) or b not in {s.address for s in _stats_of(cluster, 0).standbys}
                ),
                "the frozen standby to be detached",
            )
            cluster.processes[2].send_signal(signal.SIGTERM)
            assert cluster.processes[2].wait(30) == 0
            push(client)  # the primary alone
            cluster.restart(2)
            wait_until(lambda: _all_caught_up(cluster, 0, [2]), "C copied afresh")
            push(client)
            rows = client.pull("emb", IDS[:64])
            cluster.kill(0)
        finally:
            cluster.processes[1].send_signal(signal.SIGCONT)
        np.testing.assert_array_equal(client.pull("emb", IDS[:64]), rows)
        assert _stats_of(cluster, 2).role == "primary"


def test_one_of_two_standbys_takes_over_and_the_other_follows_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with LocalCluster(
        1, "--metrics-port", "0", workdir=tmp_path / "cluster", replicas=3
    ) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, optimizer="adagrad")
        wait_until(lambda: _all_caught_up(cluster, 0, [1, 2]), "both standbys to catch up")

        # Each standby was told the in-sync set naming both, and holds the new
        # table. A standby's own flag goes false while it takes a table made
        # after its first copy, or copies the tables again after a round cut
        # short (a slow CI machine), and true at that round's end; the
        # primary's status of it does not wait for that. So all of it is
        # read in one look.
        def told_both() -> bool:
            primary = _stats_of(cluster, 0)
            return len(primary.insync) == 2 and all(
                list(told.insync) == list(primary.insync)
                and told.role == "standby"
                and told.caught_up
                for told in (_stats_of(cluster, 1), _stats_of(cluster, 2))
            )

        wait_until(told_both, "both standbys to hold the new table and the in-sync set")
        primary = _stats_of(cluster, 0)
        text = cluster_stats.format_stats(client.stats(), cluster.addresses)
        assert f"shard 0: in sync: {', '.join(primary.insync)}" in text
        assert len(primary.insync) == 2
        metrics = (
            urllib.request.urlopen(
                f"http://127.0.0.1:{cluster.metrics_ports[0]}/metrics", timeout=10
            )
            .read()
            .decode()
        )
        assert "tf_dlt_insync_standbys 2.0" in metrics
        _train(client, 1)
        before = client.pull("emb", IDS)

        cluster.kill(0)
        np.testing.assert_array_equal(client.pull("emb", IDS), before)

        def serving() -> list[int]:
            return [p for p in (1, 2) if _stats_of(cluster, p).role == "primary"]

        wait_until(lambda: bool(serving()), "a standby to take over")
        (new,) = serving()  # exactly one
        (other,) = {1, 2} - {new}
        assert _stats_of(cluster, new).epoch == 2
        # The other follows the new primary, copies it and is in its set.
        wait_until(lambda: _all_caught_up(cluster, new, [other]), "the other standby to follow")
        assert serving() == [new]
        assert _stats_of(cluster, other).standby_of == cluster.process_addresses[new]
        assert "took over from" in cluster.log(other)
        _train(client, 2)  # sync: on both
        before = client.pull("emb", IDS)

        cluster.kill(new)  # the second failure: the last standby takes over
        np.testing.assert_array_equal(client.pull("emb", IDS), before)
        last = _stats_of(cluster, other)
        assert last.role == "primary" and last.epoch == 3


def test_a_standby_that_just_attached_knows_the_others_before_its_first_probe(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """A standby attaching to a primary that dies before the standby's
    first probe: it learned the primary's other standbys from the Hello it
    attached with, so it finds the one that took over and follows it. Before,
    it knew no peer and tried its dead primary for good."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=2) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, optimizer="adagrad")
        wait_until(lambda: _all_caught_up(cluster, 0, [1]), "the first standby")
        primary, first = cluster.process_addresses
        # A data plane that greets as a standby (the primary greets one
        # before it attaches it), driven by this link.
        standby = _native.DataServer(_native.Shard(0, 1), bind="127.0.0.1", worker_threads=1)
        standby.set_standby(True)
        standby.start()
        link = replication.StandbyLink(
            primary, f"127.0.0.1:{standby.port}", 0, 1, "",
            take_over=lambda: None, caught_up=lambda: False,
        )  # fmt: skip
        try:
            link._attach()
            assert link.known_peers() == [first]
            cluster.kill(0)
            wait_until(lambda: link._serving_peer() == first, "the first standby to take over")
        finally:
            link.stop()
            standby.stop()


def test_a_standby_the_primary_left_out_never_takes_over(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A standby that stops answering (frozen) leaves the in-sync set: the
    writes after it are acknowledged by the other alone, which was told
    the set without it first. The primary then dies and the frozen one
    wakes: it holds a whole copy but lacks those writes, so it must not take
    over; the other does, with every write acknowledged. The pushes stall
    for --standby-timeout (2 s), not the I/O timeout (30 s), and so stay
    within the client's request deadline (10 s)."""
    with LocalCluster(
        1, "--standby-timeout", "2", workdir=tmp_path / "cluster", replicas=3
    ) as cluster:
        client = tf_dlt.Client(cluster.addresses, request_timeout=10.0)
        client.create_table("emb", DIM, optimizer="adagrad")
        wait_until(lambda: _all_caught_up(cluster, 0, [1, 2]), "both standbys to catch up")
        _train(client, 3)
        # Freeze the one that comes first in the set: it would be chosen.
        first = cluster.process_addresses.index(_stats_of(cluster, 0).insync[0])
        (second,) = {1, 2} - {first}
        freeze(cluster.processes[first])
        try:
            _train(client, 4)  # acknowledged once the frozen one is out of the set
            primary = _stats_of(cluster, 0)
            assert list(primary.insync) == [cluster.process_addresses[second]]
            told = _stats_of(cluster, second)
            assert list(told.insync) == [cluster.process_addresses[second]]
            assert told.insync_version == primary.insync_version
            before = client.pull("emb", IDS)
            cluster.kill(0)
        finally:
            cluster.processes[first].send_signal(signal.SIGCONT)
        np.testing.assert_array_equal(client.pull("emb", IDS), before)
        wait_until(lambda: _stats_of(cluster, second).role == "primary", "the other to take over")
        # The frozen one follows the one that took over instead of serving.
        wait_until(lambda: _all_caught_up(cluster, second, [first]), "the frozen one to follow")
        assert _stats_of(cluster, first).role == "standby"
        assert ": taking over" not in cluster.log(first)
        fresh = tf_dlt.Client(cluster.addresses)
        np.testing.assert_array_equal(fresh.pull("emb", IDS), before)


def test_a_primary_frozen_past_a_takeover_is_fenced_when_it_wakes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The primary freezes (a long pause) past the takeover: one standby
    takes over at epoch 2 and the other follows it. The old primary wakes
    holding connections to both: the follower, which promised the takeover,
    takes none of its rounds and tells it the newer epoch, so it takes no
    standby back, acknowledges no write and answers trainers UNAVAILABLE
    (role "replaced"); the new primary keeps its standby and every write."""
    with LocalCluster(1, "--io-timeout", "2", workdir=tmp_path / "cluster", replicas=3) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, optimizer="adagrad")
        wait_until(lambda: _all_caught_up(cluster, 0, [1, 2]), "both standbys to catch up")
        _train(client, 5)

        def serving() -> list[int]:
            return [p for p in (1, 2) if _stats_of(cluster, p).role == "primary"]

        cluster.processes[0].send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: bool(serving()), "a standby to take over")
            (new,) = serving()
            (other,) = {1, 2} - {new}
            wait_until(lambda: _all_caught_up(cluster, new, [other]), "the other standby to follow")
        finally:
            cluster.processes[0].send_signal(signal.SIGCONT)
        wait_until(lambda: _stats_of(cluster, 0).role == "replaced", "the old primary to be fenced")
        with pytest.raises(errors.UnavailableError, match="was replaced") as refused:
            _native.hello(cluster.process_addresses[0], "", timeout_ms=5000)
        # It names a standby that follows the new primary, or the new one.
        assert any(cluster.process_addresses[p] in str(refused.value) for p in (1, 2))
        wait_until(lambda: "this primary was replaced" in cluster.log(0), "the replacement logged")
        _train(client, 6)  # sync: on the new primary and its standby
        before = client.pull("emb", IDS)
        assert _all_caught_up(cluster, new, [other])
        assert _stats_of(cluster, other).standby_of == cluster.process_addresses[new]
        cluster.kill(new)  # the follower takes over with every write
        np.testing.assert_array_equal(client.pull("emb", IDS), before)
        assert _stats_of(cluster, other).role == "primary"


def test_a_standby_down_when_the_primary_dies_is_waited_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The primary dies while another standby is down (not yet detached):
    that one might hold a newer in-sync set, so the survivor does not take
    over until it answers; restarted (it answers holding nothing), the
    survivor takes over with every acknowledged row and it follows."""
    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=3) as cluster:
        client = tf_dlt.Client(cluster.addresses)
        client.create_table("emb", DIM, optimizer="adagrad")
        wait_until(lambda: _all_caught_up(cluster, 0, [1, 2]), "both standbys to catch up")
        _train(client, 5)
        cluster.kill(2)
        # A write after it died is acknowledged by the survivor alone: its
        # round tells the survivor the in-sync set without the dead one, so
        # the survivor knows that one only from its primary's Hellos (it is
        # attached until --detach-standby-after). Killed sooner, the primary
        # may die before any Hello named it: then the survivor knows a set
        # leaving it out and rightly takes over at once.
        _train(client, 6, steps=1)
        down = cluster.process_addresses[2]
        wait_until(
            lambda: (
                down not in _stats_of(cluster, 1).insync and down in _stats_of(cluster, 1).peers
            ),
            "the survivor to hear of the down standby only from its primary's Hello",
        )
        before = client.pull("emb", IDS)
        cluster.kill(0)
        wait_until(lambda: "does not answer" in cluster.log(1), "the survivor to wait")
        time.sleep(2.0)  # several more probes: still waiting
        assert _stats_of(cluster, 1).role == "standby"
        cluster.restart(2)  # rejoins (--replica-set), holding nothing
        wait_until(lambda: _stats_of(cluster, 1).role == "primary", "the survivor to take over")
        np.testing.assert_array_equal(client.pull("emb", IDS), before)
        wait_until(lambda: _all_caught_up(cluster, 1, [2]), "the restarted one to follow")


def test_a_replica_set_of_three_started_out_of_order_elects_the_first() -> None:
    """Three members of a shard start with --replica-set, the first of the
    list seconds after the others (pods scheduled apart): the others do not
    begin while the first may still come, and once it does it begins and
    both follow it: one primary, never two."""
    ports = [free_port() for _ in range(3)]
    members = [f"127.0.0.1:{p}" for p in ports]
    servers = [
        ShardServer(0, 1, port=p, replica_set=members, advertise=m, takeover_after_s=1.0)
        for p, m in zip(ports, members, strict=True)
    ]
    try:
        servers[2].start()
        servers[1].start()
        time.sleep(3.0)  # several surveys: the first does not answer yet
        assert [s.servicer.snapshot()["role"] for s in servers[1:]] == ["joining", "joining"]
        servers[0].start()
        wait_until(
            lambda: (
                servers[0].servicer.snapshot()["role"] == "primary"
                and all(s.servicer.snapshot().get("caught_up") for s in servers[1:])
            ),
            "the first to begin and the others to follow it",
        )
        assert [s.servicer.snapshot()["role"] for s in servers] == [
            "primary", "standby", "standby",
        ]  # fmt: skip
        client = tf_dlt.Client(["|".join(members)])
        client.create_table("emb", DIM)
        client.push("emb", IDS[:10], np.ones((10, DIM), np.float32), 0.1)
        assert client.stats()[0]["data_port"] == ports[0]
    finally:
        for server in servers:
            server.stop(0)


def test_a_save_sent_on_after_a_kill_is_watched_like_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two failures in a row: a Save's primary is killed, the Save goes on to
    the standby that took over, and that one goes silent (SIGSTOP, as the
    Save reaches it) until the other standby takes over from it. The Save
    there is given up within seconds, as a first call would be, and
    `Client.save` makes it once more under a new save id, on the third copy,
    with every row. Before, the call sent on was not watched: it waited on
    the silent copy until its connection timed out (20 s) or, connected,
    the persist timeout, and never went on to the third copy."""
    import tf_dlt.client as client_module

    with LocalCluster(1, workdir=tmp_path / "cluster", replicas=3) as cluster:
        client = tf_dlt.Client(cluster.addresses, persist_timeout=60)
        client.create_table("emb", DIM, optimizer="adagrad")
        wait_until(lambda: _all_caught_up(cluster, 0, [1, 2]), "both standbys to catch up")
        _train(client, 0)
        rows = client.pull("emb", IDS)
        process_at = {a: i for i, a in enumerate(cluster.process_addresses)}
        frozen: list[int] = []
        reresolve = client_module.Client._reresolve

        def freezing(self: tf_dlt.Client, shard: int, *args: Any, **kwargs: Any) -> Any:
            stub = reresolve(self, shard, *args, **kwargs)
            if not frozen:  # the copy the Save goes on to goes silent, once followed
                serving = process_at[self._admins[shard].at]
                wait_until(
                    lambda: _all_caught_up(cluster, serving, [3 - serving]),
                    "the other standby to follow the one that took over",
                )
                frozen.append(serving)
                cluster.processes[serving].send_signal(signal.SIGSTOP)
            return stub

        monkeypatch.setattr(client_module.Client, "_reresolve", freezing)
        cluster.processes[0].send_signal(signal.SIGSTOP)  # the Save to it hangs ...
        try:
            outcome: list[Any] = []

            def save() -> None:
                try:
                    outcome.append(client.save(str(tmp_path / "ck")))
                except errors.DltError as e:
                    outcome.append(e)

            saving = threading.Thread(target=save)
            saving.start()
            time.sleep(0.3)
            cluster.kill(0)  # ... until it dies: UNAVAILABLE, and on to the next copy
            saving.join(45)
            assert not saving.is_alive()
            assert frozen and frozen[0] in (1, 2)
            assert isinstance(outcome[0], dict), outcome
            monkeypatch.undo()
            client.push("emb", IDS, np.ones((len(IDS), DIM), np.float32), 0.1)
            client.load(str(tmp_path / "ck"))
            np.testing.assert_array_equal(client.pull("emb", IDS), rows)
        finally:
            for process in frozen:
                cluster.processes[process].send_signal(signal.SIGCONT)
