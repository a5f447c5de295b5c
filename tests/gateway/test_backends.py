"""Backends against a fake primary (a real gRPC server on port 0): what its Prefill calls carry."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.backends import Backends
from specdec.errors import DeadlineExceeded
from specdec.sampling import SamplingParams
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


def test_a_forgotten_lease_is_not_sent_again(primary) -> None:  # noqa: ANN001
    """What a request leaves on the node it failed over from: nothing once it ended there."""
    servicer, address = primary

    async def scenario() -> list[str]:
        backends = Backends(address, address, address, timeout_s=10)
        try:
            await backends.prefill("r", [1, 2])
            backends.forget_kv_lease("r")
            await backends.prefill("r", [1, 2])
        finally:
            await backends.close()
        return servicer.sent_leases

    assert asyncio.run(scenario()) == ["", ""]


class DraftingPrimary(primary_pb2_grpc.PrimaryServiceServicer):
    """A DecodeStream whose steps drafted: 3 tokens of 5 rows (the root and 4 drafts), then 1 of 7 rows."""

    def DecodeStream(self, request, context):  # noqa: ANN001, N802
        yield primary_pb2.DecodeStreamResponse(
            token_ids=[5, 6, 7],
            num_step_rows=5,
            num_drafted=4,
            num_draft_accepted=2,
            num_answer_drafted=4,
            num_answer_accepted=2,
        )
        yield primary_pb2.DecodeStreamResponse(token_ids=[8], num_step_rows=7, is_run_end=True)


def test_a_drafted_step_s_own_rows_are_not_other_requests_load() -> None:
    """num_step_rows counts the whole engine step: less the request's root and its drafts, the rows of
    others (what the controller prices a plan beside)."""

    async def scenario() -> list[tuple[tuple[int, ...], int, int, int, int]]:
        with serving(primary_pb2_grpc.add_PrimaryServiceServicer_to_server, DraftingPrimary()) as address:
            backends = Backends(address, address, address, timeout_s=10)
            try:
                steps = backends.decode_stream("r", (), [4], SamplingParams(), 0, max_tokens=8, lookup_draft_length=4)
                return [
                    (d.token_ids, d.other_step_rows, d.num_drafted, d.num_draft_accepted, d.num_answer_accepted)
                    async for d in steps
                ]
            finally:
                await backends.close()

    assert asyncio.run(scenario()) == [((5, 6, 7), 0, 4, 2, 2), ((8,), 6, 0, 0, 0)]


class LongRunPrimary(primary_pb2_grpc.PrimaryServiceServicer):
    """A DecodeStream run that outlasts any deadline on the whole call: before each of its steps it waits
    past the time the call has left (a run of thousands of tokens takes minutes), each step well within
    the gateway's timeout of the last; a call without a deadline gets its steps at once."""

    def DecodeStream(self, request, context):  # noqa: ANN001, N802
        for i in range(3):
            remaining = context.time_remaining()
            if remaining is not None and remaining < 1e6:  # the gRPC server's "none" is a huge number
                time.sleep(remaining + 0.2)
            yield primary_pb2.DecodeStreamResponse(token_ids=[i], is_run_end=i == 2)


def test_a_decode_stream_runs_past_the_rpc_timeout_while_its_steps_come() -> None:
    """A run goes to its request's end (gateway.decode_run), which may take far longer than
    --rpc_timeout_s; before, the timeout bounded the whole stream, so a long plain run failed its
    request DEADLINE_EXCEEDED after a minute although every step came in time."""

    async def scenario() -> list[tuple[int, ...]]:
        with serving(primary_pb2_grpc.add_PrimaryServiceServicer_to_server, LongRunPrimary()) as address:
            backends = Backends(address, address, address, timeout_s=0.5)
            try:
                steps = backends.decode_stream("r", (), [4], SamplingParams(), 0, max_tokens=3)
                return [d.token_ids async for d in steps]
            finally:
                await backends.close()

    assert asyncio.run(scenario()) == [(0,), (1,), (2,)]


class HungRunPrimary(primary_pb2_grpc.PrimaryServiceServicer):
    """A DecodeStream that sends one step, then never another until `released` (a hung primary)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def DecodeStream(self, request, context):  # noqa: ANN001, N802
        yield primary_pb2.DecodeStreamResponse(token_ids=[7])
        self.released.wait()


def test_a_decode_stream_whose_next_step_never_comes_fails_at_the_rpc_timeout() -> None:
    """A hung primary still fails the run DEADLINE_EXCEEDED at --rpc_timeout_s (after its last message)."""
    primary = HungRunPrimary()

    async def scenario() -> list[tuple[int, ...]]:
        received = []
        with serving(primary_pb2_grpc.add_PrimaryServiceServicer_to_server, primary) as address:
            backends = Backends(address, address, address, timeout_s=0.5)
            try:
                with pytest.raises(DeadlineExceeded) as raised:
                    async for d in backends.decode_stream("r", (), [4], SamplingParams(), 0, max_tokens=3):
                        received.append(d.token_ids)
                assert raised.value.dependency == "primary"
            finally:
                primary.released.set()
                await backends.close()
        return received

    assert asyncio.run(scenario()) == [(7,)]
