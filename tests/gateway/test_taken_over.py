"""A gateway whose request was taken over while it was alive after all (found not answering: a
long pause, a partition): its next step write is refused by the owner check, its loop ends without
writing its end over the adopter's run, and the adopter finishes the request from the stored tokens
with the output of an undisturbed run: no token lost or stored twice. Fake backends (tests.gateway
.test_loop's), real in-memory store."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest
import structlog

from gateway.server import GenerationServicer
from specdec.errors import Unavailable
from specdec.logprobs import LogprobsRequest
from specdec.state_store import AsyncInMemoryStateStore, InMemoryStateStore, RequestStatus
from tests.gateway.test_loop import PROMPT, FakeBackends, loop_over_prompt, make_params, plain_decoding

OLD, NEW = "gateway@10.0.0.2:50050#old0", "gateway@10.0.0.1:50050#new1"
MAX_NEW_TOKENS = 60


def test_the_old_owner_stops_cleanly_and_the_adopter_finishes_the_same_output() -> None:
    store = InMemoryStateStore()
    store.create("r1", {}, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    params = make_params(degree=2, draft_length=4, max_new_tokens=MAX_NEW_TOKENS)
    backends = FakeBackends(is_lookup_right=lambda n: n % 3 == 0)
    old = loop_over_prompt(params, backends, AsyncInMemoryStateStore(store), owner=OLD)
    sent: list[int] = []  # what the old gateway's client received

    async def run_old() -> None:
        steps = old.run()
        async for out in steps:
            sent.extend(out.token_ids)
            if len(sent) >= 6 and store.load("r1").owner == OLD:
                assert store.take_over("r1", NEW, OLD)  # another gateway found OLD gone

    asyncio.run(run_old())
    assert old.is_refused and old.outcome.finish_reason == "cancelled"
    state = store.load("r1")
    assert state is not None and state.status == RequestStatus.RUNNING and state.owner == NEW  # not ended by OLD
    assert list(state.token_ids) == sent  # every token the old client got is stored, once; nothing more

    new = loop_over_prompt(
        params,
        FakeBackends(is_lookup_right=lambda n: n % 3 == 0),
        AsyncInMemoryStateStore(store),
        owner=NEW,
        generated=state.token_ids,
    )

    async def run_new() -> None:
        async for _ in new.run():
            pass

    asyncio.run(run_new())
    final = store.load("r1")
    assert final is not None and final.status == RequestStatus.FINISHED
    assert list(final.token_ids) == new.outcome.token_ids == plain_decoding(PROMPT, MAX_NEW_TOKENS)


def test_the_old_owners_client_is_told_to_retry_unless_its_request_asked_for_logprobs() -> None:
    """A retry of a request that asked for log probabilities is refused (they are not stored): its
    client is not sent to one."""
    store = InMemoryStateStore()
    store.create("r2", {}, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    store.claim("r2", NEW)
    s = GenerationServicer.__new__(GenerationServicer)
    s.store, s.owner, s.log = AsyncInMemoryStateStore(store), OLD, structlog.get_logger("test")

    def told(logprobs: LogprobsRequest | None) -> str:
        loop = types.SimpleNamespace(
            request_id="r2",
            is_refused=True,
            cancel=threading.Event(),
            outcome=types.SimpleNamespace(finish_reason="cancelled"),
            params=types.SimpleNamespace(logprobs=logprobs),
        )
        with pytest.raises(Unavailable) as e:
            asyncio.run(s._check_not_taken_over(loop, "r2"))
        return e.value.message

    assert told(None).endswith("retry the same request id to follow it")
    message = told(LogprobsRequest())
    assert "retry the same request id" not in message and "GetRequest" in message
