"""Converting a llama.cpp GGUF file into a Hugging Face-style model directory.

The engine reads one format: a directory with `config.json`, `*.safetensors` under Hugging Face
tensor names, `tokenizer.json` and `tokenizer_config.json`. A GGUF file is turned into that once
(`loader.resolve_model_dir` caches the result), so that loading at service start is a memory map
of ready float weights, and nothing at runtime depends on `gguf` or `transformers`.

What the conversion has to undo:
  * quantization: every quantized tensor is dequantized to float32 (`gguf.quants.dequantize`);
    an unquantized file keeps its float dtype (F32, F16 or BF16). Q4_0/Q4_1 tensors are also
    kept as their raw blocks (`gguf_blocks.Q4_BLOCKS_FILE`), which `--precision int4` serves as is.
  * the Q/K row permutation: llama.cpp's converter reorders the rows of `attn_q`/`attn_k` of
    `llama` files so that its adjacent-pair RoPE computes what HF's half-split RoPE computes;
    `unpermute_qk_rows` puts them back (the inverse of what transformers' GGUF loader does).
  * the names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...
  * the metadata: `llama.*` keys -> `config.json`; `tokenizer.ggml.*` -> `tokenizer.json`.

The output directory appears atomically (built in a sibling temp dir, then renamed), so a killed
conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specdec.model import gguf_blocks, gguf_tokenizer
from specdec.model.model_files import GGUFFileError, check_gguf_header
from specdec.progress import ProgressCallback, no_progress

# The stage name of the conversion's progress events (specdec.progress).
CONVERSION_STAGE = "converting GGUF tensors"

# Bump when the files this module writes change: it is part of the cache key in `loader.py`.
CONVERTER_VERSION = 2  # 2: the raw Q4_0/Q4_1 blocks file
# Above this many bytes of weights the output is split into shards, so that peak memory during
# conversion stays near one shard rather than the whole float32 model.
DEFAULT_MAX_SHARD_BYTES = 2 << 30
CONVERSION_INFO_FILE = "specdec_conversion.json"

# GGUF architecture -> (HF model_type, HF architecture class, Q/K rows permuted by llama.cpp).
# Qwen2 uses NeoX-style (half-split) RoPE in llama.cpp too, so its rows were never permuted.
SUPPORTED_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Llama 3.1+ files carry the RoPE frequency factors as a tensor; they become config.rope_scaling.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_FLOAT_DTYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
# The only llama3 RoPE parameters published (Llama 3.1, 3.2, 3.3); a file that does not match
# them is rejected rather than guessed at.
_REQUIRED = object()  # build_hf_config's marker of a metadata field without a default
_LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def open_gguf(path: Path) -> GGUFReader:
    """`GGUFReader` of `path`, its header checked first; GGUFFileError naming the file and what is
    wrong (not the reader's IndexError or reshape error) for a truncated or corrupt file."""
    check_gguf_header(path)
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as e:
        raise GGUFFileError(f"GGUF file {path} cannot be read (truncated or corrupt): {e}") from None


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, e.g. `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if (match := _BLOCK_NAME.fullmatch(gguf_name)) is not None:
        layer, kind, suffix = match.groups()
        module = _BLOCK_TENSOR_NAMES.get(kind)
        return None if module is None else f"model.layers.{layer}.{module}.{suffix}"
    base, _, suffix = gguf_name.rpartition(".")
    module = _GLOBAL_TENSOR_NAMES.get(base)
    return None if module is None else f"{module}.{suffix}"


def unpermute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` of Q/K projection rows (weights or biases).

    Within each head HF's RoPE rotates dimension i with i + head_dim/2; llama.cpp's rotates 2i with
    2i+1, so its converter interleaved the two halves. Per head (head_dim 4):
        HF rows [r0 r1 r2 r3]  ->  GGUF rows [r0 r2 r1 r3];  this maps GGUF back to HF.
    `num_heads` is the number of heads the rows hold: attention heads for Q, KV heads for K.
    """
    head_dim = weight.shape[0] // num_heads
    assert head_dim * num_heads == weight.shape[0] and head_dim % 2 == 0, (weight.shape, num_heads)
    # [num_heads, head_dim/2, 2, ...] -> [num_heads, 2, head_dim/2, ...]: pairs become halves.
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(rows.swapaxes(1, 2).reshape(weight.shape))


def llama3_rope_factors(
    head_dim: int,
    rope_theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: float,
) -> np.ndarray:
    """The per-frequency divisors of Llama 3.1 RoPE scaling [head_dim/2], as llama.cpp stores them."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    # High frequencies (short wavelengths) are kept, low ones divided by `factor`, smooth between.
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    return np.where(wavelen < high_freq_wavelen, 1.0, np.where(wavelen > low_freq_wavelen, factor, blended))


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value field of the file, as Python scalars, strings and lists."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def build_hf_config(metadata: dict[str, Any], reader: GGUFReader) -> dict[str, Any]:
    """`config.json` of the model this file holds, from its `<arch>.*` metadata and tensor names."""
    arch = metadata["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(SUPPORTED_ARCHITECTURES)})")
    model_type, architecture_class, _ = SUPPORTED_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = _REQUIRED) -> Any:
        """The file's `<arch>.<name>` field; one without a default must be there (llama.cpp requires it)."""
        value = metadata.get(f"{arch}.{name}", default)
        if value is _REQUIRED:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    num_heads = key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise ValueError(f"per-layer attention.head_count_kv is not supported, got {num_kv_heads!r}")
    hidden_size = key("embedding_length")
    head_dim = key("attention.key_length", hidden_size // num_heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(
            f"partial rotary embeddings are not supported "
            f"(rope.dimension_count {key('rope.dimension_count')} != head_dim {head_dim})"
        )
    rope_theta = _float32_value(key("rope.freq_base", 10000.0))
    eos_token_ids = gguf_tokenizer.eos_token_ids(metadata)
    config = {
        "architectures": [architecture_class],
        "model_type": model_type,
        # The embedding's row count is the truth; the token list can be shorter (padded vocab).
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(metadata, arch, reader, head_dim, rope_theta),
        "max_position_embeddings": key("context_length"),
        # llama.cpp writes `output.weight` only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_ids[0] if len(eos_token_ids) == 1 else (list(eos_token_ids) or None),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": str(output_dtype(reader)).removeprefix("torch."),
    }
    if model_type == "qwen2":
        config["use_sliding_window"] = False
    return config


