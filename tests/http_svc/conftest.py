"""The HTTP front in process, in front of a fake gateway (a real gRPC server on port 0).

The fake checks each request with the gateway's own `params_from_pb`, so a value the front passes
on gets the answer the real gateway would give it (INVALID_ARGUMENT naming the field, or a
completion), without a model, Redis or the other services."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest
from starlette.testclient import TestClient

from gateway.config import Limits, SpeculationDefaults
from gateway.params import params_from_pb
from http_svc.app import HttpFront
from tests.http_svc.asgi import post_scope
from http_svc.config import HttpConfig
from specdec.errors import InvalidArgument
from specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.grpc_serving import serving

MODEL = "test-model"
# A held stream waits this long at most for its client to go away (a test that fails stops here).
HOLD_S = 30.0


class FakeGateway(gateway_pb2_grpc.GenerationServiceServicer):
    """Answers "ok" (one token); a stream sends its first message and, while `is_holding`, waits
    for the caller to cancel before its last. `cancelled` is set when a stream ends, which a held
    one does only when cancelled; `num_ended` counts the streams that ended, and `requests` keeps
    every request it was sent."""

    def __init__(self) -> None:
        self.is_holding = False
        self.cancelled = threading.Event()
        self.num_ended = 0
        self.requests: list[gateway_pb2.GenerateRequest] = []
        self._lock = threading.Condition()

    def _ended(self) -> None:
        with self._lock:
            self.num_ended += 1
            self._lock.notify_all()
        self.cancelled.set()

    def wait_ended(self, count: int, timeout: float = HOLD_S) -> bool:
        """Whether `count` streams have ended within `timeout` seconds."""
        with self._lock:
            return self._lock.wait_for(lambda: self.num_ended >= count, timeout)

    def _check(self, request: gateway_pb2.GenerateRequest, context: grpc.ServicerContext) -> None:
        with self._lock:
            self.requests.append(request)
        try:
            params_from_pb(request, Limits(), SpeculationDefaults())
        except InvalidArgument as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Generate(self, request, context):  # noqa: ANN001, N802
        self._check(request, context)
        return gateway_pb2.GenerateResponse(
            request_id=request.request_id,
            text="ok",
            token_ids=[1],
            finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
            stats=gateway_pb2.GenerationStats(num_prompt_tokens=1, num_generated_tokens=1),
        )

    def GenerateStream(self, request, context):  # noqa: ANN001, N802
        self._check(request, context)
        context.add_callback(self._ended)  # before the first message: the caller may cancel at once
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, text="o", token_ids=[1])
        if self.is_holding:
            self.cancelled.wait(HOLD_S)
        yield gateway_pb2.GenerateStreamResponse(
            request_id=request.request_id,
            text="k",
            token_ids=[2],
            is_final=True,
            finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
            stats=gateway_pb2.GenerationStats(num_prompt_tokens=1, num_generated_tokens=2),
        )


@pytest.fixture
def fake_gateway() -> Iterator[tuple[FakeGateway, str]]:
    servicer = FakeGateway()
    with serving(gateway_pb2_grpc.add_GenerationServiceServicer_to_server, servicer) as address:
        yield servicer, address


@pytest.fixture
def front(fake_gateway: tuple[FakeGateway, str]) -> HttpFront:
    return HttpFront(HttpConfig(gateway_address=fake_gateway[1], model_name=MODEL, request_timeout_s=60))


@pytest.fixture
def client(front: HttpFront) -> Iterator[TestClient]:
    """Answers as a client gets them: an exception in a route is the 500 it becomes, not raised.
    Its requests name localhost in their Host, as a local client's do (a front without API keys
    refuses TestClient's default, "testserver": http_svc.allowed_hosts)."""
    with TestClient(front.app(), base_url="http://localhost", raise_server_exceptions=False) as started:
        yield started


@pytest.fixture
def post_then_disconnect(front: HttpFront) -> Callable[..., Awaitable[list[dict]]]:
    """`await post_then_disconnect(path, body, after_body_chunks=n)`: see _post_then_disconnect."""
    return functools.partial(_post_then_disconnect, front)


async def _post_then_disconnect(front: HttpFront, path: str, body: bytes, *, after_body_chunks: int) -> list[dict]:
    """POSTs `body` to the app over raw ASGI and disconnects once the app has sent
    `after_body_chunks` body messages (0: while the app still reads the request body, which
    never ends). Returns the ASGI messages the app sent."""
    app = front.app()
    sent: list[dict[str, Any]] = []
    num_chunks = 0
    is_gone = asyncio.Event()
    num_receives = 0

    async def receive() -> dict[str, Any]:
        nonlocal num_receives
        num_receives += 1
        if num_receives == 1:
            return {"type": "http.request", "body": body, "more_body": after_body_chunks == 0}
        if after_body_chunks > 0:
            await is_gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal num_chunks
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            num_chunks += 1
            if num_chunks >= after_body_chunks:
                is_gone.set()

    scope = post_scope(path)
    async with front._lifespan(app):
        await asyncio.wait_for(app(scope, receive, send), HOLD_S)
    return sent
