"""The request state store on Redis (redis-py with the hiredis parser).

Keys of request R, all expiring ttl_s after the request's last write:
    {ns}:req:{R}:meta    hash: params, status, stats, controller (JSON text),
                         finish_reason, error, created_ms, updated_ms,
                         kv_lease, node (once the gateway wrote them)
    {ns}:req:{R}:tokens  string: committed token ids, int32 little-endian,
                         grown with APPEND (4 bytes per token, one value)
    {ns}:req:{R}:prompt  string: prompt token ids, same packing
    {ns}:req:{R}:owner   string: the gateway holding the lease (expires lease_s)
and one index, {ns}:active, a sorted set of active ids scored by creation time.
The literal braces make {R} a Redis Cluster hash tag: a request's keys share a
slot, so the Lua scripts below (one round trip each) stay cluster-safe; only
the index lives elsewhere and is touched at creation, at the end and by
list_active. The meta hash is the truth; the index may briefly hold ids of
ended or expired requests, which list_active filters out and prunes.

Why APPEND to one string rather than RPUSH of one packed item per step
(scripts/measure_state_store.py, unix socket, 3000 steps of 4 tokens): the
writes cost the same (185 vs 200 us median per MULTI), but loading the log
back, what recovery and GetRequest do, is 5x faster (GET 132 us vs LRANGE +
join 695 us for 12000 tokens). The string's cost is Redis' doubling growth:
at most ~2x the 4 bytes per token. The whole per-step write (append_step:
checks, APPEND, HSET stats/controller, lease, PEXPIRE) is one EVALSHA:
~37 us on the server, ~235 us median seen by the Python client, against a
~110 us PING round trip on the same (busy, 2-core) machine.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

import redis
import redis.exceptions

from specdec.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from specdec.state_store.clients import SyncClient, close_sync_client, open_sync_client
from specdec.state_store.redis_url import parse_redis_url
from specdec.state_store.types import (
    set_status_by_step,
    TERMINAL_STATUSES,
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

# An error reply of the scripts below: a code, then an optional detail.
_SCRIPT_ERROR = re.compile(r"(SPECDEC_[A-Z_]+)(?: (.*))?$")
_TERMINAL_LUA = " or ".join(f"s == '{s}'" for s in sorted(TERMINAL_STATUSES))

# KEYS: meta, tokens, prompt, owner.
# ARGV: params JSON, status, packed prompt, ttl_ms, now_ms.
CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local m = redis.call('HMGET', KEYS[1], 'status', 'created_ms')
  return redis.error_reply('SPECDEC_EXISTS ' .. m[1] .. ' ' .. m[2])
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1], 'params', ARGV[1], 'status', ARGV[2], 'stats', '{}', 'controller', '{}',
           'finish_reason', '', 'error', '', 'created_ms', ARGV[5], 'updated_ms', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if string.len(ARGV[3]) > 0 then redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4]) end
return 1
"""

