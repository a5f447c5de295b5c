"""Adaptive controller: the cost model's formulas, the optimiser, and deterministic closed-loop simulations."""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable

import pytest

from gateway.controller import (
    AdaptiveController,
    ControllerConfig,
    ControllerState,
    SpeculationPlan,
    TaskType,
    adjust_speculative_degree,
    expected_accepted_length,
    infer_task_type,
)
from gateway.cost_model import SMOLLM2_BF16_VERIFY_MS, CostModel, CostSettings, DraftCost, cost_model_for
from specdec.candidates import CandidateOutcome

LOOKUP, SUFFIX, EARLY_EXIT = "prompt_lookup", "suffix_index", "early_exit"
# docs/architecture.md: bf16 verify curve, ~10 % of a step outside model compute when speculating, early exit
# costing 0.6 of a full step per drafted token.
COST = CostModel.from_verify_ms(
    SMOLLM2_BF16_VERIFY_MS,
    {LOOKUP: DraftCost(fixed=0.002), SUFFIX: DraftCost(fixed=0.004), EARLY_EXIT: DraftCost(per_token=0.6)},
    plain_overhead=0.05,
    speculative_overhead=0.10,
)
# coverage 1: every decoder always proposes, so the closed forms apply exactly
FULL_COVERAGE = ControllerConfig(prior_coverage=1.0)

World = Callable[[int], dict[tuple[str, int], float]]


def simulate(
    controller: AdaptiveController, state: ControllerState, world: World, num_steps: int, rng: random.Random
) -> list[SpeculationPlan]:
    """Each planned candidate is accepted token by token with the world's true alpha (geometric)."""
    plans = []
    for step in range(num_steps):
        plan = controller.plan(state)
        alphas, outcomes = world(step), []
        for decoder, rank in plan.sources:
            accepted = 0
            while accepted < plan.draft_length and rng.random() < alphas[decoder, rank]:
                accepted += 1
            outcomes.append(CandidateOutcome(decoder, rank, plan.draft_length, accepted))
        controller.observe(state, plan, outcomes)
        plans.append(plan)
    return plans


def reference_speedup(alphas: list[float], decoders: set[str], gamma: int, config: ControllerConfig) -> float:
    """E[accepted length] of independent full-length candidates over the cost of their tree."""
    length = 1 + sum(1 - math.prod(1 - a**j for a in alphas) for j in range(1, gamma + 1))
    step = (
        COST.speculative_overhead
        + sum(COST.draft(d, gamma) for d in decoders)
        + float(COST.verify(1 + min(len(alphas) * gamma, config.max_tree_nodes)))
    )
    return length * COST.plain_step / step


