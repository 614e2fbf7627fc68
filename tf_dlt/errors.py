"""Errors raised by tf_dlt's Python API, one class per status code.

The codes are the canonical gRPC / absl codes, the same numbers the wire
protocol and the control plane carry. Each class also derives from the closest
builtin exception, so ``except ValueError`` catches a bad argument.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator


class DltError(Exception):
    """Base class: a failed tf_dlt operation with a status `code`."""

    code: int = 2
    code_name: str = "UNKNOWN"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(DltError, ValueError):
    code, code_name = 3, "INVALID_ARGUMENT"


class DeadlineExceededError(DltError, TimeoutError):
    code, code_name = 4, "DEADLINE_EXCEEDED"


class NotFoundError(DltError, LookupError):
    code, code_name = 5, "NOT_FOUND"


class AlreadyExistsError(DltError):
    code, code_name = 6, "ALREADY_EXISTS"


class PermissionDeniedError(DltError, PermissionError):
    code, code_name = 7, "PERMISSION_DENIED"


class ResourceExhaustedError(DltError):
    code, code_name = 8, "RESOURCE_EXHAUSTED"


class FailedPreconditionError(DltError):
    code, code_name = 9, "FAILED_PRECONDITION"


class AbortedError(DltError):
    """Refused before anything was applied (a re-shard's switch): send again."""

    code, code_name = 10, "ABORTED"


class InternalError(DltError):
    code, code_name = 13, "INTERNAL"


class UnavailableError(DltError, ConnectionError):
    code, code_name = 14, "UNAVAILABLE"


class ControlPlaneUnreachedError(UnavailableError):
    """A shard's data plane greeted the client and its control plane did
    not: TLS on one side only, most likely (the message says what to check).
    Its standbys would not greet this client either."""


class FailedOverError(UnavailableError):
    """A save given up because its shard failed over while it ran (the
    primary writing it went silent, or failed as it ran, and a standby took
    over): nothing of it committed, and the old copy may still write its
    part of that save (woken, or past its --stop-grace as it exits), so the
    save is not sent again under the same id. Save
    again (a new save id): it goes to the copy serving. `Client.save`
    without a `save_id`, and `tf_dlt.save`, do so by themselves (up to
    `tf_dlt.client.SAVE_TRIES` tries in all)."""


class DataLossError(DltError):
    """Rows a shard held are gone: every process of its replica set
    restarted. The client goes on with the restarted shard; reload a
    checkpoint (resilient_fit does) for tables that agree again."""

    code, code_name = 15, "DATA_LOSS"


class UnauthenticatedError(DltError, PermissionError):
    code, code_name = 16, "UNAUTHENTICATED"


_BY_CODE: dict[int, type[DltError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}


def error_for_code(code: int, message: str) -> DltError:
    """Returns the exception for a status code (DltError for unknown codes)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        error = DltError(f"status code {code}: {message}")
        error.code = code
        return error
    return cls(message)


_BY_ERRNO: dict[int, type[DltError]] = {
    errno.ENAMETOOLONG: InvalidArgumentError,
    errno.EINVAL: InvalidArgumentError,
    errno.ENOENT: NotFoundError,
    errno.ENOTDIR: NotFoundError,
    errno.EACCES: PermissionDeniedError,
    errno.EPERM: PermissionDeniedError,
    errno.ENOSPC: ResourceExhaustedError,
    errno.EDQUOT: ResourceExhaustedError,
    errno.EFBIG: ResourceExhaustedError,
    errno.ECONNREFUSED: UnavailableError,
    errno.ECONNRESET: UnavailableError,
    errno.ETIMEDOUT: UnavailableError,
    errno.EHOSTUNREACH: UnavailableError,
}


# Exception classes of filesystem libraries (matched by name, so none has to
# be imported) that mean the store could not be reached or did not answer.
_UNREACHABLE = frozenset({
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError", "ClientConnectorError", "ServerTimeoutError",
})  # fmt: skip
_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError"})
# Store libraries' failures of a call that got no answer in time (botocore,
# urllib3, aiohttp, requests), beside TimeoutError and ETIMEDOUT.
_TIMED_OUT = frozenset({
    "ConnectTimeoutError", "ReadTimeoutError", "ServerTimeoutError", "ConnectTimeout",
    "ReadTimeout",
})  # fmt: skip
# Any other failure of an object store's client library (botocore: a read
# whose checksum does not match, say): FAILED_PRECONDITION, naming it.
_STORE_LIBRARY = frozenset({"BotoCoreError", "ClientError"})
# hdfs-native's failures that are not OSErrors come as RuntimeError("Kind(...)"):
# these kinds mean the DataNodes or NameNode could not be reached, or did not
# answer in time (OperationFailed: "Failed to complete file in time", a
# DataNode gone silent mid-write, reached a trainer as a bare RuntimeError);
# the others are HDFS's own failures (FAILED_PRECONDITION).
_HDFS_UNREACHABLE = ("DataTransferError", "RPCError", "OperationFailed")
_HDFS_OTHER = (
    "BlocksNotFound",
    "ChecksumError",
    "FatalRPCError",
    "InternalError",
    "InvalidRPCResponse",
)
# Most characters of a filesystem library's own message kept in an error.
MAX_REASON_CHARS = 400


def error_for_storage(error: BaseException, what: str) -> DltError:
    """The DltError for a failed file or object-store operation: `what` and
    the first line of the library's reason (a Java stack trace or a
    server's long reply after it is left out; at most MAX_REASON_CHARS),
    with the class the failure calls for: NOT_FOUND, PERMISSION_DENIED,
    ALREADY_EXISTS, RESOURCE_EXHAUSTED (a full disk or quota), UNAVAILABLE
    (the store cannot be reached or timed out), UNAUTHENTICATED (no
    credentials), FAILED_PRECONDITION for the rest (a link where a file was
    expected, I/O errors)."""
    if isinstance(error, DltError):
        return error
    names = _class_names(error)
    code = getattr(error, "errno", None) if isinstance(error, OSError) else None
    if code is None:  # Rust libraries (hdfs-native) say "... (os error 111)"
        found = re.search(r"\(os error (\d+)\)", str(error))
        code = int(found.group(1)) if found else None
    cls: type[DltError]
    if isinstance(error, FileNotFoundError):
        cls = NotFoundError
    elif isinstance(error, PermissionError):
        cls = PermissionDeniedError
    elif isinstance(error, FileExistsError):
        cls = AlreadyExistsError
    elif isinstance(code, int) and code in _BY_ERRNO:
        cls = _BY_ERRNO[code]
    elif (
        isinstance(error, (ConnectionError, TimeoutError))
        or names & _UNREACHABLE
        or _hdfs_kind(error) in _HDFS_UNREACHABLE
    ):
        cls = UnavailableError
    elif names & _NO_CREDENTIALS:
        cls = UnauthenticatedError
    else:
        cls = FailedPreconditionError
    if isinstance(error, OSError) and error.errno == errno.ELOOP:
        reason = "a link, not followed"
    else:
        text = (error.strerror if isinstance(error, OSError) and error.strerror else "") or str(
            error
        )
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        reason = lines[0] if lines else type(error).__name__
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[: MAX_REASON_CHARS - 3] + "..."
        if isinstance(code, int) and os.strerror(code) not in reason:
            # A library's first line may not say it (HDF5: "Can't write data").
            reason = f"{reason} [{os.strerror(code)}]"
        if type(error).__module__ != "builtins":
            reason = f"{type(error).__name__}: {reason}"
        # The files an OSError names, where its reason is its strerror alone
        # ("File exists" left the caller to guess which).
        files = _file_names(error) if isinstance(error, OSError) and error.strerror else []
        if files:
            reason = f"{reason}: {' -> '.join(files)}"  # (a rename's: from, to)
    return cls(f"{what}: {reason}")


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a call to a store that got no answer in time, as
    opposed to one refused or failed at once."""
    return (
        isinstance(error, TimeoutError)
        or (isinstance(error, OSError) and error.errno == errno.ETIMEDOUT)
        or bool(_class_names(error) & _TIMED_OUT)
    )


def _file_names(error: BaseException) -> list[str]:
    if not isinstance(error, OSError):
        return []
    names = [error.filename, error.filename2]
    return [os.fsdecode(n) if isinstance(n, bytes) else str(n) for n in names if n is not None]


def _class_names(error: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(error).__mro__}


def _hdfs_kind(error: BaseException) -> str:
    """The kind of an hdfs-native failure raised as RuntimeError ("" if none)."""
    if type(error) is not RuntimeError:
        return ""
    found = re.match(r"(\w+)\(", str(error))
    return found.group(1) if found else ""


def is_storage_error(error: BaseException) -> bool:
    """Whether `error` is a filesystem library's failure (an OSError, an
    object-store client's error, or an hdfs-native failure of the DataNodes
    or NameNode). Before, a botocore checksum error or an HDFS DataNode
    failure reached the caller as itself (or InternalError)."""
    library = _class_names(error) & (_UNREACHABLE | _NO_CREDENTIALS | _STORE_LIBRARY)
    return (
        isinstance(error, OSError)
        or bool(library)
        or _hdfs_kind(error) in _HDFS_UNREACHABLE + _HDFS_OTHER
    )


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Raises a filesystem library's failure inside the block as the DltError
    `error_for_storage` gives (tf_dlt's own errors pass as they are)."""
    try:
        yield
    except DltError:
        raise
    except Exception as e:
        if not is_storage_error(e):
            raise
        raise error_for_storage(e, what) from e