# The per-step write. Checks in the in-memory store's order: exists, a replay, not ended, token
# count, lease; then appends, sets fields, re-arms expiry.
# A replay is idempotent, keyed by the step's position (expected count): when the log already ends
# with exactly this step's tokens at that position, the step was applied and its reply lost (a
# timeout, a failover): it succeeds with the count, writing nothing. E.g. log [a b c d],
# expected 2, tokens [c d] -> 4, unchanged; tokens [c e] or expected 1 -> MISMATCH.
# KEYS: meta, tokens, prompt, owner.
# ARGV: packed tokens, expected count (-1: no check), ttl_ms, now_ms, owner ('' : none),
#       lease_ms, then field/value pairs for the meta hash.
STEP_LUA = f"""
local function is_terminal(s) return {_TERMINAL_LUA} end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return redis.error_reply('SPECDEC_NOT_FOUND') end
local n = redis.call('STRLEN', KEYS[2]) / 4
local expected = tonumber(ARGV[2])
local size = string.len(ARGV[1])
if expected >= 0 and size > 0 and n * 4 == expected * 4 + size
   and redis.call('GETRANGE', KEYS[2], expected * 4, -1) == ARGV[1] then
  return n
end
if is_terminal(status) then return redis.error_reply('SPECDEC_ENDED ' .. status) end
if expected >= 0 and n ~= expected then return redis.error_reply('SPECDEC_MISMATCH ' .. n) end
if ARGV[5] ~= '' then
  local holder = redis.call('GET', KEYS[4])
  if holder and holder ~= ARGV[5] then return redis.error_reply('SPECDEC_NOT_OWNER ' .. holder) end
end
if string.len(ARGV[1]) > 0 then n = redis.call('APPEND', KEYS[2], ARGV[1]) / 4 end
if #ARGV > 6 then redis.call('HSET', KEYS[1], unpack(ARGV, 7)) end
redis.call('HSET', KEYS[1], 'updated_ms', ARGV[4])
if is_terminal(redis.call('HGET', KEYS[1], 'status')) then
  redis.call('DEL', KEYS[4])
elseif ARGV[5] ~= '' then
  redis.call('SET', KEYS[4], ARGV[5], 'PX', ARGV[6])
end
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return n
"""

# KEYS: meta, owner. ARGV: owner, lease_ms.
CLAIM_LUA = f"""
local function is_terminal(s) return {_TERMINAL_LUA} end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return redis.error_reply('SPECDEC_NOT_FOUND') end
if is_terminal(status) then return 0 end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: meta, tokens, prompt, owner. Returns {meta as field/value list, tokens, prompt, owner}
# (false for a missing key): one consistent snapshot, one round trip, one cluster slot.
LOAD_LUA = """
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3]),
        redis.call('GET', KEYS[4])}
