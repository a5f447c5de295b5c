"""The backward suffix array: hand-built corpora with hand-computed rows, matches, counts and
continuations, then a brute-force rescan on random corpora."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from specdec.suffix_array import QueryConfig, SuffixArray, block_starts, sort_positions
from specdec.suffix_array import SEPARATOR

A, B, C, D, E = 1, 2, 3, 4, 5
VOCAB = 8


def corpus(*docs: list[int]) -> np.ndarray:
    out: list[int] = []
    for doc in docs:
        out += [*doc, SEPARATOR]
    return np.array(out, dtype=np.int32)


def suffix_array(tokens: np.ndarray, sort_depth: int = 8, **config) -> SuffixArray:
    order = sort_positions(tokens, sort_depth)
    return SuffixArray(tokens, order, block_starts(tokens, order, VOCAB), sort_depth, QueryConfig(**config))


def test_rows_are_sorted_by_the_tokens_before_them():
    # t = [a b a b SEP]: positions 1..4 have backward keys (a), (b a), (a b a), (b a b a).
    tokens = corpus([A, B, A, B])
    assert sort_positions(tokens, 4).tolist() == [1, 3, 2, 4]
    # Depth 1 only: ties keep position order, so the same here; blocks: a -> rows 0-1, b -> rows 2-3.
    assert sort_positions(tokens, 1).tolist() == [1, 3, 2, 4]
    assert block_starts(tokens, sort_positions(tokens, 4), VOCAB).tolist() == [0, 0, 2, 4, 4, 4, 4, 4, 4]


def test_a_separator_ends_the_key():
    # Doc 2's "a" at position 4 has key (a, SEP): it sorts before doc 1's (a, c) at position 2.
    tokens = corpus([C, A], [A, B])
    order = sort_positions(tokens, 4)
    assert order.tolist() == [4, 2, 5, 1]  # keys (a SEP), (a c), (b a SEP), (c)


def test_hand_made_corpus_counts_and_continuations():
    # "a b" is followed by c three times (then d, d, e) and by e once; "c a b" only by e.
    docs = [[A, B, C, D], [A, B, C, D], [E, A, B, C, E], [C, A, B, E, A]]
    sa = suffix_array(corpus(*docs))
    counts = [collections.Counter(int(sa.tokens[s]) for s in starts) for starts in sa.occurrences([D, A, B])]
    assert counts == [{C: 3, E: 1}]  # "d a b" never occurs: the match is "a b", 4 times
    assert sa.query([D, A, B], max_tokens=3, max_candidates=2) == ((C, D), (E, A))
    # The longer match "c a b" (once, -> e a) wins over the more frequent "a b" -> c; a second
    # candidate backs off to "a b", whose most frequent next token is c.
    assert [len(s) for s in sa.occurrences([C, A, B])] == [1, 4]
    assert sa.query([C, A, B], max_tokens=3, max_candidates=2) == ((E, A), (C, D))
    # Continuations stop at a document's end; below "a b c" the two d's outvote one e.
    assert sa.query([A, B, C], max_tokens=4) == ((D,),)
    assert sa.query([B, D], max_tokens=2) == ()  # no match of min_match_len (2) tokens


def test_one_token_matches_are_opt_in():
    sa = suffix_array(corpus([A, B, C], [A, B, D], [D, B, C]), min_match_len=1)
    assert sa.query([E, B], max_tokens=1, max_candidates=3) == ((C,), (D,))
    assert suffix_array(corpus([A, B, C])).query([E, B], max_tokens=1) == ()


def test_wide_ranges_are_narrowed_then_sampled():
    # 300 copies of "a b c" and 100 of "d b e": the range of "b" (400 rows) is narrowed by "a" to 300
    # rows, sampled to max_occurrences rows, and c is the answer.
    docs = [[A, B, C]] * 300 + [[D, B, E]] * 100
    sa = suffix_array(corpus(*docs), max_occurrences=16)
    assert sa.query([A, B], max_tokens=2) == ((C,),)
    assert sa.query([D, B], max_tokens=2) == ((E,),)
    assert [len(s) for s in sa.occurrences([D, B])] == [16]


def _reference(
    docs: list[list[int]], context: list[int], max_tokens: int, config: QueryConfig
) -> tuple[tuple[int, ...], set[int]]:
    """By scanning every position: the continuations of the longest context suffix that some
    occurrence continues, and the most frequent path through them -> (path, the first tokens tied
    for the top count)."""
    for n in range(min(len(context), config.max_match_len), config.min_match_len - 1, -1):
        suffix = context[-n:]
        rows = [doc[c : c + max_tokens] for doc in docs for c in range(n, len(doc)) if doc[c - n : c] == suffix]
        if rows:
            break
    else:
        return (), set()
    firsts = collections.Counter(row[0] for row in rows)
    tied = {t for t, k in firsts.items() if k == max(firsts.values())}
    path: list[int] = []
    while len(path) < max_tokens:
        column = collections.Counter(row[len(path)] for row in rows if len(row) > len(path))
        if not column:
            break
        path.append(column.most_common(1)[0][0])
        rows = [row for row in rows if len(row) >= len(path) and row[len(path) - 1] == path[-1]]
    return tuple(path), tied


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_brute_force_rescan(seed):
    # Few distinct tokens give long repeated matches; max_occurrences above every count keeps the
    # vote exact. Ties may break differently: rank 0 must start with a tied first token, and rank 0
    # of the rescan's first token must be as long as the rescan's path.
    rng = random.Random(seed)
    docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(30)]
    config = QueryConfig(max_match_len=6, max_occurrences=10_000)
    sa = suffix_array(corpus(*docs), sort_depth=4, **vars_of(config))
    for _ in range(50):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        got = sa.query(context, max_tokens=3, max_candidates=4)
        want, tied = _reference(docs, context, 3, config)
        assert bool(got) == bool(want), (context, got, want)
        if want:
            assert got[0][0] in tied, (context, got, want)
            assert {p[0] for p in got} >= tied, (context, got, want)


def vars_of(config: QueryConfig) -> dict:
    return {
        "max_match_len": config.max_match_len,
        "min_match_len": config.min_match_len,
        "max_occurrences": config.max_occurrences,
    }


@pytest.mark.parametrize("gather_rows", [16, 4096])  # narrowing by bisection, and by one gather
def test_narrowing_finds_every_occurrence_of_the_longest_match(gather_rows, monkeypatch):
    monkeypatch.setattr("specdec.suffix_array.GATHER_ROWS", gather_rows)
    rng = random.Random(7)
    docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    tokens = corpus(*docs)
    sa = suffix_array(tokens, sort_depth=16, max_match_len=12, max_occurrences=8)
    starts_in_doc = np.concatenate([[0], np.flatnonzero(tokens == SEPARATOR)[:-1] + 1])
    num_compared = 0
    for _ in range(100):
        context = [rng.randrange(4) for _ in range(12)]
        longest = next(iter(sa.occurrences(context)), None)
        assert longest is not None
        if longest.size == 8:
            continue  # possibly sampled: the count is not exact
        n = max(
            n for n in range(1, 13) for doc in docs for c in range(n, len(doc) + 1) if doc[c - n : c] == context[-n:]
        )
        want = sorted(
            int(starts_in_doc[d]) + c
            for d, doc in enumerate(docs)
            for c in range(n, len(doc) + 1)
            if doc[c - n : c] == context[-n:]
        )
        assert sorted(longest.tolist()) == want, context
        num_compared += 1
    assert num_compared > 50
