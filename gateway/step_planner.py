"""What a request's steps draft (StepPlanner): a SpeculationPlan before every step, and what the
plans learn from the steps' outcomes.

A plan is fixed by the request (its strategies cycled to speculative_degree, its draft_length), or,
when adaptive, chosen before every step by the controller (gateway.controller) from the acceptance
it observed: the request's degree and draft length are then upper bounds, and a plan may be a plain
step. Before it plans, the controller hears what the planner knows a decoder will propose
(known_coverage: the grammar's forced text, prompt lookup's repeats, the prediction's alignment);
it prices plans by a cost model refreshed from what the gateway's steps cost as they run
(gateway.step_costs). After a step it hears what the step's drafts earned and how loaded the
primary was. Its state is written to the state store with each step's tokens and restored with
them on a resume.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.acceptance_memory import AcceptanceMemory
from gateway.backends import Backends, ModelInfo
from gateway.config import GRAMMAR_MAX_SPELLINGS
from gateway.controller import (
    AdaptiveController,
    ControllerConfig,
    ControllerState,
    SpeculationPlan,
    infer_task_type,
)
from gateway.cost_model import CostModel, CostSettings, cost_model_for, one_row_ms
from gateway.dependencies import DependencyState
from gateway.params import GenerationParams, SpeculationParams
from gateway.stats import RequestStats
from gateway.step_costs import MeasuredOverheads, StepCosts
from specdec.acceptance_mode import AcceptanceMode
from specdec.candidates import CandidateOutcome, ranked_sources
from specdec.grammar import GrammarState
from specdec.model.tokenizer import Tokenizer
from specdec.prediction import LOST, PredictionAlignment
from specdec.repeats import MIN_REPEAT_TOKENS, RepeatIndex
from specdec.strategies import (
    FEATURE_STRATEGIES,
    GRAMMAR_STRATEGY,
    PREDICTION_STRATEGY,
    PROMPT_LOOKUP_STRATEGY,
    TREE_STRATEGIES,
)
from specdec.task_type import TaskType


def cycled_strategies(spec: SpeculationParams) -> tuple[str, ...]:
    """speculative_degree decoders cycling through the strategies; the r-th repeat of a strategy is
    its rank-r candidate. E.g. [prompt_lookup, suffix_index], degree 3 ->
    [prompt_lookup#0, suffix_index#0, prompt_lookup#1]. Grammar-forced drafts are spellings of the
    one forced text, so they leave the cycle after GRAMMAR_MAX_SPELLINGS rounds: [grammar,
    prompt_lookup], degree 5 -> [grammar#0, prompt_lookup#0, grammar#1, prompt_lookup#1,
    prompt_lookup#2]; [grammar] alone, degree 4 -> [grammar#0, grammar#1]."""
    repeatable = [s for s in spec.strategies if s != GRAMMAR_STRATEGY]
    num_spellings = GRAMMAR_MAX_SPELLINGS if GRAMMAR_STRATEGY in spec.strategies else 0
    if not repeatable:
        return (GRAMMAR_STRATEGY,) * min(num_spellings, spec.speculative_degree)
    rounds = (([GRAMMAR_STRATEGY] if r < num_spellings else []) + repeatable for r in itertools.count())
    return tuple(itertools.islice(itertools.chain.from_iterable(rounds), spec.speculative_degree))


def fixed_plan(spec: SpeculationParams, max_tree_nodes: int) -> SpeculationPlan:
    """The request's own settings, every step (speculation off: a plain step)."""
    if not spec.is_enabled:
        return SpeculationPlan()
    return SpeculationPlan(
        draft_length=spec.draft_length, sources=ranked_sources(cycled_strategies(spec)), max_tree_nodes=max_tree_nodes
    )


def within_room(plan: SpeculationPlan, room: int) -> SpeculationPlan:
    """plan with its tree no deeper than `room`: what the context has room for (the primary verifies
    a tree only when context + depth <= max_context) and what the request can still use (a step
    of d drafts gives up to d + 1 tokens). E.g. context 4089 of 4096, draft_length 16 -> 7; 3 tokens
    left to max_new_tokens -> 2; no room -> a plain step. Output is unchanged: the drafts only
    propose, the primary decides."""
    if not plan.is_speculative or plan.draft_length <= room:
        return plan
    return dataclasses.replace(plan, draft_length=room) if room >= 1 else SpeculationPlan()


def bounded_config(config: ControllerConfig, spec: SpeculationParams, max_tree_nodes: int) -> ControllerConfig:
    """The controller's settings within the request's bounds: at most speculative_degree candidates
    and draft_length tokens (itself a choice), at most max_tree_nodes nodes."""
    lengths = {g for g in config.draft_length_choices if g <= spec.draft_length} | {spec.draft_length}
    return dataclasses.replace(
        config,
        draft_length_choices=tuple(sorted(lengths)),
        max_speculative_degree=spec.speculative_degree,
        max_tree_nodes=min(config.max_tree_nodes, max_tree_nodes),
        probe_draft_length=min(config.probe_draft_length, spec.draft_length),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class StepRecord:
    """What a step ran, for the gateway's cost measurements (gateway.step_costs)."""

    is_speculative: bool
    forward_ms: float  # the primary's forward passes of the step
    num_rows: int  # speculative: the verify's rows; plain: the tokens of the run
    model_draft_ms: float = 0.0  # model-based decoders' own time (priced apart)


class StepPlanner:
    """One request's plans: the fixed plan, or the adaptive controller with its state; prompt
    lookup's repeat index and the prediction's alignment, which tell the controller what a decoder
    will propose; the gateway's step costs, which price its plans.

    The loop's objects it reads and never changes: `generated` (the committed output, growing as the
    loop commits), the prompt, the grammar at the end of the output; it counts in the loop's `stats`.
    `validator_state` is the request's node's: the loop sets another after a failover; `backends`
    are the node's when the request starts, whose load a new controller state starts from."""

    def __init__(
        self,
        params: GenerationParams,
        prompt_ids: Sequence[int],
        generated: Sequence[int],
        tokenizer: Tokenizer,
        model: ModelInfo,
        stats: RequestStats,
        log: Any,
        *,
        max_tree_nodes: int,
        acceptance_mode: AcceptanceMode,
        validator_state: DependencyState,
        backends: Backends,
        grammar: GrammarState | None = None,
        cost_model: CostModel | None = None,
        step_costs: StepCosts | None = None,
        controller_config: ControllerConfig | None = None,
        controller_state: Mapping[str, Any] | None = None,
        acceptance_memory: AcceptanceMemory | None = None,
        min_repeat_tokens: int = MIN_REPEAT_TOKENS,
        is_batched_plain: bool = False,
    ) -> None:
        self.params, self.prompt_ids, self.generated = params, prompt_ids, generated
        self.tokenizer, self.model, self.stats, self.log = tokenizer, model, stats, log
        self.max_tree_nodes, self.acceptance_mode = max_tree_nodes, acceptance_mode
        self.validator_state, self.grammar = validator_state, grammar
        # Whether the draft service's feature readers follow the context: the last step (or the prefill)
        # brought the primary's features of its committed rows (the loop sets it before each plan). A
        # feature drafter drafts from the last committed token's features, so after a step without them
        # (a plain step, a run, a verify that did not ask) it has nothing to propose: it is known silent
        # (known_coverage), and where the controller would draft with it, or have it ride along, were
        # its features current, the step asks for them (is_feature_wanted, the loop's _feature_request)
        # so that the next step can; if nothing else would draft, that step is one of its own that
        # brings them (a refresh, not counted against it: _observed_plan).
        self.are_features_current = True
        self.is_feature_wanted = False
        self._is_refreshing_features = False
        self._init_prediction()
        self.fixed_plan = fixed_plan(params.speculation, max_tree_nodes)
        # The gateway's measurements of what its steps cost (shared by its requests): each step of
        # this request adds to them (measure_step), and an adaptive one plans with them (plan).
        self.step_costs = step_costs
        # its runs send several steps a message (a client that waits for the whole answer): its plain
        # tokens cost less loop work than a streaming client's, measured apart (StepCosts)
        self.is_batched_plain = is_batched_plain
        self.measured_overheads: MeasuredOverheads | None = None  # what the controller's cost model holds
        self.base_cost_model = cost_model or cost_model_for(model.verify_costs_ms, CostSettings())
        self.one_row_ms = one_row_ms(model.verify_costs_ms)
        self._init_controller(controller_config, controller_state, acceptance_memory, backends)
        # Whether the context's tail repeats earlier text: where prompt lookup can pay (specdec.repeats);
        # min_repeat_tokens 0: prompt lookup is planned like any decoder, from its estimate alone.
        self.repeats = (
            RepeatIndex(prompt_ids, min_repeat_tokens)
            if self.controller is not None
            and min_repeat_tokens > 0
            and PROMPT_LOOKUP_STRATEGY in params.speculation.strategies
            else None
        )

    def _init_prediction(self) -> None:
        """The prediction's tokens go to the draft service when it opens the request; the planner
        aligns the output to them too: to tell the controller when the prediction decoder has nothing
        to propose (known_coverage), and to count the prediction's tokens the output has not used."""
        prediction = self.params.prediction
        self.prediction_ids: tuple[int, ...] = tuple(self.tokenizer.encode(prediction)) if prediction else ()
        self.prediction = PredictionAlignment(self.prediction_ids) if self.prediction_ids else None
        self.align_prediction(self.generated)

    def _init_controller(
        self,
        controller_config: ControllerConfig | None,
        controller_state: Mapping[str, Any] | None,
        acceptance_memory: AcceptanceMemory | None,
        backends: Backends,
    ) -> None:
        """An adaptive request's controller and its state (restored on a resume); None for a request
        with a fixed plan."""
        spec = self.params.speculation
        self.controller: AdaptiveController | None = None
        self.controller_state: ControllerState | None = None
        if spec.is_enabled and spec.is_adaptive:
            self.controller = AdaptiveController(
                self.base_cost_model,
                bounded_config(controller_config or ControllerConfig(), spec, self.max_tree_nodes),
                acceptance_memory,
            )
            self.controller_state = self._restore_controller(controller_state, backends)
            self.stats.task_type = self.controller_state.task_type.value

    def _restore_controller(self, stored: Mapping[str, Any] | None, backends: Backends) -> ControllerState:
        """The stored state of a resumed request, or a fresh one (task type given or inferred)."""
        spec = self.params.speculation
        decoders = Counter(cycled_strategies(spec))  # name -> ranks it may offer
        for name in TREE_STRATEGIES.intersection(spec.strategies):
            # a tree decoder's ranks are the leaves of one tree it grows per step: as many as the degree
            decoders[name] = max(decoders[name], spec.speculative_degree)
        if stored:
            try:
                state = ControllerState.from_dict(stored)
                if Counter(e.decoder for e in state.estimates) == decoders:
                    return state
                self.log.warning("stored controller state tracks other decoders; starting afresh")
            except ValueError as e:
                self.log.warning("stored controller state unreadable; starting afresh", error=str(e))
        assert self.controller is not None  # restored only for an adaptive request
        state = self.controller.new_state(
            self._requested_task_type()
            or infer_task_type(self.params.prompt_text(self.tokenizer), self.params.has_schema),
            decoders,
        )
        # starts from the primary's load as the last request to hear from it saw it
        state.other_rows = float(backends.other_step_rows)
        return state

    def _requested_task_type(self) -> TaskType | None:
        """A constrained output is a structured task whatever the request says; else its own, or None."""
        return TaskType.STRUCTURED if self.params.has_schema else self.params.speculation.task_type

    # --- before a step -------------------------------------------------------------------------

    def plan(self) -> SpeculationPlan:
        """What the next step drafts: the fixed plan or the controller's, a plain step while no
        validator can sample against a tree or score its draw on the raw rows, no deeper than the step
        can use (draft_room)."""
        self._refresh_cost_model()
        self.is_feature_wanted = self._is_refreshing_features = False
        room = self.draft_room()
        if room < 1:  # the step's own token is the request's last (or the context's): nothing to draft
            return SpeculationPlan()
        if self.controller is None:
            plan = self.fixed_plan
        else:
            known = self.known_coverage()
            plan = self._with_features_wanted(
                self._with_prediction(self.controller.plan(self._controller_state(), known)), known
            )
        if plan.is_speculative and self.waits_for_validator and not self.validator_state.is_retry_due():
            self.stats.num_validator_fallback_steps += 1
            return SpeculationPlan()  # no validator to sample against: the primary samples alone
        if plan.is_speculative and self._is_drawn_token_scored_on_processed_rows():
            return SpeculationPlan()  # the primary's plain step scores its token on the raw row
        return within_room(plan, room)

    def _is_drawn_token_scored_on_processed_rows(self) -> bool:
        """Whether a speculative step would score its drawn token on other rows than the log
        probabilities are of (specdec.logprobs: the raw row). At temperature > 0 the validator draws a
        step's last token and scores it on the rows the primary sent, which are processed (penalties,
        logit_bias, min_tokens still ahead: specdec.penalties) when the primary's sampling for the step
        has any; the primary's plain steps score every token on its raw row, so with speculation on or
        off the values are the same. At temperature 0 (greedy or threshold) the last token is the row's
        argmax, which the primary scores on its raw row (gateway.step_validation.path_logprobs)."""
        if self.params.logprobs is None or self.params.sampling.is_greedy:
            return False
        end_token_ids = self.params.end_token_ids(self.model.eos_token_ids)
        return self.params.sampling.holding_back(end_token_ids, len(self.generated)).has_penalties

    def draft_room(self) -> int:
        """The most draft tokens the next step can use: the context's room for its tree, and the
        tokens the request may still generate less the step's own."""
        return min(
            self.model.max_context - len(self.prompt_ids) - len(self.generated),
            self.params.max_new_tokens - len(self.generated) - 1,
        )

    def features_missed(self) -> None:
        """The step was planned on features the last call did not bring (a prefill that computed no
        row: the whole prompt was cached): its feature readers are silent this step, which is not
        counted against them, as a refresh's (_observed_plan)."""
        self.are_features_current = False
        self._is_refreshing_features = True

    def _with_features_wanted(self, plan: SpeculationPlan, known: dict[tuple[str, int], float]) -> SpeculationPlan:
        """Where the feature readers' features are not current but the controller would draft with one
        (or have it ride along) were they (`known`, the step's known coverage, without their silence):
        the plan asks for them (is_feature_wanted); a plain plan becomes a step of the reader alone,
        which proposes nothing and brings them (a refresh)."""
        state = self._controller_state()
        readers = [e.decoder for e in state.estimates if e.decoder in FEATURE_STRATEGIES and e.rank == 0]
        if self.are_features_current or not readers:
            return plan
        assert self.controller is not None
        live = {key: coverage for key, coverage in known.items() if key[0] not in FEATURE_STRATEGIES}
        self.is_feature_wanted = self.controller.would_draft_with(state, live, FEATURE_STRATEGIES)
        if not self.is_feature_wanted or plan.is_speculative:
            return plan
        self._is_refreshing_features = True
        return SpeculationPlan(draft_length=1, sources=((readers[0], 0),), max_tree_nodes=1)

    def _refresh_cost_model(self) -> None:
        """A new cost model for the controller (and its remembered choices dropped) only when a
        measured cost moved."""
        if self.controller is None or self.step_costs is None:
            return
        measured = self.step_costs.overheads(self.is_batched_plain, self.waits_for_validator)
        if measured != self.measured_overheads:
            self.measured_overheads = measured
            self.controller.set_cost_model(self.step_costs.cost_model(self.base_cost_model, self.one_row_ms, measured))

    def tail_repeats(self) -> bool:
        """Whether the context's last tokens occurred earlier (specdec.repeats), the index brought up to
        the output so far."""
        assert self.repeats is not None
        done = len(self.repeats) - len(self.prompt_ids)
        self.repeats.extend(self.generated[done:])
        return self.repeats.tail_repeats()

    def _with_prediction(self, plan: SpeculationPlan) -> SpeculationPlan:
        """A speculative plan with the request's prediction in it, first, whenever the output follows
        the prediction: the user supplied it and it costs nothing to draft, while the controller,
        pricing each decoder's nodes apart, may leave it out for another decoder that drafts the same
        tokens (the suffix index after a repeated request). At the degree bound it takes the last
        source's place. Not where the request drafts without the decoder (a draft pool that does not
        offer it, gateway.params): the pool could not draft it, nor the controller learn from it."""
        key = (PREDICTION_STRATEGY, 0)
        if self.prediction is None or not plan.is_speculative or key in plan.sources:
            return plan
        if PREDICTION_STRATEGY not in self.params.speculation.strategies:
            return plan
        position = self.prediction.next_position
        if position == LOST or position >= len(self.prediction_ids):
            return plan
        degree = max(1, plan.speculative_degree)
        return dataclasses.replace(plan, sources=(key, *plan.sources)[:degree])

    def known_coverage(self) -> dict[tuple[str, int], float]:
        """What the planner knows a decoder will propose this step, before the controller plans
        (AdaptiveController.plan): grammar-forced drafts nothing where the grammar forces no text next
        (free text, a choice between values); prompt lookup nothing worth a step where the context's
        tail does not repeat earlier text (specdec.repeats: its 1- and 2-token matches); a feature
        reader nothing while its features are not current (are_features_current); the prediction
        decoder, which follows the same alignment as the planner's, nothing while the output does not
        follow the prediction (or it is used up), and surely while it does."""
        known: dict[tuple[str, int], float] = {}
        estimates = self._controller_state().estimates
        silent: set[str] = set()
        if not self.are_features_current:
            silent |= FEATURE_STRATEGIES
        if self.grammar is not None and not self.grammar.forced_text():
            silent.add(GRAMMAR_STRATEGY)
        if self.repeats is not None and not self.tail_repeats():
            silent.add(PROMPT_LOOKUP_STRATEGY)
        known.update({(e.decoder, e.rank): 0.0 for e in estimates if e.decoder in silent})
        if self.prediction is not None:
            position = self.prediction.next_position
            is_proposing = position != LOST and position < len(self.prediction_ids)
            known.update(
                {
                    (e.decoder, e.rank): 1.0 if is_proposing and e.rank == 0 else 0.0  # one candidate at most
                    for e in estimates
                    if e.decoder == PREDICTION_STRATEGY
                }
            )
        return known

    def _controller_state(self) -> ControllerState:
        assert self.controller_state is not None  # set with the controller
        return self.controller_state

    # --- after a step --------------------------------------------------------------------------

    def align_prediction(self, new_tokens: Sequence[int]) -> None:
        """The committed tokens to the prediction's alignment; the prediction's tokens the output has
        not used so far (OpenAI's rejected_prediction_tokens, counted by specdec.prediction)."""
        if self.prediction is None:
            return
        self.prediction.add(new_tokens)
        self.stats.num_rejected_prediction_tokens = len(self.prediction_ids) - self.prediction.num_matched

    def observe(self, plan: SpeculationPlan, outcomes: list[CandidateOutcome] | None, num_steps: int = 1) -> None:
        """Count the step's choice; tell the controller what its drafts earned (None: no drafts ran; then
        `num_steps` plain steps, a run's message)."""
        assert num_steps == 1 or outcomes is None, "several steps at once are plain ones"
        self.stats.add_plan(plan.draft_length, plan.speculative_degree, plan.is_probe, num_steps)
        if self.controller is not None:
            refreshed = self._is_refreshing_features and outcomes is not None
            self.controller.observe(
                self._controller_state(),
                self._observed_plan(plan) if outcomes is not None else SpeculationPlan(),
                [o for o in outcomes or () if not (refreshed and o.decoder in FEATURE_STRATEGIES)],
                num_steps,
            )

    def _observed_plan(self, plan: SpeculationPlan) -> SpeculationPlan:
        """The step's plan as the controller learns from it: a refresh step (_with_features_wanted) as a
        plain one, its reader having proposed nothing that says anything of its drafts."""
        if not self._is_refreshing_features:
            return plan
        sources = tuple(source for source in plan.sources if source[0] not in FEATURE_STRATEGIES)
        return dataclasses.replace(plan, sources=sources) if sources else SpeculationPlan()

    def observe_load(self, other_rows: int) -> None:
        """Tell the controller how many rows the primary's step carried besides this request's: under
        load a draft row costs another request's token (AdaptiveController.observe_load)."""
        if self.controller is not None:
            self.controller.observe_load(self._controller_state(), other_rows)

    @property
    def waits_for_validator(self) -> bool:
        """Whether this request's speculative steps wait for the validator's decision before they
        commit (a sampling or threshold rule), where a greedy step has it confirmed beside the next
        (gateway.step_validation): the kind of step whose overhead prices its plans (gateway.step_costs)."""
        return self.acceptance_mode != AcceptanceMode.GREEDY

    def measure_step(self, record: StepRecord | None, wall_ms: float) -> None:
        """Add the step that just ended to the gateway's cost measurements (gateway.step_costs):
        its wall time from its start to the next one's, the previous step's write and check included."""
        if record is None or self.step_costs is None:
            return  # nothing undisturbed ran: a recovery, a dependency down, a dropped tree
        if record.is_speculative:
            self.step_costs.observe_speculative(
                wall_ms,
                record.forward_ms,
                record.model_draft_ms,
                record.num_rows,
                self.base_cost_model,
                self.waits_for_validator,
            )
        else:
            self.step_costs.observe_plain(
                wall_ms, record.forward_ms, record.num_rows, self.base_cost_model, self.is_batched_plain
            )
