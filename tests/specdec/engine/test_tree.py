"""Tree geometry on hand-computed cases (the example in specdec/engine/tree.py's docstring)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine import tree


def test_depths_and_positions_of_the_docstring_example():
    parents = [-1, 0, 0, -1]  # r ── a ── b, a ── c, r ── d
    assert tree.node_depths(parents) == [1, 2, 2, 1]
    assert tree.verify_position_ids(5, 1, parents) == [5, 6, 7, 7, 6]


def test_mask_of_the_docstring_example():
    mask = tree.verify_mask(5, 1, [-1, 0, 0, -1])
    assert mask.shape == (5, 10)
    assert mask[:, :5].all()  # everybody sees the context
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],  # r
            [1, 1, 0, 0, 0],  # a
            [1, 1, 1, 0, 0],  # b
            [1, 1, 0, 1, 0],  # c
            [1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[:, 5:], expected)


def test_chain_of_uncached_tokens_is_causal_and_hidden_from_nothing():
    mask = tree.verify_mask(2, 3, [-1])  # chain x y z, one node hanging off z
    assert torch.equal(
        mask[:, 2:], torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    )
    assert tree.verify_position_ids(2, 3, [-1]) == [2, 3, 4, 5]


def test_single_token_needs_no_mask():
    assert tree.verify_mask(7, 1, []) is None


@pytest.mark.parametrize(
    "token_ids, parents, field, message",
    [
        ([5], [0], "parents", "parents[0] = 0: must be -1 or the index of an earlier node"),
        ([5, 6], [-1, 1], "parents", "parents[1] = 1: must be -1 or the index of an earlier node"),
        ([5, 6], [-1, -2], "parents", "parents[1] = -2: must be -1 or the index of an earlier node"),
        ([5, 6, 7], [-1, 0, 3], "parents", "parents[2] = 3: must be -1 or the index of an earlier node"),
        ([5, 6], [-1], "parents", "parents has 1 entries, token_ids has 2"),
        ([5, 10], [-1, 0], "token_ids", "token_ids[1] = 10: outside the vocabulary [0, 10)"),
        ([5, -1], [-1, 0], "token_ids", "token_ids[1] = -1: outside the vocabulary [0, 10)"),
    ],
)
def test_a_malformed_tree_is_refused_naming_the_entry(token_ids, parents, field, message):
    with pytest.raises(tree.TreeError) as e:
        tree.check_tree(token_ids, parents, vocab_size=10)
    assert (e.value.field, str(e.value)) == (field, message)


def test_siblings_must_differ_only_in_a_merged_tree():
    # E.g. two children of the root both carrying token 5, and two of node 0 carrying 6.
    for token_ids, parents in (([5, 5], [-1, -1]), ([5, 6, 6], [-1, 0, 0])):
        tree.check_tree(token_ids, parents, vocab_size=10)
        with pytest.raises(tree.TreeError, match=r"repeats a sibling's token") as e:
            tree.check_tree(token_ids, parents, vocab_size=10, is_siblings_unique=True)
        assert e.value.field == "token_ids"
    tree.check_tree([5, 5, 6], [-1, 0, 0], is_siblings_unique=True)  # same token, other parents: fine


def test_is_path():
    parents = [-1, 0, 0, -1]
    assert tree.is_path(parents, [0, 2]) and tree.is_path(parents, [3]) and tree.is_path(parents, [])
    assert not tree.is_path(parents, [2]) and not tree.is_path(parents, [0, 3]) and not tree.is_path(parents, [9])


def test_row_paths_follow_the_chain_then_each_nodes_ancestors():
    from specdec.engine.tree import row_paths

    paths = [p.tolist() for p in row_paths(1, [-1, 0, 0, -1])]  # the module docstring's tree
    assert paths == [[0], [0, 1], [0, 1, 2], [0, 1, 3], [0, 4]]
    assert [p.tolist() for p in row_paths(2, [-1])] == [[0], [0, 1], [0, 1, 2]]
    assert [p.tolist() for p in row_paths(1, [])] == [[0]]
