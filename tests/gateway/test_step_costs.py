"""The gateway's measured step costs (gateway.step_costs): the controller's overheads, as its steps ran."""

from __future__ import annotations

import pytest

from gateway.cost_model import CostSettings, cost_model_for
from gateway.step_costs import BUCKET, StepCostConfig, StepCosts

CURVE_MS = {1: 4.0, 2: 4.2, 4: 5.0, 8: 8.0, 16: 14.0}


def _base():
    return cost_model_for(CURVE_MS, CostSettings(plain_overhead_ms=1.0, speculative_overhead_ms=4.0, draft_costs=()))


def test_the_settings_stand_until_enough_steps_were_measured():
    costs, base = StepCosts(StepCostConfig(min_steps=3)), _base()
    for _ in range(2):
        costs.observe_plain(wall_ms=4.25, forward_ms=4.0, num_tokens=1, curve=base)  # 0.25 ms a token outside
        costs.observe_speculative(wall_ms=16.0, forward_ms=10.0, model_draft_ms=0.0, num_rows=8, curve=base)
    assert costs.overheads().plain_ms is None
    assert costs.cost_model(base, one_row_ms=4.0) == base
    costs.observe_plain(wall_ms=4.25, forward_ms=4.0, num_tokens=1, curve=base)
    measured = costs.overheads()
    assert measured.plain_ms == pytest.approx(0.25, rel=BUCKET - 1)
    assert measured.speculative_ms is None  # two samples of its kind so far


def test_runs_sent_several_steps_a_message_are_measured_apart_a_sample_a_token():
    """A request whose runs send several steps a message (a client that waits for the whole answer)
    pays the loop's work a message: its plain overhead is its own figure, not a streaming request's,
    and a message of n tokens counts as n samples (so a run's lone first step weighs as one token)."""
    costs, base = StepCosts(StepCostConfig(min_steps=8)), _base()
    costs.observe_plain(wall_ms=34.0, forward_ms=32.0, num_tokens=8, curve=base, is_batched=True)
    assert costs.overheads(is_batched=True).plain_ms == pytest.approx(0.25, rel=BUCKET - 1)  # 8 samples
    assert costs.overheads().plain_ms is None  # a streaming request's: none yet
    for _ in range(8):
        costs.observe_plain(wall_ms=5.5, forward_ms=4.0, num_tokens=1, curve=base)
    assert costs.overheads().plain_ms == pytest.approx(1.5, rel=BUCKET - 1)
    assert costs.overheads(is_batched=True).plain_ms == pytest.approx(0.25, rel=BUCKET - 1)
    # a run's first step comes alone (1.5 ms), then messages of 8 (0.25 ms a token): per token, the mean
    # leans to the many cheap tokens
    costs = StepCosts(StepCostConfig(min_steps=1, half_life_steps=1000.0))
    costs.observe_plain(wall_ms=5.5, forward_ms=4.0, num_tokens=1, curve=base, is_batched=True)
    costs.observe_plain(wall_ms=34.0, forward_ms=32.0, num_tokens=8, curve=base, is_batched=True)
    assert costs.overheads(is_batched=True).plain_ms == pytest.approx((1.5 + 8 * 0.25) / 9, rel=BUCKET - 1)


def test_steps_that_wait_for_the_validator_are_measured_apart():
    """A sampled request's speculative step waits for the validator's decision (here 8 ms more outside
    the forward than a greedy one's): each kind prices its own requests' plans; the 1-row forward
    they measure is one."""
    costs, base = StepCosts(StepCostConfig(min_steps=2)), _base()
    for _ in range(2):
        costs.observe_speculative(wall_ms=20.0, forward_ms=10.0, model_draft_ms=0.0, num_rows=8, curve=base)
    assert costs.overheads(waits_for_validator=True).speculative_ms is None  # none of its kind yet
    for _ in range(2):
        costs.observe_speculative(
            wall_ms=28.0, forward_ms=10.0, model_draft_ms=0.0, num_rows=8, curve=base, waits_for_validator=True
        )
    greedy, sampled = costs.overheads(), costs.overheads(waits_for_validator=True)
    assert greedy.speculative_ms == pytest.approx(10.0, rel=BUCKET - 1)
    assert sampled.speculative_ms == pytest.approx(18.0, rel=BUCKET - 1)
    assert greedy.one_row_ms == sampled.one_row_ms == pytest.approx(5.0, rel=BUCKET - 1)
    assert costs.cost_model(base, 4.0, sampled).speculative_overhead > costs.cost_model(base, 4.0).speculative_overhead


