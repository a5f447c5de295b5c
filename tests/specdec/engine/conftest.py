from __future__ import annotations

import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model

MAX_CONTEXT = 1024


@pytest.fixture(scope="session")
def bf16_model(default_model_dir):
    return load_model(default_model_dir, "bf16", max_positions=MAX_CONTEXT, is_shared=False)


@pytest.fixture()
def engine(fp32_model):
    return Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), MAX_CONTEXT)


@pytest.fixture(scope="session")
def transformers_reference_dir(default_gguf_path, tmp_path_factory):
    """The default GGUF as loaded by transformers' own GGUF reader, saved as a safetensors directory:
    an independent path to the same weights (and the outside oracle's model)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("transformers_reference")
    hf = AutoModelForCausalLM.from_pretrained(
        default_gguf_path.parent, gguf_file=default_gguf_path.name, dtype=torch.float32
    )
    state = {
        k: v.contiguous()
        for k, v in hf.state_dict().items()
        if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)
    }
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    hf.config.quantization_config = None
    hf.config.to_json_file(out / "config.json")
    return out
