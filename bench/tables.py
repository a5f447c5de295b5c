"""Markdown tables of `python -m bench` results (results.md, also printed).

    print(render_markdown(results))   # results: what bench.suite writes to results.json

Per precision: the headline table in the reference article's shape (scenario | baseline tok/s |
optimized tok/s | speedup | acceptance), with one tok/s column per peer system; then every system
of every scenario; the speculative system's decoders and controller plans; then the concurrency
sweep when it ran.
"""
from __future__ import annotations

from typing import Any

from bench.report import BASELINE, SPECULATIVE

SYSTEM_LABELS = {BASELINE: "baseline (speculation off)", SPECULATIVE: "specdec (adaptive)",
                 "transformers": "transformers greedy", "transformers_lookup": "transformers + prompt lookup",
                 "llamacpp": "llama.cpp greedy", "llamacpp_lookup": "llama.cpp + prompt lookup"}
NONE = "—"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return NONE if value is None else fmt.format(value)


def _times(value: float | None) -> str:
    return _num(value, "{:.2f}x")


def _pct(value: float | None) -> str:
    return _num(None if value is None else 100 * value, "{:.1f} %")


def _ratio(count: int | None, total: int) -> str:
    return NONE if count is None else f"{count}/{total}"


def _tps(system: dict[str, Any]) -> str:
    """Median tok/s, or the error code when nothing ran (e.g. UNIMPLEMENTED)."""
    tps = system["tokens_per_s"]
    if tps is None:
        return "error: " + ", ".join(sorted({e.split(":")[0] for e in system["errors"]})) if system["errors"] else NONE
    return f"{tps['median']:.1f}"


def _tps_spread(system: dict[str, Any]) -> str:
    tps = system["tokens_per_s"]
    if tps is None or tps["n"] < 2:
        return _tps(system)
    return f"{tps['median']:.1f} ({tps['min']:.1f}–{tps['max']:.1f})"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join([_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)])


def peer_systems(run: dict[str, Any]) -> list[str]:
    """The systems beyond baseline and speculative that appear in any scenario, in label order."""
    present = {s for scenario in run["scenarios"].values() for s in scenario["systems"]}
    return [s for s in SYSTEM_LABELS if s in present and s not in (BASELINE, SPECULATIVE)]


def headline_table(run: dict[str, Any]) -> str:
    peers = peer_systems(run)
    header = ["scenario", "prompts", "baseline tok/s", "optimized tok/s", "speedup", "acceptance", "same output",
              *(f"{SYSTEM_LABELS[p]} tok/s" for p in peers)]
    rows = []
    for name, scenario in run["scenarios"].items():
        systems = scenario["systems"]
        base, spec = systems.get(BASELINE), systems.get(SPECULATIVE)
        n = scenario["num_prompts"]
        row = [name, str(n), _tps(base) if base else NONE, _tps(spec) if spec else NONE,
               _times(spec["speedup"]) if spec else NONE, _pct(spec.get("acceptance_rate")) if spec else NONE,
               _ratio(spec["num_same_as_baseline"], n) if spec else NONE]
        for p in peers:
            peer = systems.get(p)
            row.append(NONE if peer is None else f"{_tps(peer)} ({_times(peer['speedup'])})")
        rows.append(row)
    return _table(header, rows)


def systems_table(run: dict[str, Any]) -> str:
    header = ["scenario", "system", "tok/s median (min–max)", "vs baseline", "vs own greedy", "acceptance",
              "mean accepted length", "outside model compute", "same as baseline", "JSON parses / valid"]
    rows = []
    for name, scenario in run["scenarios"].items():
        for system, s in scenario["systems"].items():
            n = s["num_prompts"] - s["num_errors"]
            json_cell = (f"{s['num_json']}/{n} / {s['num_schema_valid']}/{n}" if "num_json" in s else NONE)
            rows.append([name, SYSTEM_LABELS.get(system, system), _tps_spread(s), _times(s["speedup"]),
                         _times(s.get("speedup_over_own_greedy")), _pct(s.get("acceptance_rate")),
                         _num(s.get("mean_accepted_length"), "{:.2f}"), _pct(s.get("outside_model_fraction")),
                         f"{_ratio(s['num_same_as_baseline'], n)} ({s['compared_by']})"
                         if s["num_same_as_baseline"] is not None else NONE, json_cell])
    return _table(header, rows)


def speculation_table(run: dict[str, Any]) -> str:
    """The speculative system per scenario: each decoder's acceptance and the controller's plans."""
    header = ["scenario", "decoders: accepted / proposed", "steps by degree (0 = plain)", "steps by draft length",
              "probe steps"]
    rows = []
    for name, scenario in run["scenarios"].items():
        spec = scenario["systems"].get(SPECULATIVE)
        if spec is None or "decoders" not in spec:
            continue
        decoders = ", ".join(f"{d} {v['num_accepted']}/{v['num_proposed']}" for d, v in spec["decoders"].items())
        rows.append([name, decoders or NONE, str(spec["num_steps_by_degree"]), str(spec["num_steps_by_draft_length"]),
                     str(spec["num_probe_steps"])])
    return _table(header, rows)


def concurrency_table(rows: list[dict[str, Any]]) -> str:
    header = ["clients", "speculation", "aggregate tok/s", "per-token p50 ms", "per-token p99 ms", "TTFT p50 ms",
              "steps by degree (0 = plain)", "steps by draft length", "errors"]
    return _table(header, [[str(r["concurrency"]), "on" if r["speculation"] else "off",
                            _num(r["aggregate_tokens_per_s"]), _num(r["token_latency_ms"]["p50"], "{:.0f}"),
                            _num(r["token_latency_ms"]["p99"], "{:.0f}"), _num(r["ttft_ms"]["p50"], "{:.0f}"),
                            str(r["num_steps_by_degree"]), str(r["num_steps_by_draft_length"]),
                            f"{r['num_errors']}/{r['num_requests']}"] for r in rows])


def render_markdown(results: dict[str, Any]) -> str:
    config, machine = results["config"], results["machine"]
    parts = [f"Machine: {machine['cpu_model']}, {machine['num_cpus']} CPUs, AVX512 "
             f"{'yes' if machine['avx512'] else 'no'}, torch {machine['versions']['torch']}, {machine['date']}. "
             f"Greedy, batch 1, at most {config['max_new_tokens']} new tokens, sequence length "
             f"{config['sequence_length']}, json {'with' if config['is_schema'] else 'without'} response_format."]
    parts += [f"Peer {name} skipped: {reason}" for name, reason in results["peers_skipped"].items()]
    for precision, run in results["runs"].items():
        skipped = ", ".join(f"{k} {v['num_skipped']}" for k, v in run["scenarios"].items() if v["num_skipped"])
        parts += [f"### {precision}", headline_table(run), systems_table(run), speculation_table(run)]
        parts += [f"Peer {name} failed: {error}" for name, error in run.get("peers_failed", {}).items()]
        if skipped:
            parts.append(f"Prompts skipped (prompt + max new tokens > sequence length): {skipped}.")
        if run.get("concurrency"):
            parts += ["Concurrency sweep (per-token latency: inter-token time at the client):",
                      concurrency_table(run["concurrency"])]
    return "\n\n".join(parts) + "\n"
