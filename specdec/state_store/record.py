"""A request's record as both stores keep it: the meta hash (field -> text), the token log and
the prompt (packed int32, specdec.state_store.types.encode_token_ids) and the lease holder.

Redis holds these in the keys of specdec.state_store.redis_scripts; the in-memory store holds the
same values in a dict. Both build and read them here, so both accept and return exactly the same
values. The meta hash's fields:
    params, stats, controller   JSON text (controller: the adaptive controller's state)
    status                      a RequestStatus value
    finish_reason, error        text
    created_ms, updated_ms      wall-clock milliseconds, decimal
    kv_lease, node              once the gateway wrote them
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from specdec.state_store.types import (
    TOKEN_BYTES,
    CreateOptions,
    RequestState,
    RequestStatus,
    StepFields,
    check_keywords,
    check_request_id,
    check_step,
    decode_token_ids,
    encode_json,
    encode_token_ids,
    record_corrupt,
)

T = TypeVar("T")


def create_record(
    request_id: str, params: Mapping[str, Any], options: CreateOptions, now_ms: int
) -> tuple[dict[str, str], bytes]:
    """The meta hash and the packed prompt of a new request (create's arguments, checked)."""
    check_request_id(request_id)
    check_keywords("create", options, CreateOptions.__optional_keys__)
    status = options.get("status", RequestStatus.QUEUED)
    check_step({"status": status})
    meta = {
        "params": encode_json("params", params),
        "status": status.value,
        "stats": "{}",
        "controller": "{}",
        "finish_reason": "",
        "error": "",
        "created_ms": str(now_ms),
        "updated_ms": str(now_ms),
    }
    return meta, encode_token_ids(options.get("prompt_token_ids", ()))


def step_meta(step: StepFields) -> dict[str, str]:
    """The meta fields a step replaces: those of `step` that are given, checked and encoded."""
    check_step(step)
    status, stats, controller_state = step.get("status"), step.get("stats"), step.get("controller_state")
    fields = {
        "status": None if status is None else status.value,
        "stats": None if stats is None else encode_json("stats", stats),
        "controller": None if controller_state is None else encode_json("controller_state", controller_state),
        "finish_reason": step.get("finish_reason"),
        "error": step.get("error"),
        "kv_lease": step.get("kv_lease"),
        "node": step.get("node"),
    }
    return {name: value for name, value in fields.items() if value is not None}


def flat(meta: Mapping[str, str]) -> list[str]:
    """{'a': '1', 'b': '2'} -> ['a', '1', 'b', '2'] (HSET's arguments)."""
    return [item for pair in meta.items() for item in pair]


def state_from_record(
    request_id: str, meta: Mapping[str, str], tokens: bytes | None, prompt: bytes | None, owner: str
) -> RequestState:
    """The RequestState of a stored record (owner: "" when unclaimed or the lease expired); Internal
    (record_corrupt) naming the field when a value is missing or malformed: one record a bug or an
    operator wrote must not pass for a store failure, nor crash its reader with a KeyError."""

    def read(field: str, parse: Callable[[str], T]) -> T:
        if field not in meta:
            raise record_corrupt(request_id, field, "is missing")
        try:
            return parse(meta[field])
        except ValueError as e:  # json.JSONDecodeError and an unknown status are ValueErrors too
            raise record_corrupt(request_id, field, f"holds {meta[field][:80]!r}: {e}") from None

    def packed(field: str, data: bytes | None) -> tuple[int, ...]:
        try:
            return decode_token_ids(data)
        except ValueError as e:
            raise record_corrupt(request_id, field, str(e)) from None

    return RequestState(
        request_id=request_id,
        params=read("params", _json_object),
        status=read("status", RequestStatus),
        prompt_token_ids=packed("prompt", prompt),
        token_ids=packed("tokens", tokens),
        stats=read("stats", _json_object),
        controller_state=read("controller", _json_object),
        finish_reason=read("finish_reason", str),
        error=read("error", str),
        owner=owner,
        created_ms=read("created_ms", int),
        updated_ms=read("updated_ms", int),
        kv_lease=meta.get("kv_lease", ""),
        node=meta.get("node", ""),
    )


def _json_object(text: str) -> dict[str, Any]:
    """A stored JSON object (params, stats, controller); ValueError for any other JSON."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object but {type(value).__name__}")
    return value


def is_replay(tokens: bytes | bytearray, packed: bytes, expected_num_tokens: int | None) -> bool:
    """Whether a step write repeats one already applied: the log ends with exactly its tokens at
    its position (expected_num_tokens), so its first attempt landed and the reply was lost. The
    store answers it with the count and writes nothing. E.g. log [a b c d], expected 2, tokens
    [c d] -> a replay; tokens [c e] or expected 1 -> not one. (The Redis step script makes the
    same check on the server.)"""
    if expected_num_tokens is None or not packed:
        return False
    start = expected_num_tokens * TOKEN_BYTES
    return len(tokens) == start + len(packed) and tokens[start:] == packed
