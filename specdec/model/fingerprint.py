"""What a file trained on a model's outputs is bound to: the model's shape and its final norm's weights."""

from __future__ import annotations

import hashlib
import json

import torch
from torch import Tensor

from specdec.model.config import SHAPE_FIELDS, ModelConfig


def model_fingerprint(config: ModelConfig, final_norm_weight: Tensor) -> str:
    """What a drafter file is bound to: the primary's shape and its final norm's weights (rounded to
    bf16, so every serving precision of the same checkpoint gives the same fingerprint)."""
    shape = {k: getattr(config, k) for k in ("model_type", *SHAPE_FIELDS)}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    digest.update(final_norm_weight.detach().float().cpu().to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:32]
