from __future__ import annotations

import math

import pytest
import torch

from specdec.errors import InvalidArgument
from specdec.pb import check_sampling_token_ids, sampling_from_pb, sampling_to_pb
from specdec.sampling import SamplingParams, logits_to_probs, make_generator, sample
from specdec.v1 import common_pb2

LOG_1234 = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))  # softmax at temperature 1 = [.1, .2, .3, .4]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": True}, "seed"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (2, 1.0))}, "logit_bias"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"min_tokens_ids": (3, 2)}, "min_tokens_ids"),
        ({"min_tokens_ids": (-1,)}, "min_tokens_ids"),
        ({"min_tokens_ids": tuple(range(129))}, "min_tokens_ids"),
    ],
)
def test_params_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_defaults_are_greedy_and_off():
    params = SamplingParams()
    assert params.is_greedy and params.top_k == 0 and params.top_p == 1.0 and params.seed is None
    assert not SamplingParams(temperature=0.7).is_greedy


def test_greedy_is_one_hot_of_the_lowest_index_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # ties at 1,2 and everywhere
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_temperature_scales_logits():
    # At T=0.5 the probabilities are squared and renormalised: [1, 4, 9, 16] / 30.
    probs = logits_to_probs(LOG_1234, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 4.0, 9.0, 16.0]]) / 30.0)


def test_a_tiny_temperature_is_near_greedy_not_nan():
    # 10 / 1e-38 overflows float32: unshifted, softmax([inf, inf, ...]) is NaN and every draw failed.
    logits = torch.tensor([[10.0, 5.0, -1.0, 10.0], [-math.inf, 2.0, 1.0, -3.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1e-38, top_p=0.9, min_p=0.5))
    assert probs.tolist() == [[0.5, 0.0, 0.0, 0.5], [0.0, 1.0, 0.0, 0.0]]  # the limit T -> 0: the tied maxima
    assert sample(probs, make_generator(3, 0)).tolist()[1] == 1


def test_top_k_keeps_k_largest_and_breaks_ties_by_lowest_id():
    probs = logits_to_probs(LOG_1234, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]))
    # Three logits tie for the 2 slots: ids 0 and 2 win, id 3 is dropped.
    tied = logits_to_probs(torch.tensor([[2.0, 1.0, 2.0, 2.0]]), SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(tied, torch.tensor([[0.5, 0.0, 0.5, 0.0]]))


def test_top_p_keeps_the_smallest_nucleus():
    # Sorted [.4, .3, .2, .1]; mass before each [0, .4, .7, .9]: top_p .5 keeps {.4, .3}, .35 keeps {.4}.
    half = logits_to_probs(LOG_1234, SamplingParams(temperature=1.0, top_p=0.5))
    torch.testing.assert_close(half, torch.tensor([[0.0, 0.0, 3 / 7, 4 / 7]]))
    small = logits_to_probs(LOG_1234, SamplingParams(temperature=1.0, top_p=0.35))
    torch.testing.assert_close(small, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))


def test_top_k_applies_before_top_p():
    # top_k 2 -> [3/7, 4/7]; mass before 3/7 is 4/7 > .55, so only id 3 stays. (top_p on the full
    # vocabulary first would have kept ids 2 and 3.)
    probs = logits_to_probs(LOG_1234, SamplingParams(temperature=1.0, top_k=2, top_p=0.55))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))


def test_masked_logits_get_zero_probability():
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]])
    torch.testing.assert_close(
        logits_to_probs(logits, SamplingParams(temperature=2.0)), torch.tensor([[0.5, 0.0, 0.5, 0.0]])
    )


def test_sample_is_deterministic_per_seed_and_position():
    probs = torch.full((64, 6), 1 / 6)
    first = sample(probs, make_generator(7, 3))
    assert torch.equal(first, sample(probs, make_generator(7, 3)))
    assert not torch.equal(first, sample(probs, make_generator(7, 4)))
    assert not torch.equal(first, sample(probs, make_generator(8, 3)))
    assert sample(probs, make_generator(None, 0)).shape == (64,)


def test_make_generator_rejects_negative_position():
    with pytest.raises(ValueError, match="position"):
        make_generator(1, -1)


def test_sample_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(2000, 1)
    token_ids = sample(probs, make_generator(0, 0))
    assert set(token_ids.tolist()) == {1, 3}
    assert sample(torch.tensor([[0.0, 0.0, 1.0]]), make_generator(0, 0)).tolist() == [2]


def test_sample_matches_the_distribution():
    # 20k draws of [.1, .2, .3, .4]: chi-square with 3 dof; 21.1 is the 1e-4 upper quantile, so a
    # correct sampler fails with probability 1e-4 for a random seed (this seed is fixed).
    num_draws = 20_000
    expected = torch.tensor([0.1, 0.2, 0.3, 0.4])
    token_ids = sample(expected.repeat(num_draws, 1), make_generator(123, 0))
    observed = torch.bincount(token_ids, minlength=4).double()
    chi2 = float((((observed - num_draws * expected) ** 2) / (num_draws * expected)).sum())
    assert chi2 < 21.1, chi2


