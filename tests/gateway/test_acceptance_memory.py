"""The gateway's memory of what each decoder earned (gateway.acceptance_memory): new requests' priors."""

from __future__ import annotations

import pytest

from gateway.acceptance_memory import AcceptanceMemory, AcceptanceMemoryConfig
from gateway.controller import AdaptiveController, ControllerConfig
from gateway.cost_model import CostSettings, cost_model_for
from specdec.candidates import CandidateOutcome
from specdec.task_type import TaskType

CREATIVE, CODE = TaskType.CREATIVE, TaskType.CODE


def test_nothing_is_known_before_min_tested_tokens():
    memory = AcceptanceMemory(AcceptanceMemoryConfig(min_tested=4.0))
    memory.record(CREATIVE, "prompt_lookup", 0, num_proposed=4, num_accepted=1, num_requested=4)
    assert memory.prior(CREATIVE, "prompt_lookup", 0) is None  # 2 tested tokens: 1 accepted + 1 rejection


def test_the_prior_is_the_requests_acceptance_coverage_and_fill():
    memory = AcceptanceMemory(AcceptanceMemoryConfig(half_life_steps=1e9, min_tested=1.0))
    # 3 steps asked: 4 of 4 accepted; 1 of 2 proposed (fill 0.5); nothing proposed
    memory.record(CODE, "prompt_lookup", 0, 4, 4, 4)
    memory.record(CODE, "prompt_lookup", 0, 2, 1, 4)
    memory.record(CODE, "prompt_lookup", 0, 0, 0, 4)
    learned = memory.prior(CODE, "prompt_lookup", 0)
    assert learned is not None
    assert learned.acceptance == pytest.approx(5 / 6)  # 5 accepted of 4 + 2 tested
    assert learned.coverage == pytest.approx(2 / 3)
    assert learned.fill == pytest.approx(0.75)
    assert memory.prior(CREATIVE, "prompt_lookup", 0) is None  # another task type learns apart
    assert memory.prior(CODE, "prompt_lookup", 1) is None  # and another rank


def test_bad_outcomes_are_refused_and_the_table_is_bounded():
    memory = AcceptanceMemory(AcceptanceMemoryConfig(max_keys=1, min_tested=1.0))
    with pytest.raises(ValueError, match="num_accepted"):
        memory.record(CODE, "a", 0, 1, 2, 4)
    memory.record(CODE, "a", 0, 2, 2, 4)
    memory.record(CODE, "b", 0, 2, 2, 4)  # past the bound: not remembered
    assert memory.prior(CODE, "a", 0) is not None
    assert memory.prior(CODE, "b", 0) is None


def test_a_new_request_starts_from_what_earlier_requests_measured():
    """Prompt lookup at the creative prior (0.3) would be drafted by a fresh request; after requests
    that never had a draft accepted, the next request starts with speculation off."""
    model = cost_model_for({1: 10.0, 8: 12.0}, CostSettings(plain_overhead_ms=0.5, speculative_overhead_ms=2.0))
    memory = AcceptanceMemory(AcceptanceMemoryConfig(min_tested=8.0))
    controller = AdaptiveController(model, ControllerConfig(prior_acceptance_creative=0.6), memory)
    first = controller.new_state(CREATIVE, {"prompt_lookup": 1})
    assert first.estimates[0].acceptance == pytest.approx(0.6)
    assert controller.plan(first).is_speculative
    for _ in range(8):  # earlier requests: each drafts until its own evidence turns it off
        state = controller.new_state(CREATIVE, {"prompt_lookup": 1})
        while (plan := controller.plan(state)).is_speculative:
            controller.observe(state, plan, [CandidateOutcome("prompt_lookup", 0, plan.draft_length, 0)])
    learned = memory.prior(CREATIVE, "prompt_lookup", 0)
    assert learned is not None and learned.acceptance == 0.0
    later = controller.new_state(CREATIVE, {"prompt_lookup": 1})
    assert later.estimates[0].acceptance == 0.0
    assert not controller.plan(later).is_speculative


def test_the_prediction_decoder_is_the_requests_own_and_never_remembered():
    memory = AcceptanceMemory(AcceptanceMemoryConfig(min_tested=1.0))
    for _ in range(10):  # a wrong prediction in one request says nothing of the next request's
        memory.record(CODE, "prediction", 0, 8, 0, 8)
    assert memory.prior(CODE, "prediction", 0) is None
