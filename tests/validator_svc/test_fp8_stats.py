"""Row statistics of fp8 logits from byte counts (validator_svc.fp8_stats) against the decoded
reference (kernel.row_stats_reference on decode_logits), and the torch path that uses them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.grammar.bitmask import TokenBitmask
from specdec.logits_codec import decode_logits, encode_logits
from specdec.model import native
from validator_svc import paths
from validator_svc.acceptance import validate_tree
from validator_svc.fp8_stats import byte_counts, fp8_row_stats
from validator_svc.kernel import row_stats_reference
from validator_svc.paths import TorchPath, ValidationInputs
from specdec.acceptance_mode import AcceptanceMode
from specdec.sampling import SamplingParams


def random_mask(token_ids, parents, vocab_size: int, seed: int) -> TokenBitmask:
    """About 30 % of each row forbidden (token 0 always allowed), and node 1 off the grammar."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(len(token_ids) + 1, vocab_size, generator=generator) < 0.7  # [N+1, V]
    allowed[:, 0] = True
    allowed[parents[1] + 1, token_ids[1]] = False
    return TokenBitmask.from_bool(allowed)


def assert_stats_match_the_decoded_reference(encoded, token_ids, parents, allowed=None) -> None:
    got = fp8_row_stats(encoded, token_ids, parents, allowed=allowed)
    expected = row_stats_reference(decode_logits(encoded), token_ids, parents, allowed)
    assert torch.equal(got.row_max, expected.row_max)  # exact: a decoded value
    assert torch.equal(got.argmax_ids, expected.argmax_ids)  # the first maximum, ties included
    assert torch.equal(got.child_logits, expected.child_logits)  # exact: a decoded value
    for name in ("log_normalizer", "entropy", "child_probs"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("vocab_size", [70, 49152])
def test_byte_count_statistics_equal_the_decoded_references(random_tree_logits, vocab_size):
    for seed in range(3):
        token_ids, parents, logits = random_tree_logits(8, vocab_size, seed)
        logits[3] = 0.0  # an all-zero row: scale 1, entropy log V
        logits[4, : vocab_size // 3] = logits[4].max()  # ties at the max: the first wins
        logits[5, 1] = logits[5].max() - 1e-7  # rounds to -0.0 once shifted: ties 0.0, position 1 first
        encoded = encode_logits(logits, "fp8_e4m3")
        assert_stats_match_the_decoded_reference(encoded, token_ids, parents)
        assert_stats_match_the_decoded_reference(
            encoded, token_ids, parents, random_mask(token_ids, parents, vocab_size, seed)
        )
        given = fp8_row_stats(encoded, token_ids, parents, argmax_ids=list(range(9)))
        assert given.argmax_ids.tolist() == list(range(9))


def test_byte_counts_natively_and_in_numpy_agree():
    codes = np.random.default_rng(0).integers(0, 256, size=(5, 1001), dtype=np.uint8)
    allowed = torch.rand(5, 1001, generator=torch.Generator().manual_seed(0)) < 0.5
    allowed[1] = True  # whole words, and a partial last word (1001 = 31 * 32 + 9)
    allowed[2, :64] = False
    mask = TokenBitmask.from_bool(allowed)
    counts, masked = byte_counts(codes), byte_counts(codes, mask)
    with native.disabled():
        assert np.array_equal(byte_counts(codes), counts)
        assert np.array_equal(byte_counts(codes, mask), masked)
    assert counts.sum(axis=1).tolist() == [1001] * 5 and counts[2, codes[2, 7]] >= 1
    assert masked.sum(axis=1).tolist() == allowed.sum(dim=1).tolist()
    expected = [np.bincount(codes[r][allowed[r].numpy()], minlength=256) for r in range(5)]
    assert np.array_equal(masked, np.stack(expected))


def test_a_nan_byte_makes_the_row_statistics_invalid(random_tree_logits):
    token_ids, parents, logits = random_tree_logits(3, 70, 0)
    encoded = encode_logits(logits, "fp8_e4m3")
    data = bytearray(encoded.data)
    data[70 * 2 + 5] = 0x7F  # row 2 holds e4m3fn's NaN
    bad = type(encoded)(encoded.format, encoded.num_rows, encoded.vocab_size, bytes(data), encoded.row_scales)
    with pytest.raises(ValueError, match="target_logits row 2"):
        fp8_row_stats(bad, token_ids, parents).check_finite()


def test_a_bad_tree_is_refused_before_any_byte_is_read():
    encoded = encode_logits(torch.zeros(3, 10), "fp8_e4m3")
    with pytest.raises(ValueError, match="parents"):
        fp8_row_stats(encoded, [1, 2], [-1, 5])
    with pytest.raises(ValueError, match="rows"):
        fp8_row_stats(encoded, [1], [-1])


@pytest.mark.parametrize("vocab_size", [70, 49152])
def test_the_torch_path_validates_fp8_from_byte_counts_as_the_decoded_reference_does(
    random_tree_logits, monkeypatch, vocab_size
):
    def no_decode(encoded):
        raise AssertionError("fp8 greedy validation decoded the logits")

    monkeypatch.setattr(paths, "decode_logits", no_decode)
    for seed in range(4):
        token_ids, parents, logits = random_tree_logits(8, vocab_size, seed)
        encoded = encode_logits(logits, "fp8_e4m3")
        decoded = decode_logits(encoded)
        mask = random_mask(token_ids, parents, vocab_size, seed)
        masked_argmax = mask.argmax(decoded).tolist()
        for mode, threshold, argmax, allowed in (
            (AcceptanceMode.GREEDY, 0.0, None, None),
            (AcceptanceMode.GREEDY, 0.0, decoded.argmax(dim=-1).tolist(), None),
            (AcceptanceMode.THRESHOLD, 0.3, None, None),
            (AcceptanceMode.GREEDY, 0.0, masked_argmax, mask),
            (AcceptanceMode.GREEDY, 0.0, None, mask),
            (AcceptanceMode.THRESHOLD, 0.3, None, mask),
        ):
            inputs = ValidationInputs(
                token_ids,
                parents,
                encoded,
                SamplingParams(),
                mode,
                acceptance_threshold=threshold,
                argmax_ids=argmax,
                allowed=allowed,
            )
            got = TorchPath().validate(inputs)
            expected = validate_tree(
                token_ids,
                parents,
                decoded,
                SamplingParams(),
                mode,
                acceptance_threshold=threshold,
                argmax_ids=argmax,
                allowed=allowed,
            )
            assert (got.accepted_nodes, got.bonus_token) == (expected.accepted_nodes, expected.bonus_token)
            assert got.accepted_entropies == pytest.approx(expected.accepted_entropies, rel=2e-5, abs=2e-5)
            assert got.rejected_entropies == pytest.approx(expected.rejected_entropies, rel=2e-5, abs=2e-5)
