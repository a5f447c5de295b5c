"""The request state store's layout on Redis: keys, Lua scripts, their arguments and replies, and
the mapping of Redis errors to domain errors. No I/O: AsyncRedisStateStore (redis_store.py) sends
these.

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

import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import redis
import redis.exceptions

from specdec.errors import Unavailable
from specdec.state_store.record import create_record, flat, state_from_record, step_meta
from specdec.state_store.types import (
    TERMINAL_STATUSES,
    CreateOptions,
    RequestState,
    RequestStatus,
    StateStoreConfig,
    StepFields,
    check_request_id,
    encode_token_ids,
    lease_held,
    request_ended,
    request_exists,
    request_not_found,
    token_count_mismatch,
)

# An error reply of the scripts below: a code, then an optional detail.
_SCRIPT_ERROR = re.compile(r"(SPECDEC_[A-Z_]+)(?: (.*))?$")
_TERMINAL_LUA = " or ".join(f"s == '{s}'" for s in sorted(TERMINAL_STATUSES))
_LIVE_STATUSES = frozenset(s.value for s in RequestStatus if not s.is_terminal)

# KEYS: meta, tokens, prompt, owner.
# ARGV: packed prompt, ttl_ms, then field/value pairs of the meta hash (specdec.state_store.record).
CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local m = redis.call('HMGET', KEYS[1], 'status', 'created_ms')
  -- (a field that is missing, false here, would fail the concatenation: the id is taken all the same)
  return redis.error_reply('SPECDEC_EXISTS ' .. (m[1] or '') .. ' ' .. (m[2] or ''))
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if string.len(ARGV[1]) > 0 then redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2]) end
return 1
"""

# The per-step write. Checks in the in-memory store's order: exists, a replay (record.is_replay),
# not ended, token count, lease; then appends, sets fields, re-arms expiry.
# A replay is idempotent, keyed by the step's position (expected count): when the log already ends
# with exactly this step's tokens at that position, the step was applied and its reply lost (a
# timeout, a failover): it succeeds with the count, changing nothing stored but the expiry, which it
# re-arms as any write does. E.g. log [a b c d], expected 2, tokens [c d] -> 4, unchanged; tokens
# [c e] or expected 1 -> MISMATCH. (The expiry makes the replay a replicated write: on a replicated
# Redis the WAIT that follows it on its connection then covers the step it replays, replica_ack.py.)
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
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
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

# The compare-and-set takeover: the lease moves to ARGV[1] only while ARGV[3] (a gateway found
# gone) holds it. One slot: both keys carry the request's hash tag.
# KEYS: meta, owner. ARGV: owner, lease_ms, dead owner.
TAKE_OVER_LUA = f"""
local function is_terminal(s) return {_TERMINAL_LUA} end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return redis.error_reply('SPECDEC_NOT_FOUND') end
if is_terminal(status) then return 0 end
if redis.call('GET', KEYS[2]) ~= ARGV[3] then return 0 end
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


class RedisLayout:
    """A namespace's keys, the scripts' arguments and the parsing of their replies."""

    def __init__(self, config: StateStoreConfig | None, wall_clock_ms: Callable[[], int] | None) -> None:
        self.config = StateStoreConfig() if config is None else config
        self._wall_clock_ms = wall_clock_ms or (lambda: int(time.time() * 1000))
        self._ttl_ms = max(1, round(self.config.ttl_s * 1000))
        self._lease_ms = max(1, round(self.config.lease_s * 1000))
        self.active_key = f"{self.config.namespace}:active"

    def keys(self, request_id: str) -> tuple[str, str, str, str]:
        """meta, tokens, prompt, owner keys of request_id; InvalidArgument for an id with braces (as
        create refuses it): a '}' first would leave the hash tag empty and put each key in a slot of its
        own, and every script over them would fail CROSSSLOT on a cluster."""
        check_request_id(request_id)
        base = f"{self.config.namespace}:req:{{{request_id}}}"
        return f"{base}:meta", f"{base}:tokens", f"{base}:prompt", f"{base}:owner"

    def create_args(
        self, request_id: str, params: Mapping[str, Any], options: CreateOptions
    ) -> tuple[list[bytes | str | int], int]:
        """The create script's ARGV, and the creation time that scores the request in the index."""
        now_ms = self._wall_clock_ms()
        meta, prompt = create_record(request_id, params, options, now_ms)
        return [prompt, self._ttl_ms, *flat(meta)], now_ms

    def step_args(self, token_ids: Sequence[int], step: StepFields) -> list[bytes | str | int]:
        """The step script's ARGV (append_step's arguments, checked and encoded)."""
        fields = step_meta(step)
        expected_num_tokens = step.get("expected_num_tokens")
        return [
            encode_token_ids(token_ids),
            -1 if expected_num_tokens is None else expected_num_tokens,
            self._ttl_ms,
            self._wall_clock_ms(),
            step.get("owner") or "",
            self._lease_ms,
            *flat(fields),
        ]

    def claim_keys_args(self, request_id: str, owner: str) -> tuple[list[str], list[str | int]]:
        """The claim script's KEYS and ARGV."""
        if not owner:
            raise ValueError("owner must not be empty")
        meta, _, _, owner_key = self.keys(request_id)
        return [meta, owner_key], [owner, self._lease_ms]

    def take_over_keys_args(self, request_id: str, owner: str, dead_owner: str) -> tuple[list[str], list[str | int]]:
        """The takeover script's KEYS and ARGV."""
        if not dead_owner:
            raise ValueError("dead_owner must not be empty")
        keys, args = self.claim_keys_args(request_id, owner)
        return keys, [*args, dead_owner]

    def status_keys(self, members: list[bytes]) -> tuple[list[str], list[str]]:
        """The ids of the index's members and their meta keys, whose statuses list_active reads
        (clients are made without decode_responses: members come back as bytes)."""
        ids = [rid.decode(errors="replace") for rid in members]
        # Not keys(), which refuses an id with braces: one such member (written by hand) must not fail
        # the listing; a single-key HGET needs no common slot, and finding no status prunes it.
        return ids, [f"{self.config.namespace}:req:{{{rid}}}:meta" for rid in ids]


