"""Grammar masks in Validate: a path that leaves the grammar is never accepted, the bonus token is
always allowed, and an argmax taken without the mask is refused (the consistency check)."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.sampling import SamplingParams
from specdec.v1 import validator_pb2
from tests.validator_svc.requests import validate_request
from validator_svc.kernel import row_stats_cpu
from validator_svc.paths import CudaPath, TorchPath
from validator_svc.server import ValidatorServicer

V = 8


def _tree_case():
    # Tree: node 0 = token 3 (off the root). The primary's raw favourite everywhere is token 3, but the
    # grammar allows only tokens {1, 5} at the root (e.g. `"` or a digit) and anything after node 0.
    logits = torch.tensor(
        [[0.0, 2.0, 0.0, 9.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0]]
    )  # [2, V]
    allowed = torch.ones(2, V, dtype=torch.bool)
    allowed[0] = False
    allowed[0, [1, 5]] = True
    return logits, allowed


@pytest.mark.parametrize("fmt", ["fp32", "fp8_e4m3"])
def test_greedy_never_accepts_a_token_the_grammar_forbids(fmt):
    logits, allowed = _tree_case()
    unmasked = ValidatorServicer().Validate(validate_request(logits, [3], [-1], fmt=fmt), None)
    assert list(unmasked.accepted_nodes) == [0]  # without the grammar: accepted
    masked = ValidatorServicer().Validate(validate_request(logits, [3], [-1], allowed=allowed, fmt=fmt), None)
    assert list(masked.accepted_nodes) == [] and masked.bonus_token == 1  # best allowed token instead


def test_sampling_and_threshold_give_forbidden_tokens_probability_zero():
    logits, allowed = _tree_case()
    for seed in range(20):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        r = ValidatorServicer().Validate(
            validate_request(
                logits, [3], [-1], allowed=allowed, mode=validator_pb2.ACCEPTANCE_MODE_SAMPLE, sampling=sampling
            ),
            None,
        )
        assert list(r.accepted_nodes) == [] and r.bonus_token in (1, 5)
    req = validate_request(logits, [3], [-1], allowed=allowed, mode=validator_pb2.ACCEPTANCE_MODE_THRESHOLD)
    req.acceptance_threshold = 0.01
    r = ValidatorServicer().Validate(req, None)
    assert list(r.accepted_nodes) == [] and r.bonus_token == 1


def test_an_argmax_taken_without_the_mask_is_refused():
    logits, allowed = _tree_case()
    with pytest.raises(InvalidArgument) as e:
        ValidatorServicer().Validate(validate_request(logits, [3], [-1], allowed=allowed, argmax=[3, 3]), None)
    assert e.value.field == "target_argmax_token_ids"
    ok = ValidatorServicer().Validate(validate_request(logits, [3], [-1], allowed=allowed, argmax=[1, 3]), None)
    assert list(ok.accepted_nodes) == [] and ok.bonus_token == 1


def test_a_mask_of_the_wrong_height_is_refused():
    logits, allowed = _tree_case()
    with pytest.raises(InvalidArgument) as e:
        ValidatorServicer().Validate(validate_request(logits, [3], [-1], allowed=allowed[:1]), None)
    assert e.value.field == "allowed_tokens.num_rows"


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "mode, temperature",
    [
        (validator_pb2.ACCEPTANCE_MODE_GREEDY, 0.0),
        (validator_pb2.ACCEPTANCE_MODE_SAMPLE, 1.0),
        (validator_pb2.ACCEPTANCE_MODE_THRESHOLD, 0.0),
        (validator_pb2.ACCEPTANCE_MODE_THRESHOLD, 1.0),
    ],
)
@pytest.mark.parametrize("path", [TorchPath, lambda: CudaPath(row_stats=row_stats_cpu)])
def test_a_row_whose_allowed_tokens_are_all_minus_inf_is_refused_on_either_path(fmt, mode, temperature, path):
    # The root row has finite logits, but the grammar allows only token 1, whose logit is -inf: no
    # token is left to choose. The host rule sampled a NaN row (an assertion: INTERNAL) or answered a
    # forbidden-probability bonus with a NaN entropy; the kernel's statistics refuse it.
    logits = torch.tensor([[0.0, float("-inf"), 1.0], [0.0, 1.0, 2.0]])
    allowed = torch.tensor([[False, True, False], [True, True, True]])
    req = validate_request(
        logits, [1], [-1], fmt, mode=mode, sampling=SamplingParams(temperature=temperature, seed=1), allowed=allowed
    )
    if mode == validator_pb2.ACCEPTANCE_MODE_THRESHOLD:
        req.acceptance_threshold = 0.5
    with pytest.raises(InvalidArgument) as e:
        ValidatorServicer(path()).Validate(req, None)
    assert e.value.field == "target_logits" and "row 0" in str(e.value)
