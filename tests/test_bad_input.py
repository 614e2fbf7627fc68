"""Bad input: each case gets a clear typed error naming the problem, the
server keeps serving other connections, and nothing partial is committed."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from tf_dlt import Client, _native, errors
from tf_dlt import cluster as cluster_lib
from tf_dlt import dlt_ops as ops
from tf_dlt.checkpoint import shard_format, shard_save
from tf_dlt.proto import dlt_pb2, dlt_pb2_grpc
from tf_dlt.table_config import TableConfig

import frames
from conftest import Cluster


def _connect(cluster: Cluster) -> socket.socket:
    host, port = cluster.addresses[0].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _still_serves(cluster: Cluster) -> None:
    with cluster.client() as client:
        client.pull("emb", [1, 2, 3])


@pytest.fixture
def one(start_cluster: Callable[..., Cluster]) -> Cluster:
    cluster = start_cluster(1)
    with cluster.client() as client:
        client.create_table("emb", 4, "uniform", "adagrad")
    return cluster


def test_wrong_dtypes_are_rejected(one: Cluster) -> None:
    with one.client() as client:
        with pytest.raises(errors.InvalidArgumentError, match="ids must be int64.*float64"):
            client.pull("emb", np.array([1.0, 2.0]))
        with pytest.raises(errors.InvalidArgumentError, match="uint64"):
            client.pull("emb", np.array([1], np.uint64))
        with pytest.raises(errors.InvalidArgumentError, match="grads must be floating point"):
            client.push("emb", [1], np.ones((1, 4), np.int32), 0.1)
        with pytest.raises(errors.InvalidArgumentError, match=r"grads must have shape \(2, 4\)"):
            client.push("emb", [1, 2], np.ones((2, 3), np.float32), 0.1)
        client.pull("emb", np.array([1, 2], np.int32))  # safe integer casts are fine
        with pytest.raises(errors.InvalidArgumentError, match="missing='zeros' applies to"):
            client.pull("emb", [5], missing="zeros")  # (ignored: it made the row)
        assert client.pull("emb", [5], training=False, missing="zeros").sum() == 0


@pytest.mark.unit
def test_an_address_no_call_could_reach_is_refused_when_given() -> None:
    """Accepted before, then failing each call UNAVAILABLE after retries."""
    import tf_dlt

    for bad in (["127.0.0.1"], ["h:70000"], ["h:7000|standby"], ["h:"], "h:1,nohost"):
        with pytest.raises(errors.InvalidArgumentError, match="is not host:port"):
            tf_dlt.Client(bad)
        with pytest.raises(errors.InvalidArgumentError, match="is not host:port"):
            ops.ClientResource(bad)
    # A bare IPv6 address, a space or a comma in a host, and digits that are
    # not ASCII (int() refused '²' with a bare ValueError) were accepted
    # and failed every call UNAVAILABLE ("cannot resolve ':'").
    for bad in ("::1", "fe80::1:7000", "h :7000", "a:7000,b:7000", "h:\u00b2", "h:\u0667\u0660"):
        with pytest.raises(errors.InvalidArgumentError, match="is not host:port"):
            tf_dlt.Client([bad])
        with pytest.raises(errors.InvalidArgumentError, match="is not host:port"):
            ops.ClientResource([bad])
    for bad_ps in (["::1"], ["ps-0:7000| ps-1:7000"], ["[::g]:7000"]):
        text = json.dumps({"cluster": {"ps": bad_ps, "worker": ["w:0"]}, "task": {"index": 0}})
        with pytest.raises(ValueError, match="TF_CONFIG"):
            cluster_lib.parse(text)
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX"):
        cluster_lib.cluster_from_env(
            {"TF_CONFIG": '{"cluster": {"worker": ["a:0", "b:0"]}}', "JOB_COMPLETION_INDEX": "²"}
        )
    # Spaces around an address (a list pasted from a config) are dropped.
    assert ops.ClientResource([" 127.0.0.1:7000 "]).pservers == ["127.0.0.1:7000"]
    assert tf_dlt.Client(["[::1]:7000", "ps_0.ns-1.svc:7000"]).pservers == [
        "[::1]:7000",
        "ps_0.ns-1.svc:7000",
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs",
    [
        {"frame_bytes": 2**40},
        {"frame_bytes": -1},
        {"frame_bytes": 4096.5},
        {"request_timeout": None},
        {"connect_timeout": "5"},
        {"auth_token": 12345},
        {"auth_token": b"\xff-not-ascii"},
    ],
)
def test_bad_client_arguments_are_invalid_argument_naming_them(kwargs: dict) -> None:
    """They raised pybind's TypeError, AttributeError or a bare TypeError."""
    import tf_dlt

    with pytest.raises(errors.InvalidArgumentError, match=next(iter(kwargs))):
        tf_dlt.Client(["127.0.0.1:1"], **kwargs)


