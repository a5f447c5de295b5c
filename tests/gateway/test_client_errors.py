"""What a client is told when an internal service fails: never that service's name or details
(`primary: tree: ...` reached clients as INVALID_ARGUMENT), but INTERNAL or a retryable status
naming the request; its own fields' errors as they are."""

from __future__ import annotations

import grpc
import pytest

from gateway.backends import _domain_error, client_error
from specdec.errors import Internal, InvalidArgument, NotFound, ResourceExhausted, StateLost, Unavailable


class FakeRpcError(grpc.RpcError, grpc.Call):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> None:
        return None


@pytest.mark.parametrize(
    "code, details, told, status",
    [
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "tree: context 4089 + tree depth 16 exceeds max_context 4096",
            Internal,
            "INTERNAL",
        ),
        (grpc.StatusCode.INVALID_ARGUMENT, "strategies: 'early_exit' is not loaded", Internal, "INTERNAL"),
        (grpc.StatusCode.NOT_FOUND, "request_id: no active request 'x' on this primary", Internal, "INTERNAL"),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", Unavailable, "UNAVAILABLE"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "kv_cache: no free KV blocks", ResourceExhausted, "RESOURCE_EXHAUSTED"),
    ],
)
def test_an_internal_services_failure_names_the_request_not_the_service(code, details, told, status):
    for service in ("primary", "draft", "validator"):
        error = client_error(_domain_error(FakeRpcError(code, details), service), "order-1")
        assert type(error) is told and error.status_name == status
        assert error.field == "request_id" and "'order-1'" in error.message
        assert service not in str(error) and details not in str(error)


def test_the_clients_own_errors_pass_unchanged():
    mine = InvalidArgument("max_new_tokens", "must be in [1, 8192], got 0")
    assert client_error(mine, "order-1") is mine
    gone = NotFound("request_id", "no request 'x'")
    assert client_error(gone, "x") is gone


def test_a_state_store_outage_names_the_request_not_the_store():
    outage = Unavailable("state_store", "Redis unreachable: Timeout reading from socket", dependency="state_store")
    error = client_error(outage, "order-1")
    assert type(error) is Unavailable and error.field == "request_id" and "'order-1'" in error.message
    assert "state_store" not in str(error) and "Redis" not in str(error)


def test_a_lost_stored_state_is_named_to_the_client_without_the_stores_details():
    lost = StateLost(
        "state_store",
        "the stored state of request 't/order-1' was lost (the state store no longer holds it) and writing it "
        "back failed: OutOfMemoryError: command not allowed when used memory > 'maxmemory'.",
        dependency="state_store",
    )
    error = client_error(lost, "order-1")
    assert type(error) is Unavailable and error.status_name == "UNAVAILABLE" and error.field == "request_id"
    assert "stored state of request 'order-1' was lost" in error.message
    assert "maxmemory" not in str(error) and "t/order-1" not in str(error)
