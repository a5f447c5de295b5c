"""The state store on Redis with Sentinel failover: a real master, one replica and 3 sentinels on
loopback (specdec.redis_sentinel), requests writing steps as the gateway does, and kill -9 of the
master mid-run: the sentinels promote the replica, the store follows them, and every request runs
to its end with no step lost or duplicated. Redis replicates asynchronously: the store acknowledges a
step once a replica holds it (specdec/state_store/replica_ack.py), and where the promoted replica
still lacks steps the writer holds (a write that failed over before its answer), the writer writes
them back, as the gateway does (RequestRecord.write_back_lost, gateway/request_record.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Iterator

import pytest

from gateway.state_retry import DEFAULT_MAX_STATE_RETRY_S, give_up_at, with_state_retries
from specdec.errors import FailedPrecondition, Unavailable
from specdec.redis_sentinel import LocalSentinelGroup, current_master_port, redis_sentinel, wait_for_promotion
from specdec.redis_server import RedisServerError
from specdec.state_store import AsyncRedisStateStore, RedisStateStore, RequestStatus

NUM_REQUESTS = 4
NUM_STEPS = 40
KILL_AT_STEP = 10
STEP_PAUSE_S = 0.01


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[LocalSentinelGroup]:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed (`make test` installs it)")
        pytest.skip("redis-server is not installed (`make test` installs it)")
    try:
        with redis_sentinel() as group:
            yield group
    except RedisServerError as e:
        pytest.fail(str(e))


def token(index: int, step: int) -> int:
    return index * 1000 + step


async def run_request(store: AsyncRedisStateStore, rid: str, index: int, reached: asyncio.Event) -> int:
    """NUM_STEPS one-token steps, retried within the gateway's budget; the Unavailable answers seen."""
    num_unavailable = 0
    for step in range(NUM_STEPS):

        async def write(step: int = step) -> int:
            nonlocal num_unavailable
            try:
                try:
                    return await store.append_step(rid, [token(index, step)], expected_num_tokens=step, owner="gw-1")
                except FailedPrecondition:
                    # The promoted replica lacks steps the old master acknowledged: write them back.
                    state = await store.load(rid)
                    assert state is not None
                    num_kept = len(state.token_ids)
                    assert num_kept < step and list(state.token_ids) == [token(index, s) for s in range(num_kept)]
                    lost = [token(index, s) for s in range(num_kept, step + 1)]
                    return await store.append_step(rid, lost, expected_num_tokens=num_kept, owner="gw-1")
            except Unavailable:
                num_unavailable += 1
                raise

        assert await with_state_retries(write, give_up_at(DEFAULT_MAX_STATE_RETRY_S, None)) == step + 1
        if step == KILL_AT_STEP:
            reached.set()
        await asyncio.sleep(STEP_PAUSE_S)
    return num_unavailable


async def run_with_the_master_killed(group: LocalSentinelGroup, request_ids: list[str]) -> int:
    store = AsyncRedisStateStore.from_url(group.url)
    try:
        for rid in request_ids:
            await store.create(rid, {"requestId": rid}, prompt_token_ids=[7], status=RequestStatus.RUNNING)
        reached = [asyncio.Event() for _ in request_ids]
        runs = [asyncio.create_task(run_request(store, rid, i, reached[i])) for i, rid in enumerate(request_ids)]
        await reached[0].wait()
        os.kill(group.master_pid, signal.SIGKILL)
        num_unavailable = sum(await asyncio.gather(*runs))
        for rid in request_ids:
            await store.append_step(rid, status=RequestStatus.FINISHED, finish_reason="length", owner="gw-1")
        return num_unavailable
    finally:
        await store.close()


def test_the_store_follows_the_sentinels_to_the_promoted_replica(sentinel_group: LocalSentinelGroup) -> None:
    assert current_master_port(sentinel_group) == sentinel_group.master_port
    request_ids = [f"sentinel-{i}" for i in range(NUM_REQUESTS)]
    num_unavailable = asyncio.run(run_with_the_master_killed(sentinel_group, request_ids))
    assert num_unavailable > 0, "the writes waited for the promotion"

    assert wait_for_promotion(sentinel_group) in sentinel_group.replica_ports
    store = RedisStateStore.from_url(sentinel_group.url)
    try:
        for i, rid in enumerate(request_ids):
            state = store.load(rid)
            assert state is not None and state.status == RequestStatus.FINISHED
            assert list(state.token_ids) == [token(i, step) for step in range(NUM_STEPS)]
        assert store.list_active() == []
    finally:
        store.close()
