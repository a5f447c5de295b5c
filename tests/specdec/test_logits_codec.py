from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from specdec.logits_codec import (
    shift_to_row_max,
    FORMATS,
    EncodedLogits,
    bytes_per_row,
    decode_logits,
    encode_logits,
    fp8_row_scales,
    row_argmax,
    saturating_e4m3_codes,
)
from specdec.model import native

E4M3_MAX_CODE, E4M3_MIN_CODE = 0x7E, 0xFE  # +448 and -448


def random_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * 4.0 - 2.0  # [R, V]


def test_fp32_round_trip_is_exact():
    logits = random_logits(3, 50)
    encoded = encode_logits(logits, "fp32")
    assert torch.equal(decode_logits(encoded), logits)
    assert len(encoded.data) == 3 * 50 * 4 and encoded.row_scales is None


def test_bf16_equals_torch_round_to_nearest_even():
    logits = random_logits(3, 50)
    decoded = decode_logits(encode_logits(logits, "bf16"))
    assert torch.equal(decoded, logits.to(torch.bfloat16).to(torch.float32))
    # 1 + 2^-8 sits exactly between two bf16 values (ulp 2^-7 near 1): ties go to the even one, 1.0.
    tie = torch.tensor([[1.0 + 2**-8, 1.0 + 3 * 2**-8]])
    assert decode_logits(encode_logits(tie, "bf16")).tolist() == [[1.0, 1.0 + 2**-6]]


def test_fp8_codes_equal_ml_dtypes_with_saturation():
    # Near 448 the e4m3 step is 32: 449..463 round to 448 in both; from 464 on ml_dtypes (like an
    # unclipped cast) gives NaN, the codec saturates to +-448 (CUDA SATFINITE).
    values = torch.tensor([0.0, 1e-4, -0.0013, 0.3, -2.5, 17.0, 447.0, 449.0, 463.0, 464.0, 1000.0, -1e6])
    codes = saturating_e4m3_codes(values).numpy()
    clipped = np.clip(values.numpy(), -448.0, 448.0)
    assert codes.tolist() == clipped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).tolist()
    assert codes[-3:].tolist() == [E4M3_MAX_CODE, E4M3_MAX_CODE, E4M3_MIN_CODE]
    assert np.isnan(np.float32(1000.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))


def test_fp8_encoding_equals_the_ml_dtypes_reference():
    logits = shift_to_row_max(random_logits(5, 300, seed=1))  # what the encoder scales
    encoded = encode_logits(logits, "fp8_e4m3")
    scales = logits.abs().amax(dim=-1) / 448.0  # [R]
    scaled = np.clip((logits / scales[:, None]).numpy(), -448.0, 448.0)
    reference = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert encoded.data == reference.tobytes()
    assert encoded.row_scales == tuple(scales.tolist())


def test_fp8_round_trip_error_bound():
    # Per element: |x - dec(enc(x))| <= scale * max(2^-4 |x / scale|, 2^-10) (half an ulp: 3 mantissa
    # bits for normals, subnormal step 2^-9), with 1e-6 relative slack for the fp32 divide/multiply.
    logits = random_logits(8, 4096, seed=2)
    logits[1] *= 1e-3  # a row of tiny values: scale adapts per row
    logits[2, :100] = logits[2].max() - 1e-6  # just below the max: subnormal territory once shifted
    decoded = decode_logits(encode_logits(logits, "fp8_e4m3"))
    logits = shift_to_row_max(logits)  # decoding gives the row shifted by its max
    scales = fp8_row_scales(logits)[:, None]  # [R, 1]
    bound = scales * torch.maximum((logits / scales).abs() * 2**-4, torch.full_like(logits, 2**-10))
    assert bool(((decoded - logits).abs() <= bound * (1 + 1e-6)).all())
    # The bound is tight: some element uses at least 80 % of it.
    assert float(((decoded - logits).abs() / bound).max()) > 0.8
    # The row maximum itself is exact (it maps to 448).
    rows = torch.arange(8)
    absmax_ids = logits.abs().argmax(dim=-1)
    torch.testing.assert_close(decoded[rows, absmax_ids], logits[rows, absmax_ids], rtol=1e-6, atol=0)


