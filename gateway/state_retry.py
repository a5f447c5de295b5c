"""Riding over a state store that does not answer for a while: a write retried with backoff.

A Redis that fails over, restarts or stalls answers nothing for seconds; its client's calls time out
(the socket timeout, 5 s) and raise Unavailable. A request's prompt and tokens must be in the store
at every step, so the gateway does not go on without it: the write is retried after the waits of
STATE_RETRY_WAITS_S, then every STATE_RETRY_MAX_WAIT_S, until it lands, or until the retry budget
(--max_state_retry_s), the request's deadline or a cancel would pass: then Unavailable.

The budget is the same kind of wait as --recovery_timeout_s for a restarted primary. A budget of
10 s, the store's socket timeout twice over, failed every request in flight (16 of 16) with
UNAVAILABLE when Redis stalled for 12 s under `python -m bench load --chaos`. 30 s covers a stall of
15-20 s with the write that timed out and its retries, yet a store that stays away still ends a
request with a clear status well inside a usual client deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from specdec.errors import Unavailable

T = TypeVar("T")

STATE_RETRY_WAITS_S = (0.05, 0.1, 0.2, 0.4, 0.8)
STATE_RETRY_MAX_WAIT_S = 1.0
DEFAULT_MAX_STATE_RETRY_S = 30.0


def retry_wait_s(attempt: int) -> float:
    """The wait after failed attempt number `attempt` (0-based). E.g. 0 -> 0.05, 4 -> 0.8, 9 -> 1.0."""
    return STATE_RETRY_WAITS_S[attempt] if attempt < len(STATE_RETRY_WAITS_S) else STATE_RETRY_MAX_WAIT_S


def give_up_at(max_retry_s: float, deadline: float | None) -> float:
    """When retrying stops (time.monotonic): the budget from now, or the request's deadline if sooner."""
    give_up = time.monotonic() + max_retry_s
    return give_up if deadline is None else min(give_up, deadline)


async def with_state_retries(
    write: Callable[[], Awaitable[T]],
    give_up: float,
    cancel: threading.Event | None = None,
    log: Any = None,
) -> T:
    """write(), retried while it raises Unavailable; that Unavailable once the next try would start
    after give_up (time.monotonic) or cancel is set. The first retry is logged as a warning (log)."""
    for attempt in itertools.count():
        try:
            return await write()
        except Unavailable as e:
            wait = retry_wait_s(attempt)
            if time.monotonic() + wait > give_up or (cancel is not None and cancel.is_set()):
                raise
            if log is not None:
                (log.warning if attempt == 0 else log.debug)(
                    "state store unavailable; retrying", attempt=attempt + 1, error=str(e)
                )
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")
