"""Wire protocol v1: the golden frames (also checked by the C++ suite against
its encoders) equal frames built from the spec, and a real server answers
hand-built frames, pipelined, matched by request id."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

import frames
from conftest import Cluster

GOLDEN = Path(__file__).parent / "data" / "frames_golden.txt"


def _golden() -> dict[str, bytes]:
    rows = [line.split() for line in GOLDEN.read_text().splitlines() if line and line[0] != "#"]
    return {name: bytes.fromhex(hexed) for name, hexed in rows}


def test_golden_frames_follow_the_spec() -> None:
    g = _golden()
    assert g["hello_request"] == frames.hello(1, "secret")
    assert g["hello_reply"] == frames.frame(
        frames.HELLO, 1, struct.pack("<6I", 1, 1, 3, 4096, 7001, 64 << 20), frames.RESPONSE
    )
    assert g["pull_request"] == frames.pull(2, "emb", 4, [1, -1, 2**63 - 1])
    assert g["pull_request_infer_zeros"] == frames.pull(5, "emb", 4, [-(2**63)], mode=2)
    assert g["pull_reply"] == frames.frame(
        frames.PULL, 2, struct.pack("<II4f", 2, 2, 0.5, -1.0, 2.0, 0.25), frames.RESPONSE
    )
    grads = np.array([[0.5, -0.5], [1.0, 2.0]], np.float32)
    assert g["push_request"] == frames.push(3, "ctr/user1", 2, [7, -7], grads, np.float32(0.01))
    assert g["push_reply"] == frames.frame(
        frames.PUSH, 3, struct.pack("<II", 2, 0), frames.RESPONSE
    )
    msg = b"no table 'x'"
    assert g["error"] == frames.frame(
        frames.ERROR, 4, struct.pack("<II", 5, len(msg)) + msg, frames.RESPONSE
    )
    assert g["assign_request"] == frames.assign(6, "emb", 2, [5], np.array([[1.5, -2.0]]))
    # A primary's rows for its standby (docs/replication.md): table prefix,
    # removed count, slot floats, push clock, ids, removed ids, steps, stamps,
    # values, slots.
    replicate = (
        struct.pack("<IIHBBf", 2, 1, 3, 0, 0, 0.0)
        + b"emb\0\0\0\0\0"
        + struct.pack("<IIQ", 1, 2, 42)
        + struct.pack("<qq", 5, 7)
        + struct.pack("<II", 3, 9)
        + struct.pack("<4f", 1.5, -2.0, 0.25, 0.5)
    )
    assert g["replicate_request"] == frames.frame(6, 7, replicate)
    # A push with an id (flags bit 0): client id and sequence after the name.
    identified = (
        struct.pack("<IIHBBf", 2, 1, 3, 1, 0, 0.5)
        + b"emb\0\0\0\0\0"
        + struct.pack("<QQ", 42, 7)
        + struct.pack("<q", 5)
        + struct.pack("<2f", 1.0, -1.0)
    )
    assert g["push_request_identified"] == frames.frame(3, 8, identified)
    # A table's admission sketch (StandbyTable actions 4 and 5): its
    # slices (name, counters per slice, slices, (bucket, pushes since
    # halving) each, counters), then hashes counted.
    slices = (
        struct.pack("<I", 3) + b"emb" + struct.pack("<II", 2, 2)
        + struct.pack("<4I", 10, 5, 11, 0) + bytes([1, 2, 3, 4])
    )  # fmt: skip
    assert g["standby_sketch_slices"] == frames.frame(
        5, 9, struct.pack("<II", 4, len(slices)) + slices
    )
    counts = struct.pack("<I", 3) + b"emb" + struct.pack("<QQ", 0x0123456789ABCDEF, 42)
    assert g["standby_sketch_counts"] == frames.frame(
        5, 10, struct.pack("<II", 5, len(counts)) + counts
    )
    assert len(g) == 13


def test_a_part_of_a_push_is_applied_once_unless_the_push_it_came_from_was(
    start_cluster: Callable[..., Cluster],
) -> None:
    """A frame a shard refused unapplied (a re-shard's switch) is sent again
    in parts, one per owner, each under an id of its own naming the frame's
    (its ancestors). Before, every part carried the frame's id: after a
    second switch, a part sent to a shard that had applied another part
    was answered "applied" and its rows dropped."""
    cluster = start_cluster(1)
    client = cluster.client()
    client.create_table("t", 2, "zeros", "sgd")
    host, port = cluster.addresses[0].split(":")
    one = np.ones((1, 2), np.float32)

    def push(request_id: int, row: int, **ident: object) -> tuple[int, bytes]:
        sock.sendall(frames.push(request_id, "t", 2, [row], one, 1.0, **ident))  # type: ignore[arg-type]
        opcode, _, got_id, payload = frames.read_frame(sock)
        assert got_id == request_id
        return opcode, payload

    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(frames.hello(1))
        frames.read_frame(sock)
        assert push(2, 1, push_id=(7, 1))[0] == frames.PUSH  # a whole frame
        # Two parts of frame (7, 100), the second split again from (7, 101):
        # neither was applied whole, so both parts are applied.
        assert push(3, 2, push_id=(7, 2), ancestors=[(7, 100)])[0] == frames.PUSH
        assert push(4, 3, push_id=(7, 3), ancestors=[(7, 100), (7, 101)])[0] == frames.PUSH
        # A part sent again (its reply lost) is applied once.
        assert push(5, 2, push_id=(7, 2), ancestors=[(7, 100)])[0] == frames.PUSH
        # A part of a frame applied whole here (in doubt, then refused) is not.
        assert push(6, 1, push_id=(7, 4), ancestors=[(7, 1)])[0] == frames.PUSH
        # Malformed: the part bit without an id, no ancestors, too many.
        for request_id, ident in (
            (7, {"flags": 2, "push_id": None}),
            (8, {"push_id": (7, 5), "ancestors": [], "flags": 3}),
            (9, {"push_id": (7, 6), "ancestors": [(7, k) for k in range(17)]}),
        ):
            opcode, payload = push(request_id, 4, **ident)
            assert opcode == frames.ERROR and frames.error_of(payload)[0] == 3  # INVALID_ARGUMENT
    np.testing.assert_array_equal(client.pull("t", [1, 2, 3, 4]), [[-1, -1]] * 3 + [[0, 0]])
    client.close()


def test_pipelined_requests_are_matched_by_request_id(
    start_cluster: Callable[..., Cluster],
) -> None:
    cluster = start_cluster(1)
    client = cluster.client()
    client.create_table("emb", 4, "uniform", "sgd", seed=9)
    host, port = cluster.addresses[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        requests = [frames.hello(100)] + [frames.pull(200 + k, "emb", 4, [k, -k]) for k in range(5)]
        sock.sendall(b"".join(requests))  # all before reading any reply
        replies = [frames.read_frame(sock) for _ in requests]
    assert [r[2] for r in replies] == [100, 200, 201, 202, 203, 204]
    for k, (opcode, flags, _, payload) in enumerate(replies[1:]):
        assert (opcode, flags) == (frames.PULL, frames.RESPONSE)
        dim, rows = struct.unpack_from("<II", payload)
        got = np.frombuffer(payload[8:], "<f4").reshape(rows, dim)
        np.testing.assert_array_equal(got, client.pull("emb", [k, -k]))
    hello_payload = replies[0][3]
    version, shard, num_shards, buckets, admin_port, max_frame = struct.unpack("<6I", hello_payload)
    assert (version, shard, num_shards, buckets) == (1, 0, 1, 4096)
    assert admin_port == cluster.admin_ports[0]
    assert max_frame == 64 << 20
    client.close()
