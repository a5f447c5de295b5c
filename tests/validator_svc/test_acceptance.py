"""Hand-computed cases of the acceptance rule on vocabularies of 4-6 tokens."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specdec.acceptance_mode import AcceptanceMode
from specdec.logits_codec import decode_logits, encode_logits
from specdec.sampling import SamplingParams, logits_to_probs, make_generator, sample
from validator_svc.acceptance import (
    ValidationResult,
    build_children,
    greedy_accept,
    rejection_sample_accept,
    threshold_accept,
    validate_tree,
)

NEG = -math.inf
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=11)
LN4 = math.log(4.0)


def one_hot_logits(*argmax_ids: int, vocab_size: int = 6) -> torch.Tensor:
    """Rows with logit 2 at the given id and 0 elsewhere: the argmax is that id."""
    logits = torch.zeros(len(argmax_ids), vocab_size)
    logits[torch.arange(len(argmax_ids)), torch.tensor(argmax_ids)] = 2.0
    return logits


def point_mass_logits(*token_ids: int, vocab_size: int = 4) -> torch.Tensor:
    """Rows with probability exactly 1 at the given id (every other logit -inf)."""
    logits = torch.full((len(token_ids), vocab_size), NEG)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 0.0
    return logits


def probs_logits(*rows: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(rows))


# ---- tree checks -------------------------------------------------------------------------------


def test_build_children_indexes_by_logits_row():
    # root ── 0 ── 1
    #     └── 2
    assert build_children([7, 8, 9], [-1, 0, -1], 10) == ((7, 8, 9), ((0, 2), (1,), (), ()))


@pytest.mark.parametrize(
    "token_ids, parents, num_rows, field",
    [
        ([1, 6], [-1, 0], 3, r"token_ids\[1\]"),  # outside V = 6
        ([1, -1], [-1, 0], 3, r"token_ids\[1\]"),
        ([1, 2], [0, -1], 3, r"parents\[0\]"),  # not topological: node 0 cannot hang off itself
        ([1, 2], [-1, 1], 3, r"parents\[1\]"),
        ([1, 2], [-1, -2], 3, r"parents\[1\]"),
        ([1, 2], [-1], 3, "parents has 1"),
        ([1, 1], [-1, -1], 3, r"token_ids\[1\].*sibling"),  # siblings must carry distinct tokens
        ([1, 2], [-1, 0], 2, "target_logits has 2 rows"),
    ],
)
def test_invalid_trees_raise_naming_the_field(token_ids, parents, num_rows, field):
    with pytest.raises(ValueError, match=field):
        greedy_accept(token_ids, parents, torch.zeros(num_rows, 6))


def test_invalid_logits_and_side_inputs_raise():
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept([1], [-1], torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept([1], [-1], torch.full((2, 3), NEG))
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept([1], [-1], torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="argmax_ids"):
        greedy_accept([1], [-1], torch.zeros(2, 3), argmax_ids=[0])
    with pytest.raises(ValueError, match="argmax_ids"):
        greedy_accept([1], [-1], torch.zeros(2, 3), argmax_ids=[0, 3])
    with pytest.raises(ValueError, match="draft_probs has shape"):
        rejection_sample_accept([1], [-1], torch.zeros(2, 3), SAMPLED, None, draft_probs=torch.ones(2, 3))
    with pytest.raises(ValueError, match="draft_probs\\[0\\] gives zero"):
        rejection_sample_accept(
            [1], [-1], torch.zeros(2, 3), SAMPLED, None, draft_probs=torch.tensor([[1.0, 0.0, 0.0]])
        )
    with pytest.raises(ValueError, match="acceptance_threshold"):
        validate_tree([1], [-1], torch.zeros(2, 3), GREEDY, AcceptanceMode.THRESHOLD, acceptance_threshold=1.5)
    with pytest.raises(ValueError, match="acceptance_threshold"):
        validate_tree([1], [-1], torch.zeros(2, 3), GREEDY, AcceptanceMode.THRESHOLD, acceptance_threshold=-0.5)


def test_the_mode_given_is_the_mode_applied():
    # Sample mode at temperature 0 is rejection sampling against one-hot rows: greedy's answer, by sampling.
    logits = torch.cat([probs_logits(ROW_532), one_hot_logits(3, 0, vocab_size=4)])
    sampled = validate_tree([1, 2], [-1, -1], logits, GREEDY, AcceptanceMode.SAMPLE, position=1)
    assert sampled == greedy_accept([1, 2], [-1, -1], logits)
    with pytest.raises(ValueError, match="mode greedy needs sampling.temperature = 0"):
        validate_tree([1, 2], [-1, -1], logits, SAMPLED, AcceptanceMode.GREEDY)


# ---- greedy ------------------------------------------------------------------------------------


def test_greedy_accepts_the_argmax_path_and_takes_the_bonus_from_the_last_row():
    # root ── 0:tok 2 ── 1:tok 3        argmax by row: root 2, node0 3, node1 5, node2 0
    #     └── 2:tok 1                   -> accept 0 then 1, bonus = argmax of node 1's row = 5
    logits = one_hot_logits(2, 3, 5, 0)
    result = greedy_accept([2, 3, 1], [-1, 0, -1], logits)
    assert result.accepted_nodes == (0, 1) and result.bonus_token == 5
    assert len(result.accepted_entropies) == 2 and result.rejected_entropies == ()  # node 1 is a leaf
    assert result.accepted_length == 3


def test_greedy_picks_the_matching_sibling_and_stops_on_a_mismatch():
    # Root's children: node 0 (tok 2) and node 2 (tok 1); argmax 1 -> node 2. Node 2 has no children.
    assert greedy_accept([2, 3, 1], [-1, 0, -1], one_hot_logits(1, 3, 5, 4)).accepted_nodes == (2,)
    # Argmax 4 is no child of the root: nothing accepted, bonus 4 from row 0, one rejected entropy.
    result = greedy_accept([2, 3, 1], [-1, 0, -1], one_hot_logits(4, 3, 5, 0))
    assert result.accepted_nodes == () and result.bonus_token == 4
    assert len(result.rejected_entropies) == 1


def test_greedy_ties_go_to_the_lowest_id_and_entropy_is_in_nats():
    # Row 0 is uniform over 4 tokens: argmax 0 (lowest id), entropy ln 4 = 1.386.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0]])
    result = greedy_accept([0], [-1], logits)
    assert result == ValidationResult((0,), 2, (pytest.approx(LN4),), ())


def test_greedy_empty_tree_returns_only_the_bonus():
    result = greedy_accept([], [], one_hot_logits(3))
    assert result == ValidationResult((), 3, (), ())


def test_greedy_precomputed_argmax_overrides_the_decoded_logits():
    # fp8 rows are shifted to their max, so near-ties at the top survive down to e4m3's subnormal
    # step: here 100.0 vs 100.0001 -> [-1e-4, 0, -100, -100] at scale 100/448, and -1e-4 / scale
    # = -4.5e-4 is below half the smallest subnormal (2^-10): the decoded row ties and the argmax
    # moves to id 0; the primary's fp32 argmax (id 1) keeps the decision exact.
    logits = torch.tensor([[100.0, 100.0001, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    decoded = decode_logits(encode_logits(logits, "fp8_e4m3"))
    assert decoded[0, 0] == decoded[0, 1]
    assert greedy_accept([1], [-1], decoded).accepted_nodes == ()
    exact = greedy_accept([1], [-1], decoded, argmax_ids=logits.argmax(dim=-1))
    assert exact.accepted_nodes == (0,) and exact.bonus_token == 3


# ---- sample (recursive rejection sampling) -----------------------------------------------------


def test_sample_point_masses_accept_with_certainty():
    # Target rows are point masses at 1, 2, 3: the chain [1, 2] is accepted with p = 1 each and the
    # leaf's bonus is 3, whatever the seed.
    logits = point_mass_logits(1, 2, 3)
    for seed in range(5):
        result = rejection_sample_accept([1, 2], [-1, 0], logits, SAMPLED, make_generator(seed, 0))
        assert result.accepted_nodes == (0, 1) and result.bonus_token == 3


def test_sample_deterministic_drafts_are_sampled_without_replacement():
    # Root target [0, .5, .5, 0]; children tok 1 then tok 2 (deterministic drafts).
    # tok 1: accepted with prob .5; on reject p becomes [0, 0, 1, 0] and tok 2 is accepted for sure.
    # Either way exactly one child is accepted; its row (node 0 -> 3, node 1 -> 0) gives the bonus.
    logits = torch.cat([probs_logits([1e-30, 0.5, 0.5, 1e-30]), point_mass_logits(3, 0)])
    logits[0, [0, 3]] = NEG
    seen = set()
    for seed in range(40):
        result = rejection_sample_accept([1, 2], [-1, -1], logits, SAMPLED, make_generator(seed, 0))
        seen.add((result.accepted_nodes, result.bonus_token))
    assert seen == {((0,), 3), ((1,), 0)}


def test_sample_correction_token_comes_from_the_residual():
    # Target p = [0, .5, .5, 0]; the draft drew tok 0 from q = [.5, .5, 0, 0].
    # p(0)/q(0) = 0 -> always rejected; residual max(p - q, 0) = [0, 0, .5, 0] -> correction is tok 2
    # every time (resampling from p itself would give tok 1 half of the time).
    logits = probs_logits([1.0, 0.5, 0.5, 1.0])
    logits[0, [0, 3]] = NEG
    logits = torch.cat([logits, torch.zeros(1, 4)])
    draft_probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    for seed in range(20):
        result = rejection_sample_accept([0], [-1], logits, SAMPLED, make_generator(seed, 0), draft_probs=draft_probs)
        assert result == ValidationResult((), 2, (), (pytest.approx(math.log(2.0)),))


def test_sample_later_siblings_exclude_earlier_tokens_from_their_draft():
    # Target p = [.5, .5, 0, 0] (row 0). Children: tok 2 (point mass, p = 0: rejected for sure), then
    # tok 0 with q = [.5, 0, .5, 0]. Without tok 2 that q is [1, 0, 0, 0]: accept prob p(0)/1 = .5 and
    # on reject residual max([.5,.5,0,0] - [1,0,0,0], 0) -> tok 1. Without the exclusion the accept
    # prob would be min(1, .5/.5) = 1 and tok 1 could never appear.
    logits = torch.cat([probs_logits([0.5, 0.5, 1.0, 1.0]), torch.zeros(2, 4)])
    logits[0, [2, 3]] = NEG
    draft_probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.5, 0.0]])
    outcomes = set()
    for seed in range(40):
        result = rejection_sample_accept(
            [2, 0], [-1, -1], logits, SAMPLED, make_generator(seed, 0), draft_probs=draft_probs
        )
        outcomes.add((result.accepted_nodes, result.bonus_token if not result.accepted_nodes else None))
    assert outcomes == {((1,), None), ((), 1)}


def test_sample_applies_the_sampling_params_to_the_target():
    # Root logits favour tok 1 slightly over tok 2; with top_k = 1 the target is a point mass on tok 1,
    # so the draft tok 2 is always rejected and tok 1 is the correction.
    logits = torch.tensor([[0.0, 1.1, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=1)
    for seed in range(10):
        result = rejection_sample_accept([2], [-1], logits, params, make_generator(seed, 0))
        assert result.accepted_nodes == () and result.bonus_token == 1


def test_sample_at_temperature_zero_equals_greedy():
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    token_ids, parents = [int(logits[0].argmax()), 4, 5], [-1, 0, -1]
    greedy = greedy_accept(token_ids, parents, logits)
    sampled = rejection_sample_accept(token_ids, parents, logits, GREEDY, make_generator(1, 0))
    assert (sampled.accepted_nodes, sampled.bonus_token) == (greedy.accepted_nodes, greedy.bonus_token)


# ---- threshold (lossy) -------------------------------------------------------------------------

ROW_532 = [0.5, 0.3, 0.2, 1e-9]  # root probabilities; children tok 1 (ratio .6) and tok 2 (ratio .4)


def test_threshold_accepts_near_argmax_tokens_at_temperature_zero():
    logits = torch.cat([probs_logits(ROW_532), one_hot_logits(3, 0, vocab_size=4)])
    # Greedy rejects both (argmax is tok 0) ...
    assert greedy_accept([1, 2], [-1, -1], logits).accepted_nodes == ()
    # ... threshold .5: only tok 1 qualifies (.3 >= .5 * .5); bonus = argmax of node 0's row = 3.
    assert threshold_accept([1, 2], [-1, -1], logits, GREEDY, 0.5, None) == ValidationResult(
        (0,), 3, (pytest.approx(1.0297, abs=1e-4),), ()
    )
    # threshold .3: both qualify, the more likely tok 1 wins although it comes first here anyway;
    # swapped order (tok 2 first) still picks tok 1.
    assert threshold_accept([2, 1], [-1, -1], logits, GREEDY, 0.3, None).accepted_nodes == (1,)
    # threshold .7: none qualifies -> bonus is the root's argmax, tok 0.
    result = threshold_accept([1, 2], [-1, -1], logits, GREEDY, 0.7, None)
    assert result.accepted_nodes == () and result.bonus_token == 0 and len(result.rejected_entropies) == 1


def test_threshold_uses_the_distribution_after_sampling_params():
    # top_k = 2 keeps toks 0, 1 -> p = [.625, .375, 0, 0]: tok 1 qualifies at .5 (ratio .6), tok 2 has
    # p = 0 and never qualifies. Node 0's row is a point mass on 3 -> the sampled bonus is 3.
    logits = torch.cat([probs_logits(ROW_532), point_mass_logits(3, 0)])
    params = SamplingParams(temperature=1.0, top_k=2)
    assert threshold_accept([1, 2], [-1, -1], logits, params, 0.5, make_generator(0, 0)).accepted_nodes == (0,)
    assert threshold_accept([2], [-1], logits[[0, 2]], params, 0.01, make_generator(0, 0)).accepted_nodes == ()


def test_threshold_zero_means_off():
    logits = torch.cat([probs_logits(ROW_532), one_hot_logits(3, 0, vocab_size=4)])
    off = validate_tree([1, 2], [-1, -1], logits, GREEDY, AcceptanceMode.GREEDY, acceptance_threshold=0.0)
    assert off == greedy_accept([1, 2], [-1, -1], logits)


# ---- determinism -------------------------------------------------------------------------------


def test_deterministic_when_seeded():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 5, generator=generator)  # [N+1, V], N = 6
    token_ids, parents = [0, 1, 2, 3, 4, 0], [-1, -1, 0, 0, 2, 4]
    draft_probs = torch.softmax(torch.randn(6, 5, generator=generator), dim=-1)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    results = [
        validate_tree(token_ids, parents, logits, params, AcceptanceMode.SAMPLE, draft_probs=draft_probs, position=s)
        for s in range(30)
    ]
    again = [
        validate_tree(token_ids, parents, logits, params, AcceptanceMode.SAMPLE, draft_probs=draft_probs, position=s)
        for s in range(30)
    ]
    assert results == again
    assert len({(r.accepted_nodes, r.bonus_token) for r in results}) > 1  # the step does change the stream


# ---- a seed's draws follow the token's position ------------------------------------------------


def test_sample_walk_commits_what_plain_seeded_sampling_draws():
    """Steps over trees of deterministic drafts, some right and some wrong, commit exactly the tokens a
    plain decode draws with the same seed (the token at position p from stream (seed, p)), however
    the steps are cut: what makes a seed reproduce an answer with or without speculation."""
    rng = torch.Generator().manual_seed(3)
    vocab_size = 6
    table = torch.randn(vocab_size, vocab_size, generator=rng) * 1.5  # [V, V]: next-token logits of the last token
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    for seed in range(20):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        plain, last = [], 0
        for position in range(24):
            last = int(sample(logits_to_probs(table[last][None], params), make_generator(seed, position))[0])
            plain.append(last)
        drafted, last, shapes = [], 0, random.Random(seed)
        while len(drafted) < len(plain):
            truth = plain[len(drafted) : len(drafted) + 4]
            wrong = [(t + 1 + shapes.randrange(vocab_size - 1)) % vocab_size for t in truth]
            cut = shapes.randrange(len(truth) + 1)  # the first `cut` right, then a wrong one
            chain = (truth[:cut] + wrong[cut : cut + 1])[:4]
            token_ids, parents = list(chain), [-1] + list(range(len(chain) - 1))
            if shapes.random() < 0.5 and chain:  # a wrong sibling at the root beside the chain
                sibling = next(t for t in range(vocab_size) if t != chain[0])
                token_ids, parents = token_ids + [sibling], parents + [-1]
            rows = [last] + token_ids  # each node's row: the bigram row of its token
            result = validate_tree(
                token_ids, parents, table[rows], params, AcceptanceMode.SAMPLE, position=len(drafted)
            )
            assert len(result.accepted_nodes) >= min(cut, len(truth))
            drafted += [token_ids[j] for j in result.accepted_nodes] + [result.bonus_token]
            last = drafted[-1]
        assert drafted[: len(plain)] == plain, f"seed {seed}"


def test_threshold_bonus_is_drawn_on_its_positions_stream():
    """Threshold mode at temperature > 0 draws its bonus token from the stream of the bonus's position."""
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.zeros(2, 6)  # a flat row: the draw decides
    result = validate_tree([3], [-1], logits, params, AcceptanceMode.THRESHOLD, acceptance_threshold=0.9, position=7)
    expected = int(sample(logits_to_probs(logits[1:], params), make_generator(5, 8))[0])
    assert result.accepted_nodes == (0,)
    assert result.bonus_token == expected
