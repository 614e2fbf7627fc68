"""Fuzzing both planes of a live shard server (hypothesis, derandomized so
CI runs the same cases every time).

Data plane: 10,000 cases of random bytes, valid frames with mutated bytes,
truncated or extended frames and frames with random header fields, each on
its own connection, half of them after a valid Hello. Every case must end
with error frames or a cleanly closed connection (never a hang), the
server must stay up with bounded memory, and a valid client must keep
working throughout. Control plane: 2,000 random request payloads to every
ShardAdmin method."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tf_dlt import _native

import frames
from conftest import Cluster
from native_build import SANITIZER_ENV, build

pytestmark = pytest.mark.slow  # thousands of cases, and a sanitized shard build

DATA_CASES = 10_000
CONTROL_CASES = 2_000
DIM = 4
# The same cases on every run, generated only (no shrinking, no database).
FUZZ_SETTINGS: dict[str, Any] = {
    "derandomize": True, "deadline": None, "database": None, "phases": [Phase.generate],
    "suppress_health_check": list(HealthCheck),
}  # fmt: skip
# The table every valid frame names; rows 0..99 exist.
TABLE = "fuzz"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _valid_frames() -> list[bytes]:
    ids = list(range(8))
    rows = np.ones((8, DIM), np.float32)
    return [
        frames.hello(),
        frames.pull(2, TABLE, DIM, ids),
        frames.pull(3, TABLE, DIM, ids, mode=1),
        frames.push(4, TABLE, DIM, ids, rows, 0.01),
        frames.assign(5, TABLE, DIM, ids, rows),
    ]


VALID = _valid_frames()

mutated = st.builds(
    lambda frame, edits: _apply(frame, edits),
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6),
)
truncated = st.builds(
    lambda frame, cut: frame[: cut % max(1, len(frame))], st.sampled_from(VALID), st.integers(0)
)
extended = st.builds(
    lambda frame, tail: frame + tail, st.sampled_from(VALID), st.binary(max_size=64)
)
random_header = st.builds(
    lambda opcode, flags, rid, length, reserved, payload: frames.HEADER.pack(
        frames.MAGIC, 1, opcode, flags, rid, length, reserved
    ) + payload,
    st.integers(0, 255), st.integers(0, 0xFFFF), st.integers(0, 2**64 - 1),
    st.sampled_from([0, 1, 7, 24, 1 << 20, 1 << 31, 2**32 - 1]), st.integers(0, 2**32 - 1),
    st.binary(max_size=64),
)  # fmt: skip
random_fields = st.builds(
    lambda dim, count, name_len, mode, lr: frames.frame(
        frames.PULL if mode < 4 else frames.PUSH, 9,
        struct.pack("<IIHBBI", dim, count, name_len, mode % 4, 0, lr) + b"fuzz\0\0\0\0"
        + b"\1" * 64,
    ),
    st.sampled_from([0, 1, DIM, 3, 1 << 16, 2**32 - 1]),
    st.sampled_from([0, 1, 8, 1 << 20, 2**32 - 1]),
    st.sampled_from([0, 4, 5, 255, 0xFFFF]), st.integers(0, 7), st.integers(0, 2**32 - 1),
)  # fmt: skip
cases = st.one_of(
    st.binary(max_size=200), mutated, truncated, extended, random_header, random_fields
)


def _apply(frame: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(frame)
    for pos, value in edits:
        out[pos % len(out)] = value
    return bytes(out)


def _exchange(port: int, data: bytes, hello_first: bool) -> None:
    """Sends one case; reads until the server closes. Every reply must be a
    whole, well-formed frame; the connection must end (EOF or reset)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        if hello_first:
            sock.sendall(frames.hello())
            assert frames.read_frame(sock)[0] == frames.HELLO
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # EPIPE, ECONNRESET, ENOTCONN
            return  # the server already hung up on an earlier part
        while True:
            try:
                header = sock.recv(frames.HEADER.size, socket.MSG_WAITALL)
            except ConnectionResetError:
                return
            if not header:
                return  # closed cleanly
            assert len(header) == frames.HEADER.size, "a partial reply header"
            magic, version, opcode, flags, rid, length, reserved = frames.HEADER.unpack(header)
            assert (magic, version, reserved) == (frames.MAGIC, 1, 0)
            assert opcode in (frames.HELLO, frames.PULL, frames.PUSH, frames.ASSIGN, frames.ERROR)
            payload = frames.recv_exact(sock, length)
            if opcode == frames.ERROR:
                code, message = frames.error_of(payload)
                assert 0 < code < 17 and message


