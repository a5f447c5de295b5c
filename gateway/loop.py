"""The per-request loop: propose -> verify -> validate -> commit, until a stop condition.

One step, speculative:
    tree      = draft.Propose(tokens committed since the last step)
    logits    = primary.Verify(commit of the last step, tree)      # ONE forward over the tree
    accepted  = validator.Validate(tree, logits)                   # path + bonus token
    committed = [tree tokens on the accepted path] + [bonus]
    state store: append committed tokens, stats                    # one round trip, beside the next step
The primary learns the commit at the start of the next Verify (no extra RPC). With
speculation off a step is one engine step of a plain run the primary streams (primary.DecodeStream:
a token per message as each engine step decides it), the baseline the speedup is measured against;
the runs, how long each is and where it stops, are the loop's DecodeRuns' (gateway.decode_run).
Off the step's path: the state store's write, and in greedy mode the validator's Validate (its rule
walks the primary's argmaxes, which the loop has: it goes on with that decision and the validator
confirms it). Both run beside the next step, whose RPC goes out first; the step's tokens reach the
client only once confirmed and stored (RequestLoop.run). The step's acceptance (Validate, that
greedy check, the fallback while the validator is away) is the loop's StepValidator's
(gateway.step_validation). Where the tokens end (an end-of-sequence token, a length limit, a stop
string) and their text (detokenized, cut at the stop strings, a tail that may become one held back)
are the loop's Output's (gateway.output).
A lookahead decoder's rows (Propose's `lookahead`) ride in the Verify beside the tree; the
primary's argmaxes there go back to the draft service with the next Propose. They are never
validated: the acceptance rule sees the tree alone.

What a step drafts is a SpeculationPlan: fixed by the request (its strategies cycled to
speculative_degree, its draft_length), or, when adaptive, chosen before every step by the
controller from the acceptance it observed (the request's degree and draft length are then upper
bounds, and a plan may be a plain step). The draft service hears every committed token at its
next Propose, however many plain steps came between; the controller's state is written to the
state store with each step's tokens and restored with them. The plans, the controller and what it
learns from each step's outcome and cost are the loop's StepPlanner's (gateway.step_planner).

Recovery: the committed tokens are in the state store after every step. If the primary
restarts, its Verify answers NOT_FOUND (or UNAVAILABLE while it is down): the loop waits for
it, re-prefills prompt + committed tokens, and goes on; greedy output is unchanged. The primary's
calls, with those retries, the failover to another node and the request's deadline, are the
loop's PrimaryCalls' (gateway.primary_calls); the loop supplies the prefill and the switch of node.
Cancellation and deadlines are checked once per step, so they stop a request within a step.
If the state store loses the request's record (a Redis restarted without persistence) while the loop
runs, the loop writes the whole state back from its memory and goes on; a store that refuses that too
ends the request UNAVAILABLE, naming the lost state. What the loop writes to the store, with its
retries and repairs, is its RequestRecord's (gateway.request_record).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import threading
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence

import structlog

from gateway.backends import (
    Backends,
    DraftTree,
    ModelInfo,
    Validation,
    Verified,
    features_of_rows,
)
from gateway.call_deadlines import CallDeadlines
from gateway.controller import ControllerConfig, SpeculationPlan
from gateway.acceptance_memory import AcceptanceMemory
from gateway.decode_run import DecodeRuns, RunStart
from gateway.cost_model import CostModel
from gateway.dependencies import DependencyState
from gateway.draft_calls import DraftCalls
from gateway.node_pool import Node
from gateway.output import FINISH_EOS, FINISH_STOP, Output
from gateway.params import GenerationParams
from gateway.primary_calls import PrimaryCalls
from specdec.repeats import MIN_REPEAT_TOKENS
from gateway.request_record import DEFAULT_STATS_INTERVAL_S, RequestRecord
from gateway.state_retry import DEFAULT_MAX_STATE_RETRY_S
from gateway.stats import RequestStats
from gateway.step_costs import StepCosts
from gateway.step_planner import StepPlanner, StepRecord
from gateway.step_validation import StepValidator, path_logprobs
from specdec.acceptance_mode import AcceptanceMode, select_mode
from specdec.candidates import (
    CandidateOutcome,
    candidate_outcomes,
    depth_outcomes,
    stats_name,
)
from specdec.errors import Cancelled, DeadlineExceeded, FailedPrecondition
from specdec.grammar import GrammarState
from specdec.logits_codec import FORMAT_FP32
from specdec.logprobs import TokenLogprob
from specdec.model.tokenizer import Tokenizer
from specdec.engine.tree import chain_parents
from specdec.sampling import SamplingParams
from specdec.state_store import AsyncStateStore, RequestStatus
from specdec.strategies import (
    MODEL,
    PREDICTION_STRATEGY,
    PROMPT_LOOKUP_STRATEGY,
    consumes_features,
    names_of,
)

FINISH_CANCELLED, FINISH_DEADLINE, FINISH_ERROR = "cancelled", "deadline", "error"
# Grammar-forced tokens committed after one step at most: a bound on the mask queries per step and on
# the chain the primary runs in front of the next tree (JSON's forced runs are a few tokens).
MAX_FORCED_TOKENS = 32
# Tokens a Propose asks each model-free decoder for past the step's draft (ProposeRequest.
# continuation_length): when a step accepts a candidate's whole draft and the bonus token is the
# first of them, the next step drafts the rest without asking the draft service (the round trip
# costs as much as the pool's work many times over on a CPU); the service hears those tokens at its
# next Propose. At least the step's draft length, so that a carried step drafts as long as a proposed
# one: a prediction's 32-token drafts, accepted whole, would otherwise alternate with 16-token ones.
CONTINUATION_TOKENS = 16
# How often a request's own prefill, which may wait at the primary for KV room up to its call's deadline,
# looks at the request's cancel (a threading.Event, set by Cancel or by the client's going away).
PREFILL_CANCEL_POLL_S = 0.05


def continuation_after(tree: DraftTree, v: Validation) -> tuple[str, tuple[int, ...]] | None:
    """(decoder, tokens) the next step can draft without a Propose: the continuation of the node
    where the accepted path ends, past the bonus token, when the bonus token is its first."""
    if not v.accepted_nodes:
        return None
    leaf = v.accepted_nodes[-1]
    for node, decoder, tokens in tree.continuations:
        if node == leaf and len(tokens) > 1 and tokens[0] == v.bonus_token:
            return decoder, tokens[1:]
    return None


MODEL_DECODERS = frozenset(names_of(MODEL))
# GenerationStats.decoders' row of the drafts the primary's runs make themselves (gateway.decode_run)
RUN_LOOKUP_STATS = PROMPT_LOOKUP_STRATEGY + "@run"
RUN_ANSWERS_STATS = "answers@run"  # a run's drafts from the model's own answers (the primary's --run_answers)


@dataclasses.dataclass(slots=True)
class StepOutput:
    token_ids: list[int]  # tokens committed by this step (after stop handling)
    text: str  # text that became final with them (stop strings held back)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # one per token, when asked


@dataclasses.dataclass(slots=True)
class RequestOutcome:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats
    # When asked: one per token this loop generated (a resumed request's earlier tokens have none), and
    # the prompt's tokens 1.. (GenerateRequest.logprobs)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class _PendingStep:
    """A committed step whose validator check (greedy steps) and state store write are still to come
    (RequestLoop._commit). They are started (start()) only after the next step's task: that step's
    RPC goes out first, and their own Python work runs while the primary computes."""

    check_call: Coroutine[Any, Any, None] | None  # the validator confirming a greedy step (StepValidator)
    write_call: Callable[[asyncio.Future | None], Coroutine[Any, Any, bool]]  # the write, after the check
    output: StepOutput | None  # what the client gets once it is stored
    num_chars: int  # len(text) before the step
    num_stored: int  # len(generated) before the step
    is_stopped: bool  # the step completed a stop string
    check: asyncio.Future | None = None
    write: asyncio.Future | None = None  # -> bool: stored (False: refused, the request ended elsewhere)

    def start(self) -> None:
        if self.write is None:
            self.check = None if self.check_call is None else asyncio.ensure_future(self.check_call)
            self.write = asyncio.ensure_future(self.write_call(self.check))

    def discard(self) -> None:
        """Never started (the loop is leaving): close the check's coroutine unrun."""
        if self.write is None and self.check_call is not None:
            self.check_call.close()


async def _cancelled(task: asyncio.Future | None) -> None:
    """Cancel a task and wait until it is over, whatever it raised."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


class RequestLoop:
    def __init__(
        self,
        request_id: str,
        params: GenerationParams,
        prompt_ids: Sequence[int],
        backends: Backends,
        store: AsyncStateStore,
        tokenizer: Tokenizer,
        model: ModelInfo,
        logits_formats: tuple[str, str],
        recovery_timeout_s: float,
        max_tree_nodes: int,
        cancel: threading.Event,
        owner: str,
        deadline: float | None = None,
        generated: Sequence[int] = (),
        stats: RequestStats | None = None,
        *,
        cost_model: CostModel | None = None,
        controller_config: ControllerConfig | None = None,
        controller_state: Mapping[str, Any] | None = None,
        grammar: GrammarState | None = None,
        validator_state: DependencyState | None = None,
        draft_state: DependencyState | None = None,
        call_deadlines: CallDeadlines | None = None,
        max_state_retry_s: float = DEFAULT_MAX_STATE_RETRY_S,
        stats_interval_s: float = DEFAULT_STATS_INTERVAL_S,
        decode_run_max: int | None = None,
        stored_params: Mapping[str, Any] | None = None,
        step_costs: StepCosts | None = None,
        acceptance_memory: AcceptanceMemory | None = None,
        min_repeat_tokens: int = MIN_REPEAT_TOKENS,
        is_run_drafting: bool = True,
        steps_per_message: int = 1,
        node_id: str = "",
        failover: Callable[[str, str], Awaitable[Node | None]] | None = None,
        node: Node | None = None,
    ) -> None:
        self.request_id, self.params, self.prompt_ids = request_id, params, list(prompt_ids)
        self.backends, self.tokenizer, self.model = backends, tokenizer, model
        self.cancel, self.deadline, self.max_tree_nodes = cancel, deadline, max_tree_nodes
        self.log = structlog.get_logger("gateway.loop").bind(request_id=request_id)
        self._init_output(generated, stats)
        self._init_record(store, owner, stored_params, max_state_retry_s, node_id, stats_interval_s)
        self._init_primary_calls(recovery_timeout_s, failover)
        self._init_step_state()
        self._init_calls(validator_state, draft_state, call_deadlines)
        self._init_constraints(grammar)
        self._init_planning(logits_formats)
        self._init_planner(
            cost_model,
            step_costs,
            controller_config,
            controller_state,
            acceptance_memory,
            min_repeat_tokens,
            is_batched_plain=steps_per_message > 1,
        )
        self._init_runs(decode_run_max, is_run_drafting, steps_per_message)
        self._init_nodes(node)

    def _init_nodes(self, node: Node | None) -> None:
        """`node`: the node it runs on (with --nodes), held (Node.hold) until the request ends, as is
        every node it fails over to."""
        self.held_nodes: list[Node] = []  # the nodes whose backends it uses, let go at its end (_finish)
        if node is not None:
            self._hold(node)

    def _hold(self, node: Node) -> None:
        if not any(n is node for n in self.held_nodes):
            node.hold()
            self.held_nodes.append(node)

    @property
    def node_id(self) -> str:
        """The node the request runs on (gateway.nodes; "" with a single node): its record's."""
        return self.record.node_id

    def _init_output(self, generated: Sequence[int], stats: RequestStats | None) -> None:
        """The output so far (a resumed request's, else none), its text and where it ends
        (gateway.output), stats and log probabilities."""
        self.generated: list[int] = list(generated)
        self.stats = stats or RequestStats(num_prompt_tokens=len(self.prompt_ids))
        # the tokens that end the output (the model's end-of-sequence ones unless ignore_eos, and the
        # request's stop_token_ids): the output stops before them, and so do the primary's runs
        self.eos = set(self.params.end_token_ids(self.model.eos_token_ids))
        self.output = Output(
            self.tokenizer,
            self.generated,
            eos=self.eos,
            stop=self.params.stop,
            stop_token_ids=frozenset(self.params.stop_token_ids),
            max_new_tokens=self.params.max_new_tokens,
            num_prompt_tokens=len(self.prompt_ids),
            max_context=self.model.max_context,
            min_tokens=self.params.sampling.min_tokens,
        )
        self.is_refused = False  # the store refused a step: the output ends before it
        # Log probabilities (params.logprobs): output_logprobs[i] belongs to generated[num_unscored + i];
        # the tokens before were generated by an earlier gateway (a resumed request) and have none here.
        self.output_logprobs: list[TokenLogprob] = []
        self.num_unscored = len(self.generated)
        self.prompt_logprobs: list[TokenLogprob] = []

    def _init_record(
        self,
        store: AsyncStateStore,
        owner: str,
        stored_params: Mapping[str, Any] | None,
        max_state_retry_s: float,
        node_id: str,
        stats_interval_s: float,
    ) -> None:
        """The request's record in the state store (gateway.request_record): each step's write, the
        end, and the repairs of a record the store lost, written back from self.generated."""
        self.record = RequestRecord(
            store,
            self.request_id,
            owner,
            self.prompt_ids,
            self.generated,
            self.cancel,
            self.log,
            deadline=self.deadline,
            stored_params=stored_params,
            max_retry_s=max_state_retry_s,
            node_id=node_id,
            snapshot=self._stored_state,
            stats_interval_s=stats_interval_s,
        )

    def _init_primary_calls(
        self, recovery_timeout_s: float, failover: Callable[[str, str], Awaitable[Node | None]] | None
    ) -> None:
        """The primary's calls, carried through its restarts and failovers (gateway.primary_calls)."""
        self.left_backends: list[Backends] = []  # the nodes' backends it failed over from
        self.primary_calls = PrimaryCalls(
            self.record,
            self._prefill_context,
            self._move_to,
            cancel=self.cancel,
            log=self.log,
            recovery_timeout_s=recovery_timeout_s,
            deadline=self.deadline,
            failover=failover,
        )

    def _stored_state(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The stats and controller state as the state store keeps them."""
        state = self.planner.controller_state
        return self.stats.to_dict(), None if state is None else state.to_dict()

    def _init_step_state(self) -> None:
        """What passes from one step to the next: what the services still have to learn, a carried
        draft."""
        # What the primary / draft service still has to learn (piggybacked on the next call).
        self.pending_accepted: tuple[int, ...] = ()
        self.pending_committed: list[int] = []
        # With a strategy that reads them, the primary returns its features on every Prefill and Verify;
        # the latest step's rows of committed tokens go to the next Propose (DraftCalls.pending_features).
        self.is_feature_consumer = consumes_features(self.params.speculation.strategies)
        # (decoder, tokens): what the last step's accepted candidate proposed past its draft and bonus
        self.carry: tuple[str, tuple[int, ...]] | None = None
        self.step_engine_steps = 1  # the engine steps of the step being computed (a run's message may carry several)
        self.grammar_preparation: asyncio.Future | None = None  # the draft pool compiling the response format
        # The first step's plan, made before the prefill answers, and its Propose begun beside the
        # prefill where the plan drafts without the prefill's features (_open_first_step)
        self.opening: tuple[SpeculationPlan, asyncio.Future | None] | None = None

    def _init_calls(
        self,
        validator_state: DependencyState | None,
        draft_state: DependencyState | None,
        call_deadlines: CallDeadlines | None,
    ) -> None:
        # Shared by the gateway's requests: whether the validator and the draft service answer.
        self.validator_state = validator_state or DependencyState("validator")
        # The validator's and the draft pool's calls end at a deadline from their recent latency: a
        # hung one fails like a dead one (gateway.call_deadlines).
        self.call_deadlines = call_deadlines or CallDeadlines()
        self.draft = DraftCalls(
            self.request_id,
            self.prompt_ids,
            self.generated,
            self.backends,
            draft_state or DependencyState("draft"),
            self.call_deadlines,
            self._remaining_s,
        )

    def _init_constraints(self, grammar: GrammarState | None) -> None:
        # The response format's grammar, at the end of the committed output (replayed on a resume).
        self.grammar = grammar
        if grammar is not None and not grammar.accept_tokens(self.generated):
            raise FailedPrecondition("response_format", "the stored output does not follow the request's grammar")

    def _init_planning(self, logits_formats: tuple[str, str]) -> None:
        """How steps are decided: the acceptance rule and the logits' formats."""
        self.greedy_format, self.sample_format = logits_formats
        # The acceptance rule, decided here once for the request and sent on every Validate.
        self.acceptance_mode = select_mode(self.params.sampling, self.params.speculation.acceptance_threshold)
        self.step_record: StepRecord | None = None  # the step being computed, once it ran undisturbed
        self._init_validation()

    def _init_validation(self) -> None:
        """The steps' acceptance on the validator, under the request's rule (gateway.step_validation)."""
        self.validation = StepValidator(
            self.request_id,
            self.params,
            self.backends,
            self.validator_state,
            self.call_deadlines,
            self.stats,
            acceptance_mode=self.acceptance_mode,
            is_bonus_scored=self._is_bonus_scored(),
            deadline=self.deadline,
        )

    def _init_planner(
        self,
        cost_model: CostModel | None,
        step_costs: StepCosts | None,
        controller_config: ControllerConfig | None,
        controller_state: Mapping[str, Any] | None,
        acceptance_memory: AcceptanceMemory | None,
        min_repeat_tokens: int,
        is_batched_plain: bool,
    ) -> None:
        """What each step drafts (gateway.step_planner): the request's fixed plan, or an adaptive
        request's controller, its state (restored on a resume) and prompt lookup's repeat index; and
        the gateway's cost measurements, which each step adds to (`is_batched_plain`: its runs send
        several steps a message)."""
        self.planner = StepPlanner(
            self.params,
            self.prompt_ids,
            self.generated,
            self.tokenizer,
            self.model,
            self.stats,
            self.log,
            max_tree_nodes=self.max_tree_nodes,
            acceptance_mode=self.acceptance_mode,
            validator_state=self.validator_state,
            backends=self.backends,
            grammar=self.grammar,
            cost_model=cost_model,
            step_costs=step_costs,
            controller_config=controller_config,
            controller_state=controller_state,
            acceptance_memory=acceptance_memory,
            min_repeat_tokens=min_repeat_tokens,
            is_batched_plain=is_batched_plain,
        )

    def _init_runs(self, decode_run_max: int | None, is_run_drafting: bool, steps_per_message: int) -> None:
        """The primary's streamed runs of plain steps (gateway.decode_run): one open at a time, each
        opened from the request's state then (_run_start), each message of up to `steps_per_message`
        engine steps after a run's first."""
        self.runs = DecodeRuns(
            self.request_id,
            self.params,
            self._run_start,
            num_prompt_tokens=len(self.prompt_ids),
            max_context=self.model.max_context,
            eos=self.eos,
            grammar=self.grammar,
            logprobs_request=self._logprobs_request(),
            decode_run_max=decode_run_max,
            is_run_drafting=is_run_drafting,
            steps_per_message=steps_per_message,
            repeats=self.planner.repeats,
            controller=self.planner.controller,
            controller_state=self.planner.controller_state,
            known_coverage=self.planner.known_coverage,
        )

    def _run_start(self) -> RunStart:
        """What a run opened now starts from: the last step's commit, which its call carries."""
        return RunStart(
            self.backends,
            self.pending_accepted,
            self.pending_committed,
            len(self.generated),
            self.validator_state.is_up,
        )

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> AsyncIterator[StepOutput]:
        """Yield each step's committed tokens and final text; the outcome is in `self.outcome` at the end.

        A step's tokens reach the client only once the state store holds them, but the loop does not
        wait for the write before it computes the next step: the store's round trip runs beside the
        next step's draft and forward (_PendingStep), and the step's output is yielded when the write
        is in, usually long before that next step ends."""
        start = time.perf_counter()
        # a resumed request's output may be whole already: then only its end is stored
        finish: str | None = self.output.resumed_finish(len(self.generated)) if self.generated else None
        pending: _PendingStep | None = None
        step: asyncio.Future | None = None
        step_start, step_end = 0.0, [0.0]

        def mark_end(_: asyncio.Future) -> None:
            step_end[0] = time.perf_counter()

        try:
            if finish is None:
                await self._open()
            while True:
                if finish is None:
                    finish = self._stop_signal()
                if finish is None:
                    step_start = time.perf_counter()
                    step = asyncio.ensure_future(self._compute())
                    step.add_done_callback(mark_end)
                if pending is not None:
                    if not await self._land(pending, step, step_end):
                        # refused: cancelled from elsewhere; the step leaves the output
                        self._unstore(pending)
                        await _cancelled(step)
                        self.validation.drop_check()
                        step, finish = None, FINISH_CANCELLED
                    elif pending.output is not None:
                        yield pending.output
                    pending = None
                if step is None:
                    break
                plan, new_tokens, outcomes, step_logprobs = await step
                step = None
                pending, finish = self._commit_step(plan, new_tokens, outcomes, step_logprobs, step_start)
        except GeneratorExit:
            # The consumer closed the stream: its client cancelled, went away or ran out of time.
            await self._settle(step, pending)
            await self._finish(self._stop_signal() or FINISH_CANCELLED)
            raise
        except BaseException as e:
            await self._settle(step, pending)
            if not self._is_cut_short_by_cancel(e, pending):
                await self._end_on_error(e)
                raise
            finish = FINISH_CANCELLED
        assert finish is not None  # the loop ends only with one
        tail = await self._conclude(finish)
        if tail:
            yield StepOutput([], tail)
        self._log_finished(finish, start)

    def _log_finished(self, finish: str, start: float) -> None:
        self.log.info(
            "request finished",
            finish_reason=finish,
            num_tokens=len(self.generated),
            steps=self.stats.num_steps,
            wall_ms=round((time.perf_counter() - start) * 1000, 1),
        )

    async def _land(self, pending: _PendingStep, step: asyncio.Future | None, step_end: list[float]) -> bool:
        """Start the last step's check and write (after the next step's RPC went out) and wait for them,
        booking the time they held the loop up; whether the store took the step."""
        pending.start()
        assert pending.write is not None
        if pending.check is not None:
            t = time.perf_counter()
            await pending.check
            self._book_wait("validate", t, step, step_end[0])
        t = time.perf_counter()
        is_stored = await pending.write
        self._book_wait("state", t, step, step_end[0])
        return is_stored

    def _commit_step(
        self,
        plan: SpeculationPlan,
        new_tokens: list[int],
        outcomes: list[CandidateOutcome] | None,
        step_logprobs: list[TokenLogprob],
        step_start: float,
    ) -> tuple[_PendingStep, str | None]:
        """A computed step's tokens, grammar-forced ones added and cut at a stop, committed (their
        write pending) and counted; the finish reason when the step ends the request."""
        num_chosen = len(new_tokens)  # drafted, verified or decoded; the grammar forces the rest
        new_tokens += self._forced_after(new_tokens)
        # one engine step, speculative or plain (a plain one's drafts, DecodeRuns._run_lookup_length, are its
        # own), or a run's message of several plain ones
        num_engine_steps, self.step_engine_steps = self.step_engine_steps, 1
        self.planner.observe(plan, outcomes, num_engine_steps)
        kept, finish = self.output.truncate(new_tokens, len(self.generated))
        self.stats.num_steps += num_engine_steps
        self.stats.num_generated_tokens += len(kept)
        pending = self._commit(
            kept,
            is_final=finish is not None,
            num_forced=max(0, len(kept) - num_chosen),
            logprobs=step_logprobs,
            has_end_token=finish in (FINISH_EOS, FINISH_STOP),  # truncate's: a stop token ended it
        )
        if pending.is_stopped:
            finish = FINISH_STOP
        wall_ms = (time.perf_counter() - step_start) * 1000
        self.stats.total_ms += wall_ms
        record, self.step_record = self.step_record, None
        self.planner.measure_step(record, wall_ms)
        return pending, finish

    def _is_cut_short_by_cancel(self, error: BaseException, pending: _PendingStep | None) -> bool:
        """Whether the request's open or step ended on its own cancel (Cancelled while it is set: a
        wait for its primary, busy or unavailable, PrimaryCalls): the request then ends as a cancel seen between
        steps ends it (stored CANCELLED, finish reason "cancelled", no error for its client), not as
        failed. Only where no step's write was in flight (`pending`), whose tokens would be stored
        unsent."""
        return isinstance(error, Cancelled) and pending is None and self._stop_signal() == FINISH_CANCELLED

    async def _end_on_error(self, error: BaseException) -> None:
        """Store the end of a request its loop left on an error."""
        stop = self._stop_signal()
        if isinstance(error, DeadlineExceeded) and stop is not None:
            # its own deadline passed in a call (a hung primary), or its client went away then
            await self._finish(stop)
        else:
            await self._finish(FINISH_ERROR, error=f"{type(error).__name__}: {error}")

    async def _conclude(self, finish: str) -> str:
        """The request's end stored and its outcome set; the text that became final at the end (what
        the detokenizer and the stop strings held back)."""
        # a stop token ends the text as an end-of-sequence token does: a character it cut short is
        # flushed (U+FFFD, as a decode of the stored tokens gives); a stop string's cut is not
        tail = self.output.end(is_flushed=not self.output.is_stopped and not self.is_refused)
        await self._finish(finish)
        self.outcome = RequestOutcome(
            self.generated, self.output.text, finish, self.stats, self.output_logprobs, self.prompt_logprobs
        )
        return tail

    async def _compute(
        self,
    ) -> tuple[SpeculationPlan, list[int], list[CandidateOutcome] | None, list[TokenLogprob]]:
        """A step up to its new tokens: the plan, then propose -> verify -> validate, or one decode;
        with the tokens' log probabilities when the request asks for them (else [])."""
        if self.runs.is_open:  # a streamed run goes on: its next engine step, as planned
            tokens, logprobs = await self._plain_step()
            return self.runs.plan, tokens, None, logprobs
        if self.runs.was_stopping_at_repeat():  # the last run ended: where a copy starts, or at its length
            self.stats.num_runs_ended_at_repeat += self.planner.tail_repeats()
        opening, self.opening = self.opening, None
        if opening is None:
            self.planner.are_features_current = self.draft.pending_features is not None
            plan, proposal = self.planner.plan(), None
        else:
            plan, proposal = opening
            if self.draft.pending_features is None and self.planner.are_features_current:
                self.planner.features_missed()  # planned on features the prefill did not bring
        if plan.is_speculative:
            return await self._speculative_step(plan, proposal)
        self.runs.plan = plan
        tokens, logprobs = await self._plain_step()
        return plan, tokens, None, logprobs

    async def _settle(self, step: asyncio.Future | None, pending: _PendingStep | None) -> None:
        """On the way out: stop a step being computed, and let a write in flight land before the
        request's end is written (a write is one round trip; its outcome no longer matters)."""
        await _cancelled(step)
        self.validation.drop_check()  # made by a step that never reached its commit
        if pending is None:
            return
        if pending.write is None:
            pending.discard()
            return
        with contextlib.suppress(BaseException):
            await asyncio.shield(pending.write)

    def _book_wait(self, stage: str, wait_start: float, step: asyncio.Future | None, step_end: float) -> None:
        """Book as `stage` the time the loop was held up by a step's validation or write: the part the
        next step's work did not cover (from when that step was done, or all of it when no step
        follows; the latter also counts in the total, the former is inside the next step's)."""
        now = time.perf_counter()
        if step is None:
            held = now - wait_start
            self.stats.total_ms += held * 1000
        else:
            held = now - max(wait_start, step_end) if step.done() else 0.0
        self.stats.stage_ms[stage] += held * 1000

    def _remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _stop_signal(self) -> str | None:
        if self.cancel.is_set():
            return FINISH_CANCELLED
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return FINISH_DEADLINE
        return None

    # --- steps ---------------------------------------------------------------------------------

    def _prepare_draft_grammar(self) -> asyncio.Future | None:
        """The draft pool's compile of the request's response format, begun beside the prefill so that
        the first speculative step's Propose finds it compiled instead of compiling on that step's path
        (a new schema: docs/benchmarks.md, "Per-step overheads"); not asked where the first step's
        Propose goes out beside the prefill, which begins the same compile."""
        if self.params.response_format is None or not self.params.speculation.is_enabled:
            return None
        return self.draft.prepare_grammar(self.params.response_format)

    def _open_first_step(self) -> tuple[SpeculationPlan, asyncio.Future | None]:
        """The first step's plan, made while the prefill is under way (it reads the prompt, the
        grammar and the controller's state, none of which the prefill changes), and, where it drafts
        without the prefill's features, its Propose begun beside the prefill: the draft service needs
        only the prompt, so the first speculative step waits for the prefill alone instead of the
        prefill, then its plan, then the Propose (docs/benchmarks.md, "Per-step overheads"). A
        request whose strategies read features is planned on the features its prefill brings (the
        primary returns them to such a request); a plan with a feature reader proposes after the
        prefill, with them."""
        self.planner.are_features_current = self.is_feature_consumer
        plan = self.planner.plan()
        if not plan.is_speculative or consumes_features(decoder for decoder, _ in plan.sources):
            return plan, None
        return plan, asyncio.ensure_future(self._propose(plan))

    async def _open(self) -> None:
        """The request's prefill, sent first (the critical path), with its first step's Propose and the
        pool's compile of its response format begun beside it."""
        prefill_start = time.perf_counter()
        prefill = asyncio.ensure_future(self.primary_calls.prefill())
        try:
            self.opening = self._open_first_step()
            if self.opening[1] is None:  # an opening Propose compiles the format itself
                self.grammar_preparation = self._prepare_draft_grammar()
        except BaseException:
            await _cancelled(prefill)
            raise
        await self._prefilled(prefill, prefill_start)

    async def _prefilled(self, prefill: asyncio.Future, t: float) -> None:
        """The request's own prefill (begun at perf_counter t) done. One whose request is cancelled
        meanwhile (Cancel, or its client went away) is given up: its call ends, so the primary drops it
        from its queue for KV room, and the loop ends cancelled (_stop_signal) then, not once KV room
        came or the call's deadline passed (the admission slot held all that time)."""
        while not prefill.done():
            await asyncio.wait({prefill}, timeout=PREFILL_CANCEL_POLL_S)
            if self.cancel.is_set() and not prefill.done():
                await _cancelled(prefill)
                break
        else:
            prefill.result()
        ms = (time.perf_counter() - t) * 1000
        self.stats.stage_ms["verify"] += ms
        self.stats.total_ms += ms

    async def _speculative_step(
        self, plan: SpeculationPlan, proposal: asyncio.Future | None = None
    ) -> tuple[SpeculationPlan, list[int], list[CandidateOutcome] | None, list[TokenLogprob]]:
        """One propose -> verify -> validate: the plan that ran (_carried_draft may narrow it), the
        step's tokens, the candidates' outcomes (None when the draft service failed). `proposal`: the
        plan's Propose, already under way (the first step's, _open_first_step)."""
        t0 = time.perf_counter()
        self.primary_calls.start_step()
        planned = plan  # before a carried draft narrows it: whether the features are wanted next
        carried = None if proposal is not None else self._carried_draft(plan)
        if carried is not None:
            plan, tree = carried
        else:
            tree = await (proposal if proposal is not None else self._propose(plan))
        if len(self.prompt_ids) + len(self.generated) + tree.lookahead_depth > self.model.max_context:
            tree = dataclasses.replace(tree, lookahead_token_ids=(), lookahead_parents=())  # no room: not this step
        allowed = None if self.grammar is None else self.grammar.tree_masks(tree.token_ids, tree.parents).allowed
        t1 = time.perf_counter()
        verified = await self._verify(tree, allowed, planned)
        t2 = time.perf_counter()
        # greedy: decided here from the primary's argmaxes, and confirmed by the validator beside the
        # next step (the check the step's commit takes)
        v = await self.validation.decide(tree, verified, allowed, len(self.generated))
        t3 = time.perf_counter()
        if v is None:  # the validator is gone and only it can sample: drop this step's tree
            # a recovery's prefill, not the request's own: its prompt figures and log probabilities stay
            await self.primary_calls.reprefill()
            return plan, [], None, []
        outcomes = self._apply_decision(tree, verified, v)
        for stage, ms in (("draft", t1 - t0), ("verify", t2 - t1), ("validate", t3 - t2)):
            self.stats.stage_ms[stage] += ms * 1000
        logprobs = [] if self.params.logprobs is None else path_logprobs(verified, v)
        return plan, list(self.pending_committed), (outcomes if tree.decoders else None), logprobs

    async def _verify(self, tree: DraftTree, allowed, planned: SpeculationPlan) -> Verified:
        """The primary's Verify of the tree, with the last step's commit; the logits in the format the
        acceptance rule reads. `planned`: the step's plan before a carried draft narrowed it."""
        fmt = self.greedy_format if self.acceptance_mode == AcceptanceMode.GREEDY else self.sample_format
        if self._is_bonus_scored():
            fmt = FORMAT_FP32  # the validator scores the token it draws: from the primary's own fp32 rows
        return await self.primary_calls.call(
            lambda: self.backends.verify(
                self.request_id,
                self.pending_accepted,
                self.pending_committed,
                tree,
                fmt,
                allowed,
                **self._feature_request(planned),
                **self._logprobs_request(),
                **self._penalties_request(),
            )
        )

    def _apply_decision(self, tree: DraftTree, verified: Verified, v: Validation) -> list[CandidateOutcome]:
        """The step's decision taken: what the primary and the draft service learn next, the carried
        draft, the stats and the step's cost record; the candidates' outcomes."""
        self.stats.forward_ms += verified.forward_ms
        self.planner.observe_load(verified.other_step_rows)
        self.draft.pending_lookahead_argmax = verified.lookahead_argmax_token_ids
        if verified.features is not None:
            # Root row and the accepted nodes' rows: they predict the accepted tokens and the bonus, the
            # first of which lands at the context's end. E.g. accepted nodes (2, 5): rows [0, 3, 6].
            rows = [0, *(node + 1 for node in v.accepted_nodes)]
            position = len(self.prompt_ids) + len(self.generated)
            self.draft.pending_features = (features_of_rows(verified.features, rows), position)
        else:  # the latest step has none; and older ones may name a logits slot since rewritten
            self.draft.pending_features = None
        self.pending_accepted = v.accepted_nodes
        self.pending_committed = [tree.token_ids[i] for i in v.accepted_nodes] + [v.bonus_token]
        self.carry = continuation_after(tree, v)
        outcomes = candidate_outcomes(tree.decoders, tree.node_sources, v.accepted_nodes, tree.parents)
        self._account(tree, outcomes, v)
        if tree.decoders and not self.primary_calls.is_step_disturbed:  # drafts ran and nothing was recovered
            model_draft_ms = sum(ms for name, ms in tree.decoder_ms.items() if name in MODEL_DECODERS)
            # root + tree + lookahead rows
            num_rows = len(verified.argmax_token_ids) + len(verified.lookahead_argmax_token_ids)
            self.step_record = StepRecord(True, verified.forward_ms, num_rows, model_draft_ms)
        return outcomes

    def _carried_draft(self, plan: SpeculationPlan) -> tuple[SpeculationPlan, DraftTree] | None:
        """The step's draft from the last step's continuation, when there is one and the plan still
        drafts with its decoder: a chain of at most draft_length of its tokens, proposed by that
        decoder alone (the plan narrows to it, so the controller hears of it only), and the rest
        kept as the chain's own continuation. Used once either way."""
        carry, self.carry = self.carry, None
        if carry is None or self.grammar is not None or (carry[0], 0) not in plan.sources:
            return None
        decoder, tokens = carry
        chain, rest = tokens[: plan.draft_length], tokens[plan.draft_length :]
        n = len(chain)
        tree = DraftTree(
            chain,
            chain_parents(n),
            (1,) * n,
            (decoder,),
            {},
            0.0,
            continuations=((n - 1, decoder, rest),) if rest else (),
        )
        return dataclasses.replace(plan, draft_length=n, sources=((decoder, 0),), max_tree_nodes=n), tree

    async def _plain_step(self) -> tuple[list[int], list[TokenLogprob]]:
        """One engine step of a streamed run of plain steps (DecodeRuns.next_step), or a message of several
        (step_engine_steps): its tokens, with their log probabilities when asked."""
        t = time.perf_counter()
        self.primary_calls.start_step()
        decoded = await self.primary_calls.call(self.runs.next_step)
        tokens = list(decoded.token_ids) or [decoded.token_id]
        self.step_engine_steps = decoded.num_steps
        self.carry = None  # what follows a plain step is not what the last draft continued with
        self.draft.pending_features = None  # the latest step has none
        self.stats.forward_ms += decoded.forward_ms
        if decoded.num_drafted:  # the run drafted this step itself (DecodeRuns._run_lookup_length)
            self.stats.num_proposed += decoded.num_drafted
            self.stats.num_accepted += decoded.num_draft_accepted
            self.stats.num_draft_steps += max(1, decoded.num_drafting_steps)
            copied, kept = (
                decoded.num_drafted - decoded.num_answer_drafted,
                decoded.num_draft_accepted - decoded.num_answer_accepted,
            )
            if copied:
                self.stats.add_decoder(RUN_LOOKUP_STATS, copied, kept, 0.0)
            if decoded.num_answer_drafted:
                self.stats.add_decoder(RUN_ANSWERS_STATS, decoded.num_answer_drafted, decoded.num_answer_accepted, 0.0)
        elif not self.primary_calls.is_step_disturbed:
            # a plain step's cost (a drafted one's forward is over more rows)
            self.step_record = StepRecord(False, decoded.forward_ms, len(tokens))
        self.planner.observe_load(decoded.other_step_rows)
        self.stats.stage_ms["verify"] += (time.perf_counter() - t) * 1000
        # the primary committed every token of the run but its last, which the next call commits
        self.pending_accepted, self.pending_committed = (), [tokens[-1]] if decoded.is_run_end else []
        return tokens, list(decoded.logprobs)

    def _forced_after(self, new_tokens: list[int]) -> list[int]:
        """The tokens the grammar allows alone after this step's (GrammarState.forced_token_ids): any
        decoding must write them, so they join the step's commit undrafted and unverified, and the
        primary runs them as its uncached chain in the next forward (its logits at the last one are
        the next step's root row). Output is unchanged, token for token. Only with speculation on:
        with it off a step is one plain Decode, the baseline."""
        if (
            self.grammar is None
            or self.runs.is_open  # the primary's run goes on: it decodes the grammar's tokens itself
            or not self.params.speculation.is_enabled
            or self.params.logprobs is not None  # no forward scores a forced token: it is decoded instead
            or not new_tokens
            or not self.eos.isdisjoint(new_tokens)
            or not self.grammar.accept_tokens(new_tokens)  # off the grammar: _commit fails the request
        ):
            return []
        try:
            forced = list(self.grammar.forced_token_ids(MAX_FORCED_TOKENS))
        finally:
            self.grammar.rollback(len(new_tokens))
        self.pending_committed.extend(forced)
        return forced

    async def _propose(self, plan: SpeculationPlan) -> DraftTree:
        """The plan's candidates as a tree (gateway.draft_calls)."""
        return await self.draft.propose(
            plan.sources,
            plan.draft_length,
            min(plan.max_tree_nodes, self.max_tree_nodes),
            response_format=self.params.response_format,
            continuation_length=max(CONTINUATION_TOKENS, plan.draft_length) if self.grammar is None else 0,
            prediction_ids=self.planner.prediction_ids,
        )

    def _account(self, tree: DraftTree, outcomes: list[CandidateOutcome], v: Validation) -> None:
        """Per decoder and rank ("prompt_lookup", "prompt_lookup#1", ...); a decoder's time is its
        one run for all its ranks, so it goes to rank 0."""
        self.stats.num_proposed += tree.num_nodes
        self.stats.num_accepted += len(v.accepted_nodes)
        self.stats.num_draft_steps += tree.num_nodes > 0
        for o in outcomes:
            ms = tree.decoder_ms.get(o.decoder, 0.0) if o.rank == 0 else 0.0
            self.stats.add_decoder(stats_name(o.decoder, o.rank), o.num_proposed, o.num_accepted, ms)
            if o.decoder == PREDICTION_STRATEGY:
                self.stats.num_accepted_prediction_tokens += o.num_accepted
        for d in depth_outcomes(tree.decoders, tree.node_sources, v.accepted_nodes, tree.parents):
            self.stats.add_depths(d.decoder, d.num_tested, d.num_accepted)
        self.stats.add_entropies(list(v.accepted_entropies), list(v.rejected_entropies))

    # --- stop conditions, commit ---------------------------------------------------------------

    def _commit(
        self,
        kept: list[int],
        is_final: bool,
        num_forced: int = 0,
        logprobs: Sequence[TokenLogprob] = (),
        has_end_token: bool = False,
    ) -> _PendingStep:
        """Commit the step's tokens, the last `num_forced` of them forced by the grammar, then the end
        token the output leaves out when has_end_token: its text and stop strings, the grammar,
        `generated`; then start the state store's write, which the caller awaits before the step's
        output goes out (_PendingStep). Detokenizing, stop strings and the grammar are booked as
        commit time, the wait for the write as state."""
        t = time.perf_counter()
        num_chars = len(self.output.text)
        k, is_stopped = self.output.add(kept, self.generated)
        if k < len(kept):  # a stop string completed before the step's last token (Output.add)
            self.stats.num_generated_tokens -= len(kept) - k
            num_forced = max(0, num_forced - (len(kept) - k))  # the forced tokens are the last ones
            del kept[k:]  # the caller yields this same list
        # a stop string among the tokens ends the output before the end token, which plain decoding
        # never decodes: not one of the step's tokens (mean_accepted_length)
        self.stats.num_end_tokens += has_end_token and not is_stopped
        self.stats.num_forced_tokens += num_forced
        if self.grammar is not None and not self.grammar.accept_tokens(kept):
            # Cannot happen while primary and validator apply the masks: fail loudly, not silently off-grammar.
            raise FailedPrecondition("response_format", f"committed tokens {kept} leave the request's grammar")
        num_stored = len(self.generated)
        self.generated.extend(kept)
        self.planner.align_prediction(kept)
        # Hold back a tail that could still become a stop string, unless this is the end.
        delta = self.output.ready_text(is_final or is_stopped)
        check = self.validation.take_check()
        stats, controller = self._stored_state() if self.record.is_stats_due(is_final or is_stopped) else (None, None)

        async def write(check: asyncio.Future | None) -> bool:
            """The step appended to the request's record once the validator confirmed it (check);
            False when the store refuses it (the request ended elsewhere)."""
            if check is not None:
                await check
            return await self.record.append_step(kept, num_stored, stats, controller)

        self.stats.stage_ms["commit"] += (time.perf_counter() - t) * 1000
        kept_logprobs = list(logprobs[: len(kept)])  # the step's tokens past an end or a stop are not output
        self.output_logprobs.extend(kept_logprobs)
        output = StepOutput(kept, delta, kept_logprobs) if kept or delta else None
        return _PendingStep(check, write, output, num_chars, num_stored, is_stopped)

    def _unstore(self, pending: _PendingStep) -> None:
        """A step the store refused leaves the output: its tokens, their count and text."""
        self.stats.num_generated_tokens -= len(self.generated) - pending.num_stored
        del self.generated[pending.num_stored :]
        del self.output_logprobs[max(0, pending.num_stored - self.num_unscored) :]
        self.output.cut_back(pending.num_chars)
        self.is_refused = True

    async def _finish(self, finish: str, error: str = "") -> None:
        """Record the request's end in the state store, then release what it holds in the services."""
        status = {
            FINISH_CANCELLED: RequestStatus.CANCELLED,
            FINISH_ERROR: RequestStatus.FAILED,
            FINISH_DEADLINE: RequestStatus.CANCELLED,
        }.get(finish, RequestStatus.FINISHED)
        if self.grammar_preparation is not None:
            self.grammar_preparation.cancel()
        if self.opening is not None:  # the request ended before its first step
            await _cancelled(self.opening[1])
            self.opening = None
        await self.record.finish(status, finish, error, *self._stored_state())
        with contextlib.suppress(Exception):  # a run still streaming (a stop string, a cancel) ends first
            await self.runs.close()
        # The two services forget the request at once: their round trips overlap instead of adding up
        # before the client hears of the end.
        await asyncio.gather(self._release_primary(), self.draft.release(finish))
        for left in self.left_backends:  # the nodes it failed over from: their leases, else kept for good
            if left is not self.backends:
                left.forget_kv_lease(self.request_id)
        await self.let_go_nodes()

    async def let_go_nodes(self) -> None:
        """Let go of the nodes it used (at its end; a request that never ran, once): a node no longer
        listed closes its connections with its last request."""
        held, self.held_nodes = self.held_nodes, []
        for node in held:
            with contextlib.suppress(Exception):  # a channel that would not close: the request is over
                await node.let_go()

    async def _release_primary(self) -> None:
        with contextlib.suppress(Exception):  # already gone (restarted) or never opened
            await self.backends.release_primary(self.request_id)

    # --- primary calls ----------------------------------------------------------------------

    def _penalties_request(self) -> dict[str, Any]:
        """The Verify argument carrying the request's penalties and logit_bias, which the primary
        applies to every tree row as Decode does to its row (calls of requests without stay as they
        were)."""
        sampling = self.primary_sampling()
        return {"sampling": sampling} if sampling.has_penalties else {}

    def primary_sampling(self) -> SamplingParams:
        """The sampling parameters the primary processes this step's rows by: with min_tokens still
        ahead, holding back the request's end tokens; after it, as a request without it."""
        return self.params.sampling.holding_back(self.eos, len(self.generated))

    def _feature_request(self, plan: SpeculationPlan | None = None) -> dict[str, Any]:
        """The primary calls' argument asking for features, only where a strategy reads them (calls of
        requests without stay as they were). A Verify asks only when its step drafts with a feature
        reader, or the controller would draft with one whose features are not current
        (StepPlanner.is_feature_wanted), so that the next step can: a forward with features runs
        eagerly, off the primary's compiled fast path, and the adaptive controller leaves the drafter
        out wherever it does not pay; the drafter takes the gap in its features as it takes a plain
        step's (its own KV goes on from the rows it has)."""
        if not self.is_feature_consumer:
            return {}
        if (
            plan is not None
            and not consumes_features(decoder for decoder, _ in plan.sources)
            and not self.planner.is_feature_wanted
        ):
            return {}
        return {"return_features": True}

    def _prompt_logprobs_request(self, is_fresh: bool) -> dict[str, Any]:
        """The prefill's argument asking for the prompt's log probabilities: with the request's own
        prefill (not a recovery's), when it asks."""
        scoring = self.params.logprobs
        return {"prompt_logprobs": scoring} if is_fresh and scoring is not None and scoring.is_prompt_included else {}

    def _run_format_request(self) -> dict[str, Any]:
        """The prefill's argument naming the response format the request's runs decode under
        (DecodeRuns.run_format), for the primary to compile beside the prefill; calls of requests
        without stay as they were."""
        run_format = self.runs.run_format
        return {} if run_format is None else {"response_format": run_format}

    def _is_bonus_scored(self) -> bool:
        """The validator draws a step's last token (sampling, lossy threshold) and the request asks for
        log probabilities: it returns that token's, which the primary's rows may not name."""
        return self.params.logprobs is not None and self.acceptance_mode != AcceptanceMode.GREEDY

    def _logprobs_request(self) -> dict[str, Any]:
        """The primary calls' argument asking for the tokens' log probabilities, only when the request
        asks (calls of requests without stay as they were)."""
        return {} if self.params.logprobs is None else {"logprobs": self.params.logprobs}

    def _move_to(self, node: Node) -> None:
        """Go on with another node's services after a failover (PrimaryCalls): its backends and the
        states of its validator and draft pool; the draft pool there opens the request afresh. The
        old node's backends keep the request's lease (a failover back re-prefills with it) until the
        request ends (_finish)."""
        if not any(b is self.backends for b in self.left_backends):
            self.left_backends.append(self.backends)
        self._hold(node)
        self.backends, self.record.node_id = node.backends, node.node_id
        self.validator_state = node.validator_state
        self.draft.move_to(node.backends, node.draft_state)
        self.planner.validator_state = node.validator_state  # whether a plan may draft under sampling
        self.validation.move_to(node.backends, node.validator_state)
        if self.opening is not None and self.opening[1] is not None:  # asked of the old node's draft pool
            self.opening[1].cancel()
            self.opening = (self.opening[0], None)  # the first step proposes on this node's

    async def _prefill_context(self, is_fresh: bool) -> str:
        """Prefill the prompt and the committed tokens on the primary (PrimaryCalls: the request's own
        prefill when is_fresh, else a recovery's); the weights' precision it answers with."""
        context = self.prompt_ids + self.generated
        is_scoring_prompt = bool(self._prompt_logprobs_request(is_fresh))
        prefilled = await self.primary_calls.within_deadline(
            self.backends.prefill(
                self.request_id,
                context,
                len(self.prompt_ids),
                **self._feature_request(),
                **self._prompt_logprobs_request(is_fresh),
                **self._run_format_request(),
            )
        )
        if is_scoring_prompt:  # the first token has no context: NaN, no alternatives
            self.prompt_logprobs = [TokenLogprob(self.prompt_ids[0], math.nan), *prefilled.prompt_logprobs]
        # its one row predicts the pending (last) token; none when the prefill computed no row
        has_features = prefilled.features is not None
        self.draft.pending_features = (prefilled.features, len(context) - 1) if has_features else None
        self.stats.forward_ms += prefilled.time_ms
        self.record.prefilled(prefilled.kv_lease)
        # the request's own prefill, not a recovery's, nor a resumed request's (its prompt's figure is its
        # first gateway's, restored with its stats; this prefill of its output too is a recovery)
        if is_fresh and not self.num_unscored:
            self.stats.num_cached_prompt_tokens = prefilled.num_cached_prompt_tokens
        self.pending_accepted, self.pending_committed = (), []
        return prefilled.precision
