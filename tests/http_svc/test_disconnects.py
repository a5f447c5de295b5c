"""A client that goes away is counted (specdec_http_client_disconnects_total) and its gateway call
cancelled, whenever it goes: mid-stream, or before its body has arrived."""

from __future__ import annotations

import asyncio
import json

from http_svc.app import HttpFront
from tests.http_svc.asgi import post_scope

MODEL = "test-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _disconnects(front: HttpFront) -> float:
    return front.metrics.registry.get_sample_value("specdec_http_client_disconnects_total")


def _requests(front: HttpFront, status: str) -> float | None:
    return front.metrics.registry.get_sample_value(
        "specdec_http_requests_total", {"endpoint": "/v1/chat/completions", "status": status}
    )


def test_a_client_that_disconnects_mid_stream_is_counted_and_its_call_cancelled(
    front, fake_gateway, post_then_disconnect
) -> None:  # noqa: ANN001
    gateway, _ = fake_gateway
    gateway.is_holding = True  # the stream's last message waits for a cancel
    body = json.dumps({**CHAT, "stream": True}).encode()
    sent = asyncio.run(post_then_disconnect("/v1/chat/completions", body, after_body_chunks=1))
    assert sent[0]["status"] == 200 and b"data: " in sent[1]["body"]
    assert gateway.cancelled.wait(10), "the gateway call was not cancelled"
    assert _disconnects(front) == 1


def test_a_client_that_disconnects_before_its_body_arrives_is_counted_not_a_500(front, post_then_disconnect) -> None:  # noqa: ANN001
    sent = asyncio.run(post_then_disconnect("/v1/chat/completions", b'{"model": ', after_body_chunks=0))
    assert not [m for m in sent if m["type"] == "http.response.start" and m["status"] >= 500]
    assert _disconnects(front) == 1
    assert _requests(front, "499") == 1 and _requests(front, "500") is None


def test_a_client_that_leaves_before_its_tokenize_body_arrives_is_no_internal_error(post_then_disconnect) -> None:  # noqa: ANN001
    sent = asyncio.run(post_then_disconnect("/tokenize", b'{"prompt": ', after_body_chunks=0))
    assert not [m for m in sent if m["type"] == "http.response.start" and m["status"] >= 500]


async def _post_as_uvicorn_receives(front: HttpFront, path: str, body: bytes) -> list[dict]:
    """POSTs `body` to the app over raw ASGI (spec 2.3, as uvicorn serves HTTP/1.1) with uvicorn's
    receive: after the body, it waits for the next event of the connection, and once the response
    is complete answers http.disconnect at once. Returns the ASGI messages the app sent."""
    app = front.app()
    sent: list[dict] = []
    event = asyncio.Event()
    is_body_read = False

    async def receive() -> dict:
        nonlocal is_body_read
        if not is_body_read:
            is_body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await event.wait()  # set by the response's last message (uvicorn's message_event)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            event.set()

    scope = post_scope(path)
    async with front._lifespan(app):
        await asyncio.wait_for(app(scope, receive, send), 30)
    return sent


def test_a_stream_that_ends_is_no_disconnect(front) -> None:  # noqa: ANN001
    """The server's own http.disconnect after a complete response (uvicorn answers it at once) is
    not the client going away: a stream read to its end counts no disconnect."""
    body = json.dumps({**CHAT, "stream": True}).encode()
    sent = asyncio.run(_post_as_uvicorn_receives(front, "/v1/chat/completions", body))
    assert sent[0]["status"] == 200 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert b"data: [DONE]" in b"".join(m.get("body", b"") for m in sent)
    assert _disconnects(front) == 0
    assert _requests(front, "200") == 1
