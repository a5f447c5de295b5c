"""The step planner's plans around the controller: what it adds to them and what it tells the controller."""

from __future__ import annotations

import types
from typing import Any, cast

import structlog

from gateway.backends import Backends, ModelInfo
from gateway.cost_model import SMOLLM2_BF16_VERIFY_MS, CostModel
from gateway.dependencies import DependencyState
from gateway.params import GenerationParams, SpeculationParams
from gateway.stats import RequestStats
from gateway.step_planner import StepPlanner
from specdec.acceptance_mode import AcceptanceMode
from specdec.candidates import CandidateOutcome
from specdec.model.tokenizer import Tokenizer
from specdec.sampling import SamplingParams
from specdec.strategies import PREDICTION_STRATEGY, PROMPT_LOOKUP_STRATEGY, DraftCost
from specdec.task_type import TaskType

MODEL = ModelInfo(
    vocab_size=50,
    eos_token_ids=(49,),
    max_context=4096,
    instance_id="fake",
    verify_costs_ms=dict(SMOLLM2_BF16_VERIFY_MS),
)
# free drafts and no overhead: a code request's prompt lookup pays from its prior on
FREE_DRAFTS = CostModel.from_verify_ms(
    SMOLLM2_BF16_VERIFY_MS, {PROMPT_LOOKUP_STRATEGY: DraftCost(), PREDICTION_STRATEGY: DraftCost()}
)


class WordTokenizer:
    """Each word is its number."""

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]

    def decode(self, token_ids: Any) -> str:
        return " ".join(map(str, token_ids))


def make_planner(strategies: tuple[str, ...], prediction: str | None) -> StepPlanner:
    spec = SpeculationParams(True, 2, 8, 0.0, strategies, TaskType.CODE, True)
    params = GenerationParams("3 7 1 4", None, 60, (), SamplingParams(), spec, prediction=prediction)
    return StepPlanner(
        params,
        [3, 7, 1, 4],
        [],
        cast(Tokenizer, WordTokenizer()),
        MODEL,
        RequestStats(),
        structlog.get_logger("test"),
        max_tree_nodes=64,
        acceptance_mode=AcceptanceMode.GREEDY,
        validator_state=DependencyState("validator"),
        backends=cast(Backends, types.SimpleNamespace(other_step_rows=0)),
        cost_model=FREE_DRAFTS,
        min_repeat_tokens=0,
    )


def test_a_prediction_drafts_first_while_the_output_follows_it():
    planner = make_planner((PREDICTION_STRATEGY, PROMPT_LOOKUP_STRATEGY), "5 6 7 8 9 10 11 12")
    plan = planner.plan()
    assert plan.sources[0] == (PREDICTION_STRATEGY, 0)
    planner.observe(plan, [CandidateOutcome(d, r, plan.draft_length, 0) for d, r in plan.sources])


def test_a_prediction_the_pool_does_not_offer_is_neither_planned_nor_observed():
    # the draft pool does not offer the prediction decoder, so the request drafts without it
    # (gateway.params); its prediction still counts the output's unused tokens
    planner = make_planner((PROMPT_LOOKUP_STRATEGY,), "5 6 7 8 9 10 11 12")
    plan = planner.plan()
    assert plan.is_speculative and {d for d, _ in plan.sources} == {PROMPT_LOOKUP_STRATEGY}
    planner.observe(plan, [CandidateOutcome(d, r, plan.draft_length, 1) for d, r in plan.sources])
    assert planner.stats.num_rejected_prediction_tokens == 8
