"""Grammar state: hand-computed forced text, masks, all-or-nothing accept, rollback, tree masks
against a brute-force replay of every root-to-node path."""

from __future__ import annotations

import random

import pytest
import torch

from tests.schemas import PERSON_SCHEMA

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture()
def state(grammar_cache):
    return grammar_cache.compile_response_format("json_schema", PERSON_SCHEMA).new_state()


def allowed_row(state) -> torch.Tensor:
    """bool [V]: the state's next-token mask, unpacked for inspection."""
    return state.allowed_mask().to_bool()[0]


def _pieces(tokenizer, token_ids) -> list[str]:
    return [tokenizer.decode([t]) for t in token_ids]


def _advance(state, tokenizer, text: str) -> None:
    assert state.accept_tokens(tokenizer.encode(text)), text


# (text accepted so far, forced text the grammar allows next, its tokens as the model's BPE writes it)
FORCED_CASES = [
    ("", '{"name": "', ['{"', "name", '":', ' "']),
    ('{"name": "Bob', "", []),  # inside a string: the model's choice
    ('{"name": "Bob"', ', "age": ', [",", ' "', "age", '":', " "]),
    ('{"name": "Bob", "age": 42', "", []),  # more digits may follow
    ('{"name": "Bob", "age": 42,', ' "unit": "', [' "', "unit", '":', ' "']),
    ('{"name": "Bob", "age": 42, "unit": "', "", []),  # celsius | fahrenheit
    ('{"name": "Bob", "age": 42, "unit": "f', 'ahrenheit"}', ["ahrenheit", '"}']),
    ('{"name": "Bob", "age": 42, "unit": "fahrenheit"}', "", []),  # complete: only EOS may follow
]


@pytest.mark.parametrize("prefix, forced_text, forced_pieces", FORCED_CASES)
def test_forced_continuation_by_hand(state, tokenizer, prefix, forced_text, forced_pieces):
    if prefix:
        _advance(state, tokenizer, prefix)
    forced = state.forced_continuation(max_tokens=16)
    assert tokenizer.decode(forced) == forced_text
    assert _pieces(tokenizer, forced) == forced_pieces
    assert list(forced) == tokenizer.encode(forced_text)  # re-tokenized with the model's BPE
    assert state.forced_continuation(max_tokens=2) == forced[:2]
    assert state.num_tokens == len(tokenizer.encode(prefix))  # proposing does not move the state


# (text accepted so far, the tokens the grammar then allows alone, one after another)
FORCED_TOKEN_CASES = [
    ("", []),  # `{` or `{"`: a choice
    ("{", ['"']),  # then `n`, `na`, `nam` or `name`: a choice
    ('{"name": "Bob"', [","]),  # then ` "` or ` ` (a space, then `"`): a choice
    ('{"name": "Bob", "age": 42', []),  # a digit or `,`
    ('{"name": "Bob", "age": 42, "unit": "c', []),  # `e`, `el`, `els` or `elsius`
    ('{"name": "Bob", "age": 42, "unit": "celsius"', ["}", "<|im_end|>"]),  # the end is forced too
    ('{"name": "Bob", "age": 42, "unit": "celsius"}', ["<|im_end|>"]),
]


@pytest.mark.parametrize("prefix, forced_pieces", FORCED_TOKEN_CASES)
def test_forced_token_ids_by_hand(state, tokenizer, prefix, forced_pieces):
    if prefix:
        _advance(state, tokenizer, prefix)
    num_tokens = state.num_tokens
    forced = state.forced_token_ids(max_tokens=8)
    assert [tokenizer.decode([t], skip_special_tokens=False) for t in forced] == forced_pieces
    assert state.num_tokens == num_tokens  # a query: the state does not move
    for token_id in forced:  # each is the only token its row allows
        assert allowed_row(state).nonzero().flatten().tolist() == [token_id]
        assert state.accept_tokens([token_id])
    assert state.forced_token_ids(max_tokens=8) == ()  # a choice (or the end) follows the run


