"""The request state store: Redis when a URL is configured, else in memory.

On the gateway's event loop (grpc.aio request loops), every call awaited:
store = open_async_state_store(redis_url)    # "" -> AsyncInMemoryStateStore
await store.create(request_id, params, prompt_token_ids=prompt_ids)
n = await store.append_step(request_id, [t1, t2, bonus], expected_num_tokens=n, stats=...)
state = await store.load(request_id)         # recovery: re-prefill prompt + tokens

Synchronous tools and tests get the same store as plain calls (SyncStateStore, specdec.state_store.sync):
store = open_state_store(redis_url)
n = store.append_step(request_id, [t1, t2, bonus], expected_num_tokens=n)
"""

from __future__ import annotations

from specdec.state_store.memory import AsyncInMemoryStateStore, InMemoryStateStore
from specdec.state_store.redis_store import DEFAULT_COMMAND_TIMEOUT_S, AsyncRedisStateStore
from specdec.state_store.sync import RedisStateStore, SyncStateStore
from specdec.state_store.types import (
    DEFAULT_LEASE_S,
    DEFAULT_NAMESPACE,
    DEFAULT_TTL_S,
    TERMINAL_STATUSES,
    AsyncStateStore,
    RequestState,
    RequestStatus,
    StateStoreConfig,
    StepFields,
    decode_token_ids,
    encode_token_ids,
)


def open_async_state_store(
    redis_url: str, config: StateStoreConfig | None = None, *, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S
) -> AsyncStateStore:
    """AsyncRedisStateStore on redis_url (a command that takes over timeout_s fails Unavailable), or an
    AsyncInMemoryStateStore when it is empty."""
    if not redis_url:
        return AsyncInMemoryStateStore(config=config)
    return AsyncRedisStateStore.from_url(redis_url, config, timeout_s=timeout_s)


def open_state_store(redis_url: str, config: StateStoreConfig | None = None) -> SyncStateStore:
    """open_async_state_store's store, for synchronous callers."""
    if not redis_url:
        return SyncStateStore(AsyncInMemoryStateStore(config=config))
    return RedisStateStore.from_url(redis_url, config)


__all__ = [
    "DEFAULT_COMMAND_TIMEOUT_S",
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
    "StateStoreConfig",
    "StepFields",
    "SyncStateStore",
    "decode_token_ids",
    "encode_token_ids",
    "open_async_state_store",
    "open_state_store",
]
