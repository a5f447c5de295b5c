"""ASGI middleware: the client's X-Request-Id tags every log line of its request, the access log's
included (uvicorn logs it from the app's own send, inside this context), and goes on to the
gateway in the call's metadata (specdec.tracing). A malformed id binds nothing here; the route
refuses it with a 400 naming the header."""

from __future__ import annotations

import structlog
from starlette.types import ASGIApp, Receive, Scope, Send

from specdec.errors import InvalidArgument
from specdec.tracing import LOG_FIELD, check_client_request_id, client_request_id_bound

REQUEST_ID_HEADER = b"x-request-id"


def client_request_id_header(scope: Scope) -> str | None:
    """The X-Request-Id header's value (None without one), not checked."""
    for key, value in scope.get("headers", ()):
        if key.lower() == REQUEST_ID_HEADER:
            return value.decode("latin-1")
    return None


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        value = client_request_id_header(scope) if scope["type"] == "http" else None
        try:
            client_request_id = "" if value is None else check_client_request_id(value)
        except InvalidArgument:
            client_request_id = ""
        if not client_request_id:
            await self.app(scope, receive, send)
            return
        with (
            client_request_id_bound(client_request_id),
            structlog.contextvars.bound_contextvars(**{LOG_FIELD: client_request_id}),
        ):
            await self.app(scope, receive, send)
