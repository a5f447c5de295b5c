"""The per-call deadline rule of the optional dependencies (gateway.call_deadlines), by hand."""

from __future__ import annotations

import asyncio

import pytest

from gateway.call_deadlines import CallDeadlines, DeadlineRule, call_deadline_s, nearest_rank
from specdec.errors import DeadlineExceeded

RULE = DeadlineRule(floor_s=2.0, multiple=4.0, quantile=0.99, min_samples=3, window=128, max_s=60.0)


def test_nearest_rank_by_hand():
    assert nearest_rank([0.1, 0.3, 0.2], 0.99) == 0.3  # rank ceil(2.97) = 3
    assert nearest_rank([0.1, 0.3, 0.2], 0.5) == 0.2  # rank ceil(1.5) = 2
    assert nearest_rank([0.4, 0.1, 0.3, 0.2], 0.25) == 0.1  # rank 1
    assert nearest_rank([float(i) for i in range(1, 101)], 0.99) == 99.0  # the outlier at 100 is past it


def test_fast_calls_get_the_floor():
    assert call_deadline_s([0.01, 0.05, 0.02], None, RULE) == 2.0  # 4 x 0.05 = 0.2 < 2


def test_slow_calls_get_a_multiple_of_their_high_quantile():
    assert call_deadline_s([0.9, 1.0, 0.95], None, RULE) == 4.0  # 4 x 1.0


def test_the_longest_wait_bounds_it():
    assert call_deadline_s([20.0, 20.0, 20.0], None, RULE) == 60.0  # 4 x 20 = 80 > 60


def test_too_few_calls_known_wait_the_longest():
    """A first call may load a model or compile: not a hang."""
    assert call_deadline_s([], None, RULE) == 60.0
    assert call_deadline_s([0.01, 0.01], None, RULE) == 60.0


def test_never_past_the_requests_remaining_time():
    assert call_deadline_s([0.01, 0.01, 0.01], 0.5, RULE) == 0.5
    assert call_deadline_s([], 10.0, RULE) == 10.0
    assert call_deadline_s([0.01, 0.01, 0.01], -1.0, RULE) == 0.0  # already past


def test_the_rule_checks_itself():
    for bad in ({"floor_s": 0.0}, {"floor_s": 61.0}, {"multiple": 0.5}, {"quantile": 0.0}, {"min_samples": 0}):
        with pytest.raises(ValueError):
            DeadlineRule(**bad)


def test_a_call_past_its_deadline_fails_naming_its_service():
    deadlines = CallDeadlines(DeadlineRule(floor_s=0.05, min_samples=1, max_s=60.0))

    async def answer(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "ok"

    async def scenario() -> None:
        assert await deadlines.call("validator.Validate", answer(0.001)) == "ok"  # observed: deadline 0.05 s
        assert deadlines.deadline_s("validator.Validate") == 0.05
        with pytest.raises(DeadlineExceeded) as e:
            await deadlines.call("validator.Validate", answer(5.0))  # "hung"
        assert e.value.dependency == "validator"

    asyncio.run(scenario())
