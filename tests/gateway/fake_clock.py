"""A monotonic clock that a test moves by hand, for the gateway's timed parts (owner probes, state
retries, resumption): sleep() moves it instead of waiting."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
