"""The gateway's gRPC statuses as OpenAI error objects with their HTTP status."""

from __future__ import annotations

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from http_svc.errors import ApiError, from_rpc_error, param_for


def rpc_error(code: grpc.StatusCode, details: str, trailing: tuple = ()) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(*trailing), details=details)


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("sampling.temperature", "temperature"),
        ("sampling.top_p", "top_p"),
        ("sampling.seed", "seed"),
        ("chat.messages", "messages"),
        ("chat.messages[3].role", "messages[3].role"),
        ("chat.messages[0].content", "messages[0].content"),
        ("prompt", "prompt"),
        ("stop", "stop"),
        ("response_format.json_schema", "response_format.json_schema.schema"),
        ("speculation.speculative_degree", "speculative_degree"),
        ("speculation.strategies", "strategies"),
        ("speculation.is_enabled", "speculative_decoding"),
        ("max_new_tokens", "max_tokens"),
        ("something_new", "something_new"),
    ],
)
def test_gateway_fields_map_to_openai_parameters(field: str, param: str) -> None:
    assert param_for(field, {"max_new_tokens": "max_tokens"}) == param


def test_invalid_argument_is_a_400_naming_the_parameter() -> None:
    error = from_rpc_error(
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be in [1, 8192], got 0"),
        {"max_new_tokens": "max_completion_tokens"},
        1,
    )
    assert error.status == 400 and error.param == "max_completion_tokens"
    assert error.to_json() == {
        "error": {
            "message": "max_completion_tokens: must be in [1, 8192], got 0",
            "type": "invalid_request_error",
            "param": "max_completion_tokens",
            "code": None,
        }
    }


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_statuses(code: grpc.StatusCode, status: int) -> None:
    error = from_rpc_error(rpc_error(code, "request_id: something"), {}, 1)
    assert isinstance(error, ApiError) and error.status == status and error.param is None


@pytest.mark.parametrize(
    ("trailing", "seconds"),
    [
        ((), 7),
        ((("retry-after", "2"),), 2),
        ((("retry-after", "0.2"),), 1),
        ((("retry-after-ms", "2500"),), 3),
        ((("grpc-retry-pushback-ms", "900"),), 1),
        ((("retry-after", "soon"),), 7),
        ((("other", "1"),), 7),
    ],
)
def test_a_429_says_when_to_retry(trailing: tuple, seconds: int) -> None:
    error = from_rpc_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue: full", trailing), {}, 7)
    assert error.status == 429 and dict(error.headers) == {"retry-after": str(seconds)}
    assert error.to_json()["error"]["code"] == "rate_limit_exceeded"
