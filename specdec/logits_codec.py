"""Wire formats for the primary's verify logits: fp32, bf16 and fp8_e4m3 with a per-row scale.

A verify step returns logits [N+1, V]; with V around 50k they dominate the bytes on the wire
between primary and validator when the two are not co-located. Layouts (row-major, little endian):

  fp32      4 bytes per element, the IEEE float32 bits.
  bf16      2 bytes per element, the top half of the float32 bits after round-to-nearest-even
            (what torch's float32 -> bfloat16 cast does).
  fp8_e4m3  1 byte per element plus one float32 scale per row, of the row shifted by its max
            (x - max(row): lossless for every decision the validator makes, which all depend
            on the softmax or on argmax; decoding yields the shifted row): scale = absmax / 448 (1.0
            for an all-zero row), byte = e4m3fn(clip(x / scale, -448, 448)) rounded to nearest
            even. The clip is CUDA's SATFINITE behaviour: e4m3fn has no infinity and both torch
            and ml_dtypes turn an overflow into NaN, which x / scale can hit by one fp32 rounding.
            Decoding is e4m3fn(byte) * scale in float32. On the CPU the native kernels
            (specdec.model.native, when built) encode a row in two passes with the same
            arithmetic and the same bytes; torch's ops are the reference and the fallback.

e4m3fn bit layout (what validator_svc/kernel.py decodes by hand): s eeee mmm, bias 7;
e > 0: (-1)^s * 2^(e-7) * (1 + m/8); e == 0: (-1)^s * 2^-6 * (m/8); 0x7f / 0xff is NaN.
Round-trip error bound per element: |x - dec(enc(x))| <= scale * max(2^-4 * |x / scale|, 2^-10)
(half an ulp: 3 mantissa bits for normals, the subnormal step 2^-9 below 2^-6), plus float32
rounding of the divide and multiply.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import torch

from specdec.field_checks import require_bytes, require_counts
from specdec.model import native

FORMAT_FP32 = "fp32"
FORMAT_BF16 = "bf16"
FORMAT_FP8_E4M3 = "fp8_e4m3"
FORMATS = (FORMAT_FP32, FORMAT_BF16, FORMAT_FP8_E4M3)
ITEMSIZE = {FORMAT_FP32: 4, FORMAT_BF16: 2, FORMAT_FP8_E4M3: 1}
FP8_E4M3_MAX = 448.0  # the largest finite e4m3fn value
SCALE_ITEMSIZE = 4  # one float32 scale per fp8 row
ZERO_ROW_SCALE = 1.0  # any positive scale decodes an all-zero row exactly; 1.0 is the obvious one
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_MIN_POSITIVE = float(np.finfo(np.float32).smallest_subnormal)


@dataclasses.dataclass(frozen=True, slots=True)
class EncodedLogits:
    format: str
    num_rows: int
    vocab_size: int
    data: bytes  # row-major [num_rows, vocab_size] elements of `format`
    row_scales: tuple[float, ...] | None = None  # fp8_e4m3 only: one float32 scale per row

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        require_counts(self, "num_rows", "vocab_size")
        require_bytes(self, "data")
        expected = self.num_rows * self.vocab_size * ITEMSIZE[self.format]
        if len(self.data) != expected:
            raise ValueError(
                f"data has {len(self.data)} bytes, expected num_rows * vocab_size * "
                f"{ITEMSIZE[self.format]} = {expected} for format {self.format}"
            )
        if self.format != FORMAT_FP8_E4M3:
            if self.row_scales is not None:
                raise ValueError(f"row_scales must be None for format {self.format}")
            return
        if self.row_scales is None or len(self.row_scales) != self.num_rows:
            num_scales = None if self.row_scales is None else len(self.row_scales)
            raise ValueError(f"row_scales must hold num_rows={self.num_rows} scales, got {num_scales}")
        for row, scale in enumerate(self.row_scales):
            # The kernel reads scales as float32: the value must survive that conversion.
            if not isinstance(scale, float) or not (FLOAT32_MIN_POSITIVE <= scale <= FLOAT32_MAX):
                raise ValueError(f"row_scales[{row}] must be a finite float32 > 0, got {scale!r}")

    @property
    def num_bytes(self) -> int:
        """Payload bytes including the scales (what the wire carries besides framing)."""
        return bytes_per_row(self.format, self.vocab_size) * self.num_rows


def bytes_per_row(fmt: str, vocab_size: int) -> int:
    """Wire bytes for one row of `vocab_size` logits: 4V, 2V, or V + 4 (the fp8 scale)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    return vocab_size * ITEMSIZE[fmt] + (SCALE_ITEMSIZE if fmt == FORMAT_FP8_E4M3 else 0)


def fp8_row_scales(logits: torch.Tensor) -> torch.Tensor:
    """Per-row float32 scales [R] = absmax / 448, ZERO_ROW_SCALE for all-zero rows.

    A row holding NaN or +-inf gets a non-finite scale (amax propagates NaN).
    """
    absmax = logits.abs().amax(dim=-1)  # [R]
    scales = absmax / FP8_E4M3_MAX  # [R] fp32
    # A denormal absmax can underflow to scale 0 after the divide; treat it like a zero row. Only 0:
    # `scales > 0` is False for NaN too, and a NaN row must keep its NaN scale so the caller refuses it.
    return torch.where(scales == 0, torch.full_like(scales, ZERO_ROW_SCALE), scales)


