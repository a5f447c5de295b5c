"""bench.measure: the order of a stack's requests, warm-ups included."""

from __future__ import annotations

import pytest

from bench import measure
from bench.prompts import BenchPrompt
from bench.report import BASELINE, SPECULATIVE, Record
from bench.suite import Selection

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


def _prompt(scenario: str, schema: dict | None) -> BenchPrompt:
    return BenchPrompt(f"{scenario}-0", scenario, "Hi.", None, schema, False)


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, str, int, bool]]:
    """Each run_request measure_stack makes: (prompt id, system, max_new_tokens, constrained)."""
    made: list[tuple[str, str, int, bool]] = []

    def run_request(sut, prompt, scenario, system, max_new_tokens, is_constrained, tokenizer):
        made.append((prompt.id, system, max_new_tokens, is_constrained))
        return Record(system, scenario, prompt.id, 3, (1, 2), "x", 0.01)

    monkeypatch.setattr(measure, "run_request", run_request)
    return made


def test_a_constrained_scenario_warms_both_systems_up_under_a_schema_first(calls):
    selections = {"json": Selection((_prompt("json", SCHEMA),), 0)}
    records = measure.measure_stack(None, selections, {"json": 16}, None, "int4")

    warm_ups = [c for c in calls if c[0].startswith("warmup")]
    assert calls[: len(warm_ups)] == warm_ups  # every warm-up before the first measured request
    assert {(system, c) for _, system, _, c in warm_ups} == {
        (BASELINE, False),
        (SPECULATIVE, False),
        (BASELINE, True),
        (SPECULATIVE, True),
    }
    assert measure.WARMUP_JSON_PROMPT.schema is not None
    assert [r.prompt_id for r in records] == ["json-0", "json-0"]  # warm-ups are not recorded
    assert calls[len(warm_ups) :] == [
        ("json-0", BASELINE, measure.NUM_PRIMING_TOKENS, True),
        ("json-0", SPECULATIVE, 16, True),
        ("json-0", BASELINE, 16, True),
    ]


@pytest.mark.parametrize("scenario, schema", [("prose", None), ("json_noschema", SCHEMA)])
def test_no_schema_warm_up_where_no_request_is_constrained(calls, scenario, schema):
    measure.measure_stack(None, {scenario: Selection((_prompt(scenario, schema),), 0)}, {scenario: 8}, None, "int4")
    assert not any(c[3] for c in calls)
    assert [c[0] for c in calls[:2]] == ["warmup", "warmup"]
