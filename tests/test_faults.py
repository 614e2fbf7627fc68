"""Faults with real processes: a shard killed (-9) during training, during a
save, a trainer killed in the middle of pushes, and a shard that accepts
connections but never answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dlt
from tf_dlt import dlt_ops as ops
from tf_dlt import errors
from tf_dlt.checkpoint import manifest
from tf_dlt.layers import Embedding
from tf_dlt.server.local import LocalCluster

from conftest import Cluster, wait_until

DEADLINE_S = 5.0


def _model(cluster: Cluster) -> keras.Model:
    inp = keras.Input((3,), dtype="int64")
    emb = Embedding(output_dim=4, is_distributed=True, optimizer="adagrad", name="faulty")
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="adam", loss="mse")
    return tf_dlt.transpile(model, cluster.addresses, request_timeout=DEADLINE_S)


def test_a_killed_shard_fails_within_the_deadline(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2)
    with cluster.client() as client:
        client.create_table("t", 4)
        client.pull("t", np.arange(100))
        cluster.kill(1)
        start = time.monotonic()
        with pytest.raises(errors.UnavailableError, match=r"shard 1 \(127\.0\.0\.1:\d+\)"):
            client.pull("t", np.arange(100))
        elapsed = time.monotonic() - start
        print(f"\nClient.pull: UnavailableError {elapsed:.3f} s after the kill (3 retries)")
        assert elapsed < DEADLINE_S
    resource = ops.ClientResource(cluster.addresses, request_timeout=DEADLINE_S)
    start = time.monotonic()
    with pytest.raises(tf.errors.UnavailableError, match="shard 1"):
        ops.lookup(resource, np.arange(100, dtype=np.int64), "t", 4)
    elapsed = time.monotonic() - start
    print(f"Dlt>Lookup: tf.errors.UnavailableError after {elapsed:.3f} s")
    assert elapsed < DEADLINE_S


def test_training_recovers_from_a_killed_shard(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    model = _model(cluster)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 2000, size=(256, 3)), rng.normal(size=(256, 1)).astype("float32")
    seen: dict[str, object] = {}

    class Crash(keras.callbacks.Callback):  # type: ignore[misc]
        """Kills shard 1 in the 3rd epoch; restarts it a second later, at
        the same address, as its supervisor would."""

        epoch = 0

        def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
            self.epoch = epoch

        def on_train_begin(self, logs: object = None) -> None:
            if "killed" in seen and "resumed_rows" not in seen:
                with cluster.client() as client:
                    seen["resumed_rows"] = client.pull("faulty", ids, training=False)

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if self.epoch == 2 and batch == 3 and "killed" not in seen:
                cluster.kill(1)
                seen["killed"] = time.monotonic()
                restarts.append(threading.Timer(1.0, cluster.restart, args=(1,)))
                restarts[-1].start()

    ids = np.unique(x)
    restarts: list[threading.Timer] = []
    try:
        history = tf_dlt.resilient_fit(
            model, x, y, checkpoint=str(tmp_path / "ck"), epochs=4, batch_size=16, verbose=0,
            callbacks=[Crash()], keep=3,
        )  # fmt: skip
    finally:
        for timer in restarts:  # no restart may outlive the test's cluster
            timer.join(30)
    assert history.restarts == 1
    # Every epoch's logs: 1 and 2 from the first fit, 3 and 4 after resuming.
    assert history.epoch == [0, 1, 2, 3]
    assert len(history.history["loss"]) == 4
    assert all(np.isfinite(history.history["loss"]))
    # keep=3: the newest three checkpoints (epoch-0 and epoch-1 deleted).
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch-2", "epoch-3", "epoch-4"]
    # Resumed from the epoch-2 checkpoint: every row of it is back, on both shards.
    staged = tf_dlt._native.Shard(0, 1)
    from tf_dlt.checkpoint import shard_files

    shard_files.load_shard(str(tmp_path / "ck" / "epoch-2" / "tables"), staged)
    table = staged.get_table("faulty")
    assert table.size() == len(ids)
    np.testing.assert_array_equal(seen["resumed_rows"], table.pull(ids, 1))
    for epoch in (3, 4):
        assert (tmp_path / "ck" / f"epoch-{epoch}" / "tf_dlt_model.json").exists()


def _model_on(
    cluster: LocalCluster, name: str, seed: int
) -> tuple[keras.Model, np.ndarray, np.ndarray]:
    """A Functional model whose table `name` (Adagrad) is on `cluster`, and
    256 examples of 3 ids for it."""
    inp = keras.Input((3,), dtype="int64")
    emb = Embedding(output_dim=4, is_distributed=True, optimizer="adagrad", name=name)
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, 2000, size=(256, 3)), rng.normal(size=(256, 1)).astype("float32")
    return tf_dlt.transpile(model, cluster.addresses, request_timeout=20), x, y


def test_training_recovers_when_every_process_of_a_replicated_shard_is_lost(
    tmp_path: Path,
) -> None:
    """Shard 1 has a standby. Its primary dies in epoch 1 (the standby takes
    over: the trainer meets epoch 2), then in epoch 2 the standby that took
    over dies too, and both come back a second later as their supervisor
    restarts them: the shard's replica set begins again, empty, at epoch 1.
    resilient_fit reloads the last checkpoint and goes on through the same
    clients (they refused the restarted set as older than epoch 2)."""
    with LocalCluster(2, workdir=tmp_path / "cluster", replicas=2) as cluster:
        model, x, y = _model_on(cluster, "faulty", seed=2)
        restarts: list[threading.Timer] = []

        def standby_caught_up() -> bool:
            with tf_dlt.Client(cluster.addresses) as client:
                standbys = client.stats()[1]["standbys"]
            return bool(standbys) and bool(standbys[0]["caught_up"])

        def restart_shard_1() -> None:
            for process in (1, 3):  # shard 1's primary and standby (shard-major)
                cluster.restart(process)

        class Crash(keras.callbacks.Callback):  # type: ignore[misc]
            epoch = 0
            killed: list[int] = []

            def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
                self.epoch = epoch

            def on_train_batch_end(self, batch: int, logs: object = None) -> None:
                if self.epoch == 1 and batch == 3 and not self.killed:
                    wait_until(standby_caught_up, "shard 1's standby")
                    self.killed.append(1)
                    cluster.kill(1)  # its standby takes over
                elif self.epoch == 2 and batch == 3 and len(self.killed) == 1:
                    self.killed.append(3)
                    cluster.kill(3)  # the shard's last process
                    restarts.append(threading.Timer(1.0, restart_shard_1))
                    restarts[-1].start()

        try:
            history = tf_dlt.resilient_fit(
                model, x, y, checkpoint=str(tmp_path / "ck"), epochs=4, batch_size=16,
                verbose=0, callbacks=[Crash()],
            )  # fmt: skip
        finally:
            for timer in restarts:
                timer.join(60)
        assert Crash.killed == [1, 3]
        assert history.restarts == 1
        assert history.epoch == [0, 1, 2, 3]
        assert all(np.isfinite(history.history["loss"]))


def test_training_recovers_from_a_shard_restarted_empty_before_its_clients_noticed(
    tmp_path: Path,
) -> None:
    """A shard without standbys killed and restarted at once (its supervisor
    was quick): the trainer's next call reaches it, serving, with none of the
    model's tables, and failed NotFoundError, which resilient_fit did not take
    for a lost shard. It now reloads the last checkpoint and goes on."""
    with LocalCluster(2, workdir=tmp_path / "cluster") as cluster:
        model, x, y = _model_on(cluster, "emptied", seed=3)

        class Restart(keras.callbacks.Callback):  # type: ignore[misc]
            epoch = 0
            done = False

            def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
                self.epoch = epoch

            def on_train_batch_end(self, batch: int, logs: object = None) -> None:
                if self.epoch == 1 and batch == 3 and not Restart.done:
                    Restart.done = True
                    cluster.kill(1)
                    cluster.restart(1)  # serving again, empty, before the next step

        history = tf_dlt.resilient_fit(
            model, x, y, checkpoint=str(tmp_path / "ck"), epochs=3, batch_size=16, verbose=0,
            callbacks=[Restart()],
        )  # fmt: skip
        assert Restart.done and history.restarts == 1
        assert history.epoch == [0, 1, 2]
        assert all(np.isfinite(history.history["loss"]))


def test_a_shard_restarted_from_a_checkpoint_is_never_used_silently(tmp_path: Path) -> None:
    """A shard without standbys restarted at once from a checkpoint
    (`--load-from`, as a supervisor may): the long-lived clients' next call,
    a pull or a push, fails DataLossError naming the shard, and the calls
    after it use the restarted process. Before, they read the checkpoint's
    rows and pushed on top of them as if nothing had happened: the rows
    pushed since the save were gone on that shard only, unnoticed."""
    with LocalCluster(2, workdir=tmp_path / "cluster") as cluster:
        ids = np.arange(200, dtype=np.int64)
        ones = np.ones((200, 4), np.float32)
        puller, pusher = tf_dlt.Client(cluster.addresses), tf_dlt.Client(cluster.addresses)
        puller.create_table("emb", 4, optimizer="sgd")
        pusher.push("emb", ids, ones, 1.0)
        puller.save(str(tmp_path / "ck"))
        saved = puller.pull("emb", ids)
        pusher.push("emb", ids, ones, 1.0)
        trained = puller.pull("emb", ids)
        cluster.kill(1)
        cluster.restart(1, "--load-from", str(tmp_path / "ck"))
        with pytest.raises(errors.DataLossError, match="shard 1"):
            puller.pull("emb", ids)
        with pytest.raises(errors.DataLossError, match="shard 1"):
            pusher.push("emb", ids, ones, 1.0)
        now = puller.pull("emb", ids)
        on_1 = (now == saved).all(axis=1)
        assert 0 < on_1.sum() < len(ids)  # shard 1's rows: the checkpoint's
        np.testing.assert_array_equal(now[~on_1], trained[~on_1])
        pusher.push("emb", ids, ones, 1.0)  # goes on
        np.testing.assert_array_equal(puller.pull("emb", ids), now - 1.0)


def test_training_recovers_from_a_shard_lost_before_the_first_checkpoint(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """Killed in the first epoch, the shard comes back without tables: the
    checkpoint resilient_fit writes before the first epoch is restored."""
    cluster = start_cluster(2)
    model = _model(cluster)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 2000, size=(128, 3)), rng.normal(size=(128, 1)).astype("float32")
    restarts: list[threading.Timer] = []

    class Crash(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if batch == 3 and not restarts:
                cluster.kill(1)
                restarts.append(threading.Timer(1.0, cluster.restart, args=(1,)))
                restarts[-1].start()

    try:
        history = tf_dlt.resilient_fit(
            model, x, y, checkpoint=str(tmp_path / "ck"), epochs=2, batch_size=16, verbose=0,
            callbacks=[Crash()],
        )  # fmt: skip
    finally:
        for timer in restarts:
            timer.join(30)
    assert history.restarts == 1
    assert len(history.history["loss"]) == 2  # both epochs, from the starting checkpoint
    assert (tmp_path / "ck" / "epoch-0" / "tf_dlt_model.json").exists()
    assert (tmp_path / "ck" / "epoch-2" / "tf_dlt_model.json").exists()


def test_training_with_pull_ahead_recovers_from_a_killed_shard(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """Shard 1 dies while rows of the next batches are being pulled ahead:
    the fit fails with a shard error, not a hang, resilient_fit reloads the
    last checkpoint, and every step of the resumed epochs takes a pull ahead
    again. (That pulls left by the failed fit are never served is tested in
    test_pull_ahead.py.)"""
    cluster = start_cluster(2)
    model = tf_dlt.pull_ahead(_model(cluster))
    rng = np.random.default_rng(2)
    x, y = rng.integers(0, 2000, size=(256, 3)), rng.normal(size=(256, 1)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    restarts: list[threading.Timer] = []
    used: list[float] = []

    class Crash(keras.callbacks.Callback):  # type: ignore[misc]
        epoch = 0

        def on_epoch_begin(self, epoch: int, logs: object = None) -> None:
            self.epoch = epoch

        def on_train_begin(self, logs: object = None) -> None:
            used.append(ops.client_stats(model.get_layer("faulty").client)["pulls_ahead_used"])

        on_train_end = on_train_begin

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if self.epoch == 1 and batch == 5 and not restarts:
                cluster.kill(1)
                restarts.append(threading.Timer(1.0, cluster.restart, args=(1,)))
                restarts[-1].start()

    start = time.monotonic()
    try:
        history = tf_dlt.resilient_fit(
            model, data, checkpoint=str(tmp_path / "ck"), epochs=3, verbose=0, callbacks=[Crash()]
        )
    finally:
        for timer in restarts:
            timer.join(30)
    print(f"\nrecovered in {time.monotonic() - start:.1f} s with pull ahead")
    assert history.restarts == 1
    assert len(history.history["loss"]) == 3  # epoch 1, then 2 and 3 resumed from epoch 1
    assert np.isfinite(history.history["loss"]).all()
    # Every step of the resumed fit took its pull ahead: 16 per epoch.
    assert len(used) == 3 and used[2] - used[1] == 2 * 16


def test_a_shard_killed_during_save_leaves_the_last_checkpoint(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    rows = 1_500_000
    client = cluster.client()
    client.create_table("big", 16, optimizer="sgd")
    for start in range(0, rows, 500_000):
        client.pull("big", np.arange(start, start + 500_000))
    first, second = tmp_path / "first", tmp_path / "second"
    client.save(str(first))
    outcome: dict[str, BaseException] = {}

    def save() -> None:
        try:
            client.save(str(second))
        except errors.DltError as e:
            outcome["error"] = e

    saver = threading.Thread(target=save)
    saver.start()
    deadline = time.monotonic() + 60
    while not list(second.glob("shard-00001-of-00002.*")) and time.monotonic() < deadline:
        time.sleep(0.002)
    cluster.kill(1)  # while shard 1 writes its file
    saver.join(60)
    assert isinstance(outcome.get("error"), errors.UnavailableError), outcome
    assert not (second / manifest.MANIFEST).exists()
    with pytest.raises(errors.NotFoundError):
        client.load(str(second))
    cluster.restart(1)  # empty: a fresh process
    client.close()
    client = cluster.client()
    assert client.list_tables().get("big", {"rows": 0})["rows"] < rows
    client.load(str(first))  # the last committed checkpoint
    assert client.list_tables()["big"]["rows"] == rows
    # A later save to the same place commits and removes the half-written files.
    client.save(str(second))
    saved = manifest.read_manifest(str(second))
    committed = {p["file"] for p in saved["files"]}
    copy = manifest.manifest_copy(saved["save_id"])
    assert {p.name for p in second.iterdir()} == committed | {manifest.MANIFEST, copy}
    client.close()


PUSHER = """
import sys, numpy as np, tf_dlt
client = tf_dlt.Client(sys.argv[1].split(","))
ids = np.arange(200_000)
grads = np.ones((len(ids), 8), np.float32)
print("pushing", flush=True)
while True:
    client.push("p", ids, grads, 1.0)
