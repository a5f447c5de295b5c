"""Fixtures of the end-to-end tests: the four services as real processes on
loopback with a real redis-server, one stack per test module.

    pytestmark = pytest.mark.e2e

    def test_something(gateway_stub):
        gateway_stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi"), timeout=60)

A module sets STACK_OPTIONS (StackConfig fields) for a stack of its own kind, e.g.
{"is_serving_http": True} for the OpenAI-compatible front that `client` talks to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import openai
import pytest

from specdec.launcher import Stack, StackConfig
from specdec.v1 import gateway_pb2, gateway_pb2_grpc


@pytest.fixture(scope="module")
def stack(
    redis_server,
    tmp_path_factory: pytest.TempPathFactory,  # noqa: ANN001 - RedisServer from tests/conftest.py
    request: pytest.FixtureRequest,
) -> Iterator[Stack]:
    """The four services (default model, default precision: auto) with the state in redis_server.

    Logs go to pytest's temp dir (pytest keeps the last few runs), so a failed
    test's service logs can be read afterwards; the path is printed on failure.
    """
    log_dir = tmp_path_factory.mktemp(f"stack-{request.module.__name__.rpartition('.')[2]}")
    options = getattr(request.module, "STACK_OPTIONS", {})
    config = StackConfig(redis_url=redis_server.url, log_dir=log_dir, **options)
    with Stack(config) as started:
        yield started


@pytest.fixture(scope="module")
def gateway_channel(stack: Stack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        yield channel


@pytest.fixture(scope="module")
def gateway_stub(gateway_channel: grpc.Channel) -> gateway_pb2_grpc.GenerationServiceStub:
    """GenerationService on the module's stack."""
    return gateway_pb2_grpc.GenerationServiceStub(gateway_channel)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    """The OpenAI client of the module's HTTP front (STACK_OPTIONS {"is_serving_http": True})."""
    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=600)


Streamed = tuple[list[gateway_pb2.GenerateResponse], list[grpc.RpcError], threading.Thread]


def _stream_in_background(
    stub: gateway_pb2_grpc.GenerationServiceStub, request: gateway_pb2.GenerateRequest, timeout_s: float = 300
) -> Streamed:
    stream = stub.GenerateStream(request, timeout=timeout_s)
    received, errors = [next(stream)], []

    def read() -> None:
        try:
            received.extend(stream)
        except grpc.RpcError as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    return received, errors, reader


@pytest.fixture
def stream_in_background() -> Callable[..., Streamed]:
    """stream_in_background(stub, request, timeout_s=300): a GenerateStream past its first message,
    the rest read in a thread: (messages, errors, thread)."""
    return _stream_in_background
