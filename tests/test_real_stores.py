"""Checkpoints on a real HDFS (NameNode + DataNode of Hadoop 2.7.3 on
loopback, reached through hdfs-native) and a real S3-compatible server
(rclone serve s3), each started once for this module and stopped at its end
(tf_dlt.tools.local_stores). Every test runs against both: full save and
load, a delta chain, re-sharding 2 -> 3, `tf-dlt checkpoint ls/compact/
prune`, a follower, ModelCheckpoint, a save cut short by a killed shard, a
corrupt block, and the errors a store's failures become.

Where Java, the Hadoop jars or a package is missing the tests skip saying
which; under CI (CI=true) they fail instead, since CI's set-up installs them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tf_dlt
from tf_dlt import errors
from tf_dlt.checkpoint import manifest
from tf_dlt.tools import local_stores

from conftest import Cluster, staged_rows

pytestmark = pytest.mark.cluster


@dataclasses.dataclass
class Store:
    """A running store: `root` is the URL prefix checkpoints go under, `env`
    what a process needs to reach it."""

    name: str
    root: str
    env: dict[str, str]
    # Flags a shard needs to use it: a URL naming an HDFS host needs a
    # checkpoint root naming that host (docs/security.md).
    flags: tuple[str, ...] = ()

    def url(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def fs(self, url: str) -> tuple[Any, str]:
        return manifest.filesystem(url)

    def names(self, url: str) -> list[str]:
        fs, path = self.fs(url)
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI installs every store; here: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def hdfs_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    reason = local_stores.hdfs_unavailable()
    if reason:
        _unavailable(reason)
    with local_stores.LocalHdfs(tmp_path_factory.mktemp("hdfs")) as hdfs:
        yield Store("hdfs", hdfs.url, {}, ("--checkpoint-root", hdfs.url))


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    reason = local_stores.s3_unavailable()
    if reason:
        _unavailable(reason)
    with (
        local_stores.LocalS3(tmp_path_factory.mktemp("s3")) as s3,
        pytest.MonkeyPatch.context() as mp,
    ):
        for key, value in s3.env.items():
            mp.setenv(key, value)
        import s3fs  # type: ignore[import-untyped]

        s3fs.S3FileSystem.clear_instance_cache()
        yield Store("s3", "s3://tf-dlt", s3.env)
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(params=["hdfs", "s3"])
def store(request: pytest.FixtureRequest) -> Store:
    """The store, with a directory of this test's own as its root."""
    found: Store = request.getfixturevalue(f"{request.param}_store")
    return dataclasses.replace(found, root=found.url(f"t-{secrets.token_hex(4)}"))


