"""specdec.acceptance_mode: the mode decided once (select_mode), checked where it is applied (check_mode)."""

from __future__ import annotations

import math

import pytest

from specdec.acceptance_mode import AcceptanceMode, check_mode, check_threshold, from_pb, select_mode, to_pb
from specdec.sampling import SamplingParams
from specdec.v1 import validator_pb2

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=11)


def test_the_modes_are_the_proto_enum_both_ways():
    assert [m.value for m in AcceptanceMode] == ["greedy", "sample", "threshold"]
    for mode in AcceptanceMode:
        assert from_pb(to_pb(mode)) is mode
    assert to_pb(AcceptanceMode.THRESHOLD) == validator_pb2.ACCEPTANCE_MODE_THRESHOLD
    for number in (validator_pb2.ACCEPTANCE_MODE_UNSPECIFIED, 99):
        with pytest.raises(ValueError, match=f"got {number}"):
            from_pb(number)


def test_select_mode():
    assert select_mode(GREEDY, 0.0) is AcceptanceMode.GREEDY
    assert select_mode(SAMPLED, 0.0) is AcceptanceMode.SAMPLE
    assert select_mode(GREEDY, 0.3) is select_mode(SAMPLED, 0.3) is AcceptanceMode.THRESHOLD
    for bad in (-0.1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="acceptance_threshold"):
            check_threshold(bad)


@pytest.mark.parametrize(
    "mode, sampling, threshold, first_word",
    [
        (AcceptanceMode.GREEDY, SAMPLED, 0.0, "mode"),
        (AcceptanceMode.GREEDY, GREEDY, 0.5, "acceptance_threshold"),
        (AcceptanceMode.SAMPLE, SAMPLED, 0.5, "acceptance_threshold"),
        (AcceptanceMode.THRESHOLD, GREEDY, 0.0, "acceptance_threshold"),
        (AcceptanceMode.THRESHOLD, SAMPLED, math.nan, "acceptance_threshold"),
    ],
)
def test_check_mode_names_the_field_at_fault_first(mode, sampling, threshold, first_word):
    with pytest.raises(ValueError) as e:
        check_mode(mode, sampling, threshold)
    assert str(e.value).split(" ", 1)[0] == first_word


def test_what_select_mode_decides_passes_check_mode():
    for sampling in (GREEDY, SAMPLED):
        for threshold in (0.0, 0.3, 1.0):
            check_mode(select_mode(sampling, threshold), sampling, threshold)
    check_mode(AcceptanceMode.SAMPLE, GREEDY, 0.0)  # sampling one-hot rows: allowed, and greedy's answer
