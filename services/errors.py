"""Domain errors. Plain modules raise these; the gRPC interceptor turns each into its
status code with the error's message, so servicers never pick status codes by hand."""

from __future__ import annotations

import grpc

# Trailing metadata key of an error's machine-readable reason (IServeError.reason).
REASON_KEY = "iserve-reason"


class IServeError(Exception):
    """Base class; ``code`` is the gRPC status the client receives. ``reason``, when
    set, travels beside it as trailing metadata (REASON_KEY), so that a client can tell
    one refusal from another of the same status without reading the message (the
    gateway turns it into OpenAI's error code)."""

    code = grpc.StatusCode.INTERNAL
    reason = ""

    def told_to_tenants(self) -> str:
        """What a caller that is no administrator is told: the message, unless it names
        what only the operator should see (an internal address)."""
        return str(self)


class InvalidArgument(IServeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ContextLengthExceeded(InvalidArgument):
    """A prompt (with its output) longer than the deployment takes."""

    reason = "context_length_exceeded"


# The reason of a checkpoint a node cannot start workers from: every start from it would
# be refused the same way until someone puts it right, so the deployer does not retry.
CHECKPOINT_UNUSABLE = "checkpoint_unusable"


class CheckpointUnusable(InvalidArgument):
    """A checkpoint path that names no readable checkpoint under the models root."""

    reason = CHECKPOINT_UNUSABLE


class NotFound(IServeError):
    code = grpc.StatusCode.NOT_FOUND


class ModelNotFound(NotFound):
    """A model with no deployment (or none the caller may see)."""

    reason = "model_not_found"


class AlreadyExists(IServeError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(IServeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotServing(FailedPrecondition):
    """A deployment that exists and serves no request (FAILED, being removed, no replica
    serving): the server's state, not the request's fault (the gateway's 503, not 400)."""

    reason = "deployment_not_serving"


class WorkerKilled(FailedPrecondition):
    """A worker killed from outside (SIGKILL, SIGTERM: by hand, or the kernel's
    out-of-memory killer) before it was ready: a start again may succeed."""

    reason = "worker_killed"


class CheckpointChanged(FailedPrecondition):
    """A checkpoint rewritten since its model was registered (another shape)."""

    reason = CHECKPOINT_UNUSABLE


class ResourceExhausted(IServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(IServeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DeadlineUnreachable(InvalidArgument):
    """A deadline the predicted decode of the request's own max_tokens alone passes: no
    queue could meet it, so it is the request to change (a 400, which clients do not
    retry; the OpenAI SDKs retried a 504 twice, to the same refusal)."""

    reason = "deadline_unreachable"


class Unavailable(IServeError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(IServeError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Unauthenticated(IServeError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(IServeError):
    code = grpc.StatusCode.PERMISSION_DENIED


# How much of a client's value an error message repeats: an id of a megabyte must not come
# back as a megabyte of status details.
_SHOWN_CHARS = 80


def shown(value: object) -> str:
    """``repr(value)`` cut to a readable length, for messages about what a client sent."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[: _SHOWN_CHARS - 3]}...{size}"


def require(condition: bool, message: str) -> None:
    """Raise InvalidArgument(message) unless ``condition`` holds."""
    if not condition:
        raise InvalidArgument(message)


class RemoteError(IServeError):
    """An error another iserve service returned, passed on with its status code."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = ""):
        super().__init__(message)
        self.code = code
        self.reason = reason


def rpc_reason(exc: grpc.RpcError) -> str:
    """The reason (REASON_KEY) a service sent beside an error's status, or ""."""
    metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == REASON_KEY and isinstance(value, str):
            return value
    return ""


def unreached(details: str) -> bool:
    """Whether an UNAVAILABLE is gRPC's own "no connection" (the service is not there),
    not a service's answer (a deployment starting, Redis down, a server draining, or a
    peer of the service's that it could not reach, whose connection error it quotes
    after its own words)."""
    return details.startswith(("failed to connect", "Connection refused"))


def cut_off_midway(details: str) -> bool:
    """Whether an UNAVAILABLE is gRPC's own word for a call its server ended mid-way
    (the service stopped, was killed or restarted while it answered)."""
    return details.startswith(
        ("Stream removed", "Socket closed", "Cancelling all calls", "Connection reset")
    )


def from_rpc_error(exc: grpc.RpcError, what: str) -> IServeError:
    """Wrap a failed call to another service, keeping its status and reason and naming
    ``what`` failed."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"{what}: unreachable ({details})")
    return RemoteError(code, f"{what}: {details}", rpc_reason(exc))
