"""Delta checkpoints and chains: a chain loads to exactly the state a full
save of the same moment loads (values, slots, steps, ages) on 1 and 3
shards; tombstones; a row and its slots from one moment while pushes run;
broken, corrupt and interrupted links; retention and compaction."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tf_dlt
from tf_dlt import _native, errors
from tf_dlt.checkpoint import chain, manifest, shard_files, shard_format, shard_save

from conftest import Cluster, flip_byte, staged_rows


def _train(client: tf_dlt.Client, ids: np.ndarray, seed: int, tables: dict[str, int]) -> None:
    rng = np.random.default_rng(seed)
    for name, dim in tables.items():
        client.pull(name, ids)
        client.push(name, ids, rng.normal(size=(len(ids), dim)).astype(np.float32), 0.1)


TABLES = {"adam": 8, "ftrl": 5, "sgd": 3}


def _base(client: tf_dlt.Client, ids: np.ndarray, path: Path) -> None:
    """Table "t" (dim 4, Adagrad) trained on `ids`, saved in full at `path`."""
    client.create_table("t", 4, "normal", "adagrad", seed=1)
    _train(client, ids, 1, {"t": 4})
    client.save(str(path))


def _base_and_delta(client: tf_dlt.Client, ids: np.ndarray, base: Path, delta: Path) -> None:
    """`_base` at `base`, then `ids[:50]` trained and saved as a delta on it
    at `delta`."""
    _base(client, ids, base)
    _train(client, ids[:50], 2, {"t": 4})
    client.save(str(delta), base=str(base))


def _loads_back(
    client: tf_dlt.Client, path: Path, ids: np.ndarray, state: np.ndarray, seed: int
) -> None:
    """Trains table "t" on (training moves on), loads `path`, and checks
    that `ids` hold `state` again."""
    _train(client, ids[:50], seed, {"t": 4})
    client.load(str(path))
    np.testing.assert_array_equal(client.pull("t", ids), state)


def _create(client: tf_dlt.Client) -> None:
    client.create_table("adam", 8, "normal", "adam", seed=1)
    client.create_table("ftrl", 5, "zeros", "ftrl", seed=3)
    client.create_table("sgd", 3, "uniform", "sgd", seed=2)


@pytest.mark.parametrize("load_shards", [1, 3])
def test_chain_loads_what_a_full_save_of_the_same_state_loads(
    start_cluster: Callable[..., Cluster], tmp_path: Path, load_shards: int
) -> None:
    cluster = start_cluster(2)
    rng = np.random.default_rng(0)
    ids = rng.integers(-(2**63), 2**63 - 1, 6000, dtype=np.int64)
    with cluster.client() as c:
        _create(c)
        _train(c, ids[:4000], 1, TABLES)
        c.save(str(tmp_path / "base"))
        _train(c, ids[:300], 2, TABLES)  # changed rows
        _train(c, ids[4000:4500], 3, {"adam": 8})  # new rows
        assert c.shrink("ftrl", min_count=2) > 0  # tombstones
        d1 = c.save(str(tmp_path / "d1"), base=str(tmp_path / "base"))
        c.drop_table("ftrl")
        c.create_table("emb2", 4, "normal", "adagrad", seed=5)  # a table new since the base
        _train(c, ids[4500:5000], 4, {"emb2": 4, "adam": 8})
        for _ in range(3):  # sgd rows untouched for 2 pushes go
            _train(c, ids[:10], 5, {"sgd": 3})
        assert c.shrink("sgd", unseen_for=2) > 0
        d2 = c.save(str(tmp_path / "d2"), base=str(tmp_path / "d1"))
        full = c.save(str(tmp_path / "full"))
    assert (d1["kind"], d1["chain_length"], d2["kind"], d2["chain_length"]) == (
        "delta", 2, "delta", 3
    )  # fmt: skip
    by_name = {t["config"]["name"]: t for t in d1["tables"]}
    assert by_name["adam"]["rows"] == 800 and by_name["sgd"]["rows"] == 300
    assert by_name["ftrl"]["removed"] > 0 and by_name["ftrl"]["full_files"] == 0
    emb2 = {t["config"]["name"]: t for t in d2["tables"]}["emb2"]
    assert emb2["full_files"] == 2  # new since the base: written whole
    assert {t["config"]["name"] for t in full["tables"]} == {"adam", "emb2", "sgd"}
    chained = staged_rows(str(tmp_path / "d2"), load_shards)
    whole = staged_rows(str(tmp_path / "full"), load_shards)
    assert set(chained) == {"adam", "emb2", "sgd"}
    for name in whole:
        assert chained[name] == whole[name], name
    assert len(whole["sgd"]) < 4000  # expiry removed rows, and the chain knows


def test_chain_onto_a_running_cluster_and_deltas_on_top_of_the_load(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    ids = np.arange(3000, dtype=np.int64)
    with start_cluster(2).client() as c:
        _create(c)
        _train(c, ids, 1, TABLES)
        c.save(str(tmp_path / "base"))
        _train(c, ids[:50], 2, TABLES)
        c.save(str(tmp_path / "d1"), base=str(tmp_path / "base"))
    three = start_cluster(3)
    with three.client() as c:
        loaded = c.load(str(tmp_path / "d1"))
        assert loaded["adam"]["rows"] == 3000
        # A delta on top of the loaded checkpoint holds only what changed
        # after the load, on the new shard count.
        _train(c, ids[100:110], 3, {"adam": 8})
        d2 = c.save(str(tmp_path / "d2"), base=str(tmp_path / "d1"))
        c.save(str(tmp_path / "full"))
    assert {t["config"]["name"]: t["rows"] for t in d2["tables"]} == {
        "adam": 10, "ftrl": 0, "sgd": 0
    }  # fmt: skip
    assert d2["num_shards"] == 3 and d2["kind"] == "delta"
    assert staged_rows(str(tmp_path / "d2"), 2) == staged_rows(str(tmp_path / "full"), 2)


def test_removed_and_readmitted_rows(start_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    ids = np.arange(1000, dtype=np.int64)
    with start_cluster(1).client() as c:
        _base(c, ids, tmp_path / "base")
        _train(c, ids[:500], 2, {"t": 4})  # rows [0, 500) get 2 updates
        assert c.shrink("t", min_count=2) == 500  # [500, 1000) go
        _train(c, ids[900:], 3, {"t": 4})  # [900, 1000) come back, fresh
        c.save(str(tmp_path / "d1"), base=str(tmp_path / "base"))
        c.save(str(tmp_path / "full"))
    rows = staged_rows(str(tmp_path / "d1"), 1)["t"]
    assert sorted(rows) == list(range(500)) + list(range(900, 1000))
    assert rows == staged_rows(str(tmp_path / "full"), 1)["t"]


def test_a_row_and_its_slots_come_from_one_moment_while_pushes_run(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """Every row of a delta taken during pushes equals an oracle replay of
    the same pushes after as many updates as the row's step count: value,
    Adam slots and step from one moment (DeepRec #1023 mixed them)."""
    n, dim, pushes = 20000, 4, 24
    config = tf_dlt.TableConfig.create("adam", dim, "normal", "adam", seed=3)
    ids = np.arange(n, dtype=np.int64)

    def grads(k: int) -> np.ndarray:
        return np.random.default_rng(k).normal(size=(n, dim)).astype(np.float32)

    # The oracle: the same pushes on a local table, every step recorded.
    oracle = _native.Table(config.to_dict())
    states = []
    oracle.pull(ids)
    for k in range(pushes):
        oracle.push(ids, grads(k), 0.01)
        ex = oracle.exporter()
        got = {}
        while (chunk := ex.next(8192)) is not None:
            for i in range(len(chunk[0])):
                got[int(chunk[0][i])] = (chunk[1][i].tobytes(), chunk[2][i].tobytes())
        states.append(got)
    with start_cluster(2).client() as c:
        c.create_table_from_config(config)
        c.pull("adam", ids)
        c.push("adam", ids, grads(0), 0.01)
        c.save(str(tmp_path / "base"))

        def push_rest() -> None:
            with tf_dlt.Client(c.pservers) as pusher:
                for k in range(1, pushes):
                    pusher.push("adam", ids, grads(k), 0.01)

        worker = threading.Thread(target=push_rest)
        worker.start()
        saved = []
        while worker.is_alive() or not saved:
            saved.append(c.save(str(tmp_path / f"d{len(saved)}"), base=str(tmp_path / "base")))
        worker.join()
    steps_seen = set()
    for k in range(len(saved)):
        rows = staged_rows(str(tmp_path / f"d{k}"), 1)["adam"]
        assert len(rows) == n
        for i, (values, slots, step, _) in rows.items():
            assert (values, slots) == states[step - 1][i], (k, i, step)
            steps_seen.add(step)
    assert len(steps_seen) > 1  # the saves did overlap the pushes


def test_broken_missing_and_corrupt_links_are_refused_naming_them(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    ids = np.arange(2000, dtype=np.int64)
    with start_cluster(2).client() as c:
        _base(c, ids, tmp_path / "base")
        for k in (1, 2, 3):
            _train(c, ids[k * 10 : k * 10 + 10], k, {"t": 4})
            prev = "base" if k == 1 else f"d{k - 1}"
            c.save(str(tmp_path / f"d{k}"), base=str(tmp_path / prev))
        before = c.pull("t", ids)
        # A corrupt delta: refused, naming its file; the chain before it loads.
        d3 = json.loads((tmp_path / "d3" / "MANIFEST.json").read_text())
        flip_byte(tmp_path / "d3" / d3["files"][1]["file"], 0.5)
        with pytest.raises(errors.FailedPreconditionError, match=d3["files"][1]["file"]):
            c.load(str(tmp_path / "d3"))
        np.testing.assert_array_equal(c.pull("t", ids), before)  # nothing changed
        c.load(str(tmp_path / "d2"))
        # A missing link: refused, naming it.
        shutil.rmtree(tmp_path / "d1")
        with pytest.raises(errors.FailedPreconditionError, match="broken checkpoint chain.*d1"):
            c.load(str(tmp_path / "d2"))
        # A link replaced by another save: refused.
        c.save(str(tmp_path / "d1"))
        with pytest.raises(errors.FailedPreconditionError, match="now holds save"):
            c.load(str(tmp_path / "d2"))
        c.load(str(tmp_path / "base"))
        with pytest.raises(errors.InvalidArgumentError, match="directory of its own"):
            c.save(str(tmp_path / "base"), base=str(tmp_path / "base"))


def test_shard_killed_during_a_delta_save_leaves_the_chain_before_it_loadable(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    ids = np.arange(200_000, dtype=np.int64)
    with cluster.client(request_timeout=60) as c:
        c.create_table("t", 64, "normal", "adagrad", seed=1)
        for k in range(0, len(ids), 50_000):
            _train(c, ids[k : k + 50_000], k, {"t": 64})
        c.save(str(tmp_path / "base"))
        _train(c, ids[:100_000], 7, {"t": 64})
        c.save(str(tmp_path / "d1"), base=str(tmp_path / "base"))
        _train(c, ids, 8, {"t": 64})
        errors_seen: list[BaseException] = []

        def save() -> None:
            try:
                c.save(str(tmp_path / "d2"), base=str(tmp_path / "d1"))
            except errors.DltError as e:
                errors_seen.append(e)

        worker = threading.Thread(target=save)
        worker.start()
        deadline = time.monotonic() + 60
        while not list((tmp_path / "d2").glob("shard-00001-*.tmp-*")):
            assert time.monotonic() < deadline and worker.is_alive(), "the save never started"
            time.sleep(0.005)
        cluster.kill(1)
        worker.join(120)
        assert errors_seen and not (tmp_path / "d2" / "MANIFEST.json").exists()
    cluster.restart(1)
    with cluster.client() as c:
        c.load(str(tmp_path / "d1"))
        assert c.list_tables()["t"]["rows"] == len(ids)


def test_compact_ls_and_prune_from_the_command_line(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    ids = np.arange(3000, dtype=np.int64)
    run = tmp_path / "run"
    with start_cluster(2).client() as c:
        c.create_table("t", 4, "normal", "adagrad", seed=1)
        _train(c, ids, 1, {"t": 4})
        c.save(str(run / "c1"))
        for k in range(2, 6):
            _train(c, ids[k * 10 : k * 10 + 10], k, {"t": 4})
            c.save(str(run / f"c{k}"), base=str(run / f"c{k - 1}"))
        c.save(str(run / "c6"))  # a new base
        _train(c, ids[:5], 6, {"t": 4})
        c.save(str(run / "c7"), base=str(run / "c6"))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tf_dlt.tools.cli", "checkpoint", *args],
            capture_output=True, text=True, cwd="/", timeout=120,
        )  # fmt: skip

    out = cli("ls", str(run / "c5"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["full"] + ["delta"] * 4
    assert lines[-1].endswith(str(run / "c5"))
    listed = json.loads(cli("ls", str(run), "--json").stdout)
    assert [r["path"].rsplit("/", 1)[-1] for r in listed] == [f"c{k}" for k in range(1, 8)]
    out = cli("compact", str(run / "c5"), str(tmp_path / "compacted"), "--num-shards", "3")
    assert out.returncode == 0, out.stderr
    compacted = manifest.read_manifest(str(tmp_path / "compacted"))
    assert compacted["kind"] == "full" and compacted["num_shards"] == 3
    assert staged_rows(str(tmp_path / "compacted"), 2) == staged_rows(str(run / "c5"), 2)
    # An older save compacted over it: refused before anything is written
    # (it was refused at the commit, as "a newer save committed while this
    # one ran").
    out = cli("compact", str(run / "c1"), str(tmp_path / "compacted"))
    assert out.returncode != 0 and "the copy would replace newer state" in out.stderr, out.stderr
    assert staged_rows(str(tmp_path / "compacted"), 2) == staged_rows(str(run / "c5"), 2)
    # A target inside the source's chain (a delta it reads, its base, itself)
    # is refused before anything is written: the chain still loads the same.
    before = staged_rows(str(run / "c5"), 2)
    for inside in ("c3", "c1", "c5"):
        out = cli("compact", str(run / "c5"), str(run / inside))
        assert out.returncode != 0 and "would break the chain" in out.stderr, out.stderr
    assert staged_rows(str(run / "c5"), 2) == before
    # Inside a checkpoint of the chain, or holding them: refused too (a
    # listing or prune of the directory would mix them up); and no shard
    # count below 1.
    for target in (run / "c5" / "inner", run):
        out = cli("compact", str(run / "c5"), str(target))
        assert out.returncode != 0 and "lies inside, or holds" in out.stderr, out.stderr
    # A link to its base, elsewhere, is its base: the compact overwrote it
    # (c1's files deleted, the chain broken for good).
    (tmp_path / "link").symlink_to(run / "c1")
    out = cli("compact", str(run / "c5"), str(tmp_path / "link"))
    assert out.returncode != 0 and "would break the chain" in out.stderr, out.stderr
    # And another checkpoint compacted onto it: the deltas beside c1 (not
    # beside the link) are looked for.
    out = cli("compact", str(tmp_path / "compacted"), str(tmp_path / "link"))
    assert out.returncode != 0 and "is a delta on top of" in out.stderr, out.stderr
    assert staged_rows(str(run / "c5"), 2) == before
    # (past 4096 files, each of which re-reads the whole source, too)
    for bad in ("0", "-2", "4097"):
        out = cli("compact", str(run / "c5"), str(tmp_path / "x"), "--num-shards", bad)
        assert out.returncode != 0 and "num_shards must be 1 to 4096" in out.stderr, out.stderr
    assert not (run / "c5" / "inner").exists() and not (tmp_path / "x").exists()
    # Keep the newest 2 (c6, c7): c1..c5 go. Keep 4 (c4..c7): c4 and c5
    # need c1..c3, so nothing goes.
    out = cli("prune", str(run), "--keep", "4")
    assert out.returncode == 0 and "kept 7" in out.stdout, out.stdout + out.stderr
    out = cli("prune", str(run), "--keep", "2")
    assert sorted(os.listdir(run)) == ["c6", "c7"], out.stdout
    assert cli("ls", str(tmp_path / "nothing")).returncode == 1
    # Nothing to prune, or a kept chain broken: said, and a failure.
    out = cli("prune", str(tmp_path / "nothing"), "--keep", "1")
    assert out.returncode == 1 and "no committed checkpoint" in out.stderr, out.stderr
    shutil.rmtree(run / "c6")
    out = cli("prune", str(run), "--keep", "1")
    assert out.returncode == 1 and "nothing deleted" in out.stderr, out.stdout + out.stderr
    assert os.listdir(run) == ["c7"]


def test_a_save_over_the_base_of_a_delta_beside_it_is_refused(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A full save into a directory holding the base of a delta beside it
    replaced that base, and the delta's chain was broken for good (its
    parent held another save). It is refused, naming the delta; saving
    into the delta's own directory, or anywhere else, goes on."""
    run = tmp_path / "run"
    ids = np.arange(500, dtype=np.int64)
    with start_cluster(1).client() as c:
        _base_and_delta(c, ids, run / "step-2000", run / "step-3000")
        state = c.pull("t", ids)
        for base in (None, str(tmp_path / "elsewhere")):
            if base is not None:
                c.save(base)
            with pytest.raises(errors.FailedPreconditionError, match="is a delta on top of"):
                c.save(str(run / "step-2000"), base=base)
        c.save(str(run / "step-3000"))  # over the delta itself: nothing stands on it
        _loads_back(c, run / "step-3000", ids, state, seed=3)


def test_a_base_replaced_or_pruned_while_a_delta_is_written_fails_one_save_not_the_chain(
    start_cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What guards a delta's base looked only at the start of a save. A
    prune (or another save over the base) while a delta was written let the
    delta commit on a base that was gone: reported saved, never loadable.
    And a save over a base that began before a delta on it committed
    replaced it. Each is now refused at its commit: the delta (the path
    unchanged), or the save over the base (the delta loads). The moment is
    made exact by acting from the check a save makes before its commit."""
    run = tmp_path / "run"
    ids = np.arange(500, dtype=np.int64)
    check = chain.refuse_breaking_dependents
    with start_cluster(1).client() as c:
        _base_and_delta(c, ids, run / "step-1", run / "step-2")
        _train(c, ids[:50], 3, {"t": 4})
        calls: list[str] = []

        def prune_as_the_delta_commits(path: str) -> None:
            calls.append(path)
            if len(calls) == 2:  # the shards wrote the delta
                assert chain.retain([str(run / "step-1"), str(run / "step-2")], keep=1) == []
                shutil.rmtree(run / "step-2")  # as a prune of the compacted copy's run does
            check(path)

        monkeypatch.setattr(chain, "refuse_breaking_dependents", prune_as_the_delta_commits)
        with pytest.raises(errors.FailedPreconditionError, match="no longer loads") as e:
            c.save(str(run / "step-3"), base=str(run / "step-2"))
        assert "is unchanged" in e.value.message
        assert not (run / "step-3" / manifest.MANIFEST).exists()

        # A save over a base, begun before a delta on that base committed.
        state = c.pull("t", ids)
        c.save(str(run / "step-4"))
        done: list[str] = []

        def delta_commits_meanwhile(path: str) -> None:
            check(path)
            if not done:
                done.append(path)
                c.save(str(run / "step-5"), base=str(run / "step-4"))

        monkeypatch.setattr(chain, "refuse_breaking_dependents", delta_commits_meanwhile)
        with pytest.raises(errors.FailedPreconditionError, match="is a delta on top of"):
            c.save(str(run / "step-4"))
        monkeypatch.setattr(chain, "refuse_breaking_dependents", check)
        _loads_back(c, run / "step-5", ids, state, seed=4)


def test_a_prune_keeps_a_base_that_a_delta_committed_on_after_it_listed(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A prune lists the directory, a delta on an old checkpoint commits,
    the prune deletes that checkpoint: the delta reported saved and never
    loaded. Before deleting, a prune now looks again at what the other
    checkpoints beside them need."""
    run = tmp_path / "run"
    ids = np.arange(300, dtype=np.int64)
    with start_cluster(1).client() as c:
        _base(c, ids, run / "c1")
        _train(c, ids[:50], 2, {"t": 4})
        c.save(str(run / "c2"))
        listed = [found.path for found in chain.find(str(run))]
        assert listed == [str(run / "c1"), str(run / "c2")]
        c.save(str(run / "c3"), base=str(run / "c1"))
        state = c.pull("t", ids)
        assert chain.retain(listed, keep=1) == []
        _loads_back(c, run / "c3", ids, state, seed=3)


def test_a_delta_of_some_tables_never_drops_the_others_from_its_chain(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A delta saved with `tables=` on a base holding more tables read, in
    its chain, as if the others were dropped: a load, a compaction and a
    follower lost them, and no error said so. It is refused, naming them;
    one listing them all, or leaving out only a table the shards dropped,
    is saved."""
    ids = np.arange(300, dtype=np.int64)
    with start_cluster(1).client() as c:
        for name in ("a", "b", "gone"):
            c.create_table(name, 4, "normal", "sgd", seed=1)
            c.pull(name, ids)
        c.save(str(tmp_path / "full"))
        c.drop_table("gone")
        c.push("a", ids[:10], np.ones((10, 4), np.float32), 0.1)
        with pytest.raises(errors.InvalidArgumentError, match=r"leaves out tables \['b'\]"):
            c.save(str(tmp_path / "d1"), base=str(tmp_path / "full"), tables=["a"])
        assert not (tmp_path / "d1").exists()
        c.save(str(tmp_path / "d1"), base=str(tmp_path / "full"), tables=["a", "b"])
        state = {name: c.pull(name, ids) for name in ("a", "b")}
        loaded = c.load(str(tmp_path / "d1"))
        assert sorted(loaded) == ["a", "b"]
        for name in ("a", "b"):
            np.testing.assert_array_equal(c.pull(name, ids), state[name])


def test_a_checkpoint_saved_again_as_it_is_read_is_never_mixed_into_a_load_or_compaction(
    start_cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each shard of a load, and each file of a compaction, resolved the
    path anew: a save to it meanwhile gave a cluster (or a compacted copy)
    rows of two saves. Every reader now takes the save the load (or the
    compaction) began at, and one that finds another refuses: nothing is
    loaded or committed."""
    latest = str(tmp_path / "latest")
    ids = np.arange(400, dtype=np.int64)
    with start_cluster(2).client() as c:
        c.create_table("t", 4, "zeros", "sgd")
        c.assign("t", ids, np.ones((400, 4), np.float32))
        c.save(latest)
        resolve = manifest.resolve_chain

        def saved_again_after_the_client_read_it(path: str, allow=None):  # type: ignore[no-untyped-def]
            links = resolve(path, allow)
            c.assign("t", ids, np.full((400, 4), 2.0, np.float32))
            c.save(latest)
            c.assign("t", ids, np.full((400, 4), 3.0, np.float32))
            return links

        monkeypatch.setattr(manifest, "resolve_chain", saved_again_after_the_client_read_it)
        with pytest.raises(errors.FailedPreconditionError, match="was saved again as it was read"):
            c.load(latest)
        monkeypatch.setattr(manifest, "resolve_chain", resolve)
        np.testing.assert_array_equal(c.pull("t", ids), np.full((400, 4), 3.0, np.float32))

        prepare = shard_files.prepare_load
        files: list[int] = []

        def saved_again_after_the_first_file(path: str, shard, *args, **kwargs):  # type: ignore[no-untyped-def]
            files.append(int(shard.shard_index))
            if len(files) == 2:
                c.save(latest)
            return prepare(path, shard, *args, **kwargs)

        monkeypatch.setattr(shard_files, "prepare_load", saved_again_after_the_first_file)
        with pytest.raises(errors.FailedPreconditionError, match="was saved again as it was read"):
            chain.compact(latest, str(tmp_path / "compacted"), num_shards=3)
        assert not (tmp_path / "compacted" / manifest.MANIFEST).exists()


def test_retain_never_deletes_what_a_kept_checkpoint_needs(tmp_path: Path) -> None:
    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    table = shard.get_table("t")
    paths: list[str] = []
    for k in range(7):  # full, delta, delta, full, delta, delta, delta
        table.push(np.arange(k * 5, k * 5 + 5, dtype=np.int64), np.ones((5, 2), np.float32), 0.1)
        path, save_id = str(tmp_path / f"c{k}"), manifest.new_save_id()
        parent = None
        if k not in (0, 3):
            base = manifest.read_manifest(paths[-1])
            parent = {"path": paths[-1], "save_id": base["save_id"],
                      "chain_length": base["chain_length"]}  # fmt: skip
        part = shard_files.save_shard(path, shard, save_id, parent["save_id"] if parent else "")
        manifest.write_manifest(path, [part], save_id, parent)
        paths.append(path)
    assert chain.retain(paths, 2) == paths[:3]  # c5, c6 need c3, c4
    assert sorted(os.listdir(tmp_path)) == ["c3", "c4", "c5", "c6"]
    assert chain.retain(paths[3:], 1) == []
    with pytest.raises(errors.InvalidArgumentError):
        chain.retain(paths[3:], 0)


def test_a_shard_restarted_empty_is_saved_as_it_is(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """A shard that restarted without loading has lost its rows: a delta
    then says so (its buckets hold nothing, then whatever it made since),
    exactly as a full save of the same moment does."""
    cluster = start_cluster(2)
    ids = np.arange(4000, dtype=np.int64)
    with cluster.client() as c:
        _base(c, ids, tmp_path / "base")
    cluster.kill(1)
    cluster.restart(1)
    with cluster.client() as c:
        d1 = c.save(str(tmp_path / "d1"), base=str(tmp_path / "base"))
        c.save(str(tmp_path / "full1"))
        c.create_table("t", 4, "normal", "adagrad", seed=1)  # back on shard 1, empty
        _train(c, ids[:100], 2, {"t": 4})
        d2 = c.save(str(tmp_path / "d2"), base=str(tmp_path / "d1"))
        c.save(str(tmp_path / "full2"))
    assert d1["kind"] == "delta" and d2["tables"][0]["full_files"] == 1
    for delta, full in (("d1", "full1"), ("d2", "full2")):
        rows = staged_rows(str(tmp_path / delta), 3)
        assert rows == staged_rows(str(tmp_path / full), 3), delta
    assert 0 < len(staged_rows(str(tmp_path / "d1"), 1)["t"]) < len(ids)


def test_a_table_made_since_the_base_that_a_restarted_shard_lacks_loads_on_every_shard(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """Table x is made after the base, and u made again with another dim;
    shard 1 restarts empty, so the delta's file of it holds neither. Loaded,
    x was missing on every shard that reads only that file's buckets
    (pulls there: NotFoundError), and u kept the base's dim there, where
    the full save of the same moment gives both, as saved, on every shard."""
    cluster = start_cluster(2)
    ids = np.arange(4000, dtype=np.int64)
    with cluster.client() as c:
        c.create_table("u", 4, "normal", "adagrad", seed=1)
        _train(c, ids, 5, {"u": 4})
        _base(c, ids, tmp_path / "base")
        c.create_table("x", 4, "normal", "adagrad", seed=1)
        c.drop_table("u")
        c.create_table("u", 8, "normal", "adagrad", seed=1)
        _train(c, ids, 3, {"x": 4, "u": 8, "t": 4})
    cluster.kill(1)
    cluster.restart(1)
    with cluster.client() as c:
        d1 = c.save(str(tmp_path / "d1"), base=str(tmp_path / "base"))
        c.save(str(tmp_path / "full1"))
    assert d1["kind"] == "delta"
    for n in (2, 3):
        for path in ("d1", "full1"):
            for index in range(n):
                staged = shard_files.prepare_load(
                    str(tmp_path / path), _native.Shard(index, n)
                )["staged"]  # fmt: skip
                tables = {(t.name, t.dim) for t in staged}
                assert tables == {("t", 4), ("u", 8), ("x", 4)}, (path, index)
        assert staged_rows(str(tmp_path / "d1"), n) == staged_rows(str(tmp_path / "full1"), n)


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("file", "../../../etc/passwd", "not a shard file name"),
        ("file", "shard-00000-of-00001.20261124T000000000000-0000abcd.h5.tmp-12", "not a shard"),
        ("block_bytes", 0, "block_bytes"),
        ("block_bytes", 1 << 40, "block_bytes"),
        ("meta_block_bytes", -1, "meta_block_bytes"),
        ("meta_block_bytes", "1", "meta_block_bytes"),
        ("block_sha256", ["00"], "one SHA-256 per block"),
        ("bytes", -1, "bytes must be an integer"),
        ("end_bucket", 1 << 20, "bucket range"),
        ("sha256", "zz", "not a SHA-256"),
    ],
)
def test_crafted_manifests_are_refused_before_any_file_is_read(
    tmp_path: Path, field: str, value: object, why: str
) -> None:
    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    shard.get_table("t").push(np.arange(5, dtype=np.int64), np.ones((5, 2), np.float32), 0.1)
    save_id = manifest.new_save_id()
    path = str(tmp_path / "c")
    manifest.write_manifest(path, [shard_files.save_shard(path, shard, save_id)], save_id)
    doc = json.loads((tmp_path / "c" / "MANIFEST.json").read_text())
    doc["files"][0][field] = value
    (tmp_path / "c" / "MANIFEST.json").write_text(json.dumps(doc))
    with pytest.raises(errors.FailedPreconditionError, match=why):
        shard_files.prepare_load(path, _native.Shard(0, 1))


def test_a_parent_outside_the_allowed_roots_is_refused(tmp_path: Path) -> None:
    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    paths = []
    for k in range(2):
        path, save_id = (
            str(tmp_path / ("outside" if k == 0 else "root") / f"c{k}"),
            (manifest.new_save_id()),
        )
        parent = None
        if paths:
            base = manifest.read_manifest(paths[-1])
            parent = {"path": paths[-1], "save_id": base["save_id"], "chain_length": 1}
        part = shard_files.save_shard(path, shard, save_id, parent["save_id"] if parent else "")
        manifest.write_manifest(path, [part], save_id, parent)
        shard.get_table("t").push(np.arange(3, dtype=np.int64), np.ones((3, 2), np.float32), 0.1)
        paths.append(path)
    from tf_dlt.server import paths as server_paths

    roots = server_paths.CheckpointRoots([str(tmp_path / "root")])
    with pytest.raises(errors.PermissionDeniedError, match="outside"):
        shard_files.prepare_load(paths[1], _native.Shard(0, 1), lambda p: roots.check(p, "Load"))
    assert shard_files.prepare_load(paths[1], _native.Shard(0, 1))["links"] == 2


def test_a_delta_never_overwrites_a_checkpoint_its_base_needs(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    ids = np.arange(500, dtype=np.int64)
    with start_cluster(1).client() as c:
        _base(c, ids, tmp_path / "a")
        _train(c, ids[:5], 2, {"t": 4})
        c.save(str(tmp_path / "b"), base=str(tmp_path / "a"))
        # Ping-pong between two directories would destroy both.
        with pytest.raises(errors.InvalidArgumentError, match="needs"):
            c.save(str(tmp_path / "a"), base=str(tmp_path / "b"))
        c.load(str(tmp_path / "b"))
        c.load(str(tmp_path / "a"))
        # Nor lies inside one, or holds one: listings and prunes mixed them
        # (accepted before; compact refused the same layouts).
        for nested in (tmp_path / "a" / "inner", tmp_path):
            with pytest.raises(errors.InvalidArgumentError, match="lies inside, or holds"):
                c.save(str(nested), base=str(tmp_path / "b"))
        assert not (tmp_path / "a" / "inner").exists()
        assert not (tmp_path / manifest.MANIFEST).exists()
        # A table checkpoint named "tables" is no model's: a delta beside it
        # is beside it.
        c.save(str(tmp_path / "run" / "tables"))
        c.save(str(tmp_path / "run" / "d1"), base=str(tmp_path / "run" / "tables"))


def test_a_delta_names_a_base_on_another_filesystem_by_its_whole_url(tmp_path: Path) -> None:
    """A relative parent only within one filesystem: on HDFS the NameNode is
    not part of the path, so "../base" from a delta on another NameNode
    would name a directory of the delta's own cluster (the URLs are never
    opened here)."""
    ref = manifest.parent_reference
    assert ref("hdfs://nn1.example:8020/run/d1", "hdfs://nn1.example:8020/run/base") == "../base"
    for delta, base in [
        ("hdfs://nn1.example:8020/run/d1", "hdfs://nn2.example:8020/run/base"),
        ("hdfs://nn1.example:8020/run/d1", "hdfs://nn1.example:9000/run/base"),
        ("hdfs://nn1.example:8020/run/d1", "s3://bucket/run/base"),
        (str(tmp_path / "d1"), "hdfs://nn1.example:8020/run/base"),
    ]:
        assert ref(delta, base) == base
        assert manifest.resolve_parent(delta, ref(delta, base)) == base
    assert ref("s3://b1/run/d1", "s3://b2/run/base") == "../../../b2/run/base"
    assert manifest.resolve_parent("s3://b1/run/d1", "../../../b2/run/base") == "s3://b2/run/base"
    assert ref(str(tmp_path / "d1"), f"file://{tmp_path}/base") == "../base"


def test_a_chain_that_loops_is_refused_at_once(tmp_path: Path) -> None:
    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    save_id = manifest.new_save_id()
    path = str(tmp_path / "c")
    manifest.write_manifest(path, [shard_files.save_shard(path, shard, save_id)], save_id)
    doc = json.loads((tmp_path / "c" / "MANIFEST.json").read_text())
    doc.update(kind="delta", parent={"path": ".", "save_id": save_id}, chain_length=2)
    (tmp_path / "c" / "MANIFEST.json").write_text(json.dumps(doc))
    with pytest.raises(errors.FailedPreconditionError, match="cycle"):
        manifest.resolve_chain(path)
    doc.update(kind="full")
    doc["tables"][0]["rows"] = -5
    (tmp_path / "c" / "MANIFEST.json").write_text(json.dumps(doc))
    with pytest.raises(errors.FailedPreconditionError, match="rows must be"):
        manifest.read_manifest(path)


def test_a_removal_log_overflowing_during_a_delta_save_writes_the_table_whole(
    tmp_path: Path,
) -> None:
    """A wave of removals between a delta save's start and its end (a ttl
    sweep, a shrink, an eviction wave) overflows the table's removal log:
    the delta then holds the table whole, and the chain loads exactly the
    rows the table has."""
    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig.create("t", 4, "normal", "adagrad", seed=1).to_dict())
    table = shard.get_table("t")
    ids = np.arange(400_000, dtype=np.int64)
    table.push(ids, np.ones((len(ids), 4), np.float32), 0.1)
    c1, c2 = str(tmp_path / "c1"), str(tmp_path / "c2")
    manifest.write_manifest(c1, [shard_files.save_shard(c1, shard, "s1")], "s1")
    table.push(ids[:1000], np.ones((1000, 4), np.float32), 0.1)
    rows = shard_save.native_rows(table, shard_format.ShardLayout(), "s2", "s1")
    assert rows.whole is not None  # a delta on top of s1
    table.erase(ids[1000:360_000])  # mid-save: ~5,600 removals a stripe overflow its log
    parent = manifest.delta_parent(c2, c1)
    part = shard_save.save_tables(c2, shard_format.ShardLayout(), [rows], "s2")
    assert [t["mode"] for t in part["tables"]] == ["full"]
    manifest.write_manifest(c2, [part], "s2", parent)
    staged = shard_files.prepare_load(c2, _native.Shard(0, 1))["staged"]
    assert [t.size() for t in staged] == [table.size()] == [41_000]
    np.testing.assert_array_equal(staged[0].pull(ids[::97]), table.pull(ids[::97]))


def test_prune_reads_each_checkpoints_own_layout(tmp_path: Path) -> None:
    """A directory holding a table checkpoint (oldest) and model
    checkpoints (tables in tables/): prune keeps the newest by their own
    layout, deleting the old one, instead of guessing from the oldest."""
    import argparse

    from tf_dlt.tools import checkpoints

    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig.create("t", 4).to_dict())
    shard.get_table("t").pull(np.arange(100, dtype=np.int64))
    run = tmp_path / "run"
    for path in (run / "c1", run / "m2" / "tables", run / "m3" / "tables"):
        save_id = manifest.new_save_id()
        manifest.write_manifest(
            str(path), [shard_files.save_shard(str(path), shard, save_id)], save_id
        )
        if path.name == "tables":  # a model checkpoint holds its dense weights too
            (path.parent / chain.dense_file(save_id)).write_bytes(b"")
    assert checkpoints.run(argparse.Namespace(verb="prune", directory=str(run), keep=2)) == 0
    assert sorted(os.listdir(run)) == ["m2", "m3"]


def test_a_save_syncs_the_directory_after_its_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard file's, the manifest copy's and the manifest's renames are
    made durable: the checkpoint directory itself is synced after each."""
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig.create("t", 4).to_dict())
    path = tmp_path / "ck"
    save_id = manifest.new_save_id()
    manifest.write_manifest(str(path), [shard_files.save_shard(str(path), shard, save_id)], save_id)
    assert synced.count(str(path)) == 3  # after each rename


def test_a_delta_refused_in_a_later_table_changes_no_table_in_use(tmp_path: Path) -> None:
    """A follower applies a delta in place to the tables it serves: a file
    whose second table fails a check (a delta without its base clock, its
    checksums valid) is refused before the first table changes. It was
    refused after: the first table served part of the delta, and every
    later poll applied that part again."""
    import h5py

    from tf_dlt.checkpoint import verified
    from tf_dlt.routing import NUM_BUCKETS

    shard = _native.Shard(0, 1)
    ids = np.arange(100, dtype=np.int64)
    for name in ("a", "b"):
        shard.create_table(tf_dlt.TableConfig.create(name, 4, "normal", "adagrad").to_dict())
        shard.get_table(name).pull(ids)
    base, path = str(tmp_path / "c1"), str(tmp_path / "c2")
    base_id = manifest.new_save_id()
    manifest.write_manifest(base, [shard_files.save_shard(base, shard, base_id)], base_id)
    for name in ("a", "b"):
        shard.get_table(name).push(ids, np.ones((len(ids), 4), np.float32), 0.1)
    save_id = manifest.new_save_id()
    part = shard_files.save_shard(path, shard, save_id, base_id)
    parent = {"path": base, "save_id": base_id, "chain_length": 1}
    manifest.write_manifest(path, [part], save_id, parent)
    victim = os.path.join(path, part["file"])
    with h5py.File(victim, "r+") as f:
        groups = sorted(f["tables"])
        assert [json.loads(f["tables"][g].attrs["config"])["name"] for g in groups] == ["a", "b"]
        assert f["tables"][groups[1]].attrs["mode"] == "delta"
        del f["tables"][groups[1]].attrs["base_clock"]
    doc = json.loads((tmp_path / "c2" / "MANIFEST.json").read_text())
    with open(victim, "rb") as f:
        doc["files"][0]["sha256"], doc["files"][0]["block_sha256"] = verified.file_digests(f)
    doc["files"][0]["bytes"] = os.path.getsize(victim)
    (tmp_path / "c2" / "MANIFEST.json").write_text(json.dumps(doc))

    follower = _native.Shard(0, 1)
    follower.install_tables(shard_files.prepare_load(base, follower)["staged"])
    tables = {t.name: t for t in follower.tables()}
    served = {name: table.pull(ids) for name, table in tables.items()}
    link = manifest.resolve_chain(path)[-1]
    with pytest.raises(errors.FailedPreconditionError, match="without its base_clock"):
        shard_files.apply_link(link, tables, follower.new_table, (0, NUM_BUCKETS), in_use=True)
    for name, table in tables.items():
        np.testing.assert_array_equal(table.pull(ids), served[name])


def test_a_compacted_copy_sorts_as_the_save_it_holds_so_prune_keeps_the_newest(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    """`compact` of an older checkpoint gave its copy a new save id, so it
    sorted as the newest: `prune --keep 1` then deleted the newest training
    checkpoint and kept the older state. The copy keeps the id of the save
    whose state it holds."""
    run = tmp_path / "run"
    ids = np.arange(500, dtype=np.int64)
    with start_cluster(1).client() as c:
        _base(c, ids, run / "step-1000")
        _train(c, ids[:50], 2, {"t": 4})
        delta = c.save(str(run / "step-2000"), base=str(run / "step-1000"))
        _train(c, ids[:50], 3, {"t": 4})
        c.save(str(run / "step-3000"))
        newest = c.pull("t", ids)
        copy = chain.compact(str(run / "step-2000"), str(run / "step-2000-full"))
        assert copy["save_id"] == delta["save_id"] and copy["kind"] == "full"
        deleted = chain.retain([cp.path for cp in chain.find(str(run))], 1)
        assert sorted(Path(p).name for p in deleted) == ["step-1000", "step-2000", "step-2000-full"]
        assert (run / "step-3000").exists()
        c.load(str(run / "step-3000"))
        np.testing.assert_array_equal(c.pull("t", ids), newest)


@pytest.mark.parametrize("name", ["aaa", "step-2000-full", "zzz"])
def test_prune_after_compact_keeps_the_compacted_copy(
    start_cluster: Callable[..., Cluster], tmp_path: Path, name: str
) -> None:
    """The compacted copy of the newest checkpoint has its save id: the tie
    fell to the directory's listing order, and `prune --keep 1` could
    delete the copy just made and keep the chain it replaces. Of two
    checkpoints of one save, the one written later (the copy) counts as
    newer."""
    run = tmp_path / "run"
    ids = np.arange(500, dtype=np.int64)
    with start_cluster(1).client() as c:
        _base_and_delta(c, ids, run / "step-1000", run / "step-2000")
        newest = c.pull("t", ids)
        chain.compact(str(run / "step-2000"), str(run / name))
        deleted = chain.retain([cp.path for cp in chain.find(str(run))], 1)
        assert sorted(Path(p).name for p in deleted) == ["step-1000", "step-2000"]
        c.load(str(run / name))
        np.testing.assert_array_equal(c.pull("t", ids), newest)


def test_ls_shows_a_creation_time_no_calendar_holds_as_unknown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A manifest's created_unix of 1e300 or NaN (the shards do not check
    it) made `tf-dlt checkpoint ls` end in a traceback."""
    from tf_dlt.tools import checkpoints

    link = {"kind": "full", "created_unix": 1e300, "num_shards": 1, "rows": 1, "removed": 0,
            "bytes": 10, "path": "/ck"}  # fmt: skip
    checkpoints._print_links([link, {**link, "created_unix": float("nan")}])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[1] for line in lines] == ["?", "?"]


def test_ls_of_a_relative_path_shows_its_chain_with_absolute_paths(
    start_cluster: Callable[..., Cluster],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tf-dlt checkpoint ls d1` showed the head as given ("d1") and its
    base absolute, as if they lay apart."""
    from tf_dlt.tools import cli

    with start_cluster(1).client() as c:
        _base_and_delta(c, np.arange(100, dtype=np.int64), tmp_path / "base", tmp_path / "d1")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["checkpoint", "ls", "d1"]) == 0
    paths = [line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]]
    assert paths == [str(tmp_path / "base"), str(tmp_path / "d1")]


def test_prune_keeps_a_checkpoint_whose_directory_holds_another(
    start_cluster: Callable[..., Cluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint saved inside an older one's directory (run/c1/late): a
    prune deleted run/c1 whole, and the newest checkpoint with it. The older
    one is kept and the prune says why; the others go as before."""
    from tf_dlt.tools import cli

    ids = np.arange(500, dtype=np.int64)
    run = tmp_path / "run"
    with start_cluster(1).client() as c:
        _base(c, ids, run / "c1")
        c.save(str(run / "c2"))
        c.save(str(run / "c3"))
        _train(c, ids, 2, {"t": 4})
        c.save(str(run / "c1" / "late"))
        late = c.pull("t", ids)
    # `ls` of the directory names it under the one that holds it (it listed
    # c1, c2, c3 only: the newest checkpoint did not show).
    assert cli.main(["checkpoint", "ls", str(run)]) == 0
    listed = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(listed) if f"  {run / 'c1'}  (" in line)
    assert listed[at + 1].split() == ["holds", "1", "more:", str(run / "c1" / "late")]
    # And `ls` of c1 itself, after its chain (it named none: a prune of c1's
    # directory deleted checkpoints that its listing never showed).
    assert cli.main(["checkpoint", "ls", str(run / "c1")]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[-1].split() == ["holds", "1", "more:", str(run / "c1" / "late")]
    assert cli.main(["checkpoint", "prune", str(run), "--keep", "1"]) == 1
    out = capsys.readouterr()
    assert f"deleted {run / 'c2'}" in out.out and str(run / "c1") not in out.out
    assert f"{run / 'c1'} kept: its directory holds other checkpoints ({run / 'c1' / 'late'})" in (
        out.err
    )
    assert (run / "c1" / "late" / "MANIFEST.json").exists() and (run / "c3").exists()
    with start_cluster(1).client() as c:
        c.load(str(run / "c1" / "late"))
        np.testing.assert_array_equal(c.pull("t", ids), late)


def test_prune_keeps_a_checkpoint_saved_again_while_it_ran(
    start_cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`latest` older than `step-2` when the prune listed them, then saved
    again (the newest of all) before the prune deleted it: it was deleted,
    the newest checkpoint lost after its save succeeded (3 s of a slow
    store's listing were enough). Kept, and the prune says why."""
    from tf_dlt.checkpoint import chain

    ids = np.arange(300, dtype=np.int64)
    run = tmp_path / "run"
    with start_cluster(1).client() as c:
        _base(c, ids, run / "latest")
        c.save(str(run / "step-2"))
        listed = [x.path for x in chain.find(str(run))]
        assert listed == [str(run / "latest"), str(run / "step-2")]
        needed = chain.needed

        def saving_meanwhile(*args: Any, **kwargs: Any) -> Any:
            c.save(str(run / "latest"))  # commits while the prune runs
            monkeypatch.setattr(chain, "needed", needed)
            return needed(*args, **kwargs)

        monkeypatch.setattr(chain, "needed", saving_meanwhile)
        _train(c, ids, 3, {"t": 4})
        newest = c.pull("t", ids)
        problems: list[str] = []
        assert chain.retain(listed, 1, problems=problems) == []
        assert problems == [f"{run / 'latest'} kept: a save committed there while the prune ran"]
        c.push("t", ids, np.ones((len(ids), 4), np.float32), 0.1)
        c.load(str(run / "latest"))
        np.testing.assert_array_equal(c.pull("t", ids), newest)
        # The same through `tf-dlt checkpoint prune`, the save landing after
        # it listed the directory and before its deletions began: the
        # manifests it listed are the snapshot (a review's repro).
        from tf_dlt.tools import cli

        c.save(str(run / "step-3"))
        retain = chain.retain

        def saved_after_listing(*args: Any, **kwargs: Any) -> Any:
            c.save(str(run / "latest"))
            return retain(*args, **kwargs)

        monkeypatch.setattr(chain, "retain", saved_after_listing)
        newest = c.pull("t", ids)
        assert cli.main(["checkpoint", "prune", str(run), "--keep", "1"]) == 1
        c.push("t", ids, np.ones((len(ids), 4), np.float32), 0.1)
        c.load(str(run / "latest"))
        np.testing.assert_array_equal(c.pull("t", ids), newest)


def _clock_behind(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The checkpoint code's clock (save ids, creation times) set back by
    `seconds`, as on a host whose clock is behind (the client's own calls
    keep theirs: a shifted clock breaks their deadlines)."""

    class Behind:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def time() -> float:
            return time.time() - seconds

        @staticmethod
        def time_ns() -> int:
            return time.time_ns() - int(seconds * 1e9)

    monkeypatch.setattr(manifest, "time", Behind())


def _saved_then_clock_behind(
    client: tf_dlt.Client, ids: np.ndarray, run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_base` at run/a and the same saved at run/b; then this host's clock
    an hour behind the one they were saved by."""
    _base(client, ids, run / "a")
    client.save(str(run / "b"))
    _clock_behind(monkeypatch, 3600)


def test_a_save_made_on_a_clock_behind_the_last_saves_still_sorts_as_the_newest(
    start_cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer on a host whose clock is an hour behind the one that saved
    before it (a restart on another machine): its save ids sorted first, so
    a prune deleted its newest checkpoint, followers never took it, and a
    save into the same path handed the path back to the save it replaced
    (the newer id). Its saves sort after every save beside them."""
    from tf_dlt.tools import cli

    ids = np.arange(400, dtype=np.int64)
    run = tmp_path / "run"
    with start_cluster(1).client() as c:
        _saved_then_clock_behind(c, ids, run, monkeypatch)
        _train(c, ids, 2, {"t": 4})
        c.save(str(run / "c"))
        assert [x.path for x in chain.find(str(run))] == [str(run / p) for p in "abc"]
        _train(c, ids, 3, {"t": 4})
        c.save(str(run / "b"), base=str(run / "c"))  # into a path that held a newer id
        b = c.pull("t", ids)
        assert [x.path for x in chain.find(str(run))] == [str(run / p) for p in "acb"]
        assert cli.main(["checkpoint", "prune", str(run), "--keep", "2"]) == 0
        assert sorted(p.name for p in run.iterdir()) == ["b", "c"]
        _train(c, ids, 4, {"t": 4})
        c.load(str(run / "b"))
        np.testing.assert_array_equal(c.pull("t", ids), b)


def test_a_save_id_follows_what_can_be_read_when_some_cannot(
    start_cluster: Callable[..., Cluster],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A manifest beside the path that this process may not read (an S3
    policy, a 0700 directory) fails no save: its id follows what could be
    read, and a warning names what was passed over. An id of another form (a manifest
    written by hand) is passed over too, and so is a compacted copy made on
    a host whose clock is behind: it still sorts after the save it copies."""
    from tf_dlt.tools import cli

    ids = np.arange(300, dtype=np.int64)
    run = tmp_path / "run"
    with start_cluster(1).client() as c:
        _saved_then_clock_behind(c, ids, run, monkeypatch)
        read = manifest.read_manifest

        def refused(path: str, *args: Any, **kwargs: Any) -> Any:
            if Path(path).name == "a":
                raise PermissionError(13, "Permission denied", path)
            return read(path, *args, **kwargs)

        monkeypatch.setattr(manifest, "read_manifest", refused)
        caplog.set_level("WARNING", logger="tf_dlt.checkpoint")
        c.save(str(run / "c"))
        assert "its id follows the saves beside it that could be read, not " in caplog.text
        assert str(run / "a") in caplog.text
        monkeypatch.setattr(manifest, "read_manifest", read)
        assert [x.path for x in chain.find(str(run))] == [str(run / p) for p in "abc"]
        foreign = json.loads((run / "b" / manifest.MANIFEST).read_text())
        (run / "hand").mkdir()
        (run / "hand" / manifest.MANIFEST).write_text(json.dumps({**foreign, "save_id": "~"}))
        c.save(str(run / "d"))  # "~" sorts after every id: find lists it last
        found = [x.path for x in chain.find(str(run))]
        assert found[-3:] == [str(run / "c"), str(run / "d"), str(run / "hand")]
    _clock_behind(monkeypatch, 7200)
    chain.compact(str(run / "d"), str(run / "d-full"))
    shutil.rmtree(run / "hand")
    found = [x.path for x in chain.find(str(run))]
    assert found[-2:] == [str(run / "d"), str(run / "d-full")]
    assert cli.main(["checkpoint", "prune", str(run), "--keep", "1"]) == 0
    assert sorted(p.name for p in run.iterdir()) == ["d-full"]


def test_a_new_save_id_follows_the_one_it_must_come_after() -> None:
    """Ids of both forms (to the microsecond, and to the second from
    earlier versions) are followed by a later id; a time ahead of them is
    kept as it is."""
    now = manifest.new_save_id()
    assert manifest.new_save_id(after=now) > now
    ahead = "99990101T000000999999-0123abcd"
    assert manifest.new_save_id(after=ahead).startswith("99990101T000001000000-")
    assert manifest.new_save_id(after="99990101T000000-0123abcd") > "99990101T000000-0123abcd"
    assert manifest.new_save_id(after="20000101T000000-0123abcd") > now
    last = "99991231T235959999999-0123abcd"  # none can follow: an id of that time
    assert manifest.is_save_id(manifest.new_save_id(after=last))
    with pytest.raises(errors.InvalidArgumentError, match="not a save id"):
        manifest.new_save_id(after="yesterday")


def test_a_load_whose_files_a_new_save_removed_says_it_was_saved_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save to the path committed after a shard read the manifest and
    before it opened the files, removing the files it replaced: the load
    said a file "named in the manifest is missing", as if the checkpoint
    were broken. It says the path was saved again as it was read (a retry
    mends it), and nothing is staged."""
    from tf_dlt.checkpoint import shard_load

    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    path = str(tmp_path / "latest")

    def save() -> None:
        save_id = manifest.new_save_id()
        manifest.write_manifest(path, [shard_files.save_shard(path, shard, save_id, "")], save_id)

    save()
    apply = shard_load.apply_link

    def saved_again_before_the_files(*args: Any, **kwargs: Any) -> Any:
        save()
        return apply(*args, **kwargs)

    monkeypatch.setattr(shard_load, "apply_link", saved_again_before_the_files)
    loading = _native.Shard(0, 1)
    with pytest.raises(errors.FailedPreconditionError, match="was saved again as it was read"):
        shard_files.prepare_load(path, loading)
    monkeypatch.setattr(shard_load, "apply_link", apply)
    assert [t.name for t in shard_files.prepare_load(path, loading)["staged"]] == ["t"]


def test_a_chain_keeps_the_ages_of_rows_pushes_during_its_base_save_did_not_touch(
    tmp_path: Path,
) -> None:
    """Pushes a shard takes while a save runs (after the save began, before
    its clock was read for the file) count once in a chain's ages. The
    delta's base clock was the clock when the base save began, while the
    base's file holds the clock when its rows were read: a chain loaded
    every row the delta did not hold as older by the pushes of that window
    (once per link), so a Pushes ttl expired it early. Found under
    concurrent pushes and delta saves (ages of 19,773 of 20,000 rows off)."""
    config = tf_dlt.TableConfig.create("t", 4, "zeros", "sgd", ttl=tf_dlt.expiry.Pushes(1000))
    shard = _native.Shard(0, 1)
    shard.create_table(config.to_dict())
    table = shard.get_table("t")
    a, b, c = (np.arange(k * 1000, k * 1000 + 100, dtype=np.int64) for k in range(3))
    one = lambda ids: np.ones((len(ids), 4), np.float32)  # noqa: E731
    table.push(a, one(a), 1.0)  # clock 1: rows of `a` are never pushed again
    c1, c2, c3 = (str(tmp_path / n) for n in ("c1", "c2", "c3"))
    rows = shard_save.native_rows(table, shard_format.ShardLayout(), "s1")
    for _ in range(5):  # mid-save: the clock moves from 1 to 6
        table.push(b, one(b), 1.0)
    manifest.write_manifest(
        c1, [shard_save.save_tables(c1, shard_format.ShardLayout(), [rows], "s1")], "s1"
    )
    table.push(c, one(c), 1.0)  # clock 7
    part = shard_files.save_shard(c2, shard, "s2", "s1")
    assert [t["mode"] for t in part["tables"]] == ["delta"]
    manifest.write_manifest(c2, [part], "s2", manifest.delta_parent(c2, c1))
    manifest.write_manifest(c3, [shard_files.save_shard(c3, shard, "s3")], "s3")
    chain, full = staged_rows(c2, 1)["t"], staged_rows(c3, 1)["t"]
    assert full[int(a[0])][3] == 6  # pushed at clock 1, saved at 7
    assert {x: r[3] for x, r in chain.items()} == {x: r[3] for x, r in full.items()}
    assert chain == full


def _one_shard() -> _native.Shard:
    shard = _native.Shard(0, 1)
    shard.create_table(tf_dlt.TableConfig("t", 2).to_dict())
    return shard


def _push_all(shard: _native.Shard, value: float) -> None:
    ids = np.arange(10, dtype=np.int64)
    shard.get_table("t").push(ids, np.full((10, 2), value, np.float32), 1.0)


def _commit(shard: _native.Shard, path: Path, base: Path | None = None, base_id: str = "") -> str:
    """A one-shard save of `shard` at `path` (a delta on `base` when given),
    committed as Client.save commits one."""
    save_id = chain.next_save_id(str(path))
    part = shard_files.save_shard(str(path), shard, save_id, base_id)
    parent = manifest.delta_parent(str(path), str(base)) if base is not None else None
    return str(manifest.write_manifest(str(path), [part], save_id, parent)["save_id"])


def _checkpoint_cli(verb: str, **kwargs: object) -> int:
    import argparse

    from tf_dlt.tools import checkpoints

    return checkpoints.run(argparse.Namespace(verb=verb, **kwargs))


def test_compact_never_writes_over_a_checkpoint_of_the_other_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tf-dlt checkpoint compact run/c1 run/m2`, run/m2 a model checkpoint
    holding a newer save (a typo in the target): it wrote c1's older rows as
    a table checkpoint into run/m2 itself, which hid the model's save from
    listings, and a follower of run served the older rows in its place,
    reporting itself current (helper-125's review). The reverse (a model
    checkpoint compacted into a table checkpoint's directory) hid the
    copy. Both refused now, nothing written, the follower unmoved."""
    from tf_dlt.server.follower import Follower

    run = tmp_path / "run"
    shard = _one_shard()
    _push_all(shard, 1.0)
    _commit(shard, run / "c1")
    _push_all(shard, 1.0)
    newer = _commit(shard, run / "m2" / "tables")
    (run / "m2" / chain.dense_file(newer)).write_bytes(b"")
    served = _native.Shard(0, 1)
    follow = Follower(served, str(run), interval_s=60)
    assert follow.poll().serving_save_id == newer
    before = served.get_table("t").pull(np.arange(10, dtype=np.int64)).copy()
    code = _checkpoint_cli(
        "compact", source=str(run / "c1"), target=str(run / "m2"), num_shards=None
    )
    assert code == 1 and "holds a model checkpoint" in capsys.readouterr().err
    assert not (run / "m2" / manifest.MANIFEST).exists()
    assert follow.poll().serving_save_id == newer
    np.testing.assert_array_equal(served.get_table("t").pull(np.arange(10, dtype=np.int64)), before)
    # The reverse: a model checkpoint into a table checkpoint's directory.
    code = _checkpoint_cli(
        "compact", source=str(run / "m2"), target=str(run / "c1"), num_shards=None
    )
    assert code == 1 and "holds a table checkpoint" in capsys.readouterr().err
    assert not (run / "c1" / "tables").exists()


def test_prune_deletes_nothing_beside_a_checkpoint_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run/c1 full, run/c2 a delta on c1 whose manifest is mid-edit (a load
    refuses it), run/c3 full; `tf-dlt checkpoint prune run --keep 1`
    deleted c1 with exit 0, and c2, repaired, was a broken chain for good.
    Nothing is deleted now (c2 may need any of them), naming c2, exit 1."""
    run = tmp_path / "run"
    shard = _one_shard()
    _push_all(shard, 1.0)
    c1 = _commit(shard, run / "c1")
    _push_all(shard, 1.0)
    _commit(shard, run / "c2", base=run / "c1", base_id=c1)
    _push_all(shard, 1.0)
    _commit(shard, run / "c3")
    text = (run / "c2" / manifest.MANIFEST).read_text()
    edited = json.loads(text)
    edited["num_buckets"] = 1024  # mid-edit: a load refuses it
    (run / "c2" / manifest.MANIFEST).write_text(json.dumps(edited))
    code = _checkpoint_cli("prune", directory=str(run), keep=1)
    err = capsys.readouterr().err
    assert code == 1 and "nothing deleted" in err and str(run / "c2") in err, err
    (run / "c2" / manifest.MANIFEST).write_text(text)  # the edit undone
    assert [link.path for link in manifest.resolve_chain(str(run / "c2"))][0].endswith("c1")
    # Once it reads again, the prune goes on: c2 and its base together.
    assert _checkpoint_cli("prune", directory=str(run), keep=1) == 0
    assert sorted(p.name for p in run.iterdir()) == ["c3"]
