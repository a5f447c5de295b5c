"""The mask helper shared by constrained plain and speculative decoding, and bitmask unpacking."""

from __future__ import annotations

import pytest
import torch

from specdec.grammar import MASKED_LOGIT, apply_token_mask, bitmask_to_bool


def test_apply_token_mask_by_hand():
    logits = torch.tensor([[1.0, 5.0, 3.0], [2.0, 0.0, -1.0]])
    allowed = torch.tensor([[True, False, True], [False, True, True]])
    masked = apply_token_mask(logits, allowed)
    assert masked.tolist() == [[1.0, MASKED_LOGIT, 3.0], [MASKED_LOGIT, 0.0, -1.0]]
    assert masked.argmax(dim=-1).tolist() == [2, 1]  # the unmasked argmax would be [1, 0]
    assert logits[0, 1] == 5.0  # the input is unchanged
    assert torch.softmax(masked, dim=-1)[0, 1] == 0.0


def test_apply_token_mask_broadcasts_one_row_and_keeps_dtype():
    logits = torch.zeros(2, 4, dtype=torch.bfloat16)
    masked = apply_token_mask(logits, torch.tensor([False, True, False, False]))
    assert masked.dtype == torch.bfloat16 and masked.argmax(dim=-1).tolist() == [1, 1]


def test_apply_token_mask_refuses_a_wrong_shape():
    with pytest.raises(AssertionError, match="does not fit"):
        apply_token_mask(torch.zeros(1, 3), torch.ones(4, dtype=torch.bool))


def test_bitmask_to_bool_by_hand():
    words = torch.tensor([[0b101, 0], [0, -(2**31)]], dtype=torch.int32)  # -2**31: only bit 31 set
    allowed = bitmask_to_bool(words, vocab_size=64)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2]
    assert allowed[1].nonzero().flatten().tolist() == [63]
    assert bitmask_to_bool(words, vocab_size=40).shape == (2, 40)  # padding bits are cut off
