"""The steps of one Decode call's run, decided on the engine thread (PrimaryServicer._plain_run).

A run decodes up to max_tokens tokens, one engine step each, as plain decoding would: the argmax
(masked by the request's grammar state under a response_format) when greedy, else a draw from the
request's sampling distribution keyed by (seed, position) (specdec.sampling.make_generator), so a
seeded run writes the same tokens as one Decode call a token.

With lookup_draft_length, after its first step a run drafts its own next tokens by prompt lookup
(specdec.repeats.RunDrafts) and verifies them in the next step's forward, as a chain after the
pending token. Row i of that step is where a plain step would choose the (i+1)-th token of the step:
the run chooses it there exactly as a plain step would (the same argmax, or the same draw at the same
position), keeps the drafts equal to those choices and the choice after them. The tokens are
therefore plain decoding's, token for token, greedy or seeded; several a step where the answer copies.
A sampled draft is kept with the probability the distribution gives it, what speculative sampling
gives a draft proposed with certainty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from primary_svc.metrics import PrimaryMetrics
from primary_svc.worker import RunStep
from specdec.engine.tree import chain_parents
from specdec.grammar import GrammarState
from specdec.logits_codec import row_argmax
from specdec.logprobs import TokenLogprob, token_logprobs
from specdec.repeats import RunDrafts
from specdec.sampling import SamplingParams, draw_token

NextToken = Callable[[torch.Tensor, int], int]  # (logits [1, V], position) -> a plain step's token


@dataclasses.dataclass(frozen=True, slots=True)
class Decided:
    """What one engine step of a Decode run decided, on the engine thread."""

    token_ids: tuple[int, ...]  # the drafts it accepted, then the token it decided (the last is pending at a run's end)
    num_step_rows: int  # the engine step's rows, every request's (VerifyResponse.num_step_rows)
    num_drafted: int  # tokens the run drafted for this step (DecodeRequest.lookup_draft_length)
    num_draft_accepted: int  # of them, those among token_ids
    is_last: bool  # the run ends with it: max_tokens, a stop token, a repeat (the full context ends it too)
    num_answer_drafted: int = 0  # of num_drafted, those drafted from the model's answers (specdec.answers)
    num_answer_accepted: int = 0  # of them, those among token_ids


@dataclasses.dataclass(frozen=True, slots=True)
class RunLimits:
    """Where a run ends (DecodeRequest.max_tokens, stop_token_ids, stop_at_repeat_tokens)."""

    max_tokens: int
    stop_token_ids: frozenset[int]
    repeats: Callable[[int], bool] | None  # decoded token -> whether the context's tail now repeats


class Run:
    """A Decode call's steps: `finish(logits)` -> the step's Decided, appending its tokens to `tokens`
    (and their log probabilities to `logprobs`, when asked); `repeat` (None for a single step) ->
    its RunStep: what the next step commits and drafts, or is_last where the run ends. Both run on the
    engine thread, finish first."""

    def __init__(
        self,
        *,
        request_id: str,
        position: int,
        sampling: SamplingParams,
        limits: RunLimits,
        next_token: NextToken,
        grammar: Callable[[list[int]], GrammarState] | None,
        make_drafts: Callable[[], RunDrafts] | None,
        logprobs_top: int | None,
        output_token_ids: Callable[[str], list[int]],
        step_load: Callable[[], tuple[int, int]],
        metrics: PrimaryMetrics | None,
    ) -> None:
        self.request_id, self.position, self.sampling, self.limits = request_id, position, sampling, limits
        self.next_token, self.grammar, self.make_drafts = next_token, grammar, make_drafts
        self.logprobs_top = logprobs_top  # None: no log probabilities asked
        self.output_token_ids = output_token_ids  # the request's committed output (the engine's)
        self.step_load = step_load  # () -> (rows, requests) of the engine step just run, every request's
        self.metrics = metrics
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.num_drafted = 0  # every step's (DecodeResponse.num_drafted)
        self.num_draft_accepted = 0
        self.num_answer_drafted = 0  # of num_drafted, every step's from the model's answers
        self.num_answer_accepted = 0
        # The last step's other work, which the next step's drafts are priced beside (RunDrafts.draft)
        self.other_rows = 0
        self.other_requests = 0
        self.drafts: RunDrafts | None = None  # made after the first step
        self.drafted: list[int] = []  # the step's drafts: a chain after its pending token
        self.is_forced = False  # the step's drafts are the tokens the grammar allows alone
        self.repeat: Callable[[Decided], RunStep] | None = self._repeat if limits.max_tokens > 1 else None

    def finish(self, logits: torch.Tensor) -> Decided:
        """logits [1 + len(drafted), V] of the step's rows -> what the step decided."""
        if self.drafted:
            new = self._accept(logits)
            if not self.is_forced and self.drafts is not None:  # forced tokens say nothing of the copies'
                self.drafts.observe(len(self.drafted), len(new) - 1)
        else:
            new = [self.next_token(logits, self.position + len(self.tokens))]
        if self.logprobs_top is not None:  # of the raw row the token was chosen from (no drafts with logprobs)
            self.logprobs.extend(token_logprobs(logits[:1], new, self.logprobs_top))
        kept, is_end = self._keep(new)
        accepted = min(len(kept), len(new) - 1)
        self.num_drafted += len(self.drafted)
        self.num_draft_accepted += accepted
        if self.drafted and self.metrics is not None:
            self.metrics.run_drafted_tokens.inc(len(self.drafted))
            self.metrics.run_draft_accepted_tokens.inc(accepted)
        is_answer = (
            bool(self.drafted) and self.drafts is not None and self.drafts.is_answer_draft and not self.is_forced
        )
        answer_drafted, answer_accepted = (len(self.drafted), accepted) if is_answer else (0, 0)
        self.num_answer_drafted += answer_drafted
        self.num_answer_accepted += answer_accepted
        if is_answer and self.metrics is not None:
            self.metrics.run_answer_drafted_tokens.inc(answer_drafted)
            self.metrics.run_answer_accepted_tokens.inc(answer_accepted)
        step_rows, step_requests = self.step_load()
        self.other_rows = max(0, step_rows - 1 - len(self.drafted))  # the step's, beside this run's
        self.other_requests = max(0, step_requests - 1)
        is_last = is_end or self.limits.max_tokens <= 1
        return Decided(tuple(kept), step_rows, len(self.drafted), accepted, is_last, answer_drafted, answer_accepted)

    def _keep(self, new: list[int]) -> tuple[list[int], bool]:
        """The step's tokens up to the first that ends the run (appended to `tokens`), and whether one did."""
        limits, kept = self.limits, []
        for token in new:
            kept.append(token)
            self.tokens.append(token)
            if (
                len(self.tokens) >= limits.max_tokens
                or token in limits.stop_token_ids
                or (limits.repeats is not None and limits.repeats(token))  # it extends the repeat index: once a token
            ):
                return kept, True
        return kept, False

    def _accept(self, logits: torch.Tensor) -> list[int]:
        """The drafts equal to what a plain step would choose at their rows, then that choice after them."""
        new: list[int] = []
        for token, drafted in zip(self._choices(logits), [*self.drafted, None]):
            new.append(token)
            if token != drafted:
                break
        return new

    def _choices(self, logits: torch.Tensor) -> Iterator[int]:
        """Row by row, the token a plain step there would choose: under a grammar, among the tokens its
        state allows after the committed output and the drafts before the row; sampled rows are drawn
        only as far as the walk reads them (a draw a row)."""
        masks = None
        if self.grammar is not None:
            state = self.grammar(self.output_token_ids(self.request_id))
            masks = state.tree_masks(self.drafted, chain_parents(len(self.drafted))).allowed
        if self.sampling.is_greedy:
            yield from (row_argmax(logits) if masks is None else masks.argmax(logits).tolist())
            return
        first = self.position + len(self.tokens)  # the position of row 0's token
        for i in range(logits.shape[0]):
            row = logits[i : i + 1] if masks is None else masks.masked_rows(logits, [i])  # [1, V]
            yield draw_token(row, self.sampling, first + i)

    def _forced_after(self, new: tuple[int, ...], room: int) -> tuple[int, ...]:
        """The tokens the grammar allows alone after the committed output and `new` (at most `room`):
        every decoding writes them, so as drafts they are always accepted (GrammarState.forced_token_ids)."""
        if self.grammar is None or room <= 0:
            return ()
        state = self.grammar(self.output_token_ids(self.request_id))
        if not state.accept_tokens(new):
            return ()  # off the grammar: the next step's masks say so
        try:
            return state.forced_token_ids(room)
        finally:
            state.rollback(len(new))

    def _repeat(self, result: Decided) -> RunStep:
        """After finish: what the next step commits (every token but the last, which is pending) and drafts."""
        self.drafted.clear()
        if self.make_drafts is not None and not result.is_last:
            if self.drafts is None:  # the context up to this step's pending token
                self.drafts = self.make_drafts()
            self.drafts.extend(result.token_ids)
            room = self.limits.max_tokens - len(self.tokens) - 1
            forced = self._forced_after(result.token_ids, room)
            self.is_forced = bool(forced)
            self.drafted.extend(forced or self.drafts.draft(room, self.other_rows, self.other_requests))
        accepted = tuple(range(len(result.token_ids) - 1))  # every token but the last (pending) was drafted
        return RunStep(result.token_ids, accepted, tuple(self.drafted), result.is_last)
