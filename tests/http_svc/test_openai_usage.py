"""The usage of a request of several choices (or prompts): the counts added up, the speculation
figures recomputed over all of them."""

from __future__ import annotations

import pytest

from http_svc.openai_response import summed_stats
from specdec.v1 import gateway_pb2


def test_the_choices_mean_accepted_length_counts_each_ones_end_token():
    # plain decoding that ended at its end token (9 tokens in 10 steps, the end's step included), and
    # a speculative choice that ran to its length (12 tokens in 6 steps)
    ended = gateway_pb2.GenerationStats(
        num_prompt_tokens=5, num_generated_tokens=9, num_steps=10, mean_accepted_length=1.0
    )
    speculative = gateway_pb2.GenerationStats(
        num_prompt_tokens=5,
        num_generated_tokens=12,
        num_steps=6,
        num_proposed_tokens=10,
        num_accepted_tokens=6,
        mean_accepted_length=2.0,
    )
    total = summed_stats([ended, speculative], num_choices=2)
    assert (total.num_prompt_tokens, total.num_generated_tokens, total.num_steps) == (5, 21, 16)
    assert total.mean_accepted_length == pytest.approx((10 + 12) / 16)
    assert total.acceptance_rate == pytest.approx(0.6)
