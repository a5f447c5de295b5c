"""bench.drafter: the shipped feature drafter replayed on one real prompt at int4, and how a chain's
accepted drafts are counted."""

from __future__ import annotations

import pytest

from bench.drafter import Replay, replay, speculate, summarize
from draft_svc.config import DEFAULT_FEATURE_DRAFTER
from draft_svc.strategies.feature import FeatureDrafterSource, FeatureTreeConfig
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.model.tokenizer import Tokenizer
from specdec.sampling import SamplingParams


def test_a_chain_counts_the_drafts_the_next_tokens_confirm_in_a_row():
    r = Replay(chains=[[5, 6, 9], [6, 7], [], [1]], tokens=[5, 6, 7, 8])
    assert [r.accepted(i) for i in range(4)] == [2, 2, 0, 0]  # chain 0 stops at 9 != 7; step 3: 1 != 8
    r.observe_s, r.propose_s = [0.001] * 4, [0.002] * 4
    row = summarize([r], 3)
    # depth 2 over the steps with 2 tokens left (0, 1, 2), depth 3 over those with 3 (0, 1)
    assert row["steps"] == 4 and row["hit_by_depth"] == [0.5, 0.6667, 0.0] and row["drafts_per_step"] == 1.167
    assert row["observe_ms"] == 1.0 and row["propose_ms"] == 2.0


def test_a_depth_counts_only_the_steps_that_had_that_many_tokens_left():
    """A drafter right every time hits at every depth: the replay's last steps, with fewer tokens left
    than the depth, cannot show a deep hit and are no misses (they were: 1.0 / 0.75 / 0.5 here)."""
    tokens = [10, 11, 12, 13]
    r = Replay(chains=[tokens[i : i + 3] + [99] * (i + 3 - len(tokens)) for i in range(4)], tokens=tokens)
    assert [r.accepted(i) for i in range(4)] == [3, 3, 2, 1]
    row = summarize([r, Replay(chains=[[7, 8, 9]], tokens=[5])], 3)  # a one-step replay: a miss at depth 1 only
    assert row["steps"] == 5 and row["hit_by_depth"] == [0.8, 1.0, 1.0] and row["drafts_per_step"] == 2.8


@pytest.fixture(scope="module")
def setup(default_model_dir):
    if not DEFAULT_FEATURE_DRAFTER.exists():
        pytest.skip(f"no shipped drafter file at {DEFAULT_FEATURE_DRAFTER}")
    loaded = load_model(default_model_dir, "int4", max_positions=256, is_shared=False)
    engine = Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), 256)
    tokenizer = Tokenizer.from_dir(default_model_dir)
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 20."}]))
    source = FeatureDrafterSource(DEFAULT_FEATURE_DRAFTER, FeatureTreeConfig(top_k=1, beam=1))
    return engine, (lambda: source.create(model=loaded.model)), ids


def test_a_scenario_without_prompts_has_no_steps_and_no_times():
    """No prompt fit (or none past --first-prompt): a row of nothing, not a median of nothing that
    ends the run before the other scenarios."""
    row = summarize([], 3)
    assert row["steps"] == 0 and row["hit_by_depth"] == [0.0] * 3
    assert row["observe_ms"] is None and row["propose_ms"] is None


def test_the_shipped_drafter_follows_greedy_decoding_of_a_real_prompt(setup):
    engine, new_decoder, ids = setup
    r = replay(engine, new_decoder(), ids, 12, 2)
    assert len(r.tokens) == len(r.chains) == 12 and engine.num_active_requests == 0
    assert all(len(chain) == 2 for chain in r.chains)  # current after every step: a full chain each time
    assert r.tokens == engine.generate(ids, 12, SamplingParams())  # the replay is plain greedy decoding
    row = summarize([r], 2)
    assert row["hit_by_depth"][0] >= row["hit_by_depth"][1] and row["drafts_per_step"] > 0  # counting, not quality


def test_speculating_with_the_drafters_chains_keeps_plain_decodings_tokens_in_fewer_steps(setup):
    engine, new_decoder, ids = setup
    plain = speculate(engine, None, ids, 16, 0)
    assert plain.steps == 16 and plain.tokens == engine.generate(ids, 16, SamplingParams())
    for depth in (1, 3):
        chained = speculate(engine, new_decoder(), ids, 16, depth)
        assert chained.tokens == plain.tokens  # greedy: verified drafts change nothing
        assert chained.steps < plain.steps  # counting to 20 is easy to draft
    assert engine.num_active_requests == 0
