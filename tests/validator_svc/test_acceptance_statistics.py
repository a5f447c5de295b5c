"""Sample mode is lossless: the emitted tokens follow the primary's distribution after sampling params.

A toy primary and toy draft decoders over V = 5 tokens are bigram tables: the next-token logits depend
on the last token only, so the exact target of the first two emitted tokens is
    P(t1 = a, t2 = b) = p(a | root) * p(b | a),   p = logits_to_probs(table, params).
Each trial runs whole speculative steps (propose -> validate -> commit) until two tokens are emitted,
then counts (t1, t2). A step that emits one token (rejection at the root) is followed by another step
from the new context, so the joint covers the accepted, bonus and correction paths alike.

The feature decoder (EAGLE-2 trees, draft_svc/strategies/feature.py) proposes here too, as the pool
runs it: a small seeded drafter over V, a head over 4 of the 5 tokens (FR-Spec: one token is never
drafted), and toy "primary features" (the feature predicting position p is a fixed random row of the
token at p - 1), so its point-mass trees of several candidates depend on the whole context.

Test: Pearson chi-square over the 25 cells (cells with expected count < 5 pooled), rejecting at the
1e-4 upper quantile (Wilson-Hilferty), so a correct rule fails with probability 1e-4 per test for a
random seed; the seeds here are fixed, so the outcome is deterministic. Cells of probability 0 must
stay empty. `test_a_biased_rule_is_detected` shows the test has the power to fail.

With penalties and min_p the target depends on the whole history, as the primary processes it
(specdec.penalties: each tree row from the context plus its path; the root token is the prompt):
    P(t1 = a, t2 = b) = p(a | prompt, output []) * p(b | prompt, output [a]).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import random
from typing import Callable

import pytest
import torch

from draft_svc.heads.model import FeatureDrafter, SharedParts
from draft_svc.strategies.feature import FeatureDecoder, FeatureTreeConfig
from specdec.acceptance_mode import AcceptanceMode
from specdec.engine.tree import ROOT
from specdec.penalties import penalize
from specdec.sampling import SamplingParams, logits_to_probs, make_generator
from validator_svc import acceptance
from validator_svc.acceptance import rejection_sample_accept, validate_tree
from tests.draft_svc.tiny_drafter import TINY

# Thousands of tiny-tensor calls: extra intra-op threads only add contention
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB_SIZE = 5
ROOT_TOKEN = 0
NUM_TRIALS = 800
NUM_TRIALS_BIASED = 400  # the biased rule below scores chi2 ~ 100 against a critical ~ 45
Z_1E4 = 3.719  # standard normal upper 1e-4 quantile
PARAMS = SamplingParams(temperature=1.0, top_k=4, top_p=0.97)  # each row keeps 3-4 tokens
# Every history-dependent control, and min_p (it empties 6 more of the 25 (t1, t2) cells than top-k 4 alone)
PENALIZED_PARAMS = SamplingParams(
    temperature=1.0,
    top_k=4,
    min_p=0.4,
    repetition_penalty=1.6,
    frequency_penalty=0.5,
    presence_penalty=0.3,
    logit_bias=((2, 0.4),),
)

_tables = torch.Generator().manual_seed(11)
TARGET_LOGITS = torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=_tables) * 0.8  # [V, V]: row = last token
DRAFT_LOGITS_1 = TARGET_LOGITS + torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=_tables)  # a decent drafter
DRAFT_LOGITS_2 = torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=_tables) * 0.8  # an unrelated one
TARGET_PROBS = logits_to_probs(TARGET_LOGITS, PARAMS)  # [V, V]
DRAFT_PROBS_1 = logits_to_probs(DRAFT_LOGITS_1, PARAMS)
DRAFT_PROBS_2 = logits_to_probs(DRAFT_LOGITS_2, PARAMS)

Candidate = tuple[list[int], list[torch.Tensor] | None]  # tokens, and the rows they were drawn from
Proposer = Callable[[tuple[int, ...], random.Random], list[Candidate]]  # (context: root token .. last, rng)

# The tiny drafter at half its width, over VOCAB_SIZE tokens
FEATURE_DRAFTER = dataclasses.replace(
    TINY,
    hidden_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=32,
    vocab_size=VOCAB_SIZE,
    draft_vocab_size=VOCAB_SIZE - 1,
)
FEATURE_TREE = FeatureTreeConfig(top_k=3, beam=2)
FEATURE_DEPTH, FEATURE_CANDIDATES, FEATURE_NODES = 3, 4, 7


def stochastic_chain(draft_probs: torch.Tensor, last: int, length: int, rng: random.Random) -> Candidate:
    tokens, rows = [], []
    for _ in range(length):
        row = draft_probs[last]  # [V]
        last = rng.choices(range(VOCAB_SIZE), weights=row.tolist())[0]
        tokens.append(last)
        rows.append(row)
    return tokens, rows


def greedy_chain(draft_logits: torch.Tensor, first: int, length: int) -> Candidate:
    tokens = [first]
    while len(tokens) < length:
        tokens.append(int(draft_logits[tokens[-1]].argmax()))
    return tokens, None


@functools.cache
def feature_parts() -> tuple[FeatureDrafter, SharedParts, torch.Tensor]:
    """The feature decoder's drafter and shared parts, and the toy primary's features [V + 1, C]: row x is
    the feature after token x, the last row the one before the root token."""
    g = torch.Generator().manual_seed(5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        drafter = FeatureDrafter(FEATURE_DRAFTER).eval().requires_grad_(False)
    c = FEATURE_DRAFTER
    table = torch.randn(c.vocab_size, c.hidden_size, generator=g)
    shared = SharedParts(
        embed=lambda ids: table[ids],
        final_norm=1 + 0.1 * torch.randn(c.hidden_size, generator=g),
        head=torch.randn(c.draft_vocab_size, c.hidden_size, generator=g),
        vocab=torch.randperm(c.vocab_size, generator=g)[: c.draft_vocab_size],
        eps=c.rms_norm_eps,
    )
    return drafter, shared, torch.randn(c.vocab_size + 1, c.hidden_size, generator=g)


@functools.cache
def feature_tree(context: tuple[int, ...]) -> list[Candidate]:
    """The feature decoder's candidates after `context` (deterministic: a function of the context, so
    cached), fed every position's feature as the gateway forwards them: row i predicts position i."""
    drafter, shared, features = feature_parts()
    decoder = FeatureDecoder(drafter, shared, FEATURE_TREE)
    decoder.extend(context)
    decoder.observe_features(0, features[[VOCAB_SIZE, *context[:-1]]])
    candidates = decoder.propose(FEATURE_DEPTH, FEATURE_CANDIDATES, max_nodes=FEATURE_NODES)
    assert candidates, context
    return [(list(c.token_ids), None) for c in candidates]


