"""Service identity in process on port 0: the token interceptor refuses calls
without the right token (UNAUTHENTICATED, before the servicer runs), for unary
and streaming methods and for reflection; health stays open; the token file
is private and a service refuses to start without one unless told to."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import structlog.testing
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from specdec.metrics import RpcMetrics
from specdec.service import ErrorInterceptor, create_server
from specdec.service.auth import (
    ServiceTokenError,
    ServiceTokenInterceptor,
    authenticated_channel,
    internal_interceptors,
    load_service_token,
    new_service_token,
    read_service_token,
    service_token_or_exit,
    write_service_token,
)
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, validator_pb2, validator_pb2_grpc

TOKEN = new_service_token()


class CountingValidator(validator_pb2_grpc.ValidatorServiceServicer):
    def __init__(self) -> None:
        self.num_calls = 0

    def Validate(self, request, context):  # noqa: ANN001, ANN201, N802 - the RPC's name
        self.num_calls += 1
        return validator_pb2.ValidateResponse(bonus_token=7)


class StreamingGateway(gateway_pb2_grpc.GenerationServiceServicer):
    def GenerateStream(self, request, context):  # noqa: ANN001, ANN201, N802 - the RPC's name
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, is_final=True)


@pytest.fixture
def served() -> Iterator[tuple[str, CountingValidator]]:
    validator = CountingValidator()
    server, port = create_server(
        "127.0.0.1:0",
        [
            (validator_pb2_grpc.add_ValidatorServiceServicer_to_server, validator),
            (gateway_pb2_grpc.add_GenerationServiceServicer_to_server, StreamingGateway()),
        ],
        interceptors=[ServiceTokenInterceptor(TOKEN), ErrorInterceptor()],
    )
    server.start()
    yield f"127.0.0.1:{port}", validator
    server.stop(None)


@pytest.mark.parametrize("token", [None, "0" * 64, TOKEN[:-1], TOKEN + "0"], ids=["none", "wrong", "short", "long"])
def test_calls_without_the_right_token_are_unauthenticated(served, token: str | None) -> None:
    address, validator = served
    with authenticated_channel(grpc.insecure_channel(address), token) as channel:
        with pytest.raises(grpc.RpcError) as unary:
            validator_pb2_grpc.ValidatorServiceStub(channel).Validate(validator_pb2.ValidateRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as stream:
            list(
                gateway_pb2_grpc.GenerationServiceStub(channel).GenerateStream(
                    gateway_pb2.GenerateRequest(request_id="x"), timeout=10
                )
            )
        with pytest.raises(grpc.RpcError) as reflection:
            list(
                reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
                )
            )
    for e in (unary, stream, reflection):
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        assert TOKEN not in e.value.details()
    assert validator.num_calls == 0, "the servicer never ran"


def test_refused_calls_are_counted_in_the_rpc_metrics() -> None:
    """An internal service's refusals show in specdec_rpc_requests_total{code="UNAUTHENTICATED"}
    (a peer with a stale token), beside the calls it served."""
    registry = CollectorRegistry()
    server, port = create_server(
        "127.0.0.1:0",
        [(validator_pb2_grpc.add_ValidatorServiceServicer_to_server, CountingValidator())],
        interceptors=internal_interceptors(TOKEN, RpcMetrics(registry)),
    )
    server.start()
    try:
        for token in (None, "0" * 64, TOKEN):
            with authenticated_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), token) as channel:
                stub = validator_pb2_grpc.ValidatorServiceStub(channel)
                try:
                    stub.Validate(validator_pb2.ValidateRequest(), timeout=10)
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and token != TOKEN
    finally:
        server.stop(None)
    value = registry.get_sample_value
    method = "ValidatorService/Validate"
    assert value("specdec_rpc_requests_total", {"method": method, "code": "UNAUTHENTICATED"}) == 2
    assert value("specdec_rpc_requests_total", {"method": method, "code": "OK"}) == 1


def test_the_right_token_reaches_the_servicer_and_health_needs_none(served) -> None:
    address, validator = served
    with authenticated_channel(grpc.insecure_channel(address), TOKEN) as channel:
        reply = validator_pb2_grpc.ValidatorServiceStub(channel).Validate(validator_pb2.ValidateRequest(), timeout=10)
        assert reply.bonus_token == 7 and validator.num_calls == 1
        final = list(
            gateway_pb2_grpc.GenerationServiceStub(channel).GenerateStream(
                gateway_pb2.GenerateRequest(request_id="x"), timeout=10
            )
        )
        assert final[-1].is_final
    with grpc.insecure_channel(address) as channel:  # probes carry no secret
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_the_token_file_is_private_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "service_token"
    path.write_text("old")
    path.chmod(0o644)
    token = write_service_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_service_token(path) == token and len(token) == 64
    assert write_service_token(path) != token, "each call writes a fresh secret"


@pytest.mark.parametrize(
    "mode, is_warned", [(0o644, True), (0o604, True), (0o640, False), (0o400, False)], ids=["644", "604", "640", "400"]
)
def test_a_token_file_any_user_can_read_is_warned_about(tmp_path: Path, mode: int, is_warned: bool) -> None:
    path = tmp_path / "service_token"
    token = write_service_token(path)
    path.chmod(mode)
    with structlog.testing.capture_logs() as logs:
        assert service_token_or_exit(str(path), is_unauthenticated_allowed=False) == token
    warned = [e for e in logs if "readable by any user" in e["event"]]
    assert len(warned) == is_warned
    if is_warned:
        assert warned[0]["file"] == str(path) and warned[0]["mode"] == f"{mode:04o}"
        assert token not in str(warned[0])


def test_a_service_needs_a_token_unless_told_otherwise(tmp_path: Path) -> None:
    with pytest.raises(ServiceTokenError, match="--service_token_file"):
        load_service_token("", is_unauthenticated_allowed=False)
    assert load_service_token("", is_unauthenticated_allowed=True) is None
    with pytest.raises(ServiceTokenError, match="at least"):
        (tmp_path / "short").write_text("secret\n")
        load_service_token(str(tmp_path / "short"), is_unauthenticated_allowed=False)
    with pytest.raises(ServiceTokenError, match="No such file"):
        load_service_token(str(tmp_path / "missing"), is_unauthenticated_allowed=True)


def test_every_service_reads_the_token_flags_from_one_definition():
    import argparse

    from specdec.service.auth import add_service_token_arguments
    from specdec.service.flags import Flags

    env = {"SPECDEC_SERVICE_TOKEN_FILE": "/run/secrets/t", "SPECDEC_ALLOW_UNAUTHENTICATED": "yes"}
    flags = Flags(argparse.ArgumentParser(), "PRIMARY", env)
    add_service_token_arguments(flags)
    a = flags.parser.parse_args([])
    assert (a.service_token_file, a.allow_unauthenticated) == ("/run/secrets/t", True)
    with pytest.raises(ValueError, match="SPECDEC_ALLOW_UNAUTHENTICATED .*--allow_unauthenticated"):
        add_service_token_arguments(
            Flags(argparse.ArgumentParser(), "PRIMARY", {"SPECDEC_ALLOW_UNAUTHENTICATED": "maybe"})
        )
