"""The state store for synchronous callers (tools, benchmarks, tests): an AsyncStateStore run on an
event loop of its own thread.

The stores are coroutines because the gateway serves every request from one event loop. A tool
that wants plain calls wraps one here instead of a second, blocking implementation of each store:
each call is sent to the facade's loop and waited for. The store's connections (redis.asyncio's
belong to the loop that opened them) live on that one loop, so any thread may call the facade,
including one that runs an event loop of its own.

    store = RedisStateStore.from_url("redis://127.0.0.1:6379/0")
    state = store.load("r1")
    store.close()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar, Unpack

from specdec.state_store.redis_store import AsyncRedisStateStore
from specdec.state_store.types import AsyncStateStore, RequestState, RequestStatus, StateStoreConfig, StepFields

_R = TypeVar("_R")


class SyncStateStore:
    """`store`'s methods as blocking calls, with the same arguments, results and errors."""

    def __init__(self, store: AsyncStateStore) -> None:
        self.store = store
        self._loop = asyncio.new_event_loop()
        # A daemon: a tool that exits without close() is not held up by it.
        self._thread = threading.Thread(target=self._loop.run_forever, name="state-store-loop", daemon=True)
        self._thread.start()

    def _run(self, call: Coroutine[Any, Any, _R]) -> _R:
        if self._loop.is_closed():
            call.close()
            raise RuntimeError("the state store is closed")
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def create(
        self,
        request_id: str,
        params: Mapping[str, Any],
        *,
        prompt_token_ids: Sequence[int] = (),
        status: RequestStatus = RequestStatus.QUEUED,
    ) -> None:
        self._run(self.store.create(request_id, params, prompt_token_ids=prompt_token_ids, status=status))

    def append_step(self, request_id: str, token_ids: Sequence[int] = (), **step: Unpack[StepFields]) -> int:
        return self._run(self.store.append_step(request_id, token_ids, **step))

    def set_status(self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = "") -> bool:
        return self._run(self.store.set_status(request_id, status, finish_reason=finish_reason, error=error))

    def claim(self, request_id: str, owner: str) -> bool:
        return self._run(self.store.claim(request_id, owner))

    def load(self, request_id: str) -> RequestState | None:
        return self._run(self.store.load(request_id))

    def list_active(self) -> list[str]:
        return self._run(self.store.list_active())

    def delete(self, request_id: str) -> bool:
        return self._run(self.store.delete(request_id))

    def close(self) -> None:
        """Close the store on its loop, then stop the loop's thread. A second close does nothing."""
        if self._loop.is_closed():
            return
        try:
            self._run(self.store.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


class RedisStateStore(SyncStateStore):
    """AsyncRedisStateStore for synchronous callers."""

    store: AsyncRedisStateStore

    def __init__(self, store: AsyncRedisStateStore) -> None:
        super().__init__(store)

    @classmethod
    def from_url(cls, url: str, config: StateStoreConfig | None = None, *, timeout_s: float = 5.0) -> RedisStateStore:
        """url: any --redis_url (specdec.state_store.redis_url): one server, a cluster or sentinels."""
        return cls(AsyncRedisStateStore.from_url(url, config, timeout_s=timeout_s))

    def keys(self, request_id: str) -> tuple[str, str, str, str]:
        """meta, tokens, prompt, owner keys of request_id."""
        return self.store.keys(request_id)
