"""What a file trained on a model's outputs is bound to: the model's shape and its final norm's
weights; and the check of such a file's header."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

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


def bound_metadata(
    path: Path, kind: str, file_format: str, max_bytes: int, expected_fingerprint: str | None, verb: str = "written"
) -> dict[str, str]:
    """The metadata of a safetensors file made for one model (a drafter, the model's answers), read
    from its header alone and checked: its size at most max_bytes, its `format` file_format, its
    `model_fingerprint` expected_fingerprint (None: any). ValueError naming the file (`kind file
    PATH`) and what differs otherwise; the caller wraps it in its own error."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ValueError(f"{kind} file {path}: {e.strerror or e}") from None
    if size > max_bytes:
        raise ValueError(f"{kind} file {path} is {size} bytes, more than a {kind} file's {max_bytes}")
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len)) if 0 < header_len <= size - 8 else None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: a header nested past the parser's depth
        raise ValueError(f"{kind} file {path} cannot be read: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{kind} file {path} is not a safetensors file (truncated or another kind)")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):  # safetensors' metadata is an object of strings
        raise ValueError(f"{kind} file {path} is not a safetensors file (its __metadata__ is not an object)")
    if metadata.get("format") != file_format:
        raise ValueError(
            f"{kind} file {path} has format {metadata.get('format')!r}; this version reads {file_format!r}"
        )
    fingerprint = str(metadata.get("model_fingerprint", ""))
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise ValueError(
            f"{kind} file {path} was {verb} for model {fingerprint or '(none)'}, "
            f"but the primary serves model {expected_fingerprint}"
        )
    return metadata
