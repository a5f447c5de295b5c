"""Suffix index: longest match, most frequent continuation, eviction, concurrency, and a brute-force rescan."""

from __future__ import annotations

import collections
import random
import threading

import numpy as np
import pytest

from draft_svc.strategies.suffix_index import SuffixDecoder, SuffixIndex, SuffixIndexConfig, _bucket, _buckets


def _index(docs: list[list[int]], **config) -> SuffixIndex:
    index = SuffixIndex(SuffixIndexConfig(**config))
    for doc in docs:
        index.insert(doc)
    return index


def _ranked(column: list[int]) -> list[int]:
    counts, first = collections.Counter(column), {}
    for row, token in enumerate(column):
        first.setdefault(token, row)
    return sorted(counts, key=lambda token: (-counts[token], first[token]))


def reference_query(
    docs: list[list[int]], context: list[int], max_tokens: int, max_candidates: int, config: SuffixIndexConfig
) -> tuple[tuple[int, ...], ...]:
    """The documented rule by scanning every document (no hashing, no ring)."""
    occurrences, offset = [], 0  # (global position of the continuation start, doc, c)
    for d, doc in enumerate(docs):
        occurrences += [(offset + c, d, c) for c in range(len(doc))]
        offset += len(doc) + 1
    occurrences.sort(reverse=True)  # most recent first
    suffix = context[-config.max_match_len :]
    for n in reversed(config.ngram_sizes):
        if len(suffix) < n:
            continue
        found = [(d, c) for _, d, c in occurrences if c >= n and docs[d][c - n : c] == suffix[-n:]]
        found = found[: config.max_occurrences]
        if not found:
            continue

        def match_len(d: int, c: int) -> int:
            length = 0
            while length < len(suffix) and c - 1 - length >= 0 and docs[d][c - 1 - length] == suffix[-1 - length]:
                length += 1
            return length

        lengths = [match_len(d, c) for d, c in found]
        rows = [docs[d][c : c + max_tokens] for (d, c), length in zip(found, lengths) if length == max(lengths)]
        paths = []
        for first in _ranked([row[0] for row in rows])[:max_candidates]:
            agree, path = [row for row in rows if row[0] == first], [first]
            for depth in range(1, max_tokens):
                column = [row[depth] for row in agree if len(row) > depth]
                if not column:
                    break
                path.append(_ranked(column)[0])
                agree = [row for row in agree if len(row) > depth and row[depth] == path[-1]]
            paths.append(tuple(path))
        return tuple(paths)
    return ()


def test_most_frequent_continuation_after_the_match():
    # Three earlier outputs share "10 11 12"; after it, 20 follows twice and 13 once -> rank 0 starts
    # with 20; below 20 the next tokens 21 and 22 tie once each -> the most recent (22) wins.
    index = _index([[10, 11, 12, 13, 14], [10, 11, 12, 20, 21], [10, 11, 12, 20, 22]], max_total_tokens=64)
    assert index.query([5, 11, 12], max_tokens=4, max_candidates=3) == ((20, 22), (13, 14))


def test_longest_suffix_match_beats_frequency():
    # "7 11 12" occurs once (-> 30 31); "11 12" alone is followed by 40 twice. The longer match decides.
    docs = [[1, 11, 12, 40, 41], [2, 11, 12, 40, 41], [7, 11, 12, 30, 31]]
    index = _index(docs, max_total_tokens=64, ngram_sizes=(2, 4))
    assert index.query([9, 7, 11, 12], max_tokens=2) == ((30, 31),)
    assert index.query([9, 8, 11, 12], max_tokens=2) == ((40, 41),)


def test_continuations_stop_at_document_ends_and_nothing_matches_gives_nothing():
    index = _index([[1, 2, 3], [3, 9, 9]], max_total_tokens=64, ngram_sizes=(1, 2))
    assert index.query([1, 2], max_tokens=5) == ((3,),)  # not [3 3 9 9]: the separator ends doc 0
    assert index.query([8, 8], max_tokens=5) == ()
    assert index.query([], max_tokens=5) == ()
    assert _index([], max_total_tokens=8).query([1, 2], max_tokens=3) == ()


def test_a_tenant_s_queries_match_its_own_documents_only():
    """Tenants share the ring but not their outputs: tenant b's query of a context only tenant a wrote
    finds nothing, and where both wrote it each finds its own continuation."""
    index = SuffixIndex(SuffixIndexConfig(max_total_tokens=64, ngram_sizes=(2,), max_match_len=8))
    index.insert([1, 2, 3, 4], tenant="a")
    index.insert([5, 6, 7], tenant="a")
    index.insert([5, 6, 9], tenant="b")
    assert index.query([1, 2], max_tokens=2, tenant="a") == ((3, 4),)
    assert index.query([1, 2], max_tokens=2, tenant="b") == ()
    assert index.query([1, 2], max_tokens=2) == ()  # tenant "" (no API keys) is a tenant of its own
    assert index.query([5, 6], max_tokens=2, tenant="a") == ((7,),)
    assert index.query([5, 6], max_tokens=2, tenant="b") == ((9,),)
    assert index.query([5, 6], max_tokens=2, tenant="c") == ()  # never inserted
    decoder = SuffixDecoder(index, tenant="b")
    decoder.extend([5, 6])
    assert [c.token_ids for c in decoder.propose(2)] == [(9,)]


