"""The request state store: Redis when a URL is configured, else in memory.

store = open_state_store(redis_url)          # "" -> InMemoryStateStore
store.create(request_id, params, prompt_token_ids=prompt_ids)
n = store.append_step(request_id, [t1, t2, bonus], expected_num_tokens=n, stats=...)
state = store.load(request_id)               # recovery: re-prefill prompt + tokens
"""

from __future__ import annotations

from specdec.state_store.memory import InMemoryStateStore
from specdec.state_store.redis_store import RedisStateStore
from specdec.state_store.types import (
    DEFAULT_LEASE_S,
    DEFAULT_NAMESPACE,
    DEFAULT_TTL_S,
    TERMINAL_STATUSES,
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


__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TTL_S",
    "TERMINAL_STATUSES",
    "InMemoryStateStore",
    "RedisStateStore",
    "RequestState",
    "RequestStatus",
    "StateStore",
    "StateStoreConfig",
    "decode_token_ids",
    "encode_token_ids",
    "open_state_store",
]
