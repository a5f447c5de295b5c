"""bench.scenarios: json runs with and without its schema; which requests are constrained."""

from __future__ import annotations

from bench.prompts import BenchPrompt
from bench.scenarios import is_constrained, prompt_file, run_scenarios


def test_json_expands_to_both_variants_unless_no_schema():
    assert run_scenarios(("code", "json", "prose"), is_schema=True) == ("code", "json", "json_noschema", "prose")
    assert run_scenarios(("code", "json"), is_schema=False) == ("code", "json_noschema")


def test_prompt_file_of_each_scenario():
    assert [prompt_file(s) for s in ("json", "json_noschema", "code")] == ["json", "json", "code"]


def test_only_the_json_scenario_sends_a_schema():
    row = BenchPrompt("j0", "json", "p", None, {"type": "object"}, False)
    assert is_constrained("json", row)
    assert not is_constrained("json_noschema", row)
    assert not is_constrained("json", BenchPrompt("j1", "json", "p", None, None, False))
