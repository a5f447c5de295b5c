"""gateway.request_record: a running request's writes to the state store and their repairs, each rule
on a tiny hand-made record in the in-memory store (the loop's tests cover them through whole requests)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import structlog

from gateway.request_record import RequestRecord
from specdec.errors import StateLost, Unavailable
from specdec.state_store import AsyncInMemoryStateStore, InMemoryStateStore, RequestStatus

PROMPT = [1, 2, 3]
PARAMS = {"max_new_tokens": 16}
STATS = {"num_steps": 1}
OWNER = "gateway-a"


def new_record(
    store: InMemoryStateStore,
    generated: list[int],
    *,
    stored_params=PARAMS,
    node_id: str = "",
    max_retry_s=30.0,
    **kwargs,
) -> RequestRecord:
    """The record of request "r" (created in `store` with `generated` stored), as its loop makes it."""
    if store.load("r") is None:
        store.create("r", PARAMS, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
        store.append_step("r", generated, expected_num_tokens=0, owner=OWNER)
    return RequestRecord(
        AsyncInMemoryStateStore(store),
        "r",
        OWNER,
        PROMPT,
        generated,
        threading.Event(),
        structlog.get_logger("test"),
        stored_params=stored_params,
        max_retry_s=max_retry_s,
        node_id=node_id,
        **kwargs,
    )


async def commit(record: RequestRecord, kept: list[int]) -> bool:
    """What the loop does with a step: its tokens join `generated`, then the write."""
    num_stored = len(record.generated)
    record.generated.extend(kept)
    return await record.append_step(kept, num_stored, STATS, None)


def test_a_step_stores_the_latest_prefills_lease_and_node_once():
    store = InMemoryStateStore()
    record = new_record(store, [10], node_id="node-1")
    record.prefilled("lease-1")
    assert asyncio.run(commit(record, [11, 12]))
    state = store.load("r")
    assert state.token_ids == (10, 11, 12) and (state.kv_lease, state.node) == ("lease-1", "node-1")
    assert record.unstored_kv_lease is None and record.unstored_node is None  # stored: not sent again


class RenewingStore(InMemoryStateStore):
    """A re-prefill grants a new lease while the step's write is under way."""

    record: RequestRecord

    def append_step(self, request_id, token_ids=(), **kwargs):
        if kwargs.get("kv_lease") == "lease-1":
            self.record.prefilled("lease-2")
        return super().append_step(request_id, token_ids, **kwargs)


def test_a_lease_renewed_while_its_step_is_written_goes_with_the_next_step():
    store = RenewingStore()
    record = store.record = new_record(store, [10])
    record.prefilled("lease-1")
    assert asyncio.run(commit(record, [11]))
    assert store.load("r").kv_lease == "lease-1" and record.unstored_kv_lease == "lease-2"
    assert asyncio.run(commit(record, [12]))
    assert store.load("r").kv_lease == "lease-2" and record.unstored_kv_lease is None


def test_steps_a_failover_lost_go_back_from_memory_with_the_step():
    store = InMemoryStateStore()
    record = new_record(store, [10, 11, 12])
    del store._entries["r"].tokens[-8:]  # the promoted replica lacks the last two acknowledged tokens
    assert asyncio.run(commit(record, [13]))
    assert store.load("r").token_ids == (10, 11, 12, 13)


def test_a_record_holding_tokens_that_are_not_this_gateways_refuses_the_step():
    store = InMemoryStateStore()
    record = new_record(store, [10, 11, 12])
    entry = store._entries["r"]
    entry.tokens[:] = entry.tokens[:4]
    store.append_step("r", [99])  # the record's second token is someone else's
    assert not asyncio.run(commit(record, [13]))
    assert store.load("r").token_ids == (10, 99)


def test_a_record_ended_elsewhere_refuses_the_step():
    store = InMemoryStateStore()
    record = new_record(store, [10])
    store.set_status("r", RequestStatus.CANCELLED, finish_reason="cancelled")
    assert not asyncio.run(commit(record, [11]))
    state = store.load("r")
    assert state.token_ids == (10,) and state.status == RequestStatus.CANCELLED


class ReplyLosingStore(InMemoryStateStore):
    """Applies the first step write, then its reply is lost (the client sees Unavailable)."""

    num_writes = 0

    def append_step(self, request_id, token_ids=(), **kwargs):
        self.num_writes += 1
        stored = super().append_step(request_id, token_ids, **kwargs)
        if self.num_writes == 2:  # the first after new_record's
            raise Unavailable("state_store", "redis: Connection reset by peer")
        return stored


def test_a_retried_write_that_had_been_applied_is_stored_once():
    store = ReplyLosingStore()
    record = new_record(store, [10])
    assert asyncio.run(commit(record, [11, 12]))
    assert store.load("r").token_ids == (10, 11, 12) and store.num_writes >= 3


def test_a_lost_record_is_written_back_whole():
    store = InMemoryStateStore()
    record = new_record(store, [10], node_id="node-1")
    record.prefilled("lease-1")
    store.delete("r")  # a Redis restarted without persistence
    assert asyncio.run(commit(record, [11]))
    state = store.load("r")
    assert (state.params, state.prompt_token_ids, state.token_ids) == (PARAMS, tuple(PROMPT), (10, 11))
    assert (state.status, state.kv_lease, state.node) == (RequestStatus.RUNNING, "lease-1", "node-1")
    assert state.stats == STATS