def test_expected_accepted_length_is_leviathans_closed_form():
    assert expected_accepted_length(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_accepted_length(0.0, 5) == 1.0
    assert expected_accepted_length(1.0, 5) == 6.0


def test_verify_cost_interpolates_and_extrapolates_the_measured_curve():
    cost = CostModel(verify_curve=((1, 1.0), (4, 1.3), (8, 1.5)))
    assert float(cost.verify(2)) == pytest.approx(1.1)
    assert float(cost.verify(6)) == pytest.approx(1.4)
    assert float(cost.verify(10)) == pytest.approx(1.6)  # last slope 0.05 a token continues
    assert float(cost.verify(0)) == 1.0
    assert float(COST.verify(8)) == pytest.approx(31.7 / 26.8)
    assert COST.plain_step == pytest.approx(1.05)
    with pytest.raises(ValueError, match="num_tokens 1"):
        CostModel(verify_curve=((2, 1.0),))
    with pytest.raises(ValueError, match="'unknown'"):
        COST.draft("unknown", 4)


def test_single_chain_plan_uses_the_closed_form():
    plan = adjust_speculative_degree("code", 0.8, decoders={LOOKUP: 1}, cost_model=COST, config=FULL_COVERAGE)
    assert plan.sources == ((LOOKUP, 0),)
    assert plan.expected_accepted_length == pytest.approx(expected_accepted_length(0.8, plan.draft_length))
    assert plan.expected_speedup == pytest.approx(reference_speedup([0.8], {LOOKUP}, plan.draft_length, FULL_COVERAGE))
    # and it is the best length on the grid
    assert plan.expected_speedup == pytest.approx(
        max(reference_speedup([0.8], {LOOKUP}, g, FULL_COVERAGE) for g in FULL_COVERAGE.draft_length_choices)
    )


def test_draft_length_grows_with_acceptance_and_speculation_stops_at_zero():
    lengths = [
        adjust_speculative_degree("code", a, decoders={LOOKUP: 1}, cost_model=COST, config=FULL_COVERAGE).draft_length
        for a in (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
    ]
    assert lengths == sorted(lengths)
    assert lengths[0] <= 2 and lengths[-1] >= 12
    off = adjust_speculative_degree("code", 0.0, decoders={LOOKUP: 1}, cost_model=COST, config=FULL_COVERAGE)
    assert not off.is_speculative and off.speculative_degree == 0 and off.expected_speedup < 1.0


def test_optimiser_agrees_with_the_reference_and_beats_every_single_candidate():
    rng = random.Random(7)
    decoders = {LOOKUP: 3, SUFFIX: 1}
    for _ in range(25):
        alphas = {
            (LOOKUP, 0): rng.random(),
            (LOOKUP, 1): rng.random() * 0.6,
            (LOOKUP, 2): rng.random() * 0.3,
            (SUFFIX, 0): rng.random(),
        }
        plan = adjust_speculative_degree("creative", alphas, decoders=decoders, cost_model=COST, config=FULL_COVERAGE)
        singles = max(
            reference_speedup([alphas[d, 0]], {d}, g, FULL_COVERAGE)
            for d in decoders
            for g in FULL_COVERAGE.draft_length_choices
        )
        if not plan.is_speculative:
            assert singles < 1.0
            continue
        assert plan.expected_speedup == pytest.approx(
            reference_speedup(
                [alphas[s] for s in plan.sources], {d for d, _ in plan.sources}, plan.draft_length, FULL_COVERAGE
            )
        )
        assert plan.expected_speedup >= singles - 1e-12
        for decoder, rank in plan.sources:  # ranks come in order within a decoder
            assert rank == 0 or (decoder, rank - 1) in plan.sources


def test_a_decoder_that_does_not_pay_for_its_cost_is_left_out():
    # Early exit agreeing on 39 % of tokens at 0.6 of a step per token (docs/architecture.md) never pays.
    alone = adjust_speculative_degree(
        "code", {(EARLY_EXIT, 0): 0.39}, decoders={EARLY_EXIT: 1}, cost_model=COST, config=FULL_COVERAGE
    )
    assert not alone.is_speculative
    mixed = adjust_speculative_degree(
        "code",
        {(EARLY_EXIT, 0): 0.39, (LOOKUP, 0): 0.6},
        decoders={LOOKUP: 1, EARLY_EXIT: 1},
        cost_model=COST,
        config=FULL_COVERAGE,
    )
    assert mixed.sources == ((LOOKUP, 0),)
    cheap = CostModel(COST.verify_curve, ((EARLY_EXIT, DraftCost(per_token=0.01)),))
    paid = adjust_speculative_degree(
        "code", {(EARLY_EXIT, 0): 0.39}, decoders={EARLY_EXIT: 1}, cost_model=cheap, config=FULL_COVERAGE
    )
    assert paid.sources == ((EARLY_EXIT, 0),)  # the same acceptance earns its place once it is cheap


def test_a_plan_expects_no_more_of_its_tree_than_the_node_budget_holds():
    # A flat verify curve makes every row free: without a budget both candidates draft 16 tokens. A
    # budget of 8 nodes holds one chain of 8 (1 + 0.8 + ... + 0.8^8 = 4.33 tokens) or two of 4 (4.24),
    # never two of 16, which the pool would cut to 8 nodes.
    flat = CostModel(((1, 1.0), (64, 1.0)), ((LOOKUP, DraftCost()), (SUFFIX, DraftCost())))
    decoders = {LOOKUP: 1, SUFFIX: 1}
    roomy = ControllerConfig(prior_coverage=1.0, max_speculative_degree=2, draft_length_choices=(4, 8, 16))
    tight = ControllerConfig(
        prior_coverage=1.0, max_speculative_degree=2, draft_length_choices=(4, 8, 16), max_tree_nodes=8
    )
    wide = adjust_speculative_degree("code", 0.8, decoders=decoders, cost_model=flat, config=roomy)
    assert (wide.draft_length, wide.speculative_degree) == (16, 2)
    plan = adjust_speculative_degree("code", 0.8, decoders=decoders, cost_model=flat, config=tight)
    assert (plan.draft_length, plan.speculative_degree, plan.max_tree_nodes) == (8, 1, 8)
    assert plan.expected_accepted_length == pytest.approx(expected_accepted_length(0.8, 8))
    assert plan.expected_speedup == pytest.approx(expected_accepted_length(0.8, 8))  # rows are free
    assert plan.expected_speedup < wide.expected_speedup


def test_a_decoders_extra_verify_rows_are_priced_once_by_the_verify_curve():
    # Lookahead's window adds rows to every verify it rides in: the same acceptance as prompt lookup
    # loses to it when the rows cost more than they gain, and ranks of it pay for the rows once.
    lookahead = "lookahead"
    costs = dict(COST.draft_costs) | {lookahead: DraftCost(fixed=0.002, extra_rows=48)}
    model = CostModel(COST.verify_curve, tuple(sorted(costs.items())), COST.plain_overhead, COST.speculative_overhead)
    assert model.extra_rows(lookahead) == 48 and model.extra_rows(LOOKUP) == 0
    alphas = {(LOOKUP, 0): 0.5, (lookahead, 0): 0.5}
    plan = adjust_speculative_degree(
        "code", alphas, decoders={LOOKUP: 1, lookahead: 1}, cost_model=model, config=FULL_COVERAGE
    )
    assert plan.sources[0] == (LOOKUP, 0)
    alone = adjust_speculative_degree("code", {(lookahead, 0): 0.5}, decoders={lookahead: 1}, cost_model=model)
    free = adjust_speculative_degree("code", {(LOOKUP, 0): 0.5}, decoders={LOOKUP: 1}, cost_model=model)
    assert alone.expected_speedup < free.expected_speedup


def test_task_type_priors_order_the_first_plan():
    first = {t: adjust_speculative_degree(t, decoders={LOOKUP: 1}, cost_model=COST) for t in TaskType}
    assert (
        first[TaskType.STRUCTURED].draft_length
        >= first[TaskType.CODE].draft_length
        >= first[TaskType.CREATIVE].draft_length
    )


HIGH = {(LOOKUP, 0): 0.9, (LOOKUP, 1): 0.45, (SUFFIX, 0): 0.6}
LOW = {(LOOKUP, 0): 0.35, (LOOKUP, 1): 0.15, (SUFFIX, 0): 0.2}
ZERO = dict.fromkeys(HIGH, 0.0)


def _settled(plans: list[SpeculationPlan], last: int = 15) -> tuple[float, float]:
    """Median draft_length and tree size (degree * length) over the last steps, probes left out."""
    steady = [p for p in plans[-last:] if not p.is_probe]
    return (
        statistics.median(p.draft_length for p in steady),
        statistics.median(p.draft_length * p.speculative_degree for p in steady),
    )


def test_falling_acceptance_shrinks_drafts_and_rising_acceptance_grows_them():
    controller = AdaptiveController(COST)
    state = controller.new_state("code", {LOOKUP: 2, SUFFIX: 1})
    rng = random.Random(0)
    high = _settled(simulate(controller, state, lambda _: HIGH, 40, rng))
    low = _settled(simulate(controller, state, lambda _: LOW, 40, rng))
    high_again = _settled(simulate(controller, state, lambda _: HIGH, 40, rng))
    assert low[0] < high[0] and low[1] < high[1]
    assert high_again[0] > low[0] and high_again[1] > low[1]
    assert high[0] >= 8 and low[0] <= 4


def test_consistently_losing_turns_speculation_off_then_probes_bring_it_back():
    # a probe's own cost never stretches the schedule here (test_a_dear_probe_waits_until_its_cost_is_spread)
    config = ControllerConfig(probe_interval=10, max_probe_overhead=1.0)
    controller = AdaptiveController(COST, config)
    state = controller.new_state("code", {LOOKUP: 1, SUFFIX: 1})
    rng = random.Random(1)
    simulate(controller, state, lambda _: HIGH, 20, rng)
    assert state.is_speculating
    losing = simulate(controller, state, lambda _: ZERO, 60, rng)
    assert not state.is_speculating
    assert max(p.draft_length for p in losing[10:]) <= 4  # drafts shrink within a few steps
    # speculating with 1-2 tokens costs only a few percent in bf16, so turning off needs alpha near 0
    first_off = next(i for i, p in enumerate(losing) if not p.is_speculative)
    assert first_off < 30
    # while off, the only drafts are short probes: the first probe_interval steps after turning off,
    # then each failed probe doubles the wait, up to max_probe_backoff times the interval
    probes = [i for i, p in enumerate(losing[first_off:]) if p.is_speculative]
    assert probes and all(losing[first_off + i].is_probe for i in probes)
    assert all(losing[first_off + i].draft_length == config.probe_draft_length for i in probes)
    assert probes[0] == config.probe_interval
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == [config.probe_interval * min(2 ** (k + 1), config.max_probe_backoff) for k in range(len(gaps))]
    recovered = simulate(controller, state, lambda _: HIGH, 80, rng)
    back_on = next(i for i, p in enumerate(recovered) if p.is_speculative and not p.is_probe)
    assert back_on <= config.probe_interval * config.max_probe_backoff + 5
    assert state.is_speculating and _settled(recovered)[0] >= 8


def test_a_dear_probe_waits_until_its_cost_is_spread():
    """With a speculative step's overhead at two forwards, a failed probe loses about two steps'
    time: probes come no more often than every loss / max_probe_overhead steps."""
    dear = cost_model_for({1: 4.0, 8: 8.0}, CostSettings(plain_overhead_ms=0.2, speculative_overhead_ms=8.0))
    config = ControllerConfig(probe_interval=10, max_probe_overhead=0.02)
    controller = AdaptiveController(dear, config)
    state = controller.new_state("code", {LOOKUP: 1})
    plans = simulate(controller, state, lambda _: ZERO, 400, random.Random(3))
    probes = [i for i, p in enumerate(plans) if p.is_probe]
    assert len(probes) >= 2
    plain_step = dear.plain_step
    for a, b in zip(probes, probes[1:]):
        rows = 1.0 + state.estimates[0].coverage * state.estimates[0].fill * config.probe_draft_length
        loss = dear.speculative_overhead + float(dear.verify(rows)) - plain_step
        assert (b - a) * config.max_probe_overhead * plain_step >= loss * 0.9  # the spread (estimates move)
        assert b - a > config.probe_interval * config.max_probe_backoff  # longer than the schedule alone


def test_a_collapsing_decoder_is_dropped_and_a_probe_readmits_it():
    both_good = {(LOOKUP, 0): 0.5, (SUFFIX, 0): 0.5}
    suffix_dead = {(LOOKUP, 0): 0.5, (SUFFIX, 0): 0.0}
    config = ControllerConfig(probe_interval=8)
    controller = AdaptiveController(COST, config)
    state = controller.new_state("creative", {LOOKUP: 1, SUFFIX: 1})
    rng = random.Random(2)
    plans = simulate(controller, state, lambda _: both_good, 30, rng)
    assert all((SUFFIX, 0) in p.sources for p in plans[-10:])
    plans = simulate(controller, state, lambda _: suffix_dead, 40, rng)
    steady = [p for p in plans[-15:] if not p.is_probe]
    assert steady and all(p.sources == ((LOOKUP, 0),) for p in steady)  # degree 2 -> 1
    assert any(p.is_probe and (SUFFIX, 0) in p.sources for p in plans[-15:])
    plans = simulate(controller, state, lambda _: both_good, 40, rng)
    assert all((SUFFIX, 0) in p.sources for p in plans[-10:])  # degree back to 2


def test_expensive_decoders_are_neither_chosen_nor_probed():
    # early exit: 4 tokens cost 2.4 steps; probing it every 4 steps would cost 60 % of throughput
    controller = AdaptiveController(COST, ControllerConfig(probe_interval=4))
    rng = random.Random(4)
    state = controller.new_state("creative", {EARLY_EXIT: 1, LOOKUP: 1})
    plans = simulate(controller, state, lambda _: {(EARLY_EXIT, 0): 0.39, (LOOKUP, 0): 0.7}, 30, rng)
    assert any(p.is_speculative for p in plans)
    assert all((EARLY_EXIT, 0) not in p.sources for p in plans)
    state = controller.new_state("creative", {EARLY_EXIT: 1})
    plans = simulate(controller, state, lambda _: {(EARLY_EXIT, 0): 0.39}, 30, rng)
    assert not any(p.is_speculative for p in plans) and not state.is_speculating


def test_a_decoder_known_silent_is_neither_planned_nor_probed_nor_counted():
    # SUFFIX stands in for grammar-forced drafts: certain where it proposes (forced text, 3 steps of
    # every 8), silent in between (free text); LOOKUP never right. The gateway says which steps are silent.
    controller = AdaptiveController(COST, ControllerConfig(probe_interval=4))
    state = controller.new_state("structured", {LOOKUP: 1, SUFFIX: 1})
    silent = {(SUFFIX, 0): 0.0}
    suffix = next(e for e in state.estimates if e.decoder == SUFFIX)
    for step in range(64):
        is_forced = step % 8 < 3
        asked_before = suffix.asked_steps
        plan = controller.plan(state, None if is_forced else silent)
        assert ((SUFFIX, 0) in plan.sources) == is_forced, (step, plan)  # planned exactly when it can draft
        outcomes = [
            CandidateOutcome(name, rank, plan.draft_length, plan.draft_length if name == SUFFIX else 0)
            for name, rank in plan.sources
        ]
        controller.observe(state, plan, outcomes)
        if not is_forced:
            assert suffix.asked_steps <= asked_before  # not asked: only discounted, never a miss
    assert suffix.coverage == pytest.approx(1.0, abs=1e-3) and suffix.acceptance > 0.9  # the prior faded
    # known silent and nothing else to draft: plain steps, and no probe of it either
    state = controller.new_state("structured", {SUFFIX: 1})
    plans = [controller.plan(state, silent) for _ in range(20)]
    for plan in plans:
        controller.observe(state, plan, [])
    assert not any(p.is_speculative for p in plans)


def test_a_planned_decoder_without_an_outcome_proposed_nothing():
    controller = AdaptiveController(COST)
    state = controller.new_state("code", {LOOKUP: 1})
    before = state.estimates[0].coverage
    plan = SpeculationPlan(draft_length=4, sources=((LOOKUP, 0),))
    for _ in range(5):
        controller.observe(state, plan, [])
    assert state.estimates[0].coverage < before / 2
    assert state.num_steps == 5


def test_plain_steps_ahead_count_down_to_the_next_probe_and_failed_probes_back_off():
    """While off, the plans up to the next probe are plain whatever happens meanwhile (no evidence
    arrives): plain_steps_ahead says how many, so the gateway can decode them in one run. Each probe
    that leaves speculation off doubles the wait; turning on starts over."""
    config = ControllerConfig(probe_interval=10, max_probe_backoff=4)
    controller = AdaptiveController(COST, config)
    state = controller.new_state("code", {LOOKUP: 1})
    rng = random.Random(5)
    simulate(controller, state, lambda _: HIGH, 10, rng)
    assert state.is_speculating and controller.plain_steps_ahead(state) == 0
    for _ in range(40):  # losing until speculation turns off, not a step more
        simulate(controller, state, lambda _: ZERO, 1, rng)
        if not state.is_speculating:
            break
    assert not state.is_speculating and state.num_failed_probes == 0
    waits = []
    for _ in range(4):  # walk through four probes, checking every plain plan's count on the way
        ahead = controller.plain_steps_ahead(state)
        waits.append(ahead)
        for k in range(ahead):
            assert controller.plain_steps_ahead(state) == ahead - k
            plan = controller.plan(state)
            assert not plan.is_speculative
            controller.observe(state, plan, [])
        probe = controller.plan(state)
        assert probe.is_probe
        controller.observe(state, probe, [CandidateOutcome(LOOKUP, 0, probe.draft_length, 0)])
        waits[-1] += 1  # the probe's own step
    assert waits == [10, 20, 40, 40]  # the interval, then 2x, 4x, and capped at 4x
    simulate(controller, state, lambda _: HIGH, 60, rng)  # a probe finds acceptance again
    assert state.is_speculating and state.num_failed_probes == 0
    data = json.loads(json.dumps(state.to_dict()))
    del data["num_failed_probes"]  # a state stored before probes backed off
    assert ControllerState.from_dict(data).num_failed_probes == 0


def test_no_probe_to_come_means_plain_steps_without_end():
    """A request whose only decoders are too dear to probe stays plain: nothing bounds its runs."""
    from gateway.controller import NEVER_DRAFTS

    controller = AdaptiveController(COST)
    state = controller.new_state("code", {})
    assert not controller.plan(state).is_speculative
    assert controller.plain_steps_ahead(state) == NEVER_DRAFTS


def test_state_round_trips_through_a_plain_dict():
    controller = AdaptiveController(COST)
    state = controller.new_state("structured", {LOOKUP: 2, SUFFIX: 1})
    simulate(controller, state, lambda step: HIGH if step < 10 else ZERO, 25, random.Random(3))
    data = json.loads(json.dumps(state.to_dict()))  # what Redis holds
    restored = ControllerState.from_dict(data)
    assert restored == state
    assert restored.task_type is TaskType.STRUCTURED
    assert controller.plan(restored) == controller.plan(state)
    assert restored == state  # both advanced identically
    with pytest.raises(ValueError, match="'num_steps'"):
        ControllerState.from_dict({k: v for k, v in data.items() if k != "num_steps"})
    with pytest.raises(ValueError, match="version"):
        ControllerState.from_dict({**data, "version": 99})


def test_bad_inputs_are_rejected_naming_the_field():
    controller = AdaptiveController(COST)
    with pytest.raises(ValueError, match="'mystery'"):
        controller.new_state("code", {"mystery": 1})
    with pytest.raises(ValueError, match="task_type"):
        controller.new_state("poetry", {LOOKUP: 1})
    state = controller.new_state("code", {LOOKUP: 1})
    plan = SpeculationPlan(draft_length=4, sources=((LOOKUP, 0),))
    with pytest.raises(ValueError, match="num_accepted"):
        controller.observe(state, plan, [CandidateOutcome(LOOKUP, 0, num_proposed=2, num_accepted=3)])
    with pytest.raises(ValueError, match="not tracked"):
        controller.observe(state, plan, [CandidateOutcome(SUFFIX, 0, num_proposed=2, num_accepted=1)])
    with pytest.raises(ValueError, match="not tracked"):
        controller.observe(state, SpeculationPlan(draft_length=4, sources=((SUFFIX, 0),)), [])
    with pytest.raises(ValueError, match="on_above"):
        ControllerConfig(off_below=1.1, on_above=1.0)


@pytest.mark.parametrize(
    "prompt, has_schema, expected",
    [
        ("Give me the weather in Paris.", True, TaskType.STRUCTURED),
        ("Fix this:\n```python\nprint(1)\n```", False, TaskType.CODE),
        ('def add(a, b):\n    """Add two numbers."""\n', False, TaskType.CODE),
        ("#include <stdio.h>\nint main() {\n", False, TaskType.CODE),
        ("Write a short story about a lighthouse keeper.", False, TaskType.CREATIVE),
        ("Describe the class struggle in Victorian novels.", False, TaskType.CREATIVE),
    ],
)
def test_infer_task_type(prompt, has_schema, expected):
    assert infer_task_type(prompt, has_schema) is expected


def test_ride_alongs_keep_the_degree_bound_and_rank_order():
    # degree bound 1: a probe of the left-out decoder takes the chosen one's place for that step
    config = ControllerConfig(max_speculative_degree=1, probe_interval=6)
    controller = AdaptiveController(COST, config)
    state = controller.new_state("code", {LOOKUP: 2, SUFFIX: 1})
    plans = simulate(
        controller, state, lambda _: {(LOOKUP, 0): 0.8, (LOOKUP, 1): 0.3, (SUFFIX, 0): 0.4}, 60, random.Random(5)
    )
    assert all(p.speculative_degree <= 1 for p in plans)
    assert any(p.is_probe and p.sources == ((SUFFIX, 0),) for p in plans)
    assert all(p.sources[0][1] == 0 for p in plans if p.sources)  # never rank 1 alone
    # degree 2 with three ranks: rank 2 rides along only next to rank 1
    state = AdaptiveController(COST, ControllerConfig(max_speculative_degree=2, probe_interval=4)).new_state(
        "code", {LOOKUP: 3}
    )
    controller = AdaptiveController(COST, ControllerConfig(max_speculative_degree=2, probe_interval=4))
    plans = simulate(
        controller, state, lambda _: {(LOOKUP, 0): 0.9, (LOOKUP, 1): 0.05, (LOOKUP, 2): 0.05}, 60, random.Random(6)
    )
    for p in plans:
        assert p.speculative_degree <= 2
        ranks = sorted(r for _, r in p.sources)
        assert ranks == list(range(len(ranks))), p.sources


# An int8 CPU curve (ms, `python -m bench engine` on a 2-core AVX2 machine): past a few rows every row
# costs about the same, so under load a draft row costs about what another request's token does.
CPU_INT8 = CostModel.from_verify_ms(
    ((1, 11.7), (2, 13.2), (4, 19.9), (8, 32.8), (16, 55.7), (32, 112.0), (64, 262.0)),
    {LOOKUP: DraftCost(fixed=0.002)},
)


def plan_under_load(alpha: float, other_rows: float) -> SpeculationPlan:
    controller = AdaptiveController(CPU_INT8, FULL_COVERAGE)
    state = controller.new_state("code", {LOOKUP: 1})
    state.estimates[0].accepted = alpha * state.estimates[0].tested
    state.other_rows = other_rows
    return controller.plan(state)


def test_under_load_probes_grow_rare_so_others_rarely_wait_on_their_rows():
    controller = AdaptiveController(CPU_INT8, ControllerConfig(probe_interval=16, max_shared_probe_overhead=0.05))
    # unloaded the interval is probe_interval
    assert controller.probe_interval(0.0) == 16
    # 3 others: a probe's 4 rows lengthen their 4-row step by verify(8) - verify(4) = 12.9 ms, which
    # 3 requests wait on; 3 * 12.9 / (0.05 * 19.9) = 38.9 -> every 39 steps
    assert controller.probe_interval(3.0) == 39
    intervals = [controller.probe_interval(r) for r in (1.0, 3.0, 7.0, 15.0, 31.0)]
    assert intervals == sorted(intervals) and intervals[-1] > 4 * 16
    # and the loop follows it: a request that is off probes at that interval under load (times the
    # failed probes' backoff)
    state = controller.new_state("creative", {LOOKUP: 1})
    state.is_speculating, state.other_rows = False, 3.0
    state.estimates[0].accepted = 0.0  # nothing accepted: speculation stays off between probes
    probes = []
    for step in range(300):
        state.num_steps = step
        if controller.plan(state).is_probe:
            probes.append(step)
    assert probes[0] == 39 and [b - a for a, b in zip(probes, probes[1:])] == [78, 156]


def test_without_load_the_plan_is_the_single_request_plan():
    alone = adjust_speculative_degree("code", 0.8, decoders={LOOKUP: 1}, cost_model=CPU_INT8, config=FULL_COVERAGE)
    plan = plan_under_load(0.8, 0.0)
    assert plan == alone and plan.is_speculative


def test_load_shrinks_drafts_and_turns_speculation_off():
    busy = (0, 1, 3, 7)
    plans = [plan_under_load(0.8, rows) for rows in busy]
    assert all(p.is_speculative for p in plans)
    speedups, lengths = [p.expected_speedup for p in plans], [p.draft_length for p in plans]
    assert speedups == sorted(speedups, reverse=True) and lengths == sorted(lengths, reverse=True)
    assert lengths[0] > lengths[-1]
    # 1 other row: (1 + E) / 2 tokens for the draft and verify(2 + nodes) against a plain verify(2)
    gain = (1 + plans[1].expected_accepted_length) / 2
    step = CPU_INT8.draft(LOOKUP, plans[1].draft_length) + CPU_INT8.verify(2 + plans[1].draft_length)
    assert plans[1].expected_speedup == pytest.approx(gain * CPU_INT8.verify(2) / step)
    # where a row costs about another request's token, no draft pays
    assert not any(plan_under_load(0.8, rows).is_speculative for rows in (15, 31, 63))
    assert plan_under_load(0.95, 7).is_speculative and not plan_under_load(0.5, 1).is_speculative


def test_the_load_is_the_other_requests_rows_smoothed():
    controller = AdaptiveController(CPU_INT8, ControllerConfig(load_smoothing=0.5))
    state = controller.new_state("code", {LOOKUP: 1})
    controller.observe_load(state, 32)
    assert state.other_rows == pytest.approx(16.0)
    controller.observe_load(state, 32)
    assert state.other_rows == pytest.approx(24.0)
    controller.observe_load(state, 0)  # alone again: the load fades
    assert state.other_rows == pytest.approx(12.0)
    with pytest.raises(ValueError, match="other_rows"):
        controller.observe_load(state, -1)
    data = json.loads(json.dumps(state.to_dict()))
    assert ControllerState.from_dict(data).other_rows == pytest.approx(12.0)
    del data["other_rows"]  # a state stored before the load was kept
    assert ControllerState.from_dict(data).other_rows == 0.0
    with pytest.raises(ValueError, match="load_smoothing"):
        ControllerConfig(load_smoothing=0.0)


def test_remembered_choices_give_the_plans_of_a_fresh_optimisation(monkeypatch):
    import gateway.controller as controller_module

    calls = []
    real = controller_module._best_choice
    monkeypatch.setattr(
        controller_module, "_best_choice", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs)
    )
    config = ControllerConfig(probe_interval=10)
    remembering = AdaptiveController(COST, config)
    state = remembering.new_state("code", {LOOKUP: 1, SUFFIX: 1})
    rng = random.Random(3)
    plans = simulate(remembering, state, lambda step: HIGH if step < 20 else ZERO, 80, rng)
    # Each plan equals what an optimisation of that step's state from scratch plans.
    monkeypatch.setattr(controller_module, "MAX_REMEMBERED_CHOICES", 0)  # remembers nothing
    replay, replay_state = AdaptiveController(COST, config), remembering.new_state("code", {LOOKUP: 1, SUFFIX: 1})
    rng = random.Random(3)
    assert simulate(replay, replay_state, lambda step: HIGH if step < 20 else ZERO, 80, rng) == plans
    monkeypatch.setattr(controller_module, "MAX_REMEMBERED_CHOICES", 4096)
    # Plain steps change nothing the optimisation reads: they are not optimised again.
    assert not state.is_speculating
    before = len(calls)
    for _ in range(5):
        plan = remembering.plan(state)
        remembering.observe(state, plan, [])
    assert len(calls) - before <= 1  # at most a probe's outcome to take in
    # Another request in the same state shares the choice; a different load is optimised afresh.
    other = ControllerState.from_dict(state.to_dict())
    before = len(calls)
    remembering.plan(other)
    assert len(calls) == before
    other.other_rows = 7.0
    remembering.plan(other)
    assert len(calls) == before + 1


def test_the_plan_takes_the_load_on_a_grid_so_loaded_requests_share_choices(monkeypatch):
    import gateway.controller as controller_module

    bucket = controller_module.load_bucket
    assert bucket(0.0) == 0.0 and bucket(-1.0) == 0.0 and bucket(3.0) == 3.0 and bucket(3.3) == 3.5
    for rows in (8.0, 31.0, 63.0, 200.0):
        assert abs(bucket(rows) - rows) <= 0.05 * rows  # half a 10 % step
    loads = []
    real = controller_module._best_choice
    monkeypatch.setattr(
        controller_module, "_best_choice", lambda *args, **kwargs: loads.append(args[4]) or real(*args, **kwargs)
    )
    controller = AdaptiveController(CPU_INT8, FULL_COVERAGE)
    state = controller.new_state("code", {LOOKUP: 1})
    for rows in (29.5, 30.0, 30.8, 31.5):  # the smoothed load drifting within one 10 % step
        state.other_rows = rows
        controller.plan(state)
    assert loads == [bucket(30.0)]


def test_a_tree_decoder_is_priced_by_its_measured_cost_and_gets_leaves_while_they_pay():
    """The feature drafter's ranks are the leaves of one tree: one measured propose (fixed + per depth,
    in ms over the primary's 1-row forward), nodes from every planned rank. Cheap, it runs with
    several leaves; at more than a forward per depth the cost model leaves it out."""
    from gateway.cost_model import CostSettings, cost_model_for

    verify_ms = dict(SMOLLM2_BF16_VERIFY_MS)
    decoders = {"feature": 4, LOOKUP: 1}
    alpha = {("feature", 0): 0.8, ("feature", 1): 0.7, ("feature", 2): 0.1, ("feature", 3): 0.05, (LOOKUP, 0): 0.05}
    config = ControllerConfig(prior_coverage=1.0)
    cheap = cost_model_for(verify_ms, CostSettings(), {"feature": (0.5, 1.5)})
    plan = adjust_speculative_degree("code", alpha, decoders=decoders, cost_model=cheap, config=config)
    assert plan.sources[:2] == (("feature", 0), ("feature", 1)) and plan.num_candidates("feature") == 2
    assert plan.max_tree_nodes == len(plan.sources) * plan.draft_length  # the budget the pool hands it
    dear = cost_model_for(verify_ms, CostSettings(), {"feature": (5.0, 40.0)})
    plan = adjust_speculative_degree("code", alpha, decoders=decoders, cost_model=dear, config=config)
    assert plan.num_candidates("feature") == 0


def test_a_trained_drafters_own_prior_puts_it_in_the_first_plans_where_it_pays():
    """With the task type's prior (creative 0.3) a drafter costing 0.1 of a forward per depth loses to
    the free model-free drafts and is too dear to probe, so it would never be tried; its validation
    acceptance (0.65) as its prior plans it from the first step, and its own steps take over."""
    from gateway.cost_model import CostSettings, cost_model_for

    cost = cost_model_for(dict(SMOLLM2_BF16_VERIFY_MS), CostSettings(), {"feature": (0.0, 2.7)})
    decoders = {LOOKUP: 2, SUFFIX: 1, "feature": 4}
    plain = AdaptiveController(cost)
    assert "feature" not in {d for d, _ in plain.plan(plain.new_state(TaskType.CREATIVE, decoders)).sources}
    assert not plain._is_cheap_probe("feature", 4)
    primed = AdaptiveController(cost, ControllerConfig(decoder_prior_acceptance=(("feature", 0.65),)))
    plan = primed.plan(primed.new_state(TaskType.CREATIVE, decoders))
    assert plan.sources[0] == ("feature", 0) and plan.expected_speedup > 1.0


def greedy_by_draft_length(estimates, cost_model, config, known_coverage, load):
    """The optimiser of the module docstring, one draft length at a time in plain Python: add the
    eligible (decoder, rank) that raises the step's speedup most while it does; keep the best length.
    (sources, draft_length, speedup)."""
    plain_step = cost_model.verify(load + 1.0) + cost_model.plain_overhead
    best = (-math.inf, (), 0)
    for gamma in config.draft_length_choices:
        chosen, miss, nodes, draft, extra, speedup = [], [1.0] * gamma, 0.0, 0.0, 0.0, 0.0
        for _ in range(min(config.max_speculative_degree, len(estimates))):
            pick = None
            for s, e in enumerate(estimates):
                keys = [(estimates[t].decoder, estimates[t].rank) for t in chosen]
                has_prev = any((x.decoder, x.rank) == (e.decoder, e.rank - 1) for x in estimates)
                if s in chosen or (has_prev and (e.decoder, e.rank - 1) not in keys):
                    continue
                coverage = known_coverage.get((e.decoder, e.rank), e.coverage)
                length = e.fill * gamma
                reach = [coverage * e.acceptance ** (j + 1) * min(1.0, max(0.0, length - j)) for j in range(gamma)]
                new_miss = [m * (1.0 - r) for m, r in zip(miss, reach)]
                is_paid = any(estimates[t].decoder == e.decoder for t in chosen)
                new_draft = draft + (0.0 if is_paid else cost_model.draft(e.decoder, gamma))
                new_extra = extra + (0.0 if is_paid else cost_model.extra_rows(e.decoder))
                new_nodes = nodes + coverage * length
                if new_nodes > config.max_tree_nodes:
                    continue
                rows = load + 1.0 + new_nodes + new_extra
                step = cost_model.speculative_overhead + new_draft + cost_model.verify(rows)
                value = (load + 1.0 + sum(1.0 - m for m in new_miss)) / (load + 1.0) * plain_step / step
                if pick is None or value > pick[0]:
                    pick = (value, s, new_miss, new_nodes, new_draft, new_extra)
            if pick is None or pick[0] <= speedup:
                break
            speedup, s, miss, nodes, draft, extra = pick
            chosen.append(s)
        if chosen and speedup > best[0]:
            best = (speedup, tuple(chosen), gamma)
    return best[1], best[2], best[0]


def test_the_optimiser_makes_the_choices_of_a_plain_greedy_search_per_draft_length():
    """The vectorised optimiser (every draft length at once, each decoder's costs remembered per cost
    model) chooses what the search it implements chooses, on varied states, decoders, cost models and
    loads; a second cost model for the same decoders is priced by its own costs."""
    from gateway.controller import _best_choice

    cost_models = [
        cost_model_for({1: 5.2, 2: 5.5, 4: 6.6, 8: 9.4, 16: 15.2, 32: 25.4}, CostSettings(), {"feature": (0.5, 0.45)}),
        cost_model_for({1: 5.2, 2: 5.5, 4: 6.6, 8: 9.4, 16: 15.2, 32: 25.4}, CostSettings(), {"feature": (0.1, 0.05)}),
        cost_model_for({1: 4.0, 8: 8.0}, CostSettings(plain_overhead_ms=0.2, speculative_overhead_ms=2.0)),
        COST,
    ]
    mixes = [{LOOKUP: 1, SUFFIX: 1, "feature": 4}, {LOOKUP: 2, SUFFIX: 1}, {LOOKUP: 1, "lookahead": 1, "feature": 3}]
    rng = random.Random(5)
    num_paying = 0
    for _ in range(300):
        cost_model = rng.choice(cost_models)
        decoders = {d: n for d, n in rng.choice(mixes).items() if d in dict(cost_model.draft_costs)}
        controller = AdaptiveController(cost_model, ControllerConfig(max_speculative_degree=rng.choice([2, 4])))
        state = controller.new_state(rng.choice(["creative", "code", "structured"]), decoders)
        for e in state.estimates:
            for _ in range(rng.randrange(14)):
                proposed = rng.randrange(17)
                e.record(rng.uniform(0.8, 1.0), proposed, rng.randrange(proposed + 1), rng.choice([4, 8, 16]), 64.0)
        known = {} if rng.random() < 0.5 else {(rng.choice(list(decoders)), 0): rng.choice([0.0, 0.5, 1.0])}
        load = rng.choice([0.0, 1.5, 9.7])
        choice = _best_choice(state.estimates, cost_model, controller._config, known, load)
        sources, draft_length, speedup = greedy_by_draft_length(
            state.estimates, cost_model, controller._config, known, load
        )
        assert (choice.sources, choice.draft_length) == (sources, draft_length)
        assert choice.expected_speedup == pytest.approx(speedup, rel=1e-9)
        num_paying += speedup > 1.0
    assert 30 < num_paying < 270  # plans that pay and plans that lose to plain decoding were both tested
