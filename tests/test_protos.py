"""The contracts: stubs are generated and import, buf lint passes, and the
conventions the services rely on hold (every RPC, message and field commented
is enforced by buf's COMMENTS rules)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _buf() -> str | None:
    """buf from the venv (buf-bin) first, then PATH."""
    candidate = Path(sys.executable).parent / "buf"
    return str(candidate) if candidate.exists() else shutil.which("buf")


def test_stubs_import_with_services_and_messages() -> None:
    from specdec.v1 import (
        common_pb2,
        draft_pb2,
        draft_pb2_grpc,
        gateway_pb2,
        gateway_pb2_grpc,
        primary_pb2,
        primary_pb2_grpc,
        validator_pb2,
        validator_pb2_grpc,
    )

    assert primary_pb2.DESCRIPTOR.package == "specdec.v1"
    services = {
        name for m in (primary_pb2, draft_pb2, validator_pb2, gateway_pb2) for name in m.DESCRIPTOR.services_by_name
    }
    assert services == {"PrimaryService", "DraftService", "ValidatorService", "GenerationService"}
    for grpc_module, service in (
        (primary_pb2_grpc, "PrimaryService"),
        (draft_pb2_grpc, "DraftService"),
        (validator_pb2_grpc, "ValidatorService"),
        (gateway_pb2_grpc, "GenerationService"),
    ):
        assert hasattr(grpc_module, f"{service}Stub")
        assert hasattr(grpc_module, f"add_{service}Servicer_to_server")
    tree = common_pb2.TokenTree(token_ids=[5, 6], parents=[-1, 0])
    assert common_pb2.TokenTree.FromString(tree.SerializeToString()) == tree


def test_generate_request_round_trips_through_json() -> None:
    """The gateway stores params as json_format JSON; the oneof and optionals survive."""
    from google.protobuf import json_format

    from specdec.v1 import common_pb2, gateway_pb2

    request = gateway_pb2.GenerateRequest(
        request_id="r1",
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")]),
        max_new_tokens=16,
        sampling=common_pb2.SamplingParams(temperature=0.7, seed=0),
        speculation=gateway_pb2.SpeculationConfig(is_enabled=False, draft_length=4),
        response_format=common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_JSON_OBJECT),
    )
    params = json_format.MessageToDict(request)
    again = json_format.ParseDict(params, gateway_pb2.GenerateRequest())
    assert again == request
    assert again.WhichOneof("input") == "chat"
    assert again.sampling.HasField("seed") and again.sampling.seed == 0  # seed 0 is not "unset"
    assert again.speculation.HasField("is_enabled") and not again.speculation.is_enabled
    assert not again.speculation.HasField("is_adaptive")


def test_logits_payload_is_one_of_inline_or_handle() -> None:
    from specdec.v1 import common_pb2

    logits = common_pb2.Logits(
        inline_logits=common_pb2.InlineLogits(
            format=common_pb2.LOGITS_FORMAT_FP32, num_rows=1, vocab_size=2, data=b"\0" * 8
        )
    )
    assert logits.WhichOneof("payload") == "inline_logits"
    logits.handle.memory.segment_name = "psm_1"
    assert logits.WhichOneof("payload") == "handle"


def test_buf_lint_passes() -> None:
    buf = _buf()
    if buf is None:
        pytest.skip("buf is not installed (requirements-dev.txt: buf-bin)")
    result = subprocess.run([buf, "lint"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


NODE_DIR = REPO_ROOT / "tests" / "node"


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    return node


def test_node_stream_client_parses() -> None:
    result = subprocess.run(
        [_node(), "--check", str(NODE_DIR / "stream_client.js")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_node_stream_client_against_a_fake_gateway() -> None:
    """The .proto files load in @grpc/proto-loader and the client's exit codes hold."""
    import grpc

    from specdec.service import create_server
    from specdec.v1 import gateway_pb2, gateway_pb2_grpc

    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.skip("tests/node dependencies are not installed (`make test` runs npm ci)")

    class FakeGateway(gateway_pb2_grpc.GenerationServiceServicer):
        def GenerateStream(self, request, context):  # noqa: N802, ANN001
            if request.max_new_tokens == 0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be > 0")
            yield gateway_pb2.GenerateStreamResponse(
                request_id=request.request_id or "gen-1", text=request.prompt, token_ids=[1, 2]
            )
            yield gateway_pb2.GenerateStreamResponse(
                request_id="gen-1",
                is_final=not request.prompt.startswith("no-final"),
                finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
                stats=gateway_pb2.GenerationStats(
                    num_generated_tokens=request.max_new_tokens, num_proposed_tokens=2**40
                ),
            )

    server, port = create_server(
        "127.0.0.1:0", [(gateway_pb2_grpc.add_GenerationServiceServicer_to_server, FakeGateway())]
    )
    server.start()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [_node(), str(NODE_DIR / "stream_client.js"), f"127.0.0.1:{port}", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        ok = run("Hello", "2", "my-id")
        failed = run("Hello", "0")
        no_final = run("no-final", "2")
        bad_args = run("Hello", "two")
    finally:
        server.stop(None)
    assert ok.returncode == 0, ok.stderr
    lines = [json.loads(line) for line in ok.stdout.splitlines()]
    assert [m["token_ids"] for m in lines] == [[1, 2], []]
    assert lines[0]["request_id"] == "my-id" and lines[0]["text"] == "Hello"
    assert lines[1]["is_final"] is True and lines[1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert lines[1]["stats"]["num_proposed_tokens"] == str(2**40)  # uint64 as a string: no precision loss
    assert failed.returncode == 1
    assert json.loads(failed.stderr) == {"error": "INVALID_ARGUMENT", "details": "max_new_tokens: must be > 0"}
    assert no_final.returncode == 1 and "NO_FINAL_MESSAGE" in no_final.stderr
    assert bad_args.returncode == 2
