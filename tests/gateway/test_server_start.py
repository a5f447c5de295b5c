"""The gateway's way in and out: a request stored before its loop exists is never left RUNNING or
QUEUED when its client goes away, or the loop cannot be made, in between (GenerationServicer._start);
a gateway that shuts down stores its running requests as ended (stop_loops); a record the store
lost (a Redis restarted without persistence) never tells the client NOT_FOUND about its own request."""

from __future__ import annotations

import asyncio
import threading
import types

import pytest
import structlog
from prometheus_client import CollectorRegistry

from gateway.admission import Admission, QueueFull
from gateway.backends import Decoded, ModelInfo, Prefilled
from gateway.loop import RequestLoop
from gateway.metrics import GatewayMetrics
from gateway.params import GenerationParams, SpeculationParams, params_to_json
from gateway.server import GenerationServicer, _Retried
from gateway.state_retry import DEFAULT_MAX_STATE_RETRY_S
from gateway.stats import RequestStats
from specdec.errors import AlreadyExists, ResourceExhausted, Unavailable
from specdec.sampling import SamplingParams
from specdec.state_store import AsyncInMemoryStateStore
from specdec.state_store.memory import InMemoryStateStore
from specdec.state_store.types import RequestStatus
from specdec.v1 import gateway_pb2


class Context:
    def time_remaining(self):
        return None

    def add_done_callback(self, _fn) -> None:
        pass


class GatedStore(AsyncInMemoryStateStore):
    """Holds the write `gated` ("create", or "running": the queue's move to RUNNING) open until
    `opened` is set; `entered` says it is held."""

    def __init__(self, gated: str) -> None:
        super().__init__(InMemoryStateStore())
        self.gated, self.entered, self.opened = gated, asyncio.Event(), asyncio.Event()

    async def _gate(self, name: str) -> None:
        if name == self.gated:
            self.entered.set()
            await self.opened.wait()

    async def create(self, *args, **kwargs):
        await self._gate("create")
        return await super().create(*args, **kwargs)

    async def set_status(self, request_id, status, **kwargs):
        await self._gate("running" if status == RequestStatus.RUNNING else "")
        return await super().set_status(request_id, status, **kwargs)


def servicer(store: AsyncInMemoryStateStore, admission: Admission, make_loop) -> GenerationServicer:
    """A servicer with only what _start touches: the store, admission, and a make_loop under test."""
    s = GenerationServicer.__new__(GenerationServicer)
    s.store, s.admission, s.api_keys, s.metrics = store, admission, None, None
    s.max_state_retry_s = DEFAULT_MAX_STATE_RETRY_S
    s._active, s._lock, s._background = {}, threading.Lock(), set()
    s.log = structlog.get_logger("test")
    s._prepare = lambda request, client_id, deadline, offered: (None, [1, 2, 3], None, request)

    async def no_pool(remaining_s: float | None = None) -> None:  # the draft pool not reached: its offer unknown
        return None

    s._offered_by_pool = no_pool
    s.make_loop = make_loop
    return s


async def settle(s: GenerationServicer) -> None:
    while s._background:
        await asyncio.gather(*list(s._background), return_exceptions=True)


@pytest.mark.parametrize("gated", ["create", "running"])
def test_a_client_gone_before_its_loop_exists_is_stored_cancelled(gated: str) -> None:
    """The client leaves while the request is being stored (let in at once), or while the queue's
    move to RUNNING is in flight (queued, then let in)."""
    admission = Admission(max_active=1, max_queued=4)
    holder = admission.enter("") if gated == "running" else None

    def make_loop(*_args, **_kwargs):
        raise AssertionError("the loop is not made: its client went away")

    async def main() -> GatedStore:
        store = GatedStore(gated)
        s = servicer(store, admission, make_loop)
        task = asyncio.ensure_future(
            s._start(gateway_pb2.GenerateRequest(request_id="r1"), Context(), is_streamed=False)
        )
        if holder is not None:  # queued behind holder; let in when holder leaves
            while await store.load("r1") is None:
                await asyncio.sleep(0.01)
            assert (await store.load("r1")).status == RequestStatus.QUEUED
            holder.release()
        await store.entered.wait()
        task.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        store.opened.set()
        for _ in range(500):  # the held write goes on, then the cancel is written behind it
            state = store.sync.load("r1")
            if state is not None and state.status.is_terminal and not s._background:
                break
            await asyncio.sleep(0.01)
        assert s._active == {}
        return store

    store = asyncio.run(main())
    assert store.sync.load("r1").status == RequestStatus.CANCELLED
    assert (admission.num_active, admission.num_queued) == (0, 0)