@pytest.mark.unit
def test_a_token_read_as_bytes_is_taken() -> None:
    """`open(path, "rb").read()` gave AttributeError ('bytes' has no encode)."""
    import tf_dlt

    tf_dlt.Client(["127.0.0.1:1"], auth_token=b"s3cret-token\n").close()


def test_unknown_table_and_dim_mismatch(one: Cluster) -> None:
    raw = _native.Client(one.addresses)
    with pytest.raises(
        errors.NotFoundError, match=r"shard 0 \(127.0.0.1:\d+\) Pull: no table 'nope'.*'emb'"
    ):
        raw.pull("nope", 4, np.array([1], np.int64))
    with pytest.raises(
        errors.InvalidArgumentError, match="table 'emb' has dim 4, the request says 8"
    ):
        raw.pull("emb", 8, np.array([1], np.int64))
    with pytest.raises(errors.InvalidArgumentError, match="has dim 4, the request says 2"):
        raw.push("emb", 2, np.array([1], np.int64), np.ones((1, 2), np.float32), 0.1)
    with one.client() as client, pytest.raises(errors.NotFoundError, match="no table 'nope'"):
        client.pull("nope", [1])
    _still_serves(one)


def test_non_finite_gradients_change_nothing(one: Cluster) -> None:
    with one.client() as client:
        ids = np.arange(10, dtype=np.int64)
        before = client.pull("emb", ids)
        for bad in (np.nan, np.inf, -np.inf):
            grads = np.ones((10, 4), np.float32)
            grads[7, 2] = bad
            with pytest.raises(errors.InvalidArgumentError, match=r"row 7 \(id 7\).*non-finite"):
                client.push("emb", ids, grads, 0.1)
        with pytest.raises(errors.InvalidArgumentError, match="learning rate"):
            client.push("emb", ids, np.ones((10, 4), np.float32), float("nan"))
        np.testing.assert_array_equal(client.pull("emb", ids), before)
        # Each row within the limit, an id's repeats summed past it: that
        # row stays as it was (before, it was applied, leaving Adagrad's
        # accumulator at 1.6e37), the others are applied.
        repeated = np.array([3, 3, 3, 3, 5], np.int64)
        grads = np.full((5, 4), 1e18, np.float32)
        grads[4] = 1.0
        with pytest.raises(errors.InvalidArgumentError, match=r"id 3, repeated in the push") as e:
            client.push("emb", repeated, grads, 0.1)
        # The table is named once (was "table 'emb': push to table 'emb': ...").
        assert str(e.value).count("'emb'") == 1, e.value
        after = client.pull("emb", ids)
        np.testing.assert_array_equal(after[3], before[3])
        assert not np.array_equal(after[5], before[5])


def test_invalid_table_configs(one: Cluster) -> None:
    with one.client() as client:
        with pytest.raises(errors.InvalidArgumentError, match="letters, digits"):
            client.create_table("bad name!", 4)
        with pytest.raises(
            errors.InvalidArgumentError, match=r"dim must be in \[1, 65536\], got 0"
        ):
            client.create_table("x", 0)
        with pytest.raises(errors.InvalidArgumentError, match="unknown optimizer 'rmsprop'"):
            client.create_table("x", 4, optimizer="rmsprop")
        with pytest.raises(errors.InvalidArgumentError, match="minval < maxval"):
            client.create_table("x", 4, initializer={"kind": "uniform", "minval": 1, "maxval": 0})
        with pytest.raises(errors.AlreadyExistsError, match="exists"):
            client.create_table("emb", 8)
        client.create_table("emb", 4, "uniform", "adagrad")  # identical: fine


