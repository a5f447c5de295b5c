"""Fixtures of the service-infrastructure tests (test_service.py, test_service_aio.py): each module
defines its own `server` fixture, (port, servicer), which `channel` connects to."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def channel(server: tuple[int, Any]) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server[0]}") as channel:
        yield channel