def test_forced_token_ids_stop_at_max_tokens_and_after_the_end(state, tokenizer):
    _advance(state, tokenizer, '{"name": "Bob", "age": 42, "unit": "celsius"')
    assert len(state.forced_token_ids(max_tokens=2)) == 2
    assert len(state.forced_token_ids(max_tokens=1)) == 1
    assert state.forced_token_ids(max_tokens=0) == ()
    assert state.accept_tokens(state.forced_token_ids(max_tokens=2)) and state.is_terminated
    assert state.forced_token_ids(max_tokens=8) == ()  # only the end again, forever: not a run


def test_masks_by_hand(state, tokenizer):
    start = allowed_row(state)
    assert start.shape == (state.vocab_size,) and start.dtype == torch.bool
    # '{"name": "' is forced; SmolLM2 has exactly two tokens that start it
    assert sorted(_pieces(tokenizer, start.nonzero().flatten().tolist())) == ["{", '{"']
    _advance(state, tokenizer, '{"name": "Bob", "age": ')
    digits = set(_pieces(tokenizer, allowed_row(state).nonzero().flatten().tolist()))
    assert {"1", "9", "-"} <= digits and not {"a", '"', " "} & digits
    _advance(state, tokenizer, '42, "unit": "celsius"}')
    assert state.is_completed and not state.is_terminated
    assert allowed_row(state).nonzero().flatten().tolist() == [EOS]
    assert state.accept_tokens([EOS]) and state.is_terminated
    assert allowed_row(state).nonzero().flatten().tolist() == [EOS]  # after the end, only the end again
    assert state.forced_continuation(8) == ()


def test_special_tokens_are_refused_even_inside_strings(state, tokenizer):
    _advance(state, tokenizer, '{"name": "')
    in_string = allowed_row(state)
    assert not in_string[:17].any()  # <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...
    assert in_string.sum() > 40000  # almost anything else may go into a string
    assert not state.accept_tokens([1])


def test_accept_is_all_or_nothing(state, tokenizer):
    _advance(state, tokenizer, '{"name": "Bob"')
    before = (state.num_tokens, allowed_row(state))
    good, bad = tokenizer.encode(', "age": '), tokenizer.encode("}")
    assert not state.accept_tokens(good + bad)  # '}' is refused: "age" and "unit" are required
    assert (state.num_tokens, allowed_row(state).tolist()) == (before[0], before[1].tolist())
    assert not state.accept_tokens([-1]) and not state.accept_tokens([state.vocab_size])


def test_rollback_restores_masks_and_forced_text(state, tokenizer):
    token_ids = tokenizer.encode('{"name": "Bob", "age": 42, "unit": "celsius"}') + [EOS]
    history = []
    for token_id in token_ids:
        history.append((allowed_row(state), state.forced_continuation(16), state.is_completed))
        assert state.accept_tokens([token_id])
    for position in reversed(range(len(token_ids))):
        state.rollback(1)
        mask, forced, is_completed = history[position]
        assert torch.equal(allowed_row(state), mask) and state.forced_continuation(16) == forced
        assert state.is_completed == is_completed and not state.is_terminated
    with pytest.raises(ValueError, match="cannot roll back 1 of 0"):
        state.rollback(1)


def test_fork_is_independent(state, tokenizer):
    _advance(state, tokenizer, '{"name": "Bob"')
    twin = state.fork()
    _advance(twin, tokenizer, ', "age": 1')
    assert state.num_tokens + len(tokenizer.encode(', "age": 1')) == twin.num_tokens
    assert tokenizer.decode(state.forced_continuation(8)) == ', "age": '


# --- tree masks ------------------------------------------------------------------------------------


def brute_force_tree_masks(state, token_ids, parents):
    """Replay every root-to-node path on a fork of the state: what tree_masks must equal."""
    rows, valid = [allowed_row(state)], []
    for node in range(len(token_ids)):
        path = []
        cursor = node
        while cursor != -1:
            path.append(token_ids[cursor])
            cursor = parents[cursor]
        replay = state.fork()
        is_valid = replay.accept_tokens(path[::-1])
        valid.append(is_valid)
        rows.append(allowed_row(replay) if is_valid else torch.ones(state.vocab_size, dtype=torch.bool))
    return torch.stack(rows), torch.tensor(valid, dtype=torch.bool)


