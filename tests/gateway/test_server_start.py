"""The gateway's way in (GenerationServicer._start): a request stored before its loop exists is
never left RUNNING or QUEUED when its client goes away, or the loop cannot be made, in between."""

from __future__ import annotations

import asyncio
import threading

import pytest
import structlog

from gateway.admission import Admission
from gateway.server import GenerationServicer
from specdec.state_store.memory import InMemoryStateStore
from specdec.state_store.types import RequestStatus
from specdec.v1 import gateway_pb2


class Context:
    def time_remaining(self):
        return None

    def add_done_callback(self, _fn) -> None:
        pass


def servicer(store: InMemoryStateStore, admission: Admission, make_loop) -> GenerationServicer:
    """A servicer with only what _start touches: the store, admission, and a make_loop under test."""
    s = GenerationServicer.__new__(GenerationServicer)
    s.store, s.admission, s.api_keys, s.metrics = store, admission, None, None
    s._active, s._lock, s._background = {}, threading.Lock(), set()
    s.log = structlog.get_logger("test")
    s._prepare = lambda request, client_id, deadline: (None, [1, 2, 3], None, request)
    s.make_loop = make_loop
    return s


async def settle(s: GenerationServicer) -> None:
    while s._background:
        await asyncio.gather(*list(s._background), return_exceptions=True)


@pytest.mark.parametrize("is_queued", [False, True])
def test_a_client_gone_while_its_loop_is_made_is_stored_cancelled(is_queued: bool) -> None:
    store, admission = InMemoryStateStore(), Admission(max_active=1, max_queued=4)
    holder = admission.enter("") if is_queued else None
    making, unblock = threading.Event(), threading.Event()

    def make_loop(*_args, **_kwargs):
        making.set()
        unblock.wait(10)
        raise AssertionError("the loop is not used: its client went away")

    s = servicer(store, admission, make_loop)

    async def main() -> None:
        task = asyncio.ensure_future(s._start(gateway_pb2.GenerateRequest(request_id="r1"), Context()))
        if holder is not None:  # queued behind holder; let in when holder leaves
            while store.load("r1") is None:
                await asyncio.sleep(0.01)
            assert store.load("r1").status == RequestStatus.QUEUED
            holder.release()
        while not making.is_set():
            await asyncio.sleep(0.01)
        assert store.load("r1").status == RequestStatus.RUNNING
        task.cancel()  # the client goes away while the loop is being made
        with pytest.raises(asyncio.CancelledError):
            await task
        unblock.set()
        await settle(s)

    asyncio.run(main())
    assert store.load("r1").status == RequestStatus.CANCELLED
    assert (admission.num_active, admission.num_queued) == (0, 0)
    assert s._active == {}


def test_a_loop_that_cannot_be_made_leaves_the_request_failed() -> None:
    store, admission = InMemoryStateStore(), Admission(max_active=1, max_queued=4)

    def make_loop(*_args, **_kwargs):
        raise RuntimeError("no loop today")

    s = servicer(store, admission, make_loop)

    async def main() -> None:
        with pytest.raises(RuntimeError):
            await s._start(gateway_pb2.GenerateRequest(request_id="r2"), Context())
        await settle(s)

    asyncio.run(main())
    state = store.load("r2")
    assert state.status == RequestStatus.FAILED and "no loop today" in state.error
    assert admission.num_active == 0
