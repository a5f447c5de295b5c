"""Weight-only int4 and int8: the quantized matrices, and the layers over torch's packed CPU kernels.

Memory holds only the quantized form; no layer ever widens its weights into a float copy. Where
the native kernels build (`specdec.model.native`, the default), int4 is stored as the GGUF's Q4_1
values and int8 as its rows, both interleaved by 16 output columns (`pack_q4_1`, `pack_int8`);
what follows is the torch-kernel form, used otherwise. Which form a matrix takes is decided once,
by `precision.choose_layout`, and recorded with the weights (`layout.py`).

int4, group-32 asymmetric (the form of llama.cpp's Q4_1). For output row n, input k, group g = k // 32:

    w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]            q in 0..15

  `aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros[K/32, N, 2])` dequantizes exactly
  so, with `packed` = `aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)` (uint8 [N, K/2]).
  A Q4_1 block (w = q * d + m) therefore becomes scale = d, zero = m + 8d, both rounded to bf16,
  the dtype the kernel takes them in. That is the one rounding serving adds to a file's blocks:
  |served w - file w| <= 2^-8 * (8 |d| + |m + 8d|) (bf16 keeps 8 significant bits).
  Quantizing float weights (`quantize_int4`) is round-to-nearest onto the grid of the rounded
  scale/zero: scale = (max - min) / 15 and zero = min + 8 scale per group.

int8, per output channel, symmetric:

    w[n, k] = q[n, k] * scale[n]      q in -127..127, scale = bf16(max_k |w[n, k]| / 127)

  `aten._weight_int8pack_mm(x, q int8 [N, K], scale [N])`. The same [V, C] int8 matrix serves a
  tied embedding: a lookup gathers rows and multiplies them by their scale (`Int8Embedding`).

Both kernels run 10-20x faster with bf16 activations than with fp32 or fp16 on an AVX2 CPU (1536x576,
1 row, int4: 0.078 ms bf16 vs 0.985 ms fp32), so the layers cast their input to bf16 and the
output back. Everything else (residual stream, norms, RoPE, attention, KV cache) stays fp32:
measured on the 2-vCPU AVX2 EPYC, an int4 step after 256 tokens took 26 / 31 / 44 / 54 / 122 ms at
k = 1 / 2 / 4 / 8 / 16 rows with an fp32 stream and 30 / 39 / 31 / 156 / 1920 ms all in bf16 (bf16
SDPA has no fast path on AVX2: ~7.5 ms vs ~3.4 ms per step at one row). Measured, both kernels are
batch-invariant: a row's output does not depend on how many rows share the call (1..16), so a k-row
verify and 1-row decoding agree bit for bit there.
"""

from __future__ import annotations

from typing import Mapping

import torch

from specdec.model import native
from specdec.model.options import INT8_TOKEN
from specdec.model.layout import (
    INT4_SCALES_ZEROS,
    INT4_WEIGHT,
    INT8_COLUMNS,
    INT8_SCALE,
    INT8_TOKEN_COLUMNS,
    INT8_WEIGHT,
    Q4_1_D,
    Q4_1_M,
    Q4_1_NIBBLES,
    WeightLayout,
    model_weights,
)

Tensor = torch.Tensor

GROUP_SIZE = 32  # inputs per int4 scale/zero group (= a GGUF block)
INT4_MAX = 15
INT4_OFFSET = 8  # the kernel subtracts this from every nibble
INT8_MAX = 127
KERNEL_DTYPE = torch.bfloat16  # activation dtype into both kernels (see the module docstring)
# int8_token (INT8_TOKEN, named in specdec.model.options with the other formats): the int8 rows and
# layout of int8, their activations quantized per token (a row of 15-bit integers in two int8 halves,
# `native.QuantLinear(per_token=True)`); its matrices are recorded as
# `layout.WeightLayout.NATIVE_INT8_TOKEN`, so the draft pool, mapping the primary's weights, runs the
# same arithmetic
# int4 serves the embedding/lm_head in int8 too (see `precision.py`)
_KERNELS = {
    "int4": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"),
    "int8": ("_weight_int8pack_mm",),
}
NATIVE_ONLY = (INT8_TOKEN,)  # precisions with no torch-kernel form


