"""GenerateRequest.prediction -> GenerationParams: the prediction decoder drafts first and long, and
bad predictions are refused naming the field."""

from __future__ import annotations

import pytest

from gateway.config import Limits, SpeculationDefaults
from gateway.params import params_from_pb
from specdec.errors import InvalidArgument
from specdec.v1 import gateway_pb2

OFFERED = frozenset({"prompt_lookup", "suffix_index", "prediction"})


def params(offered=OFFERED, limits=Limits(), **fields):
    req = gateway_pb2.GenerateRequest(prompt="rename x to y", **fields)
    return params_from_pb(req, limits, SpeculationDefaults(), offered)


def test_a_prediction_turns_its_decoder_on_first_and_drafts_up_to_the_limit():
    p = params(prediction=gateway_pb2.Prediction(content="def y():\n    return 1\n"))
    assert p.prediction == "def y():\n    return 1\n"
    assert p.speculation.strategies == ("prediction", "prompt_lookup", "suffix_index")
    assert p.speculation.draft_length == Limits().max_draft_length
    assert p.speculation.is_adaptive  # the controller weighs it beside the others


def test_a_prediction_joins_the_strategies_a_request_names_and_its_own_draft_length_stays():
    spec = gateway_pb2.SpeculationConfig(strategies=["suffix_index"], draft_length=6, is_adaptive=False)
    p = params(prediction=gateway_pb2.Prediction(content="x = 1"), speculation=spec)
    assert p.speculation.strategies == ("prediction", "suffix_index")
    assert p.speculation.draft_length == 6


def test_without_a_prediction_nothing_changes():
    p = params()
    assert p.prediction is None
    assert p.speculation.strategies == ("prompt_lookup", "suffix_index")
    assert p.speculation.draft_length == SpeculationDefaults().max_adaptive_draft_length


def test_a_pool_that_does_not_offer_the_decoder_leaves_the_request_as_it_was():
    p = params(offered=frozenset({"prompt_lookup"}), prediction=gateway_pb2.Prediction(content="x = 1"))
    assert "prediction" not in p.speculation.strategies


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"prediction": gateway_pb2.Prediction(content="")}, "prediction.content", "must not be empty"),
        ({"prediction": gateway_pb2.Prediction(content="x" * 11)}, "prediction.content", "longer than 10"),
        (
            {"speculation": gateway_pb2.SpeculationConfig(strategies=["prediction"])},
            "speculation.strategies",
            "need a prediction",
        ),
    ],
)
def test_bad_predictions_are_refused_naming_the_field(fields, field, words):
    with pytest.raises(InvalidArgument, match=words) as e:
        params(limits=Limits(max_prediction_chars=10), **fields)
    assert e.value.field == field
