"""Several choices (`n`) through the HTTP front (in process, fake gateway): each choice is a request
of its own (ids `<response id>-<index>`, seed + index), the answer's choices are numbered
prompt-major, the usage counts a prompt once, and streamed choices interleave with their indices,
closing with one usage chunk and one [DONE]."""

from __future__ import annotations

import asyncio
import json

from starlette.testclient import TestClient

MODEL = "test-model"
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


def chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def events(text: str) -> list[dict | str]:
    """The SSE stream's data payloads: JSON objects, and "[DONE]"."""
    payloads = [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_n_choices_are_requests_of_their_own(client: TestClient, fake_gateway) -> None:  # noqa: ANN001
    gateway, _ = fake_gateway
    response = client.post(CHAT_PATH, json=chat(n=3, seed=5, temperature=0.8))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [(c["index"], c["message"]["content"]) for c in answer["choices"]] == [(0, "ok"), (1, "ok"), (2, "ok")]
    assert answer["usage"]["prompt_tokens"] == 1 and answer["usage"]["completion_tokens"] == 3
    sent = sorted(gateway.requests, key=lambda r: r.request_id)
    assert [r.request_id for r in sent] == [f"{answer['id']}-{j}" for j in range(3)]
    assert [r.sampling.seed for r in sent] == [5, 6, 7]


def test_n_choices_of_several_prompts_are_numbered_prompt_major(client: TestClient) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "echo": True, "max_tokens": 1}
    response = client.post(COMPLETION_PATH, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [(0, "aok"), (1, "aok"), (2, "bok"), (3, "bok")]
    assert answer["usage"]["prompt_tokens"] == 2 and answer["usage"]["completion_tokens"] == 4


def test_streamed_choices_interleave_and_close_once(client: TestClient, fake_gateway) -> None:  # noqa: ANN001
    gateway, _ = fake_gateway
    body = chat(n=2, stream=True, stream_options={"include_usage": True})
    response = client.post(CHAT_PATH, json=body)
    assert response.status_code == 200, response.text
    payloads = events(response.text)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    usage = payloads[-2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 1
    assert usage["usage"]["completion_tokens"] == 4
    chunks = payloads[:-2]
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "ok"
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
    # The fake gateway counts a stream's end on its server thread, which may run after the response.
    assert len(gateway.requests) == 2 and gateway.wait_ended(2, 10), f"{gateway.num_ended} of 2 streams ended"


def test_a_client_that_leaves_mid_stream_cancels_every_choice(fake_gateway, post_then_disconnect) -> None:  # noqa: ANN001
    gateway, _ = fake_gateway
    gateway.is_holding = True  # each stream's last message waits for a cancel
    body = json.dumps(chat(n=3, stream=True)).encode()
    sent = asyncio.run(post_then_disconnect(CHAT_PATH, body, after_body_chunks=1))
    assert sent[0]["status"] == 200
    assert gateway.wait_ended(3, 10), f"{gateway.num_ended} of 3 calls ended: every choice's call is cancelled"