def test_data_plane_survives_10000_fuzz_cases(start_cluster: Callable[..., Cluster]) -> None:
    cluster = start_cluster(1)
    port = int(cluster.addresses[0].rsplit(":", 1)[1])
    pid = cluster.processes[0].pid
    client = cluster.client()
    client.create_table(TABLE, DIM, "zeros", "sgd")
    client.pull(TABLE, np.arange(100))
    state = {"n": 0, "rss0": 0}

    @settings(max_examples=DATA_CASES, **FUZZ_SETTINGS)
    @given(data=cases, hello_first=st.booleans())
    def run(data: bytes, hello_first: bool) -> None:
        _exchange(port, data, hello_first)
        state["n"] += 1
        if state["n"] == 1000:
            state["rss0"] = _rss_kib(pid)  # after warm-up
        if state["n"] % 500 == 0:
            assert cluster.processes[0].poll() is None, "the shard died"
            rows = client.pull(TABLE, np.arange(100), training=False)  # a valid client
            assert rows.shape == (100, DIM) and np.isfinite(rows).all()

    run()
    assert state["n"] >= DATA_CASES
    growth = _rss_kib(pid) - state["rss0"]
    print(f"{state['n']} data-plane cases; shard RSS growth after warm-up {growth} KiB")
    assert growth < 64 * 1024, f"shard memory grew {growth} KiB"
    assert cluster.processes[0].poll() is None
    client.close()


def test_control_plane_survives_random_requests(
    start_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    from tf_dlt.proto import dlt_pb2

    cluster = start_cluster(1)
    client = cluster.client()
    client.create_table(TABLE, DIM)
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.admin_ports[0]}")
    methods = [m.name for m in dlt_pb2.DESCRIPTOR.services_by_name["ShardAdmin"].methods]
    calls = {m: channel.unary_unary(f"/tf_dlt.v1.ShardAdmin/{m}") for m in methods}
    # Save and Load write and read where the request says: fuzz them only
    # with paths inside this test's directory.
    safe_path = dlt_pb2.SaveRequest(path=str(tmp_path / "fuzz-ck")).SerializeToString()
    codes: dict[str, int] = {}

    floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
    names = st.text(max_size=300)
    config = st.builds(
        lambda name, dim, seed, ikind, ivals, okind, ovals: dlt_pb2.TableConfig(
            name=name, dim=dim, seed=seed,
            initializer=dlt_pb2.InitializerConfig(kind=ikind, value=ivals[0], minval=ivals[1],
                                                  maxval=ivals[2], mean=ivals[3], stddev=ivals[4]),
            optimizer=dlt_pb2.OptimizerConfig(
                kind=okind, initial_accumulator=ovals[0], epsilon=ovals[1], beta1=ovals[2],
                beta2=ovals[3], learning_rate_power=ovals[4], l1=ovals[5], l2=ovals[6]),
        ),
        st.one_of(names, st.just(TABLE)), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1),
        st.sampled_from(["zeros", "constant", "uniform", "normal", "truncated_normal", "", "x"]),
        st.lists(floats, min_size=5, max_size=5),
        st.sampled_from(["sgd", "adagrad", "adam", "ftrl", "", "rmsprop"]),
        st.lists(floats, min_size=7, max_size=7),
    )  # fmt: skip
    structured = st.one_of(
        st.tuples(st.just("CreateTable"), config.map(
            lambda c: dlt_pb2.CreateTableRequest(config=c))),
        st.tuples(st.just("DropTable"), names.map(lambda n: dlt_pb2.DropTableRequest(name=n))),
        st.tuples(st.just("Save"), names.map(
            lambda i: dlt_pb2.SaveRequest(path=str(tmp_path / "fuzz-ck"), save_id=i))),
        st.tuples(st.just("Load"), st.builds(
            lambda phase, load_id, exists: dlt_pb2.LoadRequest(
                path=str(tmp_path / ("fuzz-ck" if exists else "none")), phase=phase,
                load_id=load_id),
            st.integers(0, 3), names, st.booleans())),
    ).map(lambda pair: (pair[0], pair[1].SerializeToString(), True))  # fmt: skip
    raw = st.tuples(st.sampled_from(methods), st.binary(max_size=120), st.just(False))

    @settings(max_examples=CONTROL_CASES, **FUZZ_SETTINGS)
    @given(case=st.one_of(raw, structured))
    def run(case: tuple[str, bytes, bool]) -> None:
        method, payload, well_formed = case
        if method in ("Save", "Load") and not payload.startswith(b"\n"):
            payload = safe_path + payload[:8]
        try:
            calls[method](payload, timeout=30)
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method} hung"
            codes[e.code().name] = codes.get(e.code().name, 0) + 1
            assert e.code() != grpc.StatusCode.UNKNOWN, f"{method}: {e.details()}"
            # Only bytes that are no request may fail to decode (INTERNAL).
            bad = grpc.StatusCode.INTERNAL
            assert not (well_formed and e.code() == bad), f"{method}: {e.details()}"

    run()
    print(f"control-plane outcomes: {codes}")
    assert cluster.processes[0].poll() is None
    # A valid client still works (the fuzz may have dropped and re-created
    # the table, so create it again if needed).
    if TABLE not in client.list_tables():
        client.create_table(TABLE, DIM)
    assert client.pull(TABLE, np.arange(4), training=False).shape == (4, DIM)
    channel.close()
    client.close()


