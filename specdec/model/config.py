"""The architecture description of a Llama-family model (Llama 2/3, SmolLM2, Qwen2, Mistral).

One frozen dataclass, read from a Hugging Face `config.json` dict. It checks itself in
`__post_init__` so that a bad checkpoint fails at load time with a clear message, not
with a shape error deep inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# Architectures whose forward pass is exactly the one in `llama.py`.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# The sizes that fix a model's tensor shapes (with model_type, what a drafter file is bound to).
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # Mistral; None means full attention

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        for name in (*SHAPE_FIELDS, "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "num_attention_heads must be a multiple of num_key_value_heads "
                f"({self.num_attention_heads} vs {self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ("llama3", "linear", "default"):
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        model_type = cfg.get("model_type", "llama")
        sliding_window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        # transformers >= 5 nests RoPE settings in `rope_parameters`; older configs use rope_theta/rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding_window,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads(Path(path).read_text()))
