"""Grammar-forced drafts: propose the text the request's grammar leaves no choice about, spelled the
way the model spells it.

In structured output much of the text is fixed by the schema: the opening `{"`, every key in
declared order, `": "`, `", "`, closing brackets, the rest of an enum value once its first letter
is written. Those tokens cost nothing to propose (no model, one jump-forward query of the
grammar state), and the primary accepts them whenever it writes them with the same tokens. The
canonical re-tokenization with the model's tokenizer is how the model writes most of them (see
`specdec.grammar.GrammarState.forced_continuation`), but under the mask it writes some keys in
other pieces (`cl`, `e`, `a`, `n` for `clean`), and then a canonical draft fails at its first
token. So the decoder watches what the model writes wherever text was forced, remembers those
spellings per request (`spellings.SpellingMemory`), and proposes a small tree: rank 0 the spelling
the model used most for this text, then the others and the canonical one (the pool merges them by
common prefix). The controller keeps acceptance per rank, so a request whose model sticks to the
canonical tokens soon drafts rank 0 only.

A text the model has not written before (most keys appear once) has no learned spelling. Where ranks
are left, the decoder then offers the text's other first pieces, shortest first, each followed by
the canonical tokens of the rest: under the mask the model that does not take the canonical first
token mostly takes the shortest (`c`, `s`, `f` for `clean`, `start`, `faq`). On the BFCL json rows
the model took the canonical first token at 60 % of the positions inside forced text with a choice,
the shortest at 30 %; a second rank of this kind cut the steps spent inside forced text by a quarter
in a replay of their outputs.

The last canonical token before free text is left out, because the model often merges it with what
follows: forced ` [` then `]` is written ` [],`; forced `": "` then `Al` is `":` ` "Al`. That token
comes free as the step's bonus token instead. A learned spelling stops where the model's own
tokens stopped inside the forced text, so it needs no such cut. Inside strings and numbers nothing
is forced and this decoder proposes nothing; prompt lookup and the suffix index cover those.

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
from draft_svc.strategies.spellings import DEFAULT_MAX_SHARED_TEXTS, SharedSpellings, Spelling, SpellingMemory
from specdec.grammar import GrammarCache, ResponseFormat


class GrammarForcedDecoder:
    """Per-request grammar state and spelling memory; proposes spellings of the forced text, best first."""

    name: ClassVar[str] = "grammar"

    def __init__(
        self,
        grammars: GrammarCache,
        *,
        response_format: ResponseFormat,
        num_prompt_tokens: int | None = None,
        shared_spellings: SharedSpellings | None = None,
        tenant: str = "",
    ) -> None:
        if num_prompt_tokens is not None and num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
        # An invalid schema raises specdec.errors.InvalidArgument here, naming response_format.json_schema.
        self._state = grammars.compile(response_format).new_state()
        tokenizer = grammars.tokenizer_info.tokenizer
        self._decode, self._encode = tokenizer.decode, tokenizer.encode
        self._spellings = SpellingMemory(tokenizer.encode, tokenizer.decode)
        # the spellings of the pool's requests of the same tenant, for texts this one has not spelled
        self._shared, self._tenant = shared_spellings, tenant
        # The forced text where the current forced run began, and the tokens the model wrote since.
        self._run: tuple[str, list[int]] | None = None
        self._num_prompt_tokens = num_prompt_tokens
        self._num_context_tokens = 0  # prompt + output tokens seen through extend()
        self.is_diverged = False  # the committed output left the grammar: propose nothing

    @property
    def num_output_tokens(self) -> int:
        return self._state.num_tokens

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._num_prompt_tokens is None:  # first call without a stated prompt length: all prompt
            self._num_prompt_tokens = len(token_ids)
        num_prompt_left = max(0, self._num_prompt_tokens - self._num_context_tokens)
        self._num_context_tokens += len(token_ids)
        output_ids = [int(t) for t in token_ids[num_prompt_left:]]
        if output_ids and not self.is_diverged and not self._follow(output_ids):
            self.is_diverged = True

    def _follow(self, output_ids: list[int]) -> bool:
        """Accept committed output tokens one by one; where forced text begins, hand the tokens the
        model writes for it to the spelling memory once they cover it. False: the grammar refused one."""
        for token_id in output_ids:
            if self._run is None and (forced_text := self._state.forced_text()):
                self._run = (forced_text, [])
            if not self._state.accept_tokens((token_id,)):
                return False
            if self._run is not None:
                forced_text, run_ids = self._run
                run_ids.append(token_id)
                if len(self._decode(run_ids)) >= len(forced_text):
                    self._spellings.observe(forced_text, run_ids)
                    if self._shared is not None:
                        self._shared.observe(self._tenant, forced_text, run_ids)
                    self._run = None
        return True

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        validate_propose_args(max_tokens, max_candidates)
        if self.is_diverged or max_tokens == 0:
            return ()
        forced_text = self._state.forced_text()
        if not forced_text:
            return ()
        candidates: list[Candidate] = []
        for spelling in self._learned_spellings(forced_text, max_candidates):
            token_ids = self._draft(spelling, max_tokens)
            if token_ids and all(c.token_ids != token_ids for c in candidates):
                candidates.append(Candidate(self.name, token_ids, rank=len(candidates)))
        if len(candidates) < max_candidates:
            for spelling in self._first_piece_spellings(forced_text):
                token_ids = self._draft(spelling, max_tokens)
                if token_ids and all(c.token_ids[0] != token_ids[0] for c in candidates):
                    candidates.append(Candidate(self.name, token_ids, rank=len(candidates)))
                    if len(candidates) == max_candidates:
                        break
        return tuple(candidates)

    def _learned_spellings(self, forced_text: str, max_candidates: int) -> list[Spelling]:
        """The request's own spellings of `forced_text`; where it has none but the canonical one, the
        spellings other requests taught the pool (the canonical one among them as the memory puts it)."""
        own = self._spellings.spellings(forced_text, max_candidates)
        if self._shared is None:
            return own
        canonical = tuple(self._encode(forced_text))
        if any(s.token_ids != canonical for s in own):
            return own
        return self._shared.spellings(self._tenant, forced_text, max_candidates)

    def _first_piece_spellings(self, forced_text: str) -> list[Spelling]:
        """Each token the grammar allows first that spells a proper prefix of `forced_text`, shortest
        first, followed by the canonical tokens of the rest (module doc). E.g. forced `clean":` ->
        [`c` `lean` `":`, `cl` `ean` `":`, `cle` `an` `":`] (`clean` itself is the canonical one)."""
        pieces = []
        for token_id in self._state.allowed_mask().allowed_ids(0).tolist():
            piece = self._decode([token_id])
            if piece and len(piece) < len(forced_text) and forced_text.startswith(piece):
                pieces.append((len(piece), token_id, piece))
        return [
            Spelling((token_id, *self._encode(forced_text[len(piece) :])), is_canonical_end=True)
            for _, token_id, piece in sorted(pieces)
        ]

    def _draft(self, spelling: Spelling, max_tokens: int) -> tuple[int, ...]:
        """The tokens of `spelling` to propose: those the grammar accepts, at most max_tokens, and
        without the last canonical token before free text (module doc)."""
        token_ids = spelling.token_ids
        token_ids = token_ids[: self._state.num_valid(token_ids)]
        if len(token_ids) > max_tokens:
            return token_ids[:max_tokens]  # the cut falls inside forced text: tokens as written
        if spelling.is_canonical_end and token_ids and not self._ends_output(token_ids):
            return token_ids[:-1]
        return token_ids

    def _ends_output(self, token_ids: tuple[int, ...]) -> bool:
        """Whether `token_ids` complete the output (nothing but the end follows, e.g. a final `}`)."""
        if not self._state.accept_tokens(token_ids):
            return False
        is_completed = self._state.is_completed
        self._state.rollback(len(token_ids))
        return is_completed


def register_grammar_decoder(
    registry: DecoderRegistry, grammars: GrammarCache, is_sharing_spellings: bool = True
) -> None:
    """Offer "grammar" in `registry`; the pool creates one per request with
    `registry.create("grammar", response_format=..., num_prompt_tokens=..., tenant=...)`. With
    `is_sharing_spellings` its requests learn spellings from the same tenant's others (SharedSpellings)."""
    tokenizer = grammars.tokenizer_info.tokenizer
    new_memory = functools.partial(
        SpellingMemory, tokenizer.encode, tokenizer.decode, max_texts=DEFAULT_MAX_SHARED_TEXTS
    )
    shared = SharedSpellings(new_memory) if is_sharing_spellings else None
    registry.register(
        GrammarForcedDecoder.name, functools.partial(GrammarForcedDecoder, grammars, shared_spellings=shared)
    )
