"""Prompt lookup: propose the tokens that followed an earlier occurrence of the context's last n tokens.

Prompt lookup decoding (Saxena 2023; `prompt_lookup_num_tokens` in transformers, the n-gram
proposer in vLLM) matches the suffix of prompt + generated tokens against the same sequence.

Ranking rule, which fixes both the single answer and the top-k:
  1. longer n-grams first (max_ngram down to min_ngram): a longer match is better evidence;
  2. within one n, the most recent occurrence first: recent text predicts the next text best;
  3. a continuation equal to, or a prefix of, an already ranked one is skipped, so the k
     candidates are distinct and each adds at least one node to the token tree.
So rank 0 is "the most recent match of the longest n"; ranks 1.. are the next distinct ones.

Continuation: the tokens after the match, copied LZ77-style. When the match ends less than
max_tokens before the context end, the copy runs into tokens it is itself predicting, so the
text repeats with period L - c (E.g. context [x y x y x y], match of [x y] at c=4:
continuation [x y x y ...] rather than a 2-token stub).

Incremental index (the hash chains of zlib/LZ77): for every n, `_last_start[key]` is the most
recent continuation start c of the n-gram `key` (= context[c-n:c]), and `_prev_start[n][c]` the
start of the previous occurrence of the same n-gram, or NO_POSITION. An n-gram is indexed only
once a token follows it, so the context's own suffix never matches itself. extend() costs
O(num_new_tokens * num_ngram_sizes); propose() costs O(max_ngram^2 + max_tokens) for one
candidate and O(max_ngram * max_chain_steps * max_tokens) at most for k candidates: it never
rescans the context. Memory: one dict entry per distinct (n, n-gram) and 4 bytes per token per n.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from typing import ClassVar

from draft_svc.strategies.base import TOKEN_TYPECODE, Candidate, append_tokens, new_context, validate_propose_args
from specdec.field_checks import require_at_least_one

NO_POSITION = -1  # end of a hash chain: no earlier occurrence
_TOKEN_BYTES = array(TOKEN_TYPECODE).itemsize  # n-gram keys are n * 4 bytes, so sizes never collide


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLookupConfig:
    max_ngram: int = 4
    min_ngram: int = 1
    # Occurrences examined per n-gram size when ranking several candidates: bounds propose() on
    # very repetitive text, where one n-gram can occur thousands of times.
    max_chain_steps: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            )
        require_at_least_one(self, "max_chain_steps")


class PromptLookupDecoder:
    """Per-request n-gram index over prompt + committed tokens; see the module docstring."""

    name: ClassVar[str] = "prompt_lookup"

    def __init__(self, config: PromptLookupConfig | None = None) -> None:
        self._config = config or PromptLookupConfig()
        self._ngram_sizes = range(self._config.min_ngram, self._config.max_ngram + 1)
        self._tokens = new_context()
        self._last_start: dict[bytes, int] = {}
        # _prev_start[n - min_ngram][c]: previous continuation start of context[c-n:c]; one entry per token
        self._prev_start = [array(TOKEN_TYPECODE) for _ in self._ngram_sizes]

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Sequence[int]) -> None:
        old_len = len(self._tokens)
        append_tokens(self._tokens, token_ids)
        new_len = len(self._tokens)
        # Every c in [old_len, new_len) now has a token, so the n-gram ending just before it is indexable.
        # E.g. context [a b] + extend([c]): c=2 indexes "b" (n=1) and "a b" (n=2), both pointing at 2.
        tail_start = max(0, old_len - self._config.max_ngram)
        tail = self._tokens[tail_start:new_len].tobytes()
        for size_idx, n in enumerate(self._ngram_sizes):
            prev = self._prev_start[size_idx]
            for c in range(old_len, new_len):
                if c < n:
                    prev.append(NO_POSITION)
                    continue
                key = tail[(c - n - tail_start) * _TOKEN_BYTES : (c - tail_start) * _TOKEN_BYTES]
                prev.append(self._last_start.get(key, NO_POSITION))
                self._last_start[key] = c

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        validate_propose_args(max_tokens, max_candidates)
        num_tokens = len(self._tokens)
        if max_tokens == 0 or num_tokens == 0:
            return ()
        tail = self._tokens[max(0, num_tokens - self._config.max_ngram) :].tobytes()
        found: list[tuple[int, ...]] = []
        for size_idx in reversed(range(len(self._ngram_sizes))):
            n = self._ngram_sizes[size_idx]
            if n > num_tokens:
                continue
            c = self._last_start.get(tail[len(tail) - n * _TOKEN_BYTES :], NO_POSITION)
            prev = self._prev_start[size_idx]
            for _ in range(self._config.max_chain_steps):
                if c == NO_POSITION:
                    break
                continuation = self._continuation(c, max_tokens)
                if not any(seen[: len(continuation)] == continuation for seen in found):
                    found.append(continuation)
                    if len(found) == max_candidates:
                        return self._candidates(found)
                c = prev[c]
        return self._candidates(found)

    def _continuation(self, start: int, max_tokens: int) -> tuple[int, ...]:
        out = self._tokens[start : start + max_tokens].tolist()
        period = len(self._tokens) - start  # = len(out) whenever the copy reaches the context end
        while len(out) < max_tokens:
            out.append(out[len(out) - period])
        return tuple(out)

    def _candidates(self, continuations: list[tuple[int, ...]]) -> tuple[Candidate, ...]:
        return tuple(Candidate(self.name, tokens, rank=rank) for rank, tokens in enumerate(continuations))
