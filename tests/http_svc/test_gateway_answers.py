"""What the HTTP front makes of gateway answers off the usual path: one larger than gRPC's default
4 MiB receive limit (the gateway sends up to its own 128 MiB), and a stream the gateway fails after
its first events."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from starlette.testclient import TestClient

from specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.grpc_serving import serving
from tests.http_svc.conftest import FakeGateway

MODEL = "test-model"
CHAT_PATH = "/v1/chat/completions"
LARGE_TEXT = "x" * (5 << 20)  # past gRPC's default 4 MiB receive limit


class _Gateway(FakeGateway):
    """Answers LARGE_TEXT; a stream sends one message, then fails UNAVAILABLE."""

    def Generate(self, request, context):  # noqa: ANN001, N802
        self._check(request, context)
        return gateway_pb2.GenerateResponse(
            request_id=request.request_id,
            text=LARGE_TEXT,
            token_ids=[1],
            finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
            stats=gateway_pb2.GenerationStats(num_prompt_tokens=1, num_generated_tokens=1),
        )

    def GenerateStream(self, request, context):  # noqa: ANN001, N802
        self._check(request, context)
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, text="o", token_ids=[1])
        context.abort(grpc.StatusCode.UNAVAILABLE, "request_id: the primary is gone")


@pytest.fixture
def fake_gateway() -> Iterator[tuple[FakeGateway, str]]:
    servicer = _Gateway()
    with serving(gateway_pb2_grpc.add_GenerationServiceServicer_to_server, servicer) as address:
        yield servicer, address


def _chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def test_an_answer_past_4_mib_is_served_not_a_429(client: TestClient) -> None:
    response = client.post(CHAT_PATH, json=_chat())
    assert response.status_code == 200, response.text[:500]
    assert response.json()["choices"][0]["message"]["content"] == LARGE_TEXT


def test_a_stream_that_fails_midway_ends_with_an_error_event_then_done(client: TestClient) -> None:
    response = client.post(CHAT_PATH, json=_chat(stream=True))
    assert response.status_code == 200, response.text
    payloads = [line[len("data: ") :] for line in response.text.split("\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "service_unavailable" and "the primary is gone" in error["message"]
    assert all("choices" in json.loads(p) for p in payloads[:-2])
