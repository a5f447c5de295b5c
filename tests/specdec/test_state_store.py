"""The request state store: one suite against the stores (Redis on a real server on a unix
socket, on a real 3-master Redis Cluster on loopback, and in memory, directly and through its
async face), plus Redis-only checks of key layout, round trips and recovery through a fresh
client. The async stores run the tests through SyncStateStore, as synchronous tools use them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis
import redis.asyncio

from specdec.redis_cluster import free_port_pairs, redis_cluster
from specdec.state_store.clients import open_async_client
from specdec.state_store.redis_url import parse_redis_url
from specdec.errors import AlreadyExists, FailedPrecondition, Internal, InvalidArgument, NotFound, Unavailable
from specdec.state_store import (
    DEFAULT_NAMESPACE,
    AsyncInMemoryStateStore,
    AsyncRedisStateStore,
    AsyncStateStore,
    InMemoryStateStore,
    RedisStateStore,
    RequestStatus,
    StateStoreConfig,
    SyncStateStore,
    decode_token_ids,
    encode_token_ids,
    open_async_state_store,
    open_state_store,
)

PARAMS = {"requestId": "r1", "prompt": "Hello", "maxNewTokens": 8, "sampling": {"temperature": 0.0}}
# Short enough to wait out on the real server.
SHORT_TTL_S = 0.3
SHORT_LEASE_S = 0.3
KINDS = ["memory", "memory-async", "redis", "cluster"]


@dataclass
class FakeClock:
    now: float = 1000.0
    wall_ms: int = 1_700_000_000_000
    history: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    """A store plus a way to let time pass: the fake clock for memory, real
    sleep for Redis (whose expiry runs on the server's clock)."""

    store: InMemoryStateStore | SyncStateStore
    clock: FakeClock
    kind: str
    backend: InMemoryStateStore | AsyncStateStore  # store itself, or the async store behind its facade
    redis_client: redis.Redis | None = None  # on the Redis store's server, to look at its keys

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        if self.redis_client is not None:
            time.sleep(seconds)


def make_harness(kind: str, request: pytest.FixtureRequest, config: StateStoreConfig) -> Harness:
    clock = FakeClock()
    wall_ms = lambda: clock.wall_ms  # noqa: E731 - a one-line clock
    if kind.startswith("memory"):
        memory = InMemoryStateStore(config, clock=clock, wall_clock_ms=wall_ms)
        if kind == "memory":
            return Harness(memory, clock, kind, memory)
        backend: AsyncStateStore = AsyncInMemoryStateStore(memory)
        return Harness(SyncStateStore(backend), clock, kind, backend)
    if kind == "cluster":
        client = request.getfixturevalue("redis_cluster_client")
        target = parse_redis_url(request.getfixturevalue("redis_cluster").url)
        backend = AsyncRedisStateStore(open_async_client(target, 5.0, 8), config, wall_clock_ms=wall_ms)
        return Harness(SyncStateStore(backend), clock, kind, backend, client)
    client = request.getfixturevalue("redis_client")
    socket_path = request.getfixturevalue("redis_server").socket_path
    backend = AsyncRedisStateStore(redis.asyncio.Redis(unix_socket_path=socket_path), config, wall_clock_ms=wall_ms)
    return Harness(SyncStateStore(backend), clock, kind, backend, client)


@pytest.fixture(params=KINDS)
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = make_harness(request.param, request, StateStoreConfig(ttl_s=60.0, lease_s=SHORT_LEASE_S))
    yield h
    h.store.close()


@pytest.fixture(params=KINDS)
def short_ttl(request: pytest.FixtureRequest) -> Iterator[Harness]:
    h = make_harness(request.param, request, StateStoreConfig(ttl_s=SHORT_TTL_S, lease_s=60.0))
    yield h
    h.store.close()


def test_token_packing_is_int32_little_endian() -> None:
    assert encode_token_ids([5, 258]) == b"\x05\x00\x00\x00\x02\x01\x00\x00"
    assert decode_token_ids(b"\x05\x00\x00\x00\x02\x01\x00\x00") == (5, 258)
    assert decode_token_ids(None) == ()
    with pytest.raises(InvalidArgument, match="token_ids"):
        encode_token_ids([-1])
    with pytest.raises(ValueError):
        decode_token_ids(b"\x01\x02\x03")


def test_create_then_load_round_trips(harness: Harness) -> None:
    harness.store.create("r1", PARAMS, prompt_token_ids=[1, 2, 3])
    state = harness.store.load("r1")
    assert state is not None
    assert state.params == PARAMS
    assert state.status == RequestStatus.QUEUED
    assert state.prompt_token_ids == (1, 2, 3)
    assert state.token_ids == ()
    assert (state.stats, state.controller_state, state.finish_reason, state.error, state.owner) == ({}, {}, "", "", "")
    assert state.created_ms == state.updated_ms == harness.clock.wall_ms


def test_append_step_appends_in_order_and_counts(harness: Harness) -> None:
    harness.store.create("r1", PARAMS)
    assert harness.store.append_step("r1", [5, 258], expected_num_tokens=0, status=RequestStatus.RUNNING) == 2
    harness.clock.wall_ms += 7
    assert harness.store.append_step("r1", [0, 49151, 2**31 - 1], expected_num_tokens=2) == 5
    assert harness.store.append_step("r1", []) == 5
    state = harness.store.load("r1")
    assert state.token_ids == (5, 258, 0, 49151, 2**31 - 1)
    assert state.status == RequestStatus.RUNNING
    assert state.updated_ms == state.created_ms + 7


def test_a_misspelled_keyword_is_refused_not_dropped(harness: Harness) -> None:
    store = harness.store
    store.create("r1", PARAMS)
    with pytest.raises(TypeError, match="expected_tokens"):
        store.append_step("r1", [1], expected_tokens=0)
    with pytest.raises(TypeError, match="prompt_ids"):
        store.create("r2", PARAMS, prompt_ids=[1])
    assert store.load("r1").token_ids == () and store.load("r2") is None


def test_stats_and_controller_are_replaced_only_when_given(harness: Harness) -> None:
    harness.store.create("r1", PARAMS)
    harness.store.append_step("r1", [1], stats={"num_steps": 1}, controller_state={"draft_length": 4})
    harness.store.append_step("r1", [2], stats={"num_steps": 2})
    state = harness.store.load("r1")
    assert state.stats == {"num_steps": 2}
    assert state.controller_state == {"draft_length": 4}


def test_the_kv_lease_is_kept_for_a_successor_gateway(harness: Harness) -> None:
    """The primary's lease on the request's slot, written with a step, loads back until replaced."""
    harness.store.create("r1", PARAMS)
    assert harness.store.load("r1").kv_lease == ""
    harness.store.append_step("r1", [1], kv_lease="a" * 32)
    harness.store.append_step("r1", [2])
    assert harness.store.load("r1").kv_lease == "a" * 32
    harness.store.append_step("r1", [3], kv_lease="b" * 32)
    assert harness.store.load("r1").kv_lease == "b" * 32


def test_the_node_is_recorded_for_the_request(harness: Harness) -> None:
    """The node a request runs on, written with a step, loads back until a failover replaces it."""
    harness.store.create("r1", PARAMS)
    assert harness.store.load("r1").node == ""
    harness.store.append_step("r1", [1], kv_lease="a" * 32, node="10.0.0.1:50051")
    harness.store.append_step("r1", [2])
    assert harness.store.load("r1").node == "10.0.0.1:50051"
    harness.store.append_step("r1", [3], kv_lease="b" * 32, node="10.0.0.2:50051")
    state = harness.store.load("r1")
    assert (state.node, state.kv_lease) == ("10.0.0.2:50051", "b" * 32)


def test_token_count_mismatch_rejects_the_whole_write(harness: Harness) -> None:
    harness.store.create("r1", PARAMS)
    harness.store.append_step("r1", [1, 2], expected_num_tokens=0)
    # Another write at the same position (a concurrent writer's other tokens).
    with pytest.raises(FailedPrecondition, match="expected_num_tokens: the store holds 2 .* expected 0"):
        harness.store.append_step("r1", [1, 3], expected_num_tokens=0, stats={"x": 1})
    with pytest.raises(FailedPrecondition, match="expected_num_tokens: the store holds 2 .* expected 1"):
        harness.store.append_step("r1", [3], expected_num_tokens=1, stats={"x": 1})
    state = harness.store.load("r1")
    assert state.token_ids == (1, 2)
    assert state.stats == {}


def test_a_replayed_step_succeeds_without_appending_twice(harness: Harness) -> None:
    """The writer did not see the reply of an applied step (a timeout, a failover) and sends it
    again: keyed by its position, the replay answers the same count and changes nothing."""
    harness.store.create("r1", PARAMS)
    assert harness.store.append_step("r1", [1, 2], expected_num_tokens=0, stats={"step": 0}) == 2
    assert harness.store.append_step("r1", [3, 4], expected_num_tokens=2, stats={"step": 1}) == 4
    assert harness.store.append_step("r1", [3, 4], expected_num_tokens=2, stats={"step": 1}) == 4
    state = harness.store.load("r1")
    assert state.token_ids == (1, 2, 3, 4) and state.stats == {"step": 1}
    # Only the last step can be replayed: an older one is a mismatch, as is a step that ended it.
    with pytest.raises(FailedPrecondition, match="the store holds 4"):
        harness.store.append_step("r1", [1, 2], expected_num_tokens=0)
    assert harness.store.append_step("r1", [5], expected_num_tokens=4, status=RequestStatus.FINISHED) == 5
    assert harness.store.append_step("r1", [5], expected_num_tokens=4, status=RequestStatus.FINISHED) == 5
    assert harness.store.load("r1").token_ids == (1, 2, 3, 4, 5)
    with pytest.raises(FailedPrecondition, match="ended"):
        harness.store.append_step("r1", [6], expected_num_tokens=5)


def test_a_retried_create_of_a_live_request_puts_it_in_the_index(harness: Harness) -> None:
    """A create whose script landed but whose index write was lost (the index lives in another
    cluster slot, maybe on a master failing over) is retried: refused as a duplicate, it still
    lists the live request, so a successor gateway finds it."""
    harness.store.create("r1", PARAMS)
    if harness.redis_client is not None:
        harness.redis_client.zrem(f"{DEFAULT_NAMESPACE}:active", "r1")
    with pytest.raises(AlreadyExists, match="request_id"):
        harness.store.create("r1", PARAMS)
    assert harness.store.list_active() == ["r1"]


def test_unknown_and_duplicate_ids(harness: Harness) -> None:
    with pytest.raises(NotFound, match="request_id"):
        harness.store.append_step("nope", [1])
    with pytest.raises(NotFound, match="request_id"):
        harness.store.claim("nope", "gw-1")
    assert harness.store.load("nope") is None
    harness.store.create("r1", PARAMS)
    with pytest.raises(AlreadyExists, match="request_id"):
        harness.store.create("r1", {})


def test_a_duplicate_id_of_a_finished_request_stays_out_of_the_active_list(harness: Harness) -> None:
    """The refused create must not put the finished request back among the active ones (a
    successor gateway would try to resume it)."""
    harness.store.create("done", PARAMS)
    harness.store.append_step("done", [9], status=RequestStatus.FINISHED, finish_reason="length")
    with pytest.raises(AlreadyExists, match="request_id"):
        harness.store.create("done", PARAMS)
    if harness.redis_client is not None:  # the index itself, before list_active() would prune it
        assert harness.redis_client.zscore(f"{DEFAULT_NAMESPACE}:active", "done") is None
    assert harness.store.list_active() == []
    assert harness.store.load("done").status == RequestStatus.FINISHED


def test_bad_input_names_the_field(harness: Harness) -> None:
    with pytest.raises(InvalidArgument, match="request_id"):
        harness.store.create("", PARAMS)
    with pytest.raises(InvalidArgument, match="request_id"):
        harness.store.create("a{b}", PARAMS)
    with pytest.raises(InvalidArgument, match="params"):
        harness.store.create("r1", {"x": object()})
    with pytest.raises(InvalidArgument, match="params"):
        harness.store.create("r1", {"x": float("nan")})
    harness.store.create("r1", PARAMS)
    with pytest.raises(InvalidArgument, match="token_ids"):
        harness.store.append_step("r1", [3, -2])
    with pytest.raises(InvalidArgument, match="expected_num_tokens"):
        harness.store.append_step("r1", [3], expected_num_tokens=-1)
    assert harness.store.load("r1").token_ids == ()


def test_ended_requests_leave_the_active_list_and_refuse_writes(harness: Harness) -> None:
    for rid in ("a", "b", "c"):
        harness.store.create(rid, PARAMS)
    assert harness.store.list_active() == ["a", "b", "c"]
    harness.store.append_step("b", [9], status=RequestStatus.FINISHED, finish_reason="length")
    assert harness.store.set_status("c", RequestStatus.CANCELLED, finish_reason="cancelled") is True
    assert harness.store.list_active() == ["a"]
    assert harness.store.set_status("b", RequestStatus.CANCELLED) is False
    with pytest.raises(FailedPrecondition, match="has ended"):
        harness.store.append_step("b", [10])
    state = harness.store.load("b")
    assert (state.status, state.finish_reason, state.token_ids) == (RequestStatus.FINISHED, "length", (9,))


def test_failed_request_keeps_its_error(harness: Harness) -> None:
    harness.store.create("r1", PARAMS)
    assert harness.store.set_status("r1", RequestStatus.FAILED, error="primary unavailable")
    state = harness.store.load("r1")
    assert (state.status, state.error) == (RequestStatus.FAILED, "primary unavailable")


def test_claim_lease_fences_a_stalled_owner(harness: Harness) -> None:
    store = harness.store
    store.create("r1", PARAMS)
    assert store.claim("r1", "gw-1")
    assert store.claim("r1", "gw-1")  # renewal
    assert not store.claim("r1", "gw-2")
    assert store.load("r1").owner == "gw-1"
    store.append_step("r1", [1], owner="gw-1")
    with pytest.raises(FailedPrecondition, match="owner: the lease of 'r1' is held by 'gw-1'"):
        store.append_step("r1", [2], owner="gw-2")
    harness.advance(SHORT_LEASE_S + 0.1)  # gw-1 stalls past its lease
    assert store.load("r1").owner == ""
    assert store.claim("r1", "gw-2")
    with pytest.raises(FailedPrecondition, match="owner"):
        store.append_step("r1", [2], owner="gw-1")
    assert store.append_step("r1", [2], owner="gw-2") == 2
    store.append_step("r1", [3], status=RequestStatus.FINISHED, owner="gw-2")
    assert store.load("r1").owner == ""  # the lease ends with the request
    assert not store.claim("r1", "gw-3")


def test_take_over_moves_a_live_lease_only_from_the_named_dead_owner(harness: Harness) -> None:
    store = harness.store
    store.create("r1", PARAMS)
    assert not store.take_over("r1", "gw-2", "gw-1")  # nobody holds it: that is claim's case
    assert store.claim("r1", "gw-1")
    assert not store.take_over("r1", "gw-3", "gw-9")  # gw-1 holds it, not gw-9
    assert store.load("r1").owner == "gw-1"
    assert store.take_over("r1", "gw-2", "gw-1")  # the lease had time left: a compare-and-set
    assert store.load("r1").owner == "gw-2"
    assert not store.take_over("r1", "gw-3", "gw-1")  # the race's loser
    assert not store.claim("r1", "gw-1")
    with pytest.raises(FailedPrecondition, match="owner: the lease of 'r1' is held by 'gw-2'"):
        store.append_step("r1", [1], owner="gw-1")  # the old owner, alive after all, is fenced
    assert store.append_step("r1", [1], owner="gw-2") == 1
    store.append_step("r1", [2], status=RequestStatus.FINISHED, owner="gw-2")
    assert not store.take_over("r1", "gw-3", "gw-2")  # an ended request has no lease to take


def test_take_over_of_an_expired_lease_fails(harness: Harness) -> None:
    harness.store.create("r1", PARAMS)
    assert harness.store.claim("r1", "gw-1")
    harness.advance(SHORT_LEASE_S + 0.1)
    assert not harness.store.take_over("r1", "gw-2", "gw-1")  # unowned now: claim takes it
    assert harness.store.claim("r1", "gw-2")


def test_take_over_of_an_unknown_request_is_not_found(harness: Harness) -> None:
    with pytest.raises(NotFound):
        harness.store.take_over("nope", "gw-2", "gw-1")


def test_append_step_with_owner_takes_a_free_lease(harness: Harness) -> None:
    harness.store.create("r1", PARAMS)
    harness.store.append_step("r1", [1], owner="gw-1")
    assert harness.store.load("r1").owner == "gw-1"
    assert not harness.store.claim("r1", "gw-2")


def test_delete_forgets_everything(harness: Harness) -> None:
    harness.store.create("r1", PARAMS, prompt_token_ids=[1])
    harness.store.append_step("r1", [2])
    assert harness.store.delete("r1") is True
    assert harness.store.delete("r1") is False
    assert harness.store.load("r1") is None
    assert harness.store.list_active() == []
    harness.store.create("r1", {"again": True})  # the id is free again
    assert harness.store.load("r1").token_ids == ()


def test_requests_expire_ttl_after_their_last_write(short_ttl: Harness) -> None:
    store = short_ttl.store
    store.create("old", PARAMS, prompt_token_ids=[1])
    store.create("kept", PARAMS, prompt_token_ids=[1])
    short_ttl.advance(SHORT_TTL_S * 0.6)
    store.append_step("kept", [7])  # re-arms kept's expiry, not old's
    short_ttl.advance(SHORT_TTL_S * 0.6)
    assert store.load("old") is None
    assert store.list_active() == ["kept"]
    with pytest.raises(NotFound):
        store.append_step("old", [1])
    state = store.load("kept")
    assert (state.prompt_token_ids, state.token_ids) == ((1,), (7,))
    short_ttl.advance(SHORT_TTL_S * 1.2)
    assert store.load("kept") is None
    assert store.list_active() == []


def test_open_state_store_picks_the_backend(redis_server) -> None:
    assert isinstance(open_async_state_store(""), AsyncInMemoryStateStore)
    assert isinstance(open_async_state_store(redis_server.url), AsyncRedisStateStore)
    memory = open_state_store("")
    assert isinstance(memory, SyncStateStore) and isinstance(memory.store, AsyncInMemoryStateStore)
    memory.close()
    store = open_state_store(redis_server.url, StateStoreConfig(namespace="pick"))
    assert isinstance(store, RedisStateStore) and isinstance(store.store, AsyncRedisStateStore)
    try:
        store.create("r1", PARAMS)
        assert store.load("r1").params == PARAMS
    finally:
        store.delete("r1")
        store.close()
    store.close()  # a second close does nothing


def test_the_sync_store_can_be_called_from_inside_an_event_loop() -> None:
    """A synchronous tool called from a coroutine (its own loop running) still gets plain calls:
    the store runs on the facade's loop, not the caller's."""
    store = open_state_store("")

    async def inside() -> RequestStatus:
        store.create("r1", PARAMS)
        return store.load("r1").status

    try:
        assert asyncio.run(inside()) == RequestStatus.QUEUED
    finally:
        store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.load("r1")


def test_async_memory_store_runs_the_wrapped_stores_overrides() -> None:
    """Tests inject faults by subclassing InMemoryStateStore and wrapping it: the wrapper calls the
    subclass's methods, and set_status is a step like any other."""

    class Down(InMemoryStateStore):
        def append_step(self, request_id, token_ids=(), **kwargs):  # noqa: ANN001, ANN003
            raise Unavailable("state_store", "down", dependency="state_store")

    sync = Down()
    store = SyncStateStore(AsyncInMemoryStateStore(sync))
    store.create("r1", PARAMS)
    with pytest.raises(Unavailable):
        store.append_step("r1", [1])
    with pytest.raises(Unavailable):
        store.set_status("r1", RequestStatus.CANCELLED)
    assert sync.load("r1").status == RequestStatus.QUEUED
    store.close()
    with pytest.raises(ValueError, match="not both"):
        AsyncInMemoryStateStore(sync, config=StateStoreConfig())


# ---- Redis only --------------------------------------------------------------------------------


def test_redis_keys_are_namespaced_and_expiring(redis_server, redis_client: redis.Redis) -> None:
    store = RedisStateStore.from_url(redis_server.url, StateStoreConfig(namespace="ns1", ttl_s=60.0))
    other = RedisStateStore.from_url(redis_server.url, StateStoreConfig(namespace="ns2", ttl_s=60.0))
    store.create("r1", PARAMS, prompt_token_ids=[1, 2])
    store.append_step("r1", [3, 4, 5], owner="gw-1")
    keys = sorted(k.decode() for k in redis_client.keys("*"))
    assert keys == [
        "ns1:active",
        "ns1:req:{r1}:meta",
        "ns1:req:{r1}:owner",
        "ns1:req:{r1}:prompt",
        "ns1:req:{r1}:tokens",
    ]
    for key in keys:
        if key != "ns1:active":  # the index is permanent; its stale ids are pruned by list_active
            assert 0 < redis_client.pttl(key) <= 60_000
    # 4 bytes per committed token, one value.
    assert redis_client.strlen("ns1:req:{r1}:tokens") == 3 * 4
    assert other.load("r1") is None
    assert other.list_active() == []
    store.close()
    other.close()


def test_redis_per_step_write_is_one_round_trip(
    request: pytest.FixtureRequest, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = make_harness("redis", request, StateStoreConfig())
    store = h.store
    store.create("r1", PARAMS)
    store.append_step("r1", [0])  # loads the script (EVALSHA miss -> SCRIPT LOAD) once
    evalsha_before = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    # Every round trip goes through one send_packed_command (a pipeline too).
    connection_type = h.backend._client.connection_pool.connection_class  # noqa: SLF001
    owner = next(c for c in connection_type.__mro__ if "send_packed_command" in vars(c))
    sends = []
    original = owner.send_packed_command

    def counting_send(self, command, check_health=True):  # noqa: ANN001 - redis-py's signature
        sends.append(command)
        return original(self, command, check_health)  # a coroutine from the async connection

    monkeypatch.setattr(owner, "send_packed_command", counting_send)
    for i in range(10):
        store.append_step(
            "r1", [i], expected_num_tokens=1 + i, stats={"step": i}, controller_state={"k": 4}, owner="gw-1"
        )
    monkeypatch.undo()
    h.store.close()
    assert len(sends) == 10
    assert redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] - evalsha_before == 10


def test_redis_recovery_through_a_fresh_client(redis_server) -> None:
    config = StateStoreConfig(namespace="recover")
    first = RedisStateStore.from_url(redis_server.url, config)
    first.create("done", PARAMS, prompt_token_ids=[1])
    first.append_step("done", [2], status=RequestStatus.FINISHED, finish_reason="eos")
    first.create("live", PARAMS, prompt_token_ids=[10, 11, 12])
    first.append_step(
        "live",
        [13, 14],
        expected_num_tokens=0,
        status=RequestStatus.RUNNING,
        stats={"num_steps": 1},
        controller_state={"draft_length": 5},
        owner="gw-old",
    )
    # The gateway dies; a new one connects with its own client.
    restarted = RedisStateStore.from_url(redis_server.url, config)
    try:
        assert restarted.list_active() == ["live"]
        assert not restarted.claim("live", "gw-new")  # the old lease is still live
        state = restarted.load("live")
        assert state == first.load("live")
        assert (state.prompt_token_ids + state.token_ids) == (10, 11, 12, 13, 14)  # what to re-prefill
        assert (state.stats, state.controller_state) == ({"num_steps": 1}, {"draft_length": 5})
    finally:
        restarted.close()
        first.close()


# A record a bug or an operator wrote: (the key under specdec:req:{r1}, a command that spoils it, the
# field the error names).
CORRUPTIONS = {
    "bad-json": ("meta", ("HSET", "params", "{not json"), "params"),
    "not-an-object": ("meta", ("HSET", "stats", "[1]"), "stats"),
    "unknown-status": ("meta", ("HSET", "status", "paused"), "status"),
    "missing-field": ("meta", ("HDEL", "created_ms"), "created_ms"),
    "not-utf8": ("meta", ("HSET", "finish_reason", b"\xff"), None),
    "torn-token-log": ("tokens", ("APPEND", b"\x01\x02\x03"), "tokens"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_redis_a_corrupt_record_loads_as_an_error_naming_the_field(
    corruption: str, redis_server, redis_client: redis.Redis
) -> None:
    """Not a KeyError or a JSON error out of the store: its callers (GetRequest, adopting a request)
    tell one record's corruption from a failing store, and say which field is bad."""
    key, (command, *args), field = CORRUPTIONS[corruption]
    store = RedisStateStore.from_url(redis_server.url, StateStoreConfig(ttl_s=60.0))
    try:
        store.create("r1", PARAMS, prompt_token_ids=[1])
        store.append_step("r1", [2], owner="gw-1")
        redis_client.execute_command(command, f"{DEFAULT_NAMESPACE}:req:{{r1}}:{key}", *args)
        if field is None:  # text the record can carry on: not worth failing the request for
            assert store.load("r1").finish_reason == "\ufffd"
            return
        with pytest.raises(Internal, match=f"'r1'.*{field}") as raised:
            store.load("r1")
        assert raised.value.dependency == "state_store"
    finally:
        store.close()


def test_redis_a_corrupt_status_does_not_hide_the_other_active_requests(
    redis_server, redis_client: redis.Redis
) -> None:
    """list_active is how a starting gateway finds the requests it resumes: one status written by
    hand must not fail it for all; that request stays listed (it has not ended), its load names it."""
    store = RedisStateStore.from_url(redis_server.url, StateStoreConfig(ttl_s=60.0))
    try:
        store.create("r1", PARAMS)
        store.create("r2", PARAMS)
        redis_client.hset(f"{DEFAULT_NAMESPACE}:req:{{r1}}:meta", "status", "paused")
        assert store.list_active() == ["r1", "r2"]
        with pytest.raises(Internal, match="status"):
            store.load("r1")
    finally:
        store.close()


@pytest.mark.parametrize("command", [("HDEL", "status", "created_ms"), ("HSET", "status", "paused")])
def test_redis_a_create_over_a_corrupt_record_is_already_exists(
    command: tuple[str, ...], redis_server, redis_client: redis.Redis
) -> None:
    """The id is taken whatever its record holds: ALREADY_EXISTS, not a Lua error or a ValueError."""
    store = RedisStateStore.from_url(redis_server.url, StateStoreConfig(ttl_s=60.0))
    try:
        store.create("r1", PARAMS)
        name, *args = command
        redis_client.execute_command(name, f"{DEFAULT_NAMESPACE}:req:{{r1}}:meta", *args)
        with pytest.raises(AlreadyExists, match="request_id"):
            store.create("r1", PARAMS)
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_redis_an_id_with_braces_is_refused_by_every_call(kind: str, request: pytest.FixtureRequest) -> None:
    """A '}' first leaves the {request_id} hash tag empty, so each of the id's keys hashes whole to a
    slot of its own: on a cluster a script over them failed CROSSSLOT (GetRequest answered INTERNAL).
    Every call refuses such an id by name, as create always did: no stored request can have one."""
    h = make_harness(kind, request, StateStoreConfig(ttl_s=60.0))
    calls = {
        "load": h.store.load,
        "delete": h.store.delete,
        "append_step": lambda r: h.store.append_step(r, [1]),
        "claim": lambda r: h.store.claim(r, "gw-1"),
        "take_over": lambda r: h.store.take_over(r, "gw-1", "gw-0"),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(InvalidArgument, match="request_id.*braces"):
                call("}x")
                pytest.fail(f"{name} took an id with braces")
        h.store.create("r1", PARAMS)
        h.redis_client.zadd(f"{DEFAULT_NAMESPACE}:active", {"}x": 0})  # written by hand: not a request
        assert h.store.list_active() == ["r1"]
    finally:
        h.store.close()


@pytest.mark.parametrize("is_stalled", [True, False], ids=["stalled", "absent"])
def test_a_stalled_or_absent_redis_is_unavailable_and_named_as_the_dependency(
    is_stalled: bool, redis_server, tmp_path
) -> None:
    """A Redis that does not answer (stopped) times out, one that is not there refuses the
    connection: Unavailable, marked as the state store's failure (clients are told without its
    name or details)."""
    url = redis_server.url if is_stalled else f"unix://{tmp_path / 'absent.sock'}"
    store = RedisStateStore.from_url(url, StateStoreConfig(namespace="stall"), timeout_s=0.2)
    if is_stalled:
        os.kill(redis_server.pid, signal.SIGSTOP)
    try:
        with pytest.raises(Unavailable) as e:
            store.load("r1")
    finally:
        os.kill(redis_server.pid, signal.SIGCONT)
        store.close()
    assert e.value.dependency == "state_store" and e.value.field == "state_store"


@pytest.mark.parametrize("is_stalled", [True, False], ids=["stalled", "absent"])
def test_a_stalled_or_absent_redis_cluster_is_unavailable_and_named_as_the_dependency(is_stalled: bool) -> None:
    """As for one server: the cluster client re-reads the slot map after a connection error or a
    timeout, and when no node answers that either it raised RedisClusterException, which passed
    through the store untranslated, so the gateway neither retried it nor told it as UNAVAILABLE."""
    with contextlib.ExitStack() as stack:
        if is_stalled:  # a cluster of its own: the shared one is not stopped under other tests
            if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
                pytest.skip("redis-server and redis-cli not installed (`make test` installs them)")
            cluster = stack.enter_context(redis_cluster(num_masters=3, num_replicas=0))
            url, pids = cluster.url, [node.pid for node in cluster.nodes]
        else:
            url, pids = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in free_port_pairs(2)), []
        store = RedisStateStore.from_url(url, StateStoreConfig(namespace="stall"), timeout_s=0.2)
        stack.callback(store.close)
        if is_stalled:
            store.create("r1", PARAMS)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
                stack.callback(os.kill, pid, signal.SIGCONT)
        for call in (lambda: store.load("r1"), lambda: store.append_step("r1", [1]), store.list_active):
            with pytest.raises(Unavailable) as e:
                call()
            assert e.value.dependency == "state_store" and e.value.field == "state_store"


def test_hundreds_of_concurrent_async_writes_share_a_bounded_pool(redis_server) -> None:
    """400 requests created and stepped at once (the gateway's coroutines) through 4 connections:
    calls wait for a free connection instead of failing, and every write lands."""
    config = StateStoreConfig(namespace="burst")

    async def burst() -> list:
        store = AsyncRedisStateStore.from_url(redis_server.url, config, max_connections=4)
        try:

            async def one(i: int) -> None:
                await store.create(f"b{i}", PARAMS, prompt_token_ids=[1, 2], status=RequestStatus.RUNNING)
                await store.append_step(f"b{i}", [i], expected_num_tokens=0)

            await asyncio.gather(*(one(i) for i in range(400)))
            return [await store.load(f"b{i}") for i in range(400)]
        finally:
            await store.close()

    states = asyncio.run(burst())
    assert [s.token_ids for s in states] == [(i,) for i in range(400)]
