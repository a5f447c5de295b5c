"""The Host check of a front without API keys: the defence against DNS rebinding.

A front without --api_keys_file answers whoever reaches it, which on loopback (the default) means
the programs of this machine's user. A web page that user visits is not one of them, but it can
become one: its site's name re-resolves to 127.0.0.1, and the page's requests to "its own" site
(same origin, so the browser lets it read the answers) reach this front, with that name in their
Host header (Ollama's CVE-2024-28224). So without API keys a request is answered only when its
Host names localhost, a loopback address or a host of --allowed_hosts; others get a 403 naming
the Host. A request without a Host header (HTTP/1.0; every browser sends one) passes. With API
keys there is no check: a page cannot send the user's key, and such a front is meant to be
reached by whatever name its clients use.

The Origin header, which browsers send with every request a page makes to another origin (and
with every POST, "null" when they withhold it), gets the same check: a page of another site may
still POST to a loopback front unasked (a CORS "simple" request), and one whose body carries no
Content-Type (fetch with a Blob or ArrayBuffer body) passes the front's 415 on the types a form
could send; without this the front would run it. Clients other than browsers send no Origin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from http_svc.errors import ApiError
from specdec.host_check import ANY_HOST, allowed_host_set, host_of, is_allowed, origin_host

HOST_HEADER = b"host"
ORIGIN_HEADER = b"origin"


class AllowedHostsMiddleware:
    """Answers 403 to an HTTP request whose Host header, or Origin header when it has one, names
    neither a loopback host nor one of `allowed_hosts` ("*" among them: every host passes)."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed_hosts = allowed_host_set(allowed_hosts)
        self.is_any = ANY_HOST in allowed_hosts

    def is_allowed(self, host: str) -> bool:
        return is_allowed(host, self.allowed_hosts)

    def refusal(self, headers: Iterable[tuple[bytes, bytes]]) -> ApiError | None:
        """The 403 of a request with these headers, None when it may be answered."""
        for key, value in headers:
            checked = _CHECKED_HEADERS.get(key.lower())
            if checked is None:
                continue
            name, host_of_value, answered, code = checked
            text = value.decode("latin-1")
            if not self.is_allowed(host_of_value(text)):
                return ApiError(
                    403,
                    f"the {name} header {text!r} is not allowed: without --api_keys_file this server answers "
                    + answered,
                    "permission_error",
                    code=code,
                )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.is_any:
            error = self.refusal(scope.get("headers", ()))
            if error is not None:
                await JSONResponse(error.to_json(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# The headers checked: (name, its host, what the server answers, the error's code).
_CHECKED_HEADERS: dict[bytes, tuple[str, Callable[[str], str], str, str]] = {
    HOST_HEADER: (
        "Host",
        host_of,
        "requests to localhost, a loopback address or a host of --allowed_hosts (which keeps web pages "
        "from reaching it through DNS rebinding)",
        "host_not_allowed",
    ),
    ORIGIN_HEADER: (
        "Origin",
        origin_host,
        "web pages of localhost, a loopback address or a host of --allowed_hosts only",
        "origin_not_allowed",
    ),
}
