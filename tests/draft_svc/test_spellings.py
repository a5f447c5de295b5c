"""Spellings of grammar-forced text on hand cases: what is remembered from the model's tokens, and the
ranked spellings (the token tree's candidates) proposed for later forced text."""

from __future__ import annotations

import pytest

from draft_svc.strategies.spellings import Spelling, SpellingMemory

# A toy vocabulary: canonical encoding is greedy longest match, decoding concatenates.
PIECES = ['{"', "{", '"', "clean", "cl", "e", "a", "n", '":', ' "', " true", ', "', "dry", "d", "ry", " ", ":", "}"]
IDS = {piece: i for i, piece in enumerate(PIECES)}


def encode(text: str) -> list[int]:
    out = []
    while text:
        piece = max((p for p in PIECES if text.startswith(p)), key=len)
        out.append(IDS[piece])
        text = text[len(piece) :]
    return out


def decode(token_ids) -> str:
    return "".join(PIECES[t] for t in token_ids)


def ids(*pieces: str) -> tuple[int, ...]:
    return tuple(IDS[p] for p in pieces)


@pytest.fixture()
def memory() -> SpellingMemory:
    return SpellingMemory(encode, decode)


def test_canonical_only_before_anything_is_observed(memory):
    assert memory.spellings('{"clean": ', 3) == [Spelling(ids('{"', "clean", '":', " "), True)]
    assert memory.spellings("", 3) == [] and memory.spellings('{"', 0) == []


def test_observe_keeps_the_tokens_inside_the_forced_text_and_their_suffixes(memory):
    # Forced `{"clean": `; the model wrote {" cl e a n ": then ` true` (reaching into free text).
    spelled = memory.observe('{"clean": ', ids('{"', "cl", "e", "a", "n", '":', " true"))
    assert spelled == ids('{"', "cl", "e", "a", "n", '":')
    # the whole spelling and each suffix at a token boundary (6 texts), and each prefix of two tokens
    # or more short of the whole (4: `{"cl` ... `{"clean`)
    assert memory.num_texts == 10
    # Later `clean": ` is forced (the `{"` already written): the learned pieces first, then the
    # canonical rest ` ` after them; the canonical spelling last.
    assert memory.spellings('clean": ', 3) == [
        Spelling(ids("cl", "e", "a", "n", '":', " "), True),
        Spelling(ids("clean", '":', " "), True),
    ]
    # One spelling asked for: the model's own.
    assert memory.spellings('clean": ', 1) == [Spelling(ids("cl", "e", "a", "n", '":', " "), True)]
    # The learned text inside a longer forced text, at a canonical token boundary (after `, "`).
    assert memory.spellings(', "clean": ', 2) == [
        Spelling(ids(', "', "cl", "e", "a", "n", '":', " "), True),
        Spelling(ids(', "', "clean", '":', " "), True),
    ]
    # The whole forced text spelled by the model: its last token is the model's, not canonical.
    assert memory.spellings('{"clean":', 1) == [Spelling(ids('{"', "cl", "e", "a", "n", '":'), False)]


def test_how_the_model_began_one_forced_text_spells_the_start_of_another(memory):
    """An output's opening `{"` the model wrote as `{` `"` before one key: the next output opening with
    another key gets the model's two pieces, then the canonical rest (a prefix of the spelling)."""
    memory.observe('{"dry": ', ids("{", '"', "dry", '":', " true"))
    assert memory.spellings('{"clean": ', 1) == [Spelling(ids("{", '"', "clean", '":', " "), True)]
    assert memory.spellings('{"clean": ', 2)[1] == Spelling(ids('{"', "clean", '":', " "), True)  # canonical


def test_the_longest_remembered_prefix_and_the_most_used_spelling_come_first(memory):
    memory.observe('dry": ', ids("d", "ry", '":', " true"))
    memory.observe('dry": ', ids("dry", '":', " true"))
    memory.observe('dry": ', ids("dry", '":', " true"))
    # 'dry":' was written as dry ": twice, as d ry ": once; 'ry":' (a suffix of the first) is no
    # prefix of the forced text.
    assert memory.spellings('dry": ', 4) == [
        Spelling(ids("dry", '":', " "), True),
        Spelling(ids("d", "ry", '":', " "), True),
    ]
    # ^ the canonical spelling dry ": ` ` is the first one already: not repeated


def test_a_spelling_must_spell_the_text_exactly(memory):
    # The first token already leaves the forced text: nothing to remember.
    assert memory.observe('{"clean": ', ids('"')) == ()
    assert memory.num_texts == 0


def test_memory_is_bounded():
    memory = SpellingMemory(encode, decode, max_texts=2, max_spellings=1)
    memory.observe("clean", ids("cl", "e", "a", "n"))  # 4 texts: cut to the 2 most recent
    assert memory.num_texts == 2
    memory.observe("an", ids("a", "n"))
    memory.observe("an", ids("a", "n"))
    with pytest.raises(ValueError):
        SpellingMemory(encode, decode, max_texts=0)
