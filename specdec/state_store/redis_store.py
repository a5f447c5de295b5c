"""The request state store on Redis (redis.asyncio with the hiredis parser): the keys, scripts and
replies of specdec.state_store.redis_scripts, sent from the gateway's event loop.

Why asyncio: the gateway's request loops are coroutines on one event loop (grpc.aio); one blocking
Redis call there (~235 us per step, up to timeout_s when Redis stalls) would stall every stream
the gateway serves. Synchronous tools and tests use this store through SyncStateStore
(specdec.state_store.sync), which runs it on an event loop of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack, cast

import redis

from specdec.state_store.clients import AsyncClient, close_async_client, open_async_client
from specdec.state_store.replica_ack import ReplicaAck
from specdec.state_store.redis_scripts import (
    CLAIM_LUA,
    CREATE_LUA,
    DELETE_LUA,
    LOAD_LUA,
    STEP_LUA,
    TAKE_OVER_LUA,
    RedisLayout,
    live_duplicate_created_ms,
    redis_errors,
    split_stale,
    state_from_reply,
)
from specdec.state_store.redis_url import RedisKind, parse_redis_url
from specdec.state_store.types import (
    CreateOptions,
    RequestState,
    RequestStatus,
    StateStoreConfig,
    StepFields,
    set_status_by_step,
)

# Connections of one store: a Redis call takes ~0.2 ms, so a few dozen serve thousands of steps/s.
DEFAULT_MAX_CONNECTIONS = 32
# How long one command (or a connect, or the wait for a free connection) may take before it fails
# Unavailable: a stalled server (a failover, an overloaded node) costs each attempt this long.
DEFAULT_COMMAND_TIMEOUT_S = 5.0


class AsyncRedisStateStore(RedisLayout):
    """AsyncStateStore on a Redis server; the client comes in through the constructor.

    redis.asyncio connections belong to the event loop that opened them: use an instance (and
    its client) from one event loop only, and close it there.

    replica_ack: on a replicated Redis (a cluster, a Sentinel-watched master), a step is
    acknowledged once a replica holds it, so that a failover keeps it (replica_ack.py); None (one
    server): the step script alone.
    """

    def __init__(
        self,
        client: AsyncClient,
        config: StateStoreConfig | None = None,
        *,
        wall_clock_ms: Callable[[], int] | None = None,
        replica_ack: ReplicaAck | None = None,
    ) -> None:
        super().__init__(config, wall_clock_ms)
        self._client = client
        self._replica_ack = replica_ack
        self._create = client.register_script(CREATE_LUA)
        self._step = client.register_script(STEP_LUA)
        self._claim = client.register_script(CLAIM_LUA)
        self._take_over = client.register_script(TAKE_OVER_LUA)
        self._load = client.register_script(LOAD_LUA)
        self._delete = client.register_script(DELETE_LUA)

    @classmethod
    def from_url(
        cls,
        url: str,
        config: StateStoreConfig | None = None,
        *,
        timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> AsyncRedisStateStore:
        """url: any --redis_url (specdec.state_store.redis_url): one server, a cluster or sentinels.
        Connects lazily, on the first call's loop.

        One server: at most max_connections connections: coroutines are cheap, and hundreds of
        requests starting at once would otherwise each open one (redis-py's plain pool then
        refuses past 100). Beyond it a call waits for a free connection, up to timeout_s (then
        Unavailable). A cluster or Sentinel URL: steps are acknowledged once a replica holds them."""
        target = parse_redis_url(url)
        client = open_async_client(target, timeout_s, max_connections)
        return cls(client, config, replica_ack=None if target.kind is RedisKind.SINGLE else ReplicaAck(client))

    async def create(self, request_id: str, params: Mapping[str, Any], **options: Unpack[CreateOptions]) -> None:
        args, now_ms = self.create_args(request_id, params, options)
        with redis_errors(request_id):
            # Two round trips, not one pipeline: a refused create (an id that exists) must not reach
            # the index of active requests. The index key is in another cluster slot than the
            # request's, so one script cannot write both.
            try:
                await self._create(self.keys(request_id), args)
            except redis.ResponseError as e:
                if (created_ms := live_duplicate_created_ms(e)) is not None:
                    await self._client.zadd(self.active_key, {request_id: created_ms}, nx=True)
                raise
            await self._client.zadd(self.active_key, {request_id: now_ms}, nx=True)

    async def append_step(self, request_id: str, token_ids: Sequence[int] = (), **step: Unpack[StepFields]) -> int:
        args = self.step_args(token_ids, step)
        with redis_errors(request_id, step.get("expected_num_tokens"), step.get("owner")):
            keys = self.keys(request_id)
            if self._replica_ack is None:
                num_tokens = int(await self._step(keys, args))
            else:
                num_tokens = int(await self._replica_ack.run(self._step, keys, args))
            status = step.get("status")
            if status is not None and status.is_terminal:
                # The index only after the write succeeded (a second round trip,
                # once per request): a failed write must leave the request listed.
                await self._client.zrem(self.active_key, request_id)
        return num_tokens

    async def set_status(
        self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = ""
    ) -> bool:
        return await set_status_by_step(self, request_id, status, finish_reason=finish_reason, error=error)

    async def claim(self, request_id: str, owner: str) -> bool:
        keys, args = self.claim_keys_args(request_id, owner)
        with redis_errors(request_id):
            return bool(await self._claim(keys, args))

    async def take_over(self, request_id: str, owner: str, dead_owner: str) -> bool:
        keys, args = self.take_over_keys_args(request_id, owner, dead_owner)
        with redis_errors(request_id):
            return bool(await self._take_over(keys, args))

    async def load(self, request_id: str) -> RequestState | None:
        with redis_errors(request_id):
            replies = await self._load(self.keys(request_id))
        return state_from_reply(request_id, replies)

    async def list_active(self) -> list[str]:
        with redis_errors("*"):
            members = cast("list[bytes]", await self._client.zrange(self.active_key, 0, -1))
            if not members:
                return []
            # A non-transactional pipeline: a cluster's meta keys span slots.
            ids, meta_keys = self.status_keys(members)
            pipe = self._client.pipeline(transaction=False)
            for key in meta_keys:
                pipe.hget(key, "status")
            active, stale = split_stale(ids, await pipe.execute())
            if stale:
                await self._client.zrem(self.active_key, *stale)
        return active

    async def delete(self, request_id: str) -> bool:
        with redis_errors(request_id):
            num_meta = await self._delete(self.keys(request_id))
            await self._client.zrem(self.active_key, request_id)
        return int(num_meta) == 1

    async def close(self) -> None:
        await close_async_client(self._client)
