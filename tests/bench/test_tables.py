"""bench.tables and bench.chart: rendering results (markdown rows, chart series, a PNG file)."""

from __future__ import annotations

from bench.chart import entropy_series, speedup_series, write_chart
from bench.tables import (
    concurrency_table,
    decoder_cell,
    headline_table,
    peer_systems,
    render_markdown,
    speculation_table,
    step_time_table,
    structured_table,
    systems_table,
)


def spread(median: float) -> dict:
    return {"median": median, "min": median - 1, "q1": median, "q3": median, "max": median + 1, "n": 2}


def system(tps: float | None, speedup: float | None, per_prompt: float | None = None, **extra) -> dict:
    return {
        "num_prompts": 2,
        "num_errors": 0 if tps else 2,
        "errors": [] if tps else ["UNIMPLEMENTED: no"],
        "tokens_per_s": spread(tps) if tps else None,
        "speedup": speedup,
        "speedup_per_prompt": spread(per_prompt) if per_prompt else None,
        "num_same_as_baseline": 2 if tps else None,
        "compared_by": "token_ids",
        **extra,
    }


def run() -> dict:
    bins = [
        {"lower": 0.0, "upper": 0.5, "num_proposed": 4, "num_accepted": 3, "acceptance_rate": 0.75},
        {"lower": 0.5, "upper": 1.0, "num_proposed": 0, "num_accepted": 0, "acceptance_rate": None},
        {"lower": 4.0, "upper": None, "num_proposed": 2, "num_accepted": 0, "acceptance_rate": 0.0},
    ]
    return {
        "scenarios": {
            "code": {
                "num_prompts": 2,
                "num_skipped": 1,
                "systems": {
                    "baseline": system(10.0, 1.0, 1.0),
                    "speculative": system(20.0, 2.0, 1.9, acceptance_rate=0.5, entropy_bins=bins),
                    "transformers": system(12.5, 1.25),
                },
            },
            "json": {
                "num_prompts": 2,
                "num_skipped": 0,
                "systems": {
                    "baseline": system(None, None),
                    "speculative": system(None, None),
                    "transformers": system(11.0, None),
                },
            },
        },
        "concurrency": [
            {
                "concurrency": 4,
                "speculation": True,
                "aggregate_tokens_per_s": 31.25,
                "token_latency_ms": {"p50": 80.0, "p99": 300.0},
                "ttft_ms": {"p50": 500.0, "p99": 900.0},
                "num_steps_by_degree": [3, 7],
                "num_steps_by_draft_length": [3, 0, 7],
                "num_errors": 0,
                "num_requests": 4,
            }
        ],
    }


def test_headline_table_rows():
    lines = headline_table(run()).splitlines()
    assert lines[0] == (
        "| scenario | prompts | baseline tok/s | optimized tok/s | speedup | per prompt | acceptance "
        "| same output | transformers greedy tok/s |"
    )
    assert lines[2] == "| code | 2 | 10.0 | 20.0 | 2.00x | 1.90x | 50.0 % | 2/2 | 12.5 (1.25x) |"
    assert lines[3] == "| json | 2 | error: UNIMPLEMENTED | error: UNIMPLEMENTED | — | — | — | — | 11.0 (—) |"


def test_systems_table_has_a_row_per_system_with_spread():
    lines = systems_table(run()).splitlines()
    assert len(lines) == 2 + 6
    assert lines[3].startswith("| code | specdec (adaptive) | 20.0 (19.0–21.0) | 2.00x |")


def test_concurrency_table_row():
    assert (
        concurrency_table(run()["concurrency"]).splitlines()[2]
        == "| 4 | on | 31.2 | 80 | 300 | 500 | [3, 7] | [3, 0, 7] | 0/4 |"
    )


def test_peer_systems_in_label_order():
    r = run()
    r["scenarios"]["code"]["systems"]["llamacpp_lookup"] = system(50.0, 5.0)
    assert peer_systems(r) == ["transformers", "llamacpp_lookup"]


def results() -> dict:
    return {
        "config": {"max_new_tokens": 32, "sequence_length": 2048, "is_schema": True},
        "machine": {"cpu_model": "CPU", "num_cpus": 2, "avx512": False, "versions": {"torch": "2"}, "date": "d"},
        "peers_skipped": {"llamacpp": "not installed"},
        "runs": {"fp32": run()},
    }


def test_render_markdown_names_skips():
    md = render_markdown(results())
    assert "Peer llamacpp skipped: not installed" in md
    assert "### fp32" in md and "code 1" in md and "Concurrency sweep" in md


def test_render_markdown_names_the_cpu_flags():
    r = results()
    assert "AVX512 no, torch" in render_markdown(r)  # results written before VNNI and AMX were recorded
    r["machine"] |= {"avx512": True, "avx512_vnni": True, "amx": False}
    assert "AVX512 yes (VNNI yes), AMX no" in render_markdown(r)


def test_render_markdown_names_the_cpus_the_run_could_use():
    r = results()
    r["machine"] |= {"num_cpus": 16, "num_usable_cpus": 16}
    assert ", 16 CPUs, " in render_markdown(r)
    r["machine"]["num_usable_cpus"] = 2  # a container's or taskset's affinity
    assert ", 16 CPUs (2 usable), " in render_markdown(r)


