"""bench.engine: the long curve's context budget and the prefill measurement's shape on the real model."""

from __future__ import annotations

import pytest

from bench.engine import LONG_CONTEXT_TOKENS, VERIFY_SIZES, engine_max_context, prefill_rate
from primary_svc.costs import measure_verify_costs
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache


def test_engine_max_context_holds_the_long_curves_commits_and_largest_tree():
    # 2048 of context, 1 warm-up commit, 7 sizes x (1 + 2 x 5) commits, a 64-node tree
    assert engine_max_context(5) == 2048 + 1 + 77 + 64
    assert engine_max_context(1) - LONG_CONTEXT_TOKENS == 1 + len(VERIFY_SIZES) * 3 + max(VERIFY_SIZES)


def test_a_curve_fits_the_context_engine_max_context_gives_it(fp32_model):
    # the same budget at a small scale (the fixture has 1024 positions): after 64 tokens, sizes 1 and 8
    sizes = (1, 8)
    max_context = engine_max_context(1, 64, sizes)
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, fp32_model.model.kv_dtype), max_context)
    assert set(measure_verify_costs(engine, 1, sizes, 64)) == set(sizes)
    short = Engine(fp32_model.model, KVCache(fp32_model.config, fp32_model.model.kv_dtype), max_context - 1)
    with pytest.raises(ValueError, match=f"needs a max_context of {max_context}, the engine holds {max_context - 1}"):
        measure_verify_costs(short, 1, sizes, 64)  # said before it starts, not a tree error midway


def test_prefill_rate_times_one_prompt_alone_and_leaves_the_engine_empty(fp32_model):
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, fp32_model.model.kv_dtype), 128)
    out = prefill_rate(engine, 40, repeats=2)
    assert out["num_tokens"] == 40 and out["num_prefilled"] == 39  # the pending token waits for the first verify
    assert out["chunk_tokens"] == engine.prefill_chunk_tokens
    assert out["ms"] > 0 and out["tokens_per_s"] == pytest.approx(39 / (out["ms"] / 1000))
    assert engine.num_active_requests == 0
