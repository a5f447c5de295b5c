"""Outside oracles: transformers' own GGUF reader and its greedy `generate`."""

from __future__ import annotations

import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.model.tokenizer import Tokenizer
from specdec.sampling import SamplingParams

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Give me three facts about the moon as a JSON list."}],
]


def test_gguf_and_safetensors_loads_give_the_same_logits(fp32_model, transformers_reference_dir):
    other = load_model(transformers_reference_dir, "fp32", max_positions=256, is_shared=False)
    tokens = [1, 504, 3458, 282, 260, 2114, 314]
    logits = []
    for loaded in (fp32_model, other):
        engine = Engine(loaded.model, KVCache(loaded.config, torch.float32), 256)
        engine.open("a", tokens)
        logits.append(engine.verify("a", [700, 701], [-1, 0]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def test_fp32_greedy_equals_transformers_generate(engine, default_model_dir, transformers_reference_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(transformers_reference_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_dir(default_model_dir)
    for messages in PROMPTS:
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages))
        ours = engine.generate(prompt_ids, 32, SamplingParams())
        with torch.inference_mode():
            theirs = hf.generate(
                torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt_ids) :].tolist()
        assert ours == theirs, (tokenizer.decode(ours), tokenizer.decode(theirs))
