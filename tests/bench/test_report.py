"""bench.report: aggregation of per-request records into results.json figures, on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from bench.report import (
    BASELINE,
    SPECULATIVE,
    Record,
    check_json,
    decoder_figures,
    finite,
    grammar_forced_share,
    json_figures,
    merge_entropy_bins,
    num_same,
    speculation_figures,
    speedups,
    spread,
    sum_counts,
    summarize_scenario,
)


def stats(
    total: float = 100.0,
    verify: float = 60.0,
    forward: float = 50.0,
    decoders: dict | None = None,
    proposed: int = 10,
    accepted: int = 4,
    generated: int = 12,
    forced: int = 0,
    steps: int = 6,
    bins: list | None = None,
    task_type: str = "code",
) -> dict:
    """bench.stack.stats_dict's shape."""
    return {
        "num_prompt_tokens": 5,
        "num_generated_tokens": generated,
        "num_step_tokens": generated,
        "num_steps": steps,
        "num_proposed": proposed,
        "num_accepted": accepted,
        "num_forced_tokens": forced,
        "tokens_per_second": 0.0,
        "stage_ms": {
            "draft": 5.0,
            "verify": verify,
            "forward": forward,
            "validate": 1.0,
            "commit": 1.0,
            "state": 1.0,
            "other": 0.0,
            "total": total,
        },
        "decoders": decoders or {},
        "entropy_bins": bins or [],
        "num_steps_by_degree": [1, 5],
        "num_steps_by_draft_length": [1, 0, 2, 3],
        "num_probe_steps": 1,
        "task_type": task_type,
    }


def record(
    system: str,
    prompt_id: str,
    token_ids: tuple = (1, 2, 3, 4),
    seconds: float = 1.0,
    error: str = "",
    stats_: dict | None = None,
    text: str | None = None,
) -> Record:
    return Record(
        system,
        "code",
        prompt_id,
        5,
        () if error else token_ids,
        text if text is not None else " ".join(map(str, token_ids)),
        seconds,
        error=error,
        stats=stats_,
    )


def test_spread_of_four_values():
    s = spread([4.0, 1.0, 3.0, 2.0])
    assert s == {"median": 2.5, "min": 1.0, "q1": 1.75, "q3": 3.25, "max": 4.0, "n": 4}


def test_spread_of_one_and_none():
    assert spread([7.0]) == {"median": 7.0, "min": 7.0, "q1": 7.0, "q3": 7.0, "max": 7.0, "n": 1}
    assert spread([]) is None


def test_merge_entropy_bins_sums_equal_bands_in_ascending_order():
    a = [
        {"lower": 0.5, "upper": 1.0, "num_proposed": 1, "num_accepted": 0},
        {"lower": 0.0, "upper": 0.5, "num_proposed": 4, "num_accepted": 3},
    ]
    b = [
        {"lower": 0.0, "upper": 0.5, "num_proposed": 2, "num_accepted": 1},
        {"lower": 4.0, "upper": None, "num_proposed": 0, "num_accepted": 0},
    ]
    merged = merge_entropy_bins([a, b])
    assert [(m["lower"], m["upper"], m["num_proposed"], m["num_accepted"]) for m in merged] == [
        (0.0, 0.5, 6, 4),
        (0.5, 1.0, 1, 0),
        (4.0, None, 0, 0),
    ]
    assert merged[0]["acceptance_rate"] == pytest.approx(4 / 6)
    assert merged[1]["acceptance_rate"] == 0.0
    assert merged[2]["acceptance_rate"] is None


def test_sum_counts_pads_shorter_lists():
    assert sum_counts([[1, 2], [0, 0, 5], []]) == [1, 2, 5]
    assert sum_counts([]) == []


def test_speculation_figures_sum_over_requests():
    d1 = {"prompt_lookup": {"num_proposed": 8, "num_accepted": 4, "time_ms": 1.0}}
    d2 = {
        "prompt_lookup": {"num_proposed": 2, "num_accepted": 0, "time_ms": 0.5},
        "suffix_index": {"num_proposed": 0, "num_accepted": 0, "time_ms": 0.2},
    }
    f = speculation_figures(
        [
            stats(decoders=d1, proposed=8, accepted=4, generated=10, forced=3, steps=5),
            stats(decoders=d2, proposed=2, accepted=0, generated=2, steps=2),
        ]
    )
    assert f["acceptance_rate"] == pytest.approx(0.4)
    assert f["mean_accepted_length"] == pytest.approx(12 / 7)
    assert f["decoders"]["prompt_lookup"] == {
        "num_proposed": 10,
        "num_accepted": 4,
        "time_ms": 1.5,
        "acceptance_rate": 0.4,
        # results without depths (written before they were counted): none
        "num_steps": 0,
        "num_tested_by_depth": [],
        "num_accepted_by_depth": [],
        "acceptance_by_depth": [],
        "mean_accepted_length": None,
        "draft_ms_per_step": None,
    }
    assert f["decoders"]["suffix_index"]["acceptance_rate"] is None
    assert f["num_steps_by_degree"] == [2, 10]
    assert f["num_probe_steps"] == 2
    assert f["task_types"] == ["code"]
    assert f["grammar_forced_share"] == 0.0  # 4 accepted, none by the grammar decoder
    assert f["forced_token_share"] == pytest.approx(3 / 12)  # of the generated tokens, undrafted
    assert f["outside_model_fraction"] == pytest.approx((200 - 100) / 200)
    assert f["stage_ms_per_step"]["forward"] == pytest.approx(100 / 7)