def state_from_reply(request_id: str, replies: list[Any]) -> RequestState | None:
    """The RequestState from the load script's reply; None when the meta hash is gone."""
    meta, tokens, prompt, owner = (reply or None for reply in replies)  # Lua's false -> None
    if not meta:
        return None
    # errors="replace": a value that is not UTF-8 (written by hand) is refused by the field's own
    # check (state_from_record) where it matters, and kept as text where it does not (an error message).
    text = {meta[i].decode(errors="replace"): meta[i + 1].decode(errors="replace") for i in range(0, len(meta), 2)}
    return state_from_record(request_id, text, tokens, prompt, (owner or b"").decode(errors="replace"))


def split_stale(ids: list[str], statuses: list[bytes | None]) -> tuple[list[str], list[str]]:
    """(active, stale) ids: stale ones have ended or expired and leave the index. A status that is
    no RequestStatus (written by hand) is not an end: that request stays listed, and its load says
    what is wrong with it, rather than one record failing the list of every active request."""
    ended = {s.value.encode() for s in TERMINAL_STATUSES}
    stale = [rid for rid, status in zip(ids, statuses, strict=True) if status is None or status in ended]
    stale_set = set(stale)
    return [rid for rid in ids if rid not in stale_set], stale


def live_duplicate_created_ms(e: redis.ResponseError) -> int | None:
    """The creation time of the existing request a create was refused for, when that request
    is still live (not ended); None otherwise. A create retried after its first attempt
    landed (its reply lost) must still leave the request in the index of active ones."""
    match = _SCRIPT_ERROR.search(str(e))
    if match is None or match.group(1) != "SPECDEC_EXISTS" or not match.group(2):
        return None
    status, _, created_ms = match.group(2).partition(" ")
    if status not in _LIVE_STATUSES or not created_ms.isdigit():  # a record written by hand: not ours
        return None
    return int(created_ms)


@contextmanager
def redis_errors(request_id: str, expected_num_tokens: int | None = None, owner: str | None = None) -> Iterator[None]:
    """Turn Redis errors into the domain errors the in-memory store raises."""
    try:
        yield
    except UNAVAILABLE_ERRORS as e:
        raise Unavailable("state_store", f"Redis unreachable: {e}", dependency="state_store") from e
    except redis.exceptions.RedisClusterException as e:
        # No node of a cluster answered: after a connection error the cluster client re-reads the slot
        # map, and when no node answers that either it raises this ("Redis Cluster cannot be connected")
        # with the last node's error as the cause, not the ConnectionError a lone server gives.
        if isinstance(e.__cause__, UNAVAILABLE_ERRORS):
            raise Unavailable("state_store", f"Redis unreachable: {e}", dependency="state_store") from e
        raise
    except redis.ResponseError as e:
        # The script's reply (prefixed with the command when raised from a pipeline).
        match = _SCRIPT_ERROR.search(str(e))
        if match is None:
            raise
        code, detail = match.group(1), match.group(2) or ""
        if code == "SPECDEC_EXISTS":
            raise request_exists(request_id) from None
        if code == "SPECDEC_NOT_FOUND":
            raise request_not_found(request_id) from None
        if code == "SPECDEC_ENDED":
            raise request_ended(request_id, detail) from None
        if code == "SPECDEC_MISMATCH":
            raise token_count_mismatch(int(float(detail)), expected_num_tokens or 0) from None
        if code == "SPECDEC_NOT_OWNER":
            raise lease_held(request_id, detail, owner) from None
        raise