def test_a_loop_that_cannot_be_made_leaves_the_request_failed() -> None:
    store, admission = InMemoryStateStore(), Admission(max_active=1, max_queued=4)

    def make_loop(*_args, **_kwargs):
        raise RuntimeError("no loop today")

    s = servicer(AsyncInMemoryStateStore(store), admission, make_loop)

    async def main() -> None:
        with pytest.raises(RuntimeError):
            await s._start(gateway_pb2.GenerateRequest(request_id="r2"), Context(), is_streamed=False)
        await settle(s)

    asyncio.run(main())
    state = store.load("r2")
    assert state.status == RequestStatus.FAILED and "no loop today" in state.error
    assert admission.num_active == 0


class SlowPrimary:
    """A primary whose every Decode takes 20 ms and never ends the request (plain steps only)."""

    num_decodes = 0

    async def prefill(self, request_id, token_ids, num_prompt_tokens=0) -> Prefilled:
        return Prefilled(0.0, 0)

    async def decode(
        self, request_id, accepted_nodes, committed_token_ids, sampling, step, allowed=None, **_
    ) -> Decoded:
        self.num_decodes += 1
        await asyncio.sleep(0.02)
        return Decoded(7, 20.0)

    async def decode_stream(self, *args, **kwargs):
        """decode's run as the primary streams it: one message per token, the last ending the run."""
        decoded = await self.decode(*args, **kwargs)
        yield decoded

    async def release_primary(self, request_id) -> None:
        pass

    async def release_draft(self, request_id, is_finished, new_token_ids=()) -> None:
        pass


class Tokens:
    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "x" * len(token_ids)


def test_stopping_the_gateway_stores_each_running_request_cancelled() -> None:
    """At shutdown stop_loops cancels the running loops and waits until each stored its end: no
    request is left RUNNING when the gateway's connections close."""
    store = InMemoryStateStore()
    admission = Admission(max_active=4, max_queued=4)
    s = servicer(AsyncInMemoryStateStore(store), admission, None)
    spec = SpeculationParams(False, 1, 1, 0.0, (), None, False)
    params = GenerationParams("p", None, 100_000, (), SamplingParams(), spec)
    model = ModelInfo(50, (49,), 1_000_000, "fake", verify_costs_ms={})
    primary = SlowPrimary()

    async def main() -> None:
        consumers = []
        for rid in ("a", "b"):
            store.create(rid, {}, prompt_token_ids=[1, 2, 3], status=RequestStatus.RUNNING)
            cancel = s._active[rid] = threading.Event()
            loop = RequestLoop(
                rid, params, [1, 2, 3], primary, s.store, Tokens(), model, ("fp32", "fp32"), 1.0, 8, cancel, "gw"
            )

            async def consume(loop=loop) -> None:  # the call's coroutine: still streaming at shutdown
                async for _ in s._run(loop, loop.request_id, admission.enter("")):
                    pass

            consumers.append(asyncio.ensure_future(consume()))
        while primary.num_decodes < 6:
            await asyncio.sleep(0.01)
        await s.stop_loops(timeout_s=5.0)
        assert not s._background and s._active == {}
        await asyncio.gather(*consumers)

    asyncio.run(main())
    assert [store.load(r).status for r in ("a", "b")] == [RequestStatus.CANCELLED] * 2
    assert (admission.num_active, admission.num_queued) == (0, 0)


