"""Admission control (gateway.admission): the fair queue's order, slots, overflow, deadlines, cancels."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from gateway.admission import MAX_RETRY_AFTER_MS, MIN_RETRY_AFTER_MS, Admission, FairQueue, QueueFull, Ticket
from specdec.errors import Cancelled, DeadlineExceeded
from gateway.metrics import GatewayMetrics


def one_slot_taken(metrics: GatewayMetrics | None = None) -> tuple[Admission, Ticket]:
    """Admission of one running request and up to 4 waiting ones, its slot held: (admission, holder)."""
    admission = Admission(max_active=1, max_queued=4, metrics=metrics)
    return admission, admission.enter("")


def test_fair_queue_is_fifo_per_key_and_round_robin_across_keys():
    q: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3", "b1", "c1", "b2"):
        q.push(item[0], item)
    assert len(q) == 6
    assert [q.pop() for _ in range(3)] == ["a1", "b1", "c1"]
    q.push("c", "c2")  # c went behind a and b when c1 was taken
    q.push("d", "d1")  # a new key waits behind those already waiting
    assert [q.pop() for _ in range(len(q))] == ["a2", "b2", "c2", "d1", "a3"]
    with pytest.raises(IndexError):
        q.pop()


def test_fair_queue_with_one_key_is_plain_fifo_and_remove_takes_an_item_out():
    q: FairQueue[int] = FairQueue()
    for i in range(5):
        q.push("", i)
    assert q.remove("", 2) and not q.remove("", 2) and not q.remove("other", 1)
    assert [q.pop() for _ in range(len(q))] == [0, 1, 3, 4]


def test_slots_pass_to_waiters_in_fair_order():
    admission = Admission(max_active=1, max_queued=8)
    holder = admission.enter("a")
    assert holder.is_granted
    waiting = [(key, admission.enter(key)) for key in ("a", "a", "a", "b", "c")]
    assert not any(t.is_granted for _, t in waiting) and admission.num_queued == 5
    order = []
    current = holder
    for _ in waiting:
        current.release()
        granted = [(k, t) for k, t in waiting if t.is_granted and not t.is_released]
        assert len(granted) == 1 and admission.num_active == 1
        order.append(granted[0][0])
        current = granted[0][1]
    current.release()
    assert order == ["a", "b", "c", "a", "a"]
    assert (admission.num_active, admission.num_queued) == (0, 0)


def test_a_request_beyond_the_queue_is_refused_with_a_retry_hint_and_counted():
    registry = CollectorRegistry()
    admission = Admission(max_active=2, max_queued=1, metrics=GatewayMetrics(registry))
    running = [admission.enter(""), admission.enter("")]
    queued = admission.enter("")
    with pytest.raises(QueueFull) as refused:
        admission.enter("")
    assert MIN_RETRY_AFTER_MS <= refused.value.retry_after_ms <= MAX_RETRY_AFTER_MS
    assert refused.value.status_name == "RESOURCE_EXHAUSTED"
    assert registry.get_sample_value("specdec_admission_rejections_total", {"reason": "queue_full"}) == 1
    assert registry.get_sample_value("specdec_num_requests_waiting") == 1
    running[0].release()
    running[0].release()  # idempotent: the slot is handed on once
    assert queued.is_granted and admission.num_active == 2 and admission.num_queued == 0
    assert asyncio.run(queued.wait_async(None, threading.Event(), "r")) >= 0
    assert registry.get_sample_value("specdec_admission_wait_seconds_count") == 1
    for t in (running[1], queued):
        t.release()
    assert (admission.num_active, admission.num_queued) == (0, 0)


def test_a_queued_request_past_its_deadline_leaves_the_queue():
    registry = CollectorRegistry()
    admission, holder = one_slot_taken(GatewayMetrics(registry))
    late = admission.enter("")
    with pytest.raises(DeadlineExceeded, match="request_id: request 'r1' waited"):
        asyncio.run(late.wait_async(time.monotonic() + 0.05, threading.Event(), "r1"))
    assert admission.num_queued == 0 and registry.get_sample_value("specdec_num_requests_waiting") == 0
    assert registry.get_sample_value("specdec_admission_rejections_total", {"reason": "deadline"}) == 1
    holder.release()
    late.release()
    assert (admission.num_active, admission.num_queued) == (0, 0)


def test_a_cancelled_queued_request_leaves_the_queue_and_the_next_one_keeps_its_turn():
    admission, holder = one_slot_taken()
    cancelled, after = admission.enter(""), admission.enter("")
    cancel = threading.Event()
    threading.Timer(0.05, cancel.set).start()
    with pytest.raises(Cancelled):
        asyncio.run(cancelled.wait_async(None, cancel, "r1"))
    assert admission.num_queued == 1
    holder.release()
    assert after.is_granted and not cancelled.is_granted
    after.release()
    assert (admission.num_active, admission.num_queued) == (0, 0)


def test_a_slot_granted_as_the_deadline_passes_goes_on_to_the_next_waiter():
    admission, holder = one_slot_taken()
    late, after = admission.enter(""), admission.enter("")
    holder.release()  # late is granted, but its deadline has passed
    assert late.is_granted
    assert asyncio.run(late.wait_async(time.monotonic() - 1, threading.Event(), "r")) >= 0  # granted first: it runs
    late.release()
    assert after.is_granted
    after.release()
    assert (admission.num_active, admission.num_queued) == (0, 0)


def test_an_async_waiter_is_woken_by_the_grant_and_holds_no_thread():
    async def scenario() -> float:
        admission, holder = one_slot_taken()
        queued = admission.enter("")
        waiting = asyncio.ensure_future(queued.wait_async(None, threading.Event(), "r1"))
        await asyncio.sleep(0.01)
        assert not waiting.done() and threading.active_count() == threads_before
        asyncio.get_running_loop().call_later(0.05, holder.release)
        waited_s = await waiting
        assert queued.is_granted and admission.num_queued == 0
        queued.release()
        assert (admission.num_active, admission.num_queued) == (0, 0)
        return waited_s

    threads_before = threading.active_count()
    assert asyncio.run(scenario()) > 0


def test_an_async_waiter_leaves_the_queue_on_its_deadline_a_cancel_or_its_coroutine_cancelled():
    async def scenario(registry: CollectorRegistry) -> None:
        admission, holder = one_slot_taken(GatewayMetrics(registry))
        late, cancelled, gone, after = (admission.enter("") for _ in range(4))
        with pytest.raises(DeadlineExceeded, match="request 'r1' waited"):
            await late.wait_async(time.monotonic() + 0.05, threading.Event(), "r1")
        cancel = threading.Event()
        asyncio.get_running_loop().call_later(0.05, cancel.set)
        with pytest.raises(Cancelled):
            await cancelled.wait_async(None, cancel, "r2")
        task = asyncio.ensure_future(gone.wait_async(None, threading.Event(), "r3"))
        await asyncio.sleep(0.01)
        task.cancel()  # its client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert admission.num_queued == 1
        holder.release()
        assert after.is_granted and await after.wait_async(None, threading.Event(), "r4") >= 0
        after.release()
        assert (admission.num_active, admission.num_queued) == (0, 0)

    registry = CollectorRegistry()
    asyncio.run(scenario(registry))
    assert registry.get_sample_value("specdec_admission_rejections_total", {"reason": "deadline"}) == 1
    assert registry.get_sample_value("specdec_admission_rejections_total", {"reason": "cancelled"}) == 2


def test_bounds_are_checked():
    with pytest.raises(ValueError, match="max_active"):
        Admission(0, 1)
    with pytest.raises(ValueError, match="max_queued"):
        Admission(1, -1)


def test_a_resumed_request_is_never_refused_but_waits_for_a_slot():
    """A request a previous gateway accepted (resumed after a restart) queues beyond max_queued;
    it still runs only when a slot frees."""
    admission = Admission(max_active=1, max_queued=0)
    running = admission.enter("")
    with pytest.raises(QueueFull):
        admission.enter("")
    resumed = [admission.enter("", is_accepted=True) for _ in range(2)]
    assert not any(t.is_granted for t in resumed) and admission.num_queued == 2
    running.release()
    assert resumed[0].is_granted and not resumed[1].is_granted and admission.num_active == 1
    for t in resumed:
        t.release()
    assert (admission.num_active, admission.num_queued) == (0, 0)


def test_a_request_let_in_at_once_waited_exactly_zero():
    admission = Admission(max_active=1, max_queued=1)
    ticket = admission.enter("")
    assert ticket.is_granted and asyncio.run(ticket.wait_async(None, threading.Event(), "r")) == 0.0  # never < 0
    ticket.release()
    again = admission.enter("")
    assert asyncio.run(again.wait_async(None, threading.Event(), "r2")) == 0.0