def merge(candidates: list[Candidate]) -> tuple[list[int], list[int], torch.Tensor]:
    """Merge by common prefix, siblings deduped in candidate order; a deterministic node's row is one-hot."""
    token_ids: list[int] = []
    parents: list[int] = []
    rows: list[torch.Tensor] = []
    for tokens, drawn_from in candidates:
        parent = ROOT
        for depth, token in enumerate(tokens):
            node = next((j for j in range(len(token_ids)) if parents[j] == parent and token_ids[j] == token), None)
            if node is None:
                token_ids.append(token)
                parents.append(parent)
                rows.append(
                    drawn_from[depth]
                    if drawn_from
                    else torch.nn.functional.one_hot(torch.tensor(token), VOCAB_SIZE).float()
                )
                node = len(token_ids) - 1
            parent = node
    return token_ids, parents, torch.stack(rows) if rows else torch.zeros(0, VOCAB_SIZE)


def first_two_tokens(
    propose: Proposer, trial: int, is_deterministic: bool, rule: str = "service", params: SamplingParams = PARAMS
) -> tuple[int, int]:
    """rule "service": validate_tree in sample mode as the validator runs it (the per-position walk
    for deterministic drafts, seeded by the trial); "rejection": rejection sampling for every tree."""
    draft_rng = random.Random(1_000_003 + trial)  # independent of the validator's stream
    emitted: list[int] = []
    last, step = ROOT_TOKEN, 0
    while len(emitted) < 2:
        token_ids, parents, draft_probs = merge(propose((ROOT_TOKEN, *emitted), draft_rng))
        target_logits = TARGET_LOGITS[[last] + token_ids]  # [N+1, V]: the bigram row of each node's token
        # as the primary returns them: each row processed from its own history (none without penalties)
        target_logits = penalize(target_logits, params, [ROOT_TOKEN], emitted, token_ids, parents)
        if rule == "service":
            result = validate_tree(
                token_ids,
                parents,
                target_logits,
                dataclasses.replace(params, seed=trial),
                AcceptanceMode.SAMPLE,
                draft_probs=None if is_deterministic else draft_probs,
                position=len(emitted),
            )
        else:
            result = rejection_sample_accept(
                token_ids,
                parents,
                target_logits,
                params,
                make_generator(trial, step),
                draft_probs=None if is_deterministic else draft_probs,
            )
        emitted += [token_ids[j] for j in result.accepted_nodes] + [result.bonus_token]
        last, step = emitted[-1], step + 1
    return emitted[0], emitted[1]