def test_fp8_zero_row_and_non_finite_input():
    logits = torch.zeros(2, 8)
    logits[1, 3] = -5.0
    encoded = encode_logits(logits, "fp8_e4m3")
    assert encoded.row_scales[0] == 1.0  # guarded: absmax 0 would divide by zero
    assert torch.equal(decode_logits(encoded), logits)
    with pytest.raises(ValueError, match="finite"):
        encode_logits(torch.tensor([[0.0, -math.inf]]), "fp8_e4m3")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_fp8_torch_encoding_refuses_any_non_finite_row(bad):
    """The torch encoder (the reference, and the fallback without native kernels) refuses what the
    native one refuses: a NaN or +inf row once gave scale 1.0 and NaN bytes for the validator."""
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, bad, 1.0]])
    with native.disabled(), pytest.raises(ValueError, match="finite"):
        encode_logits(logits, "fp8_e4m3")
    assert not bool(torch.isfinite(fp8_row_scales(shift_to_row_max(logits))[1]))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"format": "fp16"}, "format"),
        ({"num_rows": 0}, "num_rows"),
        ({"data": b"\x00" * 7}, "data"),
        ({"row_scales": (1.0,)}, "row_scales"),
        ({"row_scales": None}, "row_scales"),
        ({"row_scales": (1.0, math.nan)}, r"row_scales\[1\]"),
        ({"row_scales": (math.inf, 1.0)}, r"row_scales\[0\]"),
        ({"row_scales": (1.0, -2.0)}, r"row_scales\[1\]"),
        ({"row_scales": (1.0, 1e39)}, r"row_scales\[1\]"),  # overflows float32
    ],
)
def test_encoded_logits_validate_naming_the_field(kwargs, field):
    valid = {"format": "fp8_e4m3", "num_rows": 2, "vocab_size": 4, "data": b"\x00" * 8, "row_scales": (1.0, 2.0)}
    EncodedLogits(**valid)
    with pytest.raises(ValueError, match=field):
        EncodedLogits(**{**valid, **kwargs})
    with pytest.raises(ValueError, match="row_scales"):
        EncodedLogits("fp32", 2, 4, b"\x00" * 32, (1.0, 1.0))


def test_bytes_per_row_and_step():
    vocab_size, num_rows = 49152, 9  # N = 8 nodes + the root
    assert [bytes_per_row(f, vocab_size) for f in FORMATS] == [196608, 98304, 49156]
    encoded = {f: encode_logits(torch.zeros(num_rows, vocab_size), f) for f in FORMATS}
    assert [encoded[f].num_bytes for f in FORMATS] == [1769472, 884736, 442404]
    assert len(encoded["fp8_e4m3"].data) + 4 * num_rows == encoded["fp8_e4m3"].num_bytes


@pytest.mark.parametrize("fmt, relative_error", [("bf16", 2**-9), ("fp8_e4m3", 2**-4)])
def test_argmax_flips_under_lossy_formats_sit_at_near_ties(fmt, relative_error):
    """Greedy decisions from decoded vs fp32 logits (64 rows of V = 49152, N(−2, 4²) logits).

    A flip from fp32 argmax a to b needs x_a - x_b <= err_a + err_b, so the fp32 top-2 gap is at most
    relative_error * (|x_a| + |x_b|) (+ 2 * scale * 2^-10 subnormal slack for fp8).
    """
    logits = random_logits(64, 49152, seed=3)
    decoded = decode_logits(encode_logits(logits, fmt))
    if fmt == "fp8_e4m3":
        logits = shift_to_row_max(logits)  # fp8 carries the row shifted by its max
    exact, lossy = logits.argmax(dim=-1), decoded.argmax(dim=-1)  # [R]
    flips = (exact != lossy).nonzero().flatten()
    scales = fp8_row_scales(logits) if fmt == "fp8_e4m3" else torch.zeros(64)
    for row in flips.tolist():
        x_a, x_b = float(logits[row, exact[row]]), float(logits[row, lossy[row]])
        tolerance = relative_error * (abs(x_a) + abs(x_b)) + 2 * float(scales[row]) * 2**-10
        assert 0.0 <= x_a - x_b <= tolerance * (1 + 1e-5), (row, x_a, x_b)
    top2 = logits.topk(2, dim=-1).values  # [R, 2]
    median_gap = float((top2[:, 0] - top2[:, 1]).median())
    print(f"\n{fmt}: {len(flips)}/64 greedy flips; median fp32 top-2 gap {median_gap:.3f}")


