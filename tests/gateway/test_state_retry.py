"""gateway.state_retry: a state store write retried while the store does not answer, on a fake
clock (each timed-out attempt costs the store's socket timeout, as against a stalled Redis)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Awaitable, Callable

import pytest

from gateway import state_retry
from gateway.config import parse_config
from specdec.errors import InvalidArgument, Unavailable
from specdec.state_store import DEFAULT_COMMAND_TIMEOUT_S
from tests.gateway.fake_clock import FakeClock

SOCKET_TIMEOUT_S = DEFAULT_COMMAND_TIMEOUT_S  # the store's command timeout: what one attempt costs while Redis stalls


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock(1000.0)
    monkeypatch.setattr(state_retry.time, "monotonic", fake)
    monkeypatch.setattr(state_retry.asyncio, "sleep", fake.sleep)
    return fake


def stalled_write(clock: FakeClock, stall_s: float) -> tuple[list[float], Callable[[], Awaitable[str]]]:
    """A write against a store stalled until clock.now + stall_s: each attempt before then times out
    after SOCKET_TIMEOUT_S; (the attempts' start times, the write)."""
    resumes_at = clock.now + stall_s
    attempts: list[float] = []

    async def write() -> str:
        attempts.append(clock.now)
        if clock.now < resumes_at:
            clock.now += SOCKET_TIMEOUT_S
            raise Unavailable("state_store", "Redis unreachable: Timeout reading from socket")
        return "stored"

    return attempts, write


def test_retry_waits_back_off_to_a_ceiling():
    assert [state_retry.retry_wait_s(i) for i in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_give_up_at_is_the_budget_or_the_deadline(clock: FakeClock):
    assert state_retry.give_up_at(30.0, None) == 1030.0
    assert state_retry.give_up_at(30.0, 1012.0) == 1012.0


def test_a_fifteen_second_stall_is_ridden_over_with_the_default_budget(clock: FakeClock):
    """The chaos soak stops Redis for 15 s: a write that meets the stall lands once it is over
    (with a 10 s budget it failed UNAVAILABLE after two timed-out attempts)."""
    attempts, write = stalled_write(clock, stall_s=15.0)
    give_up = state_retry.give_up_at(state_retry.DEFAULT_MAX_STATE_RETRY_S, None)
    assert asyncio.run(state_retry.with_state_retries(write, give_up)) == "stored"
    assert len(attempts) == 4 and attempts[-1] >= 1015.0


def test_a_store_that_stays_away_fails_unavailable_by_the_budget(clock: FakeClock):
    attempts, write = stalled_write(clock, stall_s=1e9)
    give_up = state_retry.give_up_at(state_retry.DEFAULT_MAX_STATE_RETRY_S, None)
    with pytest.raises(Unavailable, match="state_store"):
        asyncio.run(state_retry.with_state_retries(write, give_up))
    assert attempts[-1] <= give_up < clock.now


def test_a_cancel_or_another_error_stops_the_retries(clock: FakeClock):
    cancel = threading.Event()
    cancel.set()
    attempts, write = stalled_write(clock, stall_s=1e9)
    with pytest.raises(Unavailable):
        asyncio.run(state_retry.with_state_retries(write, clock.now + 60, cancel))
    assert len(attempts) == 1

    async def refused() -> None:
        raise InvalidArgument("params", "no")

    with pytest.raises(InvalidArgument):
        asyncio.run(state_retry.with_state_retries(refused, clock.now + 60))


def test_the_budget_is_a_gateway_flag():
    assert parse_config(["--max_state_retry_s", "45"]).max_state_retry_s == 45.0
    assert parse_config([]).max_state_retry_s == state_retry.DEFAULT_MAX_STATE_RETRY_S >= 3 * SOCKET_TIMEOUT_S
    with pytest.raises(ValueError, match="max_state_retry_s"):
        dataclasses.replace(parse_config([]), max_state_retry_s=0.0)


def test_a_state_store_commands_timeout_is_a_gateway_flag():
    assert parse_config(["--state_timeout_s", "1.5"]).state_timeout_s == 1.5
    assert parse_config([]).state_timeout_s == DEFAULT_COMMAND_TIMEOUT_S
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="state_timeout_s"):
            dataclasses.replace(parse_config([]), state_timeout_s=bad)
