"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding"): n-grams from Jacobi iteration, computed by the primary in the rows its verify
leaves nearly free, proposed when their first token is the last committed token.

Terms (the paper's): the lookahead window holds W positions x (N - 1) levels of guessed tokens;
level 0 is the oldest Jacobi iteration, level l + 1 the model's next guess over level l. Every step
the window runs beside the verify tree as lookahead rows (VerifyRequest.lookahead), laid out as one
tree off the root:

    level 0:  a0 - a1 - a2            a chain: position i sees the root and a0..ai
               |    |    |
    level 1:  b0   b1   b2            b_i's parent is a_i, c_i's is b_i: row (l, i) sees
               |    |    |            a0..ai, then its own column's earlier levels
    level 2:  c0   c1   c2

Row (l, i) sits at depth i + 1 + l and the primary's argmax there guesses the token after it:
the Jacobi update of position i + l + 1 given the diagonal a0..ai, b_i, .., its own token. With the
window full, column i and the top row's argmax o_i form the n-gram (a_i, b_i, c_i, o_i), pooled
under a_i; then the levels move up one (b -> level 0, c -> level 1, o -> level 2), the window
advancing one position a step as the paper's does, whatever the step committed. While it fills,
the top level's argmaxes become a new level. Level 0 starts as the context's last W tokens.

The n-gram pool maps a first token to its continuations (N - 1 tokens), most recent first, at
most `max_ngrams_per_token` each and `max_first_tokens` keys (least recently updated dropped).
`propose` offers the continuations of the last committed token. Drafts are only guesses: the
primary's verify decides, and the lookahead rows themselves are never accepted.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import ClassVar, Protocol, TypeGuard, runtime_checkable

from draft_svc.strategies.base import (
    Candidate,
    DraftDecoder,
    append_tokens,
    implements,
    new_context,
    validate_propose_args,
)
from specdec.controller_defaults import LOOKAHEAD_LEVELS, LOOKAHEAD_WINDOW
from specdec.engine.tree import ROOT
from specdec.field_checks import require_at_least_one

MAX_LOOKAHEAD_ROWS = 64  # the primary's limit on VerifyRequest.lookahead (specdec.engine.engine)


@dataclasses.dataclass(frozen=True, slots=True)
class LookaheadConfig:
    window: int = LOOKAHEAD_WINDOW  # W: positions per level
    num_levels: int = LOOKAHEAD_LEVELS  # N - 1: pooled n-grams have num_levels + 1 tokens
    max_ngrams_per_token: int = 8  # continuations kept per first token
    max_first_tokens: int = 4096  # first tokens the pool keys at most (per request)

    def __post_init__(self) -> None:
        require_at_least_one(
            self, "window", "num_levels", "max_ngrams_per_token", "max_first_tokens", prefix="lookahead "
        )
        if self.num_rows > MAX_LOOKAHEAD_ROWS:
            raise ValueError(f"lookahead window x num_levels = {self.num_rows} exceeds {MAX_LOOKAHEAD_ROWS} rows")

    @property
    def num_rows(self) -> int:
        """Lookahead rows of a full window (what the gateway's cost model prices)."""
        return self.window * self.num_levels


@runtime_checkable
class LookaheadSource(DraftDecoder, Protocol):
    """A decoder that also has the primary run rows of its own in the verify (the pool's contract)."""

    def lookahead_rows(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(token_ids, parents) of the rows to run with the next verify (parents: ROOT or earlier rows)."""
        ...

    def observe(self, argmax_token_ids: Sequence[int]) -> None:
        """The primary's argmax at each row that `lookahead_rows` last returned, in row order; empty
        when they were not verified."""
        ...


def gives_lookahead(decoder: object) -> TypeGuard[LookaheadSource]:
    """Whether the decoder runs lookahead rows of its own (LookaheadSource; base.implements)."""
    return implements(decoder, LookaheadSource)


def window_tree(levels: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The window as lookahead rows, level after level. E.g. levels [[a0, a1], [b0, b1]] ->
    tokens (a0, a1, b0, b1), parents (-1, 0, 0, 1)."""
    token_ids: list[int] = []
    parents: list[int] = []
    for level, tokens in enumerate(levels):
        for i, token in enumerate(tokens):
            token_ids.append(token)
            if level == 0:
                parents.append(ROOT if i == 0 else i - 1)
            else:
                parents.append((level - 1) * len(tokens) + i)
    return tuple(token_ids), tuple(parents)


class LookaheadDecoder:
    """Per request: the context, the Jacobi window and the n-gram pool; see the module docstring."""

    name: ClassVar[str] = "lookahead"

    def __init__(self, config: LookaheadConfig | None = None) -> None:
        self.config = config or LookaheadConfig()
        self._context = new_context()
        self._levels: list[tuple[int, ...]] = []  # oldest first, each `window` tokens; empty until a context
        self._sent: list[tuple[int, ...]] | None = None  # the levels the last lookahead_rows returned
        # first token -> continuations, most recent first; keys in least-recently-updated order
        self.ngrams: collections.OrderedDict[int, list[tuple[int, ...]]] = collections.OrderedDict()

    @property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self._levels)

    def extend(self, token_ids: Sequence[int]) -> None:
        append_tokens(self._context, token_ids)
        if not self._levels and self._context:
            w = self.config.window
            tail = self._context[-w:]
            self._levels = [tuple(tail[i % len(tail)] for i in range(w))]

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        validate_propose_args(max_tokens, max_candidates)
        if not self._context or max_tokens == 0:
            return ()
        seen: set[tuple[int, ...]] = set()
        out: list[Candidate] = []
        for continuation in self.ngrams.get(self._context[-1], ()):
            draft = continuation[:max_tokens]
            if draft in seen:
                continue
            seen.add(draft)
            out.append(Candidate(self.name, draft, rank=len(out)))
            if len(out) == max_candidates:
                break
        return tuple(out)

    def lookahead_rows(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        self._sent = list(self._levels)
        return window_tree(self._levels)

    def observe(self, argmax_token_ids: Sequence[int]) -> None:
        """One Jacobi iteration: pool the window's n-grams (once full) and move the levels up. No
        argmaxes: the rows were not verified, the window stays. ValueError for any other count than
        the rows last returned."""
        sent, self._sent = self._sent, None
        if not argmax_token_ids:
            return
        num_rows = 0 if sent is None else self.config.window * len(sent)
        if len(argmax_token_ids) != num_rows:
            raise ValueError(f"has {len(argmax_token_ids)} entries for the {num_rows} lookahead rows last proposed")
        assert sent is not None  # argmaxes for rows that were proposed
        w = self.config.window
        top = tuple(int(t) for t in argmax_token_ids[-w:])  # the top level's guesses, one level further
        if len(sent) < self.config.num_levels:
            self._levels = [*sent, top]
            return
        for i in range(w):
            self._pool((*(level[i] for level in sent), top[i]))
        self._levels = [*sent[1:], top]

    def _pool(self, ngram: tuple[int, ...]) -> None:
        first, continuation = ngram[0], ngram[1:]
        continuations = self.ngrams.pop(first, [])
        if continuation in continuations:
            continuations.remove(continuation)
        continuations.insert(0, continuation)
        del continuations[self.config.max_ngrams_per_token :]
        self.ngrams[first] = continuations
        if len(self.ngrams) > self.config.max_first_tokens:
            self.ngrams.popitem(last=False)