"""


def test_a_trainer_killed_mid_push_leaves_every_row_whole(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(2)
    client = cluster.client()
    client.create_table("p", 8, initializer="zeros", optimizer="sgd")
    rng = np.random.default_rng(1)
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", PUSHER, ",".join(cluster.addresses)], cwd="/",
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"pushing"
        time.sleep(float(rng.uniform(0.2, 0.8)))
        proc.kill()
        proc.wait(30)
        # Another trainer is served meanwhile.
        assert client.pull("p", np.arange(10), training=False).shape == (10, 8)
    rows = client.pull("p", np.arange(200_000), training=False)
    assert (rows == rows[:, :1]).all(), "a row was partly updated"
    assert (rows == np.round(rows)).all() and (rows <= 0).all()  # whole pushes of -1.0
    assert rows.min() < 0  # pushes did land
    print(f"pushes applied per row: {sorted(set((-rows[:, 0]).astype(int).tolist()))}")
    client.close()


@pytest.fixture
def silent_shard() -> Iterator[str]:
    """Accepts connections and never sends a byte."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def test_a_silent_shard_hits_the_deadline_and_is_named(silent_shard: str) -> None:
    start = time.monotonic()
    with pytest.raises((errors.DeadlineExceededError, errors.UnavailableError), match="shard 0"):
        tf_dlt.Client([silent_shard], connect_timeout=0.5).list_tables()
    resource = ops.ClientResource([silent_shard], connect_timeout=0.5, request_timeout=1.0)
    with pytest.raises(
        (tf.errors.DeadlineExceededError, tf.errors.UnavailableError), match="shard 0"
    ):
        ops.lookup(resource, np.arange(3, dtype=np.int64), "t", 4)
    assert time.monotonic() - start < 10


