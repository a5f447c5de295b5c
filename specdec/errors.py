"""Domain exceptions shared by every service.

Domain modules raise these (they never import grpc); the error interceptors
(specdec/service/call_guard.py) map each to its gRPC status code. Every error names the
field (or resource) it is about, so a client can tell what to fix:

    raise InvalidArgument("max_new_tokens", "must be in [1, 8192], got 100000")
    # -> INVALID_ARGUMENT "max_new_tokens: must be in [1, 8192], got 100000"
"""

from __future__ import annotations

# An error message quotes at most this many characters of a caller's value: quoted whole, a
# multi-MiB string gives a multi-MiB HTTP error body, and over gRPC a status message past the
# client's metadata limit (8 KiB by default), which the client refuses and reports as an unrelated
# INTERNAL or RESOURCE_EXHAUSTED in place of the INVALID_ARGUMENT naming the field.
MAX_QUOTED_CHARS = 100


def shortened(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """`text`, or when longer than `limit` its first `limit` characters, an ellipsis and its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def quoted(value: object) -> str:
    """repr(value) as an error message quotes a caller's value, bounded: a longer string is its first
    MAX_QUOTED_CHARS characters quoted, an ellipsis and its length ("'xxx'... (4194304 characters)")."""
    if isinstance(value, str) and len(value) > MAX_QUOTED_CHARS:
        return f"{value[:MAX_QUOTED_CHARS]!r}... ({len(value)} characters)"
    return shortened(repr(value))


class SpecdecError(Exception):
    """Base of the domain errors: `field` names what the error is about. A subclass names the
    grpc.StatusCode member it maps to in its class line (a string, so this module needs no grpc
    import): `class NotFound(SpecdecError, status_name="NOT_FOUND")`; a subclass of one inherits it."""

    status_name = "UNKNOWN"

    def __init_subclass__(cls, status_name: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if status_name is not None:
            cls.status_name = status_name

    def __init__(self, field: str, message: str, *, dependency: str | None = None) -> None:
        if not field:
            raise ValueError("field must name what the error is about")
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        # The internal part that failed (a service, the state store), None for the caller's own
        # errors: a client is told of a dependency's failure without its name or details.
        self.dependency = dependency


class InvalidArgument(SpecdecError, status_name="INVALID_ARGUMENT"):
    """A request field is malformed or out of range (fix the request)."""


class NotFound(SpecdecError, status_name="NOT_FOUND"):
    """The named resource (usually a request_id) does not exist."""


class AlreadyExists(SpecdecError, status_name="ALREADY_EXISTS"):
    """The named resource exists already (e.g. a reused request_id)."""


# The trailing metadata of a RESOURCE_EXHAUSTED that may be retried: the milliseconds after which a retry
# may find room (the gateway's admission queue, a primary's bound on Prefills under way).
RETRY_AFTER_KEY = "retry-after-ms"


class ResourceExhausted(SpecdecError, status_name="RESOURCE_EXHAUSTED"):
    """A capacity limit is reached (KV memory, queue length); retry later. `retry_after_ms`: when a
    retry may find room, where the refusal said (a retry-after-ms hint); None: no hint."""

    retry_after_ms: int | None = None


class FailedPrecondition(SpecdecError, status_name="FAILED_PRECONDITION"):
    """The system is not in the state the call needs (e.g. Verify before Prefill,
    a stale memory handle from a restarted primary)."""


class Unavailable(SpecdecError, status_name="UNAVAILABLE"):
    """A dependency (another service, the state store) cannot be reached."""


class StateLost(Unavailable):
    """The state store no longer holds a live request's record (lost, not ended: a Redis restarted
    without persistence) and refused it back. A client is told its request's stored state was lost."""


class DeadlineExceeded(SpecdecError, status_name="DEADLINE_EXCEEDED"):
    """The request's deadline passed before it completed."""


class Cancelled(SpecdecError, status_name="CANCELLED"):
    """The request was cancelled."""


class Unimplemented(SpecdecError, status_name="UNIMPLEMENTED"):
    """The request asks for a feature this deployment does not serve."""


class Internal(SpecdecError, status_name="INTERNAL"):
    """Something failed inside the service that the caller cannot fix (the details are in the log)."""


class Unauthenticated(SpecdecError, status_name="UNAUTHENTICATED"):
    """The caller did not present valid credentials (an API key, the service token)."""
