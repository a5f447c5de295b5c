"""Weight precisions the engine serves: fp32, bf16, fp16 and weight-only fp8_e4m3.

fp8_e4m3 quantizes the projection matrices of every block (q/k/v/o, gate/up/down) with one
fp32 scale per output channel, scale = max|row| / 448, saturating at ±448. Embeddings,
norms and the lm_head stay in bf16, the compute dtype: they are a small share of the
bytes read per token at this size, and the lm_head decides every argmax.
"""
from __future__ import annotations

from typing import Mapping

import torch

from specdec.model.config import ModelConfig
from specdec.model.linear import FP8_DTYPE, FP8_MAX

PRECISIONS = ("fp32", "bf16", "fp16", "fp8_e4m3")
AUTO = "auto"   # not a format: the primary measures candidates at start-up (primary_svc.autotune)
_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp8_e4m3": torch.bfloat16}
_FP8_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                 "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in _COMPUTE_DTYPES:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return _COMPUTE_DTYPES[precision]


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (fp8 [out, in], scale [out] fp32) with weight ≈ fp8 * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
    w8 = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w8, scale


def convert_weights(state_dict: Mapping[str, torch.Tensor], config: ModelConfig,
                    precision: str) -> dict[str, torch.Tensor]:
    """HF-named fp32/bf16 tensors -> the tensors `Transformer` runs on, in `precision`."""
    dtype = compute_dtype(precision)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the lm_head is the embedding matrix, never a second copy
        if precision == "fp8_e4m3" and name.endswith(_FP8_SUFFIXES):
            out[name], out[name + "_scale"] = quantize_fp8_per_channel(tensor)
        else:
            out[name] = tensor.to(dtype).contiguous()
    return out


def weight_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())
