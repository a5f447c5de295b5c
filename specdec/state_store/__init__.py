"""The request state store: Redis when a URL is configured, else in memory.

store = open_state_store(redis_url)          # "" -> InMemoryStateStore
store.create(request_id, params, prompt_token_ids=prompt_ids)
n = store.append_step(request_id, [t1, t2, bonus], expected_num_tokens=n, stats=...)
state = store.load(request_id)               # recovery: re-prefill prompt + tokens

On an event loop (the gateway's grpc.aio request loops), the same calls awaited:
store = open_async_state_store(redis_url)    # "" -> AsyncInMemoryStateStore
n = await store.append_step(request_id, [t1, t2, bonus], expected_num_tokens=n)
"""

from __future__ import annotations

from specdec.state_store.aio import AsyncInMemoryStateStore, AsyncRedisStateStore
from specdec.state_store.memory import InMemoryStateStore
from specdec.state_store.redis_store import RedisStateStore
from specdec.state_store.types import (
    DEFAULT_LEASE_S,
    DEFAULT_NAMESPACE,
    DEFAULT_TTL_S,
    TERMINAL_STATUSES,
    AsyncStateStore,
    RequestState,
    RequestStatus,
    StateStore,
    StateStoreConfig,
    decode_token_ids,
    encode_token_ids,
)


def open_state_store(redis_url: str, config: StateStoreConfig | None = None) -> StateStore:
    """RedisStateStore on redis_url, or an InMemoryStateStore when it is empty."""
    if not redis_url:
        return InMemoryStateStore(config)
    return RedisStateStore.from_url(redis_url, config)


def open_async_state_store(redis_url: str, config: StateStoreConfig | None = None) -> AsyncStateStore:
    """AsyncRedisStateStore on redis_url, or an AsyncInMemoryStateStore when it is empty."""
    if not redis_url:
        return AsyncInMemoryStateStore(config=config)
    return AsyncRedisStateStore.from_url(redis_url, config)


__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TTL_S",
    "TERMINAL_STATUSES",
    "AsyncInMemoryStateStore",
    "AsyncRedisStateStore",
    "AsyncStateStore",
    "InMemoryStateStore",
    "RedisStateStore",
    "RequestState",
    "RequestStatus",
    "StateStore",
    "StateStoreConfig",
    "decode_token_ids",
    "encode_token_ids",
    "open_async_state_store",
    "open_state_store",
]
