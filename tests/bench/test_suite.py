"""bench.suite: prompt selection within the sequence budget, flags, and bench.peers.cut_at_eos."""
from __future__ import annotations

import pytest

from bench.peers import cut_at_eos
from bench.prompts import BenchPrompt
from bench.suite import SuiteConfig, interleave, parse_config, select_prompts


def prompts(n: int, scenario: str = "code") -> list[BenchPrompt]:
    return [BenchPrompt(f"{scenario}{i}", scenario, f"p{i}", None, None, False) for i in range(n)]


def test_select_prompts_skips_and_counts_too_long_ones():
    rows = prompts(4)
    counts = {"code0": 10, "code1": 50, "code2": 20, "code3": 30}
    s = select_prompts(rows, lambda p: counts[p.id], num_prompts=2, max_new_tokens=8, sequence_length=32)
    assert [p.id for p in s.prompts] == ["code0", "code2"]
    assert s.num_skipped == 1   # code3 (too long as well) is never examined


def test_select_prompts_budget_is_inclusive_and_may_run_out():
    rows = prompts(3)
    s = select_prompts(rows, lambda p: 24, num_prompts=5, max_new_tokens=8, sequence_length=32)
    assert len(s.prompts) == 3 and s.num_skipped == 0
    s = select_prompts(rows, lambda p: 25, num_prompts=5, max_new_tokens=8, sequence_length=32)
    assert s.prompts == () and s.num_skipped == 3


def test_interleave_round_robin():
    a, b = prompts(2, "a"), prompts(1, "b")
    assert [p.id for p in interleave([a, b])] == ["a0", "b0", "a1"]


def test_parse_config_lists_and_defaults():
    c = parse_config(["--scenarios", "code,prose", "--precision", "fp32,bf16", "--peers", "", "--no-schema",
                      "--concurrency", "1,4", "--num-prompts", "2"])
    assert c.scenarios == ("code", "prose") and c.precisions == ("fp32", "bf16") and c.peers == ()
    assert c.concurrency == (1, 4) and not c.is_schema and c.num_prompts == 2
    assert parse_config([]).concurrency == ()


@pytest.mark.parametrize("kwargs", [{"scenarios": ("poetry",)}, {"precisions": ("int4",)}, {"peers": ("vllm",)},
                                    {"max_new_tokens": 2048}, {"concurrency": (0,)}, {"num_prompts": 0}])
def test_config_refuses_bad_values(kwargs):
    with pytest.raises(ValueError):
        SuiteConfig(**kwargs)


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 2, 7], eos_token_ids=(2,), max_new_tokens=10) == [5, 6]
    assert cut_at_eos([5, 6, 7], eos_token_ids=(2,), max_new_tokens=2) == [5, 6]
