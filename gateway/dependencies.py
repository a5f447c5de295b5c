"""Whether the gateway's optional dependencies answer: the validator and the draft service.

Neither is needed for exact output. Without drafts a step verifies the root alone; without the
validator a greedy step accepts the path the primary's own argmaxes agree with (exactly what the
validator's greedy rule computes), and other requests run plain steps. A DependencyState tracks
one dependency for the whole gateway: the first failure marks it down (logged once, the metric
set to 0), calls are skipped until retry_s has passed, then one call probes it again; the first
success marks it up (logged once). A call past its deadline (gateway.call_deadlines: a hung
service) is a failure like a refused connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

DEFAULT_RETRY_S = 2.0


class DependencyState:
    def __init__(
        self,
        name: str,
        retry_s: float = DEFAULT_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.name, self.retry_s = name, retry_s
        self._clock, self._on_change = clock, on_change
        self._is_up = True
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._log = structlog.get_logger("gateway.dependencies")

    @property
    def is_up(self) -> bool:
        return self._is_up

    def is_retry_due(self) -> bool:
        """Up, or down long enough that the next should_call() probes it (does not take the probe)."""
        return self._is_up or self._clock() >= self._retry_at

    def should_call(self) -> bool:
        """True while up, and once per retry_s while down (that call is the probe)."""
        with self._lock:
            if self._is_up:
                return True
            if self._clock() < self._retry_at:
                return False
            self._retry_at = self._clock() + self.retry_s  # one probe per period, whoever calls
            return True

    def succeeded(self) -> None:
        with self._lock:
            if self._is_up:
                return
            self._is_up = True
        self._log.info("dependency is back", dependency=self.name)
        if self._on_change is not None:
            self._on_change(True)

    def failed(self, error: str) -> None:
        with self._lock:
            self._retry_at = self._clock() + self.retry_s
            if not self._is_up:
                return
            self._is_up = False
        self._log.warning("dependency unavailable; serving without it", dependency=self.name, error=error)
        if self._on_change is not None:
            self._on_change(False)
