"""Fixtures of the end-to-end tests: the four services as real processes on
loopback with a real redis-server, one stack per test module.

    pytestmark = pytest.mark.e2e

    def test_something(gateway_stub):
        gateway_stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi"), timeout=60)
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from specdec.launcher import Stack, StackConfig
from specdec.v1 import gateway_pb2_grpc


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
    config = StackConfig(redis_url=redis_server.url, log_dir=log_dir)
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