def output_dtype(reader: GGUFReader) -> torch.dtype:
    """float32 when anything is quantized (that is what dequantizing gives), else the matrices' own dtype."""
    matrix_types = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    if len(matrix_types) == 1 and (only := matrix_types.pop()) in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[only]
    return torch.float32


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    show_progress: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    on_progress: ProgressCallback = no_progress,
) -> Path:
    """Write the HF-style directory of `gguf_path` to `out_dir` (which must not exist) atomically.
    show_progress: a bar on stderr; on_progress: one event per tensor (specdec.progress)."""
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"conversion output {out_dir} already exists")
    reader = open_gguf(gguf_path)
    try:
        metadata = read_metadata(reader)
        config = build_hf_config(metadata, reader)
    except KeyError as e:
        raise GGUFFileError(f"GGUF file {gguf_path} lacks {e.args[0]!r}") from None
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise GGUFFileError(f"GGUF file {gguf_path} cannot be converted: {e}") from None
    partial_dir = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(partial_dir, ignore_errors=True)
    partial_dir.mkdir(parents=True)
    try:
        _write_weights(reader, config, partial_dir, show_progress, max_shard_bytes, on_progress)
        _write_json(partial_dir / "config.json", config)
        try:
            tokenizer_json, tokenizer_config = gguf_tokenizer.build_tokenizer_files(metadata, gguf_path)
        except (KeyError, IndexError, TypeError, ValueError) as e:  # e.g. an EOS id past the token list
            raise GGUFFileError(
                f"GGUF file {gguf_path}: its tokenizer metadata does not describe a tokenizer ({type(e).__name__}: {e})"
            ) from None
        (partial_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(partial_dir / "tokenizer_config.json", tokenizer_config)
        _write_json(
            partial_dir / "generation_config.json",
            {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if config[key] is not None},
        )
        stat = gguf_path.stat()
        _write_json(
            partial_dir / CONVERSION_INFO_FILE,
            {
                "source": str(gguf_path),
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
                "converter_version": CONVERTER_VERSION,
                "general.name": metadata.get("general.name"),
                "general.file_type": metadata.get("general.file_type"),
            },
        )
        for path in partial_dir.iterdir():  # on disk before it is published, even across a power loss
            with open(path, "rb") as file:
                os.fsync(file.fileno())
        os.rename(partial_dir, out_dir)  # atomic: readers see all of the directory or none of it
    except BaseException:
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise
    return out_dir


def _write_weights(
    reader: GGUFReader,
    config: dict[str, Any],
    out_dir: Path,
    show_progress: bool,
    max_shard_bytes: int,
    on_progress: ProgressCallback = no_progress,
) -> None:
    arch = reader.fields["general.architecture"].contents()
    is_qk_permuted = SUPPORTED_ARCHITECTURES[arch][2]
    dtype = output_dtype(reader)
    named = [(t, hf_tensor_name(t.name)) for t in reader.tensors if t.name != ROPE_FREQS_TENSOR]
    if unknown := [t.name for t, hf_name in named if hf_name is None]:
        raise ValueError(f"GGUF tensors with no Hugging Face counterpart: {unknown[:8]}")
    shards = _plan_shards([t.n_elements * dtype.itemsize for t, _ in named], max_shard_bytes)
    index: dict[str, str] = {}
    blocks: dict[str, torch.Tensor] = {}
    progress = tqdm(total=len(named), desc=CONVERSION_STAGE, unit="tensor", disable=not show_progress)
    num_converted = 0
    for shard_num, tensor_indices in enumerate(shards, start=1):
        file_name = (
            "model.safetensors" if len(shards) == 1 else f"model-{shard_num:05d}-of-{len(shards):05d}.safetensors"
        )
        state: dict[str, torch.Tensor] = {}
        for i in tensor_indices:
            tensor, hf_name = named[i]
            assert hf_name is not None  # unknown names were refused above
            try:
                rows = dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                raise GGUFFileError(
                    f"GGUF file {reader.data.filename}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
                    "which this converter cannot dequantize"
                ) from None
            weight = _hf_rows(rows, tensor.name, config, is_qk_permuted)
            if tensor.tensor_type in gguf_blocks.Q4_TYPES:
                q, d, m = gguf_blocks.unpack_q4_blocks(tensor.data, tensor.tensor_type)
                q, d, m = (_hf_rows(a, tensor.name, config, is_qk_permuted) for a in (q, d, m))
                blocks.update(gguf_blocks.q4_block_tensors(hf_name, q, d, m))
            state[hf_name] = torch.from_numpy(np.require(weight, requirements=("C", "W"))).to(dtype)
            index[hf_name] = file_name
            progress.update(1)
            num_converted += 1  # not progress.n: a disabled bar does not count
            on_progress(CONVERSION_STAGE, num_converted, len(named))
        save_file(state, str(out_dir / file_name), metadata={"format": "pt"})
        del state
    progress.close()
    if blocks:
        save_file(blocks, str(out_dir / gguf_blocks.Q4_BLOCKS_FILE), metadata={"format": "pt"})
    if len(shards) > 1:
        total_size = sum(t.n_elements for t, _ in named) * dtype.itemsize
        _write_json(
            out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total_size}, "weight_map": index}
        )


