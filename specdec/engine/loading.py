"""Build a runnable model from a model directory or from a peer's shared-weight manifest."""

from __future__ import annotations

import dataclasses
import json

import torch

from specdec.model.config import ModelConfig
from specdec.model.gguf_blocks import load_q4_blocks
from specdec.model.layout import ModelWeights
from specdec.model.llama import Transformer
from specdec.model.loader import load_config, load_state_dict
from specdec.model.precision import convert_weights, weight_bytes
from specdec.weights.shared import SharedWeights, WeightManifest, attach


@dataclasses.dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    model: Transformer
    precision: str
    weight_bytes: int
    shared: SharedWeights | None  # set when the weights live in an exportable segment


def load_model(
    model_dir,
    precision: str = "fp32",
    max_positions: int | None = None,
    device: str = "cpu",
    is_shared: bool = True,
    instance_id: str | None = None,
    min_gemm_rows: int = 1,
) -> LoadedModel:
    """Load HF-format weights, convert them to `precision`, optionally move them into shared memory.

    int4 serves a GGUF's own Q4 blocks where the directory holds them (`gguf_blocks.py`).
    With `is_shared`, the converted tensors are copied once into one exportable segment and the
    model runs on views of it; the private copies are dropped, so the process holds one copy.
    """
    config = load_config(model_dir)
    q4_blocks = load_q4_blocks(model_dir) if precision == "int4" else None
    weights = convert_weights(load_state_dict(model_dir), config, precision, q4_blocks, device)
    shared = None
    if is_shared:
        shared = SharedWeights.create(
            weights, device=device, instance_id=instance_id, matrices=weights.matrices.values()
        )
        weights = shared.model_weights()
    elif device != "cpu":
        weights = ModelWeights({k: v.to(device) for k, v in weights.items()}, weights.matrices.values())
    model = Transformer(config, weights, max_positions or config.max_position_embeddings, min_gemm_rows)
    return LoadedModel(config, model, precision, weight_bytes(weights), shared)


def model_from_manifest(manifest: WeightManifest, config: ModelConfig, max_positions: int) -> Transformer:
    """The same model over a peer's weights, mapped without copying (see `specdec.weights.shared`);
    its layers are built as the manifest's matrix layouts say."""
    return Transformer(config, attach(manifest), max_positions)


def config_to_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> ModelConfig:
    fields = json.loads(text)
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
    return ModelConfig(**fields)


def set_num_threads(num_threads: int) -> None:
    if num_threads > 0:
        torch.set_num_threads(num_threads)
