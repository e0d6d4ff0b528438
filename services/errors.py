"""Domain errors. Plain modules raise these; the gRPC interceptor turns each into its
status code with the error's message, so servicers never pick status codes by hand."""

from __future__ import annotations

import grpc


class IServeError(Exception):
    """Base class; ``code`` is the gRPC status the client receives."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(IServeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(IServeError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(IServeError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(IServeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(IServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(IServeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(IServeError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(IServeError):
    code = grpc.StatusCode.UNIMPLEMENTED


def require(condition: bool, message: str) -> None:
    """Raise InvalidArgument(message) unless ``condition`` holds."""
    if not condition:
        raise InvalidArgument(message)
