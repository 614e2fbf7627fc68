"""The control plane under misuse, with real shard processes: where Save
and Load may go (--checkpoint-root), serving beyond loopback only with a
token, one cluster load at a time, commits that are all or nothing,
abandoned loads that expire, and checkpoint files that are verified as they
are loaded and never removed unless a save of ours wrote them."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import grpc
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tf_dlt import Client, errors, routing
from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc
from tf_dlt.server import ShardServer, paths

from conftest import Cluster


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs `tf-dlt server` expecting it to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "tf_dlt.server", "--port", "0", *args],
        capture_output=True, text=True, timeout=60, cwd="/",  # the installed package
    )  # fmt: skip


@pytest.mark.cluster
def test_serving_beyond_loopback_needs_a_token_or_insecure(tmp_path: Path) -> None:
    refused = _serve("--bind", "0.0.0.0")
    assert refused.returncode == 2
    assert "refusing to serve 0.0.0.0 without a token" in refused.stderr
    assert "--insecure" in refused.stderr


@pytest.mark.parametrize(
    ("bind", "said"),
    [("0.0.0.0:7000", "without a port"), ("a b", "not a host name or IP address"),
     ("", "not a host name or IP address"), ("[x]", "not an IPv6 address")],
)  # fmt: skip
def test_a_bind_address_no_socket_takes_is_refused_by_name(bind: str, said: str) -> None:
    # A port in --bind, or a host no socket could take, was refused at the
    # bind as "in use by another process" (the host bracketed once more).
    refused = _serve("--bind", bind)
    assert refused.returncode == 2
    assert "argument --bind" in refused.stderr and said in refused.stderr, refused.stderr


def test_a_bracketed_ipv6_bind_address_is_taken() -> None:
    from tf_dlt.server import main

    parsed = main.build_parser().parse_args(["--bind", "[::1]"])
    assert parsed.bind == "::1" and main.is_loopback(parsed.bind)


def test_insecure_serves_beyond_loopback(start_cluster: Callable[..., Cluster]) -> None:
    # LocalCluster binds 127.0.0.1 first; a later --bind wins.
    cluster = start_cluster(1, "--bind", "0.0.0.0", "--insecure")
    with cluster.client() as client:
        client.create_table("t", 4)
    assert "WARNING" in cluster.log(0) and "no --checkpoint-root" in cluster.log(0)
    # Only where it matters: not on loopback, not on a read-only shard.
    quiet = [start_cluster(1), start_cluster(1, "--bind", "0.0.0.0", "--insecure", "--read-only")]
    for other in quiet:
        with other.client() as client:
            client.list_tables()
        assert "no --checkpoint-root" not in other.log(0)


def test_checkpoint_roots_bound_save_and_load(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    root = tmp_path / "allowed"
    cluster = start_cluster(2, "--checkpoint-root", str(root))
    with cluster.client() as client:
        client.create_table("t", 4)
        rows = client.pull("t", np.arange(50))
        client.save(str(root / "run" / "ck"))
        client.load(str(root / "run" / "ck"))
        np.testing.assert_array_equal(client.pull("t", np.arange(50)), rows)
        outside = [
            str(tmp_path / "elsewhere"),
            str(root) + "-sibling/ck",  # a prefix of the name is not the directory
            str(root / ".." / "escape"),
            "memory://ck",
            "http://127.0.0.1:1/ck",
            f"file://{tmp_path}/elsewhere",
        ]
        for path in outside:
            with pytest.raises(errors.PermissionDeniedError, match="outside this shard's"):
                client.save(path)
        assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "escape").exists()
        # fsspec opens the part before '::' (here the root's parent), which
        # a check of the whole string would take for a file name.
        for path in (f"{root}/..::x", f"{root}/run/../..::x"):
            with pytest.raises(errors.PermissionDeniedError, match="chains filesystems"):
                client.save(path)
        assert not list(tmp_path.glob("*.h5")) and not (tmp_path / "MANIFEST.json").exists()
        with pytest.raises(errors.InvalidArgumentError, match="lowercase"):
            client.save(f"FILE://{root}/run/upper")
        for phase in (dlt_pb2.LoadRequest.LOAD, dlt_pb2.LoadRequest.PREPARE):
            stub = dlt_pb2_grpc.ShardAdminStub(grpc.insecure_channel(_admin(cluster)))
            with pytest.raises(grpc.RpcError) as e:
                stub.Load(dlt_pb2.LoadRequest(path=str(tmp_path), phase=phase, load_id="x"))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_without_roots_only_local_paths_and_object_stores(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1)
    with cluster.client() as client:
        client.create_table("t", 4)
        for url in ("memory://ck", "http://127.0.0.1:1/ck", "ftp://127.0.0.1/ck"):
            with pytest.raises(errors.PermissionDeniedError, match="needs a --checkpoint-root"):
                client.save(url)
        # An HDFS URL naming a host would make the shard connect where the
        # caller says (a port scan through its errors): only under a root
        # naming that host; without one, the configured namenode's.
        listener = socket.create_server(("127.0.0.1", 0))
        with listener:
            port = listener.getsockname()[1]
            (stub,) = _stubs(cluster)
            for url in (f"hdfs://127.0.0.1:{port}/ck", f"viewfs://127.0.0.1:{port}/ck"):
                for method, request in (
                    (stub.Save, dlt_pb2.SaveRequest(path=url, save_id="x")),
                    (stub.Load, dlt_pb2.LoadRequest(path=url, phase=dlt_pb2.LoadRequest.LOAD)),
                ):
                    with pytest.raises(grpc.RpcError) as e:
                        method(request, timeout=30)
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "that names its host" in e.value.details()
            listener.settimeout(0)
            with pytest.raises(BlockingIOError):
                listener.accept()  # no connection came
        paths.CheckpointRoots().check("hdfs:///run/ck", "Save")
        with pytest.raises(grpc.RpcError) as e:
            stub.Save(dlt_pb2.SaveRequest(path="/tmp/ck\x00x", save_id="x"), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NUL" in e.value.details()
        with pytest.raises(errors.PermissionDeniedError, match=r"'\.' or '\.\.'"):
            client.save("s3://bucket/run/../../other")
        # The check would collapse '//'; the store keeps it: key "/run/x".
        with pytest.raises(errors.PermissionDeniedError, match="empty segment"):
            client.save("s3://bucket//run/x")


def test_an_hdfs_root_holds_its_host_whole() -> None:
    """A root's host is matched whole: before, "hdfs:///ctr" was a root of
    hdfs://ctr/... (host "ctr") and "hdfs:///" of every host."""
    allowed = {
        "hdfs:///ctr": ["hdfs:///ctr/x"],
        "hdfs:///": ["hdfs:///x"],
        "hdfs://nn:8020/ctr": ["hdfs://nn:8020/ctr/x", "hdfs://NN:8020/ctr/x"],
        "hdfs://nn:8020": ["hdfs://nn:8020/any"],
    }
    refused = {
        "hdfs:///ctr": ["hdfs://ctr/x", "hdfs:///other"],
        "hdfs:///": ["hdfs://evil:1/x", "viewfs:///x"],
        "hdfs://nn:8020/ctr": ["hdfs://nn:8021/ctr/x", "hdfs://nn:8020/ctrX", "hdfs://nn/ctr/x"],
        "hdfs://nn:8020": ["hdfs://nn:80200/x"],
    }
    for root, urls in allowed.items():
        for url in urls:
            paths.CheckpointRoots([root]).check(url, "Save")
    for root, urls in refused.items():
        for url in urls:
            with pytest.raises(errors.PermissionDeniedError, match="outside this shard's"):
                paths.CheckpointRoots([root]).check(url, "Save")