def chi_square_check(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, 1e-4 critical value); asserts zero-probability cells are empty."""
    counts, expected = counts.flatten().double(), expected_probs.flatten().double() * counts.sum()
    assert float(counts[expected == 0].sum()) == 0.0, "a token of probability 0 was emitted"
    is_large = expected >= 5
    observed_cells = torch.cat([counts[is_large], counts[(expected > 0) & ~is_large].sum()[None]])
    expected_cells = torch.cat([expected[is_large], expected[(expected > 0) & ~is_large].sum()[None]])
    keep = expected_cells > 0
    statistic = float((((observed_cells - expected_cells) ** 2) / expected_cells)[keep].sum())
    dof = int(keep.sum()) - 1
    critical = dof * (1 - 2 / (9 * dof) + Z_1E4 * math.sqrt(2 / (9 * dof))) ** 3
    return statistic, critical


def run_trials(
    propose: Proposer,
    is_deterministic: bool,
    num_trials: int = NUM_TRIALS,
    rule: str = "service",
    params: SamplingParams = PARAMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    joint_counts = torch.zeros(VOCAB_SIZE, VOCAB_SIZE)
    for trial in range(num_trials):
        first, second = first_two_tokens(propose, trial, is_deterministic, rule, params)
        joint_counts[first, second] += 1
    return joint_counts, joint_target_probs(params)


def joint_target_probs(params: SamplingParams) -> torch.Tensor:
    """P(t1 = a, t2 = b) [V, V] of sequential sampling from the primary's processed distributions."""
    first = logits_to_probs(penalize(TARGET_LOGITS[[ROOT_TOKEN]], params, [ROOT_TOKEN], []), params)[0]  # [V]
    second = torch.cat(
        [logits_to_probs(penalize(TARGET_LOGITS[[a]], params, [ROOT_TOKEN], [a]), params) for a in range(VOCAB_SIZE)]
    )  # [V, V]: row a = p(. | output [a])
    return first[:, None] * second


PROPOSERS: dict[str, tuple[Proposer, bool]] = {
    "chain, stochastic draft": (lambda ctx, g: [stochastic_chain(DRAFT_PROBS_1, ctx[-1], 3, g)], False),
    # Two i.i.d. drafters (SpecInfer-style): frequent collisions exercise dedup + sibling exclusion.
    "tree, stochastic drafts": (
        lambda ctx, g: [
            stochastic_chain(DRAFT_PROBS_1, ctx[-1], 2, g),
            stochastic_chain(DRAFT_PROBS_1, ctx[-1], 2, g),
            stochastic_chain(DRAFT_PROBS_2, ctx[-1], 2, g),
        ],
        False,
    ),
    "chain, deterministic draft": (
        lambda ctx, g: [greedy_chain(DRAFT_LOGITS_1, int(DRAFT_LOGITS_1[ctx[-1]].argmax()), 3)],
        True,
    ),
    "tree, deterministic drafts": (
        lambda ctx, g: [
            greedy_chain(DRAFT_LOGITS_1, int(r), 2) for r in DRAFT_LOGITS_1[ctx[-1]].argsort(descending=True)[:3]
        ],
        True,
    ),
    "tree, mixed drafts": (
        lambda ctx, g: [
            greedy_chain(DRAFT_LOGITS_2, int(DRAFT_LOGITS_2[ctx[-1]].argmax()), 2),
            stochastic_chain(DRAFT_PROBS_1, ctx[-1], 2, g),
        ],
        False,
    ),
    # EAGLE-2 trees (top 3 children, beam 2, up to 7 nodes over 3 depths), point masses as the services send
    "tree, feature decoder": (lambda ctx, g: feature_tree(ctx), True),
}


@pytest.mark.parametrize(
    "name, rule",
    [(name, "service") for name in PROPOSERS]
    + [(name, "rejection") for name, (_, is_deterministic) in PROPOSERS.items() if is_deterministic],
)
def test_sample_mode_matches_the_target_distribution(name, rule):
    """Both rules for deterministic drafts (the service's per-position walk, and rejection sampling
    with point masses, which the library keeps for trees that mix in drawn drafts)."""
    propose, is_deterministic = PROPOSERS[name]
    joint_counts, joint_target = run_trials(propose, is_deterministic, rule=rule)
    first_stat, first_critical = chi_square_check(joint_counts.sum(dim=1), TARGET_PROBS[ROOT_TOKEN])
    joint_stat, joint_critical = chi_square_check(joint_counts, joint_target)
    assert first_stat < first_critical, f"first token: chi2 {first_stat:.1f} >= {first_critical:.1f}"
    assert joint_stat < joint_critical, f"first two tokens: chi2 {joint_stat:.1f} >= {joint_critical:.1f}"