def test_tenants_whose_documents_were_evicted_are_forgotten():
    """The index keeps an entry per tenant only while it holds one of the tenant's documents: request ids
    with ever new tenant parts (no API keys: "client-session/..." ids) must not grow it without bound,
    and a tenant that takes a freed entry never drafts from the documents of the one that left it."""
    index = SuffixIndex(SuffixIndexConfig(max_total_tokens=16, ngram_sizes=(2,), max_match_len=8))
    for i in range(100):
        index.insert([1, 2, 100 + i], tenant=f"t{i}")
    assert index.num_documents == 4 and index.num_tenants == 4
    assert index.query([1, 2], max_tokens=1, tenant="t99") == ((199,),)
    assert index.query([1, 2], max_tokens=1, tenant="t95") == ()  # evicted
    index.insert([1, 2, 7], tenant="new")  # evicts t96's document
    assert index.num_tenants == 4
    assert index.query([1, 2], max_tokens=1, tenant="new") == ((7,),)
    assert index.query([1, 2], max_tokens=1, tenant="t96") == ()


def test_oldest_whole_documents_are_evicted_first():
    # Capacity 16 tokens, each document takes 5 + 1 separator: the third insert evicts the first whole.
    index = _index([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], max_total_tokens=16, ngram_sizes=(2,))
    assert index.query([1, 2], max_tokens=2) == ((3, 4),)
    index.insert([11, 12, 13, 14, 15])
    assert index.num_documents == 2 and index.num_tokens == 12
    assert index.query([1, 2], max_tokens=2) == ()
    assert index.query([6, 7], max_tokens=2) == ((8, 9),)
    assert index.query([11, 12], max_tokens=2) == ((13, 14),)
    index.insert(list(range(100, 130)))  # longer than the ring: keeps its first 15 tokens, evicts the rest
    assert index.num_documents == 1 and index.num_tokens == 16
    assert index.query([6, 7], max_tokens=2) == ()
    assert index.query([113, 114], max_tokens=3) == ()  # 114 has no next token inside the ring
    assert index.query([112, 113], max_tokens=3) == ((114,),)


def test_a_document_losing_only_its_first_token_is_evicted_whole():
    # Ring of 12: doc A fills slots 0..5 (5 tokens + separator); doc B's 6 tokens take 6..11 and its
    # separator lands in slot 0, over A's first token -> A goes, although 5 of its 6 slots survive.
    index = _index([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], max_total_tokens=12, ngram_sizes=(2,))
    assert index.num_documents == 1 and index.num_tokens == 7
    assert index.query([2, 3], max_tokens=2) == ()
    assert index.query([7, 8], max_tokens=2) == ((9, 10),)


def test_insert_rejects_negative_token_ids():
    with pytest.raises(ValueError, match="doc_tokens"):
        _index([[1, -1, 2]], max_total_tokens=16)


@pytest.mark.parametrize("seed", range(3))
def test_matches_a_brute_force_scan_through_ring_wraps(seed):
    rng = random.Random(seed)
    # 64-token ring, 6-token vocabulary: many repeats, several wraps, shared hash buckets.
    config = SuffixIndexConfig(max_total_tokens=64, ngram_sizes=(1, 2, 4), max_match_len=6, max_occurrences=64)
    index, docs = SuffixIndex(config), []
    for _ in range(30):
        doc = [rng.randrange(6) for _ in range(rng.randint(1, 14))]
        docs.append(doc)
        index.insert(doc)
        retained = docs[len(docs) - index.num_documents :]
        for _ in range(3):
            context = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
            assert index.query(context, 5, 3) == reference_query(retained, context, 5, 3, config)


def test_decoder_keeps_only_the_tail_it_needs():
    index = _index([[1, 2, 3, 4]], max_total_tokens=32, ngram_sizes=(2,), max_match_len=2)
    decoder = SuffixDecoder(index)
    decoder.extend(list(range(50, 60)) + [1])
    decoder.extend([2])
    assert [c.token_ids for c in decoder.propose(2)] == [(3, 4)]
    assert decoder.propose(2)[0].decoder == "suffix_index"
    assert len(decoder._tail) <= 4  # 2 * max_match_len: per-request state stays O(max_match_len)


def test_concurrent_inserts_and_queries_stay_consistent():
    index = SuffixIndex(SuffixIndexConfig(max_total_tokens=256, ngram_sizes=(2,)))
    # every document is a run of one arithmetic pattern, so any valid continuation of [k, k+1] is k+2, ...
    errors: list[BaseException] = []

    def writer(offset: int) -> None:
        for start in range(offset, offset + 200, 3):
            index.insert([t % 50 for t in range(start, start + 12)])

    def reader() -> None:
        try:
            for k in range(300):
                for candidate in index.query([k % 50, (k + 1) % 50], max_tokens=4, max_candidates=2):
                    assert list(candidate) == [(k + 2 + i) % 50 for i in range(len(candidate))]
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(o,)) for o in (0, 1)] + [threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert index.num_tokens <= 256


def test_config_validates():
    with pytest.raises(ValueError, match="ngram_sizes"):
        SuffixIndexConfig(ngram_sizes=(4, 2))
    with pytest.raises(ValueError, match="max_match_len"):
        SuffixIndexConfig(ngram_sizes=(2, 8), max_match_len=4)


def test_query_hash_equals_the_vectorised_insert_hash():
    rng = random.Random(5)
    for n in (1, 2, 4, 8):
        windows = np.array([[rng.randrange(1 << 31) for _ in range(n)] for _ in range(20)], dtype=np.int64)
        assert _buckets(windows, 17).tolist() == [_bucket(row.tolist(), 17) for row in windows]