def test_grammar_forced_share_counts_every_grammar_instance():
    decoders = {"grammar": {"num_accepted": 6}, "grammar#1": {"num_accepted": 2}, "prompt_lookup": {"num_accepted": 2}}
    assert grammar_forced_share(decoders, 10) == pytest.approx(0.8)
    assert grammar_forced_share(decoders, 0) is None  # speculation off: nothing accepted, no share


def test_speedups_ratio_of_medians_and_median_of_ratios():
    # tok/s (4 tokens): a 4 vs 2, b 2 vs 1, c 1 vs 4 -> medians 2 / 2 = 1.0; per prompt [2, 2, 0.25] -> 2.0
    spec = [
        record(SPECULATIVE, "a", seconds=1.0),
        record(SPECULATIVE, "b", seconds=2.0),
        record(SPECULATIVE, "c", seconds=4.0),
        record(SPECULATIVE, "d", error="E: x"),
    ]
    base = [record(BASELINE, "a", seconds=2.0), record(BASELINE, "b", seconds=4.0), record(BASELINE, "c", seconds=1.0)]
    ratio_of_medians, per_prompt = speedups(spec, base)
    assert ratio_of_medians == pytest.approx(1.0)
    assert per_prompt["median"] == pytest.approx(2.0) and per_prompt["n"] == 3
    assert speedups(spec, [record(BASELINE, "a", error="E: x")]) == (None, None)


def test_speedups_compare_the_same_prompts():
    """A prompt that failed on one side is left out of both medians: a: 4 vs 2 tok/s, b: failed vs 1
    -> 4 / 2, not 4 over the median of 2 and 1."""
    spec = [record(SPECULATIVE, "a", seconds=1.0), record(SPECULATIVE, "b", error="E: x")]
    base = [record(BASELINE, "a", seconds=2.0), record(BASELINE, "b", seconds=4.0)]
    assert speedups(spec, base)[0] == pytest.approx(2.0)
    assert speedups(base, spec)[0] == pytest.approx(0.5)


def test_json_figures_rates():
    rows = [
        Record(BASELINE, "json", p, 5, (1,), "{}", 1.0, is_json=j, is_schema_valid=v)
        for p, j, v in (("a", True, True), ("b", True, False), ("c", False, False), ("d", True, True))
    ]
    assert json_figures(rows) == {
        "num_json": 3,
        "num_schema_valid": 2,
        "json_parse_rate": 0.75,
        "schema_validity_rate": 0.5,
    }


def test_num_same_by_token_ids_or_text():
    refs = {"a": record(BASELINE, "a", (1, 2)), "b": record(BASELINE, "b", (3, 4), text="x")}
    rows = [record("s", "a", (1, 2)), record("s", "b", (9, 9), text="x"), record("s", "c", (5,))]
    assert num_same(rows, refs, by_text=False) == 1
    assert num_same(rows, refs, by_text=True) == 2  # "b" differs in ids but decodes the same
    assert num_same([record("s", "c")], refs, by_text=False) is None


