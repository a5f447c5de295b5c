"""TokenMask on the wire: the packed layout (the grammar engine's little-endian words) and refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec import pb
from specdec.errors import InvalidArgument
from specdec.grammar import TokenBitmask, bitmask_to_bool
from specdec.v1 import common_pb2


def test_round_trip_and_layout_by_hand():
    # V = 35 -> 2 words (8 bytes) a row. Row 0 allows tokens 0, 2 and 33; row 1 only token 8.
    allowed = torch.zeros(2, 35, dtype=torch.bool)
    allowed[0, [0, 2, 33]] = True
    allowed[1, 8] = True
    msg = pb.token_mask_to_pb(TokenBitmask.from_bool(allowed))
    assert msg.num_rows == 2
    assert msg.bits == bytes([0b101, 0, 0, 0, 0b10, 0, 0, 0]) + bytes([0, 1, 0, 0, 0, 0, 0, 0])
    assert torch.equal(pb.token_mask_from_pb(msg, 2, 35, "allowed_tokens").to_bool(), allowed)


def test_matches_the_grammar_engines_packed_words():
    rng = np.random.default_rng(0)
    words = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32))
    allowed = bitmask_to_bool(words, 128)  # [3, 128]
    assert pb.token_mask_to_pb(TokenBitmask.from_bool(allowed)).bits == words.numpy().astype("<i4").tobytes()
    assert pb.token_mask_to_pb(TokenBitmask.from_engine(words, 128)).bits == words.numpy().astype("<i4").tobytes()


@pytest.mark.parametrize(
    "num_rows, bits, field",
    [
        (2, bytes(8), "allowed_tokens.num_rows"),  # says 1 row, 2 expected
        (1, bytes(4), "allowed_tokens.bits"),  # short
        (1, bytes([0, 0, 0, 0, 0, 0, 0, 0b1000]), "allowed_tokens.bits"),  # token 59 >= V = 35
        (1, bytes([0, 0, 0, 0, 0b1000, 0, 0, 0]), "allowed_tokens.bits"),  # token 35, the first padding bit
        (1, bytes(8), "allowed_tokens.bits"),  # allows nothing
    ],
)
def test_refuses_wrong_shapes_padding_bits_and_empty_rows(num_rows, bits, field):
    msg = common_pb2.TokenMask(num_rows=1, bits=bits)
    with pytest.raises(InvalidArgument) as e:
        pb.token_mask_from_pb(msg, num_rows, 35, "allowed_tokens")
    assert e.value.field == field
