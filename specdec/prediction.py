"""The alignment of an output to its prediction (OpenAI's Predicted Outputs), shared by the draft
pool's prediction decoder (draft_svc/strategies/prediction.py), which proposes what follows, and the
gateway, which counts the prediction's tokens the output did not use (rejected_prediction_tokens).

Alignment. It keeps `next`, the position in the prediction that the output is expected to
continue with. Each committed output token equal to prediction[next] moves it on. A different token
loses the alignment (an edit begins); from then on, after every output token, it looks
for the output's last n tokens in the prediction (prompt lookup over the prediction, n from
max_ngram down to min_ngram) and re-anchors after the occurrence it trusts most:

  1. the first occurrence that starts at or after `anchor`, the end of the last run of output that
     followed the prediction for at least min_trusted_run tokens: an edit seldom jumps back, and the
     earliest match after the edit is where the unchanged text resumes;
  2. a single-token match (n = 1) only within max_single_gap tokens of the anchor (a lone common
     token far ahead is noise; a renamed identifier's next token, `(`, right after it is not);
  3. failing both, the latest occurrence before the anchor of an n-gram of at least
     min_backward_ngram tokens (text moved up, a repeated block).

    # E.g. prediction "def total ( items ) :" (one token a word), output so far "def sum":
    #   "total" != "sum": lost, anchor 1 (the run "def" was trusted from the start).
    #   output "def sum (": "(" occurs at 2 >= anchor 1 -> next = 3, propose "items ) :".

Cost: the prediction's n-grams are indexed once (O(len * max_ngram)); an output token costs O(1)
while aligned and O(max_ngram log k) while lost (a bisect in each n-gram's k sorted positions).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from specdec.field_checks import require_at_least_one

LOST = -1  # `next_position` while the output does not follow the prediction


@dataclasses.dataclass(frozen=True, slots=True)
class PredictionConfig:
    max_ngram: int = 6
    min_ngram: int = 1
    # Output tokens in a row that must follow the prediction before the alignment is trusted (moves
    # the anchor); a re-anchoring on an n-gram of at least this many tokens is trusted at once.
    min_trusted_run: int = 3
    max_single_gap: int = 64  # a 1-token match re-anchors at most this far past the anchor
    min_backward_ngram: int = 3  # a match before the anchor needs at least this many tokens

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            )
        require_at_least_one(self, "min_trusted_run", "min_backward_ngram")
        if self.max_single_gap < 0:
            raise ValueError(f"max_single_gap must be >= 0, got {self.max_single_gap}")


class PredictionAlignment:
    """The output, one token at a time, against the prediction; see the module docstring."""

    def __init__(self, prediction_token_ids: Sequence[int], config: PredictionConfig | None = None) -> None:
        self._config = config or PredictionConfig()
        self._prediction = tuple(int(t) for t in prediction_token_ids)
        if self._prediction and min(self._prediction) < 0:
            raise ValueError("prediction_token_ids must be non-negative")
        # (n-gram) -> ascending continuation starts c with prediction[c - n : c] == n-gram
        self._starts: dict[tuple[int, ...], list[int]] = {}
        for n in range(self._config.min_ngram, self._config.max_ngram + 1):
            for c in range(n, len(self._prediction) + 1):
                self._starts.setdefault(self._prediction[c - n : c], []).append(c)
        self._output: list[int] = []
        self._matched = bytearray(len(self._prediction))  # 1 where an output token followed that position
        self._num_matched = 0
        self._next = 0
        self._anchor = 0
        self._run = self._config.min_trusted_run  # the prediction's start is trusted

    @property
    def prediction(self) -> tuple[int, ...]:
        return self._prediction

    @property
    def next_position(self) -> int:
        """The prediction position the output is expected to continue with; LOST while it does not."""
        return self._next

    @property
    def num_matched(self) -> int:
        """Prediction positions that an output token followed (each counted once), re-anchoring
        n-grams included."""
        return self._num_matched

    def add(self, token_ids: Sequence[int]) -> None:
        """The next output tokens."""
        for token in token_ids:
            self._output.append(int(token))
            if self._next != LOST and self._next < len(self._prediction) and self._prediction[self._next] == token:
                self._mark(self._next, self._next + 1)
                self._next += 1
                self._run += 1
            else:
                self._next = self._realigned()
            if self._next != LOST and self._run >= self._config.min_trusted_run:
                self._anchor = self._next

    def _mark(self, start: int, end: int) -> None:
        for position in range(start, end):
            if not self._matched[position]:
                self._matched[position] = 1
                self._num_matched += 1

    def _realigned(self) -> int:
        """The position after the output's suffix in the prediction by the rules of the module
        docstring (and the trust that match earns), or LOST."""
        config, anchor = self._config, self._anchor
        backward, num_backward = LOST, 0
        for n in range(min(config.max_ngram, len(self._output)), config.min_ngram - 1, -1):
            starts = self._starts.get(tuple(self._output[-n:]))
            if not starts:
                continue
            i = bisect.bisect_left(starts, anchor + n)  # the n-gram itself starts at or after the anchor
            if i < len(starts) and (n > 1 or starts[i] - anchor <= config.max_single_gap + 1):
                self._run = n
                self._mark(starts[i] - n, starts[i])
                return starts[i]
            if backward == LOST and n >= config.min_backward_ngram and i > 0:
                backward, num_backward = starts[i - 1], n
        self._run = num_backward
        if backward != LOST:
            self._mark(backward - num_backward, backward)
        return backward