def _train(client: tf_dlt.Client, ids: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for name, dim in (("ada", 8), ("adam", 4)):
        client.pull(name, ids)
        client.push(name, ids, rng.normal(size=(len(ids), dim)).astype(np.float32), 0.1)


def _chain(client: tf_dlt.Client, store: Store, ids: np.ndarray) -> None:
    """Tables "ada" and "adam" trained and saved as run/c1 (full), c2 and c3
    (deltas, c3 with rows removed)."""
    client.create_table("ada", 8, "normal", "adagrad", seed=1)
    client.create_table("adam", 4, "uniform", "adam", seed=2)
    _train(client, ids, 1)
    client.save(store.url("run", "c1"))
    _train(client, ids[:300], 2)
    client.save(store.url("run", "c2"), base=store.url("run", "c1"))
    _train(client, ids[:100], 3)
    client.shrink("ada", min_count=2)  # removes ids[300:], pushed once
    _train(client, np.arange(10**6, 10**6 + 50, dtype=np.int64), 4)
    client.save(store.url("run", "c3"), base=store.url("run", "c2"))


def _snapshot(client: tf_dlt.Client, ids: np.ndarray) -> dict[str, np.ndarray]:
    return {name: client.pull(name, ids) for name in ("ada", "adam")}


IDS = np.random.default_rng(0).integers(-(2**62), 2**62, 2000, dtype=np.int64)


def test_full_save_delta_chain_and_resharding_2_to_3(
    store: Store, start_cluster: Callable[..., Cluster]
) -> None:
    trainer = start_cluster(2, *store.flags, env=store.env)
    with trainer.client() as c:
        _chain(c, store, IDS)
        tables = c.list_tables()
        expected = _snapshot(c, IDS)  # (pulls make the removed rows anew)
        c.push("ada", IDS, np.ones((len(IDS), 8), np.float32), 1.0)  # moves on
        c.load(store.url("run", "c3"))
        assert {k: v["rows"] for k, v in c.list_tables().items()} == {  # before any pull
            k: v["rows"] for k, v in tables.items()
        }
        for name, rows in expected.items():
            np.testing.assert_array_equal(c.pull(name, IDS), rows)
    kinds = [manifest.read_manifest(store.url("run", f"c{k}"))["kind"] for k in (1, 2, 3)]
    assert kinds == ["full", "delta", "delta"]
    # A committed checkpoint holds its manifest and one file per shard, and
    # nothing a save wrote on the way (temporary names).
    assert store.names(store.url("run", "c3")) == _committed(store.url("run", "c3"))
    with start_cluster(3, *store.flags, env=store.env).client() as c:
        c.load(store.url("run", "c3"))
        for name, rows in expected.items():
            np.testing.assert_array_equal(c.pull(name, IDS), rows)


def _cli(store: Store, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tf_dlt.tools.cli", "checkpoint", *args],
        capture_output=True, text=True, timeout=180, env={**os.environ, **store.env},
    )  # fmt: skip


def test_checkpoint_ls_compact_and_prune(
    store: Store, start_cluster: Callable[..., Cluster]
) -> None:
    with start_cluster(2, *store.flags, env=store.env).client() as c:
        _chain(c, store, IDS)
        c.save(store.url("run", "c4"))  # a new base
    out = _cli(store, "ls", store.url("run", "c3"))
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()[1:]] == ["full", "delta", "delta"]
    listed = json.loads(_cli(store, "ls", store.url("run"), "--json").stdout)
    assert [r["path"].rsplit("/", 1)[-1] for r in listed] == ["c1", "c2", "c3", "c4"]
    out = _cli(
        store, "compact", store.url("run", "c3"), store.url("compacted"), "--num-shards", "3"
    )
    assert out.returncode == 0, out.stderr
    compacted = manifest.read_manifest(store.url("compacted"))
    assert compacted["kind"] == "full" and compacted["num_shards"] == 3
    assert staged_rows(store.url("compacted"), 2) == staged_rows(store.url("run", "c3"), 2)
    out = _cli(store, "prune", store.url("run"), "--keep", "2")  # c3 needs c1, c2
    assert out.returncode == 0 and "kept 4" in out.stdout, out.stdout + out.stderr
    out = _cli(store, "prune", store.url("run"), "--keep", "1")
    assert out.returncode == 0, out.stderr
    assert store.names(store.url("run")) == ["c4"]
    assert _cli(store, "ls", store.url("nothing")).returncode == 1


def test_a_follower_applies_the_deltas_saved_to_the_store(
    store: Store, start_cluster: Callable[..., Cluster]
) -> None:
    trainer = start_cluster(2, *store.flags, env=store.env)
    with trainer.client() as c:
        c.create_table("ada", 8, "normal", "adagrad", seed=1)
        c.create_table("adam", 4, "uniform", "adam", seed=2)
        _train(c, IDS, 1)
        c.save(store.url("run", "c1"))
        first = _snapshot(c, IDS)
    followers = start_cluster(
        3, *store.flags, "--read-only", "--follow", store.url("run"), "--follow-interval", "0.2",
        env=store.env,
    )  # fmt: skip

    def serving(save_id: str) -> None:
        deadline = time.monotonic() + 90
        with followers.client() as f:
            while not all(s.get("serving_save_id") == save_id for s in f.stats()):
                assert time.monotonic() < deadline, f.stats()
                time.sleep(0.1)

    serving(manifest.read_manifest(store.url("run", "c1"))["save_id"])
    with followers.client() as f:
        for name, rows in first.items():
            np.testing.assert_array_equal(f.pull(name, IDS), rows)
    with trainer.client() as c:
        _train(c, IDS[:200], 2)
        d2 = c.save(store.url("run", "c2"), base=store.url("run", "c1"))
        second = _snapshot(c, IDS)
    assert d2["kind"] == "delta"
    serving(d2["save_id"])
    with followers.client() as f:
        assert all(int(s["deltas_applied"]) == 1 and s["follow_current"] for s in f.stats())
        for name, rows in second.items():
            np.testing.assert_array_equal(f.pull(name, IDS), rows)