def test_oversize_frame_is_refused_and_server_survives(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1, "--max-frame-bytes", "65536")
    with cluster.client() as client:
        client.create_table("emb", 4)
    with _connect(cluster) as sock:
        sock.sendall(frames.hello(1))
        assert frames.read_frame(sock)[0] == frames.HELLO
        sock.sendall(frames.HEADER.pack(frames.MAGIC, 1, frames.PULL, 0, 9, 1 << 30, 0))
        opcode, _, request_id, payload = frames.read_frame(sock)
        assert (opcode, request_id) == (frames.ERROR, 9)
        code, message = frames.error_of(payload)
        assert code == errors.ResourceExhaustedError.code
        assert "exceeds the maximum of 65536" in message
        assert frames.closed_by_peer(sock)
    _still_serves(cluster)


def test_big_batches_are_split_not_rejected(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1, "--max-frame-bytes", "4096")
    with cluster.client() as client:
        client.create_table("emb", 64)
        assert client.pull("emb", np.arange(10_000)).shape == (10_000, 64)


def test_the_smallest_frame_maximum_takes_the_longest_token(
    start_cluster: Callable[..., Cluster],
) -> None:
    """--max-frame-bytes 4096 (the documented minimum) refused a Hello
    carrying a 4,096-byte token (4,104 bytes) as too large, so no client
    could connect; frames before Hello larger than the maximum got
    RESOURCE_EXHAUSTED instead of the documented codes."""
    token = "t" * 4096
    cluster = start_cluster(1, "--max-frame-bytes", "4096", token=token)
    with cluster.client() as client:
        client.create_table("emb", 4)
        assert client.pull("emb", [1, 2]).shape == (2, 4)
    with _connect(cluster) as sock:  # a second Hello on a connection is answered as the first
        for request_id in (1, 2):
            sock.sendall(frames.hello(request_id, token))
            assert frames.read_frame(sock)[:3] == (frames.HELLO, frames.RESPONSE, request_id)
    for opcode, code in ((frames.HELLO, errors.InvalidArgumentError.code),
                         (frames.PULL, errors.UnauthenticatedError.code)):  # fmt: skip
        with _connect(cluster) as sock:
            sock.sendall(frames.HEADER.pack(frames.MAGIC, 1, opcode, 0, 9, 1 << 20, 0))
            reply, _, _, payload = frames.read_frame(sock)
            assert reply == frames.ERROR and frames.error_of(payload)[0] == code
            assert frames.closed_by_peer(sock)
    _still_serves(cluster)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        os.urandom(24),
        frames.HEADER.pack(b"DLTP", 9, 1, 0, 1, 0, 0),  # unknown version
        frames.HEADER.pack(b"DLTP", 1, 1, 0, 1, 0, 7),  # reserved bits set
    ],
    ids=["http", "random", "version", "reserved"],
)
def test_garbage_frames_get_an_error_and_a_close(one: Cluster, garbage: bytes) -> None:
    with _connect(one) as sock:
        sock.sendall(garbage)
        opcode, _, _, payload = frames.read_frame(sock)
        assert opcode == frames.ERROR
        assert frames.error_of(payload)[0] == errors.InvalidArgumentError.code
        assert frames.closed_by_peer(sock)
    _still_serves(one)


def test_truncated_frames_and_malformed_payloads(one: Cluster) -> None:
    with _connect(one) as sock:  # half a header, then hang up
        sock.sendall(frames.hello(1)[:10])
    with _connect(one) as sock:
        sock.sendall(frames.hello(1))
        frames.read_frame(sock)
        # A Pull whose payload disagrees with its own counts keeps the stream in
        # sync (the length is in the header): error, connection stays open.
        bad = frames.pull(2, "emb", 4, [1, 2])
        bad = bad[:28] + struct.pack("<I", 5) + bad[32:]  # claims 5 ids, carries 2
        sock.sendall(bad + frames.pull(3, "emb", 4, [1]))
        opcode, _, rid, payload = frames.read_frame(sock)
        assert (opcode, rid) == (frames.ERROR, 2)
        assert "implies" in frames.error_of(payload)[1]
        assert frames.read_frame(sock)[:3] == (frames.PULL, frames.RESPONSE, 3)
        sock.sendall(frames.frame(77, 4, b""))  # unknown opcode
        opcode, _, rid, payload = frames.read_frame(sock)
        assert (opcode, rid) == (frames.ERROR, 4) and "unknown opcode 77" in frames.error_of(
            payload
        )[1]
    _still_serves(one)


