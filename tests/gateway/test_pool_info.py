"""The gateway asks the draft pool what it offers and what its drafters cost (GetPoolInfo): the
measured costs replace the defaults in the cost model of the requests started after; while the pool
offers a strategy it has not measured yet (its weights not attached), it is asked again, at most
every POOL_INFO_RETRY_S, beside the requests: only a request that finds the offer unknown waits for
the answer, and at most POOL_INFO_WAIT_S."""

from __future__ import annotations

import asyncio
import types

import pytest
import structlog

from gateway import server as gateway_server
from gateway.backends import ModelInfo, PoolInfo
from gateway.call_deadlines import CallDeadlines
from gateway.cost_model import CostSettings, cost_model_for
from gateway.dependencies import DependencyState
from gateway.server import GenerationServicer, controller_config_for
from specdec.controller_defaults import PRIOR_ACCEPTANCE_PREDICTION
from specdec.errors import Unavailable
from specdec.task_type import TaskType

VERIFY_MS = {1: 20.0, 2: 21.0, 4: 22.0, 8: 24.0}


class Pool:
    def __init__(self, answers: list[PoolInfo | Exception | None]) -> None:
        """`answers` in turn (the last one again and again); None: the call hangs until released."""
        self.answers, self.num_calls = answers, 0
        self.released = asyncio.Event()

    async def draft_pool_info(self) -> PoolInfo:
        answer = self.answers[min(self.num_calls, len(self.answers) - 1)]
        self.num_calls += 1
        if answer is None:
            await self.released.wait()
            raise Unavailable("draft", "stopped hanging")
        if isinstance(answer, Exception):
            raise answer
        return answer


def servicer(pool: Pool, retry_s: float = 0.0) -> GenerationServicer:
    """A servicer with only what _offered_by_pool touches."""
    s = GenerationServicer.__new__(GenerationServicer)
    s.backends, s.call_deadlines = pool, CallDeadlines()
    s.draft_state = DependencyState("draft", retry_s=retry_s)
    s.model = ModelInfo(50, (49,), 4096, "fake", verify_costs_ms=VERIFY_MS)
    s.config = types.SimpleNamespace(costs=CostSettings())
    s.cost_model = cost_model_for(VERIFY_MS, CostSettings())
    s._offered_strategies, s._is_cost_pending, s._pool_info_at = None, False, 0.0
    s._pool_info_task, s._background = None, set()
    s.controller_config = None
    s.log = structlog.get_logger("test")
    return s


async def offered_then_settled(s: GenerationServicer) -> frozenset[str] | None:
    """What a request starting now is told, then the question it began answered."""
    offered = await s._offered_by_pool()
    while s._background:
        await asyncio.gather(*list(s._background), return_exceptions=True)
    return offered


