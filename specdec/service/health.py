"""Waiting for a service to report SERVING through grpc.health.v1."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Poll interval while a service starts (model loading takes seconds).
_POLL_S = 0.05


def check_health(channel: grpc.Channel, service: str = "", timeout_s: float = 1.0) -> bool:
    """One health check: True when `service` ("" = the whole server) is SERVING."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def wait_for_serving(target: str | grpc.Channel, service: str = "", timeout_s: float = 30.0) -> None:
    """Block until target reports `service` SERVING; raise TimeoutError after timeout_s.

    target: an address ("host:port") or an open channel (left open).
    """
    channel = grpc.insecure_channel(target) if isinstance(target, str) else target
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{target if isinstance(target, str) else 'channel'} did not report "
                    f"{service or 'the server'} SERVING within {timeout_s} s"
                )
            if check_health(channel, service, timeout_s=min(1.0, remaining)):
                return
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
    finally:
        if isinstance(target, str):
            channel.close()
