"""The owner probe: a gateway is gone after max_failures failed checks in a row; verdicts are
cached per owner and a check in flight is shared (fake checks, fake clock)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.owner_id import OwnerId
from gateway.owner_probe import OwnerProbe, OwnerProbeConfig
from tests.gateway.fake_clock import FakeClock

OWNER = str(OwnerId("10.0.0.9:50050", "aa11"))
OTHER = str(OwnerId("10.0.0.8:50050", "bb22"))


@dataclass
class FakeCheck:
    """Answers per address from `answers` (default True), counting checks; `gate` holds each
    check open until set, to see concurrent callers share one."""

    answers: dict[str, bool] = field(default_factory=dict)
    checked: list[str] = field(default_factory=list)
    gate: asyncio.Event | None = None

    async def __call__(self, owner: OwnerId) -> bool:
        self.checked.append(owner.address)
        if self.gate is not None:
            await self.gate.wait()
        return self.answers.get(owner.address, True)


def probe(check: FakeCheck, clock: FakeClock, max_failures: int = 2, cache_s: float = 0.5) -> OwnerProbe:
    return OwnerProbe(check, OwnerProbeConfig(max_failures, cache_s), clock=clock, sleep=clock.sleep)


def test_an_owner_is_gone_after_two_failed_checks_in_a_row_and_back_after_an_answer() -> None:
    async def main() -> None:
        clock, check = FakeClock(100.0), FakeCheck({"10.0.0.9:50050": False})
        p = probe(check, clock)
        assert not await p.is_gone(OWNER)  # one failure: suspect, not gone
        assert not await p.is_gone(OWNER)  # the verdict is cached: no second check yet
        assert len(check.checked) == 1
        clock.now += 0.5
        assert await p.is_gone(OWNER)
        assert len(check.checked) == 2
        check.answers["10.0.0.9:50050"] = True  # it was a blip
        clock.now += 0.5
        assert not await p.is_gone(OWNER)
        check.answers["10.0.0.9:50050"] = False
        clock.now += 0.5
        assert not await p.is_gone(OWNER)  # the count starts again

    asyncio.run(main())


def test_a_live_owner_is_never_gone_and_owners_are_judged_apart() -> None:
    async def main() -> None:
        clock, check = FakeClock(100.0), FakeCheck({"10.0.0.8:50050": False})
        p = probe(check, clock)
        for _ in range(4):
            assert not await p.is_gone(OWNER)
            await p.is_gone(OTHER)
            clock.now += 0.5
        assert await p.is_gone(OTHER)
        assert not await p.is_gone(OWNER)

    asyncio.run(main())


def test_concurrent_askers_share_one_check() -> None:
    async def main() -> None:
        clock, check = FakeClock(100.0), FakeCheck({"10.0.0.9:50050": False}, gate=asyncio.Event())
        p = probe(check, clock)
        askers = [asyncio.ensure_future(p.is_gone(OWNER)) for _ in range(32)]
        await asyncio.sleep(0)
        check.gate.set()
        assert await asyncio.gather(*askers) == [False] * 32
        assert len(check.checked) == 1

    asyncio.run(main())


def test_a_cancelled_asker_does_not_cancel_the_shared_check() -> None:
    async def main() -> None:
        clock, check = FakeClock(100.0), FakeCheck({"10.0.0.9:50050": False}, gate=asyncio.Event())
        p = probe(check, clock)
        first = asyncio.ensure_future(p.is_gone(OWNER))
        second = asyncio.ensure_future(p.is_gone(OWNER))
        await asyncio.sleep(0)
        first.cancel()
        check.gate.set()
        assert not await second
        clock.now += 0.5
        assert await p.is_gone(OWNER)  # the first check counted
        assert len(check.checked) == 2

    asyncio.run(main())


def test_an_owner_that_names_no_instance_is_never_checked() -> None:
    async def main() -> None:
        clock, check = FakeClock(100.0), FakeCheck()
        p = probe(check, clock)
        assert not await p.is_gone("gw-1")
        assert not await p.is_gone("")
        assert check.checked == []

    asyncio.run(main())


def test_a_patient_asker_waits_for_the_second_check() -> None:
    async def main() -> None:
        clock, check = FakeClock(100.0), FakeCheck({"10.0.0.9:50050": False})
        p = probe(check, clock)
        assert await p.is_gone_after_checks(OWNER)
        assert len(check.checked) == 2 and clock.now == 100.5  # waited out one verdict's life
        check.answers["10.0.0.9:50050"] = True
        clock.now += 0.5
        assert not await p.is_gone_after_checks(OTHER)  # answers at once: no waiting
        assert clock.now == 101.0

    asyncio.run(main())


def test_a_check_that_raises_counts_as_an_answer() -> None:
    async def broken(_owner: OwnerId) -> bool:
        raise RuntimeError("no event loop for channels")

    async def main() -> None:
        clock = FakeClock(100.0)
        p = OwnerProbe(broken, OwnerProbeConfig(max_failures=1, cache_s=0.0), clock=clock)
        assert not await p.is_gone(OWNER)

    asyncio.run(main())
