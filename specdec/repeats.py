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
"""

from __future__ import annotations

from collections.abc import Iterable

MIN_REPEAT_TOKENS = 3  # a tail of this many tokens that occurred earlier is a repeat
MAX_REPEAT_TOKENS = 16  # the longest tail a caller may ask a run to stop at (longer repeats are copies too)


class RepeatIndex:
    """The n-grams (n = MIN_REPEAT_TOKENS by default) of a growing context; see the module docstring."""

    def __init__(self, token_ids: Iterable[int] = (), n: int = MIN_REPEAT_TOKENS) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self._tokens: list[int] = []
        self._followed: set[tuple[int, ...]] = set()
        self.extend(token_ids)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        n, tokens = self.n, self._tokens
        for token in token_ids:
            if len(tokens) >= n:
                self._followed.add(tuple(tokens[-n:]))  # the n-gram before this token is followed now
            tokens.append(int(token))

    def tail_repeats(self) -> bool:
        """Whether the context's last n tokens occurred earlier (with a token after them)."""
        return len(self._tokens) >= self.n and tuple(self._tokens[-self.n :]) in self._followed
