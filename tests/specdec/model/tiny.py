"""A tiny llama config for the model tests: small enough to build weights in milliseconds, shaped
like a real one (grouped KV heads, matrices whose K is a multiple of the kernels' 32-value blocks)."""

from __future__ import annotations

import dataclasses
from typing import Any

from specdec.model.config import ModelConfig

# hidden 64, intermediate 96, 4 heads of 16 over 2 KV heads, one layer
TINY = ModelConfig(
    model_type="llama",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def tiny_config(**changes: Any) -> ModelConfig:
    """TINY with `changes` (field -> value), checked again by ModelConfig."""
    return dataclasses.replace(TINY, **changes)
