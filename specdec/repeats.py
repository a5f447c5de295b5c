"""Whether the context's last n tokens occurred earlier: when prompt lookup can pay.

Prompt lookup (draft_svc/strategies/prompt_lookup.py) proposes what followed an earlier occurrence of
the context's last 1..4 tokens. A 1- or 2-token match is found almost everywhere in prose and is
almost never what the model says next; a match of MIN_REPEAT_TOKENS or more is text being copied
(a quoted passage, a code identifier's line, a JSON key list), where its drafts are accepted for
many tokens. Asking the draft service costs a round trip each step, so the gateway keeps its own
index of the request's n-grams and tells the controller, before each plan, that prompt lookup
proposes nothing worth a step where the context's tail does not repeat (known coverage 0: neither
drafted nor probed nor counted as a miss, as grammar-forced drafts inside free text). Its acceptance
estimate then describes the steps at a repeat, which is when it is asked.

The index: the set of every n-gram of the context that some later token followed, so the tail
matches an earlier occurrence, never itself. O(1) per token, one n-gram per token of memory.
E.g. n = 3, context [a b c d a b c]: "a b c" was followed by d, so the tail repeats.

The gateway keeps one per request to plan; the primary builds one for a run asked to end at a repeat
(DecodeRequest.stop_at_repeat_tokens, at most MAX_REPEAT_TOKENS).

A run's own drafts (RunDrafts, DecodeRequest.lookup_draft_length): inside a greedy run of plain
steps the primary drafts the copy itself, from the same index, and verifies it in the step's own
forward as a chain after the pending token. The step keeps the drafted tokens its argmaxes agree
with and the argmax after them: the run's tokens are its plain decoding's, several a step where the
answer copies, without the draft service's and validator's round trips (about 1.4 one-row forwards
a speculative step on a 2-core CPU, docs/benchmarks.md). How many tokens to draft is chosen each
step by expected tokens per forward cost: the chain's acceptance estimate against the measured cost
of a verify of k rows. Where the tail repeats nothing, a run given the model's own answers
(specdec.answers) drafts what the model wrote after the same tokens there instead, priced by an
acceptance estimate of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.answers import AnswerIndex

MIN_REPEAT_TOKENS = 3  # a tail of this many tokens that occurred earlier is a repeat
MAX_REPEAT_TOKENS = 16  # the longest tail a caller may ask a run to stop at (longer repeats are copies too)
# A verify of k rows against one row (k = root + drafts), where the primary measured none: int4 after
# 256 tokens of context on a 2-core Xeon with AMX (docs/benchmarks.md, "Flat forward").
DEFAULT_ROW_COSTS = {1: 1.0, 2: 1.14, 4: 1.47, 8: 2.22, 16: 3.64, 32: 6.44, 64: 10.6}
# The chain acceptance estimate's prior (successes, trials) and how much each step's evidence fades:
# a copy is accepted for a while and then stops, so recent steps say most.
ACCEPTANCE_PRIOR = (1.0, 2.0)
ACCEPTANCE_DECAY = 0.7
MAX_ANSWER_CONTEXT = 32  # the context tail matched against the model's answers (specdec.answers)


class RepeatIndex:
    """The n-grams (n = MIN_REPEAT_TOKENS by default) of a growing context; see the module docstring."""

    def __init__(self, token_ids: Iterable[int] = (), n: int = MIN_REPEAT_TOKENS) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self._tokens: list[int] = []
        # n-gram -> where the token after its latest earlier occurrence is
        self._followed: dict[tuple[int, ...], int] = {}
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        n, tokens = self.n, self._tokens
        for token in token_ids:
            if len(tokens) >= n:
                self._followed[tuple(tokens[-n:])] = len(tokens)  # the n-gram before this token is followed now
            tokens.append(int(token))

    def tail(self, n: int) -> list[int]:
        """The context's last n tokens."""
        return self._tokens[-n:]

    def tail_repeats(self) -> bool:
        """Whether the context's last n tokens occurred earlier (with a token after them)."""
        return len(self._tokens) >= self.n and tuple(self._tokens[-self.n :]) in self._followed

    def continuation(self, max_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the context's last n tokens, at most
        max_tokens of it (empty where the tail does not repeat). A match that ends less than max_tokens
        before the context's end copies into its own output (LZ77), so a cycle continues: context
        [x y z x y z] (n = 3) -> [x y z x ...]."""
        tokens = self._tokens
        if len(tokens) < self.n or max_tokens <= 0:
            return []
        start = self._followed.get(tuple(tokens[-self.n :]))
        if start is None:
            return []
        out: list[int] = []
        for i in range(start, start + max_tokens):
            out.append(tokens[i] if i < len(tokens) else out[i - len(tokens)])
        return out


class ChainAcceptance:
    """The estimated chance that a drafted token is accepted given the one before it was: verified
    chains' evidence, fading by ACCEPTANCE_DECAY a chain, over the prior ACCEPTANCE_PRIOR."""

    def __init__(self) -> None:
        self._successes, self._trials = ACCEPTANCE_PRIOR

    @property
    def value(self) -> float:
        return self._successes / self._trials

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A verified chain: its first num_accepted tokens were accepted (then one was not, unless all were)."""
        if num_drafted <= 0:
            return
        trials = num_accepted + (num_accepted < num_drafted)
        p_s, p_t = ACCEPTANCE_PRIOR
        d = ACCEPTANCE_DECAY
        # the evidence beyond the prior fades; the prior stays, so one step cannot make the estimate 0 or 1
        self._successes = p_s + d * (self._successes - p_s) + num_accepted
        self._trials = p_t + d * (self._trials - p_t) + trials


class RunDrafts:
    """A run's own prompt-lookup drafts (see the module docstring): the index over the request's
    context, the chain acceptance estimate, and each step's choice of how many tokens to draft.

    `row_costs`: ms (or any unit) of a verify of k rows by k, as the primary measured them; where the
    tail repeats nothing, `learned` (context tail, max tokens -> draft: what the primary served the
    request's tenant, specdec.answers.LearnedAnswers) and then `answers` (the model's shipped
    answers) draft, each priced by an acceptance estimate of its own."""

    def __init__(
        self,
        token_ids: Iterable[int],
        max_length: int,
        row_costs: Mapping[int, float] | None = None,
        answers: AnswerIndex | None = None,
        learned: Callable[[Sequence[int], int], list[int]] | None = None,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.index = RepeatIndex(token_ids)
        self.max_length = max_length
        costs = dict(row_costs or {})
        if 1 not in costs or costs[1] <= 0 or len(costs) < 2:  # a curve needs one row and another size
            costs = DEFAULT_ROW_COSTS
        self._row_costs = sorted((k, c / costs[1]) for k, c in costs.items())
        # relative_cost by row count, filled as rows are asked for: every draft prices up to
        # max_length + 1 lengths, on the engine thread, each step of every run
        self._cost_by_rows: list[float] = []
        self.answers = answers
        self._copies, self._answer_drafts = ChainAcceptance(), ChainAcceptance()
        self._learned_drafts = ChainAcceptance()
        # where the tail repeats nothing: the sources asked in turn, each with its estimate
        self._answer_sources: list[tuple[Callable[[Sequence[int], int], list[int]], ChainAcceptance]] = []
        if learned is not None:
            self._answer_sources.append((learned, self._learned_drafts))
        if answers is not None:
            self._answer_sources.append((answers.draft, self._answer_drafts))
        self._drafted_from = self._copies  # whose estimate the next observe() updates
        self.is_answer_draft = False  # the last draft came from the answers

    @property
    def acceptance(self) -> float:
        """The estimated chance that a copied token is accepted, given the one before it was."""
        return self._copies.value

    @property
    def answer_acceptance(self) -> float:
        """The same for a token drafted from the model's answers."""
        return self._answer_drafts.value

    def extend(self, token_ids: Iterable[int]) -> None:
        self.index.extend(token_ids)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """The last draft verified: its first num_accepted tokens were accepted."""
        self._drafted_from.observe(num_drafted, num_accepted)

    def relative_cost(self, num_rows: int) -> float:
        """A verify of num_rows rows against one row, linear between the measured sizes."""
        table = self._cost_by_rows
        while len(table) <= num_rows:
            table.append(self._interpolated_cost(len(table)))
        return table[num_rows]

    def _interpolated_cost(self, num_rows: int) -> float:
        points = self._row_costs
        if num_rows <= points[0][0]:
            return points[0][1]
        for (k0, c0), (k1, c1) in zip(points, points[1:]):
            if num_rows <= k1:
                return c0 + (c1 - c0) * (num_rows - k0) / (k1 - k0)
        (k0, c0), (k1, c1) = points[-2], points[-1]
        return c1 + (c1 - c0) * (num_rows - k1) / (k1 - k0)

    def draft(self, max_tokens: int, other_rows: int = 0, other_requests: int = 0) -> list[int]:
        """The next step's drafts, at most min(max_tokens, max_length): the copy's first d tokens, d
        maximising the step's expected tokens per cost, (others + 1 + a + ... + a^d) / cost(other_rows +
        1 + d rows), where the step also carries other_rows rows of other_requests requests (a token
        each); where the tail repeats nothing, the same over the model's answers' continuation (if
        any); none where neither drafts or a plain step is worth more. Alone, a drafted token pays
        where it is accepted more often than its row costs against one row (the second row: 14 % in
        DEFAULT_ROW_COSTS, 23-34 % measured on a 2-vCPU EPYC without AVX-512); beside 31 other
        requests, where it is accepted more often than not, for its row then slows theirs too."""
        limit = min(max_tokens, self.max_length)
        copy, estimate = self.index.continuation(limit), self._copies
        # The answers are searched (tens to hundreds of microseconds on the engine thread, per request
        # and step) only where their estimate could pay for a row: beside many requests it seldom does.
        # The search goes only as deep as their estimate could pay for: a longer continuation would be
        # cut back to that length below, and its first tokens do not depend on how far it goes.
        for draft_from, source_estimate in [] if copy else self._answer_sources:
            useful = self._best_length(limit, source_estimate.value, other_rows, other_requests)
            copy = draft_from(self.index.tail(MAX_ANSWER_CONTEXT), useful) if useful > 0 else []
            if copy:
                estimate = source_estimate
                break
        best = self._best_length(len(copy), estimate.value, other_rows, other_requests)
        self._drafted_from = estimate
        self.is_answer_draft = best > 0 and estimate is not self._copies
        return copy[:best]

    def _best_length(self, num_tokens: int, acceptance: float, other_rows: int, other_requests: int) -> int:
        """How many of num_tokens drafted tokens maximise the step's expected tokens per cost."""
        best, expected, p = 0, other_requests + 1.0, 1.0
        best_value = expected / self.relative_cost(other_rows + 1)
        for d in range(1, num_tokens + 1):
            p *= acceptance
            expected += p
            value = expected / self.relative_cost(other_rows + 1 + d)
            if value > best_value:
                best, best_value = d, value
        return best
