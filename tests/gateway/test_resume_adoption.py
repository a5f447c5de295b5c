"""Which stored requests a gateway adopts (gateway.resume.Resumption.adopt_if_abandoned) and that
one gateway at a time runs each: unowned for a lease; held by a gateway that failed two health
checks (a fake check); held at start-up by an earlier instance at this gateway's own address; never
one whose owner answers. The takeover is the store's compare-and-set, and the owner it was taken
from is fenced (OwnerFencedStore)."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest
import structlog

from gateway.config import Limits, SpeculationDefaults
from gateway.fenced_store import OwnerFencedStore
from gateway.owner_id import OwnerId
from gateway.owner_probe import OwnerProbe, OwnerProbeConfig
from gateway.params import params_to_json
from gateway.resume import Resumption
from specdec.errors import FailedPrecondition
from specdec.state_store import (
    AsyncInMemoryStateStore,
    InMemoryStateStore,
    RequestState,
    RequestStatus,
    StateStoreConfig,
)
from specdec.state_store.types import record_corrupt
from specdec.v1 import gateway_pb2
from tests.gateway.fake_clock import FakeClock

LEASE_S = 30.0
HERE = OwnerId("10.0.0.1:50050", "1111")
EARLIER_HERE = OwnerId("10.0.0.1:50050", "0000")  # the process that held this address before
DEAD = OwnerId("10.0.0.2:50050", "2222")
ALIVE = OwnerId("10.0.0.3:50050", "3333")


class Adopter(Resumption):
    """The adoption rules of Resumption over a real store; adopt takes the lease as the servicer's
    does (claim, or take_over from dead_owner) and records it instead of starting a loop."""

    def __init__(self, store: AsyncInMemoryStateStore, owner: OwnerId, probe: OwnerProbe | None) -> None:
        self.store, self.owner, self.owner_probe = store, str(owner), probe
        self.config = types.SimpleNamespace(owner_lease_s=LEASE_S)
        self.log = structlog.get_logger("test")
        self.adopted: list[tuple[str, str]] = []

    async def adopt(self, request_id: str, dead_owner: str = "") -> bool:
        if dead_owner:
            is_taken = await self.store.take_over(request_id, self.owner, dead_owner)
        else:
            is_taken = await self.store.claim(request_id, self.owner)
        if is_taken:
            self.adopted.append((request_id, dead_owner))
        return is_taken


def fixture() -> tuple[AsyncInMemoryStateStore, FakeClock, list[str]]:
    """A store with r-dead (held by DEAD), r-alive (ALIVE), r-earlier (EARLIER_HERE), r-new (unowned,
    just created); a clock; the addresses checked."""
    owners = (("r-dead", DEAD), ("r-alive", ALIVE), ("r-earlier", EARLIER_HERE), ("r-new", None))
    return running(InMemoryStateStore(StateStoreConfig(lease_s=LEASE_S)), owners), FakeClock(), []


def running(sync: InMemoryStateStore, owners: tuple[tuple[str, OwnerId | None], ...]) -> AsyncInMemoryStateStore:
    """sync, with a RUNNING request per (request id, owner) in that order, claimed by its owner
    (None: unowned), as an AsyncStateStore."""
    store = AsyncInMemoryStateStore(sync)
    for request_id, owner in owners:
        store.sync.create(request_id, {}, prompt_token_ids=[1], status=RequestStatus.RUNNING)
        if owner is not None:
            assert store.sync.claim(request_id, str(owner))
    return store


def probe_of(clock: FakeClock, checked: list[str]) -> OwnerProbe:
    async def check(owner: OwnerId) -> bool:
        checked.append(owner.address)
        return owner != DEAD

    return OwnerProbe(check, OwnerProbeConfig(max_failures=2, cache_s=0.5), clock=clock, sleep=clock.sleep)


async def offer(gateway: Adopter, request_id: str, **kwargs: bool) -> bool:
    state = await gateway.store.load(request_id)
    assert state is not None
    return await gateway.adopt_if_abandoned(state, **kwargs)


def test_a_follower_adopts_a_request_whose_owner_failed_two_checks() -> None:
    async def main() -> None:
        store, clock, checked = fixture()
        gateway = Adopter(store, HERE, probe_of(clock, checked))
        assert not await offer(gateway, "r-dead")  # one failed check: suspect
        assert not await offer(gateway, "r-dead")  # cached verdict: no new check
        assert checked == ["10.0.0.2:50050"]
        clock.now += 0.5
        assert await offer(gateway, "r-dead")
        assert gateway.adopted == [("r-dead", str(DEAD))]
        assert store.sync.load("r-dead").owner == str(HERE)
        assert not await offer(gateway, "r-dead")  # its own now

    asyncio.run(main())


def test_a_request_whose_owner_answers_is_never_adopted() -> None:
    async def main() -> None:
        store, clock, checked = fixture()
        gateway = Adopter(store, HERE, probe_of(clock, checked))
        for _ in range(3):
            assert not await offer(gateway, "r-alive", is_patient=True)
            clock.now += 1.0
        assert not await offer(gateway, "r-new")  # unowned but written within a lease: its gateway claims it
        assert gateway.adopted == [] and store.sync.load("r-alive").owner == str(ALIVE)

    asyncio.run(main())


def test_the_heartbeat_waits_for_the_second_check() -> None:
    async def main() -> None:
        store, clock, checked = fixture()
        gateway = Adopter(store, HERE, probe_of(clock, checked))
        assert await offer(gateway, "r-dead", is_patient=True)
        assert checked == ["10.0.0.2:50050"] * 2 and clock.now == 0.5

    asyncio.run(main())


def test_of_two_gateways_that_found_the_owner_gone_one_takes_the_request() -> None:
    async def main() -> None:
        store, clock, checked = fixture()
        first = Adopter(store, HERE, probe_of(clock, checked))
        second = Adopter(store, ALIVE, probe_of(clock, checked))
        results = await asyncio.gather(*(offer(g, "r-dead", is_patient=True) for g in (first, second)))
        assert sorted(results) == [False, True]
        winner = first if results[0] else second
        assert store.sync.load("r-dead").owner == winner.owner

    asyncio.run(main())


def test_at_start_up_a_gateway_takes_the_requests_of_an_earlier_instance_at_its_address() -> None:
    async def main() -> None:
        store, clock, checked = fixture()
        gateway = Adopter(store, HERE, probe_of(clock, checked))
        assert not await offer(gateway, "r-earlier")  # later on, an owner like any other (it answers here)
        assert await offer(gateway, "r-earlier", is_starting=True)  # no check: this process holds its port
        assert gateway.adopted == [("r-earlier", str(EARLIER_HERE))]
        resumed = await gateway.resume_active()  # the rest: the dead owner's after its checks
        assert resumed == ["r-dead"]
        assert {r for r, _ in gateway.adopted} == {"r-earlier", "r-dead"}

    asyncio.run(main())


def test_without_a_probe_only_an_expired_lease_frees_a_request() -> None:
    async def main() -> None:
        store, _clock, _checked = fixture()
        gateway = Adopter(store, HERE, None)
        assert not await offer(gateway, "r-dead", is_patient=True)
        assert await offer(gateway, "r-earlier", is_starting=True)  # the address rule needs no probe

    asyncio.run(main())


def test_the_owner_a_request_was_taken_from_is_refused_and_writes_no_end() -> None:
    """A gateway found gone that was alive after all: its next step and its end are refused, so the
    adopter's run goes on and its tokens are the only ones stored."""

    async def main() -> None:
        store, _clock, _checked = fixture()
        old, new = OwnerFencedStore(store, str(DEAD)), OwnerFencedStore(store, str(HERE))
        assert await old.append_step("r-dead", [5], expected_num_tokens=0, owner=str(DEAD)) == 1
        assert await store.take_over("r-dead", str(HERE), str(DEAD))
        with pytest.raises(FailedPrecondition, match="owner"):
            await old.append_step("r-dead", [6], expected_num_tokens=1, owner=str(DEAD))
        assert not await old.set_status("r-dead", RequestStatus.CANCELLED, finish_reason="cancelled")
        assert await new.append_step("r-dead", [6], expected_num_tokens=1, owner=str(HERE)) == 2
        assert await new.set_status("r-dead", RequestStatus.FINISHED, finish_reason="length")
        state = store.sync.load("r-dead")
        assert (state.status, state.token_ids, state.finish_reason) == (RequestStatus.FINISHED, (5, 6), "length")
        # a client's Cancel, on any gateway, still goes through the plain store
        assert await store.set_status("r-alive", RequestStatus.CANCELLED, finish_reason="cancelled")

    asyncio.run(main())


