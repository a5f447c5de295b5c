"""bench.drafts' pure parts: the mixes it compares, a fixed mix's degree, and one mix's figures."""

from __future__ import annotations

import pytest

from bench.drafts import degree_of, mix_figures, parse_mixes


def test_mixes_parse_and_strategies_is_the_one_mix():
    assert parse_mixes("prompt_lookup,suffix_index;feature", None) == {
        "prompt_lookup,suffix_index": ["prompt_lookup", "suffix_index"],
        "feature": ["feature"],
    }
    assert parse_mixes("feature", "prompt_lookup") == {"prompt_lookup": ["prompt_lookup"]}
    with pytest.raises(ValueError, match="unknown"):
        parse_mixes("nope", None)


def test_a_fixed_tree_mix_gives_its_leaves_and_any_other_mix_one_candidate_a_decoder():
    assert degree_of(["feature"], 4) == 4
    assert degree_of(["prompt_lookup", "feature"], 4) == 2
    assert degree_of(["prompt_lookup", "suffix_index"], 4) == 2


def stats(steps: int, plain_steps: int, generated: int, draft_ms: float) -> dict:
    """bench.stack.stats_dict's shape, what mix_figures reads."""
    return {
        "num_steps": steps,
        "num_steps_by_draft_length": [plain_steps, 0, 0, 0, steps - plain_steps],
        "num_generated_tokens": generated,
        "num_step_tokens": generated,
        "num_proposed": 8,
        "num_accepted": 4,
        "stage_ms": {"draft": draft_ms},
        "entropy_bins": [{"lower": 0.0, "upper": 1.0, "num_proposed": 3, "num_accepted": 2}],
        "decoders": {
            "feature": {
                "num_proposed": 8,
                "num_accepted": 4,
                "time_ms": 2.0,
                "num_steps": steps - plain_steps,
                "num_tested_by_depth": [2, 1],
                "num_accepted_by_depth": [1, 1],
            }
        },
    }


def test_a_mixs_figures_are_per_speculative_step_over_its_prompts():
    m = mix_figures([stats(5, 1, 10, 8.0), stats(4, 2, 6, 4.0)], [30.0, 20.0], 20.0, 2)
    assert m["speedup"] == pytest.approx(1.25)  # median 25 over the plain median 20
    assert m["mean_accepted_length"] == pytest.approx(16 / 9)
    assert m["speculative_steps"] == 6 and m["draft_ms_per_step"] == pytest.approx(2.0)
    assert m["decoders"]["feature"]["acceptance_by_depth"] == [0.5, 1.0]
    assert m["decoders"]["feature"]["draft_ms_per_step"] == pytest.approx(4.0 / 6)
    assert m["entropy_bins"]["[0, 1)"] == {"decisions": 6, "accepted": 4, "acceptance_rate": pytest.approx(4 / 6)}
    assert m["identical_outputs"] == 2


def test_the_plain_run_and_the_mixes_find_the_prompt_in_the_prefix_cache():
    """The plain run, asked first, would pay the prompt's prefill and leave it cached for the mixes: a
    two-token request with speculation off reaches the stack before either, and is not measured."""
    from bench.prompts import BenchPrompt
    from bench.drafts import measure_scenario
    from specdec.v1 import gateway_pb2

    sent = []

    class Stub:
        def Generate(self, req, timeout):
            sent.append((req.speculation.is_enabled, req.max_new_tokens))
            tokens_per_second = 10.0 if req.max_new_tokens == 2 else 50.0
            return gateway_pb2.GenerateResponse(
                token_ids=[1, 2], stats=gateway_pb2.GenerationStats(num_steps=1, tokens_per_second=tokens_per_second)
            )

    prompt = BenchPrompt("p", "prose", "Tell me a story.", None, None, True)
    r = measure_scenario(Stub(), [prompt], {"prompt_lookup": ["prompt_lookup"]}, 64, False)
    assert sent == [(False, 2), (False, 64), (True, 64)]
    assert r["plain_tokens_per_s"] == 50.0


def test_a_mixs_stack_answers_a_warm_up_prompt_before_the_measured_ones():
    """A stack's first speculative request pays one-time costs (the draft pool's first Propose, the
    first tree's verify): a short prompt that is not measured goes first, plain and with the mix, and
    no figure counts it."""
    import argparse

    from bench.drafts import measure_mix
    from bench.measure import WARMUP_PROMPT
    from bench.prompts import BenchPrompt
    from specdec.v1 import gateway_pb2

    sent = []

    class Stub:
        def Generate(self, req, timeout):
            content = req.chat.messages[-1].content if req.chat.messages else req.prompt
            sent.append((content, req.speculation.is_enabled, list(req.speculation.strategies), req.max_new_tokens))
            tokens_per_second = 1.0 if content == WARMUP_PROMPT.prompt else 50.0
            return gateway_pb2.GenerateResponse(
                token_ids=[1, 2], stats=gateway_pb2.GenerationStats(num_steps=1, tokens_per_second=tokens_per_second)
            )

    prompt = BenchPrompt("p", "prose", "Tell me a story.", None, None, True)
    args = argparse.Namespace(adaptive=False, tree_leaves=4, max_new_tokens=64)
    out = measure_mix(Stub(), "prompt_lookup", ["prompt_lookup"], [prompt], ["prose"], args)
    warm = [(WARMUP_PROMPT.prompt, False, [], 8), (WARMUP_PROMPT.prompt, True, ["prompt_lookup"], 8)]
    assert sent[:2] == warm
    assert all(content != WARMUP_PROMPT.prompt for content, *_ in sent[2:])
    assert [(s[1], s[3]) for s in sent[2:]] == [(False, 2), (False, 64), (True, 64)]
    assert out["prose"]["plain_tokens_per_s"] == 50.0 and out["prose"]["speculative_tokens_per_s"] == 50.0