def test_frames_before_hello_are_unauthenticated(one: Cluster) -> None:
    with _connect(one) as sock:
        sock.sendall(frames.pull(1, "emb", 4, [1]))
        opcode, _, _, payload = frames.read_frame(sock)
        assert opcode == frames.ERROR
        assert frames.error_of(payload) == (16, "the first frame on a connection must be Hello")
        assert frames.closed_by_peer(sock)


def test_auth_token_on_both_planes(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2, token="s3cret-token")
    with cluster.client() as client:
        client.create_table("emb", 4)
        client.pull("emb", [1, 2])
    with pytest.raises(errors.UnauthenticatedError, match="Hello: wrong or missing auth token"):
        _native.Client(cluster.addresses, auth_token="wrong").pull(
            "emb", 4, np.array([1], np.int64)
        )
    # A client greeting every shard names each step once.
    with pytest.raises(errors.UnauthenticatedError, match="greeting: Hello: wrong") as e:
        Client(cluster.addresses, auth_token="wrong").list_tables()
    assert "Hello: Hello" not in str(e.value)
    with pytest.raises(errors.UnavailableError, match="greeting: connect: ") as e:
        Client(["127.0.0.1:1"], connect_timeout=2).list_tables()
    assert "connect: connect" not in str(e.value)
    with pytest.raises(errors.UnauthenticatedError):
        _native.Client(cluster.addresses).pull("emb", 4, np.array([1], np.int64))
    with grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[0]}") as channel:
        stub = dlt_pb2_grpc.ShardAdminStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ListTables(dlt_pb2.ListTablesRequest(), timeout=10,
                            metadata=(("authorization", "Bearer wrong"),))  # fmt: skip
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for i in range(2):
        assert "s3cret-token" not in cluster.log(i)


