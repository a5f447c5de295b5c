"""Request ids: the one limit every service checks them against. The gateway's own ids behind a
tenant's (`tenant/client-id`) obey it too, so an id accepted at the edge is accepted everywhere."""

from __future__ import annotations

from specdec.errors import InvalidArgument

MAX_REQUEST_ID_CHARS = 128
TENANT_SEPARATOR = "/"  # with API keys, the id behind the gateway is tenant + "/" + the client's id


def tenant_of(request_id: str) -> str:
    """The tenant part of an id behind the gateway ("" for an id without one). With API keys the
    gateway writes every id as tenant/client-id (tenants have no "/"), so a client cannot name
    another tenant's prefix; without keys there is one trust domain and a "/" in a client's own id
    only narrows what the id shares (the primary's prefix cache)."""
    tenant, sep, _ = request_id.partition(TENANT_SEPARATOR)
    return tenant if sep else ""


def check_request_id(request_id: str, field: str = "request_id") -> str:
    """request_id if it is 1..MAX_REQUEST_ID_CHARS printable characters, else InvalidArgument(field)."""
    if not request_id:
        raise InvalidArgument(field, "must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise InvalidArgument(field, f"must be at most {MAX_REQUEST_ID_CHARS} printable characters")
    return request_id
