"""Errors as OpenAI error objects, and the gateway's gRPC statuses as HTTP ones.

Every error answer is `{"error": {"message", "type", "param", "code"}}` with its HTTP status, the
shape the OpenAI SDKs turn into their typed exceptions (BadRequestError for 400, ...). Request
checks stay the gateway's: its INVALID_ARGUMENT names the protobuf field
("sampling.temperature: must be finite and >= 0, got -1.0"), and param_for() turns that field
into the OpenAI parameter the client sent ("temperature").
"""

from __future__ import annotations

import json
import math
import re

import grpc
from specdec.errors import RETRY_AFTER_KEY, shortened

# (HTTP status, OpenAI error type) of each gateway status; anything else is a 500.
_STATUS_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable_error"),  # the gateway stopped it (shutdown)
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# The `code` of an error object, where OpenAI has a well-known one.
_CODE_BY_STATUS = {
    401: "invalid_api_key",
    404: "not_found",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}
# Trailing metadata keys a gateway may give a retry hint in: seconds, or milliseconds (gRPC's own
# server pushback key among them).
RETRY_AFTER_KEYS = ("retry-after", "retry-after-s")
RETRY_AFTER_MS_KEYS = (RETRY_AFTER_KEY, "grpc-retry-pushback-ms")
# "field.path[3].name: message" -> field path, message (the gateway's InvalidArgument text).
_FIELD_MESSAGE = re.compile(r"^([a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*(?:\[\d+\])?)*): (.*)$", re.S)
# Gateway field -> OpenAI parameter; prefixes map with what follows them kept.
_PARAM_BY_FIELD = {
    "sampling.temperature": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
    "sampling.frequency_penalty": "frequency_penalty",
    "sampling.presence_penalty": "presence_penalty",
    "sampling.repetition_penalty": "repetition_penalty",
    "sampling.min_p": "min_p",
    "sampling.logit_bias": "logit_bias",
    "sampling.min_tokens": "min_tokens",
    "stop": "stop",
    "prompt": "prompt",
    "token_ids.ids": "prompt",
    "chat.messages": "messages",
    "response_format.type": "response_format.type",
    "response_format.json_schema": "response_format.json_schema.schema",
    "speculation.is_enabled": "speculative_decoding",
    "speculation.speculative_degree": "speculative_degree",
    "speculation.draft_length": "draft_length",
    "speculation.acceptance_threshold": "acceptance_threshold",
    "speculation.strategies": "strategies",
    "speculation.is_adaptive": "adaptive",
    "tools": "tools",
    "tool_choice.mode": "tool_choice",
    "tool_choice.function_name": "tool_choice.function.name",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
    "response_format": "response_format",
}
# A tool's and a call's fields sit under "function" in OpenAI's shape:
# "tools[0].name" -> "tools[0].function.name", "...tool_calls[1].arguments" -> "...tool_calls[1].function.arguments".
_FUNCTION_FIELD = re.compile(r"(tools\[\d+\]|tool_calls\[\d+\])\.(name|description|parameters|arguments)\b")


class ApiError(Exception):
    """An answer that is an error: HTTP status, OpenAI error object, extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(status, message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def to_json(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else _CODE_BY_STATUS.get(self.status),
            }
        }


def bad_request(param: str | None, message: str) -> ApiError:
    """400 naming the parameter: a body that is not the OpenAI shape (the gateway checks values)."""
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


def json_text(value: object, param: str) -> str:
    """json.dumps(value) of a body's value; a 400 naming `param` when the value nests deeper than the
    encoder can recurse: the parser allowed it from fewer frames down the stack, so a value nested
    about as deep as the parser's limit would otherwise fail here with a RecursionError (a 500)."""
    try:
        return json.dumps(value)
    except RecursionError:
        raise bad_request(param, "is nested too deeply") from None


def shown(value: object, param: str) -> str:
    """A body's value as an error message quotes it: its JSON text (json_text), shortened to its
    first characters, an ellipsis and its length when long (specdec.errors.shortened)."""
    return shortened(json_text(value, param))


def param_for(field: str, aliases: dict[str, str]) -> str:
    """The OpenAI parameter behind a gateway field, e.g. "chat.messages[2].role" -> "messages[2].role".
    `aliases` maps gateway fields whose parameter depends on the request ("max_new_tokens" ->
    "max_completion_tokens" when that is what the client sent)."""
    if field in aliases:
        return aliases[field]
    field = _FUNCTION_FIELD.sub(r"\1.function.\2", field)
    for prefix in sorted(_PARAM_BY_FIELD, key=len, reverse=True):
        if field == prefix or field.startswith((f"{prefix}.", f"{prefix}[")):
            return _PARAM_BY_FIELD[prefix] + field[len(prefix) :]
    return field


def from_rpc_error(error: grpc.RpcError, aliases: dict[str, str], default_retry_after_s: int) -> ApiError:
    """The HTTP answer to a failed gateway call."""
    # grpc.aio's AioRpcError has a Call's accessors without being a grpc.Call.
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or code.name
    status, error_type = _STATUS_BY_CODE.get(code, (500, "server_error"))
    param = None
    if status == 400 and (match := _FIELD_MESSAGE.match(details)):
        param = param_for(match.group(1), aliases)
        details = f"{param}: {match.group(2)}"
    headers: tuple[tuple[str, str], ...] = ()
    if status == 429:
        headers = (("retry-after", str(retry_after_s(error, default_retry_after_s))),)
    return ApiError(status, details, error_type, param, headers=headers)


def retry_after_s(error: grpc.RpcError, default_s: int) -> int:
    """Whole seconds to wait, from the call's trailing metadata (RETRY_AFTER_KEYS in seconds,
    RETRY_AFTER_MS_KEYS in milliseconds), rounded up; default_s when it carries none."""
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in metadata or ():
        text = value.decode() if isinstance(value, bytes) else str(value)
        try:
            seconds = float(text) / (1000 if key in RETRY_AFTER_MS_KEYS else 1)
        except ValueError:
            continue
        if key in RETRY_AFTER_KEYS + RETRY_AFTER_MS_KEYS and math.isfinite(seconds) and seconds >= 0:
            return math.ceil(seconds)
    return default_s
