"""An adopted request with a response format (gateway.resume.Resumption.adopt): its schema compiles
off the event loop, with no call's deadline and past a full compile queue, before its loop starts;
a schema the gateway now refuses ends the request FAILED instead of leaving it claimed and never run.
The store and the grammar bookkeeping are real; the compile is a stand-in that waits for the test."""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any

import pytest
import structlog

from gateway.config import Limits, SpeculationDefaults
from gateway.params import params_to_json
from gateway.resume import Resumption
from specdec.errors import InvalidArgument, Unavailable
from specdec.grammar import ResponseFormat
from specdec.grammar.compiling import Grammars, GrammarSettings
from specdec.state_store import AsyncInMemoryStateStore, InMemoryStateStore, RequestStatus, StateStoreConfig
from specdec.v1 import common_pb2, gateway_pb2

WAIT_S = 10.0  # the longest a test waits for what it expects (a failing test stops here)
SCHEMA = '{"type": "object"}'
UNCOMPILABLE = '{"type": "object", "description": "refused by the compiler"}'


class Compiled:
    def __init__(self, schema_text: str) -> None:
        self.schema_text = schema_text

    def new_state(self) -> tuple[str, str]:
        return ("state of", self.schema_text)


class HeldCache:
    """Stands in for GrammarCache: a compile waits until `release` is set; UNCOMPILABLE is refused."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def cached(self, response_format: ResponseFormat) -> None:
        return None

    def compile(self, response_format: ResponseFormat) -> Compiled:
        if response_format.schema_text == UNCOMPILABLE:
            raise InvalidArgument("response_format.json_schema", "uses a feature the grammar engine lacks")
        assert self.release.wait(WAIT_S)
        return Compiled(response_format.schema_text)


class Ticket:
    async def wait_async(self, deadline: Any, cancel: Any, request_id: str) -> float:
        return 0.0

    def release(self) -> None:
        pass


class Loop:
    def __init__(self, request_id: str) -> None:
        self.request_id, self.node_id = request_id, ""

    async def run(self):  # noqa: ANN201 - an async generator of nothing
        return
        yield


class Gateway(Resumption):
    """Resumption's real adopt() over a real store and Grammars; the loop it makes is recorded."""

    def __init__(self, grammars: Grammars) -> None:
        self.store = AsyncInMemoryStateStore(InMemoryStateStore(StateStoreConfig(lease_s=30)))
        self.config = types.SimpleNamespace(limits=Limits(), speculation=SpeculationDefaults(), owner_lease_s=30)
        self.grammars, self.owner, self.log = grammars, "gw-1", structlog.get_logger("test")
        self.backends = types.SimpleNamespace(adopt_kv_lease=lambda request_id, lease: None)
        self.admission = types.SimpleNamespace(enter=lambda key, is_accepted=False: Ticket())
        self._active: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._offered_strategies = None
        self._tasks: set[asyncio.Task] = set()
        self.grammar_of: dict[str, Any] = {}
        self.loop_made = asyncio.Event()

    def store_request(self, request_id: str, schema: str) -> None:
        req = gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=4)
        req.response_format.type = common_pb2.ResponseFormat.TYPE_JSON_SCHEMA
        req.response_format.json_schema = schema
        self.store.sync.create(request_id, params_to_json(req), prompt_token_ids=[1, 2], status=RequestStatus.RUNNING)

    def make_loop(self, request_id: str, *args: Any, **kwargs: Any) -> Loop:
        self.grammar_of[request_id] = args[7]
        self.loop_made.set()
        return Loop(request_id)

    def _place(self, request_id: str, prompt_ids: Any, stored_node: str = "") -> None:
        return None

    def _tenant_of(self, request_id: str) -> str:
        return ""

    def _in_background(self, coro: Any, name: str | None = None, *, is_logged: bool = True) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        return task

    def _end(self, request_id: str, ticket: Any) -> None:
        with self._lock:
            self._active.pop(request_id, None)


