"""The repeat index (specdec.repeats): does the context's tail occur earlier, what followed it, and
how much of it a run drafts?"""

from __future__ import annotations

import functools

import pytest

import numpy as np

from specdec.answers import AnswerIndex, LearnedAnswers
from specdec.repeats import DEFAULT_ROW_COSTS, RepeatIndex, RunDrafts
from specdec.suffix_array import SEPARATOR


def test_the_tail_repeats_only_when_an_earlier_occurrence_was_followed_by_a_token():
    index = RepeatIndex([1, 2, 3, 4, 1, 2], n=3)
    assert not index.tail_repeats()  # "4 1 2" is new
    index.extend([3])
    assert index.tail_repeats()  # "1 2 3" was followed by 4
    index.extend([9])
    assert not index.tail_repeats()
    assert len(index) == 8


def test_the_context_never_matches_itself():
    assert not RepeatIndex([5, 5], n=3).tail_repeats()  # shorter than n
    assert not RepeatIndex([5, 5, 5], n=3).tail_repeats()  # its only "5 5 5" is the tail itself
    assert RepeatIndex([5, 5, 5, 5], n=3).tail_repeats()  # the first "5 5 5" was followed by a 5


def test_n_is_checked():
    with pytest.raises(ValueError, match="n must be"):
        RepeatIndex(n=0)


def test_the_continuation_is_what_followed_the_latest_earlier_occurrence():
    index = RepeatIndex([1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3], n=3)
    assert index.continuation(4) == [4, 5, 6, 1]  # the latest "1 2 3" (at 6) was followed by 4 5 6 ...
    assert index.continuation(0) == []
    index.extend([0])
    assert index.continuation(4) == []  # "2 3 0" occurred nowhere before


def test_a_continuation_that_reaches_the_context_s_end_copies_its_own_output():
    index = RepeatIndex([7, 8, 9, 7, 8, 9], n=3)
    assert index.continuation(7) == [7, 8, 9, 7, 8, 9, 7]


def test_run_drafts_draft_nothing_where_the_tail_repeats_nothing():
    drafts = RunDrafts([1, 2, 3, 4, 5], max_length=8)
    assert drafts.draft(8) == []


def test_run_drafts_draft_longer_chains_as_the_copy_is_accepted_and_shorter_after_misses():
    """The draft length maximises expected tokens per cost: at the prior's estimate a short chain;
    after whole chains accepted, a long one (bounded by max_length and the caller's room); after
    misses, none."""
    text = list(range(100, 140))
    drafts = RunDrafts(text + text[:3], max_length=8)
    first = drafts.draft(8)
    assert first == text[3 : 3 + len(first)] and 1 <= len(first) <= 3
    for _ in range(3):
        drafts.observe(len(first), len(first))
    second = drafts.draft(8)
    assert len(first) < len(second) < 8 and second == text[3 : 3 + len(second)]
    for _ in range(3):
        drafts.observe(8, 8)
    assert drafts.acceptance > 0.9
    assert drafts.draft(8) == text[3:11]  # max_length
    assert drafts.draft(5) == text[3:8]  # the caller's room
    for _ in range(8):
        drafts.observe(4, 0)
    assert drafts.acceptance < 0.4 and len(drafts.draft(8)) <= 1


def test_run_drafts_price_rows_by_the_measured_curve_and_fall_back_to_the_default_one():
    drafts = RunDrafts([], max_length=4, row_costs={1: 4.0, 2: 4.4, 4: 6.0, 8: 10.0})
    assert drafts.relative_cost(1) == 1.0 and drafts.relative_cost(2) == pytest.approx(1.1)
    assert drafts.relative_cost(3) == pytest.approx(1.3) and drafts.relative_cost(16) == pytest.approx(4.5)
    default = RunDrafts([], max_length=4, row_costs={1: 10.0})  # one size is no curve
    assert default.relative_cost(2) == DEFAULT_ROW_COSTS[2]
    with pytest.raises(ValueError, match="max_length"):
        RunDrafts([], max_length=0)


def test_run_drafts_beside_other_requests_draft_only_what_pays_for_the_whole_step():
    """Beside other requests a drafted row slows their tokens too: at an acceptance that pays alone
    (0.5 after the prior) nothing is drafted beside 31 one-row requests; a copy accepted nine times in
    ten still is."""
    text = list(range(100, 140))
    drafts = RunDrafts(text + text[:3], max_length=8)
    assert drafts.draft(8) and not drafts.draft(8, other_rows=31, other_requests=31)
    for _ in range(4):
        drafts.observe(8, 8)
    assert drafts.acceptance > 0.9 and drafts.draft(8, other_rows=31, other_requests=31)


ANSWERS = [[50, 51, 52, 53, 54], [60, 51, 52, 53, 54], [70, 51, 52, 99]]  # 51 52 -> 53 twice, 99 once


