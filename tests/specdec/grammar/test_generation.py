"""Constrained greedy decoding with the real default model: plain decoding through the engine,
the grammar's mask applied with `apply_token_mask`; the output must parse and validate against
its schema (checked by `jsonschema`, independently of the grammar engine)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.grammar import apply_token_mask

pytestmark = pytest.mark.slow

PROMPTS_FILE = Path(__file__).resolve().parents[3] / "bench" / "data" / "json.jsonl"
# Three schemas of data/prompts/json.jsonl whose greedy answers fit MAX_NEW_TOKENS: an enum, two
# required strings, an array of strings.
PROMPT_IDS = ("bfcl-live_simple_10-3-6", "bfcl-live_simple_21-4-1", "bfcl-simple_python_149")
MAX_NEW_TOKENS = 40
INSTRUCTION = "Answer with JSON only. "


MAX_CONTEXT = 1024


@pytest.fixture(scope="module")
def prompt_rows():
    if not PROMPTS_FILE.is_file():
        pytest.skip(f"{PROMPTS_FILE} is not on this machine")
    rows = {}
    for line in PROMPTS_FILE.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            row = json.loads(line)
            rows[row["id"]] = row
    return [rows[i] for i in PROMPT_IDS]


def constrained_greedy(engine: Engine, prompt_ids: list[int], state, max_new_tokens: int) -> list[int]:
    """Plain decoding, one token a step, each step's logits masked by the grammar."""
    request_id = "constrained"
    engine.open(request_id, prompt_ids)
    try:
        engine.prefill(request_id)
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = engine.verify(request_id, (), ())  # [1, V]
            token = int(torch.argmax(apply_token_mask(logits, state.allowed_mask().to_bool()), dim=-1)[0])
            assert state.accept_tokens([token])
            if state.is_terminated:
                break
            out.append(token)
            engine.commit(request_id, (), (token,))
        return out
    finally:
        engine.release(request_id)


def test_constrained_greedy_output_validates_against_its_schema(
    fp32_model, grammar_cache, tokenizer, prompt_rows, one_thread
):
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), MAX_CONTEXT)
    for row in prompt_rows:
        grammar = grammar_cache.compile_response_format("json_schema", json.dumps(row["schema"]))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION + row["prompt"]}])
        state = grammar.new_state()
        out = constrained_greedy(engine, tokenizer.encode(prompt), state, MAX_NEW_TOKENS)
        text = tokenizer.decode(out)
        assert state.is_terminated, f"{row['id']}: no end within {MAX_NEW_TOKENS} tokens: {text!r}"
        jsonschema.validate(json.loads(text), row["schema"])