def test_shard_listed_in_the_wrong_order(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(2)
    swapped = list(reversed(cluster.addresses))
    with pytest.raises(errors.FailedPreconditionError, match="shard-index order"):
        _native.Client(swapped).pull("emb", 4, np.array([1], np.int64))
    # A shard left out is named as such (it said "order" alone).
    with pytest.raises(
        errors.FailedPreconditionError,
        match="the cluster has 2 shards and the client lists 1; list every shard's address",
    ):
        _native.Client(cluster.addresses[:1]).pull("emb", 4, np.array([1], np.int64))


def test_down_shard_is_unavailable_within_the_deadline() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = _native.Client([f"127.0.0.1:{port}"], connect_timeout_ms=2000)
    with pytest.raises(errors.UnavailableError, match=rf"shard 0 \(127.0.0.1:{port}\)"):
        client.pull("emb", 4, np.array([1], np.int64))


def test_sizes_that_would_wrap_are_refused(one: Cluster) -> None:
    """dim 2^31-2 and 2^31 ids make a Push of 2^64 bytes, which once wrapped
    to 0 and let a payload of only the fixed part through."""
    with _connect(one) as sock:
        sock.sendall(frames.hello(1))
        frames.read_frame(sock)
        name = b"emb\0\0\0\0\0"
        payload = struct.pack("<IIHBBf", 2**31 - 2, 2**31, 3, 0, 0, 0.5) + name
        sock.sendall(frames.frame(frames.PUSH, 2, payload))
        opcode, _, rid, reply = frames.read_frame(sock)
        code, message = frames.error_of(reply)
        assert (opcode, rid, code) == (frames.ERROR, 2, errors.InvalidArgumentError.code)
        assert "dim 2147483646 exceeds the maximum of 65536" in message
    _still_serves(one)


def test_state_pulls_on_the_wire_and_modes_past_4(one: Cluster) -> None:
    with one.client() as client:
        client.push("emb", [5], np.ones((1, 4), np.float32), 0.1)  # id 5 exists; 6 does not
    with _connect(one) as sock:
        sock.sendall(frames.hello(1))
        frames.read_frame(sock)
        # Mode 3: values, the Adagrad accumulator and the step as u32 bits.
        sock.sendall(frames.pull(2, "emb", 4, [5, 6], mode=3))
        opcode, _, rid, payload = frames.read_frame(sock)
        assert (opcode, rid) == (frames.PULL, 2)
        dim, rows = struct.unpack_from("<II", payload)
        assert (dim, rows) == (4, 2) and len(payload) == 8 + 2 * 9 * 4
        row5 = np.frombuffer(payload, np.float32, 9, 8)
        row6 = np.frombuffer(payload, np.float32, 9, 8 + 36)
        assert row5[8:].view(np.uint32)[0] == 1 and row6[8:].view(np.uint32)[0] == 0xFFFFFFFF
        np.testing.assert_allclose(row5[4:8], 0.1 + 1.0)  # initial accumulator + g^2
        assert not row6[:8].any()
        with one.client() as client:  # a state pull inserted nothing
            assert client.list_tables()["emb"]["rows"] == 1
        # Mode 4 (a trainer's): id 6 is made as a training pull makes it.
        sock.sendall(frames.pull(3, "emb", 4, [5, 6], mode=4))
        opcode, _, rid, payload = frames.read_frame(sock)
        assert (opcode, rid) == (frames.PULL, 3) and len(payload) == 8 + 2 * 9 * 4
        again5 = np.frombuffer(payload, np.float32, 9, 8)
        made6 = np.frombuffer(payload, np.float32, 9, 8 + 36)
        np.testing.assert_array_equal(again5, row5)
        assert made6[8:].view(np.uint32)[0] == 0  # a new row: no update yet
        np.testing.assert_allclose(made6[4:8], 0.1)  # the initial accumulator
        sock.sendall(frames.pull(4, "emb", 4, [1], mode=5))
        opcode, _, rid, payload = frames.read_frame(sock)
        assert (opcode, rid) == (frames.ERROR, 4)
        assert frames.error_of(payload)[1] == "Pull mode must be 0 to 4, got 5"
    with one.client() as client:
        assert client.list_tables()["emb"]["rows"] == 2
        np.testing.assert_array_equal(client.pull("emb", [6])[0], made6[:4])
    _still_serves(one)


def test_state_pulls_too_big_for_a_frame_are_refused_or_split(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1, "--max-frame-bytes", "65536")
    with cluster.client() as client:
        config = client.create_table("emb", 4, "uniform", "adagrad")
        client.pull("emb", np.arange(2000))  # the rows exist
    with _connect(cluster) as sock:
        sock.sendall(frames.hello(1))
        frames.read_frame(sock)
        # 2,000 ids: a plain reply (32 KB) fits the frame, a state reply
        # (9 floats a row: 72 KB) does not.
        sock.sendall(frames.pull(2, "emb", 4, list(range(2000)), mode=3))
        opcode, _, rid, payload = frames.read_frame(sock)
        assert (opcode, rid) == (frames.ERROR, 2)
        assert frames.error_of(payload)[0] == errors.ResourceExhaustedError.code
        sock.sendall(frames.pull(3, "emb", 4, list(range(2000))))  # the connection still serves
        assert frames.read_frame(sock)[:3] == (frames.PULL, frames.RESPONSE, 3)
    # A trainer's cache sizes its state pulls to the frame: its fills are split.
    client = ops.ClientResource(cluster.addresses)
    ops.configure_cache(client, config, 4000, max_staleness_steps=100, min_count=1)
    ids = np.arange(2000, dtype=np.int64)
    cached = ops.lookup(client, ids, "emb", 4).numpy()
    assert ops.client_stats(client)["cache_fills"] == 2000
    plain = ops.lookup(ops.ClientResource(cluster.addresses, request_timeout=29.0), ids, "emb", 4)
    np.testing.assert_array_equal(cached, plain.numpy())
    _still_serves(cluster)


def test_a_long_error_keeps_its_code_across_the_control_plane(one: Cluster) -> None:
    """An error whose message is longer than gRPC's metadata limit (here a
    Load of a 3,800-character path, which the message names) reaches the
    caller with its own code and a bounded message, not as "Stream removed"
    (RESOURCE_EXHAUSTED); the shard keeps serving. (A path is at most 4,096
    bytes: test_security.py.)"""
    cluster = one
    path = "/nonexistent/" + "/".join(["d" * 200] * 19)
    with grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[0]}") as channel:
        stub = dlt_pb2_grpc.ShardAdminStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Load(dlt_pb2.LoadRequest(path=path), timeout=30)
    assert info.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    details = info.value.details()
    assert "characters left out" in details and len(details) <= 2000, details[:300]
    _still_serves(cluster)


