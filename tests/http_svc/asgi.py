"""A raw ASGI request for the HTTP front's tests that drive the app without a server."""

from __future__ import annotations

from typing import Any


def post_scope(path: str) -> dict[str, Any]:
    """The scope of a JSON POST to `path`, as uvicorn gives it for HTTP/1.1 (ASGI spec 2.3)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
