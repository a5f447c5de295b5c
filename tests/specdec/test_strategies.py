"""specdec.strategies: the one list of draft strategies the services share."""

from __future__ import annotations

import pytest

from specdec import strategies


def test_the_named_strategies_are_in_the_list_with_their_kinds():
    assert len(set(strategies.NAMES)) == len(strategies.NAMES)
    assert set(strategies.MODEL_FREE_DEFAULTS) <= set(strategies.names_of(strategies.MODEL_FREE))
    # a request's defaults: those, and what a pool offers only where it can (the feature drafter)
    assert set(strategies.DEFAULT_STRATEGIES) - set(strategies.MODEL_FREE_DEFAULTS) <= strategies.DEFAULTS_WHEN_OFFERED
    assert strategies.FEATURE_STRATEGY in strategies.DEFAULT_STRATEGIES
    assert strategies.MEASURED_STRATEGIES <= set(strategies.names_of(strategies.MODEL))
    assert strategies.names_of(strategies.GRAMMAR) == (strategies.GRAMMAR_STRATEGY,)
    assert strategies.CORPUS_STRATEGY in strategies.names_of(strategies.MODEL_FREE)
    # model-free drafts cost a query; model-based ones a fraction of a forward per token
    assert all(s.cost.per_token == 0 for s in strategies.STRATEGIES if s.kind != strategies.MODEL)
    assert all(0 < s.cost.at(1) < 1 for s in strategies.STRATEGIES if s.kind == strategies.MODEL)


def test_unknown_names_and_bad_entries_are_refused():
    strategies.check_names(("prompt_lookup", "grammar"))
    with pytest.raises(ValueError, match=r"unknown strategies \['nope'\]"):
        strategies.check_names(("prompt_lookup", "nope"))
    with pytest.raises(ValueError, match="kind"):
        strategies.Strategy("x", "gpu", strategies.DraftCost())
    with pytest.raises(ValueError, match=">= 0"):
        strategies.DraftCost(fixed=-1)