def check_torch_kernels(precision: str, other_precisions: tuple[str, ...]) -> None:
    """ValueError unless this torch build has the packed kernels `precision` needs."""
    if precision in NATIVE_ONLY:
        raise ValueError(
            f"--precision {precision} runs on the native kernels only, which are {native.status()}; "
            f"use one of {other_precisions}"
        )
    for op in _KERNELS[precision]:
        if not hasattr(torch.ops.aten, op):
            raise ValueError(
                f"--precision {precision} needs torch.ops.aten.{op}, which this torch build "
                f"({torch.__version__}) lacks; use one of {other_precisions}"
            )


# --- int4 ---------------------------------------------------------------------------------------


def quantize_int4(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] float -> (q uint8 [N, K], scale bf16 [N, K/32], zero bf16 [N, K/32]), round to nearest."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)  # [N, G, 32]
    lo, hi = groups.amin(-1), groups.amax(-1)  # [N, G]
    scale = ((hi - lo) / INT4_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(KERNEL_DTYPE)
    zero = (lo + INT4_OFFSET * scale.float()).to(KERNEL_DTYPE)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None]) + INT4_OFFSET
    return q.clamp(0, INT4_MAX).to(torch.uint8).reshape(n, k), scale, zero


def q4_block_scales(d: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """GGUF Q4 block (w = q * d + m) -> the kernel's (scale, zero) = (d, m + 8d) in bf16 [N, K/32]."""
    return d.to(KERNEL_DTYPE), (m.float() + INT4_OFFSET * d.float()).to(KERNEL_DTYPE)


def pack_int4(name: str, q: Tensor, scale: Tensor, zero: Tensor) -> dict[str, Tensor]:
    """q uint8 [N, K] in 0..15, scale/zero [N, K/32] -> the two tensors `Int4Linear` runs on."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)  # [N, K/2]
    scales_and_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()  # [K/32, N, 2]
    return {name + INT4_WEIGHT: packed, name + INT4_SCALES_ZEROS: scales_and_zeros.to(KERNEL_DTYPE)}


def quantize_q4_1(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """weight [N, K] float -> GGUF Q4_1 (q uint8 [N, K] in 0..15, d fp16 [N, K/32], m fp16 [N, K/32]),
    w ≈ q * d + m: llama.cpp's own rounding (d = (max - min) / 15, m = min, q = round((w - m) / d))."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)  # [N, G, 32]
    lo, hi = groups.amin(-1), groups.amax(-1)
    d = ((hi - lo) / INT4_MAX).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(lo))
    q = torch.round((groups - m.float()[..., None]) * inv[..., None]).clamp(0, INT4_MAX).to(torch.uint8)
    return q.reshape(n, k), d, m


def pack_q4_1(name: str, q: Tensor, d: Tensor, m: Tensor) -> dict[str, Tensor]:
    """q uint8 [N, K] in 0..15, d/m fp16 [N, K/32] -> `<name>.weight_q4_1{,_d,_m}`: the native
    kernels' layout of the same values (`native.pack_q4_1`; N a multiple of 16)."""
    nibbles, dp, mp = native.pack_q4_1(q, d, m)
    return {name + Q4_1_NIBBLES: nibbles, name + Q4_1_D: dp, name + Q4_1_M: mp}


def pack_int8(name: str, q: Tensor, scale: Tensor, per_token: bool = False) -> dict[str, Tensor]:
    """int8 rows [N, K] and their scale [N] -> the native kernels' layout (`native.pack_int8`), named
    for per-token activations with `per_token`."""
    return {name + (INT8_TOKEN_COLUMNS if per_token else INT8_COLUMNS): native.pack_int8(q), name + INT8_SCALE: scale}