def test_a_push_whose_result_overflows_changes_nothing(one: Cluster, tmp_path: Path) -> None:
    """One finite push cannot put infinity into a table (and so into every
    later checkpoint): gradients past what the optimizer state can take are
    refused before anything is sent, and an update that would overflow a
    row's state anyway leaves the row as it was; saves keep loading."""
    with one.client() as client:
        client.create_table("plain", 4, "uniform", "sgd")
        ids = np.arange(10, dtype=np.int64)
        before = {t: client.pull(t, ids) for t in ("emb", "plain")}
        grads = np.ones((10, 4), np.float32)
        grads[3, 1] = 1e20  # squared: past float32 (Adagrad's accumulator)
        with pytest.raises(errors.InvalidArgumentError, match=r"row 3 \(id 3\).*nothing sent"):
            client.push("emb", ids, grads, 0.1)
        grads[3, 1] = 3e37  # times the learning rate: past float32 (SGD's step)
        with pytest.raises(errors.InvalidArgumentError, match=r"row 3 \(id 3\).*rate 10"):
            client.push("plain", ids, grads, 10.0)
        # Each gradient in range, their sum (one id pushed 400 times) not.
        many = np.full(400, 5, np.int64)
        with pytest.raises(
            errors.InvalidArgumentError, match="table 'emb'.*id 5, repeated in the push, sum past"
        ):
            client.push("emb", many, np.full((400, 4), 1e18, np.float32), 0.1)
        for t in ("emb", "plain"):
            np.testing.assert_array_equal(client.pull(t, ids), before[t])
        client.push("emb", ids, np.ones((10, 4), np.float32), 0.1)
        trained = client.pull("emb", ids)
        client.save(str(tmp_path / "ck"))
        client.push("emb", ids, np.ones((10, 4), np.float32), 0.1)
        client.load(str(tmp_path / "ck"))
        np.testing.assert_array_equal(client.pull("emb", ids), trained)
    _still_serves(one)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "ftrl"])
def test_each_optimizer_leaves_a_row_it_would_overflow_as_it_was(optimizer: str) -> None:
    """The shard's own check of a row's summed gradient: one id pushed 4,000
    times at 1e18 (each gradient in range, their sum not) is refused naming
    it and keeps its values and slots; the push's other row is applied. (The
    check fused into each update, for state grown past float32 push by
    push, is tests/cpp/native_test.cc's
    TestAPushThatWouldOverflowARowLeavesItAsItWas.)"""
    table = _native.Table(TableConfig.create("t", 4, "uniform", optimizer).to_dict())
    ids = np.array([1] + [5] * 4000, np.int64)
    grads = np.full((len(ids), 4), 1e18, np.float32)
    grads[0] = 1.0
    lr = 1e17 if optimizer == "sgd" else 0.1  # SGD: lr x sum(g) past float32
    table.pull(np.array([1, 5], np.int64))

    def state() -> dict[int, tuple[bytes, bytes, int]]:  # id -> (values, slots, step)
        ids, values, slots, steps, _, _ = table.exporter().next(16)
        assert np.isfinite(values).all() and np.isfinite(slots).all()
        return {
            int(i): (v.tobytes(), s.tobytes(), int(t))
            for i, v, s, t in zip(ids, values, slots, steps, strict=True)
        }

    before = state()
    with pytest.raises(errors.InvalidArgumentError, match="id 5, repeated in the push, sum past"):
        table.push(ids, grads, lr)
    after = state()
    assert after[5] == before[5]
    assert after[1] != before[1]