def test_run_drafts_draft_the_model_s_answers_where_the_tail_repeats_nothing():
    """A context whose tail occurs nowhere earlier in it, but in the answers: the run drafts what the
    answers continue with, priced by their own estimate; a copy still comes first where the tail repeats."""
    answers = AnswerIndex(np.concatenate([np.append(a, SEPARATOR) for a in ANSWERS]).astype(np.int32), 128)
    drafts = RunDrafts([1, 2, 51, 52], max_length=8, answers=answers)
    first = drafts.draft(8)
    assert first and first == [53, 54][: len(first)]
    assert drafts.is_answer_draft
    acceptance = drafts.acceptance
    drafts.observe(len(first), 0)  # refused: the answers' estimate falls, the copies' stays
    assert drafts.answer_acceptance < 0.5 and drafts.acceptance == acceptance
    copying = RunDrafts([7, 51, 52, 9, 8, 7, 51, 52], max_length=8, answers=answers)
    assert copying.draft(8)[:1] == [9] and not copying.is_answer_draft  # the context's own copy, not 53
    assert RunDrafts([1, 2, 3], max_length=8, answers=answers).draft(8) == []  # in neither


def test_run_drafts_draft_what_the_tenant_was_served_first_each_source_priced_by_its_own_estimate():
    """Where the tail repeats nothing, the outputs the primary served the tenant (learned) draft before
    the shipped answers, and how a source's drafts did moves its own estimate only."""
    answers = AnswerIndex(np.concatenate([np.append(a, SEPARATOR) for a in ANSWERS]).astype(np.int32), 128)
    learned = LearnedAnswers(n=2)
    learned.add("a", [], [51, 52, 80, 81, 82])
    drafts = RunDrafts([1, 2, 51, 52], max_length=8, answers=answers, learned=functools.partial(learned.draft, "a"))
    first = drafts.draft(8)
    assert first and first == [80, 81, 82][: len(first)] and drafts.is_answer_draft
    drafts.observe(len(first), len(first))  # accepted: the learned estimate rises
    other = RunDrafts([1, 2, 51, 52], max_length=8, answers=answers, learned=functools.partial(learned.draft, "b"))
    assert other.draft(8)[:1] == [53]  # another tenant's run: the shipped answers
    learned_first = RunDrafts(
        [1, 2, 51, 52], max_length=8, answers=answers, learned=functools.partial(learned.draft, "a")
    )
    for _ in range(3):  # the learned draft comes first, and only its estimate hears how it did
        assert learned_first.draft(8)[:1] == [80]
        learned_first.observe(1, 0)
    assert learned_first.answer_acceptance == RunDrafts([1], max_length=8).answer_acceptance  # the prior


def test_run_drafts_stop_drafting_answers_that_keep_missing():
    """Where a second row costs 30 % of a step, answers refused six times in a row are not worth it."""
    answers = AnswerIndex(np.concatenate([np.append(a, SEPARATOR) for a in ANSWERS]).astype(np.int32), 128)
    drafts = RunDrafts([1, 2, 51, 52], max_length=8, row_costs={1: 1.0, 2: 1.3, 4: 1.6}, answers=answers)
    assert drafts.draft(8)
    for _ in range(6):
        drafts.observe(len(drafts.draft(8)), 0)
    assert drafts.draft(8) == []


def test_run_drafts_search_the_answers_only_where_a_draft_could_pay():
    """Beside 31 other requests a drafted row pays only at an acceptance above the answers' prior:
    the run does not search them (the search costs the engine thread, request by request)."""
    searches: list[list[int]] = []

    class Counted(AnswerIndex):
        def draft(self, context_ids, max_tokens):
            searches.append(list(context_ids))
            return super().draft(context_ids, max_tokens)

    answers = Counted(np.concatenate([np.append(a, SEPARATOR) for a in ANSWERS]).astype(np.int32), 128)
    drafts = RunDrafts([1, 2, 51, 52], max_length=8, answers=answers)
    assert drafts.draft(8, other_rows=31, other_requests=31) == [] and searches == []
    assert drafts.draft(8) and searches == [[1, 2, 51, 52]]


def test_run_drafts_search_the_answers_only_as_deep_as_a_draft_could_pay():
    """The search follows the answers only as far as their estimate could pay for rows: the draft is
    the full-depth continuation cut back to what pays, found with less of the engine thread's time."""
    depths: list[int] = []

    class Recorded(AnswerIndex):
        def draft(self, context_ids, max_tokens):
            depths.append(max_tokens)
            return super().draft(context_ids, max_tokens)

    tokens = np.concatenate([np.append(a, SEPARATOR) for a in ANSWERS]).astype(np.int32)
    answers, recorded = AnswerIndex(tokens, 128), Recorded(tokens, 128)
    costs = {1: 1.0, 2: 1.25, 4: 1.7, 8: 2.7}  # at the prior's 1/2, a chain of one or two pays
    drafts = RunDrafts([1, 2, 51, 52], max_length=8, row_costs=costs, answers=recorded)
    chain = drafts.draft(8)
    full = answers.draft([1, 2, 51, 52], 8)
    assert 0 < depths[0] < len(full) and chain == full[: len(chain)] and len(chain) <= depths[0]