SANITIZED_CASES = 2_000


@pytest.fixture
def sanitized_shard() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """tests/cpp/fuzz_shard built with AddressSanitizer and
    UndefinedBehaviorSanitizer, serving table "fuzz" (dim 4) on loopback."""
    binary = build("fuzz_shard", "sanitized")
    args = ["hello_timeout_ms=500", "io_timeout_ms=1000", "max_unauthenticated=64"]
    proc = subprocess.Popen(
        [str(binary), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **SANITIZER_ENV},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read() if proc.stderr else line
        yield proc, int(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_sanitized_data_plane_under_fuzz_big_frames_idlers_and_slow_writers(
    sanitized_shard: tuple[subprocess.Popen[str], int],
) -> None:
    """The data plane built with ASan and UBSan: fuzz cases, frames up to the
    maximum size, hundreds of idle connections and slow writers, while a
    valid client keeps being served; then a clean stop with no report."""
    proc, port = sanitized_shard
    address = f"127.0.0.1:{port}"
    valid = _native.Client([address], connect_timeout_ms=5000, request_timeout_ms=30000)

    def still_serving() -> None:
        rows = valid.pull(TABLE, DIM, np.arange(100, dtype=np.int64), 2)
        assert rows.shape == (100, DIM) and np.isfinite(rows).all()

    count = {"n": 0}

    @settings(max_examples=SANITIZED_CASES, **FUZZ_SETTINGS)
    @given(data=cases, hello_first=st.booleans())
    def run(data: bytes, hello_first: bool) -> None:
        _exchange(port, data, hello_first)
        count["n"] += 1
        if count["n"] % 500 == 0:
            still_serving()

    run()
    # Frames of the maximum size: garbage, and a valid 8 MiB push.
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(frames.hello())
        frames.read_frame(sock)
        size = 64 << 20
        sock.sendall(frames.HEADER.pack(frames.MAGIC, 1, frames.PULL, 0, 5, size, 0))
        sock.sendall(b"\xff" * size)
        opcode, _, rid, payload = frames.read_frame(sock)
        assert (opcode, rid) == (frames.ERROR, 5)
        n = (8 << 20) // (8 + 4 * DIM)
        ids = list(range(n))
        sock.sendall(frames.push(6, TABLE, DIM, ids, np.full((n, DIM), 1e-3, np.float32), 0.1))
        assert frames.read_frame(sock)[:3] == (frames.PUSH, frames.RESPONSE, 6)
    # Idle connections past the unauthenticated cap, and slow writers.
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    frame = frames.pull(7, TABLE, DIM, list(range(64)))
    for k, sock in enumerate(slow):
        if k % 2:  # authenticated, then half a frame a byte at a time
            sock.sendall(frames.hello())
            frames.read_frame(sock)
        for byte in frame[:12]:
            sock.sendall(bytes([byte]))
    still_serving()
    for sock in slow:
        assert frames.closed_by_peer(sock, timeout=15)  # io or hello timeout
    for sock in idle + slow:
        sock.close()
    still_serving()

    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    for report in ("AddressSanitizer", "LeakSanitizer", "runtime error", "UndefinedBehavior"):
        assert report not in stderr, stderr
    print(f"\n{count['n']} fuzz cases, max-size frames, 300 idlers, 20 slow writers under "
          f"ASan+UBSan; {stderr.strip().splitlines()[-1]}")  # fmt: skip
