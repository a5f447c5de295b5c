"""Tree geometry on hand-computed cases (the example in specdec/engine/tree.py's docstring)."""
from __future__ import annotations

import pytest
import torch

from specdec.engine import tree


def test_depths_and_positions_of_the_docstring_example():
    parents = [-1, 0, 0, -1]             # r ── a ── b, a ── c, r ── d
    assert tree.node_depths(parents) == [1, 2, 2, 1]
    assert tree.verify_positions(5, 1, parents).tolist() == [5, 6, 7, 7, 6]


def test_mask_of_the_docstring_example():
    mask = tree.verify_mask(5, 1, [-1, 0, 0, -1])
    assert mask.shape == (5, 10)
    assert mask[:, :5].all()                               # everybody sees the context
    expected = torch.tensor([[1, 0, 0, 0, 0],              # r
                             [1, 1, 0, 0, 0],              # a
                             [1, 1, 1, 0, 0],              # b
                             [1, 1, 0, 1, 0],              # c
                             [1, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask[:, 5:], expected)


def test_chain_of_uncached_tokens_is_causal_and_hidden_from_nothing():
    mask = tree.verify_mask(2, 3, [-1])                    # chain x y z, one node hanging off z
    assert torch.equal(mask[:, 2:], torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
                                                 dtype=torch.bool))
    assert tree.verify_positions(2, 3, [-1]).tolist() == [2, 3, 4, 5]


def test_single_token_needs_no_mask():
    assert tree.verify_mask(7, 1, []) is None


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, -2], [-1, 0, 3]])
def test_bad_parents_are_refused(parents):
    with pytest.raises(ValueError):
        tree.validate_parents(parents)


def test_is_path():
    parents = [-1, 0, 0, -1]
    assert tree.is_path(parents, [0, 2]) and tree.is_path(parents, [3]) and tree.is_path(parents, [])
    assert not tree.is_path(parents, [2]) and not tree.is_path(parents, [0, 3]) and not tree.is_path(parents, [9])


def test_row_paths_follow_the_chain_then_each_nodes_ancestors():
    from specdec.engine.tree import row_paths
    paths = [p.tolist() for p in row_paths(1, [-1, 0, 0, -1])]      # the module docstring's tree
    assert paths == [[0], [0, 1], [0, 1, 2], [0, 1, 3], [0, 4]]
    assert [p.tolist() for p in row_paths(2, [-1])] == [[0], [0, 1], [0, 1, 2]]
    assert [p.tolist() for p in row_paths(1, [])] == [[0]]
