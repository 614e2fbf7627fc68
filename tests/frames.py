"""DLT wire protocol v1 frames built with `struct`, straight from
docs/wire-protocol.md: the test-side oracle for the golden vectors and the raw
socket tests (the library's only implementation is the C++ one)."""

from __future__ import annotations

import socket
import struct

import numpy as np

HEADER = struct.Struct("<4sBBHQII")
MAGIC = b"DLTP"
HELLO, PULL, PUSH, ASSIGN, ERROR = 1, 2, 3, 4, 15
RESPONSE = 1


def frame(opcode: int, request_id: int, payload: bytes, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, 1, opcode, flags, request_id, len(payload), 0) + payload


def _name(table: str) -> bytes:
    raw = table.encode()
    return raw + b"\0" * (-len(raw) % 8)


def hello(request_id: int = 1, token: str = "", version: int = 1) -> bytes:
    t = token.encode()
    return frame(HELLO, request_id, struct.pack("<II", version, len(t)) + t)


def pull(request_id: int, table: str, dim: int, ids: list[int], mode: int = 0) -> bytes:
    fixed = struct.pack("<IIHBBI", dim, len(ids), len(table.encode()), mode, 0, 0)
    return frame(PULL, request_id, fixed + _name(table) + struct.pack(f"<{len(ids)}q", *ids))


def push(
    request_id: int,
    table: str,
    dim: int,
    ids: list[int],
    grads: np.ndarray,
    lr: float,
    push_id: tuple[int, int] | None = None,
    ancestors: list[tuple[int, int]] | None = None,
    flags: int | None = None,
) -> bytes:
    """A Push; with `push_id` identified (flags bit 0), with `ancestors` a
    part of the pushes they name (bit 1; their count, a zero word, then
    the ids). `flags` overrides the flags byte (for malformed frames)."""
    if flags is None:
        flags = (1 if push_id is not None else 0) | (2 if ancestors else 0)
    fixed = struct.pack("<IIHBBf", dim, len(ids), len(table.encode()), flags, 0, lr)
    ident = struct.pack("<QQ", *push_id) if push_id is not None else b""
    if ancestors is not None:
        ident += struct.pack("<II", len(ancestors), 0)
        ident += b"".join(struct.pack("<QQ", *a) for a in ancestors)
    body = struct.pack(f"<{len(ids)}q", *ids) + np.asarray(grads, "<f4").tobytes()
    return frame(PUSH, request_id, fixed + _name(table) + ident + body)


def assign(request_id: int, table: str, dim: int, ids: list[int], values: np.ndarray) -> bytes:
    fixed = struct.pack("<IIHBBI", dim, len(ids), len(table.encode()), 0, 0, 0)
    body = struct.pack(f"<{len(ids)}q", *ids) + np.asarray(values, "<f4").tobytes()
    return frame(ASSIGN, request_id, fixed + _name(table) + body)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(opcode, flags, request_id, payload) of the next frame."""
    magic, version, opcode, flags, request_id, length, reserved = HEADER.unpack(
        recv_exact(sock, HEADER.size)
    )
    assert (magic, version, reserved) == (MAGIC, 1, 0)
    return opcode, flags, request_id, recv_exact(sock, length)


def error_of(payload: bytes) -> tuple[int, str]:
    code, length = struct.unpack_from("<II", payload)
    return code, payload[8 : 8 + length].decode()


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