def test_a_lost_record_whose_parameters_are_unknown_ends_the_request_unavailable():
    store = InMemoryStateStore()
    record = new_record(store, [10], stored_params=None)
    store.delete("r")
    with pytest.raises(StateLost, match="stored state of request 'r' was lost"):
        asyncio.run(commit(record, [11]))
    assert store.load("r") is None


def test_the_end_of_a_lost_record_writes_it_back_with_its_final_status():
    store = InMemoryStateStore()
    record = new_record(store, [10, 11])
    store.delete("r")
    asyncio.run(record.finish(RequestStatus.FINISHED, "length", "", STATS, {"task_type": "chat"}))
    state = store.load("r")
    assert (state.status, state.finish_reason, state.token_ids) == (RequestStatus.FINISHED, "length", (10, 11))
    assert state.controller_state == {"task_type": "chat"}


def test_stats_are_due_with_the_first_step_one_step_an_interval_and_the_last():
    now = [100.0]
    record = new_record(InMemoryStateStore(), [], stats_interval_s=0.1, clock=lambda: now[0])
    due = []
    for t, is_final in ((100.0, False), (100.05, False), (100.1, False), (100.15, False), (100.16, True)):
        now[0] = t
        due.append(record.is_stats_due(is_final))
    assert due == [True, False, True, False, True]
    every = new_record(InMemoryStateStore(), [], stats_interval_s=0, clock=lambda: 5.0)
    assert all(every.is_stats_due(False) for _ in range(3))
    with pytest.raises(ValueError, match="stats_interval_s must be >= 0"):
        new_record(InMemoryStateStore(), [], stats_interval_s=-1)


def test_a_step_without_stats_keeps_the_stored_ones_and_the_end_writes_the_final_ones():
    store = InMemoryStateStore()
    record = new_record(store, [10])
    asyncio.run(commit(record, [11]))
    record.generated.append(12)
    assert asyncio.run(record.append_step([12], 2, None, None))
    state = store.load("r")
    assert state.token_ids == (10, 11, 12) and state.stats == STATS
    asyncio.run(record.finish(RequestStatus.FINISHED, "eos", "", {"num_steps": 3}, {"num_steps": 3}))
    state = store.load("r")
    assert (state.status, state.finish_reason, state.stats, state.controller_state) == (
        RequestStatus.FINISHED,
        "eos",
        {"num_steps": 3},
        {"num_steps": 3},
    )


def test_the_end_of_a_record_ended_elsewhere_leaves_that_end():
    store = InMemoryStateStore()
    record = new_record(store, [10])
    store.set_status("r", RequestStatus.CANCELLED, finish_reason="cancelled")
    with structlog.testing.capture_logs() as logs:
        asyncio.run(record.finish(RequestStatus.FINISHED, "eos", "", {"num_steps": 3}, None))
    state = store.load("r")
    assert (state.status, state.finish_reason, state.stats) == (RequestStatus.CANCELLED, "cancelled", {})
    assert not logs


def test_a_lost_record_is_written_back_with_the_loops_stats_when_the_step_carried_none():
    store = InMemoryStateStore()
    record = new_record(store, [10], snapshot=lambda: ({"num_steps": 2}, {"task_type": "code"}))
    store.delete("r")
    record.generated.append(11)
    assert asyncio.run(record.append_step([11], 1, None, None))
    state = store.load("r")
    assert state.token_ids == (10, 11) and state.stats == {"num_steps": 2}
    assert state.controller_state == {"task_type": "code"}


class DownStore(InMemoryStateStore):
    def append_step(self, request_id, token_ids=(), **kwargs):
        raise Unavailable("state_store", "redis: Connection refused")


def test_the_end_is_not_recorded_by_a_store_that_stays_down_and_nothing_is_raised():
    store = DownStore()
    store.create("r", PARAMS, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    record = new_record(store, [], max_retry_s=0.2)
    with structlog.testing.capture_logs() as logs:
        asyncio.run(record.finish(RequestStatus.FINISHED, "eos", "", STATS, None))
    assert store.load("r").status == RequestStatus.RUNNING
    assert any(e["event"] == "could not record the final status" for e in logs)


def test_a_cancelled_request_stops_retrying_at_once():
    store = DownStore()
    store.create("r", PARAMS, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    record = new_record(store, [])
    record.cancel.set()
    with pytest.raises(Unavailable, match="Connection refused"):
        asyncio.run(commit(record, [10]))


class CreateReplyLosingStore(InMemoryStateStore):
    """Applies the second create (the first is new_record's), then its reply is lost."""

    num_creates = 0

    def create(self, request_id, params, **options):
        self.num_creates += 1
        super().create(request_id, params, **options)
        if self.num_creates == 2:
            raise Unavailable("state_store", "redis: Timeout reading from socket")


def test_a_lost_records_write_back_whose_create_landed_though_it_timed_out_goes_on():
    """The retried create finds the record its first attempt wrote: its own, filled in, not StateLost."""
    store = CreateReplyLosingStore()
    record = new_record(store, [10])
    store.delete("r")
    assert asyncio.run(commit(record, [11]))
    state = store.load("r")
    assert (state.token_ids, state.status, state.stats) == ((10, 11), RequestStatus.RUNNING, STATS)
    assert store.num_creates == 3
