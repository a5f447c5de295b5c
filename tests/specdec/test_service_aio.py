"""The asyncio error interceptor (the gateway's) in process on port 0: the same status mapping,
logging context and metrics as the threaded one (tests/specdec/test_service.py), through the
asyncio server, with coroutine handlers and an async-generator stream."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import structlog
from prometheus_client import CollectorRegistry

from specdec.errors import InvalidArgument, NotFound
from specdec.metrics import RpcMetrics
from specdec.service.aio import AioErrorInterceptor, create_aio_server
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, validator_pb2, validator_pb2_grpc
from tests.specdec.service_checks import check_stream_errors_arrive_after_the_messages_sent

VALIDATE = "ValidatorService/Validate"
STREAM = "GenerationService/GenerateStream"


class AsyncValidator(validator_pb2_grpc.ValidatorServiceServicer):
    """Raises what the request_id asks for; records the logging context."""

    def __init__(self) -> None:
        self.contexts: list[dict] = []

    async def Validate(self, request, context):  # noqa: ANN001, ANN201, N802 - the RPC's name
        self.contexts.append(structlog.contextvars.get_contextvars())
        if request.request_id == "missing":
            raise NotFound("request_id", "no active request 'missing'")
        if request.request_id == "bug":
            raise RuntimeError("secret internal detail at /srv/model.py:12")
        if request.request_id == "self-abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "the servicer's own status")
        return validator_pb2.ValidateResponse(accepted_nodes=[0], bonus_token=7)


class AsyncGateway(gateway_pb2_grpc.GenerationServiceServicer):
    """Streams two messages, then fails or waits (for the client to go away) when asked to."""

    async def GenerateStream(self, request, context) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:  # noqa: ANN001, N802
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, token_ids=[1])
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, token_ids=[2])
        if request.prompt == "fail":
            raise InvalidArgument("max_new_tokens", "must be > 0")
        if request.prompt == "wait":
            await asyncio.Event().wait()
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, is_final=True)


@pytest.fixture
def server(registry: CollectorRegistry) -> Iterator[tuple[int, AsyncValidator]]:
    """The asyncio server on an event loop of its own thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    validator = AsyncValidator()

    async def start() -> tuple[grpc.aio.Server, int]:
        server, port = await create_aio_server(
            "127.0.0.1:0",
            [
                (validator_pb2_grpc.add_ValidatorServiceServicer_to_server, validator),
                (gateway_pb2_grpc.add_GenerationServiceServicer_to_server, AsyncGateway()),
            ],
            interceptors=[AioErrorInterceptor(RpcMetrics(registry))],
        )
        await server.start()
        return server, port

    aio_server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield port, validator
    asyncio.run_coroutine_threadsafe(aio_server.stop(None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def count(registry: CollectorRegistry, method: str, code: str) -> float:
    return registry.get_sample_value("specdec_rpc_requests_total", {"method": method, "code": code}) or 0.0


def settled_count(registry: CollectorRegistry, method: str, code: str) -> float:
    """count() once it is non-zero (or after 10 s): a status the servicer sent itself (an awaited
    context.abort, a cancellation) can reach the client before the server's guard records it."""
    deadline = time.monotonic() + 10
    while count(registry, method, code) == 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return count(registry, method, code)


def test_statuses_of_a_coroutine_handler(channel: grpc.Channel, server, registry: CollectorRegistry) -> None:
    stub = validator_pb2_grpc.ValidatorServiceStub(channel)
    assert stub.Validate(validator_pb2.ValidateRequest(request_id="ok"), timeout=5).bonus_token == 7
    assert server[1].contexts[-1] == {"request_id": "ok", "rpc": VALIDATE}
    expected = {
        "missing": (grpc.StatusCode.NOT_FOUND, "request_id: no active request 'missing'"),
        "bug": (grpc.StatusCode.INTERNAL, f"{VALIDATE}: internal error (RuntimeError); see the service log"),
        "self-abort": (grpc.StatusCode.PERMISSION_DENIED, "the servicer's own status"),
    }
    for request_id, status in expected.items():
        with pytest.raises(grpc.RpcError) as e:
            stub.Validate(validator_pb2.ValidateRequest(request_id=request_id), timeout=5)
        assert (e.value.code(), e.value.details()) == status
    for code in ("OK", "NOT_FOUND", "INTERNAL", "PERMISSION_DENIED"):
        assert settled_count(registry, VALIDATE, code) == 1.0


def test_a_request_that_does_not_parse_is_invalid_argument(channel: grpc.Channel) -> None:
    # Field 1 (request_id, a string) with bytes that are not UTF-8.
    validate = channel.unary_unary(f"/specdec.v1.{VALIDATE}")
    with pytest.raises(grpc.RpcError) as e:
        validate(b"\x0a\x02\xff\xfe", timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in e.value.details()


def test_stream_errors_arrive_after_the_messages_sent(channel: grpc.Channel) -> None:
    check_stream_errors_arrive_after_the_messages_sent(channel)


def test_a_stream_whose_client_went_away_is_recorded_cancelled(
    channel: grpc.Channel, registry: CollectorRegistry
) -> None:
    stub = gateway_pb2_grpc.GenerationServiceStub(channel)
    stream = stub.GenerateStream(gateway_pb2.GenerateRequest(request_id="s3", prompt="wait"), timeout=30)
    assert [list(next(stream).token_ids), list(next(stream).token_ids)] == [[1], [2]]
    stream.cancel()
    # the server learns of the cancellation asynchronously
    assert settled_count(registry, STREAM, "CANCELLED") == 1.0 and count(registry, STREAM, "OK") == 0.0