def test_tree_masks_by_hand(state, tokenizer):
    _advance(state, tokenizer, '{"name": "Bob"')
    comma, space_quote, age, brace, colon = (tokenizer.encode(t)[0] for t in (",", ' "', "age", "}", '":'))
    # node 0 ','  -> node 1 ' "' -> node 2 'age' -> node 3 '":'
    # node 4 '}'  (refused: fields are missing) -> node 5 ','   (under an invalid node: invalid too)
    token_ids = [comma, space_quote, age, colon, brace, comma]
    parents = [-1, 0, 1, 2, -1, 4]
    masks = state.tree_masks(token_ids, parents)
    assert masks.is_valid_node.tolist() == [True, True, True, True, False, False]
    allowed = masks.allowed.to_bool()
    assert allowed.shape == (7, state.vocab_size)
    assert allowed[0, comma] and not allowed[0, brace]  # row 0: after the context
    assert _pieces(tokenizer, allowed[1].nonzero().flatten().tolist()) == [" ", ' "']  # after ','
    assert allowed[4, tokenizer.encode(" ")[0]]  # after '":' comes ' '
    assert allowed[5].all() and allowed[6].all()  # unreachable rows: no constraint
    expected_allowed, expected_valid = brute_force_tree_masks(state, token_ids, parents)
    assert torch.equal(allowed, expected_allowed) and torch.equal(masks.is_valid_node, expected_valid)


def _random_tree(state, rng: random.Random, num_nodes: int):
    """A tree grown from allowed tokens (usually) and random ones (sometimes), so that valid,
    invalid and terminated (EOS) nodes all occur."""
    token_ids, parents = [], []
    for node in range(num_nodes):
        parent = rng.choice([-1] + list(range(node)))
        path, cursor = [], parent
        while cursor != -1:
            path.append(token_ids[cursor])
            cursor = parents[cursor]
        replay = state.fork()
        allowed = allowed_row(replay).nonzero().flatten().tolist() if replay.accept_tokens(path[::-1]) else []
        siblings = {token_ids[i] for i in range(node) if parents[i] == parent}
        choices = [t for t in allowed if t not in siblings]
        token = rng.choice(choices) if choices and rng.random() < 0.8 else rng.randrange(state.vocab_size)
        if token in siblings:
            token = next(t for t in range(state.vocab_size) if t not in siblings)
        token_ids.append(token)
        parents.append(parent)
    return token_ids, parents


@pytest.mark.parametrize("prefix", ["", '{"name": "Bob", "age": 4', '{"name": "Bob", "age": 42, "unit": "c'])
def test_tree_masks_equal_brute_force_on_random_trees(state, tokenizer, prefix):
    if prefix:
        _advance(state, tokenizer, prefix)
    rng = random.Random(len(prefix))
    for _ in range(3):
        token_ids, parents = _random_tree(state, rng, num_nodes=12)
        before = (state.num_tokens, allowed_row(state))
        masks = state.tree_masks(token_ids, parents)
        expected_allowed, expected_valid = brute_force_tree_masks(state, token_ids, parents)
        assert torch.equal(masks.is_valid_node, expected_valid)
        assert torch.equal(masks.allowed.to_bool(), expected_allowed)
        assert state.num_tokens == before[0] and torch.equal(allowed_row(state), before[1])


def test_tree_masks_after_eos_allow_only_eos(state, tokenizer):
    _advance(state, tokenizer, '{"name": "Bob", "age": 42, "unit": "celsius"')
    brace = tokenizer.encode("}")[0]
    masks = state.tree_masks([brace, EOS, brace], [-1, 0, 1])
    assert masks.is_valid_node.tolist() == [True, True, False]  # nothing follows EOS
    assert masks.allowed.to_bool()[2].nonzero().flatten().tolist() == [EOS]  # the row after EOS: a finite softmax


def test_tree_masks_reject_bad_parents(state):
    with pytest.raises(ValueError, match="parents\\[1\\] = 1"):
        state.tree_masks([5, 6], [-1, 1])
    with pytest.raises(ValueError, match="parents has 2 entries, token_ids has 1"):
        state.tree_masks([5], [-1, -1])
