"""specdec.penalties: tiny hand-computed cases, tree paths, and the equality that makes speculation
exact: a tree row's processed logits equal those of a plain step whose history is that row's."""

from __future__ import annotations

import pytest
import torch

from specdec.penalties import HELD_BACK_LOGIT, penalize, tree_path_pairs
from specdec.sampling import SamplingParams

V = 6


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def test_no_penalties_returns_the_logits_untouched():
    logits = torch.randn(3, V)
    assert penalize(logits, SamplingParams(temperature=1.0, min_p=0.5), [1], [2], [3, 4], [-1, 0]) is logits


def test_frequency_counts_output_only():
    logits = row(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    # prompt [0, 0], output [2, 2, 3]: token 0 is not penalised, 2 twice, 3 once
    out = penalize(logits, SamplingParams(frequency_penalty=0.5), [0, 0], [2, 2, 3])
    assert torch.equal(out, row(1.0, 1.0, 0.0, 0.5, 1.0, 1.0))
    assert torch.equal(logits, row(1.0, 1.0, 1.0, 1.0, 1.0, 1.0))  # the input is not modified


def test_presence_counts_once_and_may_be_negative():
    out = penalize(row(0, 0, 0, 0, 0, 0), SamplingParams(presence_penalty=-1.5), [4], [2, 2, 3])
    assert torch.equal(out, row(0, 0, 1.5, 1.5, 0, 0))


def test_repetition_divides_positive_and_multiplies_negative_over_prompt_and_output():
    logits = row(4.0, -4.0, 4.0, -4.0, 4.0, -4.0)
    out = penalize(logits, SamplingParams(repetition_penalty=2.0), [0, 1], [2, 3])
    assert torch.equal(out, row(2.0, -8.0, 2.0, -8.0, 4.0, -4.0))
    out = penalize(logits, SamplingParams(repetition_penalty=0.5), [0], [3])  # < 1 encourages repeats
    assert torch.equal(out, row(8.0, -4.0, 4.0, -2.0, 4.0, -4.0))


def test_logit_bias_comes_first_then_the_penalties():
    # token 1: -1 + 3 = 2 > 0, then repetition 2 divides it -> 1 (penalising first would give 2.5)
    out = penalize(
        row(0, -1.0, 0, 0, 0, 0), SamplingParams(repetition_penalty=2.0, logit_bias=((1, 3.0), (5, -100.0))), [1], []
    )
    assert torch.equal(out, row(0, 1.0, 0, 0, 0, -100.0))


def test_all_three_penalties_combine():
    # token 2: output twice, logit 3 -> 3 / 1.5 = 2 -> 2 - 0.25 * 2 - 0.5 = 1
    out = penalize(
        row(3.0, 3.0, 3.0, 3.0, 3.0, 3.0),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5),
        [0],
        [2, 2],
    )
    assert torch.equal(out, row(2.0, 3.0, 1.0, 3.0, 3.0, 3.0))


def test_tree_path_pairs():
    assert tree_path_pairs([]) == ([], [])
    assert tree_path_pairs([-1, 0, -1]) == ([1, 2, 2, 3], [0, 0, 1, 2])
    assert tree_path_pairs([-1, 0, 1]) == ([1, 2, 2, 3, 3, 3], [0, 0, 1, 0, 1, 2])


def test_each_tree_row_counts_its_own_path():
    # output [5]; tree: node 0 = 1 (root's child), node 1 = 1 (child of 0), node 2 = 2 (root's child)
    logits = torch.zeros(4, V)
    out = penalize(logits, SamplingParams(frequency_penalty=1.0), [0], [5], [1, 1, 2], [-1, 0, -1])
    expected = torch.zeros(4, V)
    expected[:, 5] = -1.0  # every row's history holds the output token
    expected[1, 1] = -1.0  # row 1 = node 0: path [1]
    expected[2, 1] = -2.0  # row 2 = node 1: path [1, 1]
    expected[3, 2] = -1.0  # row 3 = node 2: path [2]; its sibling's token 1 is not in its history
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=1.3),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, logit_bias=((3, 2.0),)),
        SamplingParams(min_tokens=5, min_tokens_ids=(2, 9)),  # rows at depth 1 hold back, deeper ones not
    ],
)
def test_a_tree_row_equals_a_plain_step_with_that_rows_history(params):
    """What greedy exactness needs: node i's row processed in the tree is bit-identical to the same
    logits processed as one plain row whose output ends with node i's path."""
    generator = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(6, vocab, generator=generator) * 5  # [N+1, V]
    prompt, output = [1, 2, 3, 2], [7, 7, 9]
    tree_ids, parents = [9, 7, 3, 9, 11], [-1, 0, 1, -1, 3]
    out = penalize(logits, params, prompt, output, tree_ids, parents)
    paths = {0: [9], 1: [9, 7], 2: [9, 7, 3], 3: [9], 4: [9, 11]}
    assert torch.equal(out[0:1], penalize(logits[0:1], params, prompt, output))
    for node, path in paths.items():
        plain = penalize(logits[node + 1 : node + 2], params, prompt, output + path)
        assert torch.equal(out[node + 1 : node + 2], plain), node


def test_only_history_columns_change():
    logits = torch.randn(2, 1000)
    out = penalize(logits, SamplingParams(repetition_penalty=1.2), [10, 20], [30], [40], [-1])
    changed = (out != logits).any(dim=0).nonzero().flatten().tolist()
    assert set(changed) <= {10, 20, 30, 40}


def test_min_tokens_holds_back_its_ids_on_the_rows_before_it():
    """Output [5] so far: row 0 picks output token 1, node 0's row token 2, node 1's row token 3."""
    logits = torch.randn(4, 20)
    params = SamplingParams(min_tokens=3, min_tokens_ids=(2, 7))
    out = penalize(logits, params, [1, 1], [5], [4, 6, 8], [-1, 0, -1])  # depths 1, 2, 1
    held = (out == HELD_BACK_LOGIT).nonzero().tolist()
    assert held == [[0, 2], [0, 7], [1, 2], [1, 7], [3, 2], [3, 7]]  # not row 2 (output token 3)
    others = out != HELD_BACK_LOGIT
    assert torch.equal(out[others], logits[others])
    reached = penalize(logits[:1], params, [1], [5, 6, 7])  # 3 output tokens: min_tokens reached
    assert torch.equal(reached, logits[:1])
    assert not bool((torch.softmax(out[0], dim=-1)[[2, 7]] > 0).any())  # exactly 0, not merely small