def shift_to_row_max(logits: torch.Tensor) -> torch.Tensor:
    """logits - rowmax: softmax, argmax, entropy and probability ratios are unchanged, and the
    likely tokens land near 0, where e4m3 is finest in absolute terms.

    E.g. a row [30.0, 29.5, -20.0]: unshifted, 30 maps to 448 where the e4m3 step is 32 (±1.07
    logits after scaling); shifted to [0, -0.5, -50], the top two sit in e4m3's fine range and
    only the improbable -50 is coarse.
    """
    return logits - logits.amax(dim=-1, keepdim=True)


def saturating_e4m3_codes(values: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3fn bytes (uint8), round-to-nearest-even, clipped to +-448 first (SATFINITE)."""
    clipped = values.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return clipped.to(torch.float8_e4m3fn).view(torch.uint8)


def row_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of logits [R, V] float32: the first maximum, as torch.argmax picks it
    (natively on the CPU, ~10x cheaper than torch's reduction for a few rows)."""
    lib = _native_for(logits)
    if lib is None:
        return torch.argmax(logits, dim=-1).tolist()
    out = np.empty(logits.shape[0], dtype=np.int64)
    lib.qgemm_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.ctypes.data)
    ids = out.tolist()
    for row in (r for r, i in enumerate(ids) if i < 0):  # a NaN: torch's choice
        ids[row] = int(torch.argmax(logits[row]))
    return ids


def row_argmax_allowed(logits: torch.Tensor, words: np.ndarray) -> list[int] | None:
    """Each row's argmax of logits [R, V] float32 among the tokens it allows (words: int32 [R, W], the
    grammar mask's wire layout), the lowest id on ties; a negative id for a row the caller must take
    itself (an allowed NaN, or nothing allowed). None where the native kernels cannot read them in
    place (then the caller computes every row)."""
    lib = _native_for(logits)
    if lib is None or words.dtype != np.dtype("<i4") or words.ndim != 2 or words.shape[0] != logits.shape[0]:
        return None
    words = np.ascontiguousarray(words)
    out = np.empty(logits.shape[0], dtype=np.int64)
    lib.qgemm_argmax_rows_masked(
        logits.data_ptr(), logits.shape[0], logits.shape[1], words.ctypes.data, words.shape[1], out.ctypes.data
    )
    return out.tolist()


def _native_for(logits: torch.Tensor) -> ctypes.CDLL | None:
    """The native kernels when they can read logits in place: a 2-D contiguous fp32 CPU tensor."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return None
    if not logits.is_contiguous() or logits.shape[1] == 0:
        return None
    return native.library()


def _encode_fp8_native(lib: ctypes.CDLL, logits: torch.Tensor) -> EncodedLogits:
    num_rows, vocab_size = logits.shape
    codes = np.empty((num_rows, vocab_size), dtype=np.uint8)
    scales = np.empty(num_rows, dtype=np.float32)
    status = lib.qgemm_encode_e4m3(
        logits.data_ptr(), num_rows, vocab_size, ZERO_ROW_SCALE, codes.ctypes.data, scales.ctypes.data
    )
    if status != 0:
        raise ValueError("logits must be finite for format fp8_e4m3 (e4m3fn has no infinity)")
    return EncodedLogits(FORMAT_FP8_E4M3, num_rows, vocab_size, codes.tobytes(), tuple(scales.tolist()))


def encode_logits(logits: torch.Tensor, fmt: str) -> EncodedLogits:
    """Logits [R, V] float32 (any device) -> EncodedLogits in `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a 2-D float32 tensor, got {tuple(logits.shape)} {logits.dtype}")
    logits = logits.detach().to("cpu").contiguous()  # [R, V]
    num_rows, vocab_size = logits.shape
    row_scales = None
    if fmt == FORMAT_FP32:
        payload = logits.numpy().astype("<f4", copy=False)
    elif fmt == FORMAT_BF16:
        payload = logits.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2", copy=False)
    elif (lib := _native_for(logits)) is not None:
        return _encode_fp8_native(lib, logits)
    else:
        shifted = shift_to_row_max(logits)  # [R, V], each row's max at 0
        scales = fp8_row_scales(shifted)  # [R]
        if not bool(torch.isfinite(scales).all()):
            raise ValueError("logits must be finite for format fp8_e4m3 (e4m3fn has no infinity)")
        payload = saturating_e4m3_codes(shifted / scales[:, None]).numpy()  # [R, V] uint8
        row_scales = tuple(float(s) for s in scales.tolist())
    return EncodedLogits(fmt, num_rows, vocab_size, payload.tobytes(), row_scales)


def decode_logits(encoded: EncodedLogits) -> torch.Tensor:
    """EncodedLogits -> logits [R, V] float32 on CPU."""
    shape = (encoded.num_rows, encoded.vocab_size)
    if encoded.format == FORMAT_FP32:
        values = np.frombuffer(encoded.data, dtype="<f4").reshape(shape)
        return torch.from_numpy(values.astype(np.float32))  # astype copies: the buffer is read-only
    if encoded.format == FORMAT_BF16:
        halves = np.frombuffer(encoded.data, dtype="<u2").reshape(shape)
        bits = halves.astype(np.uint32) << 16  # bf16 is the top half of the float32 bits
        return torch.from_numpy(bits.view(np.float32))
    codes = np.frombuffer(encoded.data, dtype=np.uint8)  # [R * V]
    unscaled = torch.from_numpy(np.take(e4m3_decode_table(), codes).reshape(shape))  # [R, V], exact
    scales = torch.tensor(encoded.row_scales, dtype=torch.float32)  # [R]
    return unscaled * scales[:, None]


def e4m3_decode_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bytes (a table lookup is ~6x faster than torch's cast)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
