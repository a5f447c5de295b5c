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
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from specdec.state_store.redis_store import DEFAULT_COMMAND_TIMEOUT_S, AsyncRedisStateStore
from specdec.state_store.types import AsyncStateStore, StateStoreConfig

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _blocking(
    method: Callable[Concatenate[AsyncStateStore, _P], Coroutine[Any, Any, _R]],
) -> Callable[Concatenate[SyncStateStore, _P], _R]:
    """The blocking twin of an AsyncStateStore method: it runs the method of that name of the
    wrapped store on the facade's loop and returns its result (or raises its error)."""
    name = method.__name__

    def call(self: SyncStateStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return self.run(getattr(self.store, name)(*args, **kwargs))

    call.__name__ = call.__qualname__ = name
    return call


class SyncStateStore:
    """`store`'s methods as blocking calls, with the same arguments, results and errors."""

    def __init__(self, store: AsyncStateStore) -> None:
        self.store = store
        self._loop = asyncio.new_event_loop()
        # A daemon: a tool that exits without close() is not held up by it.
        self._thread = threading.Thread(target=self._loop.run_forever, name="state-store-loop", daemon=True)
        self._thread.start()

    def run(self, call: Coroutine[Any, Any, _R]) -> _R:
        """Run a coroutine of the store on its loop, waiting for its result."""
        if self._loop.is_closed():
            call.close()
            raise RuntimeError("the state store is closed")
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    create = _blocking(AsyncStateStore.create)
    append_step = _blocking(AsyncStateStore.append_step)
    set_status = _blocking(AsyncStateStore.set_status)
    claim = _blocking(AsyncStateStore.claim)
    take_over = _blocking(AsyncStateStore.take_over)
    load = _blocking(AsyncStateStore.load)
    list_active = _blocking(AsyncStateStore.list_active)
    delete = _blocking(AsyncStateStore.delete)

    def close(self) -> None:
        """Close the store on its loop, then stop the loop's thread. A second close does nothing."""
        if self._loop.is_closed():
            return
        try:
            self.run(self.store.close())
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
    def from_url(
        cls, url: str, config: StateStoreConfig | None = None, *, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S
    ) -> RedisStateStore:
        """url: any --redis_url (specdec.state_store.redis_url): one server, a cluster or sentinels."""
        return cls(AsyncRedisStateStore.from_url(url, config, timeout_s=timeout_s))

    def keys(self, request_id: str) -> tuple[str, str, str, str]:
        """meta, tokens, prompt, owner keys of request_id."""
        return self.store.keys(request_id)