def _admin(cluster: Cluster, shard: int = 0) -> str:
    return f"127.0.0.1:{cluster.admin_ports[shard]}"


def _stubs(cluster: Cluster) -> list[Any]:
    return [
        dlt_pb2_grpc.ShardAdminStub(grpc.insecure_channel(_admin(cluster, i)))
        for i in range(cluster.num_shards)
    ]


def _trained(cluster: Cluster, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Saves rows A to `path`, then trains them into rows B; returns (ids, A, B)."""
    ids = np.arange(400)
    with cluster.client() as client:
        client.create_table("t", 4, optimizer="adagrad")
        a = client.pull("t", ids)
        client.save(str(path))
        client.push("t", ids, np.ones((400, 4), np.float32), 0.5)
        b = client.pull("t", ids)
    assert not np.allclose(a, b)
    return ids, a, b


def test_a_second_load_never_replaces_one_in_progress(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(1)
    ids, a, b = _trained(cluster, tmp_path / "ck")
    stub = _stubs(cluster)[0]
    stub.Load(dlt_pb2.LoadRequest(path=str(tmp_path / "ck"), phase=1, load_id="first"))
    with cluster.client() as other:
        with pytest.raises(errors.FailedPreconditionError, match="in the middle of load 'first'"):
            other.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(other.pull("t", ids), b)  # nothing changed
        assert "first" in other.stats()[0]["pending_load"]
        stub.Load(dlt_pb2.LoadRequest(phase=dlt_pb2.LoadRequest.ABORT, load_id="first"))
        other.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(other.pull("t", ids), a)
        assert other.stats()[0]["pending_load"] == ""


def test_an_abandoned_prepared_load_expires(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(1, "--load-timeout", "0.5")
    ids, a, b = _trained(cluster, tmp_path / "ck")
    stub = _stubs(cluster)[0]
    stub.Load(dlt_pb2.LoadRequest(path=str(tmp_path / "ck"), phase=1, load_id="gone"))
    with cluster.client() as client:
        deadline = time.monotonic() + 20
        while client.stats()[0]["pending_load"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.stats()[0]["pending_load"] == ""
        with pytest.raises(grpc.RpcError) as e:
            stub.Load(dlt_pb2.LoadRequest(phase=dlt_pb2.LoadRequest.COMMIT, load_id="gone"))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "expired" in (e.value.details() or "")
        np.testing.assert_array_equal(client.pull("t", ids), b)
        assert "expired" in cluster.log(0)


def test_abort_load_undoes_a_load_its_client_left_in_the_middle(
    start_cluster: Callable[..., Cluster], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client died after its load committed on shard 0 and before shard
    1's commit: loads are refused until it expires (--load-timeout, 10
    minutes), and the documented way out (abort it) needed a hand-written
    RPC. `tf-dlt abort-load ID` rolls shard 0 back and aborts shard 1: the
    rows of before the load, and the next load goes through."""
    from tf_dlt.tools import cli

    cluster = start_cluster(2)
    ids, a, b = _trained(cluster, tmp_path / "ck")
    stubs = _stubs(cluster)
    for stub in stubs:
        stub.Load(dlt_pb2.LoadRequest(path=str(tmp_path / "ck"), phase=1, load_id="left"))
    stubs[0].Load(dlt_pb2.LoadRequest(phase=dlt_pb2.LoadRequest.COMMIT, load_id="left"))
    pservers = ",".join(cluster.addresses)
    with cluster.client() as client:
        with pytest.raises(errors.FailedPreconditionError, match="in the middle of load 'left'"):
            client.load(str(tmp_path / "ck"))
        assert cli.main(["abort-load", "--pservers", pservers, "left"]) == 0
        assert capsys.readouterr().out == "shard 0: rolled back\nshard 1: aborted\n"
        np.testing.assert_array_equal(client.pull("t", ids, training=False), b)
        assert [s["pending_load"] for s in client.stats()] == ["", ""]
        assert cli.main(["abort-load", "--pservers", pservers, "left"]) == 1  # nothing left
        assert "no shard was in the middle of load 'left'" in capsys.readouterr().err
        client.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(client.pull("t", ids, training=False), a)
        # Committed everywhere and finished on shard 0 before its client
        # died: the load is whole, so shard 1 finishes it too (rolling it
        # back left the shards of two checkpoints, a review's repro).
        client.push("t", ids, np.ones((400, 4), np.float32), 0.5)
        b = client.pull("t", ids, training=False)
        for stub in stubs:
            stub.Load(dlt_pb2.LoadRequest(path=str(tmp_path / "ck"), phase=1, load_id="done"))
        for stub in stubs:
            stub.Load(dlt_pb2.LoadRequest(phase=dlt_pb2.LoadRequest.COMMIT, load_id="done"))
        stubs[0].Load(dlt_pb2.LoadRequest(phase=dlt_pb2.LoadRequest.FINISH, load_id="done"))
        assert cli.main(["abort-load", "--pservers", pservers, "done"]) == 0
        assert capsys.readouterr().out == "shard 0: -\nshard 1: finished\n"
        np.testing.assert_array_equal(client.pull("t", ids, training=False), a)
        assert not np.array_equal(a, b) and [s["pending_load"] for s in client.stats()] == ["", ""]


def test_a_commit_that_fails_on_one_shard_is_rolled_back_on_the_others(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    ids, a, b = _trained(cluster, tmp_path / "ck")
    on_shard0 = ids[routing.shard_of(ids, 2) == 0]
    with cluster.client() as client:
        client._prepare_load(str(tmp_path / "ck"), "doomed", progress=False)
        cluster.kill(1)  # loses what it staged
        cluster.restart(1)
        with pytest.raises(
            errors.FailedPreconditionError,
            match=r"did not commit on shards \[1\].*every other shard was rolled back",
        ):
            client._commit_load(str(tmp_path / "ck"), "doomed")
    with cluster.client() as check:
        # Shard 0 holds rows B again, not the checkpoint's A; nothing pending.
        np.testing.assert_array_equal(
            check.pull("t", on_shard0, training=False), b[np.isin(ids, on_shard0)]
        )
        stats = check.stats()
        assert [s["pending_load"] for s in stats] == ["", ""]
        assert stats[1]["tables"] == []  # restarted empty


def test_stale_file_removal_keeps_what_a_save_did_not_write(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = start_cluster(2)
    path = tmp_path / "ck"
    path.mkdir()
    foreign = ["shard-notes.txt", "shard-00000-of-00002.backup.h5", "shard-old.h5", "README"]
    for name in foreign:
        (path / name).write_text("not tf_dlt's")
    with cluster.client() as client:
        client.create_table("t", 4)
        client.pull("t", np.arange(10))
        first = client.save(str(path))
        second = client.save(str(path))
    names = set(os.listdir(path))
    assert set(foreign) <= names
    assert not {f["file"] for f in first["files"]} & names
    assert {f["file"] for f in second["files"]} <= names


class _ChangingFS(MemoryFileSystem):  # type: ignore[misc]
    """memory:// whose shard files read differently on every open after
    the first: a store that returns one version to the hash and another to
    the parser must not get its second version loaded."""

    protocol = "changing"
    opens: dict[str, int] = {}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        if "r" not in mode or not path.endswith(".h5"):
            return f
        n = _ChangingFS.opens[path] = _ChangingFS.opens.get(path, 0) + 1
        if n == 1:
            return f
        data = bytearray(f.read())
        data[len(data) // 2 :] = bytes(len(data) - len(data) // 2)
        return io.BytesIO(bytes(data))


@pytest.mark.cluster
def test_load_parses_the_bytes_it_hashed() -> None:
    fsspec.register_implementation("changing", _ChangingFS, clobber=True)
    roots = ["changing://"]
    servers = [ShardServer(i, 2, checkpoint_roots=roots).start() for i in range(2)]
    try:
        with Client([s.address for s in servers]) as client:
            client.create_table("t", 4, optimizer="adagrad")
            ids = np.arange(2000)
            client.push("t", ids, np.ones((2000, 4), np.float32), 0.3)
            expected = client.pull("t", ids)
            client.save("changing://ck")
            client.drop_table("t")
            client.load("changing://ck")
            np.testing.assert_array_equal(client.pull("t", ids), expected)
        assert _ChangingFS.opens and max(_ChangingFS.opens.values()) == 1  # each read once
    finally:
        for s in servers:
            s.stop()