def test_the_pools_measured_cost_prices_the_feature_drafter_once_it_is_measured(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(gateway_server.time, "monotonic", lambda: clock[0])
    offered = ("prompt_lookup", "suffix_index", "feature")
    pool = Pool(
        [
            Unavailable("draft", "down"),
            PoolInfo(offered),  # up, the weights not attached yet: nothing measured
            PoolInfo(offered, {"feature": (1.0, 2.0)}),
        ]
    )
    s = servicer(pool)
    default = s.cost_model.draft("feature", 4)

    def offered_now():
        return offered_then_settled(s)

    assert asyncio.run(offered_now()) is None  # the pool down: unknown, the defaults leave feature out
    assert asyncio.run(offered_now()) == frozenset(offered) and s.cost_model.draft("feature", 4) == default
    clock[0] += 1.0
    asyncio.run(offered_now())
    assert pool.num_calls == 2  # pending, but asked again only after POOL_INFO_RETRY_S
    clock[0] += gateway_server.POOL_INFO_RETRY_S
    asyncio.run(offered_now())
    assert pool.num_calls == 3
    assert s.cost_model.draft("feature", 4) == pytest.approx((1.0 + 4 * 2.0) / VERIFY_MS[1])
    clock[0] += 10 * gateway_server.POOL_INFO_RETRY_S
    asyncio.run(offered_now())
    assert pool.num_calls == 3  # measured: not asked again


def test_a_pool_without_the_feature_drafter_is_asked_once():
    pool = Pool([PoolInfo(("prompt_lookup", "suffix_index"))])
    s = servicer(pool)
    for _ in range(3):
        assert asyncio.run(offered_then_settled(s)) == frozenset({"prompt_lookup", "suffix_index"})
    assert pool.num_calls == 1


def test_a_pool_that_does_not_answer_is_not_asked_again_before_its_retry_is_due():
    pool = Pool([Unavailable("draft", "down"), PoolInfo(("prompt_lookup",))])
    s = servicer(pool, retry_s=3600.0)
    for _ in range(3):
        assert asyncio.run(offered_then_settled(s)) is None
    assert pool.num_calls == 1 and not s.draft_state.is_up  # every request's drafts skip it meanwhile


def test_a_trained_drafters_validation_acceptance_is_its_controller_prior():
    pool = Pool([PoolInfo(("prompt_lookup", "feature"), {"feature": (0.0, 2.0)}, {"feature": (0.7, 0.6, 0.5)})])
    s = servicer(pool)
    asyncio.run(offered_then_settled(s))
    assert s.controller_config is not None
    assert s.controller_config.decoder_prior_acceptance == (
        ("feature", pytest.approx(0.6)),
        ("prediction", PRIOR_ACCEPTANCE_PREDICTION),  # the prediction decoder's default prior stays
    )
    assert s.controller_config.prior_acceptance(TaskType.CREATIVE, 1, "feature") == pytest.approx(0.3)
    assert s.controller_config.prior_acceptance(TaskType.CREATIVE, 0, "prompt_lookup") == 0.3  # the task type's
    assert controller_config_for({"feature": (), "x": (1.5,)}).decoder_prior_acceptance == (
        ("prediction", PRIOR_ACCEPTANCE_PREDICTION),
    )


def test_a_pool_that_hangs_while_its_cost_is_pending_holds_no_request():
    """The offer known, the cost pending, the pool hung: GetPoolInfo is asked beside the requests,
    which start on what is known at once (before: each waited for the call's deadline, a minute
    while few GetPoolInfo calls were known)."""
    offered = ("prompt_lookup", "feature")
    pool = Pool([PoolInfo(offered), None])
    s = servicer(pool)

    async def requests_meanwhile() -> list[frozenset[str] | None]:
        assert await offered_then_settled(s) == frozenset(offered)  # the first answer, cost pending
        s._pool_info_at -= gateway_server.POOL_INFO_RETRY_S  # the pool due to be asked again
        told = [await asyncio.wait_for(s._offered_by_pool(), 1.0) for _ in range(3)]
        assert pool.num_calls == 2  # one question in flight for every request
        pool.released.set()
        await offered_then_settled(s)
        return told

    assert asyncio.run(requests_meanwhile()) == [frozenset(offered)] * 3
    assert not s.draft_state.is_up  # the hung call's failure opened the breaker


def test_a_pool_hung_before_its_first_answer_holds_a_request_at_most_the_wait(monkeypatch):
    monkeypatch.setattr(gateway_server, "POOL_INFO_WAIT_S", 0.05)
    pool = Pool([None, PoolInfo(("prompt_lookup",))])
    s = servicer(pool)

    async def two_requests() -> tuple[frozenset[str] | None, frozenset[str] | None]:
        first = await asyncio.wait_for(s._offered_by_pool(), 1.0)  # the defaults after the wait
        second = await asyncio.wait_for(s._offered_by_pool(), 1.0)  # waits on the same question
        assert pool.num_calls == 1
        pool.released.set()
        await offered_then_settled(s)
        return first, second

    assert asyncio.run(two_requests()) == (None, None)


def test_a_request_waits_for_the_first_answer_no_longer_than_its_own_time_left():
    pool = Pool([None])
    s = servicer(pool)

    async def a_request_with_little_time() -> frozenset[str] | None:
        offered = await asyncio.wait_for(s._offered_by_pool(remaining_s=0.05), 1.0)  # not POOL_INFO_WAIT_S
        pool.released.set()
        await offered_then_settled(s)
        return offered

    assert asyncio.run(a_request_with_little_time()) is None