class LosingStore(AsyncInMemoryStateStore):
    """Loses the request's record (a Redis restarted without persistence) just before the queue's
    move to RUNNING."""

    def __init__(self) -> None:
        super().__init__(InMemoryStateStore())

    async def set_status(self, request_id, status, **kwargs):
        if status == RequestStatus.RUNNING:
            self.sync.delete(request_id)
        return await super().set_status(request_id, status, **kwargs)


class EndingPrimary(SlowPrimary):
    """SlowPrimary whose fourth decode ends the request (its token is the model's end of sequence)."""

    async def decode(self, *args, **kwargs) -> Decoded:
        decoded = await super().decode(*args, **kwargs)
        return Decoded(49, 20.0) if self.num_decodes == 4 else decoded


def test_an_adopted_requests_steps_and_end_count_in_the_adopters_metrics() -> None:
    """A request adopted from a gone gateway runs here: its steps, new tokens and end go into this
    gateway's metrics (before: none of them did), while its prompt and its client's latencies (first
    token, end to end), the first gateway's to measure, are not counted again."""
    store, registry = InMemoryStateStore(), CollectorRegistry()
    admission = Admission(max_active=1, max_queued=1)
    s = servicer(AsyncInMemoryStateStore(store), admission, None)
    s.metrics = GatewayMetrics(registry)
    spec = SpeculationParams(False, 1, 1, 0.0, (), None, False)
    params = GenerationParams("p", None, 100, (), SamplingParams(), spec)
    model = ModelInfo(50, (49,), 1_000_000, "fake", verify_costs_ms={})
    store.create("adopted", {}, prompt_token_ids=[1, 2, 3], status=RequestStatus.RUNNING)
    store.append_step("adopted", [5, 6])  # what the first gateway generated
    cancel = s._active["adopted"] = threading.Event()
    loop = RequestLoop(
        "adopted", params, [1, 2, 3], EndingPrimary(), s.store, Tokens(), model, ("fp32", "fp32"), 1.0, 8, cancel,
        "gw", generated=[5, 6],
    )  # fmt: skip

    asyncio.run(s._resumed(loop, admission.enter("")))
    state = store.load("adopted")
    assert state.status == RequestStatus.FINISHED
    assert list(state.token_ids) == [5, 6, 7, 7, 7]  # the end of sequence token is not stored

    def value(name: str, labels: dict[str, str] | None = None) -> float | None:
        return registry.get_sample_value(f"specdec_{name}", labels or {})

    assert value("generation_tokens_total") == 3  # the adopter's three, not the first gateway's two
    assert value("request_success_total", {"finished_reason": "eos"}) == 1
    assert value("steps_total") == 4
    assert value("prompt_tokens_total") == 0
    assert value("time_to_first_token_seconds_count") == 0 and value("e2e_request_latency_seconds_count") == 0
    assert admission.num_active == 0 and s._active == {}


def test_a_queued_request_whose_record_the_store_lost_still_runs() -> None:
    """Its loop is made with the parameters as stored, which its first write stores again (before:
    the client was told NOT_FOUND "no stored request" about its own request)."""
    admission = Admission(max_active=1, max_queued=4)
    holder = admission.enter("")
    made = {}
    made_loop = types.SimpleNamespace(stats=RequestStats())

    def make_loop(request_id, *_args, **kwargs):
        made[request_id] = kwargs["stored_params"]
        return made_loop

    async def main() -> None:
        store = LosingStore()
        s = servicer(store, admission, make_loop)
        request = gateway_pb2.GenerateRequest(request_id="r3", prompt="hi")
        task = asyncio.ensure_future(s._start(request, Context(), is_streamed=False))
        while await store.load("r3") is None:
            await asyncio.sleep(0.01)
        holder.release()
        client_id, loop, ticket = await task
        assert client_id == "r3" and loop is made_loop and await store.load("r3") is None
        assert made == {"r3": params_to_json(request)}
        ticket.release()

    asyncio.run(main())


def test_cancelling_a_request_running_here_whose_record_the_store_lost_stops_it() -> None:
    s = servicer(AsyncInMemoryStateStore(InMemoryStateStore()), Admission(max_active=1, max_queued=4), None)
    cancel = s._active["r4"] = threading.Event()

    async def main() -> gateway_pb2.CancelResponse:
        return await s.Cancel(gateway_pb2.CancelRequest(request_id="r4"), Context())

    assert asyncio.run(main()).was_active and cancel.is_set()