def _trained_past_a_checkpoint(
    client: tf_dlt.Client, ids: np.ndarray, dim: int, path: Path
) -> np.ndarray:
    """Makes Adagrad table "r", trains `ids`, saves to `path` and trains them
    again; returns the rows as saved."""
    client.create_table("r", dim, optimizer="adagrad")
    client.push("r", ids, np.ones((len(ids), dim), np.float32), 0.1)
    client.save(str(path))
    committed = client.pull("r", ids, training=False)
    client.push("r", ids, np.ones((len(ids), dim), np.float32), 0.1)  # after the checkpoint
    return committed


def test_a_client_loads_onto_a_shard_restarted_with_another_admin_port(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """`tf-dlt server --port P` run again takes any free admin port. The
    client that met the shard before asked the dead process's admin port
    for every control call: its `Client.load` (the documented way back
    after a restart) failed UNAVAILABLE on every try, and its pulls then
    read the restarted shard's rows beside the other shard's newer ones
    without an error. Control calls say the shard restarted (DataLossError,
    as a pull does); the load goes to the process serving now, and every
    shard is back at the checkpoint."""
    cluster = start_cluster(2)
    ids = np.arange(2000)
    with cluster.client() as client:
        committed = _trained_past_a_checkpoint(client, ids, 4, tmp_path / "ck")
        admin = cluster.admin_ports[1]
        cluster.kill(1)
        cluster.restart(1, "--load-from", str(tmp_path / "ck"), same_admin_port=False)
        assert cluster.admin_ports[1] != admin
        for _ in range(2):  # (it failed UNAVAILABLE, naming the old admin port, on every try)
            with pytest.raises(errors.DataLossError, match="started since this client met shard 1"):
                client.stats()
        client.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(client.pull("r", ids, training=False), committed)
        assert [s["shard_index"] for s in client.stats()] == [0, 1]


def test_a_restarted_shard_loads_its_part_of_the_last_checkpoint(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    ids = np.arange(5000)
    with cluster.client() as client:
        committed = _trained_past_a_checkpoint(client, ids, 8, tmp_path / "ck")
    cluster.kill(1)
    cluster.restart(1, "--load-from", str(tmp_path / "ck"))
    with cluster.client() as client:
        now = client.pull("r", ids, training=False)
    on_1 = tf_dlt.routing.shard_of(ids, 2) == 1
    np.testing.assert_array_equal(now[on_1], committed[on_1])  # back at the checkpoint
    assert not np.array_equal(now[~on_1], committed[~on_1])  # shard 0 kept its newer rows
