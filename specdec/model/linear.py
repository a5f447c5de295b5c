"""One linear layer over borrowed weight tensors, in any of the engine's precisions.

`Linear.from_weights` builds the layer its matrix's recorded layout names (`layout.MatrixLayout`):
the packed int4/int8 layouts give the layers of `quant.py` (or `native.QuantLinear`); dense and
fp8 matrices are this class. Two things here are not a plain `F.linear`:

* fp8_e4m3 weights carry a per-output-channel scale (`<name>.weight_scale`, [out] fp32):
  W ≈ W8 * scale[:, None]. On CPU the fp8 weight is widened to the compute dtype inside the
  call (an honest emulation: memory is fp8, arithmetic is bf16). On CUDA GPUs with fp8
  tensor cores `torch._scaled_mm` multiplies fp8 × fp8 directly, the activations being
  quantized per row on the fly.
* On some CPUs, fp32 GEMMs with 2 or 3 rows run as repeated matrix-vector products and
  cost more than 4 rows (measured on an AVX512 machine: 7.0 / 13.8 / 21.2 / 11.5 ms for
  1/2/3/4 rows of the 49152×576 lm_head); on others (AVX2) 2 rows are cheaper than 4.
  `calibrate_min_gemm_rows` times both on the machine at hand, and inputs of 2..n-1 rows
  are padded to `min_gemm_rows` = n only where that measured faster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import torch
import torch.nn.functional as F

from specdec.model import native
from specdec.model.layout import WEIGHT, WeightLayout, model_weights
from specdec.model.quant import Int4Linear, Int8Linear, quantized_linear

if TYPE_CHECKING:
    from specdec.model.config import ModelConfig

Tensor = torch.Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value; quantization saturates here (SATFINITE)
PADDED_GEMM_ROWS = 4  # see the module docstring
NO_PADDING = 1


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


class Linear:
    def __init__(
        self, weight: Tensor, scale: Tensor | None = None, bias: Tensor | None = None, min_gemm_rows: int = NO_PADDING
    ) -> None:
        assert weight.dim() == 2
        assert (scale is not None) == (weight.dtype == FP8_DTYPE), "fp8 weights need a scale and only they"
        self.weight, self.scale, self.bias = weight, scale, bias  # weight: [out, in], scale: [out]
        self.is_fp8 = weight.dtype == FP8_DTYPE
        self.min_gemm_rows = min_gemm_rows
        self.use_scaled_mm = self.is_fp8 and _has_fp8_tensor_cores(weight.device)

    @classmethod
    def from_weights(
        cls, weights: Mapping[str, Tensor], prefix: str, min_gemm_rows: int = NO_PADDING
    ) -> "Linear | Int4Linear | Int8Linear | native.QuantLinear":
        weights = model_weights(weights)
        matrix = weights.matrix(prefix)
        if matrix is None:
            raise KeyError(prefix + WEIGHT)
        if (quantized := quantized_linear(weights, prefix)) is not None:
            return quantized
        scale = weights[matrix.tensors[1]] if matrix.layout is WeightLayout.FP8 else None
        return cls(weights[matrix.tensors[0]], scale, weights.get(prefix + ".bias"), min_gemm_rows)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: Tensor) -> Tensor:
        # x: [T, in] -> [T, out]
        num_rows = x.shape[0]
        if 1 < num_rows < self.min_gemm_rows and x.dtype == torch.float32 and x.device.type == "cpu":
            padded = x.new_zeros(self.min_gemm_rows, x.shape[1])
            padded[:num_rows] = x
            return self._matmul(padded)[:num_rows]
        return self._matmul(x)

    def _matmul(self, x: Tensor) -> Tensor:
        if not self.is_fp8:
            return F.linear(x, self.weight, self.bias)
        assert self.scale is not None  # fp8 weights come with their scale (__init__)
        if self.use_scaled_mm:
            # Row-wise dynamic activation scale; _scaled_mm wants a column-major second operand.
            x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # [T, 1]
            x8 = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            y = torch._scaled_mm(
                x8, self.weight.t(), scale_a=x_scale, scale_b=self.scale.view(1, -1), out_dtype=x.dtype
            )
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        return y if self.bias is None else y + self.bias


def calibrate_min_gemm_rows(config: ModelConfig, repeats: int = 20) -> int:
    """PADDED_GEMM_ROWS when a 4-row fp32 GEMM beats 2 or 3 rows here, else NO_PADDING, timed on the
    model's own MLP up-projection shape (hidden_size -> intermediate_size), the GEMM of every layer
    with the most work per row: whether padding pays depends on the shape."""
    import time

    in_features, out_features = config.hidden_size, config.intermediate_size
    weight = torch.randn(out_features, in_features)

    def median_s(num_rows: int) -> float:
        x = torch.randn(num_rows, in_features)
        F.linear(x, weight)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            F.linear(x, weight)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    padded = median_s(PADDED_GEMM_ROWS)
    return PADDED_GEMM_ROWS if padded < min(median_s(2), median_s(3)) else NO_PADDING
