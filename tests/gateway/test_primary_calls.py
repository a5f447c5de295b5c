"""PrimaryCalls against a busy primary (a real gRPC server on port 0, behind the ErrorInterceptor as
primary_svc serves it): a Prefill refused with the primary's retry hint waits and tries again."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import cast

import pytest
import structlog

from gateway.backends import Backends
from gateway.primary_calls import PrimaryCalls
from gateway.request_record import RequestRecord
from specdec.errors import RETRY_AFTER_KEY
from specdec.errors import Cancelled, DeadlineExceeded, ResourceExhausted
from specdec.service.interceptor import ErrorInterceptor
from specdec.v1 import primary_pb2, primary_pb2_grpc
from tests.grpc_serving import serving

RETRY_AFTER_MS = 100


class BusyPrimary(primary_pb2_grpc.PrimaryServiceServicer):
    """Refuses its first `num_refused` Prefills as a primary with max_prefills under way does
    (RESOURCE_EXHAUSTED, with a hint of retry_after_ms unless None), then serves them."""

    def __init__(self, num_refused: int, retry_after_ms: int | None = RETRY_AFTER_MS) -> None:
        self.num_refused, self.retry_after_ms = num_refused, retry_after_ms
        self.num_prefills = 0
        self.refused = threading.Event()  # set at the first refusal

    def Prefill(self, request, context):  # noqa: ANN001, N802
        self.num_prefills += 1
        if self.num_prefills <= self.num_refused:
            if self.retry_after_ms is not None:
                context.set_trailing_metadata(((RETRY_AFTER_KEY, str(self.retry_after_ms)),))
            self.refused.set()
            raise ResourceExhausted("request_id", "this primary serves 1 prefills at once already; retry later")
        return primary_pb2.PrefillResponse(kv_lease="lease", precision="fp32")


def served(servicer: BusyPrimary) -> contextlib.AbstractContextManager[str]:
    add = primary_pb2_grpc.add_PrimaryServiceServicer_to_server
    return serving(add, servicer, [ErrorInterceptor()])


async def prefill(address: str, deadline: float | None = None, cancel: threading.Event | None = None) -> PrimaryCalls:
    """The request's own prefill through PrimaryCalls and real Backends (no failover)."""
    backends = Backends(address, address, address, timeout_s=10)
    calls: PrimaryCalls

    async def prefill_context(is_fresh: bool) -> str:
        return (await calls.within_deadline(backends.prefill("r", [1, 2, 3]))).precision

    calls = PrimaryCalls(
        cast(RequestRecord, None),  # read only by a failover
        prefill_context,
        lambda node: None,
        cancel=threading.Event() if cancel is None else cancel,
        log=structlog.get_logger(),
        recovery_timeout_s=1.0,
        deadline=deadline,
    )
    try:
        await asyncio.wait_for(calls.prefill(), 30.0)  # guard: a call that waits for ever fails here
    finally:
        await backends.close()
    return calls


def test_a_prefill_refused_by_a_busy_primary_is_retried_after_the_hinted_time():
    """Before, the refusal (the primary's bound on Prefills under way) failed the request
    RESOURCE_EXHAUSTED; a request that waits a moment finds room."""
    servicer = BusyPrimary(num_refused=2)
    with served(servicer) as address:
        start = time.monotonic()
        calls = asyncio.run(prefill(address))
        waited_s = time.monotonic() - start
    assert servicer.num_prefills == 3 and calls.weights_precision == "fp32"
    assert waited_s >= 2 * RETRY_AFTER_MS / 1000  # not retried before the hint said


def test_a_refusal_without_the_hint_is_not_retried():
    """E.g. a prompt larger than the primary's whole KV budget: no retry can help."""
    servicer = BusyPrimary(num_refused=1, retry_after_ms=None)
    with served(servicer) as address, pytest.raises(ResourceExhausted) as e:
        asyncio.run(prefill(address))
    assert servicer.num_prefills == 1 and e.value.retry_after_ms is None


def test_a_busy_primary_is_retried_until_the_requests_deadline():
    servicer = BusyPrimary(num_refused=1_000_000)
    with served(servicer) as address, pytest.raises(DeadlineExceeded):
        asyncio.run(prefill(address, deadline=time.monotonic() + 0.5))
    assert servicer.num_prefills > 1


def test_a_request_cancelled_while_it_waits_to_retry_ends_at_once():
    """Not once the hinted time (a minute here, past the 30 s guard) is over; as cancelled (the loop
    ends the request as a cancel), not with the primary's refusal."""
    servicer, cancel = BusyPrimary(num_refused=1_000_000, retry_after_ms=60_000), threading.Event()

    def cancel_while_waiting() -> None:
        servicer.refused.wait(30)
        time.sleep(0.2)
        cancel.set()

    canceller = threading.Thread(target=cancel_while_waiting)
    canceller.start()
    try:
        with served(servicer) as address, pytest.raises(Cancelled):
            asyncio.run(prefill(address, cancel=cancel))
    finally:
        cancel.set()
        canceller.join()
    assert servicer.num_prefills == 1
