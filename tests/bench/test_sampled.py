"""bench sampled's per-scenario row: medians, speedup, tokens per step, the share the runs drafted,
and the count of seeded pairs whose tokens agree."""

from __future__ import annotations

import json

from bench.sampled import RUN_DRAFTS, Answer, fitting_prompts, scenario_row
from specdec.v1 import gateway_pb2


def answer(num_tokens: int, seconds: float, num_steps: int, run_accepted: int = 0, first: int = 0) -> Answer:
    stats = gateway_pb2.GenerationStats(num_steps=num_steps)
    copies, answers = RUN_DRAFTS  # the runs' drafts: their copies' and the model's answers' rows
    stats.decoders.add(name=copies, num_proposed=run_accepted + 1, num_accepted=run_accepted - run_accepted // 4)
    stats.decoders.add(name=answers, num_proposed=run_accepted + 1, num_accepted=run_accepted // 4)
    stats.decoders.add(name="suffix_index", num_proposed=5, num_accepted=3)  # not the runs'
    return Answer(tuple(range(first, first + num_tokens)), seconds, stats)


def test_a_scenario_row_takes_medians_and_counts_the_same_answers():
    pairs = [
        {"plain": answer(100, 1.0, 100), "speculative": answer(100, 0.5, 50, run_accepted=40)},
        {"plain": answer(50, 1.0, 50), "speculative": answer(50, 0.5, 25, run_accepted=20, first=1)},
        {"plain": answer(80, 1.0, 80), "speculative": answer(80, 1.0, 80)},
    ]
    row = scenario_row("prose", pairs)
    assert row["plain_tok_s"] == 80.0 and row["speculative_tok_s"] == 100.0 and row["speedup"] == 1.25
    assert row["tokens_per_step"] == round(230 / 155, 2)
    assert row["run_drafted_share"] == round(60 / 230, 3)
    assert row["same"] == "2/3"  # the second pair's tokens differ


def test_rows_too_long_for_the_stacks_context_are_passed_over(tmp_path):
    """A row whose prompt and answer do not fit the stack's context would be refused (INVALID_ARGUMENT)
    and end the run: the bench chooses the first rows that fit, as the suite does, and counts the rest."""
    rows = [{"id": f"r{i}", "prompt": "word " * n} for i, n in enumerate((10, 3000, 20, 30))]
    (tmp_path / "prose.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    selection = fitting_prompts(tmp_path, "prose", 2, 128, lambda p: len(p.prompt.split()))
    assert [p.id for p in selection.prompts] == ["r0", "r2"] and selection.num_skipped == 1


def test_both_systems_find_the_prompt_in_the_prefix_cache():
    """The plain answer, asked first, would pay the prompt's prefill and leave it cached for the
    speculative one: a two-token request with speculation off reaches the stack before either."""
    from types import SimpleNamespace

    from bench.prompts import BenchPrompt
    from bench.sampled import answer_prompt
    from specdec.v1 import common_pb2

    sent = []

    class Stub:
        def Generate(self, req, timeout):
            sent.append((req.speculation.HasField("is_enabled") and not req.speculation.is_enabled, req.max_new_tokens))
            return gateway_pb2.GenerateResponse(token_ids=[1, 2])

    prompt = BenchPrompt("p", "prose", "Tell me a story.", None, None, True)
    seeds = [common_pb2.SamplingParams(temperature=0.7, seed=s) for s in (1, 2)]
    pairs = answer_prompt(SimpleNamespace(stub=Stub()), prompt, seeds, 64)
    assert [sorted(p) for p in pairs] == [["plain", "speculative"]] * 2
    assert sent == [(True, 2), (True, 64), (False, 64), (True, 64), (False, 64)]


def test_the_warm_up_asks_no_measured_prompt():
    """The speculative warm-up's answer is kept by the primary as a learned answer of the tenant: on a
    measured prompt, that prompt's measured answers would draft from it."""
    from types import SimpleNamespace

    from bench.measure import WARMUP_PROMPT
    from bench.sampled import warm_up

    sent = []

    class Stub:
        def Generate(self, req, timeout):
            sent.append((req.chat.messages[-1].content, req.speculation.HasField("is_enabled")))
            return gateway_pb2.GenerateResponse(token_ids=[1])

    warm_up(SimpleNamespace(stub=Stub()), 0.7)
    assert sent == [(WARMUP_PROMPT.prompt, True), (WARMUP_PROMPT.prompt, False)]


def test_a_scenario_without_answers_has_a_row_of_no_figures():
    """A scenario none of whose rows fit the context has no pairs: its row says so, rather than a
    median of nothing ending the run before any row is printed."""
    row = scenario_row("code", [])
    assert row["answers"] == 0 and row["plain_tok_s"] is None and row["speedup"] is None and row["same"] == "0/0"
