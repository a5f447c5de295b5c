"""End to end at the int8_token precision (int8 rows, activations per token, csrc/qgemm.h QW_Q8T):
the primary serves it, the draft pool runs the same per-token products over the mapped weights, and
greedy output with speculation on, trees of up to 64 rows (tiles where the CPU has AMX) included,
equals plain decoding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.prompts import load_prompts
from specdec.launcher import GATEWAY, PRIMARY, Stack, StackConfig
from specdec.model import native
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, primary_pb2, primary_pb2_grpc

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(native.library() is None, reason=f"int8_token needs the native kernels: {native.status()}"),
]

DATA_DIR = Path(__file__).resolve().parents[2] / "bench" / "data"
SETTINGS = [(False, 1, 1), (True, 1, 8), (True, 4, 16)]  # (is_enabled, speculative_degree, draft_length)


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = StackConfig(
        precision="int8_token", redis_url=redis_server.url, log_dir=tmp_path_factory.mktemp("stack-int8-token")
    )
    with Stack(config) as started:
        yield started


def generate(stub, messages, is_enabled: bool, degree: int, draft_length: int) -> gateway_pb2.GenerateResponse:
    spec = gateway_pb2.SpeculationConfig(
        is_enabled=is_enabled, speculative_degree=degree, draft_length=draft_length, is_adaptive=False
    )
    request = gateway_pb2.GenerateRequest(max_new_tokens=32, speculation=spec)
    request.chat.messages.extend(gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    return stub.Generate(request, timeout=300)


def test_greedy_output_at_int8_token_is_identical_with_and_without_speculation(stack):
    with stack.channel(PRIMARY) as channel:
        info = primary_pb2_grpc.PrimaryServiceStub(channel).GetModelInfo(primary_pb2.GetModelInfoRequest(), timeout=10)
    assert info.precision == "int8_token"
    with stack.channel(GATEWAY) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        for prompt in load_prompts(DATA_DIR, ["code", "json"], 1, max_chars=600):
            messages = [(m["role"], m["content"]) for m in prompt.messages()]
            outputs = {s: generate(stub, messages, *s) for s in SETTINGS}
            baseline = outputs[SETTINGS[0]]
            assert len(baseline.token_ids) > 0
            for setting, out in outputs.items():
                assert list(out.token_ids) == list(baseline.token_ids), (prompt.id, setting, out.text, baseline.text)
