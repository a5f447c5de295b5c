"""bench.tables and bench.chart: rendering results (markdown rows, chart series, a PNG file)."""
from __future__ import annotations

from bench.chart import entropy_series, speedup_series, write_chart
from bench.tables import (concurrency_table, headline_table, peer_systems, render_markdown, speculation_table,
                          systems_table)


def system(tps: float | None, speedup: float | None, **extra) -> dict:
    return {"num_prompts": 2, "num_errors": 0 if tps else 2, "errors": [] if tps else ["UNIMPLEMENTED: no"],
            "tokens_per_s": ({"median": tps, "min": tps - 1, "q1": tps, "q3": tps, "max": tps + 1, "n": 2}
                             if tps else None),
            "speedup": speedup, "num_same_as_baseline": 2 if tps else None, "compared_by": "token_ids", **extra}


def run() -> dict:
    bins = [{"lower": 0.0, "upper": 0.5, "num_proposed": 4, "num_accepted": 3, "acceptance_rate": 0.75},
            {"lower": 0.5, "upper": 1.0, "num_proposed": 0, "num_accepted": 0, "acceptance_rate": None},
            {"lower": 4.0, "upper": None, "num_proposed": 2, "num_accepted": 0, "acceptance_rate": 0.0}]
    return {"scenarios": {
        "code": {"num_prompts": 2, "num_skipped": 1, "systems": {
            "baseline": system(10.0, 1.0), "speculative": system(20.0, 2.0, acceptance_rate=0.5, entropy_bins=bins),
            "transformers": system(12.5, 1.25)}},
        "json": {"num_prompts": 2, "num_skipped": 0, "systems": {
            "baseline": system(None, None), "speculative": system(None, None),
            "transformers": system(11.0, None)}}},
        "concurrency": [{"concurrency": 4, "speculation": True, "aggregate_tokens_per_s": 31.25,
                         "token_latency_ms": {"p50": 80.0, "p99": 300.0}, "ttft_ms": {"p50": 500.0, "p99": 900.0},
                         "num_steps_by_degree": [3, 7], "num_steps_by_draft_length": [3, 0, 7],
                         "num_errors": 0, "num_requests": 4}]}


def test_headline_table_rows():
    lines = headline_table(run()).splitlines()
    assert lines[0] == ("| scenario | prompts | baseline tok/s | optimized tok/s | speedup | acceptance | same output "
                        "| transformers greedy tok/s |")
    assert lines[2] == "| code | 2 | 10.0 | 20.0 | 2.00x | 50.0 % | 2/2 | 12.5 (1.25x) |"
    assert lines[3] == "| json | 2 | error: UNIMPLEMENTED | error: UNIMPLEMENTED | — | — | — | 11.0 (—) |"


def test_systems_table_has_a_row_per_system_with_spread():
    lines = systems_table(run()).splitlines()
    assert len(lines) == 2 + 6
    assert lines[3].startswith("| code | specdec (adaptive) | 20.0 (19.0–21.0) | 2.00x |")


def test_concurrency_table_row():
    assert concurrency_table(run()["concurrency"]).splitlines()[2] == \
        "| 4 | on | 31.2 | 80 | 300 | 500 | [3, 7] | [3, 0, 7] | 0/4 |"


def test_peer_systems_in_label_order():
    r = run()
    r["scenarios"]["code"]["systems"]["llamacpp_lookup"] = system(50.0, 5.0)
    assert peer_systems(r) == ["transformers", "llamacpp_lookup"]


def results() -> dict:
    return {"config": {"max_new_tokens": 32, "sequence_length": 2048, "is_schema": True},
            "machine": {"cpu_model": "CPU", "num_cpus": 2, "avx512": False, "versions": {"torch": "2"}, "date": "d"},
            "peers_skipped": {"llamacpp": "not installed"}, "runs": {"fp32": run()}}


def test_render_markdown_names_skips():
    md = render_markdown(results())
    assert "Peer llamacpp skipped: not installed" in md
    assert "### fp32" in md and "code 1" in md and "Concurrency sweep" in md


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
        decoders={"prompt_lookup": {"num_proposed": 8, "num_accepted": 3}}, num_steps_by_degree=[2, 5],
        num_steps_by_draft_length=[2, 0, 0, 5], num_probe_steps=1)
    lines = speculation_table(r).splitlines()
    assert lines[2] == "| code | prompt_lookup 3/8 | [2, 5] | [2, 0, 0, 5] | 1 |"
    assert len(lines) == 3   # json's speculative system never ran
