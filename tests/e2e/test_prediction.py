"""Predicted Outputs end to end, through real processes (one stack with the HTTP front): greedy output
with a prediction, right or wrong, is the primary's own without one, token for token; the prediction
decoder's accepted drafts are reported (gRPC stats, OpenAI usage); a bad prediction is refused naming
the field (INVALID_ARGUMENT, HTTP 400).

    .venv/bin/pytest -q tests/e2e/test_prediction.py
"""

from __future__ import annotations


import grpc
import openai
import pytest

from specdec.v1 import gateway_pb2

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
MAX_NEW_TOKENS = 64
SOURCE = """def average(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)
"""
EDIT = f"Rename the function average to mean. Reply with the whole file only.\n\n```python\n{SOURCE}```"
WRONG_PREDICTION = "The quick brown fox jumps over the lazy dog. " * 4
STACK_OPTIONS = {"is_serving_http": True}  # the module's stack (tests/e2e/conftest.py) serves HTTP too


def generate(gateway_stub, prediction: str | None = None, **speculation) -> gateway_pb2.GenerateResponse:
    req = gateway_pb2.GenerateRequest(
        max_new_tokens=MAX_NEW_TOKENS, speculation=gateway_pb2.SpeculationConfig(**speculation)
    )
    req.chat.messages.add(role="user", content=EDIT)
    if prediction is not None:
        req.prediction.content = prediction
    return gateway_stub.Generate(req, timeout=600)


@pytest.fixture(scope="module")
def baseline(gateway_stub) -> gateway_pb2.GenerateResponse:
    out = generate(gateway_stub, is_enabled=False)
    assert len(out.token_ids) > 0 and out.stats.num_proposed_tokens == 0
    return out


def test_greedy_output_with_a_prediction_right_or_wrong_is_the_primarys(gateway_stub, baseline):
    for prediction in (SOURCE, SOURCE.replace("average", "mean"), WRONG_PREDICTION, baseline.text):
        for speculation in ({}, {"is_adaptive": False}):
            out = generate(gateway_stub, prediction, **speculation)
            assert list(out.token_ids) == list(baseline.token_ids), (prediction, speculation, out.text)
            assert out.text == baseline.text
            assert out.stats.num_accepted_prediction_tokens <= out.stats.num_accepted_tokens


def test_a_right_prediction_is_accepted_and_reported(gateway_stub, baseline):
    """The baseline's own text as the prediction: nearly every token comes from it, in few steps."""
    out = generate(gateway_stub, baseline.text)
    assert list(out.token_ids) == list(baseline.token_ids)
    accepted = out.stats.num_accepted_prediction_tokens
    assert accepted >= len(out.token_ids) // 2, (accepted, len(out.token_ids))
    assert out.stats.num_steps < baseline.stats.num_steps // 2
    by_decoder = {d.name: d.num_accepted for d in out.stats.decoders}
    assert by_decoder.get("prediction", 0) == accepted
    # the output is the prediction: the alignment used all of its tokens but those of a cut-off tail
    assert out.stats.num_rejected_prediction_tokens <= 2


def test_a_wrong_prediction_is_rejected_and_reported(gateway_stub, baseline):
    out = generate(gateway_stub, WRONG_PREDICTION)
    assert list(out.token_ids) == list(baseline.token_ids)
    assert out.stats.num_accepted_prediction_tokens == 0
    assert out.stats.num_rejected_prediction_tokens > 0


@pytest.mark.parametrize(
    ("prediction", "speculation", "field"),
    [
        ("", {}, "prediction.content"),
        ("x" * ((1 << 16) + 1), {}, "prediction.content"),
        (None, {"strategies": ["prediction"]}, "speculation.strategies"),
    ],
)
def test_a_bad_prediction_is_invalid_argument_naming_the_field(gateway_stub, prediction, speculation, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(gateway_stub, prediction, **speculation)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_openai_predicted_outputs_give_the_same_text_and_report_accepted_tokens(client, baseline):
    def chat(**extra):
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": EDIT}],
            max_tokens=MAX_NEW_TOKENS,
            temperature=0,
            **extra,
        )

    plain = chat()
    predicted = chat(prediction={"type": "content", "content": [{"type": "text", "text": baseline.text}]})
    assert predicted.choices[0].message.content == plain.choices[0].message.content == baseline.text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= predicted.usage.completion_tokens // 2
    assert details.rejected_prediction_tokens <= 2
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0


@pytest.mark.parametrize(
    ("prediction", "param"),
    [
        ({"type": "text", "content": "x"}, "prediction.type"),
        ({"type": "content", "content": 5}, "prediction.content"),
        ({"type": "content", "content": ""}, "prediction.content"),
    ],
)
def test_openai_bad_predictions_are_a_400_naming_the_parameter(client, prediction, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, prediction=prediction
        )
    body = e.value.body
    assert e.value.status_code == 400 and isinstance(body, dict) and body["param"] == param
