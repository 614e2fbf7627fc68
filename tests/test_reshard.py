"""Live re-sharding with real shard processes (docs/replication.md): the
tables move from 2 shards to 3 and back while a trainer pushes, through
`tf-dlt reshard` and `tf_dlt.Client.reshard`; no push fails, and every row
and optimizer slot at the end equals every push applied once, in order, to
one table. A re-shard whose new process dies before the switch aborts: the
old layout serves on with every row."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

import tf_dlt
from tf_dlt import _native, errors, grpc_util, routing
from tf_dlt import reshard as resharding
from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc
from tf_dlt.server.local import LocalCluster
from tf_dlt.server.replication import member_stats
from tf_dlt.server.shard_server import ShardServer
from tf_dlt.table_config import TableConfig
from tf_dlt.tools import cli

from conftest import wait_until

DIM = 8
IDS = np.arange(5000, dtype=np.int64)


@pytest.fixture
def cluster(tmp_path) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    with LocalCluster(2, workdir=tmp_path / "cluster") as c:
        yield c


class Trainer:
    """Pushes seeded batches through its own client until stopped, keeping
    each push and any error."""

    def __init__(self, addresses: list[str]) -> None:
        self.client = tf_dlt.Client(addresses, request_timeout=20.0)
        self.pushes: list[tuple[np.ndarray, np.ndarray]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = np.random.default_rng(3)
        while not self._stop.is_set():
            ids = rng.choice(IDS, 256)
            grads = rng.normal(size=(256, DIM)).astype(np.float32)
            try:
                self.client.push("emb", ids, grads, 0.05)
            except errors.DltError as e:
                self.errors.append(e)
            self.pushes.append((ids, grads))

    def wait_for(self, more: int) -> None:
        want = len(self.pushes) + more
        deadline = time.monotonic() + 60
        while len(self.pushes) < want:
            assert time.monotonic() < deadline, "the trainer made no progress"
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def oracle(self, config: TableConfig) -> np.ndarray:
        """State rows of IDS after every push, once, in order, on one table."""
        shard = _native.Shard(0, 1)
        shard.create_table(config.to_dict())
        table = shard.get_table("emb")
        for ids, grads in self.pushes:
            table.push(ids, grads, 0.05)
        server = _native.DataServer(shard)
        server.start()
        try:
            return _native.Client([f"127.0.0.1:{server.port}"]).pull_state("emb", DIM, DIM, IDS)
        finally:
            server.stop()


class _Passing:
    """A stub for the coordinator whose calls other than those a subclass
    intercepts (Reshard) go to `stub` unchanged."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)


def _intercepted(
    channels: list[grpc.Channel], around: Callable[[str, Any, Callable[[], Any]], Any]
) -> Callable[[str, int], Any]:
    """A `stub_for` for `tf_dlt.reshard.reshard` whose Reshard calls go
    through `around(address, request, send)` (`send()` makes the call); the
    channels it opens are added to `channels`."""

    def stub_for(address: str, admin_port: int) -> Any:
        channels.append(grpc.insecure_channel(grpc_util.admin_address(address, admin_port)))
        stub = dlt_pb2_grpc.ShardAdminStub(channels[-1])

        class Intercepted(_Passing):
            def Reshard(self, request: Any, **kwargs: Any) -> Any:  # noqa: N802
                return around(address, request, lambda: stub.Reshard(request, **kwargs))

        return Intercepted(stub)

    return stub_for


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _state(client: tf_dlt.Client) -> np.ndarray:
    """Values, Adagrad slots and step of every id, through the data plane."""
    return client._data.pull_state("emb", DIM, DIM, IDS)


def test_training_goes_on_through_a_reshard_to_three_shards_and_back(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = tf_dlt.Client(cluster.addresses)
    config = admin.create_table("emb", DIM, optimizer="adagrad", seed=7)
    joined = cluster.join()
    trainer = Trainer(cluster.addresses)
    try:
        _reshard_twice(cluster, admin, trainer, joined, capsys)
    finally:
        trainer.stop()
    assert trainer.errors == []
    np.testing.assert_array_equal(_state(admin), trainer.oracle(config))
    assert admin.num_shards == 2
    assert _native.hello(joined)["layout_epoch"] == 3  # it left, owning nothing
    # Its log lines name the shard it served, then none (it said "serving
    # shard 2 of 2" as it left, under the index it started with).
    log = cluster.log(cluster.process_addresses.index(joined))
    assert "shard-2 INFO re-shard: serving shard 2 of 3 at layout epoch 2" in log
    assert "no-shard INFO re-shard: left out of layout epoch 3 (2 shards)" in log


def _reshard_twice(
    cluster: LocalCluster,
    admin: tf_dlt.Client,
    trainer: Trainer,
    joined: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    trainer.wait_for(20)
    three = [*cluster.addresses, joined]
    with pytest.raises(errors.InvalidArgumentError, match="pace"):
        admin.reshard(three, pace=0)
    # The copies paced: each stream's thread busy half the time at most.
    assert cli.main(["reshard", "--pservers", ",".join(cluster.addresses),
                     "--to", ",".join(three), "--pace", "0.5"]) == 0  # fmt: skip
    assert '"layout_epoch": 2' in capsys.readouterr().out
    # `tf-dlt stats` given the addresses before: it shows the 3 it asked.
    assert cli.main(["stats", "--pservers", ",".join(cluster.addresses)]) == 0
    assert joined in capsys.readouterr().out
    trainer.wait_for(20)
    # The trainer's client follows; so does another client's control plane,
    # once its data plane met the new layout (or within 5 s).
    assert trainer.client._data.layout_epoch == 2
    admin.pull("emb", IDS[:200], training=False)
    stats = admin.stats()
    assert [s["layout_epoch"] for s in stats] == [2, 2, 2]
    assert admin.pservers == three and sum(s["tables"][0]["rows"] for s in stats) > 0
    # Back to two shards: the joined process leaves, owning nothing.
    done = admin.reshard(cluster.addresses)
    assert done["layout_epoch"] == 3 and done["held_s"] < 10
    trainer.wait_for(20)


def test_a_clients_table_changes_and_saves_follow_another_clients_reshard(
    cluster: LocalCluster, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A client whose control plane asked the shards their layout less than
    5 s before another client re-sharded 2 -> 3 sent its writes to the two
    old shards alone: a table it made missed the new shard, one it dropped
    stayed there with its rows (each returned OK), and a save failed after
    two shards wrote their parts. Shards of the newer layout refuse such
    calls before applying them, and the client sends them to the new
    layout's shards."""
    stale = tf_dlt.Client(cluster.addresses)
    stale.create_table("emb", DIM, seed=7)
    stale.create_table("old", DIM, seed=7)
    stale.push("old", IDS, np.ones((len(IDS), DIM), np.float32), 0.1)
    stale.list_tables()  # its layout asked just now
    joined = cluster.join()
    three = [*cluster.addresses, joined]
    assert tf_dlt.Client(cluster.addresses).reshard(three)["layout_epoch"] == 2
    stale.create_table("new", DIM, seed=1)
    stale.drop_table("old")
    saved = stale.save(str(tmp_path / "ckpt"))
    assert stale.pservers == three
    fresh = tf_dlt.Client(three)
    assert [sorted(t["config"]["name"] for t in s["tables"]) for s in fresh.stats()] == [
        ["emb", "new"]
    ] * 3
    assert saved["num_shards"] == 3
    fresh.pull("new", IDS)
    with pytest.raises(errors.NotFoundError):
        fresh.pull("old", IDS)


def test_a_write_whose_client_learns_a_reshard_as_it_sends_goes_to_the_new_layout(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data plane learning the new layout between the control plane's
    stubs and the write (a push from another thread meeting the re-shard)
    sent the write to the old shards carrying the new epoch: they took it,
    and the new shard missed the table. The write carries the epoch its
    stubs are of."""
    stale = tf_dlt.Client(cluster.addresses)
    stale.create_table("emb", DIM, seed=7)
    stale.list_tables()
    joined = cluster.join()
    three = [*cluster.addresses, joined]
    assert tf_dlt.Client(cluster.addresses).reshard(three)["layout_epoch"] == 2
    stubs_of = tf_dlt.Client._admin
    learned: list[bool] = []

    def admin_then_learn(self: tf_dlt.Client) -> Any:
        stubs = stubs_of(self)
        if not learned:  # once, as a concurrent push would
            learned.append(True)
            self._data.learn_layout()
        return stubs

    monkeypatch.setattr(tf_dlt.Client, "_admin", admin_then_learn)
    stale.create_table("new", DIM, seed=1)
    assert learned
    stats = tf_dlt.Client(three).stats()
    assert [sorted(t["config"]["name"] for t in s["tables"]) for s in stats] == [["emb", "new"]] * 3


@pytest.mark.parametrize("step", ["PREPARE", "STREAM", "HOLD", "SWITCH"])
@pytest.mark.parametrize("victim", ["joining", "old"])
def test_a_reshard_aborts_when_a_participant_dies(
    cluster: LocalCluster, step: str, victim: str
) -> None:
    """Growing 2 -> 3, one process is killed (-9) just before `step` first
    reaches any process: the joining one, or old shard 1. The re-shard fails,
    and every process left serves the old layout: no bucket changed owner
    (those of a dead old shard are lost with it, as without a re-shard)."""
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM, optimizer="adagrad")
    rng = np.random.default_rng(1)
    for _ in range(10):
        admin.push("emb", rng.choice(IDS, 512), np.ones((512, DIM), np.float32), 0.1)
    before = _state(admin)
    rows_before = [s["tables"][0]["rows"] for s in admin.stats()]
    joined = cluster.join()
    dying = len(cluster.processes) - 1 if victim == "joining" else 1
    _reshard_killing(cluster, [*cluster.addresses, joined], dying, step)
    alive = [a for p, a in enumerate(cluster.process_addresses) if p != dying]
    hellos = [_native.hello(address) for address in alive]
    # The old layout, and the joining process owns nothing. A failed switch
    # is undone as a layout newer than the one switched to (clients that
    # learned that one learn this), on every process; before the switch
    # nothing changed. A death at HOLD is met at the drain, or (when the
    # last rounds had nothing to send) at the switch.
    epochs = {h["layout_epoch"] for h in hellos}
    assert len(epochs) == 1 and epochs <= {"SWITCH": {3}, "HOLD": {1, 3}}.get(step, {1})
    for hello in hellos:
        assert (hello["shard_index"], hello["num_shards"]) in ((0, 2), (1, 2), (1, 1))
    if victim == "joining":
        # Every row as it was, and writes go on.
        assert [s["tables"][0]["rows"] for s in admin.stats()] == rows_before
        np.testing.assert_array_equal(_state(admin), before)
        admin.push("emb", IDS[:8], np.ones((8, DIM), np.float32), 0.1)


def test_standbys_move_with_their_shards_and_take_over_after(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """2 shards with sync standbys grow to 3 (the new one with a standby of
    its own) while a trainer pushes; two primaries are killed (-9) and their
    standbys take over; one of the dead is restarted with the flags it began
    with (the layout before) and rejoins its shard in its new place, as a
    standby; the 3 shards shrink to 2; then the processes serving both
    shards are killed, so the restarted one takes over (and one restarted
    in the place it had, at the layout before, learns the layout). No push
    fails, and every row and optimizer slot equals every push applied once,
    in order: each standby held what its primary held, across both
    re-shards."""
    with LocalCluster(2, replicas=2, workdir=tmp_path / "cluster") as cluster:
        admin = tf_dlt.Client(cluster.addresses)
        config = admin.create_table("emb", DIM, optimizer="adagrad", seed=7)
        joined = cluster.join(replicas=2)
        assert joined.count("|") == 1
        trainer = Trainer(cluster.addresses)
        try:
            trainer.wait_for(20)
            done = admin.reshard([*cluster.addresses, joined])
            assert done["layout_epoch"] == 2
            trainer.wait_for(20)
            for standby in cluster.process_addresses[2:4] + joined.split("|")[1:]:
                # A standby switched with its primary (it greets only that).
                assert _native.hello(standby, replica=True)["layout_epoch"] == 2
            cluster.kill(0)  # shard 0's primary
            cluster.kill(4)  # the new shard's primary
            trainer.wait_for(40)
            cluster.restart(0)  # started as shard 0 of 2: now shard 0 of 3's standby
            _await_standby(admin, 0, cluster.process_addresses[0])
            # Back to 2 shards: the dead process is left out, the new shard's
            # standby (serving now) leaves owning nothing.
            admin.reshard(cluster.addresses)
            trainer.wait_for(20)
            assert [s["layout_epoch"] for s in admin.stats()] == [3, 3]
            _await_standby(admin, 0, cluster.process_addresses[0])
            cluster.kill(2)  # serving shard 0 since the first kill
            cluster.kill(1)  # shard 1's primary: its standby followed both re-shards
            trainer.wait_for(40)
            # Restarted as shard 0 of 2 again, its place: the layout is newer.
            cluster.restart(2)
            _await_standby(admin, 0, cluster.process_addresses[2])
            assert _native.hello(cluster.process_addresses[2], replica=True)["layout_epoch"] == 3
        finally:
            trainer.stop()
        assert trainer.errors == []
        np.testing.assert_array_equal(_state(admin), trainer.oracle(config))
        hello = _native.hello(cluster.process_addresses[0])  # the restarted one serves
        assert (hello["shard_index"], hello["num_shards"], hello["layout_epoch"]) == (0, 2, 3)


def _await_standby(admin: tf_dlt.Client, shard: int, standby: str) -> None:
    """Returns once `standby` is `shard`'s caught-up standby."""
    deadline = time.monotonic() + 60
    while True:
        standbys = admin.stats()[shard]["standbys"]
        if standbys and standbys[0]["address"] == standby and standbys[0]["caught_up"]:
            return
        assert time.monotonic() < deadline, f"{standby} did not catch up: {standbys}"
        time.sleep(0.1)


def test_a_shard_with_two_standbys_moves_with_both(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A shard with two sync standbys grows to 2 (the new one with two of
    its own) while a trainer pushes: every standby switches with its
    primary. Then both primaries are killed (-9): in each shard one standby
    takes over and the other follows it. No push fails, and every row and
    slot equals every push applied once."""
    with LocalCluster(1, replicas=3, workdir=tmp_path / "cluster") as cluster:
        admin = tf_dlt.Client(cluster.addresses)
        config = admin.create_table("emb", DIM, optimizer="adagrad", seed=7)
        joined = cluster.join(replicas=3)  # processes 3 (primary), 4 and 5
        assert joined.count("|") == 2
        trainer = Trainer(cluster.addresses)
        try:
            trainer.wait_for(20)
            assert admin.reshard([*cluster.addresses, joined])["layout_epoch"] == 2
            trainer.wait_for(20)
            for standby in [*cluster.process_addresses[1:3], *joined.split("|")[1:]]:
                assert _native.hello(standby, replica=True)["layout_epoch"] == 2
            cluster.kill(0)
            cluster.kill(3)
            trainer.wait_for(40)
        finally:
            trainer.stop()
        assert trainer.errors == []
        np.testing.assert_array_equal(_state(admin), trainer.oracle(config))
        stats = admin.stats()
        assert [s["epoch"] for s in stats] == [2, 2]
        for shard, s in enumerate(stats):
            # The standby that did not take over follows the one that did.
            deadline = time.monotonic() + 60
            while len(s["insync"]) != 1:
                assert time.monotonic() < deadline, f"shard {shard}: {s['standbys']}"
                time.sleep(0.1)
                s = admin.stats()[shard]


def test_a_new_shards_standby_that_sees_its_primary_switch_first_switches_with_it(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    """The coordinator's SWITCH reaches a new shard's standby well after its
    primary switched (its link greets the primary at the new layout
    meanwhile). The standby does not take the primary's place on its own
    (empty, dropping what was streamed to it): it switches to the shard it
    prepared when the coordinator says, and holds every row when it takes
    over."""
    with LocalCluster(1, replicas=2, workdir=tmp_path / "cluster") as cluster:
        admin = tf_dlt.Client(cluster.addresses)
        config = admin.create_table("emb", DIM, optimizer="adagrad", seed=7)
        joined = cluster.join(replicas=2)  # processes 2 (primary) and 3
        new_primary, new_standby = joined.split("|")
        trainer = Trainer(cluster.addresses)
        channels: list[grpc.Channel] = []
        primary_switched = threading.Event()
        steps = dlt_pb2.ReshardRequest

        def late_to_the_standby(address: str, request: Any, send: Callable[[], Any]) -> Any:
            if request.step == steps.SWITCH and address == new_standby:
                assert primary_switched.wait(30)
                time.sleep(1.5)  # several of the link's probes
            reply = send()
            if request.step == steps.SWITCH and address == new_primary:
                primary_switched.set()
            return reply

        try:
            trainer.wait_for(20)
            done = resharding.reshard(
                cluster.addresses, [*cluster.addresses, joined],
                stub_for=_intercepted(channels, late_to_the_standby), timeout_s=30,
            )  # fmt: skip
            assert done["layout_epoch"] == 2
            trainer.wait_for(20)
            assert _native.hello(new_standby, replica=True)["layout_epoch"] == 2
            cluster.kill(2)
            trainer.wait_for(40)
        finally:
            trainer.stop()
            for channel in channels:
                channel.close()
        assert trainer.errors == []
        np.testing.assert_array_equal(_state(admin), trainer.oracle(config))


def test_a_primary_dying_mid_reshard_aborts_and_its_standby_takes_over(
    tmp_path,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    """Shards with standbys growing 2 -> 3: shard 1's primary is killed (-9)
    as writes are about to be held. The re-shard aborts, the primary that
    lives resumes its stream to its standby (sync pushes go on), shard 1's
    standby takes over, and after shard 0's primary is killed too every row
    equals every push applied once."""
    with LocalCluster(2, replicas=2, workdir=tmp_path / "cluster") as cluster:
        admin = tf_dlt.Client(cluster.addresses)
        config = admin.create_table("emb", DIM, optimizer="adagrad", seed=7)
        joined = cluster.join(replicas=2)
        trainer = Trainer(cluster.addresses)
        try:
            trainer.wait_for(20)
            _reshard_killing(cluster, [*cluster.addresses, joined], 1, "HOLD")
            trainer.wait_for(40)
            cluster.kill(0)
            trainer.wait_for(40)
        finally:
            trainer.stop()
        assert trainer.errors == []
        np.testing.assert_array_equal(_state(admin), trainer.oracle(config))
        for address in cluster.process_addresses[2:4]:  # the standbys serve the old layout
            assert _native.hello(address)["layout_epoch"] == 1
        # Again, listing the dead primaries: they are left out, and the
        # command reports the layout the shards serve (it echoed --to).
        capsys.readouterr()
        to = [*cluster.addresses, joined]
        pservers = ",".join(cluster.addresses)
        assert cli.main(["reshard", "--pservers", pservers, "--to", ",".join(to)]) == 0
        served = json.loads(capsys.readouterr().out.splitlines()[-1])["pservers"]
        assert served == ",".join([*cluster.process_addresses[2:4], joined])


def test_a_reshard_onto_a_shard_of_another_cluster_is_refused_and_changes_nothing(
    cluster: LocalCluster,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """A mistyped address in --to names a serving shard of another cluster:
    the re-shard is refused before any step (PREPARE would have replaced
    that shard's tables with the moving ones), and both clusters keep their
    tables and layouts; so is a re-shard of part of the layout. A server
    started with --join is taken."""
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM)
    rows = admin.pull("emb", IDS[:100])
    with LocalCluster(1, workdir=tmp_path / "other") as other:
        theirs = tf_dlt.Client(other.addresses)
        theirs.create_table("other", 4)
        their_rows = theirs.pull("other", IDS[:100])
        with pytest.raises(errors.FailedPreconditionError, match="no process of the shards being"):
            admin.reshard([*cluster.addresses, other.addresses[0]])
        assert list(theirs.list_tables()) == ["other"]
        np.testing.assert_array_equal(theirs.pull("other", IDS[:100]), their_rows)
        assert _native.hello(other.addresses[0])["layout_epoch"] == 1
    joined = cluster.join()
    # Given one shard of two before the first re-shard (the shards do not
    # know each other's addresses yet): refused, else shard 1 would serve
    # its buckets beside their new owners.
    with pytest.raises(errors.FailedPreconditionError, match="list every shard of the layout"):
        tf_dlt.Client(cluster.addresses[:1]).reshard([cluster.addresses[0], joined])
    assert [s["layout_epoch"] for s in admin.stats()] == [1, 1]
    np.testing.assert_array_equal(admin.pull("emb", IDS[:100]), rows)
    assert admin.reshard([*cluster.addresses, joined])["layout_epoch"] == 2
    np.testing.assert_array_equal(admin.pull("emb", IDS[:100]), rows)


def _trained_and_grown_to_three(cluster: LocalCluster) -> tuple[tf_dlt.Client, list[str]]:
    """A client of `cluster` whose table "emb" has a row for each of IDS,
    after a re-shard 2 -> 3 onto a joined process; the three addresses."""
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM, optimizer="adagrad")
    admin.push("emb", IDS, np.ones((len(IDS), DIM), np.float32), 0.1)
    three = [*cluster.addresses, cluster.join()]
    assert admin.reshard(three)["layout_epoch"] == 2
    return admin, three


def test_a_shard_restarted_in_its_new_place_can_be_resharded_again(
    cluster: LocalCluster,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """After 2 -> 3, the process serving shard 2 dies and is started again
    as shard 2 of 3 (docs/operations.md): it begins at layout epoch 1 while
    the others serve epoch 2. The newest layout names it at its index, so
    the cluster can be re-sharded again (it was refused: "serve different
    layouts")."""
    admin, three = _trained_and_grown_to_three(cluster)
    joined = three[-1]
    admin.save(str(tmp_path / "ckpt"))
    rows = admin.pull("emb", IDS)
    cluster.kill(2)
    port = int(joined.rsplit(":", 1)[1])
    with ShardServer(2, 3, port=port):
        restarted = tf_dlt.Client(three)
        restarted.load(str(tmp_path / "ckpt"))  # every shard agrees again
        assert [s["layout_epoch"] for s in restarted.stats()] == [2, 2, 1]
        assert restarted.reshard(cluster.addresses)["layout_epoch"] == 3
        np.testing.assert_array_equal(tf_dlt.Client(cluster.addresses).pull("emb", IDS), rows)


def test_a_standby_attached_after_a_reshard_serves_new_clients_once_it_takes_over(
    cluster: LocalCluster,
) -> None:
    """After 2 -> 3, a standby of the new shard's process attaches and
    takes over when that process dies. A client given the standby's
    address (alone, or after the dead one's) reached nothing: the layout
    the shards serve names the dead process, and taking it replaced every
    address the client had for the shard with it. The addresses a client
    had for a shard stay candidates where the layout keeps the shard count,
    and the client reaches the copy serving."""
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM, optimizer="adagrad")
    joined = cluster.join()
    three = [*cluster.addresses, joined]
    assert admin.reshard(three)["layout_epoch"] == 2
    # Run again (its reply lost, say): done already, nothing moves.
    assert admin.reshard(three) == {
        "layout_epoch": 2, "stream_s": 0.0, "held_s": 0.0, "unchanged": True
    }  # fmt: skip
    admin.push("emb", IDS, np.ones((len(IDS), DIM), np.float32), 0.1)
    with ShardServer(2, 3, standby_of=joined) as standby:
        _await_standby(admin, 2, standby.address)
        rows = admin.pull("emb", IDS)
        cluster.kill(len(cluster.processes) - 1)  # the joined process
        for listed in (standby.address, f"{joined}|{standby.address}"):
            client = tf_dlt.Client([*cluster.addresses, listed])
            np.testing.assert_array_equal(client.pull("emb", IDS), rows)
            client.push("emb", IDS[:10], np.ones((10, DIM), np.float32), 0.1)
            rows = client.pull("emb", IDS)
            client.close()


def test_a_standby_attached_after_a_reshard_moves_with_its_shard_in_the_next(
    cluster: LocalCluster,
) -> None:
    """After 2 -> 3 a standby attaches to shard 0. The layout the shards
    serve does not name it, so every later re-shard was refused (its
    primary "replicates to [S], but the shard lists none"), even one given
    `a|S`: the coordinator read the layout served now from the shards. The
    standbys a primary names move with it; 3 -> 2 runs, and the standby
    takes over shard 0 of the new layout with every row."""
    admin, three = _trained_and_grown_to_three(cluster)
    a = cluster.addresses[0]
    with ShardServer(0, 3, standby_of=a) as standby:
        _await_standby(admin, 0, standby.address)
        # Run again with or without it: done already.
        assert admin.reshard(three)["unchanged"]
        assert admin.reshard([f"{a}|{standby.address}", *three[1:]])["unchanged"]
        admin.push("emb", IDS[:100], np.ones((100, DIM), np.float32), 0.1)
        assert admin.reshard(cluster.addresses)["layout_epoch"] == 3
        rows = admin.pull("emb", IDS)
        _await_standby(admin, 0, standby.address)
        cluster.kill(0)  # the standby takes shard 0 of 2
        np.testing.assert_array_equal(tf_dlt.Client(cluster.addresses).pull("emb", IDS), rows)


def test_a_dead_standby_its_primary_still_names_is_left_out_though_not_listed(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """A standby dies (-9); until its primary detaches it (at its next push,
    or after --detach-standby-after) the primary's Hello still names it. A
    re-shard given the primary alone added the standby unasked, ungreeted,
    and failed at its STATUS step with an UnavailableError naming it. It is
    greeted first and, like a listed process that does not answer, left
    out: 2 -> 3 runs, and every row moves."""
    with LocalCluster(2, replicas=2, workdir=tmp_path / "cluster") as cluster:
        a, _, dead = cluster.process_addresses[:3]
        admin = tf_dlt.Client(cluster.addresses)
        admin.create_table("emb", DIM, optimizer="adagrad")
        admin.push("emb", IDS, np.ones((len(IDS), DIM), np.float32), 0.1)
        rows = admin.pull("emb", IDS)
        cluster.kill(2)  # shard 0's standby
        # Its primary finds it gone (a re-shard's PREPARE refused the shard
        # then, for a standby "not caught up" that takes no part) yet still
        # names it.
        wait_until(
            lambda: not admin.stats()[0]["standbys"][0]["connected"], "the primary to see it gone"
        )
        assert [s["address"] for s in admin.stats()[0]["standbys"]] == [dead], "nothing tested"
        three = [a, cluster.addresses[1], cluster.join()]
        assert admin.reshard(three)["layout_epoch"] == 2
        np.testing.assert_array_equal(tf_dlt.Client(three).pull("emb", IDS), rows)


def test_a_process_a_reshard_of_the_same_count_left_out_is_never_used_for_its_old_place(
    cluster: LocalCluster,
) -> None:
    """[A, B] re-sharded to [A, C|S]: a client that knew B for shard 1 keeps
    it as a candidate. B, left out (still running), and then B restarted
    with its first flags (shard 1 of 2, at the layout before: none of the
    rows), are passed over: when C dies the client rides through S's
    takeover, and once S is gone too it fails UNAVAILABLE instead of
    taking B's empty shard."""
    a, b = cluster.addresses
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM, optimizer="adagrad")
    trainer = tf_dlt.Client([a, b])
    trainer.push("emb", IDS, np.ones((len(IDS), DIM), np.float32), 0.1)
    joined = cluster.join(replicas=2)  # processes 2 (C) and 3 (S)
    deadline = time.monotonic() + 60
    while True:  # until C has its standby
        try:
            admin.reshard([a, joined])
            break
        except errors.FailedPreconditionError as e:
            assert "standby" in str(e) and time.monotonic() < deadline, e
            time.sleep(0.2)
    rows = trainer.pull("emb", IDS)  # learns the layout
    # B is no copy of the shard (it was listed as one, and a re-run failed on it).
    assert admin.pservers == [a, joined]
    assert admin.reshard([a, joined])["unchanged"]
    _await_standby(admin, 1, joined.split("|")[1])
    cluster.kill(2)  # C: S takes over
    np.testing.assert_array_equal(trainer.pull("emb", IDS), rows)
    cluster.kill(1)
    cluster.restart(1)  # B, as shard 1 of 2 of the layout before
    cluster.kill(3)  # S
    trainer.close()
    again = tf_dlt.Client([a, b], request_timeout=5.0)
    with pytest.raises(errors.UnavailableError, match="passed over"):
        again.pull("emb", IDS)


def test_a_shard_restarted_empty_after_a_reshard_is_followed_past_the_process_left_out(
    cluster: LocalCluster,
) -> None:
    """[A, B] re-sharded to [A, C]; C dies and is started again in its place,
    empty. A client that knew B (left out, still running) failed every call
    UNAVAILABLE at its deadline: B, answering for no place, stopped it from
    following the restart. It fails DATA_LOSS at once, as without B."""
    a, b = cluster.addresses
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM, optimizer="adagrad")
    trainer = tf_dlt.Client([a, b], request_timeout=20.0)
    trainer.push("emb", IDS, np.ones((len(IDS), DIM), np.float32), 0.1)
    joined = cluster.join()
    admin.reshard([a, joined])
    trainer.pull("emb", IDS)  # learns the layout
    cluster.kill(2)
    port = int(joined.rsplit(":", 1)[1])
    with ShardServer(1, 2, port=port):
        with pytest.raises(errors.DataLossError, match="restarted processes serve"):
            trainer.pull("emb", IDS)


def test_a_reshard_onto_fewer_shards_past_max_rows_is_refused_and_changes_nothing(
    cluster: LocalCluster,
) -> None:
    """2 shards of a table with max_rows 4,096 hold about 7,000 rows: one
    shard cannot. The streams took them all and the first pushes after the
    switch evicted 3,008 (before, the streams themselves evicted them). The
    re-shard is refused before anything moves, naming the table."""
    a, b = cluster.addresses
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("capped", DIM, optimizer="adagrad", max_rows=4096)
    ids = np.arange(7000, dtype=np.int64)
    admin.push("capped", ids, np.ones((len(ids), DIM), np.float32), 0.1)
    rows = admin.list_tables()["capped"]["rows"]
    with pytest.raises(
        errors.FailedPreconditionError,
        match=r"onto 1 shards would evict rows: table 'capped': about \d+ rows for shard 0 of 1 "
        r"\(at the density of the densest shard it takes buckets from\), past the about 2821 its "
        r"max_rows of 4096 holds without evicting",
    ):
        admin.reshard([a])
    assert [s["layout_epoch"] for s in admin.stats()] == [1, 1]
    assert admin.list_tables()["capped"]["rows"] == rows


def test_a_reshard_onto_fewer_shards_is_refused_where_one_range_would_pass_max_rows(
    cluster: LocalCluster,
) -> None:
    """A shard keeps max_rows per range of its buckets. 3,000 rows on one
    shard and 400 on the other are 3,400 in all, under a cap of 4,096,
    but on one shard the first shard's buckets hold 3,000 rows where their
    share of the cap is 2,048: the re-shard was let through, and one push
    of 64 new ids after the switch evicted 798 of the moved rows. It is
    refused, as is a shard whose stripes would pass their quotas; 1,000
    rows on each re-shard, and every row stays."""
    a, b = cluster.addresses
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("capped", DIM, max_rows=4096)
    ids = np.arange(20_000, dtype=np.int64)
    owner = routing.shard_of(ids, 2)
    uneven = np.concatenate([ids[owner == 0][:3000], ids[owner == 1][:400]])
    admin.push("capped", uneven, np.ones((len(uneven), DIM), np.float32), 0.1)
    with pytest.raises(errors.FailedPreconditionError, match=r"about 6\d\d\d rows for shard 0"):
        admin.reshard([a])
    # Under the cap even at that density, but not under every stripe's
    # quota: 1,843 and 200 rows were let through, and 38 moved rows were
    # evicted by the first pushes into the fullest stripes.
    admin.drop_table("capped")
    admin.create_table("capped", DIM, max_rows=4096)
    near = np.concatenate([ids[owner == 0][:1843], ids[owner == 1][:200]])
    admin.push("capped", near, np.ones((len(near), DIM), np.float32), 0.1)
    with pytest.raises(errors.FailedPreconditionError, match=r"about 3\d\d\d rows for shard 0"):
        admin.reshard([a])
    assert [s["layout_epoch"] for s in admin.stats()] == [1, 1]
    admin.drop_table("capped")
    admin.create_table("under", DIM, max_rows=4096)
    fits = np.concatenate([ids[owner == 0][:1000], ids[owner == 1][:1000]])
    admin.push("under", fits, np.ones((len(fits), DIM), np.float32), 0.1)
    before = admin.pull("under", fits)
    admin.reshard([a])
    admin.push("under", ids[-64:], np.ones((64, DIM), np.float32), 0.1)
    np.testing.assert_array_equal(admin.pull("under", fits), before)


def test_an_address_listed_twice_in_the_new_layout_is_refused_so(cluster: LocalCluster) -> None:
    joined = cluster.join()
    a, b = cluster.addresses
    for to in ([a, b, joined, joined], [a, f"{b}|{joined}", joined]):
        with pytest.raises(errors.InvalidArgumentError, match=f"{joined} is listed twice"):
            tf_dlt.Client(cluster.addresses).reshard(to)
    # One process under two names: it streamed every range, then failed at
    # the switch, the process left saying it served shard 1 of 1.
    alias = joined.replace("127.0.0.1", "localhost")
    before = _native.hello(joined)
    for to in ([a, b, joined, alias], [a, b.replace("127.0.0.1", "localhost"), b]):
        with pytest.raises(errors.InvalidArgumentError, match="are one process") as refused:
            tf_dlt.Client(cluster.addresses).reshard(to)
        assert "nothing was changed" in str(refused.value)
    assert [s["layout_epoch"] for s in tf_dlt.Client(cluster.addresses).stats()] == [1, 1]
    after = _native.hello(joined)
    assert [after[k] for k in ("shard_index", "num_shards")] == [
        before[k] for k in ("shard_index", "num_shards")
    ]


def test_a_reshard_onto_a_process_with_a_memory_budget_is_refused_naming_it(
    cluster: LocalCluster,
) -> None:
    """Shards under a memory budget do not re-shard yet; the refusal names
    the joining process as such (it read "shard 1", like the real shard 1)."""
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM)
    budget = _rss_bytes() + (4 << 30)  # one this process can honour, TensorFlow loaded or not
    with ShardServer(1, 1, memory_budget=budget) as joining:  # --join: no bucket yet
        address = f"127.0.0.1:{joining.port}"
        with pytest.raises(errors.FailedPreconditionError) as refused:
            admin.reshard([*cluster.addresses, address])
    assert "this joining process (it owns no bucket yet) has a memory budget" in str(refused.value)
    assert [s["layout_epoch"] for s in admin.stats()] == [1, 1]


def test_a_trainer_goes_on_through_a_switch_that_is_undone(cluster: LocalCluster) -> None:
    """The joining process dies as the switch begins, while a trainer
    pushes: the processes that switched go back, as a layout newer than the
    one switched to, so the trainer's client, which may have learned that
    one, learns the old layout again. No push fails; every row equals every
    push applied once."""
    admin = tf_dlt.Client(cluster.addresses)
    config = admin.create_table("emb", DIM, optimizer="adagrad", seed=7)
    joined = cluster.join()
    trainer = Trainer(cluster.addresses)
    try:
        trainer.wait_for(20)
        _reshard_killing(
            cluster, [*cluster.addresses, joined], len(cluster.processes) - 1, "SWITCH"
        )
        trainer.wait_for(40)
    finally:
        trainer.stop()
    assert trainer.errors == []
    assert [s["layout_epoch"] for s in admin.stats()] == [3, 3]
    # Never left on the layout that was undone (it learns 3 when it met 2).
    assert trainer.client._data.layout_epoch in (1, 3)
    np.testing.assert_array_equal(_state(admin), trainer.oracle(config))


def _reshard_killing(cluster: LocalCluster, to: list[str], dying: int, step: str) -> None:
    """Re-shards `cluster` to `to`, killing (-9) process `dying` just before
    `step` first reaches any process; the re-shard must fail."""
    kill_at = getattr(dlt_pb2.ReshardRequest, step)
    channels: list[grpc.Channel] = []

    def stub_for(address: str, admin_port: int) -> object:
        channels.append(grpc.insecure_channel(grpc_util.admin_address(address, admin_port)))
        stub = dlt_pb2_grpc.ShardAdminStub(channels[-1])

        class Dying(_Passing):
            def Reshard(self, request: object, **kwargs: object) -> object:  # noqa: N802
                if request.step == kill_at and cluster.processes[dying].poll() is None:  # type: ignore[attr-defined]
                    cluster.kill(dying)
                return stub.Reshard(request, **kwargs)

        return Dying(stub)

    try:
        with pytest.raises(errors.DltError):
            resharding.reshard(cluster.addresses, to, stub_for=stub_for, timeout_s=30)
    finally:
        for channel in channels:
            channel.close()


def test_a_process_frozen_part_way_fails_the_reshard_by_its_timeout_aborting_everywhere_at_once(
    cluster: LocalCluster,
) -> None:
    """An old primary frozen (SIGSTOP) as its PREPARE arrives: no step
    before the switch waits past the re-shard's timeout (1.5 s; a step may
    take 5), and ABORT goes to every process at once, so the others' return
    while the frozen one's still waits. Thawed, it serves the old layout
    with every row, and the next re-shard (which undoes what it was left
    prepared for) moves the tables."""
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM, optimizer="adagrad")
    admin.push("emb", IDS, np.ones((len(IDS), DIM), np.float32), 0.1)
    before = _state(admin)
    three = [*cluster.addresses, cluster.join()]
    frozen, steps = cluster.process_addresses[0], dlt_pb2.ReshardRequest
    calls: list[tuple[int, str, float, float, float]] = []  # step, address, timeout, began, ended
    lock, channels = threading.Lock(), []

    def stub_for(address: str, admin_port: int) -> object:
        channels.append(grpc.insecure_channel(grpc_util.admin_address(address, admin_port)))
        stub = dlt_pb2_grpc.ShardAdminStub(channels[-1])

        class Recorded(_Passing):
            def Reshard(self, request: Any, **kwargs: Any) -> Any:  # noqa: N802
                if request.step == steps.PREPARE and address == frozen:
                    cluster.processes[0].send_signal(signal.SIGSTOP)
                began = time.monotonic()
                try:
                    return stub.Reshard(request, **kwargs)
                finally:
                    with lock:
                        calls.append(
                            (request.step, address, kwargs["timeout"], began, time.monotonic())
                        )

        return Recorded(stub)

    try:
        with pytest.raises(errors.DeadlineExceededError, match="PREPARE on " + frozen):
            resharding.reshard(
                cluster.addresses, three, stub_for=stub_for, timeout_s=1.5, hold_timeout_s=5.0
            )
    finally:
        cluster.processes[0].send_signal(signal.SIGCONT)
        for channel in channels:
            channel.close()
    assert all(c[2] <= 1.5 for c in calls if c[0] in (steps.PREPARE, steps.STREAM, steps.HOLD))
    aborts = {c[1]: c for c in calls if c[0] == steps.ABORT}
    assert set(aborts) == set(cluster.process_addresses)
    assert all(a[3] < aborts[frozen][4] for a in aborts.values())  # none waited for it
    np.testing.assert_array_equal(_state(admin), before)
    admin.reshard(three)
    assert len({s["layout_epoch"] for s in admin.stats()}) == 1  # all on the new layout
    np.testing.assert_array_equal(_state(admin), before)


@pytest.mark.parametrize("switched", [0, 1, 3])
def test_a_reshard_left_part_way_is_finished_or_undone_by_the_next(
    cluster: LocalCluster, switched: int
) -> None:
    """Growing 2 -> 3, the coordinator dies once writes are held and
    `switched` processes switched (its later calls never leave it): writes
    stay held, and the trainer's pushes wait. Running the re-shard again
    finishes it (a process switched: the others still prepare their shards)
    or undoes it and moves again. No push fails; every row equals every
    push applied once."""
    admin = tf_dlt.Client(cluster.addresses)
    config = admin.create_table("emb", DIM, optimizer="adagrad", seed=7)
    three = [*cluster.addresses, cluster.join()]
    trainer = Trainer(cluster.addresses)
    channels: list[grpc.Channel] = []
    state = {"switches": 0, "dead": False}
    lock = threading.Lock()
    steps = dlt_pb2.ReshardRequest

    def dies_at_switch(address: str, request: Any, send: Callable[[], Any]) -> Any:
        with lock:
            if request.step == steps.SWITCH and state["switches"] < switched:
                state["switches"] += 1
            elif request.step in (steps.SWITCH, steps.RELEASE) or state["dead"]:
                state["dead"] = True
                raise SystemExit("the coordinator died")
        return send()

    try:
        trainer.wait_for(20)
        with pytest.raises(SystemExit):
            resharding.reshard(
                cluster.addresses, three, stub_for=_intercepted(channels, dies_at_switch),
                timeout_s=30, lease_s=2.0,
            )  # fmt: skip
        # Stats say what was left so (an old shard holds writes).
        left = member_stats(cluster.process_addresses[1], cluster.admin_ports[1], "").reshard
        assert "writes held" in left and f"to {','.join(three)}" in left
        done = admin.reshard(three)
        assert done.get("resumed", False) == (switched > 0)
        trainer.wait_for(20)
    finally:
        trainer.stop()
        for channel in channels:
            channel.close()
    assert trainer.errors == []
    # Undone (as layout 2, the old one again) and moved afresh (3); or finished.
    epoch = 3 if switched == 0 else 2
    assert [s["layout_epoch"] for s in admin.stats()] == [epoch] * 3
    np.testing.assert_array_equal(_state(admin), trainer.oracle(config))


def test_saves_and_loads_wait_for_a_reshard_to_end(cluster: LocalCluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    admin = tf_dlt.Client(cluster.addresses)
    admin.create_table("emb", DIM, optimizer="adagrad")
    admin.push("emb", IDS[:64], np.ones((64, DIM), np.float32), 0.1)
    address = cluster.addresses[0]
    admin_port = _native.hello(address)["admin_port"]
    with grpc.insecure_channel(grpc_util.admin_address(address, admin_port)) as channel:
        stub = dlt_pb2_grpc.ShardAdminStub(channel)
        step = dlt_pb2.ReshardRequest
        stub.Reshard(step(step=step.PREPARE, shard_index=0, num_shards=3))
        with pytest.raises(errors.FailedPreconditionError, match="being re-sharded"):
            admin.save(str(tmp_path / "ckpt"))
        stub.Reshard(step(step=step.ABORT))
    admin.save(str(tmp_path / "ckpt"))
    admin.load(str(tmp_path / "ckpt"))


def test_fit_goes_on_through_a_reshard_with_every_row_as_without(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """model.fit on 2 shards with sync pushes; mid-epoch the tables move to
    3 shards, and in the next epoch back to 2, each re-shard on a thread of
    its own while fit runs: fit raises nothing, and its loss, weights and
    every row's values, optimizer slots and step equal a run without
    re-sharding."""
    import keras

    from conftest import assert_same_training, fit_data, fit_outcome, two_table_model

    data = fit_data()
    model = two_table_model(DIM)

    class ReshardAt(keras.callbacks.Callback):  # type: ignore[misc]
        def __init__(self, client: tf_dlt.Client, at: dict[tuple[int, int], list[str]]) -> None:
            super().__init__()
            self.client, self.at, self.epoch = client, at, 0
            self.threads: list[threading.Thread] = []
            self.failures: list[BaseException] = []

        def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
            self.epoch = epoch

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            to = self.at.get((self.epoch, batch))
            if to is None:
                return
            for t in self.threads:
                t.join()  # one re-shard at a time
            self.threads.append(threading.Thread(target=self._reshard, args=(to,)))
            self.threads[-1].start()

        def _reshard(self, to: list[str]) -> None:
            try:
                self.client.reshard(to)
            except BaseException as e:  # noqa: BLE001 - checked by the test
                self.failures.append(e)

    results = []
    for moved in (False, True):
        with LocalCluster(2, workdir=tmp_path / f"moved{moved}") as cluster:
            remote = tf_dlt.transpile(model, cluster.addresses)
            for name in ("u", "i"):
                remote.get_layer(name).sync_push = True
            callbacks = []
            if moved:
                three = [*cluster.addresses, cluster.join()]
                mover = ReshardAt(
                    tf_dlt.Client(cluster.addresses), {(0, 10): three, (1, 10): cluster.addresses}
                )
                callbacks.append(mover)
            history = remote.fit(data, epochs=2, verbose=0, callbacks=callbacks)
            if moved:
                for t in mover.threads:
                    t.join()
                assert mover.failures == [] and len(mover.threads) == 2
                assert [s["layout_epoch"] for s in tf_dlt.Client(cluster.addresses).stats()] == [
                    3,
                    3,
                ]
            path = str(tmp_path / f"ckpt{moved}")
            results.append(fit_outcome(history, remote, cluster.addresses, path))
    assert_same_training(*results)
    rows, rows_m = results[0][2], results[1][2]
    # Values, optimizer slots and steps alike. A row's age in pushes may
    # differ by the gap between its old and new shard's push clocks (a new
    # shard takes the latest of its senders'; the pushes that reached one
    # shard and not the other), never by more than the run's 80 pushes.
    assert {t: {k: r[:3] for k, r in rows[t].items()} for t in rows} == {
        t: {k: r[:3] for k, r in rows_m[t].items()} for t in rows_m
    }
    assert all(abs(rows[t][k][3] - rows_m[t][k][3]) <= 80 for t in rows for k in rows[t])


def test_a_reshard_of_a_cluster_that_does_not_answer_says_so() -> None:
    """No process of a listed shard answers: a clear UNAVAILABLE naming the
    shard (it said "needs exactly one process serving trainers; none did")."""
    with pytest.raises(errors.UnavailableError, match="no process of shard 127.0.0.1:1 answers"):
        resharding.reshard(
            ["127.0.0.1:1"], ["127.0.0.1:1", "127.0.0.1:2"], stub_for=lambda a, p: None
        )


def test_a_second_coordinator_waits_for_a_live_one_and_never_undoes_it(
    cluster: LocalCluster,
) -> None:
    """`tf-dlt reshard` run again while the first still runs (it looked
    hung): the second took the first's re-shard for one left by a dead
    coordinator and undid it under the first. Each step now carries its
    coordinator's id and lease, and the first steps every process while it
    runs: the second waits, and raises once the first has ended (the layout
    it planned from is gone); the first completes, and no push fails."""
    admin = tf_dlt.Client(cluster.addresses)
    config = admin.create_table("emb", DIM, optimizer="adagrad", seed=7)
    three = [*cluster.addresses, cluster.join()]
    trainer = Trainer(cluster.addresses)
    channels: list[grpc.Channel] = []
    steps = dlt_pb2.ReshardRequest
    holding = threading.Event()

    def stub_for(address: str, admin_port: int) -> object:
        channels.append(grpc.insecure_channel(grpc_util.admin_address(address, admin_port)))
        stub = dlt_pb2_grpc.ShardAdminStub(channels[-1])

        class SlowBeforeHold(_Passing):
            def Reshard(self, request: object, **kwargs: object) -> object:  # noqa: N802
                if request.step == steps.HOLD and not holding.is_set():  # type: ignore[attr-defined]
                    holding.set()
                    # Past the lease (2 s): only the heartbeat keeps the first
                    # alive. Not by much: the second gives up on a live first a
                    # lease and 2 s after it first sees it, and the first must
                    # end (HOLD, switch, release) within that, on a busy host too.
                    time.sleep(2.5)
                return stub.Reshard(request, **kwargs)

        return SlowBeforeHold(stub)

    first: dict[str, object] = {}

    def run_first() -> None:
        try:
            first["done"] = resharding.reshard(
                cluster.addresses, three, stub_for=stub_for, timeout_s=60, lease_s=2.0
            )
        except BaseException as e:  # noqa: BLE001 - reported below
            first["error"] = e

    thread = threading.Thread(target=run_first)
    try:
        trainer.wait_for(20)
        thread.start()
        assert holding.wait(60)
        with pytest.raises(errors.FailedPreconditionError, match="ended while this one waited"):
            tf_dlt.Client(cluster.addresses).reshard(three)
        thread.join(60)
        assert "error" not in first, first
        assert first["done"]["layout_epoch"] == 2  # type: ignore[index]
        trainer.wait_for(20)
    finally:
        trainer.stop()
        thread.join(60)
        for channel in channels:
            channel.close()
    assert trainer.errors == []
    np.testing.assert_array_equal(_state(admin), trainer.oracle(config))


@pytest.mark.parametrize(
    ("cores", "pace"), [(1, 1 / 16), (2, 0.125), (8, 0.5), (16, 1.0), (64, 1.0)]
)
def test_default_pace_follows_the_hosts_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, pace: float
) -> None:
    # A re-shard that names no pace (STREAM's pace 0) copies at 1/16 of the
    # shard host's cores, flat out from 16: on few cores the copies leave the
    # trainers beside them most of the machine.
    from tf_dlt.server import reshard as server_reshard

    monkeypatch.setattr(server_reshard.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    assert server_reshard.default_pace() == pace


@pytest.mark.parametrize(
    ("flag", "said"),
    [("--timeout=-1", "must be > 0 seconds"), ("--timeout=0", "must be > 0 seconds"),
     ("--pace=2", "2 is not in \\(0, 1\\]"), ("--pace=x", "not a number"),
     ("--pace=nan", "nan is not in")],
)  # fmt: skip
def test_reshard_flags_out_of_range_are_usage_errors(
    flag: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before any shard is asked, with argparse's exit code 2: a
    timeout of 0 or less failed at PREPARE ("the re-shard's timeout passed
    before it"), a bad pace exited 1 after greeting the shards."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["reshard", "--pservers", "127.0.0.1:1", "--to", "127.0.0.1:1", flag])
    assert exited.value.code == 2
    assert re.search(said, capsys.readouterr().err)


def test_a_bad_reshard_target_is_a_message_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["reshard", "--pservers", "127.0.0.1:1", "--to", "bogus"]) == 1
    assert "tf-dlt reshard: " in capsys.readouterr().err