def _hf_rows(rows: np.ndarray, gguf_name: str, config: dict[str, Any], is_qk_permuted: bool) -> np.ndarray:
    """Rows of a tensor [out, ...] in HF order: Q/K rows of permuted architectures un-permuted."""
    if is_qk_permuted and ".attn_q." in gguf_name:
        return unpermute_qk_rows(rows, config["num_attention_heads"])
    if is_qk_permuted and ".attn_k." in gguf_name:
        return unpermute_qk_rows(rows, config["num_key_value_heads"])
    return rows


def _plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Greedy, in file order: a shard is closed when the next tensor would push it past the limit."""
    shards: list[list[int]] = [[]]
    shard_bytes = 0
    for i, size in enumerate(sizes):
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(i)
        shard_bytes += size
    return shards


def _rope_scaling(
    metadata: dict[str, Any], arch: str, reader: GGUFReader, head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    rope_freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if rope_freqs is not None:
        return _llama3_rope_scaling(dequantize(rope_freqs.data, rope_freqs.tensor_type), head_dim, rope_theta)
    if scaling_type == "none":
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"rope scaling type {scaling_type!r} is not supported")


def _llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, rope_theta: float) -> dict[str, Any]:
    params = {"factor": float(rope_freqs.max()), **_LLAMA3_ROPE_DEFAULTS}
    expected = llama3_rope_factors(head_dim, rope_theta, **params)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-4):
        raise ValueError(
            "the file's rope_freqs tensor does not match llama3 RoPE scaling with "
            f"{_LLAMA3_ROPE_DEFAULTS}; this scaling is not supported"
        )
    return {"rope_type": "llama3", **params}


def _float32_value(value: float) -> float:
    """The shortest decimal of a float32 metadata value: 9.999999747378752e-06 -> 1e-05."""
    return float(str(np.float32(value)))


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
