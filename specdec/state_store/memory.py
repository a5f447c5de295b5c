"""The in-process state store: the single-machine default when no Redis URL is
configured. Same semantics as AsyncRedisStateStore (one test suite runs against both), but the
state dies with the process.

InMemoryStateStore is a dict under a lock, called directly (no I/O, so nothing to await): tests
inspect it and inject faults by subclassing it. AsyncInMemoryStateStore is the AsyncStateStore the
gateway gets: it calls the wrapped store inline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, Unpack, cast

from specdec.errors import FailedPrecondition
from specdec.state_store.record import create_record, is_replay, state_from_record, step_meta
from specdec.state_store.types import (
    TOKEN_BYTES,
    CreateOptions,
    RequestState,
    RequestStatus,
    StateStoreConfig,
    StepFields,
    encode_token_ids,
    lease_held,
    request_ended,
    request_exists,
    request_not_found,
    set_status_by_step,
    token_count_mismatch,
)

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(slots=True)
class _Entry:
    """One request's record, encoded as in Redis (specdec.state_store.record)."""

    meta: dict[str, str]
    prompt: bytes
    tokens: bytearray
    expires_at: float
    owner: str = ""
    owner_expires_at: float = 0.0

    @property
    def status(self) -> RequestStatus:
        return RequestStatus(self.meta["status"])


class InMemoryStateStore:
    """A thread-safe dict of requests with TTL expiry on a caller-given clock."""

    def __init__(
        self,
        config: StateStoreConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ms: Callable[[], int] | None = None,
    ) -> None:
        self.config = StateStoreConfig() if config is None else config
        self._clock = clock
        self._wall_clock_ms = wall_clock_ms or (lambda: int(time.time() * 1000))
        self._lock = threading.Lock()
        # Insertion order = creation order, which list_active reports.
        self._entries: dict[str, _Entry] = {}

    def create(self, request_id: str, params: Mapping[str, Any], **options: Unpack[CreateOptions]) -> None:
        meta, prompt = create_record(request_id, params, options, self._wall_clock_ms())
        with self._lock:
            if self._live(request_id) is not None:
                raise request_exists(request_id)
            self._entries[request_id] = _Entry(meta, prompt, bytearray(), self._clock() + self.config.ttl_s)

    def append_step(self, request_id: str, token_ids: Sequence[int] = (), **step: Unpack[StepFields]) -> int:
        fields = step_meta(step)
        packed = encode_token_ids(token_ids)
        expected_num_tokens, owner = step.get("expected_num_tokens"), step.get("owner")
        with self._lock:
            entry = self._require(request_id)
            num_stored = len(entry.tokens) // TOKEN_BYTES
            if is_replay(entry.tokens, packed, expected_num_tokens):
                return num_stored
            if entry.status.is_terminal:
                raise request_ended(request_id, entry.status)
            if expected_num_tokens is not None and num_stored != expected_num_tokens:
                raise token_count_mismatch(num_stored, expected_num_tokens)
            now = self._clock()
            if owner:
                self._check_owner(request_id, entry, owner, now)  # before any change: the write is atomic
                entry.owner, entry.owner_expires_at = owner, now + self.config.lease_s
            entry.tokens += packed
            entry.meta.update(fields, updated_ms=str(self._wall_clock_ms()))
            if entry.status.is_terminal:
                entry.owner, entry.owner_expires_at = "", 0.0
            entry.expires_at = now + self.config.ttl_s
            return len(entry.tokens) // TOKEN_BYTES

    def set_status(self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = "") -> bool:
        """A step that appends nothing, through this store's append_step (so an override applies)."""
        try:
            self.append_step(request_id, status=status, finish_reason=finish_reason, error=error)
        except FailedPrecondition:
            return False
        return True

    def claim(self, request_id: str, owner: str) -> bool:
        if not owner:
            raise ValueError("owner must not be empty")
        with self._lock:
            entry = self._require(request_id)
            now = self._clock()
            if entry.status.is_terminal:
                return False
            if entry.owner and entry.owner != owner and entry.owner_expires_at > now:
                return False
            entry.owner, entry.owner_expires_at = owner, now + self.config.lease_s
            return True

    def take_over(self, request_id: str, owner: str, dead_owner: str) -> bool:
        if not owner or not dead_owner:
            raise ValueError("owner and dead_owner must not be empty")
        with self._lock:
            entry = self._require(request_id)
            now = self._clock()
            if entry.status.is_terminal or entry.owner != dead_owner or entry.owner_expires_at <= now:
                return False
            entry.owner, entry.owner_expires_at = owner, now + self.config.lease_s
            return True

    def load(self, request_id: str) -> RequestState | None:
        with self._lock:
            entry = self._live(request_id)
            if entry is None:
                return None
            is_owned = entry.owner and entry.owner_expires_at > self._clock()
            owner = entry.owner if is_owned else ""
            return state_from_record(request_id, entry.meta, bytes(entry.tokens), entry.prompt, owner)

    def list_active(self) -> list[str]:
        with self._lock:
            return [
                rid for rid in list(self._entries) if (e := self._live(rid)) is not None and not e.status.is_terminal
            ]

    def delete(self, request_id: str) -> bool:
        with self._lock:
            return self._entries.pop(request_id, None) is not None

    def close(self) -> None:
        """Nothing to release."""

    def _live(self, request_id: str) -> _Entry | None:
        """The entry unless missing or expired (expired ones are dropped). Lock held."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.expires_at <= self._clock():
            del self._entries[request_id]
            return None
        return entry

    def _require(self, request_id: str) -> _Entry:
        entry = self._live(request_id)
        if entry is None:
            raise request_not_found(request_id)
        return entry

    def _check_owner(self, request_id: str, entry: _Entry, owner: str, now: float) -> None:
        if entry.owner != owner and entry.owner_expires_at > now:
            raise lease_held(request_id, entry.owner, owner)


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
    take_over = _inline(InMemoryStateStore.take_over)
    load = _inline(InMemoryStateStore.load)
    list_active = _inline(InMemoryStateStore.list_active)
    delete = _inline(InMemoryStateStore.delete)
    close = _inline(InMemoryStateStore.close)

    async def set_status(
        self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = ""
    ) -> bool:
        # Through this store's append_step, as in the other stores, so an override of it applies.
        return await set_status_by_step(self, request_id, status, finish_reason=finish_reason, error=error)
