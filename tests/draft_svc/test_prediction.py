"""The prediction decoder: aligned drafts, re-anchoring after edits, tiny hand-computed cases."""

from __future__ import annotations

import pytest

from draft_svc.strategies.prediction import PredictionDecoder
from specdec.prediction import LOST, PredictionAlignment, PredictionConfig

PROMPT = [900, 901, 902]


def decoder(prediction, **config) -> PredictionDecoder:
    d = PredictionDecoder(PredictionConfig(**config), prediction_token_ids=prediction, num_prompt_tokens=len(PROMPT))
    d.extend(PROMPT)
    return d


def proposed(d: PredictionDecoder, max_tokens: int = 8) -> tuple[int, ...]:
    candidates = d.propose(max_tokens)
    assert len(candidates) <= 1
    return candidates[0].token_ids if candidates else ()


def test_before_any_output_it_proposes_the_prediction_from_its_start():
    d = decoder([1, 2, 3, 4, 5])
    assert proposed(d, 3) == (1, 2, 3)
    assert d.propose(3)[0].decoder == "prediction" and d.propose(3)[0].rank == 0


def test_prompt_tokens_are_not_output_even_when_they_match_the_prediction():
    d = PredictionDecoder(prediction_token_ids=[1, 2, 3], num_prompt_tokens=2)
    d.extend([1, 2])  # the prompt quotes the prediction: still nothing of the output
    assert proposed(d) == (1, 2, 3)


def test_an_output_that_follows_the_prediction_moves_the_alignment():
    d = decoder([1, 2, 3, 4, 5, 6])
    d.extend([1, 2])
    d.extend([3])
    assert d.next_position == 3
    assert proposed(d, 2) == (4, 5)
    assert proposed(d, 64) == (4, 5, 6)


def test_a_substitution_re_anchors_on_the_next_token():
    # "def total ( items ) :" -> "def sum ( items ) :": after "sum" the output is lost, "(" re-anchors
    d = decoder([10, 11, 12, 13, 14, 15])
    d.extend([10, 20])
    assert d.next_position == LOST and proposed(d) == ()
    d.extend([12])
    assert proposed(d) == (13, 14, 15)


def test_an_insertion_re_anchors_where_the_prediction_resumes():
    d = decoder([1, 2, 3, 4, 5, 6, 7])
    d.extend([1, 2, 3, 50, 51, 52, 4])  # a docstring of three tokens inserted before 4
    assert proposed(d) == (5, 6, 7)


def test_a_deletion_re_anchors_after_the_deleted_stretch():
    d = decoder([1, 2, 3, 4, 5, 6, 7, 8])
    d.extend([1, 2, 6, 7])  # 3, 4, 5 left out
    assert proposed(d) == (8,)


def test_the_first_occurrence_after_the_anchor_wins_over_earlier_and_later_ones():
    # 7 occurs at 1, 4 and 8; the edit is at 3, so the occurrence at 4 is where the text resumes
    d = decoder([5, 7, 6, 9, 7, 1, 2, 3, 7, 4])
    d.extend([5, 7, 6, 99, 7])
    assert proposed(d, 3) == (1, 2, 3)


def test_a_single_token_far_past_the_anchor_does_not_re_anchor():
    prediction = [1, 2, 3, *range(100, 200), 42, 43]
    d = decoder(prediction, max_single_gap=8)
    d.extend([1, 2, 3, 77, 42])  # 42 occurs ~100 tokens ahead: noise
    assert d.next_position == LOST
    d = decoder(prediction, max_single_gap=200)
    d.extend([1, 2, 3, 77, 42])
    assert proposed(d) == (43,)


def test_a_longer_ngram_re_anchors_anywhere_after_the_anchor():
    prediction = [1, 2, 3, *range(100, 200), 42, 43, 44]
    d = decoder(prediction, max_single_gap=8)
    d.extend([1, 2, 3, 77, 42, 43])  # a 2-gram is evidence enough
    assert proposed(d) == (44,)


def test_text_moved_up_re_anchors_backwards_on_a_long_enough_ngram():
    d = decoder([1, 2, 3, 4, 5, 6, 7, 8, 9], min_backward_ngram=3)
    d.extend([1, 2, 3, 4, 5, 6, 7, 8])  # anchor now 8
    d.extend([60, 2, 3])  # a 2-gram before the anchor: not enough
    assert d.next_position == LOST
    d.extend([4])  # "2 3 4" (3 tokens) -> back to 4
    assert proposed(d, 2) == (5, 6)


def test_a_false_anchor_that_fails_at_once_does_not_move_the_search_start():
    # 8 re-anchors at 3 (1 token, untrusted), the next token fails: the anchor stays at 2, so "4 5"
    # re-anchors at 4, not past the false one
    d = decoder([1, 2, 8, 4, 5, 6, 7], min_trusted_run=3)
    d.extend([1, 2, 30, 8, 31, 4, 5])
    assert proposed(d) == (6, 7)


def test_a_finished_prediction_proposes_nothing():
    d = decoder([1, 2])
    d.extend([1, 2])
    assert proposed(d) == ()


def test_an_empty_prediction_proposes_nothing():
    d = decoder([])
    assert proposed(d) == ()
    d.extend([1, 2, 3])
    assert proposed(d) == ()


def test_extend_in_one_call_equals_token_by_token():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 9]
    output = [1, 2, 40, 3, 4, 5, 41, 42, 8, 2]
    whole, one_by_one = decoder(prediction), decoder(prediction)
    whole.extend(output)
    for t in output:
        one_by_one.extend([t])
    assert whole.next_position == one_by_one.next_position
    assert proposed(whole) == proposed(one_by_one)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        PredictionDecoder(prediction_token_ids=[1], num_prompt_tokens=-1)
    with pytest.raises(ValueError, match="non-negative"):
        PredictionDecoder(prediction_token_ids=[1, -2])
    with pytest.raises(ValueError, match="min_ngram"):
        PredictionConfig(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="max_tokens"):
        decoder([1]).propose(-1)


def test_matched_positions_count_each_prediction_token_once():
    # output: 1 2 (matched 0, 1), edit 40, "3 4" re-anchors at 4 (marks 2, 3), then 5; "2 3 4" again
    # re-anchors backwards (already counted)
    alignment = PredictionAlignment([1, 2, 3, 4, 5, 6], PredictionConfig(min_backward_ngram=3))
    alignment.add([1, 2, 40, 3, 4, 5])
    assert alignment.num_matched == 5
    alignment.add([2, 3, 4])
    assert alignment.num_matched == 5
    assert alignment.next_position == 4


def test_nothing_matched_when_the_output_shares_nothing_with_the_prediction():
    alignment = PredictionAlignment([1, 2, 3])
    alignment.add([7, 8, 9, 7])
    assert (alignment.num_matched, alignment.next_position) == (0, LOST)