def test_model_checkpoint_with_full_every_and_keep(store: Store) -> None:
    import keras

    os.environ.update(store.env)  # the model's embedded tables save from this process
    name = f"store_{store.name}"
    inp = keras.Input((3,), dtype="int64")
    emb = tf_dlt.layers.Embedding(
        output_dim=4, is_distributed=True, optimizer="adam", learning_rate=0.05, name=name
    )
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(emb(inp))))
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(7)
    x = rng.integers(0, 300, size=(96, 3)).astype("int64")
    y = rng.normal(size=(96, 1)).astype("float32")
    callback = tf_dlt.ModelCheckpoint(store.url("run", "epoch-{epoch}"), full_every=2, keep=2)
    model.fit(x, y, epochs=4, batch_size=16, verbose=0, callbacks=[callback])
    assert callback.kinds == ["full", "delta", "full", "delta"]
    assert [p.rsplit("-", 1)[-1] for p in callback.deleted] == ["1", "2"]
    assert store.names(store.url("run")) == ["epoch-3", "epoch-4"]
    expected = model.predict(x, verbose=0)
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)  # moves everything on
    tf_dlt.load(model, store.url("run", "epoch-4"))
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, atol=1e-6)


def test_a_save_cut_short_by_a_killed_shard_leaves_the_last_checkpoint_loadable(
    store: Store, start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    spool = tmp_path / "spool"  # where the shards stage a file before it goes to the store
    spool.mkdir()
    cluster = start_cluster(2, *store.flags, env={**store.env, "TMPDIR": str(spool)})
    ids = np.arange(100_000, dtype=np.int64)
    with cluster.client(request_timeout=120) as c:
        c.create_table("t", 32, "normal", "adagrad", seed=1)
        c.push("t", ids, np.ones((len(ids), 32), np.float32), 0.1)
        c.save(store.url("c1"))
        c.push("t", ids, np.ones((len(ids), 32), np.float32), 0.1)
        seen: list[BaseException] = []

        def save() -> None:
            try:
                c.save(store.url("c2"), base=store.url("c1"))
            except errors.DltError as e:
                seen.append(e)

        worker = threading.Thread(target=save)
        worker.start()
        deadline = time.monotonic() + 60
        while not list(spool.glob("tf_dlt-save-*/shard-00001-*")):
            assert time.monotonic() < deadline and worker.is_alive(), "the save never started"
            time.sleep(0.002)
        cluster.kill(1)
        worker.join(120)
        assert seen and isinstance(seen[0], errors.UnavailableError), seen
    fs, path = store.fs(store.url("c2"))
    assert not fs.exists(f"{path}/MANIFEST.json")
    cluster.restart(1)
    with cluster.client() as c:
        c.load(store.url("c1"))
        assert c.list_tables()["t"]["rows"] == len(ids)
        # The next save to the same path commits and leaves only its own files.
        c.save(store.url("c2"), base=store.url("c1"))
    assert store.names(store.url("c2")) == _committed(store.url("c2"))


def _committed(url: str) -> list[str]:
    """The names a committed checkpoint at `url` holds: its manifest, the
    manifest's copy, and the files it names."""
    m = manifest.read_manifest(url)
    files = [f["file"] for f in m["files"]]
    return sorted([manifest.MANIFEST, manifest.manifest_copy(m["save_id"]), *files])


def test_a_corrupt_block_is_refused_naming_its_file(
    store: Store, start_cluster: Callable[..., Cluster]
) -> None:
    with start_cluster(2, *store.flags, env=store.env).client() as c:
        c.create_table("ada", 8, "normal", "adagrad", seed=1)
        c.create_table("adam", 4, "uniform", "adam", seed=2)
        _train(c, IDS, 1)
        c.save(store.url("c1"))
        before = _snapshot(c, IDS)
        victim = manifest.read_manifest(store.url("c1"))["files"][1]["file"]
        fs, path = store.fs(store.url("c1", victim))
        data = bytearray(fs.cat_file(path))
        data[int(len(data) * 0.75)] ^= 0xFF
        fs.pipe_file(path, bytes(data))
        _train(c, IDS, 2)
        moved = _snapshot(c, IDS)
        with pytest.raises(errors.FailedPreconditionError, match=victim):
            c.load(store.url("c1"))
        for name, rows in moved.items():  # nothing changed
            np.testing.assert_array_equal(c.pull(name, IDS), rows)
        assert not np.array_equal(moved["ada"], before["ada"])
        # Bytes appended after the last block: refused as on a local disk
        # (they were read past unseen here).
        c.save(store.url("c2"))
        victim = manifest.read_manifest(store.url("c2"))["files"][1]["file"]
        fs, path = store.fs(store.url("c2", victim))
        fs.pipe_file(path, fs.cat_file(path) + b"appended" * 1000)
        with pytest.raises(errors.FailedPreconditionError, match=f"{victim} holds .* bytes"):
            c.load(store.url("c2"))
        for name, rows in moved.items():
            np.testing.assert_array_equal(c.pull(name, IDS), rows)


def test_a_url_with_a_query_or_fragment_is_refused_before_a_write(
    store: Store, start_cluster: Callable[..., Cluster]
) -> None:
    """s3fs cuts a key at '?versionId=': every file of a save to
    `.../x?versionId=1` landed on one object `.../x` (the save returned
    success, the checkpoint did not load), and a save to
    `.../c1/MANIFEST.json?versionId=1` replaced c1's manifest. HDFS drops
    a query or fragment. Refused, and c1 still loads; S3 keys holding '#'
    or another '?' are keys like any other."""
    with start_cluster(2, *store.flags, env=store.env).client() as c:
        c.create_table("ada", 8, "normal", "adagrad", seed=1)
        c.create_table("adam", 4, "uniform", "adam", seed=2)
        _train(c, IDS, 1)
        c.save(store.url("c1"))
        refused = [store.url("x") + "?versionId=1", store.url("c1", "MANIFEST.json?versionId=1")]
        if store.name == "hdfs":
            refused += [store.url("y") + "#frag", store.url("z") + "?a=1"]
        for url in refused:
            with pytest.raises(errors.InvalidArgumentError, match="query or fragment"):
                c.save(url)
        assert store.names(store.url()) == ["c1"]
        c.load(store.url("c1"))
        if store.name == "s3":
            rows = c.pull("ada", IDS)
            c.save(store.url("exp#3?lr=0.1"))
            _train(c, IDS, 2)
            c.load(store.url("exp#3?lr=0.1"))
            np.testing.assert_array_equal(c.pull("ada", IDS), rows)


def _on_a_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[BaseException | None]]:
    """`call()` on a daemon thread, started: the thread, and a list that
    takes its outcome when it ends (None if it returned, else what it
    raised)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _bounded(error: errors.DltError) -> None:
    """A store's failure reaches the caller as a short message of its own
    (a Java stack trace or a server's reply left out)."""
    assert len(error.message) < 1500, error.message
    assert "\tat " not in error.message and "org.apache.hadoop.hdfs.server" not in error.message


def test_store_failures_reach_the_caller_as_typed_bounded_errors(
    store: Store, start_cluster: Callable[..., Cluster]
) -> None:
    with start_cluster(2, *store.flags, env=store.env).client() as c:
        c.create_table("ada", 8, "normal", "adagrad", seed=1)
        _train_one = np.arange(100, dtype=np.int64)
        c.push("ada", _train_one, np.ones((100, 8), np.float32), 0.1)
        with pytest.raises(errors.NotFoundError, match="no committed checkpoint") as missing:
            c.load(store.url("nothing"))
        _bounded(missing.value)
        # A path whose parent is a file, not a directory.
        fs, path = store.fs(store.url("file"))
        fs.pipe_file(path, b"not a directory")
        if store.name == "hdfs":  # S3 has no directories: the key prefix is fine
            with pytest.raises(errors.DltError) as under_a_file:
                c.save(store.url("file", "ck"))
            assert not isinstance(under_a_file.value, errors.InternalError)
            _bounded(under_a_file.value)
    # The store cannot be reached: UNAVAILABLE, after bounded retries.
    if store.name == "hdfs":
        dead, env, flags = (
            "hdfs://127.0.0.1:1/ck",
            store.env,
            ("--checkpoint-root", "hdfs://127.0.0.1:1"),
        )
    else:
        dead, env = store.url("ck"), {**store.env, "AWS_ENDPOINT_URL": "http://127.0.0.1:1"}
        flags = store.flags
    with start_cluster(1, *flags, env=env).client(request_timeout=120) as c:
        c.create_table("ada", 8, "normal", "adagrad", seed=1)
        with pytest.raises(errors.UnavailableError) as unreachable:  # not the deadline
            c.save(dead)
        _bounded(unreachable.value)
    if store.name == "s3":  # a bucket whose name has a typo: never created
        with start_cluster(1, env=store.env).client() as c:
            c.create_table("ada", 8, "normal", "adagrad", seed=1)
            with pytest.raises(errors.NotFoundError, match="bucket does not exist") as typo:
                c.save("s3://tf-dtl/run/c1")
            _bounded(typo.value)
            fs, _ = store.fs(store.url())
            assert not fs.exists("tf-dtl")  # s3fs's makedirs made it, and the save went there
    if store.name == "s3":  # credentials the server refuses
        wrong = {**store.env, "AWS_SECRET_ACCESS_KEY": "wrong"}
        with start_cluster(1, *store.flags, env=wrong).client() as c:
            c.create_table("ada", 8, "normal", "adagrad", seed=1)
            with pytest.raises(errors.PermissionDeniedError) as refused:
                c.save(store.url("ck"))
            _bounded(refused.value)


def test_an_upload_to_a_store_that_stopped_answering_ends_by_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 endpoint that accepts connections and stops reading (a hung
    host) held a shard's save, and every save and load of the shard after
    it, until the endpoint woke (8 minutes and more: botocore's read timeout
    does not cover sending a request's body). Uploads end by a deadline of
    their size (shortened here): UNAVAILABLE, naming the object."""
    reason = local_stores.s3_unavailable()
    if reason:
        _unavailable(reason)
    import s3fs

    monkeypatch.setenv("TF_DLT_UPLOAD_DEADLINE_S", "3")
    monkeypatch.setenv("TF_DLT_UPLOAD_MIN_BYTES_PER_S", str(1 << 40))
    part = tmp_path / "part.h5"
    part.write_bytes(os.urandom(24 << 20))
    with local_stores.LocalS3(tmp_path / "s3") as s3:
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        fs, root = manifest.filesystem("s3://tf-dlt/run")
        # It answers (within a deadline no loaded machine passes; 3 s then).
        monkeypatch.setenv("TF_DLT_UPLOAD_DEADLINE_S", "120")
        manifest.put_durably(fs, str(part), f"{root}/before.h5")
        monkeypatch.setenv("TF_DLT_UPLOAD_DEADLINE_S", "3")
        with s3.paused("s3"):
            started = time.monotonic()
            thread, outcome = _on_a_thread(
                lambda: manifest.put_durably(fs, str(part), f"{root}/during.h5")
            )
            thread.join(60)
            took = time.monotonic() - started
        thread.join(120)
        assert outcome and isinstance(outcome[0], errors.UnavailableError), outcome
        assert "during.h5 timed out after 3 s (its deadline 3 s" in outcome[0].message
        assert took < 30, took
        # A multipart upload (in parts of 5 MiB here; 50 MiB parts of a
        # file of 100 MiB or more) whose part never ends: s3fs aborts its
        # upload on an Exception only, and the cancelled one kept its parts.
        monkeypatch.setattr(s3fs.core, "calculate_chunksize", lambda *_a, **_k: 5 << 20)
        stalled = fs._call_s3

        async def a_part_that_never_ends(method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "upload_part" and kwargs.get("PartNumber") == 3:
                await asyncio.sleep(3600)
            return await stalled(method, *args, **kwargs)

        monkeypatch.setattr(fs, "_call_s3", a_part_that_never_ends)
        with pytest.raises(errors.UnavailableError, match="parts.h5 timed out"):
            manifest.put_durably(fs, str(part), f"{root}/parts.h5")
        monkeypatch.setattr(fs, "_call_s3", stalled)
        bucket = root.split("/", 1)[0]
        assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
        s3fs.S3FileSystem.clear_instance_cache()


def test_a_shard_file_read_from_a_store_that_stopped_answering_ends_by_its_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that keeps a GET of a shard file open (a byte now and then:
    botocore's read timeout bounds each socket read, not a request) held a
    shard's load, every save and load of the shard after it, and the
    process past SIGTERM, for as long as it went on. A ranged read ends by
    the deadline of its size: UNAVAILABLE, naming the file."""
    reason = local_stores.s3_unavailable()
    if reason:
        _unavailable(reason)
    import s3fs

    from tf_dlt.checkpoint import verified

    monkeypatch.setenv("TF_DLT_UPLOAD_DEADLINE_S", "120")  # 3 s once the store stalls
    monkeypatch.setenv("TF_DLT_UPLOAD_MIN_BYTES_PER_S", str(1 << 40))
    data = os.urandom(3 << 20)
    block = 1 << 20
    import hashlib

    entry = {
        "file": "part.h5",
        "bytes": len(data),
        "block_bytes": block,
        "block_sha256": [
            hashlib.sha256(data[k : k + block]).hexdigest() for k in range(0, len(data), block)
        ],
    }
    with local_stores.LocalS3(tmp_path / "s3") as s3:
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        fs, root = manifest.filesystem("s3://tf-dlt/run")
        fs.pipe_file(f"{root}/part.h5", data)
        got = verified.fetch_verified(fs, root, entry, str(tmp_path))  # it answers
        assert Path(got).read_bytes() == data
        answered = fs._call_s3

        async def a_get_that_never_ends(method: str, *args: Any, **kwargs: Any) -> Any:
            if method == "get_object":
                await asyncio.sleep(3600)
            return await answered(method, *args, **kwargs)

        monkeypatch.setattr(fs, "_call_s3", a_get_that_never_ends)
        monkeypatch.setenv("TF_DLT_UPLOAD_DEADLINE_S", "3")
        started = time.monotonic()
        thread, outcome = _on_a_thread(
            lambda: verified.fetch_verified(fs, root, entry, str(tmp_path))
        )
        thread.join(60)
        took = time.monotonic() - started
        monkeypatch.setattr(fs, "_call_s3", answered)
        assert outcome and isinstance(outcome[0], errors.UnavailableError), (outcome, took)
        assert "part.h5 timed out after 3 s" in outcome[0].message
        assert took < 30, took
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize(
    ("stalled", "asking", "what"),
    [
        ("get_object", "read_manifest", "reading s3://tf-dlt/run/c1/MANIFEST.json"),
        ("list_objects_v2", "find", "listing s3://tf-dlt/run"),
        ("head_object", "read_manifest", "looking up s3://tf-dlt/run/c1/MANIFEST.json"),
    ],
    ids=["manifest_read", "listing", "head"],
)
def test_a_manifest_read_a_listing_and_a_head_against_a_store_that_trickles_end_by_their_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stalled: str, asking: str, what: str
) -> None:
    """The small requests to a store (a HEAD, a listing, a read of
    MANIFEST.json) had no deadline: a store that kept one open (a byte now
    and then: botocore's read timeout bounds each socket read, not a
    request) held a save's checks, a load, a follower's poll, `tf-dlt
    checkpoint ls` and the process past SIGTERM for as long as it went on.
    Each ends by its deadline (shortened here): UNAVAILABLE, naming the
    request and the path."""
    reason = local_stores.s3_unavailable()
    if reason:
        _unavailable(reason)
    import s3fs

    from tf_dlt import _native
    from tf_dlt.checkpoint import chain, shard_files
    from tf_dlt.table_config import TableConfig

    monkeypatch.setenv("TF_DLT_UPLOAD_DEADLINE_S", "120")  # 2 s once the store stalls
    monkeypatch.setenv("TF_DLT_UPLOAD_MIN_BYTES_PER_S", str(1 << 40))
    shard = _native.Shard(0, 1)
    shard.create_table(TableConfig("t", 2).to_dict())
    url = "s3://tf-dlt/run/c1"
    ask = {
        "read_manifest": lambda: manifest.read_manifest(url),  # a load's, a save's checks
        "find": lambda: chain.find("s3://tf-dlt/run"),  # a follower's poll, checkpoint ls
    }[asking]
    with local_stores.LocalS3(tmp_path / "s3") as s3:
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        save_id = manifest.new_save_id()
        manifest.write_manifest(url, [shard_files.save_shard(url, shard, save_id)], save_id)
        assert ask()  # it answers
        fs, _ = manifest.filesystem(url)
        answered = fs._call_s3

        async def trickling(method: str, *args: Any, **kwargs: Any) -> Any:
            if method == stalled:
                await asyncio.sleep(3600)
            return await answered(method, *args, **kwargs)

        monkeypatch.setattr(fs, "_call_s3", trickling)
        monkeypatch.setenv("TF_DLT_UPLOAD_DEADLINE_S", "2")
        started = time.monotonic()
        thread, outcome = _on_a_thread(ask)
        thread.join(20)
        took = time.monotonic() - started
        monkeypatch.setattr(fs, "_call_s3", answered)
        assert outcome and isinstance(outcome[0], errors.UnavailableError), (outcome, took)
        assert f"{what} timed out after 2 s (its deadline 2 s" in outcome[0].message
        assert took < 15, took
        s3fs.S3FileSystem.clear_instance_cache()


def test_hdfs_calls_to_a_namenode_that_never_answers_end_by_their_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """hdfs-native has no setting that bounds a NameNode that accepts
    connections and never answers (no RPC or connect timeout): a lookup
    waited past 150 s, and a shard's save (and every save and load of the
    shard after it), a load, a follower's poll or `tf-dlt checkpoint ls`
    would wait for good. Each HDFS call ends by its deadline (shortened
    here), as on S3: UNAVAILABLE, naming the request and the path. Needs
    hdfs-native only (no HDFS): a loopback socket plays the NameNode."""
    pytest.importorskip("hdfs_native")
    from tf_dlt import _native
    from tf_dlt.checkpoint import chain, shard_files
    from tf_dlt.table_config import TableConfig

    monkeypatch.setenv("TF_DLT_UPLOAD_DEADLINE_S", "2")
    monkeypatch.setenv("TF_DLT_UPLOAD_MIN_BYTES_PER_S", str(1 << 40))
    shard = _native.Shard(0, 1)
    shard.create_table(TableConfig("t", 2).to_dict())
    accepted: list[socket.socket] = []
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        root = f"hdfs://127.0.0.1:{listener.getsockname()[1]}/run"

        def accept() -> None:  # and never answer
            while not stop.is_set():
                try:
                    accepted.append(listener.accept()[0])
                except TimeoutError:
                    continue

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        asks: list[tuple[str, Callable[[], object]]] = [
            (f"looking up {root}/c1/MANIFEST.json", lambda: manifest.read_manifest(f"{root}/c1")),
            (f"listing {root}", lambda: chain.find(root)),  # a follower's poll, checkpoint ls
            (  # a shard's save
                f"making the directory {root}/c2",
                lambda: shard_files.save_shard(f"{root}/c2", shard, manifest.new_save_id()),
            ),
        ]
        try:
            for what, ask in asks:
                outcome: list[BaseException | None] = []

                def send(ask: Callable[[], object] = ask, outcome: list[Any] = outcome) -> None:
                    try:
                        ask()
                        outcome.append(None)
                    except BaseException as e:  # noqa: BLE001 - the test reads it
                        outcome.append(e)

                started = time.monotonic()
                thread = threading.Thread(target=send, daemon=True)
                thread.start()
                thread.join(30)
                took = time.monotonic() - started
                assert outcome and isinstance(outcome[0], errors.UnavailableError), (
                    what, outcome, took,
                )  # fmt: skip
                assert f"{what} timed out after 2 s (its deadline 2 s" in outcome[0].message
                assert took < 30, took
            assert accepted  # it was asked, and never answered
        finally:
            stop.set()
            acceptor.join(10)
            for conn in accepted:  # the calls left behind end on their closed connections
                conn.close()
    # Each call left behind past its deadline ends once its connection
    # does (hdfs-native's retries refused): none outlives the test (one
    # returning as the interpreter exits aborted it, "exception not rethrown").
    for left in [t for t in threading.enumerate() if t.name.startswith("tf_dlt-hdfs ")]:
        left.join(60)
        assert not left.is_alive(), left.name
