"""A request's output as its steps commit tokens (Output): where the tokens end, and their text.

The tokens end before an end-of-sequence token or at a length limit: max_new_tokens, or the
context's room (truncate). Their text is detokenized as they commit and cut at the first of the
request's stop strings; a step that completes one keeps only its tokens up to the one completing
it (add). A step's text goes out without a tail that could still become a stop string, until the
output ends (ready_text, end). With min_tokens, as vLLM's, a stop string counts only where it ends
in the text of the tokens past the first min_tokens: the end tokens are held back until then
(the primary's logits), and so are the stop strings.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence, Set

from specdec.context_room import output_room
from specdec.model.tokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    Tokenizer,
    find_stop_string,
    num_held_back_chars,
)

FINISH_LENGTH, FINISH_STOP, FINISH_EOS = "length", "stop", "eos"


class Output:
    """One request's output side: its end-of-sequence tokens and limits, its stop strings, and the
    text of its committed tokens (`generated`: those a resumed request had before), of which the
    first `emitted_chars` characters went out."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        generated: list[int],
        *,
        eos: Set[int],
        stop: Sequence[str],
        max_new_tokens: int,
        num_prompt_tokens: int,
        max_context: int,
        stop_token_ids: Set[int] = frozenset(),
        min_tokens: int = 0,
    ) -> None:
        """`eos`: every token that ends the output; of them, `stop_token_ids` the request's own,
        which finish it as a stop string does; `min_tokens`: the tokens no stop string ends in."""
        self.tokenizer, self.eos, self.stop = tokenizer, eos, stop
        self.stop_token_ids = stop_token_ids
        self.max_new_tokens, self.num_prompt_tokens, self.max_context = max_new_tokens, num_prompt_tokens, max_context
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = self.detok.add(generated) if generated else ""
        self.min_tokens = min_tokens
        # the characters of the first min_tokens tokens' text, once there are that many (0: none)
        self._min_chars: int | None = 0 if min_tokens == 0 else None
        self._reach_min_tokens(generated)
        self.emitted_chars = len(self.text)
        self.is_stopped = False  # the text was cut at a stop string: nothing after it is flushed (end)

    def truncate(self, new_tokens: list[int], num_generated: int) -> tuple[list[int], str | None]:
        """A step's new tokens up to the output's end, after `num_generated` committed ones, and the
        finish reason when they reach it: before an end-of-sequence token (eos), or at max_new_tokens
        or the context's room (length); before one of the request's stop_token_ids (stop)."""
        kept: list[int] = []
        for t in new_tokens:
            if t in self.eos:
                return kept, FINISH_STOP if t in self.stop_token_ids else FINISH_EOS
            kept.append(t)
            if self._is_full(num_generated + len(kept)):
                return kept, FINISH_LENGTH
        return kept, None

    def resumed_finish(self, num_generated: int) -> str | None:
        """The finish reason of a resumed output that had already ended (its gateway went after it
        stored the last step, before the end), its text cut at the stop string; None when it goes on.
        An end token is not stored: decoded again, it ends the output again."""
        if self.stop:
            text, is_stopped = self._cut_at_stop(self.text + self.detok.held_back())
            if is_stopped:
                self.text, self.is_stopped = text, True
                return FINISH_STOP
        return FINISH_LENGTH if self._is_full(num_generated) else None

    def _is_full(self, num_generated: int) -> bool:
        """The output reached max_new_tokens or the context's room."""
        return num_generated >= min(self.max_new_tokens, output_room(self.num_prompt_tokens, self.max_context))

    def _reach_min_tokens(self, tokens: list[int]) -> None:
        """Where the text of the first min_tokens tokens ends, once `tokens` (the output's) has them:
        a character they end inside of is the text of the token that completes it, after them."""
        if self._min_chars is None and len(tokens) >= self.min_tokens:
            text = self.tokenizer.decode(tokens[: self.min_tokens])
            self._min_chars = len(text.rstrip(REPLACEMENT_CHAR))

    def add(self, kept: list[int], generated: list[int]) -> tuple[int, bool]:
        """The text of a step's tokens `kept`, committed after `generated`, cut at the first stop
        string: (how many of `kept` the output keeps, whether a stop string completed)."""
        if self._min_chars is None:
            self._reach_min_tokens(generated + kept)
        delta = self.detok.add(kept)
        self.text, is_stopped = self._cut_at_stop(self.text + delta)
        if not is_stopped and self.stop and kept and not delta:
            # A step that ends inside a character has its text held back whole, yet a stop string
            # may complete before that character: plain decoding (a token a step) stops there.
            held_back = self.detok.held_back()
            if held_back:
                text, is_stopped = self._cut_at_stop(self.text + held_back)
                if is_stopped:
                    self.text = text
        self.is_stopped = is_stopped
        if not is_stopped or len(kept) <= 1:
            return len(kept), is_stopped
        # A step can commit several tokens: keep only those up to the one completing the stop
        # string, so token_ids match what plain decoding stops at. (Rare: decodes at most a step.)
        # The text is cut where plain decoding cuts it too: at that token's stop string, not at one
        # that begins earlier but completes only at a later token of the step (several stop strings).
        for k in range(1, len(kept) + 1):
            text, is_complete = self._cut_at_stop(self.tokenizer.decode(generated + kept[:k]))
            if is_complete:
                self.text = text
                return k, True
        return len(kept), True

    def ready_text(self, is_final: bool) -> str:
        """The text that became final since the last call: all of it at the output's end (is_final),
        else all but a tail that could still become a stop string."""
        ready = len(self.text) if is_final else len(self.text) - num_held_back_chars(self.text, self.stop)
        delta = self.text[self.emitted_chars : ready]
        self.emitted_chars = max(self.emitted_chars, ready)
        return delta

    def cut_back(self, num_chars: int) -> None:
        """A step the store refused leaves the text: its first `num_chars` characters stay."""
        self.text = self.text[:num_chars]

    def end(self, is_flushed: bool) -> str:
        """The text that became final at the output's end and no step sent: when is_flushed (the
        output did not end at a stop string, is_stopped, or a refused step), first what the
        detokenizer held back, cut at a stop string."""
        if is_flushed:
            self.text = self._cut_at_stop(self.text + self.detok.finish())[0]
        return self.text[self.emitted_chars :]

    def _cut_at_stop(self, text: str) -> tuple[str, bool]:
        """`text` cut before its earliest stop string that ends past the first min_tokens tokens'
        text, and whether one did."""
        if not self.stop or self._min_chars is None:
            return text, False
        # a match may begin before that text's end, not end within it (find_stop_string's start)
        cut = find_stop_string(text, self.stop, start=self._min_chars)
        return (text, False) if cut is None else (text[:cut], True)


def stored_output(tokenizer: Tokenizer, stop: Sequence[str], min_tokens: int) -> Output:
    """The output of a stored request for one that reads it (a retry following it, GetRequest), cut
    at its stop strings as its loop's output cut it: its tokens are stored up to the one completing a
    stop string, their text is not. Add its tokens one at a time (add_stored)."""
    return Output(
        tokenizer,
        [],
        eos=frozenset(),
        stop=stop,
        max_new_tokens=sys.maxsize,
        num_prompt_tokens=0,
        max_context=sys.maxsize,
        min_tokens=min_tokens,
    )


def add_stored(output: Output, token_ids: Sequence[int], generated: list[int]) -> None:
    """Stored tokens after `generated` (which they extend). A stored output ends at the token that
    completes its stop string, so all but the last token go in at once, then the last: each text
    is decoded and searched once, not once a token (a stored output of thousands of tokens). Were
    a stop string completed before the last, add would still cut where plain decoding does."""
    for batch in (token_ids[:-1], token_ids[-1:]) if output.stop else (token_ids,):
        if output.is_stopped:
            return
        if batch:
            output.add(list(batch), generated)
            generated.extend(batch)
