"""ProposeArgs: the record a Propose carries, through its wire form and back."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specdec import pb
from specdec.errors import InvalidArgument
from specdec.features import encode_features
from specdec.grammar import ResponseFormat
from specdec.propose_args import ProposeArgs
from specdec.v1 import draft_pb2

OPENING = ProposeArgs(
    "r",
    prompt_token_ids=(5, 6, 7),
    strategies=("prompt_lookup", "suffix_index"),
    speculative_degree=2,
    draft_length=4,
    max_nodes=7,
    response_format=ResponseFormat("json_object"),
    continuation_length=16,
    prediction_token_ids=(8, 9),
)


def test_an_opening_call_comes_back_as_sent() -> None:
    assert ProposeArgs.from_pb(OPENING.to_pb()) == OPENING


def test_a_later_call_comes_back_as_sent() -> None:
    args = ProposeArgs("r", new_token_ids=(1, 2), strategies=("lookahead",), lookahead_argmax_token_ids=(3, 4))
    assert ProposeArgs.from_pb(args.to_pb()) == args


def test_unset_fields_keep_the_pools_defaults() -> None:
    """0 and () mean "the pool's default" (draft_length 0: default_draft_length): the wire keeps them."""
    request = ProposeArgs("r").to_pb()
    assert (request.draft_length, request.speculative_degree, request.max_nodes, list(request.strategies)) == (
        0,
        0,
        0,
        [],
    )
    assert ProposeArgs.from_pb(draft_pb2.ProposeRequest(request_id="r")) == ProposeArgs("r")


def test_the_response_format_is_read_with_the_prompt_only() -> None:
    """A later call's response format is not the request's: the grammar is fixed when it opens."""
    later = dataclasses.replace(OPENING, prompt_token_ids=(), new_token_ids=(1,))
    assert ProposeArgs.from_pb(later.to_pb()).response_format is None


def test_features_are_decoded_on_arrival() -> None:
    rows = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]  # exact in bf16
    sent = ProposeArgs("r", features=pb.features_to_pb(encode_features(torch.tensor(rows))), feature_position=9)
    received = ProposeArgs.from_pb(sent.to_pb())
    assert received.feature_position == 9
    np.testing.assert_array_equal(received.features, np.array(rows, dtype=np.float32))


def test_bad_features_are_refused_naming_the_field() -> None:
    request = ProposeArgs("r").to_pb()
    request.features.num_rows, request.features.hidden_size = 2, 3  # and no data
    with pytest.raises(InvalidArgument) as e:
        ProposeArgs.from_pb(request)
    assert e.value.field.startswith("features")