"""

# KEYS: meta, tokens, prompt, owner. Returns 1 when the meta hash existed.
DELETE_LUA = """
local existed = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
return existed
"""

# Errors of a Redis that is away for now (down, failing over, resharding): the store reports them
# as Unavailable, which its callers retry (gateway.state_retry). ReadOnlyError: a write reached a
# master just demoted to a replica; AskError (and MovedError): redirects that outlived the
# client's own retries while the slot map changed.
UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.SlotNotCoveredError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.AskError,
)


class RedisStoreBase:
    """What RedisStateStore and AsyncRedisStateStore share: the key layout, the scripts'
    arguments and the parsing of replies (with redis_errors, their mapping to domain errors).
    No I/O here, so the two stores differ only in how they wait for Redis."""

    def __init__(self, config: StateStoreConfig | None, wall_clock_ms: Callable[[], int] | None) -> None:
        self.config = StateStoreConfig() if config is None else config
        self._wall_clock_ms = wall_clock_ms or (lambda: int(time.time() * 1000))
        self._ttl_ms = max(1, round(self.config.ttl_s * 1000))
        self._lease_ms = max(1, round(self.config.lease_s * 1000))
        self._active_key = f"{self.config.namespace}:active"

    def keys(self, request_id: str) -> tuple[str, str, str, str]:
        """meta, tokens, prompt, owner keys of request_id."""
        base = f"{self.config.namespace}:req:{{{request_id}}}"
        return f"{base}:meta", f"{base}:tokens", f"{base}:prompt", f"{base}:owner"

    def _create_args(
        self, request_id: str, params: Mapping[str, Any], prompt_token_ids: Sequence[int], status: RequestStatus
    ) -> tuple[list[bytes | str | int], int]:
        """The create script's ARGV, and the creation time that scores the request in the index."""
        check_request_id(request_id)
        check_step(status, None)
        now_ms = self._wall_clock_ms()
        args = [encode_json("params", params), status.value, encode_token_ids(prompt_token_ids), self._ttl_ms, now_ms]
        return args, now_ms

    def _step_args(
        self,
        token_ids: Sequence[int],
        expected_num_tokens: int | None,
        status: RequestStatus | None,
        stats: Mapping[str, Any] | None,
        controller_state: Mapping[str, Any] | None,
        finish_reason: str | None,
        error: str | None,
        owner: str | None,
        kv_lease: str | None = None,
        node: str | None = None,
    ) -> list[bytes | str | int]:
        """The step script's ARGV (append_step's arguments, checked and encoded)."""
        check_step(status, expected_num_tokens)
        fields: list[str] = []
        for name, value in (
            ("status", None if status is None else status.value),
            ("stats", None if stats is None else encode_json("stats", stats)),
            ("controller", None if controller_state is None else encode_json("controller_state", controller_state)),
            ("finish_reason", finish_reason),
            ("error", error),
            ("kv_lease", kv_lease),
            ("node", node),
        ):
            if value is not None:
                fields += [name, value]
        return [
            encode_token_ids(token_ids),
            -1 if expected_num_tokens is None else expected_num_tokens,
            self._ttl_ms,
            self._wall_clock_ms(),
            owner or "",
            self._lease_ms,
            *fields,
        ]

    def _claim_keys_args(self, request_id: str, owner: str) -> tuple[list[str], list[str | int]]:
        """The claim script's KEYS and ARGV."""
        if not owner:
            raise ValueError("owner must not be empty")
        meta, _, _, owner_key = self.keys(request_id)
        return [meta, owner_key], [owner, self._lease_ms]

    @staticmethod
    def _state(request_id: str, replies: list[Any]) -> RequestState | None:
        """The RequestState from the load script's reply; None when the meta hash is gone."""
        meta, tokens, prompt, owner = (reply or None for reply in replies)  # Lua's false -> None
        if not meta:
            return None
        text = {meta[i].decode(): meta[i + 1].decode() for i in range(0, len(meta), 2)}
        return RequestState(
            request_id=request_id,
            params=json.loads(text["params"]),
            status=RequestStatus(text["status"]),
            prompt_token_ids=decode_token_ids(prompt),
            token_ids=decode_token_ids(tokens),
            stats=json.loads(text["stats"]),
            controller_state=json.loads(text["controller"]),
            finish_reason=text["finish_reason"],
            error=text["error"],
            owner=(owner or b"").decode(),
            created_ms=int(text["created_ms"]),
            updated_ms=int(text["updated_ms"]),
            kv_lease=text.get("kv_lease", ""),
            node=text.get("node", ""),
        )

    def _queue_statuses(self, pipe: Any, members: list[bytes]) -> tuple[list[str], Any]:
        """The ids of the index's members, with their statuses queued on pipe (a non-transactional
        pipeline of any client: a cluster's spans slots). Clients are made
        without decode_responses (from_url): members come back as bytes."""
        ids = [rid.decode() for rid in members]
        for rid in ids:
            pipe.hget(self.keys(rid)[0], "status")
        return ids, pipe

    @staticmethod
    def _split_stale(ids: list[str], statuses: list[bytes | None]) -> tuple[list[str], list[str]]:
        """(active, stale) ids: stale ones have ended or expired and leave the index."""
        stale = [
            rid
            for rid, status in zip(ids, statuses, strict=True)
            if status is None or RequestStatus(status.decode()).is_terminal
        ]
        stale_set = set(stale)
        return [rid for rid in ids if rid not in stale_set], stale

    @staticmethod
    def _live_duplicate_created_ms(e: redis.ResponseError) -> int | None:
        """The creation time of the existing request a create was refused for, when that request
        is still live (not ended); None otherwise. A create retried after its first attempt
        landed (its reply lost) must still leave the request in the index of active ones."""
        match = _SCRIPT_ERROR.search(str(e))
        if match is None or match.group(1) != "SPECDEC_EXISTS" or not match.group(2):
            return None
        status, _, created_ms = match.group(2).partition(" ")
        return None if RequestStatus(status).is_terminal else int(created_ms)


