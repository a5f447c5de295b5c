"""The state store for asyncio callers: AsyncRedisStateStore and AsyncInMemoryStateStore, the
AsyncStateStore twins of RedisStateStore and InMemoryStateStore.

Why: the gateway's request loops are coroutines on one event loop (grpc.aio); one blocking
Redis call there (~235 us per step, up to timeout_s when Redis stalls) would stall every
stream the gateway serves. The async Redis store awaits the same keys, scripts and round
trips as the sync one (RedisStoreBase holds all but the I/O); the in-memory one has no I/O and
calls the sync store inline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import redis

from specdec.state_store.clients import AsyncClient, close_async_client, open_async_client
from specdec.state_store.memory import InMemoryStateStore
from specdec.state_store.redis_store import (
    CLAIM_LUA,
    CREATE_LUA,
    DELETE_LUA,
    LOAD_LUA,
    STEP_LUA,
    RedisStoreBase,
    redis_errors,
)
from specdec.state_store.redis_url import parse_redis_url
from specdec.state_store.types import RequestState, RequestStatus, StateStoreConfig, set_status_by_async_step

# Connections of one async store: a Redis call takes ~0.2 ms, so a few dozen serve thousands of steps/s.
DEFAULT_MAX_CONNECTIONS = 32
_P = ParamSpec("_P")
_R = TypeVar("_R")


class AsyncRedisStateStore(RedisStoreBase):
    """AsyncStateStore on a Redis server, call for call RedisStateStore awaited.

    redis.asyncio connections belong to the event loop that opened them: use an instance (and
    its client) from one event loop only, and close it there.
    """

    def __init__(
        self,
        client: AsyncClient,
        config: StateStoreConfig | None = None,
        *,
        wall_clock_ms: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(config, wall_clock_ms)
        self._client = client
        self._create = client.register_script(CREATE_LUA)
        self._step = client.register_script(STEP_LUA)
        self._claim = client.register_script(CLAIM_LUA)
        self._load = client.register_script(LOAD_LUA)
        self._delete = client.register_script(DELETE_LUA)

    @classmethod
    def from_url(
        cls,
        url: str,
        config: StateStoreConfig | None = None,
        *,
        timeout_s: float = 5.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> AsyncRedisStateStore:
        """url: any --redis_url (specdec.state_store.redis_url): one server, a cluster or sentinels.
        Connects lazily, on the first call's loop.

        One server: at most max_connections connections: coroutines are cheap, and hundreds of
        requests starting at once would otherwise each open one (redis-py's plain pool then
        refuses past 100). Beyond it a call waits for a free connection, up to timeout_s (then
        Unavailable)."""
        return cls(open_async_client(parse_redis_url(url), timeout_s, max_connections), config)

    async def create(
        self,
        request_id: str,
        params: Mapping[str, Any],
        *,
        prompt_token_ids: Sequence[int] = (),
        status: RequestStatus = RequestStatus.QUEUED,
    ) -> None:
        args, now_ms = self._create_args(request_id, params, prompt_token_ids, status)
        with redis_errors(request_id):
            try:
                await self._create(self.keys(request_id), args)
            except redis.ResponseError as e:
                if (created_ms := self._live_duplicate_created_ms(e)) is not None:
                    await self._client.zadd(self._active_key, {request_id: created_ms}, nx=True)
                raise
            await self._client.zadd(self._active_key, {request_id: now_ms}, nx=True)

    async def append_step(
        self,
        request_id: str,
        token_ids: Sequence[int] = (),
        *,
        expected_num_tokens: int | None = None,
        status: RequestStatus | None = None,
        stats: Mapping[str, Any] | None = None,
        controller_state: Mapping[str, Any] | None = None,
        finish_reason: str | None = None,
        error: str | None = None,
        owner: str | None = None,
        kv_lease: str | None = None,
        node: str | None = None,
    ) -> int:
        args = self._step_args(
            token_ids, expected_num_tokens, status, stats, controller_state, finish_reason, error, owner, kv_lease, node
        )
        with redis_errors(request_id, expected_num_tokens, owner):
            num_tokens = int(await self._step(self.keys(request_id), args))
            if status is not None and status.is_terminal:
                await self._client.zrem(self._active_key, request_id)
        return num_tokens

    async def set_status(
        self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = ""
    ) -> bool:
        return await set_status_by_async_step(self, request_id, status, finish_reason=finish_reason, error=error)

    async def claim(self, request_id: str, owner: str) -> bool:
        keys, args = self._claim_keys_args(request_id, owner)
        with redis_errors(request_id):
            return bool(await self._claim(keys, args))

    async def load(self, request_id: str) -> RequestState | None:
        with redis_errors(request_id):
            replies = await self._load(self.keys(request_id))
        return self._state(request_id, replies)

    async def list_active(self) -> list[str]:
        with redis_errors("*"):
            members = cast("list[bytes]", await self._client.zrange(self._active_key, 0, -1))
            if not members:
                return []
            ids, pipe = self._queue_statuses(self._client.pipeline(transaction=False), members)
            active, stale = self._split_stale(ids, await pipe.execute())
            if stale:
                await self._client.zrem(self._active_key, *stale)
        return active

    async def delete(self, request_id: str) -> bool:
        with redis_errors(request_id):
            num_meta = await self._delete(self.keys(request_id))
            await self._client.zrem(self._active_key, request_id)
        return int(num_meta) == 1

    async def close(self) -> None:
        await close_async_client(self._client)


def _inline(
    method: Callable[Concatenate[InMemoryStateStore, _P], _R],
) -> Callable[Concatenate[AsyncInMemoryStateStore, _P], Coroutine[Any, Any, _R]]:
    """The coroutine twin of an InMemoryStateStore method: it calls the method of that name on the
    wrapped store (so a subclass's override runs) and returns its result."""
    name = method.__name__

    async def call(self: AsyncInMemoryStateStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return cast(_R, getattr(self.sync, name)(*args, **kwargs))

    return call


class AsyncInMemoryStateStore:
    """AsyncStateStore over an InMemoryStateStore (`sync`, for tests to inspect or subclass).
    Each call runs the sync store inline: no I/O, its lock held for microseconds, so no thread."""

    def __init__(
        self,
        sync: InMemoryStateStore | None = None,
        *,
        config: StateStoreConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ms: Callable[[], int] | None = None,
    ) -> None:
        """sync: the store to wrap (it has its own config and clocks); else one is made from the rest."""
        if sync is not None and (config is not None or clock is not time.monotonic or wall_clock_ms is not None):
            raise ValueError("pass either an InMemoryStateStore to wrap or the arguments to make one, not both")
        self.sync = InMemoryStateStore(config, clock=clock, wall_clock_ms=wall_clock_ms) if sync is None else sync
        self.config = self.sync.config

    create = _inline(InMemoryStateStore.create)
    append_step = _inline(InMemoryStateStore.append_step)
    claim = _inline(InMemoryStateStore.claim)
    load = _inline(InMemoryStateStore.load)
    list_active = _inline(InMemoryStateStore.list_active)
    delete = _inline(InMemoryStateStore.delete)
    close = _inline(InMemoryStateStore.close)

    async def set_status(
        self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = ""
    ) -> bool:
        # Through this store's append_step, as in the other stores, so an override of it applies.
        return await set_status_by_async_step(self, request_id, status, finish_reason=finish_reason, error=error)
