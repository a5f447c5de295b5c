"""A least-recently-used cache with per-entry expiry, for memoizing slow lookups."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class LRUCache(Generic[K, V]):
    def __init__(self, capacity: int, ttl_seconds: float | None = None, clock: Callable[[], float] = time.monotonic):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._entries: OrderedDict[K, tuple[V, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return default
            value, stored_at = entry
            if self._is_expired(stored_at):
                del self._entries[key]
                self.stats.expirations += 1
                self.stats.misses += 1
                return default
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
            self._entries[key] = (value, self._clock())
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.stats.evictions += 1

    def pop(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.pop(key, None)
            return None if entry is None else entry[0]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def get_or_compute(self, key: K, compute: Callable[[K], V]) -> V:
        value = self.get(key)
        if value is not None:
            return value
        value = compute(key)
        self.put(key, value)
        return value

    def _is_expired(self, stored_at: float) -> bool:
        return self.ttl_seconds is not None and self._clock() - stored_at > self.ttl_seconds


def memoize(capacity: int = 128, ttl_seconds: float | None = None):
    def decorator(fn):
        cache: LRUCache = LRUCache(capacity, ttl_seconds)

        def wrapper(*args):
            return cache.get_or_compute(args, lambda key: fn(*key))

        wrapper.cache = cache
        wrapper.__name__ = fn.__name__
        wrapper.__doc__ = fn.__doc__
        return wrapper

    return decorator