def test_the_table_refuses_an_update_that_overflows_its_row() -> None:
    """The shard's own check, without the client's: the row keeps its
    values."""
    table = _native.Table(TableConfig.create("t", 4, "uniform", "adagrad").to_dict())
    ids = np.arange(1000, dtype=np.int64)
    before = table.pull(ids)
    with pytest.raises(errors.InvalidArgumentError, match="gradient row 3 .id 3.* holds 1e\\+20"):
        grads = np.ones((1000, 4), np.float32)
        grads[3, 0] = 1e20
        table.push(ids, grads, 0.1)
    with pytest.raises(errors.InvalidArgumentError, match="id 5, repeated in the push, sum past"):
        table.push(np.full(400, 5, np.int64), np.full((400, 4), 1e18, np.float32), 0.1)
    np.testing.assert_array_equal(table.pull(ids), before)
    assert np.isfinite(table.pull(ids)).all()


def test_a_save_refuses_rows_its_load_would_refuse(tmp_path: Path) -> None:
    values = np.ones((3, 4), np.float32)
    values[1, 2] = np.inf
    chunk = (
        np.array([1, 2, 3], np.int64), values, np.zeros((3, 4), np.float32),
        np.zeros(3, np.uint32), _native.bucket_of(np.array([1, 2, 3], np.int64)),
        np.zeros(3, np.uint32),
    )  # fmt: skip
    rows = shard_format.TableRows({"name": "t", "dim": 4}, 4, 4, iter([chunk]))
    with pytest.raises(errors.InternalError, match="table 't': the values of id 2 are not finite"):
        shard_save.save_tables(str(tmp_path / "ck"), shard_format.ShardLayout(), [rows], "s1")
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.endswith(".h5")]


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_peer_that_half_closes_with_a_large_reply_pending_costs_nothing(
    start_cluster: Callable[..., Cluster],
) -> None:
    """An authenticated peer asks for a reply far larger than the socket
    buffers, shuts down its sending side and never reads: the shard waits
    for room without spinning (no worker pinned until --io-timeout), keeps
    serving others, and drops the connection at the timeout."""
    cluster = start_cluster(1, "--io-timeout", "4", token="tok")
    with cluster.client() as client:
        client.create_table("wide", 256)
    sock = _connect(cluster)
    sock.sendall(frames.hello(1, "tok"))
    assert frames.read_frame(sock)[:2] == (frames.HELLO, frames.RESPONSE)
    sock.sendall(frames.pull(2, "wide", 256, list(range(20_000))))  # a 20 MB reply
    sock.shutdown(socket.SHUT_WR)
    pid = cluster.processes[0].pid
    time.sleep(0.5)  # the reply fills the socket buffers
    before = _cpu_seconds(pid)
    time.sleep(2.0)
    assert _cpu_seconds(pid) - before < 0.5  # a spinning worker takes ~2 s
    with cluster.client() as client:
        assert client.pull("wide", [1]).shape == (1, 256)
    time.sleep(3.0)  # past --io-timeout: the shard drops the connection
    sock.settimeout(10)
    received = 0
    while chunk := sock.recv(1 << 20):  # what the buffers held, then the end
        received += len(chunk)
    assert received < 20_000 * 256 * 4
    sock.close()


