"""Backends against a fake primary (a real gRPC server on port 0): what its Prefill calls carry."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.backends import Backends
from specdec.v1 import primary_pb2, primary_pb2_grpc
from tests.grpc_serving import serving


class LeasingPrimary(primary_pb2_grpc.PrimaryServiceServicer):
    """Records each Prefill's kv_lease; grants "lease-1", "lease-2", ..."""

    def __init__(self) -> None:
        self.sent_leases: list[str] = []

    def Prefill(self, request, context):  # noqa: ANN001, N802
        self.sent_leases.append(request.kv_lease)
        return primary_pb2.PrefillResponse(kv_lease=f"lease-{len(self.sent_leases)}")


@pytest.fixture
def primary() -> Iterator[tuple[LeasingPrimary, str]]:
    servicer = LeasingPrimary()
    with serving(primary_pb2_grpc.add_PrimaryServiceServicer_to_server, servicer) as address:
        yield servicer, address


def test_a_re_prefill_carries_the_held_lease_and_a_resumed_request_the_adopted_one(primary) -> None:  # noqa: ANN001
    """The primary lets only a live request's lease holder prefill it again (a recovery)."""
    servicer, address = primary

    async def scenario() -> list[str]:
        backends = Backends(address, address, address, timeout_s=10)
        try:
            assert (await backends.prefill("r", [1, 2])).kv_lease == "lease-1"  # a new request: no lease
            await backends.prefill("r", [1, 2, 3], 2)  # its recovery: the lease it holds
        finally:
            await backends.close()
        successor = Backends(address, address, address, timeout_s=10)
        try:
            successor.adopt_kv_lease("r", "lease-2")  # what the state store kept
            await successor.prefill("r", [1, 2, 3], 2)
        finally:
            await successor.close()
        return servicer.sent_leases

    assert asyncio.run(scenario()) == ["", "lease-1", "lease-2"]
