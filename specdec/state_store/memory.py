"""The in-process state store: the single-machine default when no Redis URL is
configured. Same interface and semantics as RedisStateStore (one test suite
runs against both), but the state dies with the process."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import AlreadyExists, FailedPrecondition, NotFound
from specdec.state_store.types import (
    set_status_by_step,
    TOKEN_BYTES,
    RequestState,
    RequestStatus,
    StateStoreConfig,
    check_request_id,
    check_step,
    decode_token_ids,
    encode_json,
    encode_token_ids,
    token_count_mismatch,
)


@dataclass(slots=True)
class _Entry:
    """One request, stored encoded as in Redis (JSON text, packed tokens), so
    both stores accept and return exactly the same values."""

    params_json: str
    status: RequestStatus
    prompt: bytes
    created_ms: int
    updated_ms: int
    expires_at: float
    tokens: bytearray = field(default_factory=bytearray)
    stats_json: str = "{}"
    controller_json: str = "{}"
    finish_reason: str = ""
    error: str = ""
    owner: str = ""
    owner_expires_at: float = 0.0
    kv_lease: str = ""
    node: str = ""


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

    def create(
        self,
        request_id: str,
        params: Mapping[str, Any],
        *,
        prompt_token_ids: Sequence[int] = (),
        status: RequestStatus = RequestStatus.QUEUED,
    ) -> None:
        check_request_id(request_id)
        check_step(status, None)
        params_json = encode_json("params", params)
        prompt = encode_token_ids(prompt_token_ids)
        with self._lock:
            if self._live(request_id) is not None:
                raise AlreadyExists("request_id", f"request {request_id!r} exists already")
            now_ms = self._wall_clock_ms()
            self._entries[request_id] = _Entry(
                params_json, status, prompt, now_ms, now_ms, self._clock() + self.config.ttl_s
            )

    def append_step(
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
        check_step(status, expected_num_tokens)
        packed = encode_token_ids(token_ids)
        stats_json = None if stats is None else encode_json("stats", stats)
        controller_json = None if controller_state is None else encode_json("controller_state", controller_state)
        with self._lock:
            entry = self._require(request_id)
            num_stored = len(entry.tokens) // TOKEN_BYTES
            if _is_replay(entry.tokens, packed, expected_num_tokens):
                return num_stored
            if entry.status.is_terminal:
                raise FailedPrecondition("request_id", f"request {request_id!r} has ended ({entry.status})")
            if expected_num_tokens is not None and num_stored != expected_num_tokens:
                raise token_count_mismatch(num_stored, expected_num_tokens)
            now = self._clock()
            if owner is not None:
                self._check_owner(request_id, entry, owner, now)  # before any change: the write is atomic
                entry.owner_expires_at = now + self.config.lease_s
            entry.tokens += packed
            if stats_json is not None:
                entry.stats_json = stats_json
            if controller_json is not None:
                entry.controller_json = controller_json
            if finish_reason is not None:
                entry.finish_reason = finish_reason
            if error is not None:
                entry.error = error
            if kv_lease is not None:
                entry.kv_lease = kv_lease
            if node is not None:
                entry.node = node
            if status is not None:
                entry.status = status
                if status.is_terminal:
                    entry.owner, entry.owner_expires_at = "", 0.0
            entry.updated_ms = self._wall_clock_ms()
            entry.expires_at = now + self.config.ttl_s
            return len(entry.tokens) // TOKEN_BYTES

    def set_status(self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = "") -> bool:
        return set_status_by_step(self, request_id, status, finish_reason=finish_reason, error=error)

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

    def load(self, request_id: str) -> RequestState | None:
        with self._lock:
            entry = self._live(request_id)
            if entry is None:
                return None
            is_owned = entry.owner and entry.owner_expires_at > self._clock()
            return RequestState(
                request_id=request_id,
                params=json.loads(entry.params_json),
                status=entry.status,
                prompt_token_ids=decode_token_ids(entry.prompt),
                token_ids=decode_token_ids(bytes(entry.tokens)),
                stats=json.loads(entry.stats_json),
                controller_state=json.loads(entry.controller_json),
                finish_reason=entry.finish_reason,
                error=entry.error,
                owner=entry.owner if is_owned else "",
                created_ms=entry.created_ms,
                updated_ms=entry.updated_ms,
                kv_lease=entry.kv_lease,
                node=entry.node,
            )

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
            raise NotFound("request_id", f"no stored request {request_id!r}")
        return entry

    def _check_owner(self, request_id: str, entry: _Entry, owner: str, now: float) -> None:
        if entry.owner != owner and entry.owner_expires_at > now:
            raise FailedPrecondition("owner", f"the lease of {request_id!r} is held by {entry.owner!r}, not {owner!r}")
        entry.owner = owner


def _is_replay(tokens: bytearray, packed: bytes, expected_num_tokens: int | None) -> bool:
    """Whether a step write repeats one already applied: the log ends with exactly its tokens at
    its position (expected_num_tokens), so its first attempt landed and the reply was lost. The
    store answers it with the count and writes nothing (the Redis step script's same check)."""
    if expected_num_tokens is None or not packed:
        return False
    start = expected_num_tokens * TOKEN_BYTES
    return len(tokens) == start + len(packed) and tokens[start:] == packed
