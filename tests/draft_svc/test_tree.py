"""Token tree: merge by common prefix, node budget, node sources, and mapping acceptance back."""

from __future__ import annotations

import pytest

from draft_svc.strategies.base import Candidate
from draft_svc.tree import TokenTree, build_token_tree
from specdec.candidates import candidate_outcomes
from specdec.engine.tree import ROOT

A, B, C, D, E, F = 10, 11, 12, 13, 14, 15


def _candidates(*token_lists: tuple[int, ...]) -> list[Candidate]:
    return [Candidate(f"d{i}", tokens) for i, tokens in enumerate(token_lists)]


def test_shared_prefixes_are_stored_once_in_candidate_major_order():
    # candidates [a b c], [a b d], [e] -> tokens [a b c d e], parents [-1 0 1 1 -1]
    tree = build_token_tree(_candidates((A, B, C), (A, B, D), (E,)), max_nodes=16)
    assert tree.token_ids == (A, B, C, D, E)
    assert tree.parents == (ROOT, 0, 1, 1, ROOT)
    assert tree.depths == (1, 2, 3, 3, 1)
    assert tree.node_sources == (0b011, 0b011, 0b001, 0b010, 0b100)
    assert tree.decoders == ("d0", "d1", "d2")
    assert tree.max_depth == 3


def test_duplicate_and_prefix_candidates_collapse():
    # [a b], [a b], [a] -> one chain [a b]; every candidate's bit on the nodes it passes through
    tree = build_token_tree(_candidates((A, B), (A, B), (A,)), max_nodes=16)
    assert tree.token_ids == (A, B)
    assert tree.parents == (ROOT, 0)
    assert tree.node_sources == (0b111, 0b011)


def test_same_token_under_different_parents_is_two_nodes():
    # [a b], [b a] -> b appears at depth 2 and depth 1: four nodes, children of one parent distinct
    tree = build_token_tree(_candidates((A, B), (B, A)), max_nodes=16)
    assert tree.token_ids == (A, B, B, A)
    assert tree.parents == (ROOT, 0, ROOT, 2)


def test_budget_keeps_the_first_chain_whole_then_goes_breadth_first():
    # [a b c], [a b d], [e f], max_nodes 4 -> [a b c] whole; depth 1: e (a is shared); depth 2: budget gone
    tree = build_token_tree(_candidates((A, B, C), (A, B, D), (E, F)), max_nodes=4)
    assert tree.token_ids == (A, B, C, E)
    assert tree.parents == (ROOT, 0, 1, ROOT)
    assert tree.node_sources == (0b011, 0b011, 0b001, 0b100)
    # with one more node, depth 2 goes to candidate 2's f before candidate 1's depth-3 d
    tree = build_token_tree(_candidates((A, B, C), (A, B, D), (E, F)), max_nodes=5)
    assert tree.token_ids == (A, B, C, E, F)
    assert tree.parents == (ROOT, 0, 1, ROOT, 3)


def test_budget_smaller_than_the_first_chain_truncates_it():
    tree = build_token_tree(_candidates((A, B, C), (E,)), max_nodes=2)
    assert tree.token_ids == (A, B)
    assert build_token_tree(_candidates((A, B, C)), max_nodes=0).num_nodes == 0
    with pytest.raises(ValueError, match="max_nodes"):
        build_token_tree(_candidates((A,)), max_nodes=-1)


def test_empty_candidates_keep_their_index_for_the_bitmask():
    tree = build_token_tree(_candidates((), (A,)), max_nodes=4)
    assert tree.token_ids == (A,)
    assert tree.node_sources == (0b10,)


def test_truncated_candidate_counts_only_its_kept_tokens():
    tree = build_token_tree(_candidates((A, B, C), (E, F)), max_nodes=4)
    assert [o.num_proposed for o in candidate_outcomes(tree.decoders, tree.node_sources, [3], tree.parents)] == [3, 1]


def test_tree_validates_its_invariants():
    with pytest.raises(ValueError, match="earlier node"):
        TokenTree(token_ids=(A, B), parents=(1, ROOT), depths=(2, 1), node_sources=(1, 1), decoders=("d",))
    with pytest.raises(ValueError, match="repeats a sibling"):
        TokenTree(
            token_ids=(A, A),
            parents=(ROOT, ROOT),
            depths=(1, 1),
            node_sources=(1, 2),
            decoders=("d", "e"),
        )
    with pytest.raises(ValueError, match="depths"):
        TokenTree(token_ids=(A, B), parents=(ROOT, 0), depths=(1, 3), node_sources=(1, 1), decoders=("d",))
