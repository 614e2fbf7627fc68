"""Errors raised by tf_dlt's Python API, one class per status code.

The codes are the canonical gRPC / absl codes, the same numbers the wire
protocol and the control plane carry. Each class also derives from the closest
builtin exception, so ``except ValueError`` catches a bad argument.
"""

from __future__ import annotations

import errno


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


class InternalError(DltError):
    code, code_name = 13, "INTERNAL"


class UnavailableError(DltError, ConnectionError):
    code, code_name = 14, "UNAVAILABLE"


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
        InternalError,
        UnavailableError,
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
}


def error_for_errno(error: OSError, what: str) -> DltError:
    """The DltError for a failed file operation: `what` and the system's
    reason, with the class its errno calls for (FailedPreconditionError for
    the rest: a link where a file was expected, I/O errors)."""
    reason = {errno.ELOOP: "a link, not followed"}.get(error.errno or 0, error.strerror)
    cls = _BY_ERRNO.get(error.errno or 0, FailedPreconditionError)
    return cls(f"{what}: {reason or error}")