class UnreadableStore(InMemoryStateStore):
    """r-bad's record cannot be read back (a bug or an operator wrote it)."""

    def load(self, request_id: str) -> RequestState | None:
        if request_id == "r-bad":
            raise record_corrupt(request_id, "params", "is missing")
        return super().load(request_id)


def test_a_record_that_cannot_be_read_holds_up_no_other_request() -> None:
    """One corrupt record, listed first, neither stops a gateway's start nor its heartbeat's
    adoptions of the requests listed after it."""

    async def main() -> None:
        owners = (("r-bad", DEAD), ("r-dead", DEAD), ("r-earlier", EARLIER_HERE))
        store = running(UnreadableStore(StateStoreConfig(lease_s=LEASE_S)), owners)
        clock, checked = FakeClock(), []
        gateway = Adopter(store, HERE, probe_of(clock, checked))
        assert await gateway.adopt_abandoned() == ["r-dead"]  # the heartbeat's sweep
        assert await gateway.resume_active() == ["r-earlier"]  # a start-up's

    asyncio.run(main())


class StumblingAdopter(Adopter):
    """Cannot run r-bad: its stored stats are no numbers, say (RequestStats.of_record raises)."""

    async def adopt(self, request_id: str, dead_owner: str = "") -> bool:
        if request_id == "r-bad":
            raise TypeError("unsupported operand type(s) for -: 'int' and 'str'")
        return await super().adopt(request_id, dead_owner)


