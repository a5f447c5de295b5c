"""Grammar masks kept packed: one bit a token, applied to logits without a bool row per tree row.

A constrained speculative step carries a mask row for every row of the token tree (N + 1 of them,
V = 49152 tokens each). Unpacked to bool [N+1, V] and applied with a `torch.where` over every row,
the mask cost the gateway, the primary and the validator together ~25 ms a step against a ~30 ms
forward. Kept as the grammar engine fills it, int32 words [R, W] (W = ceil(V / 32); bit k of word
w = token 32*w + k, the TokenMask wire layout), each use touches only what it needs:

    argmax       the raw argmax of a row is the masked argmax whenever its bit is set (one bit
                 test a row); only a row whose favourite the grammar forbids walks its allowed
                 tokens, natively (qgemm_argmax_rows_masked), or without the native kernels
                 gathered from its non-zero bytes
    is_allowed   a bit test per (row, token): draft tokens, argmax ids
    masked_rows  whole masked rows, only for the rows a result needs whole: the rows a sampling
                 walk visits, the accepted path's rows whose entropies are reported

Every result equals the same operation on `apply_token_mask(logits, self.to_bool())`, the
reference (tests check it); ties resolve to the lowest token id as torch.argmax does.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.grammar.mask import BITS_PER_WORD, MASKED_LOGIT, bitmask_to_bool
from specdec.logits_codec import row_argmax, row_argmax_allowed

_BIT_OFFSETS = np.arange(8, dtype=np.int64)  # bit k of a byte = token 8*byte + k


class TokenBitmask:
    """Allowed tokens of R rows as little-endian int32 words [R, W]. Rows are never all-forbidden
    (the grammar state and `specdec.pb.token_mask_from_pb` guarantee it)."""

    __slots__ = ("words", "vocab_size", "_wire_bytes")

    def __init__(self, words: np.ndarray, vocab_size: int) -> None:
        assert words.dtype == np.dtype("<i4") and words.ndim == 2, "words must be little-endian int32 [R, W]"
        assert words.shape[1] * BITS_PER_WORD >= vocab_size, "words are narrower than the vocabulary"
        self.words = words  # [R, W]; may be a read-only view of wire bytes
        self.vocab_size = vocab_size
        self._wire_bytes: bytes | None = None

    @classmethod
    def from_engine(cls, bitmask: torch.Tensor, vocab_size: int) -> "TokenBitmask":
        """The grammar engine's int32 [R, W] tensor (shared, not copied)."""
        return cls(bitmask.numpy().astype("<i4", copy=False), vocab_size)

    @classmethod
    def from_bool(cls, allowed: torch.Tensor) -> "TokenBitmask":
        """bool [R, V] -> packed (tests and callers that build masks by hand)."""
        assert allowed.dtype == torch.bool and allowed.dim() == 2, "allowed must be bool [R, V]"
        num_rows, vocab_size = allowed.shape
        num_words = (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD
        padded = np.zeros((num_rows, num_words * BITS_PER_WORD), dtype=np.bool_)  # [R, W*32]
        padded[:, :vocab_size] = allowed.numpy()
        packed = np.packbits(padded, axis=1, bitorder="little")  # [R, W*4] uint8
        return cls(packed.view("<i4"), vocab_size)

    @property
    def num_rows(self) -> int:
        return self.words.shape[0]

    def to_bytes(self) -> bytes:
        """The TokenMask wire bytes: rows of W little-endian words, copied once (Verify and Validate
        carry the same mask)."""
        if self._wire_bytes is None:
            self._wire_bytes = self.words.tobytes()
        return self._wire_bytes

    def to_bool(self) -> torch.Tensor:
        """bool [R, V]: for tests and inspection, never on the serving path."""
        return bitmask_to_bool(torch.from_numpy(self.words.astype(np.int32)), self.vocab_size)

    def is_allowed(self, rows: np.ndarray | list[int], token_ids: np.ndarray | list[int]) -> np.ndarray:
        """bool [K]: whether token_ids[k] is allowed at rows[k] (ids in [0, V))."""
        rows, token_ids = np.asarray(rows, dtype=np.int64), np.asarray(token_ids, dtype=np.int64)
        words = self.words[rows, token_ids >> 5]  # [K]
        return ((words >> (token_ids & 31)) & 1).astype(np.bool_)  # arithmetic shift: bit k lands at 0

    def allowed_ids(self, row: int) -> torch.Tensor:
        """int64 [num allowed], ascending: the allowed tokens of one row, from its non-zero bytes only."""
        return _set_bits(self.words[row].view(np.uint8))

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [R]: torch.argmax of the masked logits [R, V], lowest id on ties.

        If a row's raw argmax a (the lowest id of the row's maximum) is allowed, it is also the masked
        argmax: no allowed token is larger, and an allowed token equal to it at a lower id would have
        been the raw argmax. Otherwise the row's allowed tokens are gathered, in ascending order, so
        their first maximum is again the lowest id."""
        assert logits.dim() == 2 and logits.shape == (self.num_rows, self.vocab_size), (
            f"logits {tuple(logits.shape)} do not fit the mask [{self.num_rows}, {self.vocab_size}]"
        )
        native = row_argmax_allowed(logits, self.words)  # [R], natively: one pass a row, or None
        if native is not None:
            argmax = torch.tensor(native, dtype=torch.int64)
            gathered = [row for row, i in enumerate(native) if i < 0]  # an allowed NaN: torch picks it
        else:
            argmax = torch.tensor(row_argmax(logits), dtype=torch.int64)  # [R]; torch.argmax's choice
            gathered = np.flatnonzero(~self.is_allowed(np.arange(self.num_rows), argmax.numpy())).tolist()
        for row in gathered:
            ids = self.allowed_ids(row)
            argmax[row] = ids[torch.argmax(logits[row, ids])]
        return argmax

    def masked_rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """[len(rows), V]: logits[rows] with MASKED_LOGIT at the tokens each row forbids (a new tensor).
        For the few rows a result needs whole (those a walk visits or reports, not every tree row):
        each is unpacked once here, ~6 KB of bits into V bytes."""
        assert logits.dim() == 2 and logits.shape[1] == self.vocab_size, (
            f"logits {tuple(logits.shape)} do not fit the mask's vocabulary {self.vocab_size}"
        )
        packed = self.words[rows].view(np.uint8)  # [K, W*4]
        bits = np.unpackbits(packed, axis=1, count=self.vocab_size, bitorder="little")  # [K, V] 0/1
        return torch.where(torch.from_numpy(bits).view(torch.bool), logits[rows], MASKED_LOGIT)


def _set_bits(packed: np.ndarray) -> torch.Tensor:
    """Positions of the set bits of little-endian bytes, ascending (the bytes' own order, then bit
    order within a byte). E.g. bytes [0b101, 0, 0b10] -> [0, 2, 17]."""
    nonzero = np.flatnonzero(packed)  # [B]
    bits = np.unpackbits(packed[nonzero][:, None], axis=1, bitorder="little")  # [B, 8]
    positions = nonzero[:, None] * 8 + _BIT_OFFSETS  # [B, 8]
    return torch.from_numpy(positions[bits.astype(np.bool_)])
