"""Token masks as bool rows: the definition of applying a mask, and unpacking the engine's bitmask.

`apply_token_mask` defines what a mask does to logits: constrained plain decoding and constrained
speculative decoding must see the same masked row for the same context, and so pick the same token
(greedy) or sample from the same distribution. The services never build bool rows on a step's
path: they apply `specdec.grammar.bitmask.TokenBitmask`, the packed form, whose every operation
equals this one on `bitmask_to_bool` of its words (tests check it).
"""

from __future__ import annotations

import numpy as np
import torch

MASKED_LOGIT = float("-inf")  # a token the grammar forbids: probability exactly 0 after softmax
BITS_PER_WORD = 32


def apply_token_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with MASKED_LOGIT where `allowed` is False (a new tensor; the input is unchanged).

    logits [R, V] (or [V]), any float dtype; allowed bool, the same shape, or [V] for every row.
    Every row must allow at least one token: a row of only MASKED_LOGIT has no softmax. Callers
    guarantee it (GrammarState's masks allow the stop tokens at least; `specdec.pb.token_mask_from_pb`
    refuses an empty row from the wire), so it is not re-checked here.
    E.g. logits [[1., 5., 3.]], allowed [[True, False, True]] -> [[1., -inf, 3.]] (argmax 2, not 1).
    """
    assert allowed.dtype == torch.bool, f"allowed must be bool, got {allowed.dtype}"
    assert allowed.shape == logits.shape or allowed.shape == logits.shape[-1:], (
        f"mask {tuple(allowed.shape)} does not fit logits {tuple(logits.shape)}"
    )
    return torch.where(allowed, logits, MASKED_LOGIT)  # no ~allowed copy, unlike masked_fill


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The engine's packed mask, int32 [R, ceil(V/32)] with bit k of word w = token 32*w + k,
    as bool [R, V]. E.g. words [[0b101]] -> tokens 0 and 2 allowed."""
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2, "bitmask must be int32 [R, W]"
    assert bitmask.shape[1] * BITS_PER_WORD >= vocab_size, "bitmask is narrower than the vocabulary"
    # numpy's unpackbits is ~20x faster than shifts in torch; "<i4" fixes the byte order of the words
    little_endian_words = bitmask.numpy().astype("<i4", copy=False)  # [R, W]
    bits = np.unpackbits(little_endian_words.view(np.uint8), axis=1, bitorder="little")  # [R, W*32]
    return torch.from_numpy(bits[:, :vocab_size].astype(np.bool_))  # [R, V]