def test_a_request_that_cannot_be_adopted_holds_up_no_other_request() -> None:
    """Whatever one adoption raises, a start-up (which would fail, and fail again at every restart)
    and a sweep go on to the requests listed after it."""

    async def main() -> None:
        owners = (("r-bad", EARLIER_HERE), ("r-earlier", EARLIER_HERE), ("r-dead", DEAD))
        store = running(InMemoryStateStore(StateStoreConfig(lease_s=LEASE_S)), owners)
        clock, checked = FakeClock(), []
        gateway = StumblingAdopter(store, HERE, probe_of(clock, checked))
        assert await gateway.resume_active() == ["r-earlier", "r-dead"]

    asyncio.run(main())


class Runner(Resumption):
    """Resumption's own adopt over a real store, recording the parameters each adopted request's loop
    would run with instead of running it."""

    def __init__(self, store: AsyncInMemoryStateStore) -> None:
        self.store, self.owner, self.owner_probe = store, str(HERE), None
        self.config = types.SimpleNamespace(owner_lease_s=LEASE_S, limits=Limits(), speculation=SpeculationDefaults())
        self._offered_strategies, self._lock, self._active = None, threading.Lock(), {}
        self.log = structlog.get_logger("test")
        self.ran: list = []

    def _run_adopted(self, request_id, params, state, cancel, grammar) -> None:
        self.ran.append(params)


def test_an_adopted_request_computes_no_log_probabilities() -> None:
    """Its steps reach its followers only through the store, which keeps no log probabilities (before,
    its loop asked the primary for them at every step, and for the prompt's at its prefill, for nobody)."""
    request = gateway_pb2.GenerateRequest(request_id="r-lp", prompt="Say hello", max_new_tokens=8)
    request.logprobs.num_top_logprobs = 2
    request.logprobs.include_prompt = True
    store = AsyncInMemoryStateStore(InMemoryStateStore(StateStoreConfig(lease_s=LEASE_S)))
    store.sync.create("r-lp", params_to_json(request), prompt_token_ids=[1, 2], status=RequestStatus.RUNNING)
    gateway = Runner(store)
    assert asyncio.run(gateway.adopt("r-lp"))
    [params] = gateway.ran
    assert params.logprobs is None and params.max_new_tokens == 8
