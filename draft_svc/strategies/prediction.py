"""Predicted Outputs: propose what follows in the request's own prediction of its output.

OpenAI's Predicted Outputs (`prediction: {"type": "content", ...}`) hands the server most of the
answer in advance: a file to edit, a document to revise. Here that text is a draft like any other:
this decoder proposes its tokens, the primary verifies them, and the output is the primary's own
(greedy output is the same with or without a prediction; sampling stays lossless through the
validator). A right prediction drafts long: a whole unchanged stretch is accepted in one step.

The decoder follows the output with specdec.prediction.PredictionAlignment (the prediction's tokens
aligned to the output as it grows, re-anchored after an edit like prompt lookup over the
prediction) and proposes the prediction from the aligned position on; nothing while the output does
not follow it.

Tokens the prompt holds are not output: the first `extend` (the prompt, and on a late creation the
output so far) says with `num_prompt_tokens` where the output starts. Before any output the
decoder expects the prediction's first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from draft_svc.strategies.base import Candidate, validate_propose_args
from specdec.prediction import LOST, PredictionAlignment, PredictionConfig


class PredictionDecoder:
    """Per-request alignment of the output to the request's prediction; propose() copies at most
    max_tokens of the prediction."""

    name: ClassVar[str] = "prediction"

    def __init__(
        self,
        config: PredictionConfig | None = None,
        *,
        prediction_token_ids: Sequence[int],
        num_prompt_tokens: int = 0,
    ) -> None:
        if num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
        self._alignment = PredictionAlignment(prediction_token_ids, config)
        self._num_prompt_left = num_prompt_tokens  # prompt tokens still to skip in extend()

    @property
    def next_position(self) -> int:
        """The prediction position the output is expected to continue with; LOST while it does not."""
        return self._alignment.next_position

    def extend(self, token_ids: Sequence[int]) -> None:
        skipped = min(self._num_prompt_left, len(token_ids))
        self._num_prompt_left -= skipped
        self._alignment.add(token_ids[skipped:])

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        validate_propose_args(max_tokens, max_candidates)
        start, prediction = self._alignment.next_position, self._alignment.prediction
        if start == LOST or start >= len(prediction) or max_tokens == 0:
            return ()
        return (Candidate(self.name, prediction[start : start + max_tokens]),)
