"""OpenAI's `prediction` -> GenerateRequest.prediction, and the usage's prediction counts."""

from __future__ import annotations

import pytest

from http_svc.errors import ApiError
from http_svc.openai_request import CHAT, COMPLETION, parse_request
from http_svc.openai_response import usage
from specdec.v1 import gateway_pb2

MODEL = "m"


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Rename x to y"}], **fields}


def test_a_string_prediction_becomes_the_requests_prediction():
    parsed = parse_request(chat(prediction={"type": "content", "content": "y = 1\n"}), CHAT)
    assert parsed.request.HasField("prediction") and parsed.request.prediction.content == "y = 1\n"


def test_text_parts_are_joined_and_completions_take_it_too():
    parts = [{"type": "text", "text": "def f():\n"}, {"type": "text", "text": "    return 1\n"}]
    parsed = parse_request(
        {"model": MODEL, "prompt": "x", "prediction": {"type": "content", "content": parts}}, COMPLETION
    )
    assert parsed.request.prediction.content == "def f():\n    return 1\n"


def test_no_prediction_leaves_the_field_unset():
    assert not parse_request(chat(), CHAT).request.HasField("prediction")
    assert not parse_request(chat(prediction=None), CHAT).request.HasField("prediction")


@pytest.mark.parametrize(
    ("prediction", "param"),
    [
        ("y = 1", "prediction"),
        ({"content": "y = 1"}, "prediction.type"),
        ({"type": "text", "content": "y = 1"}, "prediction.type"),
        ({"type": "content"}, "prediction.content"),
        ({"type": "content", "content": 5}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url", "image_url": {}}]}, "prediction.content[0].type"),
        ({"type": "content", "content": [{"type": "text", "text": None}]}, "prediction.content[0].text"),
    ],
)
def test_a_prediction_not_of_openais_shape_is_a_400_naming_it(prediction, param):
    with pytest.raises(ApiError) as e:
        parse_request(chat(prediction=prediction), CHAT)
    assert e.value.status == 400 and e.value.param == param


def test_usage_reports_the_prediction_counts_as_openai_does():
    stats = gateway_pb2.GenerationStats(
        num_prompt_tokens=5,
        num_generated_tokens=40,
        num_accepted_prediction_tokens=31,
        num_rejected_prediction_tokens=4,
    )
    assert usage(stats)["completion_tokens_details"] == {
        "accepted_prediction_tokens": 31,
        "rejected_prediction_tokens": 4,
    }
    assert usage(gateway_pb2.GenerationStats())["completion_tokens_details"] == {
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }
