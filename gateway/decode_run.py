"""A request's plain steps as the primary's streamed runs (DecodeRuns): one run open at a time.

A plain step of a greedy request asks the primary for a run of tokens in one call
(DecodeRequest.max_tokens): the primary steps the request itself, in every engine step beside the
other requests', and the round trip between two tokens (a gRPC call each way, the gateway's own
step work) is paid once a run. Under a grammar the call carries the response format and the
primary masks each token by its own state of the grammar (primary_svc.run_grammars): under load a
round trip per token cost a constrained request about an engine step per token. The run streams
(primary.DecodeStream): each engine step's token is a loop step of its own, stored and sent to the
client as it comes, so a client hears from a run every engine step, and a run's length delays
nothing: a request's first token comes after the run's first step, as it would alone. So a run
goes to the request's end (max_new_tokens, the context) unless a decode_run_max bounds it: each
run's end costs its request a round trip, in which the engine steps on without it (under load a gap
of two steps or more); the primary stops it at an end-of-sequence token, the loop cancels it at a
stop string, a cancel or the deadline. With adaptive speculation a run is never longer than the
stretch the controller would plan plain anyway (until its next probe:
AdaptiveController.plain_steps_ahead), so no draft it wants is delayed.

A request whose client waits for the whole answer (Generate, not GenerateStream) needs no token
before the others: its runs send, after their first step, several steps a message
(DecodeRequest.steps_per_message, the gateway's --unary_stream_interval), and the loop reads,
commits and stores a message's tokens as one loop step that counts its engine steps. On the 2-core
machines the gateway's work per message (its read, the commit, the store's write) competes for the
cores with the primary's forward. The tokens are the same. The primary sends a message at once after
a step that completes one of the request's stop strings (DecodeRequest.stop_strings), so the output
ends there, not up to a message later; a cancel or the deadline is seen up to a message later. A run
cancelled with steps it decided unsent leaves them to the next call to drop (num_context_tokens), as
it does a cancelled run's last step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable, Mapping, Set
from typing import Any

from gateway.backends import Backends, Decoded
from gateway.controller import NEVER_DRAFTS, AdaptiveController, ControllerState, SpeculationPlan
from gateway.params import GenerationParams
from specdec.context_room import output_room
from specdec.errors import Unavailable
from specdec.grammar import GrammarState, ResponseFormat
from specdec.repeats import RepeatIndex
from specdec.sampling import SamplingParams
from specdec.strategies import PROMPT_LOOKUP_STRATEGY

# What the loop's planner knows a decoder will propose this step, by (decoder, rank) (StepPlanner.known_coverage)
KnownCoverage = Callable[[], dict[tuple[str, int], float]]


@dataclasses.dataclass(frozen=True, slots=True)
class RunStart:
    """The request's state a run opened now starts from, read when it opens: a recovery re-prefills
    (the commit to carry is then empty), a failover moves the request to another node's backends."""

    backends: Backends
    pending_accepted: tuple[int, ...]  # the last step's accepted nodes and commit, which the call carries
    pending_committed: list[int]
    num_generated: int  # tokens committed so far
    is_validator_up: bool


class DecodeRuns:
    """The primary's streamed runs of a request's plain steps, one engine step per loop step, and the
    plan that opened the run under way (each of its steps is a step of that plan).

    `start()` is the request's state when a run opens (RunStart); `known_coverage()` what the loop's
    planner knows the decoders will propose (the controller's plans of plain steps read it). The
    grammar is the loop's own object; the controller with its state, and prompt lookup's repeat
    index, are its planner's (gateway.step_planner)."""

    def __init__(
        self,
        request_id: str,
        params: GenerationParams,
        start: Callable[[], RunStart],
        *,
        num_prompt_tokens: int,
        max_context: int,
        eos: Set[int],
        grammar: GrammarState | None = None,
        logprobs_request: Mapping[str, Any],
        decode_run_max: int | None = None,
        is_run_drafting: bool = True,
        steps_per_message: int = 1,
        repeats: RepeatIndex | None = None,
        controller: AdaptiveController | None = None,
        controller_state: ControllerState | None = None,
        known_coverage: KnownCoverage | None = None,
    ) -> None:
        self.request_id, self.params, self.start = request_id, params, start
        self.num_prompt_tokens, self.max_context, self.eos = num_prompt_tokens, max_context, eos
        self.logprobs_request = logprobs_request  # DecodeStream's argument asking for log probabilities
        self.grammar, self.repeats = grammar, repeats
        self.controller, self.controller_state, self.known_coverage = controller, controller_state, known_coverage
        self.decode_run_max = decode_run_max
        self.is_run_drafting = is_run_drafting  # runs draft their copies in the primary (_run_lookup_length)
        # After a run's first step, the most engine steps the primary sends in one message: 1 when the
        # client hears of every token, more when it waits for the whole answer (fewer messages to commit)
        self.steps_per_message = steps_per_message
        # The run under way (Backends.decode_stream) and the plan that opened it, set by the loop.
        self.stream: AsyncGenerator[Decoded, None] | None = None
        self.plan = SpeculationPlan()
        # The last run was opened to end where the output comes to repeat earlier text (_stop_at_repeat).
        self.is_stopping_at_repeat = False

    @property
    def is_open(self) -> bool:
        """A run is under way: the next plain step is its next engine step."""
        return self.stream is not None

    @property
    def run_format(self) -> ResponseFormat | None:
        """The response format the primary masks this request's runs by, when its runs may be longer
        than a token (greedy, _decode_run_length; _open_run sends it then): the loop's Prefill asks the
        primary to compile it beside the prefill, so that the first run does not wait for it."""
        may_run = self.params.max_new_tokens > 1 and (self.decode_run_max is None or self.decode_run_max > 1)
        if self.grammar is None or not self.params.sampling.is_greedy or not may_run:
            return None
        return self.params.response_format

    def was_stopping_at_repeat(self) -> bool:
        """Whether the run that ended was opened to end at a repeat (_stop_at_repeat); asked once a run."""
        was, self.is_stopping_at_repeat = self.is_stopping_at_repeat, False
        return was

    async def next_step(self) -> Decoded:
        """The next engine step of the request's streamed run (or steps: Decoded.num_steps, with
        steps_per_message > 1), opening a run first when none is open: the primary sends each step's
        token as it decides it (PrimaryService.DecodeStream), so a streaming client gets each token an
        engine step after the last, not a run's tokens at once. A run that
        fails is closed; the retry (PrimaryCalls.call) opens a new one from the committed tokens."""
        if self.stream is None:
            self.stream = self._open_run(self.start())
        try:
            decoded = await anext(self.stream)
        except StopAsyncIteration:
            await self.close()
            raise Unavailable(
                "primary", "the primary's decode stream ended before its run did", dependency="primary"
            ) from None
        except BaseException:
            await self.close()
            raise
        if decoded.is_run_end:
            await self._end()
        return decoded

    async def _end(self) -> None:
        """After a run's last step: read the stream to its end (the primary's status follows the
        last message at once), so that the call completes as a finished call, not a cancelled one
        (its client span ends and is exported with the request's trace), then close it."""
        run = self.stream
        if run is not None:
            with contextlib.suppress(Exception):  # StopAsyncIteration: the stream's end
                await anext(run)
        await self.close()

    async def close(self) -> None:
        """End the streamed run, if one is open: cancelled mid-run (the request ends, or its call
        failed), the primary stops it at its next step and keeps what it committed."""
        run, self.stream = self.stream, None
        if run is not None:
            await run.aclose()

    def _open_run(self, start: RunStart) -> AsyncGenerator[Decoded, None]:
        """A streamed run of plain steps from the request's committed tokens (_decode_run_length)."""
        max_tokens = self._decode_run_length(start)
        # A run under a grammar: the primary masks each token by its own state of the grammar.
        is_grammar_run = self.grammar is not None and max_tokens > 1
        allowed = None if self.grammar is None or is_grammar_run else self.grammar.allowed_mask()  # 1 row
        # min_tokens still ahead: the primary holds back the end tokens at each step of the run before it
        sampling = self.params.sampling.holding_back(self.eos, start.num_generated)
        lookup_draft_length = self._run_lookup_length(max_tokens, allowed is not None, sampling)
        stop_at_repeat, max_tokens = (
            self._stop_at_repeat(max_tokens) if max_tokens > 1 and not lookup_draft_length else (0, max_tokens)
        )
        self.is_stopping_at_repeat = stop_at_repeat > 0
        return start.backends.decode_stream(
            self.request_id,
            start.pending_accepted,
            start.pending_committed,
            sampling,
            start.num_generated,
            allowed,
            max_tokens=max_tokens,
            stop_token_ids=sorted(self.eos) if max_tokens > 1 else (),
            response_format=self.params.response_format if is_grammar_run else None,
            # what the primary holds before this call's commit: a cancelled run's extra tokens are dropped
            num_context_tokens=self.num_prompt_tokens + start.num_generated - len(start.pending_committed),
            stop_at_repeat_tokens=stop_at_repeat,
            lookup_draft_length=lookup_draft_length,
            steps_per_message=self.steps_per_message,
            # the primary sends a message at once where a stop string completes, which the loop cuts at
            stop_strings=self.params.stop if self.steps_per_message > 1 else (),
            **self.logprobs_request,
        )

    def _run_lookup_length(self, max_tokens: int, is_masked: bool, sampling: SamplingParams) -> int:
        """How many tokens a step of the run opened now may draft by prompt lookup in the primary itself
        (DecodeRequest.lookup_draft_length): the request's draft_length where prompt lookup is one of
        its adaptive strategies and the run has no one-row mask, penalties, logprobs or prediction (a
        grammar's run drafts too: the primary checks its drafts by its own grammar state; a sampled run
        keeps a draft where its draw at that position equals it); else 0.
        Such a run drafts a copy the step it starts, with no round trip to the draft service or the
        validator, so it goes on through repeats instead of ending at them (_stop_at_repeat)."""
        if (
            not self.is_run_drafting
            or self.repeats is None
            or self.params.prediction is not None  # its decoder drafts the predicted copy (Predicted Outputs)
            or max_tokens <= 1
            or is_masked
            or sampling.has_penalties
            or self.params.logprobs is not None
        ):
            return 0
        return self.params.speculation.draft_length

    def _stop_at_repeat(self, max_tokens: int) -> tuple[int, int]:
        """(stop_at_repeat_tokens, max_tokens) for a run of up to `max_tokens` opened now. A run is
        opened while prompt lookup has nothing worth a step (the tail repeats nothing), so the
        controller cannot see a copy coming; the primary ends the run where one starts (the repeat
        index's n) when the controller would draft at a repeat, or probe prompt lookup there: at once
        if it would draft or a probe is due, else the run stops short when a probe comes due, and
        the next run stops at a repeat. Plans change only with observations, which a run makes none
        of, so what holds at the open holds for the run (AdaptiveController.plain_steps_ahead)."""
        if self.repeats is None or self.controller is None:
            return 0, max_tokens
        known = {key: c for key, c in self._known_coverage().items() if key[0] != PROMPT_LOOKUP_STRATEGY}
        state = self._controller_state()
        if self.controller.would_draft(state, known):
            return self.repeats.n, max_tokens
        ahead = self.controller.plain_steps_ahead(state, known)  # plain steps before a probe, with a repeat
        if ahead == NEVER_DRAFTS:
            return 0, max_tokens
        return (self.repeats.n, max_tokens) if ahead <= 1 else (0, min(max_tokens, ahead))

    def _decode_run_length(self, start: RunStart) -> int:
        """How many tokens this plain step asks the primary for: one for a sampled request under a grammar
        (measured: its steps a token a call, each committing the grammar's forced tokens with it unverified,
        RequestLoop._forced_after, beat its runs; docs/benchmarks.md, "sampled runs") or while the validator
        is down (each step falls back from a speculative plan, and the next probe must come on time); else
        the rest of the request (max_new_tokens, the context; at most decode_run_max when given), with
        adaptive speculation no more than the controller's plain steps ahead. A sampled run draws each
        token at its position, as a call a token would (specdec.sampling.make_generator)."""
        if not self.params.sampling.is_greedy and (self.grammar is not None or not start.is_validator_up):
            return 1
        room = min(
            self.params.max_new_tokens - start.num_generated,
            output_room(self.num_prompt_tokens, self.max_context) - start.num_generated,
        )
        run = room if self.decode_run_max is None else min(room, self.decode_run_max)
        if self.controller is not None:
            run = min(run, self.controller.plain_steps_ahead(self._controller_state(), self._known_coverage()))
        return max(1, run)

    def _controller_state(self) -> ControllerState:
        assert self.controller_state is not None  # given with the controller
        return self.controller_state

    def _known_coverage(self) -> dict[tuple[str, int], float]:
        assert self.known_coverage is not None  # given with the controller
        return self.known_coverage()
