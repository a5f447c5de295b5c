"""Sampling controls and fields without effect through the HTTP front (in process, fake gateway that
checks with the gateway's own params_from_pb): ranges are 400s naming the OpenAI parameter, and the
fields that change nothing are accepted and named in a response header, streamed or not."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from structlog.testing import capture_logs

from http_svc.openai_request import IGNORED_FIELDS_HEADER

MODEL = "test-model"
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


def chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def completion(**fields: object) -> dict:
    return {"model": MODEL, "prompt": "Once", "max_tokens": 2, **fields}


@pytest.mark.parametrize("body, path", [(chat, CHAT_PATH), (completion, COMPLETION_PATH)])
def test_every_control_in_range_is_accepted(client: TestClient, body, path) -> None:
    controls = {
        "temperature": 2,
        "frequency_penalty": 2,
        "presence_penalty": -2,
        "repetition_penalty": 1.2,
        "min_p": 1,
        "logit_bias": {"0": -100, "5": 100},
    }
    response = client.post(path, json=body(**controls))
    assert response.status_code == 200, response.text
    assert IGNORED_FIELDS_HEADER not in response.headers


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),  # the gateway's check (SamplingParams)
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ],
)
def test_a_control_out_of_range_is_a_400_naming_it(client: TestClient, fields: dict, param: str) -> None:
    for path, body in ((CHAT_PATH, chat(**fields)), (COMPLETION_PATH, completion(**fields))):
        response = client.post(path, json=body)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize("is_stream", [False, True])
def test_fields_without_effect_are_named_in_a_header_and_logged(client: TestClient, is_stream: bool) -> None:
    body = chat(foo_bar=1, reasoning_effort="low", user="u1", metadata={"k": "v"}, stream=is_stream)
    with capture_logs() as logs:
        response = client.post(CHAT_PATH, json=body)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == "reasoning_effort, user, metadata, foo_bar"
    warnings = [e for e in logs if e["event"] == "request fields ignored"]
    assert len(warnings) == 1 and warnings[0]["fields"] == "foo_bar" and warnings[0]["log_level"] == "warning"


def test_a_chat_only_field_in_a_completion_is_named(client: TestClient) -> None:
    response = client.post(COMPLETION_PATH, json=completion(messages=[], response_format=None))
    assert response.status_code == 200 and response.headers[IGNORED_FIELDS_HEADER] == "messages"