class StallingStore(AsyncInMemoryStateStore):
    """A Redis that stalled: the first `num_timeouts` calls of `stalled` ("create" or "running")
    time out (Unavailable), each after the command reached the server when `is_landing` (a stalled
    Redis runs it once it resumes)."""

    def __init__(self, stalled: str, num_timeouts: int = 1, is_landing: bool = False) -> None:
        super().__init__(InMemoryStateStore())
        self.stalled, self.num_timeouts, self.is_landing, self.num_calls = stalled, num_timeouts, is_landing, 0

    async def _stall(self, name: str, write) -> object:
        if name != self.stalled:
            return await write()
        self.num_calls += 1
        if self.num_calls > self.num_timeouts:
            return await write()
        if self.is_landing:
            await write()
        raise Unavailable("state_store", "Redis unreachable: Timeout reading from socket", dependency="state_store")

    async def create(self, *args, **kwargs):
        return await self._stall("create", lambda: super(StallingStore, self).create(*args, **kwargs))

    async def set_status(self, request_id, status, **kwargs):
        name = "running" if status == RequestStatus.RUNNING else ""
        return await self._stall(name, lambda: super(StallingStore, self).set_status(request_id, status, **kwargs))


def start_one(store: AsyncInMemoryStateStore, admission: Admission, request_id: str = "r5") -> str:
    """_start a request against store; its client id once its loop is made (the loop is not run)."""
    made_loop = types.SimpleNamespace(stats=RequestStats())

    async def main() -> str:
        s = servicer(store, admission, lambda *_args, **_kwargs: made_loop)
        client_id, loop, ticket = await s._start(
            gateway_pb2.GenerateRequest(request_id=request_id), Context(), is_streamed=False
        )
        assert loop is made_loop
        ticket.release()
        return client_id

    return asyncio.run(main())


@pytest.mark.parametrize("is_landing", [False, True])
def test_a_request_arriving_while_the_store_stalls_is_stored_once_it_answers(is_landing: bool) -> None:
    """The store times out on the request's create (twice), then answers: the request starts (before:
    UNAVAILABLE at the first timeout). A create that landed although it timed out is not refused as
    ALREADY_EXISTS on the retry."""
    store = StallingStore("create", num_timeouts=2, is_landing=is_landing)
    assert start_one(store, Admission(max_active=1, max_queued=4)) == "r5"
    # landed: the second attempt finds the first's record, the request's own, and stops there
    assert store.num_calls == (2 if is_landing else 3)
    assert store.sync.load("r5").status == RequestStatus.RUNNING


def test_a_retried_create_still_refuses_another_request_with_the_same_id() -> None:
    store = StallingStore("create", num_timeouts=1)
    store.sync.create("r5", {"prompt": "someone else's"}, prompt_token_ids=[9], status=RequestStatus.RUNNING)
    with pytest.raises(AlreadyExists):
        start_one(store, Admission(max_active=1, max_queued=4))


def test_a_queued_request_let_in_while_the_store_stalls_runs_once_it_answers() -> None:
    """The queue's move to RUNNING times out once (before: the request failed UNAVAILABLE)."""
    admission = Admission(max_active=1, max_queued=4)
    holder = admission.enter("")
    store = StallingStore("running", num_timeouts=1)
    made_loop = types.SimpleNamespace(stats=RequestStats())

    async def main() -> None:
        s = servicer(store, admission, lambda *_args, **_kwargs: made_loop)
        task = asyncio.ensure_future(
            s._start(gateway_pb2.GenerateRequest(request_id="r6"), Context(), is_streamed=False)
        )
        while await store.load("r6") is None:
            await asyncio.sleep(0.01)
        holder.release()
        _client_id, loop, ticket = await task
        assert loop is made_loop
        ticket.release()

    asyncio.run(main())
    assert store.num_calls == 2 and store.sync.load("r6").status == RequestStatus.RUNNING


