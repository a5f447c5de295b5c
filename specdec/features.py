"""The primary's features on the wire: the final norm's output rows [R, C], what a feature drafter reads.

A feature row is the last layer's hidden state after the final RMSNorm (the lm_head's input) at one
logits row; row i predicts the token after that row's token. They travel as float16, 2 bytes an
element (~1.1 KiB a row for C = 576): inline in a response, or after the logits in the request's
shared-memory logits slot (specdec.logits_shm). Where the primary's activations are bfloat16 they
travel as bfloat16, bit for bit (float16 would round them a second time and cannot hold every
bfloat16 value); likewise a float32 row with a value beyond float16's range (|x| > 65504) goes as
bfloat16 rather than as infinity.

Layout: little-endian, row-major [num_rows, hidden_size] elements of `dtype`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from specdec.field_checks import require_bytes, require_counts

DTYPE_FP16 = "float16"
DTYPE_BF16 = "bfloat16"
DTYPES = (DTYPE_FP16, DTYPE_BF16)
ITEMSIZE = 2  # both dtypes
FP16_MAX = 65504.0  # the largest finite float16


@dataclasses.dataclass(frozen=True, slots=True)
class EncodedFeatures:
    dtype: str
    num_rows: int
    hidden_size: int
    data: bytes  # row-major [num_rows, hidden_size] elements of dtype

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        require_counts(self, "num_rows", "hidden_size")
        require_bytes(self, "data")
        if len(self.data) != self.num_bytes:
            raise ValueError(
                f"data has {len(self.data)} bytes, expected num_rows * hidden_size * {ITEMSIZE} = {self.num_bytes}"
            )

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.hidden_size * ITEMSIZE

    def rows(self, rows: Sequence[int]) -> EncodedFeatures:
        """The rows `rows` (in that order) of these, still encoded: a copy of their bytes."""
        row_bytes = self.hidden_size * ITEMSIZE
        data = b"".join(self.data[r * row_bytes : (r + 1) * row_bytes] for r in rows)
        return EncodedFeatures(self.dtype, len(rows), self.hidden_size, data)


def wire_dtype(features: torch.Tensor) -> str:
    """bfloat16 for bfloat16 activations (exact) or values beyond float16's range; else float16."""
    if features.dtype == torch.bfloat16:
        return DTYPE_BF16
    is_in_range = bool((features.abs() <= FP16_MAX).all()) if features.numel() else True
    return DTYPE_FP16 if is_in_range else DTYPE_BF16


def encode_features(features: torch.Tensor) -> EncodedFeatures:
    """Features [R, C] (any float dtype, any device) -> EncodedFeatures in wire_dtype(features)."""
    if features.dim() != 2 or not features.dtype.is_floating_point:
        raise ValueError(f"features must be a 2-D float tensor, got {tuple(features.shape)} {features.dtype}")
    features = features.detach().to("cpu")
    dtype = wire_dtype(features)
    if dtype == DTYPE_FP16:
        payload = features.to(torch.float16).contiguous().numpy().astype("<f2", copy=False)
    else:
        payload = features.to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2", copy=False)
    num_rows, hidden_size = features.shape
    return EncodedFeatures(dtype, int(num_rows), int(hidden_size), payload.tobytes())


def decode_features(encoded: EncodedFeatures) -> np.ndarray:
    """EncodedFeatures -> float32 [num_rows, hidden_size] (a fresh, writable array)."""
    shape = (encoded.num_rows, encoded.hidden_size)
    if encoded.dtype == DTYPE_FP16:
        return np.frombuffer(encoded.data, dtype="<f2").reshape(shape).astype(np.float32)
    halves = np.frombuffer(encoded.data, dtype="<u2").reshape(shape)
    return (halves.astype(np.uint32) << 16).view(np.float32)  # bfloat16 is the top half of the float32 bits