def test_the_feature_decoders_trees_are_accepted_in_part():
    """Its drafts are used, not just offered: from the root, some steps accept nothing, some 2+ tokens."""
    token_ids, parents, _ = merge(feature_tree((ROOT_TOKEN,)))
    assert len(token_ids) == FEATURE_NODES and parents.count(ROOT) > 1  # a tree, not a chain
    target_logits = TARGET_LOGITS[[ROOT_TOKEN] + token_ids]
    num_accepted = collections.Counter(
        len(
            validate_tree(
                token_ids, parents, target_logits, dataclasses.replace(PARAMS, seed=seed), AcceptanceMode.SAMPLE
            ).accepted_nodes
        )
        for seed in range(200)
    )
    assert num_accepted[0] > 0 and sum(n for a, n in num_accepted.items() if a >= 2) > 0, num_accepted


def test_a_biased_rule_is_detected(monkeypatch):
    """Resampling the correction from p instead of the residual max(p - q, 0) must fail the test."""
    monkeypatch.setattr(acceptance, "_residual", lambda p, q, x: p)
    propose, is_deterministic = PROPOSERS["chain, stochastic draft"]
    joint_counts, joint_target = run_trials(propose, is_deterministic, NUM_TRIALS_BIASED)
    joint_stat, joint_critical = chi_square_check(joint_counts, joint_target)
    assert joint_stat > joint_critical


def root_output_distribution(children: list[tuple[int, torch.Tensor]], is_excluding: bool) -> torch.Tensor:
    """Exact distribution [V] of the first token for fixed root children, by the module's own
    _proposal / _residual and the min(1, p/q) acceptance probability."""
    p = TARGET_PROBS[ROOT_TOKEN].double()  # [V]
    output, mass_left = torch.zeros(VOCAB_SIZE, dtype=torch.float64), 1.0
    offered: list[int] = []
    for token, draft_row in children:
        q = acceptance._proposal(draft_row, offered if is_excluding else [])
        q_x = 1.0 if q is None else float(q[token])
        accept_prob = min(1.0, float(p[token]) / q_x)
        output[token] += mass_left * accept_prob
        mass_left *= 1.0 - accept_prob
        p = acceptance._residual(p, q, token)
        offered.append(token)
    return output + mass_left * p


@pytest.mark.parametrize("is_excluding, is_exact", [(True, True), (False, False)])
def test_independent_drafts_merged_with_dedup_need_sibling_exclusion(is_excluding, is_exact):
    """Enumerate every root draw of three independent drafters (q1, q1, q2), dedup them in order as
    the merge does, and sum the exact output distributions. With the earlier siblings' tokens removed
    from q_j it equals the target (TV ~ 1e-8); with q_j as drawn it does not (TV ~ 0.017 here)."""
    drafters = [DRAFT_PROBS_1[ROOT_TOKEN], DRAFT_PROBS_1[ROOT_TOKEN], DRAFT_PROBS_2[ROOT_TOKEN]]
    total = torch.zeros(VOCAB_SIZE, dtype=torch.float64)
    for draws in itertools.product(range(VOCAB_SIZE), repeat=len(drafters)):
        weight = math.prod(float(q[x]) for q, x in zip(drafters, draws))
        if weight == 0.0:
            continue
        children: dict[int, torch.Tensor] = {}
        for token, q in zip(draws, drafters):
            children.setdefault(token, q)  # the first proposer of a token owns the node
        total += weight * root_output_distribution(list(children.items()), is_excluding)
    total_variation = float((total - TARGET_PROBS[ROOT_TOKEN].double()).abs().sum()) / 2
    assert (total_variation < 1e-6) == is_exact, total_variation


@pytest.mark.parametrize("name", ["tree, mixed drafts", "tree, deterministic drafts"])
def test_sample_mode_with_penalties_and_min_p_matches_the_processed_target(name):
    """Drafts from the unprocessed tables (any draft distribution is lossless); the primary's rows
    processed per node from its own path, min_p applied by the validator after top-k."""
    propose, is_deterministic = PROPOSERS[name]
    joint_counts, joint_target = run_trials(propose, is_deterministic, params=PENALIZED_PARAMS)
    without_min_p = joint_target_probs(dataclasses.replace(PENALIZED_PARAMS, min_p=0.0))
    assert not torch.allclose(joint_target, joint_target_probs(PARAMS)), "the controls change nothing"
    assert int((joint_target == 0).sum()) > int((without_min_p == 0).sum()), "min_p drops nothing"
    joint_stat, joint_critical = chi_square_check(joint_counts, joint_target)
    assert joint_stat < joint_critical, f"first two tokens: chi2 {joint_stat:.1f} >= {joint_critical:.1f}"
