"""The cost model built from a primary's measured verify curve (GetModelInfo.verify_costs)."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.cost_model import SMOLLM2_BF16_VERIFY_MS, CostModel, CostSettings, DraftCost, cost_model_for
from specdec.strategies import NAMES

FP32_CPU_MS = {1: 40.0, 2: 68.0, 4: 66.0, 8: 70.0, 16: 76.0, 32: 108.0}


def test_the_measured_curve_is_normalised_and_the_overheads_are_in_one_row_forwards():
    model = cost_model_for(FP32_CPU_MS, CostSettings(plain_overhead_ms=2.0, speculative_overhead_ms=6.0))
    assert float(model.verify(1)) == 1.0
    assert float(model.verify(2)) == pytest.approx(1.7)
    assert float(model.verify(8)) == pytest.approx(1.75)
    assert float(model.verify(32)) == pytest.approx(2.7)
    assert (model.plain_overhead, model.speculative_overhead) == (pytest.approx(0.05), pytest.approx(0.15))
    assert model.plain_step == pytest.approx(1.05)
    assert model.draft("prompt_lookup", 8) == pytest.approx(0.002)
    assert model.draft("early_exit", 4) == pytest.approx(3.0)  # 0.75 of a forward per token


def test_a_primary_that_measured_nothing_gets_the_reference_curve_shape():
    for measured in ({}, {2: 50.0, 4: 60.0}, {1: 0.0}):
        model = cost_model_for(measured, CostSettings(plain_overhead_ms=26.8, draft_costs=()))
        assert float(model.verify(8)) == pytest.approx(31.7 / 26.8)
        assert model.plain_overhead == pytest.approx(1.0)
        assert dict(SMOLLM2_BF16_VERIFY_MS)[1] == 26.8


def test_settings_are_checked():
    with pytest.raises(ValueError, match="overhead"):
        CostSettings(plain_overhead_ms=-1.0)
    with pytest.raises(ValueError, match="twice"):
        CostSettings(draft_costs=(("a", DraftCost()), ("a", DraftCost())))


def test_every_strategy_has_a_default_draft_cost():
    model = cost_model_for(FP32_CPU_MS, CostSettings())
    for name in NAMES:
        assert model.draft(name, 8) >= 0
    assert model.draft("corpus", 8) < 0.02  # a query, not a forward: cheap enough to probe


def test_draft_costs_the_pool_measured_replace_the_defaults_in_one_row_forwards():
    """GetPoolInfo.draft_costs (ms) over the primary's 1-row forward (40 ms here); the rest stay."""
    model = cost_model_for(FP32_CPU_MS, CostSettings(), {"feature": (2.0, 4.0), "lookahead": (0.4, 0.0)})
    assert model.draft("feature", 1) == pytest.approx(0.15)
    assert model.draft("feature", 6) == pytest.approx(0.05 + 6 * 0.1)
    assert model.draft("lookahead", 4) == pytest.approx(0.01)
    assert model.extra_rows("lookahead") > 0  # a measured time keeps the rows the decoder adds
    assert model.draft("early_exit", 4) == pytest.approx(3.0)  # not measured: the default
    defaults = cost_model_for(FP32_CPU_MS, CostSettings())
    assert defaults.draft("feature", 6) == pytest.approx(6 * dict(CostSettings().draft_costs)["feature"].per_token)


@pytest.mark.parametrize("curve", [SMOLLM2_BF16_VERIFY_MS, ((1, 4.0),), ((1, 4.0), (3, 5.5))])
def test_one_number_costs_what_an_array_of_it_costs(curve):
    """verify() of a number takes a path without numpy (every step asks): the same float, inside the
    curve, on its points, below it and past it."""
    model = CostModel.from_verify_ms(curve)
    xs = [0, 0.5, 1, 1.5, 2, 3, 7.9, 8, 16, 63, 64, 65, 100.25, 1000, *np.random.default_rng(0).uniform(0, 200, 500)]
    assert [model.verify(float(x)) for x in xs] == model.verify(np.array(xs, dtype=np.float64)).tolist()
    assert [model.verify(int(x)) for x in xs] == model.verify(np.array([int(x) for x in xs], dtype=np.float64)).tolist()
