"""An HTTP client that goes away mid-stream: what the OpenAI client cannot do on purpose."""

from __future__ import annotations

import json
import socket
from typing import Any


def first_chunk_then_disconnect(http_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST `body` (a streaming chat completion) to the front at http_url over a raw socket, read
    until its first server-sent event is whole, close the connection; returns that event's chunk."""
    host, port = http_url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=300) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        received = b""
        while b"\n" not in received.partition(b"data: ")[2]:
            chunk = s.recv(65536)
            assert chunk, f"the connection closed before a whole event: {received!r}"
            received += chunk
    return json.loads(received.partition(b"data: ")[2].split(b"\n", 1)[0])
