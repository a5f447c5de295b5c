"""Request ids: the one limit every service checks them against. The gateway's own ids behind a
tenant's (`tenant/client-id`) obey it too, so an id accepted at the edge is accepted everywhere."""

from __future__ import annotations

from specdec.errors import InvalidArgument

MAX_REQUEST_ID_CHARS = 128


def check_request_id(request_id: str, field: str = "request_id") -> str:
    """request_id if it is 1..MAX_REQUEST_ID_CHARS printable characters, else InvalidArgument(field)."""
    if not request_id:
        raise InvalidArgument(field, "must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidArgument(field, f"must be at most {MAX_REQUEST_ID_CHARS} printable characters")
    return request_id
