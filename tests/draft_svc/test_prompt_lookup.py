"""Prompt lookup: hand-computed cases, the ranking rule, and incremental == from scratch == a rescan."""

from __future__ import annotations

import dataclasses
import random

import pytest

from draft_svc.strategies.prompt_lookup import PromptLookupConfig, PromptLookupDecoder


def _proposals(decoder: PromptLookupDecoder, max_tokens: int, max_candidates: int = 1) -> list[tuple[int, ...]]:
    return [c.token_ids for c in decoder.propose(max_tokens, max_candidates)]


def _decoder(context: list[int], **config) -> PromptLookupDecoder:
    decoder = PromptLookupDecoder(PromptLookupConfig(**config))
    decoder.extend(context)
    return decoder


def reference_lookup(
    context: list[int], max_tokens: int, max_candidates: int, config: PromptLookupConfig
) -> list[tuple[int, ...]]:
    """The ranking rule by rescanning the whole context (what the incremental index must equal)."""
    num_tokens, found = len(context), []
    for n in range(config.max_ngram, config.min_ngram - 1, -1):
        if n > num_tokens:
            continue
        suffix = context[num_tokens - n :]
        # continuation starts c <= num_tokens - 1 (a next token exists), most recent first
        starts = [c for c in range(num_tokens - 1, n - 1, -1) if context[c - n : c] == suffix]
        for c in starts[: config.max_chain_steps]:
            extended = list(context)
            while len(extended) < c + max_tokens:  # LZ77 copy: the text repeats with period L - c
                extended.append(extended[len(extended) - (num_tokens - c)])
            continuation = tuple(extended[c : c + max_tokens])
            if not any(seen[: len(continuation)] == continuation for seen in found):
                found.append(continuation)
                if len(found) == max_candidates:
                    return found
    return found


def test_longest_ngram_wins_over_a_more_recent_shorter_match():
    # context [1 2 3 9 7 3 5 1 2 3] (positions 0..9): n=3 "1 2 3" occurs at 0..2 -> continuation [9 7];
    # n=1 "3" occurs more recently, at position 5 -> [5 1]; the longer match wins.
    decoder = _decoder([1, 2, 3, 9, 7, 3, 5, 1, 2, 3], max_ngram=3)
    assert _proposals(decoder, 2) == [(9, 7)]


def test_most_recent_match_wins_within_one_n_and_ranks_are_distinct():
    # E.g. [1 2 3 4 1 2 5 6 1 2]: "1 2" is followed by [5 6 ...] at c=6 (most recent), by [3 4 ...] at c=2.
    decoder = _decoder([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], max_ngram=2)
    assert _proposals(decoder, 4, max_candidates=3) == [(5, 6, 1, 2), (3, 4, 1, 2)]
    candidates = decoder.propose(4, 2)
    assert [c.rank for c in candidates] == [0, 1]
    assert {c.decoder for c in candidates} == {"prompt_lookup"}


def test_shorter_ngram_supplies_lower_ranks_and_prefix_duplicates_are_skipped():
    # [4 8 5 8 6 8 5 8]: n=2 "5 8" matches with c=4 -> [6 8 5]; n=1 "8": c=6 -> [5 8] then the period
    # of 2 repeats 5 -> [5 8 5]; c=4 -> [6 8 5] again (skipped); c=2 -> [5 8 6].
    decoder = _decoder([4, 8, 5, 8, 6, 8, 5, 8], max_ngram=2)
    assert _proposals(decoder, 3, max_candidates=4) == [(6, 8, 5), (5, 8, 5), (5, 8, 6)]
    # [6 8] with max_tokens 2 is a prefix of the rank-0 [6 8 ...]: c=4 at n=1 adds nothing
    assert _proposals(decoder, 2, max_candidates=4) == [(6, 8), (5, 8)]
    assert _proposals(decoder, 3, max_candidates=4) == reference_lookup(
        [4, 8, 5, 8, 6, 8, 5, 8], 3, 4, PromptLookupConfig(max_ngram=2)
    )


def test_match_overlapping_the_suffix_repeats_periodically():
    # [7 8 7 8 7 8]: "7 8 7 8" last occurs with c=4, two tokens before the end: period 2.
    decoder = _decoder([7, 8, 7, 8, 7, 8])
    assert _proposals(decoder, 5) == [(7, 8, 7, 8, 7)]


def test_no_match_gives_no_candidate_and_the_suffix_never_matches_itself():
    decoder = _decoder([1, 2, 3])
    assert decoder.propose(4) == ()
    assert decoder.propose(0) == ()
    assert PromptLookupDecoder().propose(4) == ()
    with pytest.raises(ValueError, match="max_candidates"):
        decoder.propose(4, 0)


def test_min_ngram_excludes_single_token_matches():
    assert _proposals(_decoder([5, 6, 1, 5], min_ngram=2, max_ngram=3), 2) == []
    assert _proposals(_decoder([5, 6, 1, 5], min_ngram=1, max_ngram=3), 2) == [(6, 1)]


@pytest.mark.parametrize("seed", range(4))
def test_incremental_extend_equals_from_scratch_and_a_rescan(seed):
    rng = random.Random(seed)
    config = PromptLookupConfig(max_ngram=3, min_ngram=1, max_chain_steps=5)
    context = [rng.randrange(6) for _ in range(120)]  # small vocabulary: many repeated n-grams
    incremental = PromptLookupDecoder(config)
    position = 0
    while position < len(context):
        chunk = context[position : position + rng.randint(1, 7)]  # a prompt, then accepted runs
        incremental.extend(chunk)
        position += len(chunk)
        scratch = _decoder(context[:position], **dataclasses.asdict(config))
        for max_tokens, max_candidates in ((1, 1), (4, 1), (6, 3)):
            expected = reference_lookup(context[:position], max_tokens, max_candidates, config)
            assert _proposals(incremental, max_tokens, max_candidates) == expected
            assert _proposals(scratch, max_tokens, max_candidates) == expected


def test_config_validates():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupConfig(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="max_chain_steps"):
        PromptLookupConfig(max_chain_steps=0)
