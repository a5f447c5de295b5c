"""bench.suite: prompt selection within the sequence budget, flags, the json variants, and
bench.peers.cut_at_eos."""

from __future__ import annotations

import json

import pytest

from bench.peers import cut_at_eos
from bench.prompts import BenchPrompt
from bench.suite import (
    SuiteConfig,
    choose_prompts,
    describe_selection,
    interleave,
    parse_config,
    select_long,
    select_prompts,
)


def prompts(n: int, scenario: str = "code") -> list[BenchPrompt]:
    return [BenchPrompt(f"{scenario}{i}", scenario, f"p{i}", None, None, False) for i in range(n)]


def test_select_prompts_skips_and_counts_too_long_ones():
    rows = prompts(4)
    counts = {"code0": 10, "code1": 50, "code2": 20, "code3": 30}
    s = select_prompts(rows, lambda p: counts[p.id], num_prompts=2, max_new_tokens=8, sequence_length=32)
    assert [p.id for p in s.prompts] == ["code0", "code2"]
    assert s.num_skipped == 1  # code3 (too long as well) is never examined


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
    c = parse_config(
        [
            "--scenarios",
            "code,prose",
            "--precision",
            "fp32,bf16",
            "--peers",
            "",
            "--no-schema",
            "--concurrency",
            "1,4",
            "--num-prompts",
            "2",
        ]
    )
    assert c.scenarios == ("code", "prose") and c.precisions == ("fp32", "bf16") and c.peers == ()
    assert c.concurrency == (1, 4) and not c.is_schema and c.num_prompts == 2
    assert parse_config([]).concurrency == ()


def test_json_runs_with_and_without_its_schema_by_default():
    assert parse_config(["--scenarios", "json,code"]).measured_scenarios == ("json", "json_noschema", "code")
    assert parse_config(["--scenarios", "json", "--no-schema"]).measured_scenarios == ("json_noschema",)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"scenarios": ("poetry",)},
        {"scenarios": ("json_noschema",)},
        {"precisions": ("int3",)},
        {"peers": ("vllm",)},
        {"max_new_tokens": 2048},
        {"concurrency": (0,)},
        {"num_prompts": 0},
    ],
)
def test_config_refuses_bad_values(kwargs):
    with pytest.raises(ValueError):
        SuiteConfig(**kwargs)


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 2, 7], eos_token_ids=(2,), max_new_tokens=10) == [5, 6]
    assert cut_at_eos([5, 6, 7], eos_token_ids=(2,), max_new_tokens=2) == [5, 6]


class WordTokenizer:
    """One token per word; the chat template joins the messages' contents."""

    def encode(self, text: str) -> list[str]:
        return text.split()

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return " ".join(m["content"] for m in messages)


def test_choose_prompts_gives_both_json_variants_the_same_rows(tmp_path):
    rows = [{"id": f"j{i}", "prompt": "w " * n, "schema": {"type": "object"}} for i, n in enumerate((3, 30, 4))]
    (tmp_path / "json.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = SuiteConfig(data_dir=tmp_path, scenarios=("json",), num_prompts=2, max_new_tokens=8, sequence_length=16)
    selections, sweep = choose_prompts(config, WordTokenizer())
    assert list(selections) == ["json", "json_noschema"]
    assert selections["json"] is selections["json_noschema"]
    assert [p.id for p in selections["json"].prompts] == ["j0", "j2"] and selections["json"].num_skipped == 1
    assert sweep == []


def test_first_prompt_passes_over_the_first_rows_of_each_file(tmp_path):
    rows = [{"id": f"c{i}", "prompt": "w " * 3} for i in range(5)]
    (tmp_path / "code.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    config = SuiteConfig(data_dir=tmp_path, scenarios=("code",), num_prompts=2, first_prompt=3)
    selections, _ = choose_prompts(config, WordTokenizer())
    assert [p.id for p in selections["code"].prompts] == ["c3", "c4"]
    with pytest.raises(ValueError, match="first-prompt"):
        SuiteConfig(first_prompt=-1)


def test_select_long_keeps_the_window_round_robin_and_counts_every_row():
    a, b = prompts(3, "prose"), prompts(2, "code")
    counts = {"prose0": 1499, "prose1": 1500, "prose2": 1700, "code0": 1900, "code1": 1901}
    s = select_long([a, b], lambda p: counts[p.id], num_prompts=2)
    assert [p.id for p in s.prompts] == ["prose1", "code0"]  # bounds inclusive; one file, then the next
    assert (s.num_considered, s.num_in_window, s.num_skipped) == (5, 3, 2)


def test_long_reads_the_source_files_present_and_stays_out_of_the_sweep(tmp_path):
    def write(name: str, lengths: tuple[int, ...]) -> None:
        rows = [{"id": f"{name}{i}", "prompt": "w " * n} for i, n in enumerate(lengths)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    write("prose", (10, 1600, 1800))
    write("code", (2000, 12, 1550, 20))  # no specbench.jsonl: long draws on what is there
    config = SuiteConfig(data_dir=tmp_path, scenarios=("code", "long"), num_prompts=2, concurrency=(1,))
    selections, sweep = choose_prompts(config, WordTokenizer())
    long = selections["long"]
    assert [p.id for p in long.prompts] == ["prose1", "code2"]
    assert (long.num_considered, long.num_in_window) == (7, 3)
    assert selections["code"].num_considered is None
    assert [p.id for p in sweep] == ["code3"]  # the sweep takes code's rows after its own, never long's
    assert "of 7 rows of prose, code, 3 have 1500-1900 prompt tokens" in describe_selection(long, tmp_path)


def test_long_asks_for_256_tokens_and_a_context_that_holds_them_unless_told():
    c = parse_config(["--scenarios", "code,long"])
    assert (c.new_tokens("code"), c.new_tokens("long")) == (128, 256)
    assert c.max_context_tokens == 1900 + 256  # beyond --sequence-length 2048
    c = parse_config(["--scenarios", "long", "--max-new-tokens", "8"])
    assert (c.new_tokens("long"), c.max_context_tokens) == (8, 2048)
    assert parse_config(["--scenarios", "code"]).max_context_tokens == 2048