def test_summarize_scenario_speedups_and_comparisons():
    records = [
        record(BASELINE, "a", seconds=2.0),
        record(BASELINE, "b", seconds=4.0),  # 2.0 and 1.0 tok/s
        record(SPECULATIVE, "a", seconds=1.0, stats_=stats()),  # 4.0 tok/s
        record(SPECULATIVE, "b", (1, 2, 3, 5), seconds=2.0, stats_=stats()),  # 2.0 tok/s, differs
        record("transformers", "a", seconds=4.0),
        record("transformers", "b", seconds=4.0),
        record("transformers_lookup", "a", seconds=2.0),
        record("transformers_lookup", "b", error="E: x"),
    ]
    out = summarize_scenario(records)
    assert list(out) == [BASELINE, SPECULATIVE, "transformers", "transformers_lookup"]
    assert out[BASELINE]["speedup"] == pytest.approx(1.0)
    assert out[SPECULATIVE]["speedup"] == pytest.approx(3.0 / 1.5)
    assert out[SPECULATIVE]["speedup_per_prompt"]["median"] == pytest.approx(2.0)
    assert out[SPECULATIVE]["num_same_as_baseline"] == 1
    assert out[SPECULATIVE]["compared_by"] == "token_ids"
    assert out[SPECULATIVE]["acceptance_rate"] == pytest.approx(0.4)
    assert out["transformers"]["compared_by"] == "text"
    assert out["transformers"]["num_same_as_baseline"] == 2
    lookup = out["transformers_lookup"]
    assert (lookup["num_errors"], lookup["errors"]) == (1, ["E: x"])
    assert lookup["speedup_over_own_greedy"] == pytest.approx(2.0)
    assert lookup["speedup_over_own_greedy_per_prompt"]["n"] == 1
    assert lookup["num_same_as_own_greedy"] == 1
    assert "acceptance_rate" not in out["transformers"]


def test_summarize_scenario_with_a_failed_baseline_has_no_speedup():
    out = summarize_scenario(
        [
            record(BASELINE, "a", error="UNIMPLEMENTED: response_format"),
            record(SPECULATIVE, "a", error="UNIMPLEMENTED: response_format"),
            record("transformers", "a"),
        ]
    )
    assert out[BASELINE]["tokens_per_s"] is None
    assert out[SPECULATIVE]["errors"] == ["UNIMPLEMENTED: response_format"]
    assert out["transformers"]["speedup"] is None
    assert out["transformers"]["num_same_as_baseline"] is None


def test_json_counts_appear_for_json_records():
    r = Record("transformers", "json", "a", 5, (1,), "{}", 1.0, is_json=True, is_schema_valid=False)
    out = summarize_scenario([r])["transformers"]
    assert (out["num_json"], out["num_schema_valid"], out["schema_validity_rate"]) == (1, 0, 0.0)
    assert "num_json" not in summarize_scenario([record(BASELINE, "a")])[BASELINE]


def test_check_json():
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    assert check_json('{"n": 3}', schema) == (True, True)
    assert check_json(' {"n": "3"} ', schema) == (True, False)
    assert check_json('```json\n{"n": 3}\n```', schema) == (False, False)
    assert check_json("[1]", None) == (True, False)


def test_record_to_dict_and_finite():
    d = Record("baseline", "code", "a", 5, (1, 2), "x", 0.5).to_dict()
    assert "token_ids" not in d and d["num_tokens"] == 2 and d["tokens_per_s"] == 4.0
    assert finite({"a": [1.0, math.inf], "b": (math.inf,)}) == {"a": [1.0, None], "b": [None]}


def test_a_decoders_subtree_figures_by_depth_sum_over_requests():
    """4 steps, tested by depth [4, 3, 1], accepted by depth [3, 1], 10 ms."""
    d1 = {"feature": {"num_proposed": 9, "num_accepted": 3, "time_ms": 6.0, "num_steps": 3,
                      "num_tested_by_depth": [3, 2], "num_accepted_by_depth": [2, 1]}}  # fmt: skip
    d2 = {"feature": {"num_proposed": 4, "num_accepted": 1, "time_ms": 4.0, "num_steps": 1,
                      "num_tested_by_depth": [1, 1, 1], "num_accepted_by_depth": [1]}}  # fmt: skip
    f = speculation_figures([stats(decoders=d1, proposed=9, accepted=3), stats(decoders=d2, proposed=4, accepted=1)])
    row = f["decoders"]["feature"]
    assert (row["num_tested_by_depth"], row["num_accepted_by_depth"]) == ([4, 3, 1], [3, 1])
    assert row["acceptance_by_depth"] == [pytest.approx(0.75), pytest.approx(1 / 3), 0.0]
    assert row["mean_accepted_length"] == pytest.approx(2.0) and row["draft_ms_per_step"] == pytest.approx(2.5)
    assert decoder_figures(
        {"num_steps": 0, "num_tested_by_depth": [], "num_accepted_by_depth": [], "time_ms": 0.0}
    ) == {
        "acceptance_by_depth": [],
        "mean_accepted_length": None,
        "draft_ms_per_step": None,
    }


def test_machine_info_records_the_cpu_flags_the_kernels_turn_on():
    """AVX-512 with and without VNNI (the quantized kernels' int8 dot products) are machines of
    different speed: the report says which it ran on."""
    from pathlib import Path

    from bench.report import machine_info

    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = set(next((ln for ln in lines if ln.startswith("flags")), ":").split(":", 1)[1].split())
    m = machine_info()
    assert m["avx512_vnni"] == ("avx512_vnni" in flags) and m["amx"] == ("amx_tile" in flags)