def check_int4_shape(name: str, shape: tuple[int, ...], other_precisions: tuple[str, ...]) -> None:
    if len(shape) != 2 or shape[1] % GROUP_SIZE:
        raise ValueError(
            f"--precision int4 cannot pack {name} {tuple(shape)}: its input dimension "
            f"must be a multiple of {GROUP_SIZE}; use one of {other_precisions}"
        )


class Int4Linear:
    def __init__(self, packed: Tensor, scales_and_zeros: Tensor, bias: Tensor | None = None) -> None:
        assert packed.dtype == torch.uint8 and scales_and_zeros.dim() == 3 and scales_and_zeros.shape[2] == 2
        self.packed, self.scales_and_zeros, self.bias = packed, scales_and_zeros, bias  # [N, K/2], [K/32, N, 2]
        self.out_features = scales_and_zeros.shape[1]

    def __call__(self, x: Tensor) -> Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(KERNEL_DTYPE), self.packed, GROUP_SIZE, self.scales_and_zeros
        ).to(x.dtype)
        return y if self.bias is None else y + self.bias


# --- int8 ---------------------------------------------------------------------------------------


def quantize_int8(name: str, weight: Tensor) -> dict[str, Tensor]:
    """weight [N, K] float -> q int8 [N, K] and scale bf16 [N] with w ≈ q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=torch.finfo(torch.bfloat16).tiny).to(KERNEL_DTYPE)
    q = torch.round(w / scale.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {name + INT8_WEIGHT: q, name + INT8_SCALE: scale}


class Int8Linear:
    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> None:
        assert weight.dtype == torch.int8 and scale.shape == weight.shape[:1]
        self.weight, self.scale, self.bias = weight, scale, bias  # [N, K] int8, [N] bf16
        self.out_features = weight.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        # x: [T, K] -> [T, N] in x's dtype
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.weight, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int8Embedding:
    """Rows of a per-channel int8 matrix: plain rows [V, C] (`WeightLayout.TORCH_INT8`), or the native
    layout [V/16, C/4, 16, 4] (`native.pack_int8`) when the matrix is also the native lm_head; widened
    only for the tokens looked up."""

    def __init__(
        self, weight: Tensor, scale: Tensor, dtype: torch.dtype, layout: WeightLayout = WeightLayout.TORCH_INT8
    ) -> None:
        self.weight, self.scale, self.dtype = weight, scale, dtype
        self.is_native_columns = layout.is_native

    def __call__(self, input_ids: Tensor) -> Tensor:
        # input_ids: [T] -> [T, C]
        rows = native.int8_rows(self.weight, input_ids) if self.is_native_columns else self.weight[input_ids]
        return (rows.float() * self.scale[input_ids].float()[:, None]).to(self.dtype)


def quantized_linear(weights: Mapping[str, Tensor], prefix: str) -> Int4Linear | Int8Linear | native.QuantLinear | None:
    """The packed layer of matrix `prefix`, as its recorded layout says (`layout.MatrixLayout`), or
    None for a dense/fp8 or absent matrix.

    The native layouts are recorded only where the native kernels were there to convert for
    (`precision.convert_weights`); a process that maps them without the kernels cannot run them."""
    matrix = model_weights(weights).matrix(prefix)
    if matrix is None or not matrix.layout.is_packed:
        return None
    tensors = [weights[name] for name in matrix.tensors]
    bias = weights.get(prefix + ".bias")
    if matrix.layout is WeightLayout.TORCH_INT4:
        return Int4Linear(tensors[0], tensors[1], bias)
    if matrix.layout is WeightLayout.TORCH_INT8:
        return Int8Linear(tensors[0], tensors[1], bias)
    lib = native.library()
    if lib is None:
        raise ValueError(f"{prefix}: the {matrix.layout.value} layout needs the native kernels: {native.status()}")
    if matrix.layout is WeightLayout.NATIVE_INT4:
        return native.QuantLinear(lib, q4=(tensors[0], tensors[1], tensors[2]), bias=bias)
    is_per_token = matrix.layout is WeightLayout.NATIVE_INT8_TOKEN
    return native.QuantLinear(lib, int8=(tensors[0], tensors[1]), bias=bias, per_token=is_per_token)
