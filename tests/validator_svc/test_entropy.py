from __future__ import annotations

import json
import math

import pytest
import torch

from validator_svc.entropy import DEFAULT_ENTROPY_BIN_EDGES, EntropyAcceptanceStats, row_entropy


def test_row_entropy_hand_cases():
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4
            [3.0, -math.inf, -math.inf, -math.inf],  # one token left: 0
            [1.0, 1.0, -math.inf, -math.inf],  # two equal tokens: ln 2
            [100.0, 0.0, 0.0, 0.0],  # nearly one-hot, no overflow: ~0
        ]
    )
    torch.testing.assert_close(
        row_entropy(logits), torch.tensor([math.log(4), 0.0, math.log(2), 0.0]), atol=1e-6, rtol=0
    )


def test_row_entropy_equals_minus_sum_p_log_p():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    probs = torch.softmax(logits.double(), dim=-1)
    torch.testing.assert_close(row_entropy(logits).double(), -(probs * probs.log()).sum(dim=-1), atol=1e-5, rtol=0)


def test_bins_are_left_closed_and_clamped():
    stats = EntropyAcceptanceStats()
    assert stats.num_bins == 7
    # [0, .5) [.5, 1) [1, 1.5) [1.5, 2) [2, 2.8) [2.8, 4) [4, inf)
    assert [stats.bin_index(h) for h in (-1e-7, 0.0, 0.49, 0.5, 2.79, 2.8, 4.0, 50.0)] == [0, 0, 0, 1, 4, 5, 6, 6]


def test_record_merge_and_rates():
    # Step 1: accepted at entropies .2 and .3, rejected at 3.0. Step 2: accepted at 3.5.
    first = EntropyAcceptanceStats().record([0.2, 0.3], [3.0])
    second = EntropyAcceptanceStats().record([3.5], [])
    merged = first.merge(second)
    assert merged.num_proposed == (2, 0, 0, 0, 0, 2, 0)
    assert merged.num_accepted == (2, 0, 0, 0, 0, 1, 0)
    assert merged.acceptance_rates() == (1.0, None, None, None, None, 0.5, None)
    assert first.num_proposed == (2, 0, 0, 0, 0, 1, 0)  # record returns a copy


def test_plain_dict_round_trip_through_json():
    stats = EntropyAcceptanceStats().record([0.1, 1.2], [4.5])
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["bin_edges"][-1] == "inf"
    assert EntropyAcceptanceStats.from_dict(data) == stats
    assert stats.bin_edges == DEFAULT_ENTROPY_BIN_EDGES


def test_invalid_stats_raise():
    with pytest.raises(ValueError, match="bin_edges"):
        EntropyAcceptanceStats((1.0, 0.5))
    with pytest.raises(ValueError, match="num_proposed"):
        EntropyAcceptanceStats((0.0, 1.0), (1, 2))
    with pytest.raises(ValueError, match="num_accepted"):
        EntropyAcceptanceStats((0.0, 1.0), (1,), (2,))
    with pytest.raises(ValueError, match="bin_edges differ"):
        EntropyAcceptanceStats().merge(EntropyAcceptanceStats((0.0, math.inf)))
    with pytest.raises(ValueError, match="EntropyAcceptanceStats"):
        EntropyAcceptanceStats.from_dict({"bin_edges": [0, 1]})