def test_overheads_are_what_the_steps_spent_outside_the_forward_in_one_row_forwards():
    costs, base = StepCosts(StepCostConfig(min_steps=1)), _base()
    # a plain run: 8 tokens, 40 ms of which 32 ms forward -> 1 ms a token outside; 4 ms a 1-row forward
    costs.observe_plain(wall_ms=40.0, forward_ms=32.0, num_tokens=8, curve=base)
    # a speculative step over 8 rows (2.0 forwards on the curve): 8 ms forward, 1 ms model drafting, 15 ms in all
    costs.observe_speculative(wall_ms=15.0, forward_ms=8.0, model_draft_ms=1.0, num_rows=8, curve=base)
    measured = costs.overheads()
    assert measured.plain_ms == pytest.approx(1.0, rel=BUCKET - 1)
    assert measured.speculative_ms == pytest.approx(6.0, rel=BUCKET - 1)
    assert measured.one_row_ms == pytest.approx(4.0, rel=BUCKET - 1)
    model = costs.cost_model(base, one_row_ms=4.0)
    assert model.plain_overhead == pytest.approx(0.25, rel=0.1)
    assert model.speculative_overhead == pytest.approx(1.5, rel=0.1)
    assert model.verify_curve == base.verify_curve  # only the overheads are measured here


def test_a_slower_forward_than_at_start_up_shrinks_the_overheads_in_forwards():
    costs, base = StepCosts(StepCostConfig(min_steps=1)), _base()
    costs.observe_plain(wall_ms=66.0, forward_ms=64.0, num_tokens=8, curve=base)  # 8 ms a forward now, not 4
    model = costs.cost_model(base, one_row_ms=4.0)
    assert model.plain_overhead == pytest.approx(0.25 / 8.0, rel=0.1)  # 0.25 ms of an 8 ms forward
    assert model.speculative_overhead == base.speculative_overhead  # not measured yet: the setting


def test_the_mean_follows_recent_steps():
    costs, base = StepCosts(StepCostConfig(half_life_steps=4.0, min_steps=1)), _base()
    for _ in range(50):
        costs.observe_speculative(wall_ms=20.0, forward_ms=10.0, model_draft_ms=0.0, num_rows=4, curve=base)
    for _ in range(50):
        costs.observe_speculative(wall_ms=12.0, forward_ms=10.0, model_draft_ms=0.0, num_rows=4, curve=base)
    assert costs.overheads().speculative_ms == pytest.approx(2.0, rel=BUCKET - 1)


def test_nonsense_samples_are_ignored():
    costs, base = StepCosts(StepCostConfig(min_steps=1)), _base()
    costs.observe_plain(wall_ms=10.0, forward_ms=5.0, num_tokens=0, curve=base)
    costs.observe_plain(wall_ms=float("nan"), forward_ms=5.0, num_tokens=2, curve=base)
    costs.observe_speculative(wall_ms=10.0, forward_ms=-1.0, model_draft_ms=0.0, num_rows=3, curve=base)
    assert costs.overheads() == costs.overheads().__class__(None, None, None)


def test_config_is_checked():
    with pytest.raises(ValueError, match="half_life_steps"):
        StepCostConfig(half_life_steps=0.0)
    with pytest.raises(ValueError, match="min_steps"):
        StepCostConfig(min_steps=0)
