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

import logging
from typing import Any, Mapping

import torch

from specdec.model import native, quant
from specdec.model.config import ModelConfig
from specdec.model.layout import FP8_SCALE, WEIGHT, MatrixLayout, ModelWeights, WeightLayout, why_not_native
from specdec.model.linear import FP8_DTYPE, FP8_MAX
from specdec.model.options import FLOAT_PRECISIONS as _FLOAT_PRECISIONS
from specdec.model.options import INT8_TOKEN, PRECISIONS, QUANTIZED_PRECISIONS

log = logging.getLogger(__name__)

_INT4_FALLBACKS = _FLOAT_PRECISIONS + ("int8",)  # what serves a model int4 cannot pack
# int4/int8: the dtype of everything but the packed matmuls (residual stream, norms, RoPE,
# attention, KV cache), chosen by measurement; see the module docstring of `quant.py`.
_COMPUTE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.bfloat16,
    "int8": torch.float32,
    "int4": torch.float32,
    INT8_TOKEN: torch.float32,
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
) -> ModelWeights:
    """HF-named fp32/bf16 tensors -> the tensors `Transformer` runs on, in `precision`, with the layout
    of every matrix recorded (`layout.MatrixLayout`, chosen here once by `choose_layout`).

    `q4_blocks` (weight name -> GGUF Q4 (q, d, m), see `gguf_blocks.load_q4_blocks`) are what int4
    serves for the matrices they cover; every other precision ignores them.
    """
    dtype = compute_dtype(precision)
    lib = packed_kernels(precision, device)
    tensors: dict[str, torch.Tensor] = {}
    matrices: list[MatrixLayout] = []
    not_native: dict[str, list[str]] = {}  # reason -> matrices the native kernels do not hold
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the lm_head is the embedding matrix, never a second copy
        layout, reason = choose_layout(name, tuple(tensor.shape), precision, lib)
        if layout is None:
            tensors[name] = tensor.to(dtype).contiguous()  # norms, biases: not matrices
            continue
        if reason:
            not_native.setdefault(reason, []).append(name)
        blocks = (q4_blocks or {}).get(name)
        matrix = MatrixLayout.of(name.removesuffix(WEIGHT), layout, tuple(tensor.shape))
        converted = _convert(matrix, tensor, dtype, blocks)
        assert tuple(converted) == matrix.tensors, (tuple(converted), matrix.tensors)
        tensors.update(converted)
        matrices.append(matrix)
    for reason, names in not_native.items():
        log.warning(
            "%s: %d matrices use torch's packed kernels, not the native ones: %s (first: %s)",
            precision,
            len(names),
            reason,
            names[0],
        )
    return ModelWeights(tensors, matrices)


def packed_kernels(precision: str, device: torch.device | str) -> Any:
    """The native library that serves `precision`'s packed matrices, or None: torch's packed kernels
    (or no packed matrix at all, for the float precisions). ValueError when neither can serve it."""
    if precision not in QUANTIZED_PRECISIONS:
        return None
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"--precision {precision} runs on the CPU kernels only, not on "
            f"{torch.device(device).type}; serve that device with one of {_FLOAT_PRECISIONS}"
        )
    lib = native.library()
    if lib is None:
        quant.check_torch_kernels(precision, _FLOAT_PRECISIONS)
    return lib


def choose_layout(name: str, shape: tuple[int, ...], precision: str, lib: Any) -> tuple[WeightLayout | None, str]:
    """The layout weight `name` [N, K] is served in under `precision` (None: not a matrix, kept as
    a plain tensor), and why the native kernels do not hold it ("" when they do, or when no packed
    layout applies). `lib`: `packed_kernels`' answer. The one place that decides native vs torch:

    * int8_token: native only; a shape the native layout cannot hold is a ValueError.
    * int4 projections: native Q4_1 where it fits, else torch's int4pack (K a multiple of 32).
    * int8 projections, and the embedding/lm_head under any packed precision: native int8 rows
      where they fit, else torch's int8pack.
    """
    is_embedding = name in _EMBEDDING_NAMES
    if not (is_embedding or name.endswith(_MATRIX_SUFFIXES)):
        return None, ""
    if precision not in QUANTIZED_PRECISIONS:
        is_fp8 = precision == "fp8_e4m3" and not is_embedding
        return (WeightLayout.FP8 if is_fp8 else WeightLayout.DENSE), ""
    reason = why_not_native(shape, lib)
    if precision == INT8_TOKEN:
        if reason:
            raise ValueError(
                f"--precision {INT8_TOKEN} cannot pack {name.removesuffix(WEIGHT)} {tuple(shape)}: the "
                f"native layout needs whole groups of {native.COLUMNS} outputs and blocks of {native.QK} inputs"
            )
        return WeightLayout.NATIVE_INT8_TOKEN, ""
    if precision == "int4" and not is_embedding:
        quant.check_int4_shape(name, shape, _INT4_FALLBACKS)
        return (WeightLayout.TORCH_INT4 if reason else WeightLayout.NATIVE_INT4), reason
    return (WeightLayout.TORCH_INT8 if reason else WeightLayout.NATIVE_INT8), reason


def _convert(
    matrix: MatrixLayout, weight: torch.Tensor, dtype: torch.dtype, blocks: tuple[torch.Tensor, ...] | None
) -> dict[str, torch.Tensor]:
    """weight [N, K] -> the tensors of `matrix`'s layout, named as its record names them."""
    module, layout = matrix.module, matrix.layout
    if layout is WeightLayout.DENSE:
        return {module + WEIGHT: weight.to(dtype).contiguous()}
    if layout is WeightLayout.FP8:
        w8, scale = quantize_fp8_per_channel(weight)
        return {module + WEIGHT: w8, module + FP8_SCALE: scale}
    if layout in (WeightLayout.NATIVE_INT4, WeightLayout.TORCH_INT4):
        return _int4_weights(matrix, weight, blocks)
    rows = quant.quantize_int8(module, weight)
    if layout is WeightLayout.TORCH_INT8:
        return rows
    is_per_token = layout is WeightLayout.NATIVE_INT8_TOKEN
    return quant.pack_int8(module, rows[module + quant.INT8_WEIGHT], rows[module + quant.INT8_SCALE], is_per_token)


def _int4_weights(
    matrix: MatrixLayout, weight: torch.Tensor, blocks: tuple[torch.Tensor, ...] | None
) -> dict[str, torch.Tensor]:
    """A Q4 matrix: the file's own blocks (q, d, m) where given, else round-to-nearest."""
    if matrix.layout is WeightLayout.NATIVE_INT4:  # the file's values, for the native kernels
        q, d, m = quant.quantize_q4_1(weight) if blocks is None else blocks
        assert q.shape == weight.shape, (matrix.module, q.shape, weight.shape)
        return quant.pack_q4_1(matrix.module, q, d, m)
    if blocks is None:
        q, scale, zero = quant.quantize_int4(weight)
    else:
        q, d, m = blocks  # the file's own blocks: [N, K], [N, K/32], [N, K/32]
        assert q.shape == weight.shape, (matrix.module, q.shape, weight.shape)
        scale, zero = quant.q4_block_scales(d, m)
    try:
        return quant.pack_int4(matrix.module, q, scale, zero)
    except RuntimeError as e:
        raise ValueError(
            f"--precision int4 cannot pack {matrix.module}{WEIGHT} {tuple(weight.shape)} ({e}); "
            f"use one of {_INT4_FALLBACKS}"
        ) from None


def weight_bytes(weights: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())
