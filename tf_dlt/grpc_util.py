"""Mapping between tf_dlt errors and gRPC status codes, both ways."""

from __future__ import annotations

import grpc

from tf_dlt import errors

_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}

AUTH_METADATA_KEY = "authorization"


# Most characters of an error message a server sends: gRPC carries it in
# metadata, and past its limit (8 KiB by default) the caller would get
# "Stream removed" (RESOURCE_EXHAUSTED) instead of the error.
MAX_DETAILS_CHARS = 2000


def status_code_for(error: errors.DltError) -> grpc.StatusCode:
    return _STATUS_BY_CODE.get(error.code, grpc.StatusCode.UNKNOWN)


def bounded_details(message: str) -> str:
    """`message`, cut to MAX_DETAILS_CHARS (its start and end kept, saying
    how much was left out), so an error keeps its code across gRPC."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    keep = MAX_DETAILS_CHARS // 2 - 40
    cut = len(message) - 2 * keep
    return f"{message[:keep]} ... ({cut} characters left out) ... {message[-keep:]}"


def error_from_rpc(error: grpc.RpcError, context: str) -> errors.DltError:
    """Turns a failed call into the tf_dlt error of the same code."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return errors.error_for_code(code.value[0], f"{context}: {details}")


def admin_address(data_address: str, admin_port: int) -> str:
    """A shard's control-plane address: its data-plane address's host and
    the admin port its Hello names."""
    return f"{data_address.rsplit(':', 1)[0]}:{admin_port}"


# Call metadata naming the lineage of the copy of a shard a client met (16
# hex digits): a shard's admin plane refuses writes from a client that met
# another lineage (docs/replication.md).
LINEAGE_METADATA_KEY = "dlt-lineage"
# Call metadata naming the layout epoch a client's control plane addresses
# (decimal): a shard serving a newer layout (a re-shard since) refuses its
# writes ABORTED, saying LAYOUT_MOVED; the client learns the layout and sends
# them again to its shards.
LAYOUT_METADATA_KEY = "dlt-layout"
LAYOUT_MOVED = "a re-shard moved the layout"
# What a shard's admin port says to a call it refuses while it stops (SIGTERM):
# a client moves on to the copy that takes over, as from one that died.
STOPPING = "the shard is stopping"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token`, or none when it is empty."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else ()


def serving(address: str, timeout: float = 2.0) -> bool:
    """True when the gRPC health service at `address` answers SERVING for
    the whole server (service ""); TLS per the TF_DLT_TLS_* variables."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tf_dlt import tls

    with tls.channel(address, tls.TlsConfig.from_env()) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
