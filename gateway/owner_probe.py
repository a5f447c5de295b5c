"""Whether the gateway that owns a request is gone, found by asking it rather than by waiting out
its lease.

A request's lease (--owner_lease_s, 30 s by default) must outlast a Redis stall: a gateway cut off
from the store for longer than its lease would lose its requests to another gateway while it still
runs them. So a lapsed lease is a slow signal, and a short lease an unsafe one. The owner id names
the owner's address and instance (gateway.owner_id); a gateway that needs to know (a client retried a
request there, or keep_leases sees an active request held by another gateway) asks the owner's
health service (grpc.health.v1 Check for the instance's own name, with a short deadline). An owner
that fails max_failures checks in a row is gone; one answer resets the count. Each owner's verdict
is kept for cache_s, and a check in flight is shared: 32 followers of one dead gateway's requests
cost one check per cache_s, not 32.

"Gone" only makes a takeover worth trying: the takeover itself is the store's compare-and-set
(take_over), which succeeds only while the gone owner still holds the lease, and an owner that was
alive after all is refused at its next step write (the store's owner check) and stops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.owner_id import OwnerId
from specdec.field_checks import require_at_least_one

DEFAULT_MAX_FAILURES = 2
DEFAULT_CACHE_S = 0.5  # a verdict's life: two failed checks of a dead owner take about this long
# Owners not asked about for this many cache_s are forgotten (gateways come and go).
NUM_CACHE_S_KEPT = 120

# check(owner): whether the owner's instance answered its health check (any status) in time.
OwnerCheck = Callable[[OwnerId], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class OwnerProbeConfig:
    max_failures: int = DEFAULT_MAX_FAILURES
    cache_s: float = DEFAULT_CACHE_S

    def __post_init__(self) -> None:
        require_at_least_one(self, "max_failures")
        if self.cache_s < 0:
            raise ValueError(f"cache_s must be >= 0, got {self.cache_s}")


@dataclass(slots=True)
class _Owner:
    num_failures: int = 0
    checked_at: float = float("-inf")
    asked_at: float = float("-inf")
    check: asyncio.Task[bool] | None = None


class OwnerProbe:
    """is_gone(owner): the owner's verdict, checked again when older than cache_s."""

    def __init__(
        self,
        check: OwnerCheck,
        config: OwnerProbeConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = OwnerProbeConfig() if config is None else config
        self._check = check
        self._clock, self._sleep = clock, sleep
        self._owners: dict[str, _Owner] = {}

    async def is_gone(self, owner: str) -> bool:
        """Whether owner (a stored owner id) failed its last max_failures checks; False for an owner
        that names no gateway instance (only its lease's expiry frees its requests)."""
        owner_id = OwnerId.parse(owner)
        if owner_id is None:
            return False
        now = self._clock()
        self._forget_old(now)
        state = self._owners.setdefault(owner, _Owner())
        state.asked_at = now
        if state.check is None and now - state.checked_at >= self.config.cache_s:
            state.check = asyncio.ensure_future(self._checked(owner_id, state))
        if state.check is not None:
            await asyncio.shield(state.check)  # one waiter cancelled does not cancel the shared check
        return state.num_failures >= self.config.max_failures

    async def is_gone_after_checks(self, owner: str) -> bool:
        """is_gone, asked again as each verdict expires while the owner is suspect (failed a check,
        not yet max_failures): a caller that asks once in a long while (keep_leases) gets the
        answer now, after up to max_failures checks."""
        for _ in range(self.config.max_failures):
            if await self.is_gone(owner):
                return True
            state = self._owners.get(owner)
            if state is None or state.num_failures == 0:
                return False
            await self._sleep(max(0.0, state.checked_at + self.config.cache_s - self._clock()))
        return await self.is_gone(owner)

    async def _checked(self, owner_id: OwnerId, state: _Owner) -> bool:
        try:
            is_answering = await self._check(owner_id)
        except Exception:  # noqa: BLE001 - a check that broke tells nothing about the owner
            is_answering = True
        finally:
            state.check = None
        state.num_failures = 0 if is_answering else state.num_failures + 1
        state.checked_at = self._clock()
        return is_answering

    def _forget_old(self, now: float) -> None:
        horizon = max(self.config.cache_s, 1.0) * NUM_CACHE_S_KEPT
        stale = [o for o, s in self._owners.items() if s.check is None and now - s.asked_at > horizon]
        for owner in stale:
            del self._owners[owner]