def _run_native(code: str) -> subprocess.CompletedProcess[str]:
    """Runs `code` (after `from tf_dlt import _native, errors`) in a fresh
    interpreter: a case that used to crash the process crashes only that."""
    code = "import numpy as np\nfrom tf_dlt import _native, errors\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_data_server_starts_once() -> None:
    """A second start of a DataServer, or a start after its stop, raises
    FAILED_PRECONDITION: it started threads over the ones it held (or left
    them unjoined at its end), which aborted the process."""
    done = _run_native("""
        def start(server, when):
            try:
                server.start()
            except errors.FailedPreconditionError as e:
                print(f"{when}:", e)

        shard = _native.Shard(0, 1)
        server = _native.DataServer(shard)
        server.start()
        start(server, "again")
        server.stop()
        start(server, "after stop")
        del server
        stopped = _native.DataServer(shard)
        stopped.stop()
        start(stopped, "stopped first")
        print("done")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "again: this data server has started already" in done.stdout
    assert "after stop: this data server was stopped" in done.stdout
    assert "stopped first: this data server was stopped" in done.stdout
    assert "done" in done.stdout


@pytest.mark.parametrize(
    "call",
    [
        "_native.DataServer(None)",
        "_native.Replicator(None, '127.0.0.1:1').start()",
        "_native.ReplicaGroup(None).attach('127.0.0.1:1')",
        "_native.Shard(0, 1).install_tables([None])",
    ],
)
def test_none_for_a_shard_or_table_is_a_type_error(call: str) -> None:
    """None where a binding takes a Shard or a Table raises TypeError (it was
    taken as a null pointer, and the process crashed on its first use)."""
    done = _run_native(f"""
        try:
            {call}
        except TypeError as e:
            print("refused:", type(e).__name__)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: TypeError" in done.stdout


def test_one_exporter_read_by_several_threads() -> None:
    """Threads that share one Exporter take its rows in turn, each row
    once: their calls ran at once without the GIL and corrupted its state
    (a double free)."""
    done = _run_native("""
        import threading
        cfg = dict(name="t", dim=4, seed=1, initializer=dict(kind="zeros"),
                   optimizer=dict(kind="adagrad"))
        table = _native.Table(cfg)
        table.pull(np.arange(100_000, dtype=np.int64))
        for _ in range(10):
            exporter = table.exporter()
            seen = []
            def read():
                while (rows := exporter.next(7)) is not None:
                    seen.append(rows[0])
            threads = [threading.Thread(target=read) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            ids = np.concatenate(seen)
            assert len(ids) == 100_000 and len(np.unique(ids)) == 100_000, len(ids)
        print("done")
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done" in done.stdout


def test_a_state_pull_with_other_slot_floats_names_the_tables(one: Cluster) -> None:
    """pull_state told other slot floats than the table's got a reply of
    another size, raised as INTERNAL ("reply of 88 bytes; the request
    expects 32"): INVALID_ARGUMENT naming the table's and the request's."""
    raw = _native.Client(one.addresses)
    with pytest.raises(
        errors.InvalidArgumentError,
        match="the table has 4 slot floats per row, the request says 1 \\(pull_state's slot_floats",
    ):
        raw.pull_state("emb", 4, 1, np.array([1, 2], np.int64))
    assert raw.pull_state("emb", 4, 4, np.array([1, 2], np.int64)).shape == (2, 9)
    _still_serves(one)


def test_a_time_out_of_range_for_shrink_or_expire_is_invalid_argument() -> None:
    """A negative `now` raised a bare RuntimeError ("Unable to cast Python
    instance of type int to C++ type '?'")."""
    shard = _native.Shard(0, 1)
    shard.create_table(TableConfig("t", 2).to_dict())
    table = shard.get_table("t")
    for now in (-1, 1 << 32):
        with pytest.raises(errors.InvalidArgumentError, match=f"now must be .*, got {now}"):
            table.shrink(min_count=1, now=now)
        with pytest.raises(errors.InvalidArgumentError, match=f"now must be .*, got {now}"):
            table.expire(now=now)
    assert table.shrink(min_count=1, now=0) == 0


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        (("dim",), "table config has no 'dim'"),
        (("optimizer", "kind"), "table config's optimizer has no 'kind'"),
    ],
)
def test_a_table_config_missing_an_entry_names_it(drop: tuple[str, ...], named: str) -> None:
    """A config dict without one of its entries raised a bare KeyError
    ('dim') from the native shard."""
    config = TableConfig("t", 2).to_dict()
    held = config
    for key in drop[:-1]:
        held = held[key]
    del held[drop[-1]]
    with pytest.raises(errors.InvalidArgumentError, match=named):
        _native.Shard(0, 1).create_table(config)


def test_a_table_config_dict_missing_entries_names_them() -> None:
    """TableConfig.from_dict raised a bare KeyError ('dim')."""
    config = TableConfig("t", 2).to_dict()
    del config["dim"], config["seed"]
    with pytest.raises(errors.InvalidArgumentError, match="table config 't' has no 'dim', 'seed'"):
        TableConfig.from_dict(config)


def test_a_port_past_65535_is_refused() -> None:
    """A data server given port 70000 listened on 4464 (70000 modulo 65536)."""
    shard = _native.Shard(0, 1)
    for options in ({"port": 70000}, {"port": -1}, {"admin_port": 70000}):
        server = _native.DataServer(shard, **options)
        with pytest.raises(errors.InvalidArgumentError, match="must be 0-65535"):
            server.start()
        server.stop()
