"""Grammar-forced drafts: propose the text the request's grammar leaves no choice about.

In structured output much of the text is fixed by the schema: the opening `{"`, every key in
declared order, `": "`, `", "`, closing brackets, the rest of an enum value once its first letter
is written. Those tokens cost nothing to propose (no model, one jump-forward query of the
grammar state), and the primary accepts them whenever it writes them with the same tokens, which
it usually does because they are re-tokenized with its own tokenizer (see
`specdec.grammar.GrammarState.forced_continuation`), except for the last token before free text,
which the model often merges with what follows: that one is left to the primary (the bonus token). Inside strings and numbers nothing is forced
and this decoder proposes nothing; prompt lookup and the suffix index cover those.

The decoder follows the request's committed tokens with its own grammar state. The first
`extend` may carry the prompt and, when the decoder is created late or after a recovery, the
output committed so far: `num_prompt_tokens` says where the output starts (None: the whole first
call is prompt). Should the committed output ever leave the grammar (the primary did not apply
the mask), the decoder falls silent rather than fail the request.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import ClassVar

from draft_svc.strategies.base import Candidate, DecoderRegistry, validate_propose_args
from specdec.grammar import GrammarCache, ResponseFormat


class GrammarForcedDecoder:
    """Per-request grammar state; proposes at most one candidate, the forced continuation."""

    name: ClassVar[str] = "grammar"

    def __init__(self, grammars: GrammarCache, *, response_format: ResponseFormat,
                 num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is not None and num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
        # An invalid schema raises specdec.errors.InvalidArgument here, naming response_format.json_schema.
        self._state = grammars.compile(response_format).new_state()
        self._num_prompt_tokens = num_prompt_tokens
        self._num_context_tokens = 0      # prompt + output tokens seen through extend()
        self.is_diverged = False          # the committed output left the grammar: propose nothing

    @property
    def num_output_tokens(self) -> int:
        return self._state.num_tokens

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._num_prompt_tokens is None:      # first call without a stated prompt length: all prompt
            self._num_prompt_tokens = len(token_ids)
        num_prompt_left = max(0, self._num_prompt_tokens - self._num_context_tokens)
        self._num_context_tokens += len(token_ids)
        output_ids = [int(t) for t in token_ids[num_prompt_left:]]
        if output_ids and not self.is_diverged and not self._state.accept_tokens(output_ids):
            self.is_diverged = True

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        validate_propose_args(max_tokens, max_candidates)
        if self.is_diverged:
            return ()
        # One token more than asked for tells whether the forced text goes on past max_tokens.
        token_ids = self._state.forced_continuation(max_tokens + 1)
        if len(token_ids) > max_tokens:
            token_ids = token_ids[:max_tokens]       # the cut falls inside forced text: tokens as written
        elif token_ids and not self._ends_output(token_ids):
            # The forced text ends where free text begins, and the model's last token there often
            # spans both: forced ` [` then `]` is written ` [],`; forced `": "` then `Al` is `":` ` "Al`.
            # That token comes free as the step's bonus token instead.
            token_ids = token_ids[:-1]
        return (Candidate(self.name, token_ids),) if token_ids else ()

    def _ends_output(self, token_ids: tuple[int, ...]) -> bool:
        """Whether `token_ids` complete the output (nothing but the end follows, e.g. a final `}`)."""
        if not self._state.accept_tokens(token_ids):
            return False
        is_completed = self._state.is_completed
        self._state.rollback(len(token_ids))
        return is_completed


def register_grammar_decoder(registry: DecoderRegistry, grammars: GrammarCache) -> None:
    """Offer "grammar" in `registry`; the pool creates one per request with
    `registry.create("grammar", response_format=..., num_prompt_tokens=...)`."""
    registry.register(GrammarForcedDecoder.name, functools.partial(GrammarForcedDecoder, grammars))
