"""Validate's bonus_logprob: the drawn token's log probability under its row's raw distribution."""

from __future__ import annotations

import math

import pytest
import torch

from specdec import pb
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, validator_pb2
from validator_svc.server import ValidatorServicer


def test_the_bonus_token_is_scored_on_its_raw_row_whatever_the_temperature():
    # Rows: the root, node 0 (token 1). Row 1 puts p = 1/4 on token 0 and 3/4 on token 1 (raw).
    logits = torch.tensor([[0.0, 50.0], [0.0, math.log(3.0)]])
    request = validator_pb2.ValidateRequest(
        request_id="r",
        mode=validator_pb2.ACCEPTANCE_MODE_SAMPLE,
        sampling=pb.sampling_to_pb(SamplingParams(temperature=0.5, seed=3)),
        tree=common_pb2.TokenTree(token_ids=[1], parents=[-1]),
        target_logits=pb.logits_to_pb(logits, "fp32"),
        return_bonus_logprob=True,
    )
    answer = ValidatorServicer().Validate(request, None)
    assert list(answer.accepted_nodes) == [0]  # p(token 1 | root) ~ 1
    expected = {0: math.log(0.25), 1: math.log(0.75)}[answer.bonus_token]
    assert answer.bonus_logprob == pytest.approx(expected, abs=1e-6)
    request.return_bonus_logprob = False
    assert ValidatorServicer().Validate(request, None).bonus_logprob == 0.0  # not asked: not computed
