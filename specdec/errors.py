"""Domain exceptions shared by every service.

Domain modules raise these (they never import grpc); the one interceptor in
specdec/service.py maps each to its gRPC status code. Every error names the
field (or resource) it is about, so a client can tell what to fix:

    raise InvalidArgument("max_new_tokens", "must be in [1, 8192], got 100000")
    # -> INVALID_ARGUMENT "max_new_tokens: must be in [1, 8192], got 100000"
"""

from __future__ import annotations


class SpecdecError(Exception):
    """Base of the domain errors: `field` names what the error is about."""

    # Name of the grpc.StatusCode member this error maps to (a string, so this
    # module needs no grpc import).
    status_name = "UNKNOWN"

    def __init__(self, field: str, message: str, *, dependency: str | None = None) -> None:
        if not field:
            raise ValueError("field must name what the error is about")
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        # The internal part that failed (a service, the state store), None for the caller's own
        # errors: a client is told of a dependency's failure without its name or details.
        self.dependency = dependency


class InvalidArgument(SpecdecError):
    """A request field is malformed or out of range (fix the request)."""

    status_name = "INVALID_ARGUMENT"


class NotFound(SpecdecError):
    """The named resource (usually a request_id) does not exist."""

    status_name = "NOT_FOUND"


class AlreadyExists(SpecdecError):
    """The named resource exists already (e.g. a reused request_id)."""

    status_name = "ALREADY_EXISTS"


class ResourceExhausted(SpecdecError):
    """A capacity limit is reached (KV memory, queue length); retry later."""

    status_name = "RESOURCE_EXHAUSTED"


class FailedPrecondition(SpecdecError):
    """The system is not in the state the call needs (e.g. Verify before Prefill,
    a stale memory handle from a restarted primary)."""

    status_name = "FAILED_PRECONDITION"


class Unavailable(SpecdecError):
    """A dependency (another service, the state store) cannot be reached."""

    status_name = "UNAVAILABLE"


class StateLost(Unavailable):
    """The state store no longer holds a live request's record (lost, not ended: a Redis restarted
    without persistence) and refused it back. A client is told its request's stored state was lost."""


class DeadlineExceeded(SpecdecError):
    """The request's deadline passed before it completed."""

    status_name = "DEADLINE_EXCEEDED"


class Cancelled(SpecdecError):
    """The request was cancelled."""

    status_name = "CANCELLED"


class Unimplemented(SpecdecError):
    """The request asks for a feature this deployment does not serve."""

    status_name = "UNIMPLEMENTED"


class Internal(SpecdecError):
    """Something failed inside the service that the caller cannot fix (the details are in the log)."""

    status_name = "INTERNAL"


class Unauthenticated(SpecdecError):
    """The caller did not present valid credentials (an API key, the service token)."""

    status_name = "UNAUTHENTICATED"
