"""specdec.candidates: the (decoder, rank) expansion and the outcomes, read the same by gateway and pool."""

from __future__ import annotations

import pytest

from specdec.candidates import (
    CandidateOutcome,
    candidate_outcomes,
    decoder_of,
    decoders_for,
    depth_outcomes,
    ranked_sources,
    stats_name,
)

LOOKUP, SUFFIX = "prompt_lookup", "suffix_index"


def test_the_rth_occurrence_of_a_decoder_is_its_rank_r_and_back():
    sources = ((LOOKUP, 0), (SUFFIX, 0), (LOOKUP, 1), (LOOKUP, 2))
    assert ranked_sources((LOOKUP, SUFFIX, LOOKUP, LOOKUP)) == sources
    assert decoders_for(sources) == (LOOKUP, SUFFIX, LOOKUP, LOOKUP)
    assert decoders_for(()) == () == ranked_sources(())
    with pytest.raises(ValueError, match="ranks in order"):
        decoders_for(((LOOKUP, 1),))  # rank 1 without rank 0 would be read as rank 0
    with pytest.raises(ValueError, match="ranks in order"):
        decoders_for(((LOOKUP, 0), (LOOKUP, 0)))


def test_outcomes_count_each_candidates_nodes_on_the_accepted_path():
    # candidates a [x y], b [x z], a#1 [w] -> tree 0:x(a,b) 1:y(a) 2:z(b) 3:w(a#1), parents (-1, 0, 0, -1)
    decoders, node_sources, parents = ("a", "b", "a"), (0b011, 0b001, 0b010, 0b100), (-1, 0, 0, -1)
    assert candidate_outcomes(decoders, node_sources, (0, 2), parents) == [
        CandidateOutcome("a", 0, num_proposed=2, num_accepted=1),
        CandidateOutcome("b", 0, num_proposed=2, num_accepted=2),
        CandidateOutcome("a", 1, num_proposed=1, num_accepted=0),
    ]
    assert [o.num_accepted for o in candidate_outcomes(decoders, node_sources, (), parents)] == [0, 0, 0]
    assert [o.num_accepted for o in candidate_outcomes(decoders, node_sources, (3,), parents)] == [0, 0, 1]
    assert candidate_outcomes((), (), (), ()) == []
    for not_a_root_path in ((0, 2, 1), (1,), (4,)):
        with pytest.raises(ValueError, match="root path"):
            candidate_outcomes(decoders, node_sources, not_a_root_path, parents)


def test_stats_names_carry_the_rank_after_the_first():
    assert [stats_name(LOOKUP, r) for r in range(3)] == [LOOKUP, f"{LOOKUP}#1", f"{LOOKUP}#2"]
    assert decoder_of(f"{LOOKUP}#2") == decoder_of(LOOKUP) == LOOKUP


@pytest.mark.parametrize(
    "accepted, expected",
    [
        ([0, 2], {"a": (2, 1), "b": (2, 2)}),  # y rejected at depth 2; z a leaf, all of b accepted
        ([0], {"a": (2, 1), "b": (2, 1)}),  # y and z rejected
        ([], {"a": (1, 0), "b": (1, 0)}),  # x rejected
    ],
)
def test_depth_outcomes_follow_the_accepted_path_through_each_decoders_subtree(accepted, expected):
    # tree 0:x(a,b) 1:y(a) 2:z(b)
    outcomes = depth_outcomes(("a", "b"), (0b11, 0b01, 0b10), accepted, (-1, 0, 0))
    assert {o.decoder: (o.num_tested, o.num_accepted) for o in outcomes} == expected


def test_a_tree_decoders_ranks_are_one_subtree_and_a_decoder_off_the_path_is_tested_once():
    # ranks f#0, f#1 (bits 0, 1) share x; p (bit 2) proposes w. Tree 0:x(f,f1) 1:y(f) 2:v(f1) 3:w(p)
    decoders, sources, parents = ("f", "f", "p"), (0b011, 0b001, 0b010, 0b100), (-1, 0, 0, -1)
    outcomes = {o.decoder: (o.num_tested, o.num_accepted) for o in depth_outcomes(decoders, sources, [0, 2], parents)}
    assert outcomes == {"f": (2, 2), "p": (1, 0)}
