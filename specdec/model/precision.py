"""Weight precisions the engine serves: fp32, bf16, fp16, and weight-only fp8_e4m3, int8 and int4.

fp8_e4m3 quantizes the projection matrices of every block (q/k/v/o, gate/up/down) with one
fp32 scale per output channel, scale = max|row| / 448, saturating at ±448. Embeddings,
norms and the lm_head stay in bf16, the compute dtype: they are a small share of the
bytes read per token at this size, and the lm_head decides every argmax.

int4 and int8 (`quant.py`) keep the block matrices packed for the native kernels (or torch's): int4 in groups
of 32 (a Q4_0/Q4_1 GGUF's own blocks when the model directory holds them, `gguf_blocks.py`,
else round-to-nearest), int8 per output channel. The embedding matrix is int8 per channel in
both: one copy serves the lookup and the tied lm_head (the head is 28M of SmolLM2-135M's 135M
weights). Measured for that choice, with int4 layers: greedy agreement with the fp32 model over
200 teacher-forced positions (8 prompts) is 197 / 196 / 189 / 174 for an fp32 / bf16 / int8 /
int4 head; the 49152x576 head costs 2.7 / 3.1 / 4.0 / 11.0 ms at 1 row and 9.2 / 13.8 / 27 / 22
ms at 8 rows (int4 / int8 / bf16 / fp32). A bf16 head (56 MB) with the int4 layers (~67 MB)
would exceed 1.2x the 98 MB GGUF; int8 takes 28 MB (int4 in memory: 95 MB in all) and needs no
second copy for the lookup, which int4's opaque packed layout would. Whole-model agreement with
fp32 on the same positions: bf16 187, int8 184, int4 189 of 200. Norms and the rest of the model
run in `compute_dtype` (see `_COMPUTE_DTYPES`); only the packed matmuls see bf16.
"""

from __future__ import annotations

from typing import Mapping

import torch

from specdec.model import native, quant
from specdec.model.config import ModelConfig
from specdec.model.linear import FP8_DTYPE, FP8_MAX

_FLOAT_PRECISIONS = ("fp32", "bf16", "fp16", "fp8_e4m3")
PRECISIONS = _FLOAT_PRECISIONS + quant.QUANTIZED_PRECISIONS
_INT4_FALLBACKS = _FLOAT_PRECISIONS + ("int8",)  # what serves a model int4 cannot pack
AUTO = "auto"  # not a format: the primary measures candidates at start-up (primary_svc.autotune)
# int4/int8: the dtype of everything but the packed matmuls (residual stream, norms, RoPE,
# attention, KV cache), chosen by measurement; see the module docstring of `quant.py`.
_COMPUTE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.bfloat16,
    "int8": torch.float32,
    "int4": torch.float32,
    quant.INT8_TOKEN: torch.float32,
}
_EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
_MATRIX_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


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


def convert_weights(
    state_dict: Mapping[str, torch.Tensor],
    config: ModelConfig,
    precision: str,
    q4_blocks: Mapping[str, tuple[torch.Tensor, ...]] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """HF-named fp32/bf16 tensors -> the tensors `Transformer` runs on, in `precision`.

    `q4_blocks` (weight name -> GGUF Q4 (q, d, m), see `gguf_blocks.load_q4_blocks`) are what int4
    serves for the matrices they cover; every other precision ignores them.
    """
    dtype = compute_dtype(precision)
    if precision in quant.QUANTIZED_PRECISIONS:
        quant.check_kernels(precision, device, _FLOAT_PRECISIONS)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the lm_head is the embedding matrix, never a second copy
        module = name.removesuffix(".weight")
        if precision == quant.INT8_TOKEN and (name in _EMBEDDING_NAMES or name.endswith(_MATRIX_SUFFIXES)):
            out.update(_int8_token_weights(module, tensor))
        elif (precision in quant.QUANTIZED_PRECISIONS and name in _EMBEDDING_NAMES) or (
            precision == "int8" and name.endswith(_MATRIX_SUFFIXES)
        ):
            out.update(_int8_weights(module, tensor))
        elif precision == "int4" and name.endswith(_MATRIX_SUFFIXES):
            out.update(_int4_weights(name, tensor, (q4_blocks or {}).get(name)))
        elif precision == "fp8_e4m3" and name.endswith(_MATRIX_SUFFIXES):
            out[name], out[name + "_scale"] = quantize_fp8_per_channel(tensor)
        else:
            out[name] = tensor.to(dtype).contiguous()
    return out


def _int8_weights(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    rows = quant.quantize_int8(module, weight)
    if native.library() is None or not native.fits(*weight.shape):
        return rows  # torch's kernels
    return quant.pack_int8(module, rows[module + quant.INT8_WEIGHT], rows[module + quant.INT8_SCALE])


def _int8_token_weights(module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    if not native.fits(*weight.shape):
        raise ValueError(
            f"--precision {quant.INT8_TOKEN} cannot pack {module} {tuple(weight.shape)}: the native layout needs "
            f"whole groups of {native.COLUMNS} outputs and blocks of {native.QK} inputs"
        )
    rows = quant.quantize_int8(module, weight)
    return quant.pack_int8(module, rows[module + quant.INT8_WEIGHT], rows[module + quant.INT8_SCALE], per_token=True)


def _int4_weights(name: str, weight: torch.Tensor, blocks: tuple[torch.Tensor, ...] | None) -> dict[str, torch.Tensor]:
    quant.check_int4_shape(name, weight, _INT4_FALLBACKS)
    if native.library() is not None and native.fits(*weight.shape):  # the file's values, for the native kernels
        q, d, m = quant.quantize_q4_1(weight) if blocks is None else blocks
        assert q.shape == weight.shape, (name, q.shape, weight.shape)
        return quant.pack_q4_1(name.removesuffix(".weight"), q, d, m)
    if blocks is None:
        q, scale, zero = quant.quantize_int4(weight)
    else:
        q, d, m = blocks  # the file's own blocks: [N, K], [N, K/32], [N, K/32]
        assert q.shape == weight.shape, (name, q.shape, weight.shape)
        scale, zero = quant.q4_block_scales(d, m)
    try:
        return quant.pack_int4(name.removesuffix(".weight"), q, scale, zero)
    except RuntimeError as e:
        raise ValueError(
            f"--precision int4 cannot pack {name} {tuple(weight.shape)} ({e}); use one of {_INT4_FALLBACKS}"
        ) from None


def weight_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())
