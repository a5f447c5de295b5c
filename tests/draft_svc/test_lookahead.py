"""Lookahead decoding's window and n-gram pool on a hand-built Jacobi trace, and its rows through the pool."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from draft_svc.pool import DraftPool, PoolConfig
from specdec.propose_args import ProposeArgs
from draft_svc.strategies import DecoderRegistry, model_free_registry
from draft_svc.strategies.lookahead import LookaheadConfig, LookaheadDecoder, window_tree
from specdec.errors import InvalidArgument

# W = 2 positions x 2 levels: pooled n-grams are 3 tokens
CONFIG = LookaheadConfig(window=2, num_levels=2, max_ngrams_per_token=2, max_first_tokens=3)


def continuations(decoder: LookaheadDecoder, max_tokens: int = 8, max_candidates: int = 4) -> list[tuple[int, ...]]:
    return [c.token_ids for c in decoder.propose(max_tokens, max_candidates)]


def test_window_tree_is_a_chain_with_one_column_per_position():
    # level 0 a0 a1 (a chain off the root), level 1 b0 under a0, b1 under a1, level 2 c_i under b_i
    assert window_tree([(1, 2), (3, 4), (5, 6)]) == ((1, 2, 3, 4, 5, 6), (-1, 0, 0, 1, 2, 3))
    assert window_tree([]) == ((), ())


def test_a_hand_built_jacobi_trace_fills_the_window_then_pools_its_columns():
    d = LookaheadDecoder(CONFIG)
    d.extend([5, 6, 7])
    assert d.levels == ((6, 7),)  # level 0: the context's last W tokens
    assert d.lookahead_rows() == ((6, 7), (-1, 0))
    d.observe([10, 11])  # the argmax after 6 and after 6 7: the next level, nothing pooled yet
    assert d.levels == ((6, 7), (10, 11)) and not d.ngrams
    assert d.lookahead_rows() == ((6, 7, 10, 11), (-1, 0, 0, 1))
    # rows a0 a1 b0 b1; the top level's argmaxes 20 (after 6 10) and 21 (after 6 7 11) close the
    # n-grams (6, 10, 20) and (7, 11, 21); the levels move up one
    d.observe([98, 99, 20, 21])
    assert d.ngrams == {6: [(10, 20)], 7: [(11, 21)]}
    assert d.levels == ((10, 11), (20, 21))
    assert continuations(d) == [(11, 21)]  # the last committed token is 7
    d.extend([6])
    assert continuations(d) == [(10, 20)]
    assert continuations(d, max_tokens=1) == [(10,)]
    d.lookahead_rows()
    d.observe([0, 0, 30, 6])  # (10, 20, 30) and (11, 21, 6)
    # max_first_tokens = 3: the least recently updated first token (6) went
    assert d.ngrams == {7: [(11, 21)], 10: [(20, 30)], 11: [(21, 6)]}
    assert list(d.ngrams) == [7, 10, 11]
    assert d.levels == ((20, 21), (30, 6))


def test_a_first_token_keeps_its_most_recent_continuations_without_repeats():
    # one level: every step pools the 2-grams (window_i, argmax_i) and the argmaxes become the window
    d = LookaheadDecoder(LookaheadConfig(window=2, num_levels=1, max_ngrams_per_token=2))
    d.extend([1, 2])
    for top in ((3, 4), (1, 2), (5, 6), (1, 2), (3, 4), (1, 2), (7, 8)):
        d.lookahead_rows()
        d.observe(top)
    # after 1: 3, 5, 3 (moved up, not repeated), 7 -> the two most recent, (5,) dropped
    assert d.ngrams[1] == [(7,), (3,)] and d.ngrams[2] == [(8,), (4,)]
    assert d.ngrams[3] == [(1,)] and d.ngrams[5] == [(1,)]
    assert continuations(d) == [(8,), (4,)]  # the last committed token is 2
    assert continuations(d, max_candidates=1) == [(8,)]


def test_unverified_rows_leave_the_window_and_a_wrong_count_is_refused():
    d = LookaheadDecoder(CONFIG)
    d.extend([5, 6, 7])
    d.lookahead_rows()
    d.observe([])  # not verified (a plain step, a failed verify)
    assert d.levels == ((6, 7),)
    with pytest.raises(ValueError, match="0 lookahead rows"):
        d.observe([1, 2])  # no rows outstanding
    d.lookahead_rows()
    with pytest.raises(ValueError, match="3 entries for the 2 lookahead rows"):
        d.observe([1, 2, 3])


def test_the_config_bounds_the_rows():
    assert LookaheadConfig(window=4, num_levels=3).num_rows == 12
    with pytest.raises(ValueError, match="64 rows"):
        LookaheadConfig(window=13, num_levels=5)
    with pytest.raises(ValueError, match="window"):
        LookaheadConfig(window=0)


class _NoModels:
    def current_model(self):
        return None

    def vocab_size(self):
        return 1000

    def max_context_length(self):
        return None


def test_the_pool_returns_the_rows_and_hands_the_argmaxes_back():
    pool = DraftPool(
        PoolConfig(strategies=("prompt_lookup", "lookahead"), default_strategies=("prompt_lookup",)),
        model_free_registry(lookahead=CONFIG),
        DecoderRegistry(),
        _NoModels(),
    )
    first = pool.propose(ProposeArgs("r", prompt_token_ids=(5, 6, 7), strategies=("lookahead",)))
    assert first.lookahead == ((6, 7), (-1, 0)) and first.tree.num_nodes == 0
    second = pool.propose(
        ProposeArgs("r", new_token_ids=(8,), strategies=("lookahead",), lookahead_argmax_token_ids=(10, 11))
    )
    assert second.lookahead == ((6, 7, 10, 11), (-1, 0, 0, 1))
    third = pool.propose(
        ProposeArgs("r", new_token_ids=(6,), strategies=("lookahead",), lookahead_argmax_token_ids=(0, 0, 20, 21))
    )
    assert third.tree.token_ids == (10, 20) and third.tree.decoders == ("lookahead",)  # the n-gram (6, 10, 20)
    with pytest.raises(InvalidArgument, match="lookahead_argmax_token_ids"):
        pool.propose(ProposeArgs("r", strategies=("lookahead",), lookahead_argmax_token_ids=(1, 2, 3)))
    with pytest.raises(InvalidArgument, match="lookahead_argmax_token_ids"):
        pool.propose(ProposeArgs("r", strategies=("prompt_lookup",), lookahead_argmax_token_ids=(10**6,) * 4))
    # a step without the lookahead decoder carries no rows, and no argmaxes may follow it
    assert pool.propose(ProposeArgs("r", strategies=("prompt_lookup",))).lookahead == ((), ())
    with pytest.raises(InvalidArgument, match="proposed no lookahead rows"):
        pool.propose(ProposeArgs("r", strategies=("prompt_lookup",), lookahead_argmax_token_ids=(1,)))
    pool.close()


def test_a_call_refused_for_its_features_leaves_the_lookahead_rows_to_their_argmaxes():
    pool = DraftPool(
        PoolConfig(strategies=("lookahead",), default_strategies=("lookahead",)),
        model_free_registry(lookahead=CONFIG),
        DecoderRegistry(),
        _NoModels(),
    )
    assert pool.propose(ProposeArgs("r", prompt_token_ids=(5, 6, 7))).lookahead == ((6, 7), (-1, 0))
    step = ProposeArgs("r", new_token_ids=(8,), lookahead_argmax_token_ids=(10, 11))
    bad_features = np.zeros((1, 4), dtype=np.float32)  # position 0: nothing predicts the first token
    with pytest.raises(InvalidArgument, match="feature_position"):
        pool.propose(dataclasses.replace(step, features=bad_features, feature_position=0))
    # the refused call took neither the tokens nor the argmaxes: the same step without features goes on
    assert pool.propose(step).lookahead == ((6, 7, 10, 11), (-1, 0, 0, 1))
    pool.close()