needs_native = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")


def every_e4m3_boundary() -> torch.Tensor:
    """Non-positive fp32 values at and around every rounding boundary of e4m3fn down to -448 (each
    code's value and the midpoints to its neighbours, one fp32 ulp either side of each): a row
    with max 0 and min -448 has scale exactly 1, so the encoder rounds exactly these."""
    values = np.arange(128, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values = np.sort(values[np.isfinite(values)])  # 0 .. 448
    mids = (values[:-1] + values[1:]) / 2  # exact in fp32
    points = np.concatenate([values, mids, np.linspace(0, 2**-6, 1001, dtype=np.float32)])
    around = np.concatenate([points, np.nextafter(points, np.float32(0)), np.nextafter(points, np.float32(np.inf))])
    row = -np.unique(np.clip(around, 0, 448))
    return torch.from_numpy(row[None, :].copy())


@needs_native
def test_native_fp8_encoding_has_torchs_bytes_at_every_rounding_boundary():
    row = every_e4m3_boundary()
    assert float(row.max()) == 0.0 and float(row.min()) == -448.0
    native_encoded = encode_logits(row, "fp8_e4m3")
    with native.disabled():
        reference = encode_logits(row, "fp8_e4m3")
    assert native_encoded.row_scales == reference.row_scales == (1.0,)
    assert native_encoded.data == reference.data


@needs_native
@pytest.mark.parametrize("vocab_size", [1, 7, 8, 300, 49152 + 5])
def test_native_fp8_encoding_and_argmax_equal_torchs(vocab_size):
    logits = random_logits(6, vocab_size, seed=vocab_size)
    logits[1] *= 1e-3
    logits[2] = 0.0  # an all-zero row: scale 1
    logits[3, : vocab_size // 2] = logits[3].max()  # ties: the first maximum wins
    logits[4] *= 1e-30  # scales near the bottom of fp32
    native_encoded = encode_logits(logits, "fp8_e4m3")
    with native.disabled():
        reference = encode_logits(logits, "fp8_e4m3")
        reference_argmax = row_argmax(logits)
    assert native_encoded.data == reference.data and native_encoded.row_scales == reference.row_scales
    assert row_argmax(logits) == reference_argmax == torch.argmax(logits, dim=-1).tolist()


@needs_native
@pytest.mark.parametrize("vocab_size", [1, 5, 8, 9, 16, 49152 + 3])
def test_native_argmax_picks_torchs_first_maximum_at_ties_signed_zeros_and_infinities(vocab_size):
    """The native argmax's index is torch.argmax's wherever the ties sit: within one 8-wide block,
    across blocks, in the tail past the last whole block; -0.0 and 0.0 are equal; infinities."""
    logits = torch.full((6, vocab_size), -math.inf)  # row 0: all -inf -> index 0
    logits[1] = 0.0
    logits[1, ::2] = -0.0  # -0.0 == 0.0: the first of them
    logits[2] = torch.arange(vocab_size, dtype=torch.float32) % 3  # many ties at 2.0 across lanes
    logits[3, -1] = 1.0  # the maximum in the tail only
    logits[4] = random_logits(1, vocab_size, seed=3)[0]
    logits[4, vocab_size // 2 :] = logits[4].max()  # a tie whose first copy is in the middle
    logits[5, : vocab_size // 3] = math.inf  # +inf from index 0 on
    assert row_argmax(logits) == torch.argmax(logits, dim=-1).tolist()


@needs_native
def test_native_paths_refuse_or_defer_non_finite_rows_as_torch_does():
    logits = random_logits(3, 100)
    logits[1, 40] = math.nan
    logits[2, 7] = math.inf
    assert row_argmax(logits) == torch.argmax(logits, dim=-1).tolist()  # the NaN row: torch's choice
    with pytest.raises(ValueError, match="finite"):
        encode_logits(logits, "fp8_e4m3")
    with pytest.raises(ValueError, match="finite"):
        encode_logits(logits[1:2], "fp8_e4m3")
    assert row_argmax(logits[:, ::2]) == torch.argmax(logits[:, ::2], dim=-1).tolist()  # a strided view
