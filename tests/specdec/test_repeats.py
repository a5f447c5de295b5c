"""The repeat index (specdec.repeats): does the context's tail occur earlier?"""

from __future__ import annotations

import pytest

from specdec.repeats import RepeatIndex


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
