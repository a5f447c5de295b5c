"""A trained drafter on disk: one safetensors file (no pickle), bound to the model it was trained on.

Tensors: the drafter's own weights (`FeatureDrafter.state_dict()`, fp16) and `vocab` (int32 [N], the
primary token id of each head row). Metadata (strings): `format` (FORMAT), `config` (DrafterConfig
JSON), `model_fingerprint` (`model.model_fingerprint` of the primary it was trained on), and
`training` (JSON: command, data sources and licences, data size, seed, accuracy). A file that is
truncated, of another format version or of another model is refused with `DrafterFileError`,
naming the file and what differs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draft_svc.heads.model import DrafterConfig, FeatureDrafter
from specdec.model.fingerprint import bound_metadata

FORMAT = "specdec-feature-drafter-1"
MAX_FILE_BYTES = 64 << 20  # a drafter is a few MB; anything this large is not one


class DrafterFileError(ValueError):
    """A drafter file that cannot serve this model (unreadable, another format, another model)."""


@dataclasses.dataclass(frozen=True, slots=True)
class DrafterFile:
    config: DrafterConfig
    state: dict[str, torch.Tensor]  # FeatureDrafter's state dict, fp32
    vocab: torch.Tensor  # [N] int64
    model_fingerprint: str
    training: dict[str, Any]

    def drafter(self) -> FeatureDrafter:
        drafter = FeatureDrafter(self.config)
        drafter.load_state_dict(self.state)
        return drafter.eval().requires_grad_(False)


def save(path: Path, drafter: FeatureDrafter, vocab: torch.Tensor, fingerprint: str, training: dict[str, Any]) -> int:
    """Write the file (atomically: a temporary beside it, then a rename); returns its size in bytes."""
    tensors = {f"drafter.{k}": v.detach().to(torch.float16).contiguous() for k, v in drafter.state_dict().items()}
    tensors["vocab"] = vocab.to(torch.int32).contiguous()
    metadata = {
        "format": FORMAT,
        "config": drafter.config.to_json(),
        "model_fingerprint": fingerprint,
        "training": json.dumps(training, sort_keys=True),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)
    return path.stat().st_size


def load(path: Path, expected_fingerprint: str | None = None) -> DrafterFile:
    """Read and check a drafter file; `expected_fingerprint` (the serving model's) must match."""
    path = Path(path)
    try:
        metadata = bound_metadata(path, "drafter", FORMAT, MAX_FILE_BYTES, expected_fingerprint, verb="trained")
    except ValueError as e:
        raise DrafterFileError(str(e)) from None
    fingerprint = str(metadata.get("model_fingerprint", ""))
    try:
        config = DrafterConfig.from_json(metadata["config"])
        training = json.loads(metadata.get("training", "{}"))
        tensors = load_file(str(path))
    except DrafterFileError:
        raise
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise DrafterFileError(f"drafter file {path} cannot be read: {e}") from None
    vocab = tensors.pop("vocab", None)
    if vocab is not None and (vocab.dtype.is_floating_point or vocab.dtype.is_complex or vocab.dtype == torch.bool):
        raise DrafterFileError(f"drafter file {path}: vocab must hold integer token ids, not {vocab.dtype}")
    if vocab is None or vocab.ndim != 1 or vocab.shape[0] != config.draft_vocab_size:
        raise DrafterFileError(f"drafter file {path}: vocab must hold {config.draft_vocab_size} token ids")
    vocab = vocab.to(torch.int64)
    if int(vocab.min()) < 0 or int(vocab.max()) >= config.vocab_size:
        raise DrafterFileError(f"drafter file {path}: vocab ids must lie in [0, {config.vocab_size})")
    weights = {k.removeprefix("drafter."): v for k, v in tensors.items() if k.startswith("drafter.")}
    if wrong := sorted(k for k, v in weights.items() if not v.dtype.is_floating_point):
        raise DrafterFileError(f"drafter file {path}: tensors {wrong} are not floating point")
    state = {k: v.float() for k, v in weights.items()}
    try:  # the shapes alone (meta tensors): a config claiming huge sizes allocates nothing
        with torch.device("meta"):
            expected = FeatureDrafter(config).state_dict()
    except (ValueError, TypeError, RuntimeError) as e:
        raise DrafterFileError(f"drafter file {path}: its config cannot build a drafter: {e}") from None
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
        raise DrafterFileError(f"drafter file {path}: its tensors do not match its config")
    # A NaN or inf weight (a diverged training, a corrupted file) drafts noise at a full draft's cost
    if not_finite := sorted(k for k, v in state.items() if not bool(torch.isfinite(v).all())):
        raise DrafterFileError(f"drafter file {path}: tensors {not_finite} hold NaN or infinite weights")
    return DrafterFile(config, state, vocab, fingerprint, training)
