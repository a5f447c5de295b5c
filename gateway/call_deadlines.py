"""Per-call deadlines for the optional dependencies, from their own observed latency.

A hung service (stopped, deadlocked, swapping) accepts connections and never answers: to the
gateway it looks up until a call's timeout. With one fixed timeout (--rpc_timeout_s, a minute) a
hung validator stalled every greedy stream for that minute and then failed it. Instead each call of
the validator and the draft pool gets a deadline drawn from the recent successful calls of the same
RPC, and a call past it is a failure of that dependency like a refused connection
(gateway.dependencies: the breaker opens for all requests, which go on without it).

The rule (call_deadline_s), with q the `quantile` of the last `window` successful calls' seconds:

    deadline = min(max(floor_s, multiple * q), max_s, the request's remaining time)

and max_s itself while fewer than min_samples calls are known (a first call may load or compile).
The floor keeps a loaded machine's slow calls from reading as a hang. E.g. floor 2 s, multiple 4:
calls of 10-50 ms give 2 s; calls of 0.9-1.0 s give 4 s.

The primary is not cut short this way: nothing replaces it, and a false alarm would cost the request
a re-prefill. Its calls are bounded by --rpc_timeout_s and the request's own deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from specdec.errors import DeadlineExceeded

T = TypeVar("T")

DEFAULT_FLOOR_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class DeadlineRule:
    floor_s: float = DEFAULT_FLOOR_S  # never less: start-up, a first compile, a loaded machine are not hangs
    multiple: float = 4.0  # of the quantile below
    quantile: float = 0.99  # of the recent successful calls' seconds (nearest rank)
    min_samples: int = 3  # fewer known calls: max_s
    window: int = 128  # recent calls kept per RPC
    max_s: float = 60.0  # the longest any call waits (--rpc_timeout_s)

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.max_s:
            raise ValueError(f"floor_s must be in (0, max_s={self.max_s}], got {self.floor_s}")
        if self.multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {self.multiple}")
        if not 0 < self.quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {self.quantile}")
        if not 1 <= self.min_samples <= self.window:
            raise ValueError(f"min_samples must be in [1, window={self.window}], got {self.min_samples}")


def nearest_rank(values: Sequence[float], quantile: float) -> float:
    """The smallest value with at least `quantile` of the values at or below it. E.g. the 0.99 of
    [0.1, 0.3, 0.2] is 0.3 (rank ceil(2.97) = 3), its 0.5 is 0.2 (rank 2)."""
    assert values and 0 < quantile <= 1
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


def call_deadline_s(recent_s: Sequence[float], remaining_s: float | None, rule: DeadlineRule) -> float:
    """Seconds a call may take: see the module's docstring. `remaining_s`: the request's time left
    (None: no deadline); never below 0."""
    if len(recent_s) < rule.min_samples:
        deadline = rule.max_s
    else:
        deadline = min(max(rule.floor_s, rule.multiple * nearest_rank(recent_s, rule.quantile)), rule.max_s)
    if remaining_s is not None:
        deadline = min(deadline, remaining_s)
    return max(0.0, deadline)


class CallDeadlines:
    """The recent successful calls of each RPC ("validator.Validate", "draft.Propose", ...), shared
    by the gateway's requests, and the calls run within the deadline they give."""

    def __init__(self, rule: DeadlineRule | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule = rule or DeadlineRule()
        self._clock = clock
        self._recent: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def observe(self, rpc: str, seconds: float) -> None:
        with self._lock:
            self._recent.setdefault(rpc, deque(maxlen=self.rule.window)).append(seconds)

    def deadline_s(self, rpc: str, remaining_s: float | None = None) -> float:
        with self._lock:
            recent = tuple(self._recent.get(rpc, ()))
        return call_deadline_s(recent, remaining_s, self.rule)

    async def call(self, rpc: str, call: Awaitable[T], remaining_s: float | None = None) -> T:
        """`call`'s result; DeadlineExceeded naming the service (a dependency's failure) once its
        deadline passes, the call cancelled. A success is observed."""
        timeout_s = self.deadline_s(rpc, remaining_s)
        start = self._clock()
        try:
            result = await asyncio.wait_for(call, timeout_s)
        except asyncio.TimeoutError:
            service = rpc.partition(".")[0]
            raise DeadlineExceeded(
                service, f"{rpc} did not answer within {timeout_s:.2f} s (hung?)", dependency=service
            ) from None
        finally:
            # A call that never ran (its event loop shutting down, e.g. a request ended at exit) is
            # closed here, not left to the garbage collector's "never awaited" warning.
            if inspect.iscoroutine(call) and inspect.getcoroutinestate(call) == inspect.CORO_CREATED:
                call.close()
        self.observe(rpc, self._clock() - start)
        return result