def full_sort_top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, by a stable full sort (the implementation uses a growing top-k prefix)."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < top_p
    keep_sorted[:, 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)


@pytest.mark.parametrize("scale, is_rounded", [(0.05, False), (3.0, False), (2.0, True), (0.0, False)])
def test_top_p_equals_the_full_sort_definition(scale, is_rounded):
    # Flat rows (scale 0.05, 0.0) need nuclei of thousands of tokens: the prefix must grow past 256.
    # Rounded logits create many ties at the nucleus boundary.
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(1)) * scale
    logits = torch.round(logits) if is_rounded else logits
    for top_p in (0.3, 0.9, 0.999):
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert torch.equal(probs > 0, full_sort_top_p_keep(torch.softmax(logits, dim=-1), top_p))


def test_bad_sampling_on_the_wire_names_the_field_once():
    with pytest.raises(InvalidArgument) as e:
        sampling_from_pb(common_pb2.SamplingParams(temperature=-1))
    assert str(e.value) == "sampling.temperature: must be finite and >= 0, got -1.0"


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    # probs [.1, .2, .3, .4]; min_p 0.5 -> keep p >= 0.2 -> [0, .2, .3, .4] / .9
    probs = logits_to_probs(LOG_1234, SamplingParams(temperature=1.0, min_p=0.5))
    assert torch.allclose(probs, torch.tensor([[0.0, 2 / 9, 3 / 9, 4 / 9]]))


def test_min_p_applies_after_temperature_and_top_p():
    # temperature 0.5 squares the ratios: [1, 4, 9, 16] / 30; min_p 0.25 keeps >= 4/30 -> ids 1..3
    probs = logits_to_probs(LOG_1234, SamplingParams(temperature=0.5, min_p=0.25))
    assert torch.allclose(probs, torch.tensor([[0.0, 4 / 29, 9 / 29, 16 / 29]]))
    # top_p 0.65 keeps {.4, .3}; min_p 0.8 of .4 / .7 keeps only id 3
    probs = logits_to_probs(LOG_1234, SamplingParams(temperature=1.0, top_p=0.65, min_p=0.8))
    assert torch.equal(probs, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))


def test_min_p_one_keeps_the_most_likely_and_greedy_ignores_it():
    probs = logits_to_probs(LOG_1234, SamplingParams(temperature=1.0, min_p=1.0))
    assert torch.equal(probs, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))
    assert torch.equal(logits_to_probs(LOG_1234, SamplingParams(min_p=0.9)), torch.tensor([[0.0, 0.0, 0.0, 1.0]]))


def test_penalties_on_the_wire_round_trip_and_name_the_field():
    params = SamplingParams(
        temperature=0.5,
        frequency_penalty=0.5,
        presence_penalty=-1.0,
        repetition_penalty=1.25,
        min_p=0.125,
        logit_bias=((2, -100.0), (7, 3.5)),
        min_tokens=9,
        min_tokens_ids=(0, 4),
    )
    assert sampling_from_pb(sampling_to_pb(params)) == params
    assert sampling_from_pb(common_pb2.SamplingParams()).repetition_penalty == 1.0  # unset: off
    with pytest.raises(InvalidArgument, match="sampling.logit_bias"):
        sampling_from_pb(common_pb2.SamplingParams(logit_bias={-1: 1.0}))
    with pytest.raises(InvalidArgument, match="sampling.logit_bias"):
        sampling_from_pb(common_pb2.SamplingParams(logit_bias={5: 200.0}))
    with pytest.raises(InvalidArgument, match="sampling.repetition_penalty"):
        sampling_from_pb(common_pb2.SamplingParams(repetition_penalty=0.0))
    with pytest.raises(InvalidArgument, match="sampling.logit_bias: token id 10 is not below the vocab_size 10"):
        check_sampling_token_ids(SamplingParams(logit_bias=((10, 1.0),)), 10)
    with pytest.raises(InvalidArgument, match="sampling.min_tokens_ids: token id 10 is not below"):
        check_sampling_token_ids(SamplingParams(min_tokens=1, min_tokens_ids=(3, 10)), 10)
    with pytest.raises(InvalidArgument, match="sampling.min_tokens_ids"):
        sampling_from_pb(common_pb2.SamplingParams(min_tokens=2, min_tokens_ids=[-4]))


def test_min_tokens_holds_back_the_requests_end_tokens_until_reached():
    params = SamplingParams(min_tokens=3)
    assert not params.has_penalties  # no ids yet: the gateway fills in the request's end tokens
    ahead = params.holding_back({7, 2}, 2)
    assert ahead.min_tokens_ids == (2, 7) and ahead.has_penalties
    assert params.holding_back({7, 2}, 3) == SamplingParams()  # reached: as a request without it
    named = SamplingParams(min_tokens=3, min_tokens_ids=(5,))
    assert named.holding_back({7}, 0) is named


def test_has_penalties_is_false_for_min_p_and_the_defaults():
    assert not SamplingParams(temperature=1.0, min_p=0.5, top_k=3).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(logit_bias=((0, 0.0),)).has_penalties