class RedisStateStore(RedisStoreBase):
    """StateStore on a Redis server; the client comes in through the constructor."""

    def __init__(
        self,
        client: SyncClient,
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
    def from_url(cls, url: str, config: StateStoreConfig | None = None, *, timeout_s: float = 5.0) -> RedisStateStore:
        """url: any --redis_url (specdec.state_store.redis_url): one server, a cluster or sentinels."""
        return cls(open_sync_client(parse_redis_url(url), timeout_s), config)

    def create(
        self,
        request_id: str,
        params: Mapping[str, Any],
        *,
        prompt_token_ids: Sequence[int] = (),
        status: RequestStatus = RequestStatus.QUEUED,
    ) -> None:
        args, now_ms = self._create_args(request_id, params, prompt_token_ids, status)
        with redis_errors(request_id):
            # Two round trips, not one pipeline: a refused create (an id that exists) must not reach
            # the index of active requests. The index key is in another cluster slot than the
            # request's, so one script cannot write both.
            try:
                self._create(self.keys(request_id), args)
            except redis.ResponseError as e:
                if (created_ms := self._live_duplicate_created_ms(e)) is not None:
                    self._client.zadd(self._active_key, {request_id: created_ms}, nx=True)
                raise
            self._client.zadd(self._active_key, {request_id: now_ms}, nx=True)

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
        args = self._step_args(
            token_ids, expected_num_tokens, status, stats, controller_state, finish_reason, error, owner, kv_lease, node
        )
        with redis_errors(request_id, expected_num_tokens, owner):
            num_tokens = int(self._step(self.keys(request_id), args))
            if status is not None and status.is_terminal:
                # The index only after the write succeeded (a second round trip,
                # once per request): a failed write must leave the request listed.
                self._client.zrem(self._active_key, request_id)
        return num_tokens

    def set_status(self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = "") -> bool:
        return set_status_by_step(self, request_id, status, finish_reason=finish_reason, error=error)

    def claim(self, request_id: str, owner: str) -> bool:
        keys, args = self._claim_keys_args(request_id, owner)
        with redis_errors(request_id):
            return bool(self._claim(keys, args))

    def load(self, request_id: str) -> RequestState | None:
        with redis_errors(request_id):
            replies = self._load(self.keys(request_id))
        return self._state(request_id, replies)

    def list_active(self) -> list[str]:
        with redis_errors("*"):
            members = cast("list[bytes]", self._client.zrange(self._active_key, 0, -1))
            if not members:
                return []
            ids, pipe = self._queue_statuses(self._client.pipeline(transaction=False), members)
            active, stale = self._split_stale(ids, pipe.execute())
            if stale:
                self._client.zrem(self._active_key, *stale)
        return active

    def delete(self, request_id: str) -> bool:
        with redis_errors(request_id):
            num_meta = self._delete(self.keys(request_id))
            self._client.zrem(self._active_key, request_id)
        return int(num_meta) == 1

    def close(self) -> None:
        close_sync_client(self._client)


@contextmanager
def redis_errors(request_id: str, expected_num_tokens: int | None = None, owner: str | None = None) -> Iterator[None]:
    """Turn Redis errors into the domain errors the in-memory store raises."""
    try:
        yield
    except UNAVAILABLE_ERRORS as e:
        raise Unavailable("state_store", f"Redis unreachable: {e}", dependency="state_store") from e
    except redis.ResponseError as e:
        # The script's reply (prefixed with the command when raised from a pipeline).
        match = _SCRIPT_ERROR.search(str(e))
        if match is None:
            raise
        code, detail = match.group(1), match.group(2) or ""
        if code == "SPECDEC_EXISTS":
            raise AlreadyExists("request_id", f"request {request_id!r} exists already") from None
        if code == "SPECDEC_NOT_FOUND":
            raise NotFound("request_id", f"no stored request {request_id!r}") from None
        if code == "SPECDEC_ENDED":
            raise FailedPrecondition("request_id", f"request {request_id!r} has ended ({detail})") from None
        if code == "SPECDEC_MISMATCH":
            raise token_count_mismatch(int(float(detail)), expected_num_tokens or 0) from None
        if code == "SPECDEC_NOT_OWNER":
            raise FailedPrecondition(
                "owner", f"the lease of {request_id!r} is held by {detail!r}, not {owner!r}"
            ) from None
        raise