def test_an_adopted_requests_schema_compiles_off_the_event_loop_with_no_deadline() -> None:
    async def main() -> None:
        cache = HeldCache()
        gateway = Gateway(Grammars(cache, GrammarSettings(max_compile_s=0.05)))  # no call waits that long here
        gateway.store_request("r-1", SCHEMA)
        assert await asyncio.wait_for(gateway.adopt("r-1"), WAIT_S)  # returns while the compile is held
        assert "r-1" in gateway._active and not gateway.loop_made.is_set()
        await asyncio.sleep(0.2)  # well past max_compile_s: still compiling, nothing refused
        assert (await gateway.store.load("r-1")).status == RequestStatus.RUNNING
        cache.release.set()
        await asyncio.wait_for(gateway.loop_made.wait(), WAIT_S)
        assert gateway.grammar_of["r-1"] == ("state of", SCHEMA)
        gateway.grammars.close()

    asyncio.run(main())


def test_a_full_compile_queue_delays_the_adopted_request_instead_of_failing_it() -> None:
    async def main() -> None:
        cache = HeldCache()
        grammars = Grammars(cache, GrammarSettings(max_pending_compiles=1))
        other = grammars.start(ResponseFormat("json_schema", '{"type": "array"}'))  # fills the queue
        gateway = Gateway(grammars)
        gateway.store_request("r-1", SCHEMA)
        assert await gateway.adopt("r-1")
        await asyncio.sleep(0.1)
        assert not gateway.loop_made.is_set()
        cache.release.set()
        await asyncio.wait_for(asyncio.wrap_future(other), WAIT_S)
        await asyncio.wait_for(gateway.loop_made.wait(), WAIT_S)
        assert gateway.grammar_of["r-1"] == ("state of", SCHEMA)
        grammars.close()

    asyncio.run(main())


def test_a_schema_refused_on_adoption_fails_the_request_and_frees_it() -> None:
    async def main() -> None:
        gateway = Gateway(Grammars(HeldCache()))
        gateway.store_request("r-bad", UNCOMPILABLE)
        gateway.store_request("r-deep", "[" * 100 + "]" * 100)  # past this gateway's schema depth limit
        assert await gateway.adopt("r-bad")  # refused by the compile, in the background
        assert not await gateway.adopt("r-deep")  # refused by the request's checks, at once
        await asyncio.gather(*gateway._tasks)
        for request_id in ("r-bad", "r-deep"):
            state = await gateway.store.load(request_id)
            assert state.status == RequestStatus.FAILED and state.error.startswith("cannot resume here: ")
        assert gateway._active == {} and not gateway.loop_made.is_set()
        gateway.grammars.close()

    asyncio.run(main())


def test_stored_parameters_that_are_no_request_fail_the_adopted_request() -> None:
    """Parameters a bug or an operator wrote (a JSON object, but no GenerateRequest) end the request
    FAILED, naming why, rather than raising out of adopt (a start-up's resume_active would fail with it)."""

    async def main() -> None:
        gateway = Gateway(Grammars(HeldCache()))
        gateway.store.sync.create("r-1", {"no_such_field": 1}, prompt_token_ids=[1], status=RequestStatus.RUNNING)
        assert not await gateway.adopt("r-1")
        state = await gateway.store.load("r-1")
        assert state.status == RequestStatus.FAILED and "no_such_field" in state.error
        assert gateway._active == {} and not gateway.loop_made.is_set()
        gateway.grammars.close()

    asyncio.run(main())


class Unplaceable(Gateway):
    """No node is known yet (gateway.server._place, with --nodes)."""

    def _place(self, request_id: str, prompt_ids: Any, stored_node: str = "") -> None:
        raise Unavailable("request_id", f"request {request_id!r}: no node is known yet; retry later")


def test_an_adopted_request_that_cannot_start_is_not_kept_as_running_here() -> None:
    """keep_leases renews the lease of every request in _active: one whose loop never started must
    leave it, or its lease would be renewed for as long as this gateway lives, and no gateway would
    ever run it. Its lease then lapses, and it is adopted again."""

    async def main() -> None:
        cache = HeldCache()
        gateway = Unplaceable(Grammars(cache))
        req = gateway_pb2.GenerateRequest(prompt="hi", max_new_tokens=4)
        gateway.store.sync.create("r-plain", params_to_json(req), prompt_token_ids=[1], status=RequestStatus.RUNNING)
        gateway.store_request("r-schema", SCHEMA)
        with pytest.raises(Unavailable, match="no node"):
            await gateway.adopt("r-plain")
        assert await gateway.adopt("r-schema")  # its loop is made once the schema compiled, in a task
        cache.release.set()
        await asyncio.gather(*gateway._tasks, return_exceptions=True)
        assert gateway._active == {}
        gateway.grammars.close()

    asyncio.run(main())
