"""A request's output side (gateway.output): where a step's tokens end, and their text cut at stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.output import Output

# A byte-level vocabulary, as a byte-level BPE's: "é" is two bytes and comes as two tokens.
A, X, E1, E2, B = range(5)
PIECES = {A: b"a", X: b"x", E1: "é".encode()[:1], E2: "é".encode()[1:], B: b"b"}


class ByteTokenizer:
    """Token ids -> text as a byte-level tokenizer decodes them: a character cut short is U+FFFD."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(PIECES[t] for t in token_ids).decode("utf-8", errors="replace")


def make_output(stop: tuple[str, ...], min_tokens: int = 0) -> Output:
    return Output(
        ByteTokenizer(),  # type: ignore[arg-type]
        [],
        eos=frozenset(),
        stop=stop,
        max_new_tokens=100,
        num_prompt_tokens=3,
        max_context=4096,
        min_tokens=min_tokens,
    )


def test_a_stop_string_before_a_split_character_ends_the_output_at_its_own_token():
    """A step whose last token begins a character ("x" then the first byte of "é") stops at the
    token completing the stop string, as plain decoding does (a token a step); it used to go on to
    the next step, whose tokens then stayed in the output."""
    output = make_output(stop=("x",))
    assert output.add([A, X, E1], []) == (2, True)
    assert output.ready_text(is_final=True) == "a"
    assert output.end(is_flushed=False) == ""


def test_plain_decoding_stops_at_the_same_token():
    output = make_output(stop=("x",))
    generated: list[int] = []
    for t in [A, X, E1]:
        num_kept, is_stopped = output.add([t], generated)
        generated += [t][:num_kept]
        if is_stopped:
            break
    assert generated == [A, X] and output.text == "a"


def test_a_stop_string_in_a_character_split_across_steps_ends_at_its_last_byte():
    output = make_output(stop=("é",))
    assert output.add([A, E1], []) == (2, False)
    assert output.add([E2, B], [A, E1]) == (1, True)
    assert output.ready_text(is_final=True) == "a"


def test_min_tokens_holds_back_stop_strings_as_it_holds_back_end_tokens():
    """As vLLM's: a stop string counts only where it ends in the text past the first min_tokens
    tokens (before, "x" as the second of min_tokens=3 ended the output at one token)."""
    output = make_output(stop=("x",), min_tokens=3)
    generated: list[int] = []
    for t in [A, X, A, B, X, A]:  # plain decoding, a token a step
        num_kept, is_stopped = output.add([t], generated)
        generated += [t][:num_kept]
        if is_stopped:
            break
    assert generated == [A, X, A, B, X] and output.text == "axab"


def test_under_min_tokens_a_step_of_several_tokens_stops_where_plain_decoding_does():
    output = make_output(stop=("x",), min_tokens=3)
    assert output.add([A, X, A, X, B], []) == (4, True)
    assert output.ready_text(is_final=True) == "axa"


def test_a_stop_string_that_begins_inside_the_first_min_tokens_and_ends_past_them_counts():
    output = make_output(stop=("ab",), min_tokens=1)
    assert output.add([A, B, X], []) == (2, True)
    assert output.text == ""


def test_an_output_resumed_past_min_tokens_still_stops_at_a_later_stop_string():
    output = Output(
        ByteTokenizer(),  # type: ignore[arg-type]
        [X, A],
        eos=frozenset(),
        stop=("x",),
        max_new_tokens=100,
        num_prompt_tokens=3,
        max_context=4096,
        min_tokens=2,
    )
    assert output.resumed_finish(2) is None  # the "x" was in the first two tokens
    assert output.add([B, X], [X, A]) == (2, True)
    assert output.text == "xab"


def test_of_several_stop_strings_a_step_cuts_at_the_one_plain_decoding_completes_first():
    """Stop strings "xaba" and "ab": "xaba" begins first but completes a token later, so plain
    decoding (a token a step) stops at "ab", keeping "x"; a step of all four tokens kept the same
    three tokens but cut its text before "xaba", to "", a text that did not match its token_ids."""
    stop = ("xaba", "ab")
    plain = make_output(stop)
    generated: list[int] = []
    for t in [X, A, B, A]:
        num_kept, is_stopped = plain.add([t], generated)
        generated += [t][:num_kept]
        if is_stopped:
            break
    assert generated == [X, A, B] and plain.text == "x"
    output = make_output(stop)
    assert output.add([X, A, B, A], []) == (3, True)
    assert output.ready_text(is_final=True) == "x"
    assert output.end(is_flushed=False) == ""


def test_a_stop_string_completed_past_min_tokens_in_a_character_they_began_counts():
    """min_tokens=2 ends inside "é" (its first byte): the character is the third token's text, so
    "é" ends past the first two tokens' text and stops the output there, as in plain decoding (the
    first two tokens' text counted the cut character, U+FFFD, and "é" never stopped it)."""
    for steps in ([[A], [E1], [E2], [X]], [[A, E1, E2, X]]):
        output = make_output(stop=("é",), min_tokens=2)
        generated: list[int] = []
        for step in steps:
            num_kept, is_stopped = output.add(step, generated)
            generated += step[:num_kept]
            if is_stopped:
                break
        assert generated == [A, E1, E2] and output.text == "a"


def test_the_output_fills_the_context_prompt_and_output_together():
    """max_context bounds prompt + output (specdec.context_room): a prompt 3 tokens short of it gets 3
    tokens, ending LENGTH (it got 2: the gateway kept a token of the context back that the primary
    does not need), and a resumed output that reached it has ended."""
    output = Output(
        ByteTokenizer(),  # type: ignore[arg-type]
        [],
        eos=frozenset(),
        stop=(),
        max_new_tokens=100,
        num_prompt_tokens=13,
        max_context=16,
    )
    assert output.truncate([A, B, A, B], 0) == ([A, B, A], "length")
    assert output.truncate([A, B], 1) == ([A, B], "length")
    assert output.resumed_finish(2) is None and output.resumed_finish(3) == "length"