def test_chart_series():
    scenarios, series = speedup_series(run())
    assert scenarios == ["code", "json"]
    assert series["speculative"][0] == 2.0 and series["speculative"][1] != series["speculative"][1]  # NaN
    assert "baseline" not in series
    assert entropy_series(run()) == {"code": ([0.25, 4.5], [0.75, 0.0])}


def test_write_chart_writes_a_png(tmp_path):
    path = tmp_path / "results.png"
    write_chart(results(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_speculation_table_lists_decoders_and_plans():
    r = run()
    r["scenarios"]["code"]["systems"]["speculative"].update(
        decoders={"prompt_lookup": {"num_proposed": 8, "num_accepted": 3}},
        num_steps_by_degree=[2, 5],
        num_steps_by_draft_length=[2, 0, 0, 5],
        num_probe_steps=1,
        task_types=["code"],
    )
    lines = speculation_table(r).splitlines()
    assert lines[2] == "| code | prompt_lookup 3/8 | [2, 5] | [2, 0, 0, 5] | 1 | code |"
    assert len(lines) == 3  # json's speculative system never ran


def json_run() -> dict:
    """json with the schema (faster, all valid) and without (a peer too, listed under both)."""

    def spec(tps: float, share: float | None, valid: float) -> dict:
        return system(
            tps,
            tps / 10.0,
            tps / 10.0,
            acceptance_rate=0.5,
            mean_accepted_length=1.5,
            grammar_forced_share=share,
            forced_token_share=share and share / 5,
            json_parse_rate=1.0,
            schema_validity_rate=valid,
        )

    peer = system(8.0, 0.8, 0.8, json_parse_rate=0.5, schema_validity_rate=0.5)
    return {
        "scenarios": {
            "json": {
                "num_prompts": 2,
                "num_skipped": 0,
                "systems": {
                    "baseline": system(12.0, 1.0, 1.0, json_parse_rate=1.0, schema_validity_rate=1.0),
                    "speculative": spec(30.0, 0.25, 1.0),
                    "transformers": peer,
                },
            },
            "json_noschema": {
                "num_prompts": 2,
                "num_skipped": 0,
                "systems": {
                    "baseline": system(10.0, 1.0, 1.0, json_parse_rate=1.0, schema_validity_rate=0.5),
                    "speculative": spec(15.0, None, 0.5),
                    "transformers": peer,
                },
            },
        },
        "concurrency": [],
    }


def test_structured_table_rows_with_and_without_the_schema():
    lines = structured_table(json_run()).splitlines()
    assert len(lines) == 2 + 5  # the peer once, under json_noschema
    assert lines[3] == (
        "| json | specdec (adaptive) | 30.0 | 3.00x | 3.00x | 3.00x | 50.0 % | 1.50 | 25.0 % | 5.0 % "
        "| 100.0 % | 100.0 % |"
    )
    assert lines[5] == (
        "| json_noschema | specdec (adaptive) | 15.0 | 1.50x | 1.50x | 1.50x | 50.0 % | 1.50 | — | — "
        "| 100.0 % | 50.0 % |"
    )
    assert lines[6].startswith("| json_noschema | transformers greedy | 8.0 | 0.80x |")


def test_step_time_table_has_the_stack_systems_with_stages():
    r = json_run()
    per_step = {
        "total": 50.0,
        "forward": 30.0,
        "draft_model": 0.0,
        "verify_minus_forward": 5.0,
        "draft": 4.0,
        "validate": 3.0,
        "commit": 2.0,
        "state": 1.0,
        "other": 5.0,
    }
    r["scenarios"]["json"]["systems"]["speculative"].update(stage_ms_per_step=per_step, outside_model_fraction=0.4)
    lines = step_time_table(r).splitlines()
    assert lines[2] == (
        "| json | specdec (adaptive) | 50.0 | 30.0 | 0.0 | 5.0 | 4.0 | 3.0 | 2.0 | 1.0 | 5.0 | 40.0 % |"
    )
    assert len(lines) == 3


def test_render_markdown_has_the_structured_output_table_only_with_json():
    md = render_markdown({**results(), "runs": {"fp32": json_run()}})
    assert "Structured output:" in md and "json_noschema" in md
    assert "Structured output:" not in render_markdown(
        {**results(), "runs": {"fp32": {"scenarios": {"code": run()["scenarios"]["code"]}, "concurrency": []}}}
    )


def test_a_decoders_cell_shows_its_accepted_length_draft_time_and_acceptance_by_depth():
    row = {
        "num_proposed": 13,
        "num_accepted": 4,
        "mean_accepted_length": 2.0,
        "draft_ms_per_step": 2.5,
        "acceptance_by_depth": [0.75, 0.5, None],
    }
    assert decoder_cell("feature", row) == "feature 4/13, L 2.00, 2.5 ms, by depth 75.0 % / 50.0 % / —"
    assert decoder_cell("feature#1", {"num_proposed": 5, "num_accepted": 1}) == "feature#1 1/5"
