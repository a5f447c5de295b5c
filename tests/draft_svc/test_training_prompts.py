"""The feature drafter's training prompts (draft_svc/heads/data.py, composed.py): reproducible, every
source in its share, tool schemas valid, and none of them a benchmark row."""

from __future__ import annotations

import collections
import json
import random

import jsonschema
import pytest

from bench.prompts import DEFAULT_DATA_DIR
from draft_svc.heads import composed, data


@pytest.fixture(scope="module")
def prompts() -> list[data.TrainingPrompt]:
    return data.training_prompts(0, num_prompts=3000)


def test_the_same_seed_gives_the_same_prompts_and_another_seed_other_ones(prompts):
    assert data.training_prompts(0, num_prompts=3000) == prompts
    assert data.training_prompts(1, num_prompts=3000) != prompts


def test_every_source_is_named_with_its_licence_and_drawn_in_its_share(prompts):
    assert set(data.DEFAULT_SHARES) == set(data.SOURCES)
    assert all("licen" in description.lower() for description in data.SOURCES.values())
    assert sum(data.DEFAULT_SHARES.values()) == pytest.approx(1.0)
    counts = collections.Counter(p.source for p in prompts)
    assert counts == {source: round(share * 3000) for source, share in data.DEFAULT_SHARES.items()}


def test_an_unknown_source_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown training prompt sources \\['benchmark'\\]"):
        data.training_prompts(0, {"benchmark": 1.0}, 10)


def test_composed_requests_are_distinct_and_tool_calls_carry_valid_schemas(prompts):
    for source in ("programming", "concepts", "everyday", "multilingual", "tool-calls"):
        texts = [p.text for p in prompts if p.source == source]
        assert texts and all(t.strip() and "{" not in t for t in texts), source  # every slot filled
    tool_calls = [p for p in prompts if p.source == "tool-calls"]
    assert all(p.schema is not None and not p.is_completion for p in tool_calls)
    for schema in {p.schema for p in tool_calls}:
        assert schema is not None
        jsonschema.Draft7Validator.check_schema(json.loads(schema))
    assert len(composed.tool_requests(random.Random(0))) >= 8 * len(composed.TOOLS)
    assert {language for language, _, _ in composed.MULTILINGUAL} >= {"Spanish", "French", "Czech", "Vietnamese"}


def test_no_training_prompt_is_a_benchmark_prompt(prompts):
    bench_prompts = set()
    for path in sorted(DEFAULT_DATA_DIR.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                bench_prompts.add(json.loads(line)["prompt"].strip())
    assert bench_prompts
    assert not {p.text.strip() for p in prompts} & bench_prompts
