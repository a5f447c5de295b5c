"""The state store across a Redis Cluster failover: a real 3-master + 3-replica cluster on loopback
(specdec.redis_cluster, this module's own), requests writing steps concurrently as the gateway does
(gateway.state_retry's retries), and kill -9 of the master that owns one request's slot mid-run.
Every request runs to its end once the replica is promoted, with no step lost or duplicated."""

from __future__ import annotations

import asyncio
import os
import signal

from gateway.state_retry import DEFAULT_MAX_STATE_RETRY_S, give_up_at, with_state_retries
from specdec.errors import Unavailable
from specdec.redis_cluster import LocalRedisCluster, master_port_of, wait_for_failover
from specdec.state_store import AsyncRedisStateStore, RedisStateStore, RequestStatus

NUM_REQUESTS = 8
NUM_STEPS = 60
NUM_TOKENS_PER_STEP = 3
KILL_AT_STEP = 20
# Between steps, as a request loop waits for the model: the kill lands while all of them run.
STEP_PAUSE_S = 0.01


def step_tokens(request_index: int, step: int) -> list[int]:
    """The tokens of one step, distinct across requests and steps."""
    first = request_index * 100_000 + step * NUM_TOKENS_PER_STEP
    return list(range(first, first + NUM_TOKENS_PER_STEP))


class CountingStore:
    """Counts the Unavailable answers of an async store's step writes (the failover's, retried)."""

    def __init__(self, store: AsyncRedisStateStore) -> None:
        self.store = store
        self.num_unavailable = 0

    async def append_step(self, request_id: str, token_ids: list[int], **kwargs: object) -> int:
        try:
            return await self.store.append_step(request_id, token_ids, **kwargs)  # type: ignore[arg-type]
        except Unavailable:
            self.num_unavailable += 1
            raise


async def run_request(store: CountingStore, request_id: str, index: int, reached: asyncio.Event) -> None:
    """NUM_STEPS step writes, each retried over an unavailable store within the gateway's budget."""
    for step in range(NUM_STEPS):
        tokens = step_tokens(index, step)
        num_stored = step * NUM_TOKENS_PER_STEP

        async def write(tokens: list[int] = tokens, num_stored: int = num_stored) -> int:
            return await store.append_step(request_id, tokens, expected_num_tokens=num_stored, owner="gw-1")

        give_up = give_up_at(DEFAULT_MAX_STATE_RETRY_S, None)
        assert await with_state_retries(write, give_up) == num_stored + NUM_TOKENS_PER_STEP
        if step == KILL_AT_STEP:
            reached.set()
        await asyncio.sleep(STEP_PAUSE_S)


async def run_with_a_master_killed(cluster: LocalRedisCluster, request_ids: list[str]) -> tuple[int, int]:
    """Create the requests, run them all, kill -9 the master of request_ids[0]'s slot when that
    request reaches KILL_AT_STEP; (the killed port, Unavailable answers seen by the writers)."""
    backend = AsyncRedisStateStore.from_url(cluster.url)
    store = CountingStore(backend)
    try:
        for rid in request_ids:
            await backend.create(rid, {"requestId": rid}, prompt_token_ids=[1, 2, 3], status=RequestStatus.RUNNING)
        victim = master_port_of(cluster, backend.keys(request_ids[0])[0])
        assert victim is not None
        reached = [asyncio.Event() for _ in request_ids]
        runs = [asyncio.create_task(run_request(store, rid, i, reached[i])) for i, rid in enumerate(request_ids)]
        await reached[0].wait()
        os.kill(cluster.pid_of(victim), signal.SIGKILL)
        await asyncio.gather(*runs)
        for rid in request_ids:
            await backend.append_step(rid, status=RequestStatus.FINISHED, finish_reason="length", owner="gw-1")
        return victim, store.num_unavailable
    finally:
        await backend.close()


class LostReplyStore:
    """Applies the step writes numbered in lost_writes, then answers Unavailable, as a client
    whose reply was lost in a failover does."""

    def __init__(self, store: AsyncRedisStateStore, lost_writes: set[int]) -> None:
        self.store, self.lost_writes, self.num_writes = store, lost_writes, 0

    async def append_step(self, request_id: str, token_ids: list[int], **kwargs: object) -> int:
        self.num_writes += 1
        num_tokens = await self.store.append_step(request_id, token_ids, **kwargs)  # type: ignore[arg-type]
        if self.num_writes in self.lost_writes:
            raise Unavailable("state_store", "Redis unreachable: the reply was lost")
        return num_tokens


def test_a_step_whose_reply_was_lost_is_retried_and_stored_once(redis_cluster: LocalRedisCluster) -> None:
    """The gateway's retry (gateway.state_retry) of an applied write is a replay keyed by the step's
    position: it answers the count and appends nothing."""

    async def run() -> tuple[int, ...]:
        backend = AsyncRedisStateStore.from_url(redis_cluster.url)
        store = LostReplyStore(backend, lost_writes={2, 3, 6})
        try:
            await backend.create("lost-reply", {}, status=RequestStatus.RUNNING)
            for step in range(5):

                async def write(step: int = step) -> int:
                    tokens = step_tokens(0, step)
                    return await store.append_step("lost-reply", tokens, expected_num_tokens=step * 3)

                assert await with_state_retries(write, give_up_at(5.0, None)) == (step + 1) * NUM_TOKENS_PER_STEP
            state = await backend.load("lost-reply")
            assert state is not None and await backend.delete("lost-reply")  # the cluster is the module's
            return state.token_ids
        finally:
            await backend.close()

    assert list(asyncio.run(run())) == [t for step in range(5) for t in step_tokens(0, step)]


def test_a_killed_master_loses_no_step_and_duplicates_none(redis_cluster: LocalRedisCluster) -> None:
    request_ids = [f"failover-{i}" for i in range(NUM_REQUESTS)]
    victim, num_unavailable = asyncio.run(run_with_a_master_killed(redis_cluster, request_ids))
    assert num_unavailable > 0, "the writes to the killed master's slots waited for the failover"

    wait_for_failover(redis_cluster, victim)
    store = RedisStateStore.from_url(redis_cluster.url)
    try:
        key = store.keys(request_ids[0])[0]
        assert master_port_of(redis_cluster, key, exclude=victim) not in (None, victim), "a replica took over"
        for i, rid in enumerate(request_ids):
            state = store.load(rid)
            assert state is not None and state.status == RequestStatus.FINISHED
            expected = [t for step in range(NUM_STEPS) for t in step_tokens(i, step)]
            assert list(state.token_ids) == expected, f"{rid}: every step once, in order"
            assert state.prompt_token_ids == (1, 2, 3)
        assert store.list_active() == []
        assert all(store.delete(rid) for rid in request_ids)
        assert store.load(request_ids[0]) is None
    finally:
        store.close()