def test_a_retry_that_reaches_a_failing_over_store_follows_the_running_request_it_finds() -> None:
    """The client's retry of a running request (its gateway died) meets a Redis failing over: the first
    create fails, the second finds the request. It has tokens and an owner, so it is not this call's
    own create that landed: the call follows it (before: a second loop started it again from no
    tokens)."""
    store = StallingStore("create", num_timeouts=1)
    request = gateway_pb2.GenerateRequest(request_id="r7")
    store.sync.create("r7", params_to_json(request), prompt_token_ids=[1, 2, 3], status=RequestStatus.RUNNING)
    store.sync.append_step("r7", [4, 5], owner="gateway@10.0.0.2:50050#dead")
    loaded = store.load

    async def failing_over_load(request_id: str):  # the first read (is it a retry?) meets the failover too
        store.load = loaded
        raise Unavailable("state_store", "Redis unreachable: Timeout reading from socket", dependency="state_store")

    store.load = failing_over_load

    async def main() -> None:
        s = servicer(store, Admission(max_active=1, max_queued=4), lambda *_args, **_kwargs: None)
        with pytest.raises(_Retried):
            await s._start(request, Context(), is_streamed=False)

    asyncio.run(main())
    assert store.num_calls == 2 and store.sync.load("r7").token_ids == (4, 5)


def test_a_retry_of_a_stored_request_follows_it_though_the_admission_queue_is_full() -> None:
    """It takes no slot (before: RESOURCE_EXHAUSTED while its gateway's load filled this one); a new
    request is still refused."""
    admission = Admission(max_active=1, max_queued=0)
    holder = admission.enter("")
    store = AsyncInMemoryStateStore(InMemoryStateStore())
    request = gateway_pb2.GenerateRequest(request_id="r8")
    store.sync.create("r8", params_to_json(request), prompt_token_ids=[1, 2, 3], status=RequestStatus.RUNNING)
    store.sync.append_step("r8", [4, 5], owner="gateway@10.0.0.2:50050#1")
    trailers = []
    context = Context()
    context.set_trailing_metadata = trailers.append

    async def main() -> None:
        s = servicer(store, admission, lambda *_args, **_kwargs: None)
        with pytest.raises(_Retried):
            await s._start(request, context, is_streamed=False)
        with pytest.raises(QueueFull):
            await s._start(gateway_pb2.GenerateRequest(request_id="r9"), context, is_streamed=False)

    asyncio.run(main())
    assert len(trailers) == 1 and store.sync.load("r9") is None
    holder.release()


def test_a_retry_of_a_stored_request_follows_it_without_a_new_requests_preparation() -> None:
    """The client's retry of a stored request (same id, parameters and prompt) follows it at once: it
    waits for no pool offer and is not refused by the checks and compile of a new request (here a
    schema's compile refused as too slow; likewise strategies this gateway's pool does not offer),
    which it does not run again (before: refused with that error). Another request under the id is
    still checked."""
    request = gateway_pb2.GenerateRequest(request_id="r8", prompt="hi")
    store = AsyncInMemoryStateStore(InMemoryStateStore())
    store.sync.create("r8", params_to_json(request), prompt_token_ids=[1, 2, 3], status=RequestStatus.RUNNING)
    store.sync.append_step("r8", [4, 5])
    store.sync.set_status("r8", RequestStatus.FINISHED, finish_reason="length")
    s = servicer(store, Admission(max_active=1, max_queued=4), None)
    asked: list[str] = []

    def refused(request, *_args):
        asked.append("prepare")
        raise ResourceExhausted("response_format.json_schema", "took longer than 10.0 s to compile into a grammar")

    async def pool(remaining_s: float | None = None) -> None:
        asked.append("pool")

    s._prepare, s._offered_by_pool = refused, pool
    with pytest.raises(_Retried):
        asyncio.run(s._start(request, Context(), is_streamed=False))
    assert asked == []
    other = gateway_pb2.GenerateRequest(request_id="r8", prompt="something else")
    with pytest.raises(ResourceExhausted):
        asyncio.run(s._start(other, Context(), is_streamed=False))
    assert asked == ["pool", "prepare"]
