"""Every service of a live stack: health, reflection, service identity on the internal ports, and a
Node.js client streaming from the gateway."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.service.auth import authenticated_channel
from specdec.v1 import draft_pb2, draft_pb2_grpc, primary_pb2, primary_pb2_grpc, validator_pb2, validator_pb2_grpc

pytestmark = pytest.mark.e2e

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
SERVICES = {
    "primary": "specdec.v1.PrimaryService",
    "draft": "specdec.v1.DraftService",
    "validator": "specdec.v1.ValidatorService",
    "gateway": "specdec.v1.GenerationService",
}


def test_each_service_is_healthy_and_reflects_its_api(stack):
    for name, service in SERVICES.items():
        with stack.channel(name) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for target in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=target), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (name, target)
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = list(
                stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            )
            listed = {s.name for s in replies[0].list_services_response.service}
            assert service in listed and "grpc.health.v1.Health" in listed, (name, listed)


def test_internal_services_refuse_callers_without_the_service_token(stack):
    """The attacks of an unauthenticated caller: a ghost Prefill that would hold KV forever, a Decode
    into someone's request, a Validate, an Attach. Each is refused before the servicer runs."""
    calls = {
        "primary": [
            lambda ch: primary_pb2_grpc.PrimaryServiceStub(ch).Prefill(
                primary_pb2.PrefillRequest(request_id="ghost", token_ids=[1, 2, 3]), timeout=30
            ),
            lambda ch: primary_pb2_grpc.PrimaryServiceStub(ch).Decode(
                primary_pb2.DecodeRequest(request_id="ghost"), timeout=30
            ),
        ],
        "draft": [lambda ch: draft_pb2_grpc.DraftServiceStub(ch).Attach(draft_pb2.AttachRequest(), timeout=30)],
        "validator": [
            lambda ch: validator_pb2_grpc.ValidatorServiceStub(ch).Validate(
                validator_pb2.ValidateRequest(request_id="ghost"), timeout=30
            )
        ],
    }
    for name, attempts in calls.items():
        for token in (None, "f" * 64):  # no credentials, a wrong token
            with authenticated_channel(grpc.insecure_channel(stack.addresses[name]), token) as ch:
                for call in attempts:
                    with pytest.raises(grpc.RpcError) as e:
                        call(ch)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, token, e.value)
    with stack.channel("primary") as ch:
        stats = primary_pb2_grpc.PrimaryServiceStub(ch).GetStats(primary_pb2.GetStatsRequest(), timeout=30)
    assert stats.num_active_requests == 0 and stats.kv_bytes == 0, "the ghost Prefill held no KV"


def test_node_client_streams_a_generation(stack):
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.skip("node or tests/node dependencies missing (`make test` installs them)")
    out = subprocess.run(
        [
            node,
            str(NODE_DIR / "stream_client.js"),
            stack.gateway_address,
            "The capital of France is",
            "12",
            "node-client-request",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    messages = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert messages[-1]["is_final"] is True and messages[-1]["request_id"] == "node-client-request"
    generated = [t for m in messages for t in m.get("token_ids", [])]
    assert 0 < len(generated) <= 12
    assert int(messages[-1]["stats"]["num_generated_tokens"]) == len(generated)


def test_a_gateway_whose_port_is_taken_exits_with_one_line_naming_it(stack, tmp_path):
    """Started on the running gateway's own port: a one-line error naming the address, exit code 1,
    no traceback (as the internal services do)."""
    argv = list(stack._get("gateway").argv)
    argv[argv.index("--metrics_port") + 1] = "0"
    address = stack.gateway_address
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=stack._env())
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: could not bind the gRPC server to {address} (in use, or not an address of this host)"
    )
    assert "Traceback" not in done.stderr
