"""The packed mask: hand cases, and every operation equal to the bool reference `apply_token_mask`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.grammar import MASKED_LOGIT, TokenBitmask, apply_token_mask


def _mask(rows: list[list[int]], vocab_size: int) -> TokenBitmask:
    allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for r, ids in enumerate(rows):
        allowed[r, ids] = True
    return TokenBitmask.from_bool(allowed)


def test_layout_and_bit_queries_by_hand():
    # V = 35 -> 2 words a row. Row 0 allows 0, 2, 33; row 1 allows 8 and 31 (the sign bit of word 0).
    mask = _mask([[0, 2, 33], [8, 31]], 35)
    assert mask.words.tolist() == [[0b101, 0b10], [0b1_0000_0000 - 2**31, 0]]
    assert mask.to_bytes() == bytes([0b101, 0, 0, 0, 0b10, 0, 0, 0, 0, 1, 0, 0x80, 0, 0, 0, 0])
    assert mask.is_allowed([0, 0, 0, 1, 1, 1], [0, 1, 33, 8, 31, 33]).tolist() == [True, False, True, True, True, False]
    assert mask.allowed_ids(0).tolist() == [0, 2, 33] and mask.allowed_ids(1).tolist() == [8, 31]


def test_argmax_by_hand_including_ties():
    logits = torch.tensor(
        [
            [1.0, 5.0, 3.0, 3.0],  # favourite 1 forbidden: 2 and 3 tie, lowest id wins
            [2.0, 0.0, -1.0, 2.0],  # favourite 0 allowed: kept
            [7.0, 7.0, 0.0, 0.0],
        ]
    )  # tie at the top, first one forbidden: 1
    mask = _mask([[0, 2, 3], [0, 1], [1, 2]], 4)
    assert mask.argmax(logits).tolist() == [2, 0, 1]


def test_masked_rows_by_hand():
    logits = torch.tensor([[1.0, 5.0, 3.0, -2.0], [0.0, 1.0, 2.0, 3.0]])
    mask = _mask([[2], [0, 1, 3]], 4)
    assert mask.masked_rows(logits, [1, 0]).tolist() == [
        [0.0, 1.0, MASKED_LOGIT, 3.0],
        [MASKED_LOGIT, MASKED_LOGIT, 3.0, MASKED_LOGIT],
    ]
    assert logits[0, 1] == 5.0  # the input is unchanged


@pytest.mark.parametrize("vocab_size", [64, 1000, 49152])
def test_every_operation_equals_the_bool_reference_on_random_masks(vocab_size):
    rng = np.random.default_rng(vocab_size)
    num_rows = 12
    # Rows from "one structural token" to "all but a few".
    densities = np.linspace(0.0, 1.0, num_rows)
    allowed = torch.from_numpy(rng.random((num_rows, vocab_size)) < densities[:, None])
    allowed[torch.arange(num_rows), torch.from_numpy(rng.integers(0, vocab_size, num_rows))] = True
    # Coarse logits (multiples of 0.5) make ties common; a forbidden token is every row's favourite.
    logits = torch.from_numpy(rng.integers(-8, 8, (num_rows, vocab_size)) / 2).float()
    favourite = (~allowed).float().argmax(dim=-1)
    logits[torch.arange(num_rows), favourite] = 100.0
    mask = TokenBitmask.from_bool(allowed)
    reference = apply_token_mask(logits, allowed)  # [R, V]
    assert torch.equal(mask.to_bool(), allowed)
    assert torch.equal(mask.argmax(logits), reference.argmax(dim=-1))
    rows = [5, 0, 11, 5]
    assert torch.equal(mask.masked_rows(logits, rows), reference[rows])
    for row in range(num_rows):
        assert mask.allowed_ids(row).tolist() == allowed[row].nonzero().flatten().tolist()
    rows = rng.integers(0, num_rows, 200)
    ids = rng.integers(0, vocab_size, 200)
    assert mask.is_allowed(rows, ids).tolist() == allowed[rows, ids].tolist()
    wire = TokenBitmask(np.frombuffer(mask.to_bytes(), dtype="<i4").reshape(num_rows, -1), vocab_size)
    assert torch.equal(wire.to_bool(), allowed)


@pytest.mark.parametrize("vocab_size", [35, 1000, 49152])
def test_argmax_natively_equals_the_gathered_path_and_the_reference(vocab_size, monkeypatch):
    """The native masked argmax (qgemm_argmax_rows_masked) against the Python path it replaces and the
    bool reference: whole words of allowed tokens holding ties, rows of -inf, NaNs at allowed and at
    forbidden tokens, a favourite the grammar forbids, and bits set past the vocabulary in the last
    word (the wire refuses them, specdec.pb.token_mask_from_pb; the native walk ignores them)."""
    rng = np.random.default_rng(vocab_size + 7)
    num_rows = 10
    allowed = torch.from_numpy(rng.random((num_rows, vocab_size)) < np.linspace(0.002, 1.0, num_rows)[:, None])
    allowed[:, 3] = True  # every row allows something
    allowed[4, :32] = True  # a whole word, tied below
    logits = torch.from_numpy(rng.integers(-8, 8, (num_rows, vocab_size)) / 2).float()
    logits[:, 0] = 100.0  # every row's favourite; forbidden where the row forbids token 0
    allowed[1, 0] = False
    logits[4, 5:9] = 200.0  # a tie inside the allowed word: the lowest id, 5
    logits[2] = float("-inf")  # all equal: the first allowed token
    logits[3, 2] = float("nan")  # a NaN at a forbidden token: not picked
    allowed[3, 2] = False
    logits[5, 7] = float("nan")  # a NaN at an allowed token: torch's choice, the NaN
    allowed[5, 7] = True
    reference = apply_token_mask(logits, allowed).argmax(dim=-1)
    mask = TokenBitmask.from_bool(allowed)
    tail = mask.words.copy()
    if vocab_size % 32:
        tail[:, -1] |= np.int32(-(1 << (vocab_size % 32)))  # the bits past the vocabulary, all set
        tail[5] = mask.words[5]  # but in the NaN's row, which Python gathers from the words
    native = TokenBitmask(tail, vocab_size).argmax(logits)
    assert native.tolist() == reference.tolist()
    assert native[4] == 5 and native[5] == 7
    monkeypatch.setattr("specdec.grammar.bitmask.row_argmax_allowed", lambda logits, words: None)
    assert mask.argmax(logits).tolist() == reference.tolist()
