"""Markdown tables of `python -m bench` results (results.md, also printed).

    print(render_markdown(results))   # results: what bench.suite writes to results.json

Per precision: the headline table in the reference article's shape (scenario | baseline tok/s |
optimized tok/s | speedup | acceptance), with one tok/s column per peer system; then every system
of every scenario; the mean time per step by stage (the overhead's composition); structured output
(json with and without the schema); the speculative system's decoders and controller plans; then
the concurrency sweep when it ran. Speedups: "speedup" is the ratio of medians, "per prompt" the
median of per-prompt ratios (bench/report.py).
"""

from __future__ import annotations

from typing import Any

from bench.report import BASELINE, SPECULATIVE, STACK_SYSTEMS
from bench.scenarios import CONSTRAINED, LONG, LONG_MAX_PROMPT_TOKENS, LONG_MIN_PROMPT_TOKENS, UNCONSTRAINED

SYSTEM_LABELS = {
    BASELINE: "baseline (speculation off)",
    SPECULATIVE: "specdec (adaptive)",
    "transformers": "transformers greedy",
    "transformers_lookup": "transformers + prompt lookup",
    "llamacpp": "llama.cpp greedy",
    "llamacpp_lookup": "llama.cpp + prompt lookup",
}
NONE = "—"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return NONE if value is None else fmt.format(value)


def _times(value: float | None) -> str:
    return _num(value, "{:.2f}x")


def _pct(value: float | None) -> str:
    return _num(None if value is None else 100 * value, "{:.1f} %")


def _ratio(count: int | None, total: int) -> str:
    return NONE if count is None else f"{count}/{total}"


def _median(value: dict[str, Any] | None) -> float | None:
    """The median of a bench.report.spread, None for none."""
    return None if value is None else value["median"]


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


def _speedup_cells(system: dict[str, Any]) -> list[str]:
    """Speedup as the ratio of medians, then per prompt (the median of per-prompt ratios)."""
    return [_times(system["speedup"]), _times(_median(system["speedup_per_prompt"]))]


def _acceptance_cells(system: dict[str, Any]) -> list[str]:
    """Acceptance rate, then mean accepted length."""
    return [_pct(system.get("acceptance_rate")), _num(system.get("mean_accepted_length"), "{:.2f}")]


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
    header = [
        "scenario",
        "prompts",
        "baseline tok/s",
        "optimized tok/s",
        "speedup",
        "per prompt",
        "acceptance",
        "same output",
        *(f"{SYSTEM_LABELS[p]} tok/s" for p in peers),
    ]
    rows = []
    for name, scenario in run["scenarios"].items():
        systems = scenario["systems"]
        base, spec = systems.get(BASELINE), systems.get(SPECULATIVE)
        n = scenario["num_prompts"]
        spec_cells = (
            [
                _tps(spec),
                *_speedup_cells(spec),
                _pct(spec.get("acceptance_rate")),
                _ratio(spec["num_same_as_baseline"], n),
            ]
            if spec
            else [NONE] * 5
        )
        row = [name, str(n), _tps(base) if base else NONE, *spec_cells]
        for p in peers:
            peer = systems.get(p)
            row.append(NONE if peer is None else f"{_tps(peer)} ({_times(peer['speedup'])})")
        rows.append(row)
    return _table(header, rows)


def systems_table(run: dict[str, Any]) -> str:
    header = [
        "scenario",
        "system",
        "tok/s median (min–max)",
        "vs baseline",
        "vs own greedy",
        "acceptance",
        "mean accepted length",
        "outside model compute",
        "same as baseline",
        "JSON parses / valid",
    ]
    rows = []
    for name, scenario in run["scenarios"].items():
        for system, s in scenario["systems"].items():
            n = s["num_prompts"] - s["num_errors"]
            json_cell = f"{s['num_json']}/{n} / {s['num_schema_valid']}/{n}" if "num_json" in s else NONE
            rows.append(
                [
                    name,
                    SYSTEM_LABELS.get(system, system),
                    _tps_spread(s),
                    _times(s["speedup"]),
                    _times(s.get("speedup_over_own_greedy")),
                    *_acceptance_cells(s),
                    _pct(s.get("outside_model_fraction")),
                    f"{_ratio(s['num_same_as_baseline'], n)} ({s['compared_by']})"
                    if s["num_same_as_baseline"] is not None
                    else NONE,
                    json_cell,
                ]
            )
    return _table(header, rows)


def step_time_table(run: dict[str, Any]) -> str:
    """The stack's systems: mean ms per step of each stage (bench/overhead.py), model compute first."""
    keys = ("total", "forward", "draft_model", "verify_minus_forward", "draft", "validate", "commit", "state", "other")
    header = [
        "scenario",
        "system",
        "step ms",
        "forward",
        "model drafting",
        "verify − forward",
        "draft (all)",
        "validate",
        "commit",
        "state",
        "other",
        "outside model compute",
    ]
    rows = []
    for name, scenario in run["scenarios"].items():
        for system, s in scenario["systems"].items():
            per_step = s.get("stage_ms_per_step")
            if system in STACK_SYSTEMS and per_step:
                rows.append(
                    [name, SYSTEM_LABELS[system], *(_num(per_step[k]) for k in keys), _pct(s["outside_model_fraction"])]
                )
    return _table(header, rows)


def structured_table(run: dict[str, Any]) -> str:
    """json with and without the schema: speed, acceptance, grammar-forced share, validity. The peers
    (unconstrained either way) are listed once, under json_noschema."""
    base = run["scenarios"].get(UNCONSTRAINED, {}).get("systems", {}).get(BASELINE)
    base_tps = _median(base["tokens_per_s"]) if base else None
    shares = ("grammar_forced_share", "forced_token_share", "json_parse_rate", "schema_validity_rate")
    header = [
        "scenario",
        "system",
        "tok/s",
        "speedup",
        "per prompt",
        "vs baseline without schema",
        "acceptance",
        "mean accepted length",
        "grammar-forced share of accepted",
        "forced tokens (undrafted)",
        "parses as JSON",
        "schema-valid",
    ]
    rows = []
    for name in (CONSTRAINED, UNCONSTRAINED):
        for system, s in run["scenarios"].get(name, {}).get("systems", {}).items():
            if name == CONSTRAINED and system not in STACK_SYSTEMS:
                continue
            tps = _median(s["tokens_per_s"])
            rows.append(
                [
                    name,
                    SYSTEM_LABELS.get(system, system),
                    _tps(s),
                    *_speedup_cells(s),
                    _times(tps / base_tps if tps is not None and base_tps else None),
                    *_acceptance_cells(s),
                    *(_pct(s.get(k)) for k in shares),
                ]
            )
    return _table(header, rows)


def speculation_table(run: dict[str, Any]) -> str:
    """The speculative system per scenario: each decoder's acceptance and the controller's plans."""
    header = [
        "scenario",
        "decoders: accepted / proposed, mean accepted length, draft ms / step, acceptance by depth",
        "steps by degree (0 = plain)",
        "steps by draft length",
        "probe steps",
        "task type",
    ]
    rows = []
    for name, scenario in run["scenarios"].items():
        spec = scenario["systems"].get(SPECULATIVE)
        if spec is None or "decoders" not in spec:
            continue
        decoders = "; ".join(decoder_cell(d, v) for d, v in spec["decoders"].items())
        rows.append(
            [
                name,
                decoders or NONE,
                str(spec["num_steps_by_degree"]),
                str(spec["num_steps_by_draft_length"]),
                str(spec["num_probe_steps"]),
                ", ".join(spec["task_types"]) or NONE,
            ]
        )
    return _table(header, rows)


def decoder_cell(name: str, v: dict[str, Any]) -> str:
    """E.g. "feature 40/60, L 2.10, 1.2 ms, by depth 80.0 % / 62.0 % / 41.0 %" (a rank r > 0 row:
    counts only; L: its mean accepted length, ms: its draft time per step)."""
    cell = f"{name} {v['num_accepted']}/{v['num_proposed']}"
    if v.get("mean_accepted_length") is None:
        return cell
    depths = " / ".join(_pct(a) for a in v.get("acceptance_by_depth") or [])
    return f"{cell}, L {v['mean_accepted_length']:.2f}, {_num(v['draft_ms_per_step'])} ms" + (
        f", by depth {depths}" if depths else ""
    )


def concurrency_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "clients",
        "speculation",
        "aggregate tok/s",
        "per-token p50 ms",
        "per-token p99 ms",
        "TTFT p50 ms",
        "steps by degree (0 = plain)",
        "steps by draft length",
        "errors",
    ]
    return _table(
        header,
        [
            [
                str(r["concurrency"]),
                "on" if r["speculation"] else "off",
                _num(r["aggregate_tokens_per_s"]),
                _num(r["token_latency_ms"]["p50"], "{:.0f}"),
                _num(r["token_latency_ms"]["p99"], "{:.0f}"),
                _num(r["ttft_ms"]["p50"], "{:.0f}"),
                str(r["num_steps_by_degree"]),
                str(r["num_steps_by_draft_length"]),
                f"{r['num_errors']}/{r['num_requests']}",
            ]
            for r in rows
        ],
    )


def _long_setting(config: dict[str, Any]) -> str:
    """The long scenario's own request length and context, when it ran."""
    if LONG not in config.get("scenarios", ()):
        return ""
    return (
        f"; long: {LONG_MIN_PROMPT_TOKENS}-{LONG_MAX_PROMPT_TOKENS} prompt tokens, at most "
        f"{config['long_max_new_tokens']} new tokens, context {config['max_context_tokens']}"
    )


def _cpu_flags(machine: dict[str, Any]) -> str:
    """The instruction sets the kernels' speed turns on, e.g. "AVX512 yes (VNNI yes), AMX no"; a flag
    that results written before it was recorded lack is left out."""

    def yes(key: str) -> str:
        return "yes" if machine[key] else "no"

    vnni = f" (VNNI {yes('avx512_vnni')})" if machine["avx512"] and "avx512_vnni" in machine else ""
    amx = f", AMX {yes('amx')}" if "amx" in machine else ""
    return f"AVX512 {yes('avx512')}{vnni}{amx}"


def _cpus(machine: dict[str, Any]) -> str:
    """The machine's CPUs, and how many of them the run could use where that differs (a container's or
    taskset's affinity: the figures were made on those)."""
    total, usable = machine["num_cpus"], machine.get("num_usable_cpus")
    return f"{total} CPUs" if usable in (None, total) else f"{total} CPUs ({usable} usable)"


def render_markdown(results: dict[str, Any]) -> str:
    config, machine = results["config"], results["machine"]
    parts = [
        f"Machine: {machine['cpu_model']}, {_cpus(machine)}, {_cpu_flags(machine)}, "
        f"torch {machine['versions']['torch']}, {machine['date']}. "
        f"Greedy, batch 1, at most {config['max_new_tokens']} new tokens, sequence length "
        f"{config['sequence_length']}{_long_setting(config)}. json: the row's schema as response_format; "
        "json_noschema: the same prompts without (peers: always without)."
    ]
    parts += [f"Peer {name} skipped: {reason}" for name, reason in results["peers_skipped"].items()]
    for precision, run in results["runs"].items():
        by_file = {  # json: once; long has a filter of its own
            v.get("prompt_file", k): v["num_skipped"] for k, v in run["scenarios"].items() if k != LONG
        }
        skipped = ", ".join(f"{name} {n}" for name, n in by_file.items() if n)
        served = run.get("served_precision", precision)
        title = precision if served == precision else f"{precision}: the primary chose {served}"
        parts += [
            f"### {title}",
            headline_table(run),
            systems_table(run),
            "Time per step by stage (ms; verify = forward + verify − forward; draft includes model drafting):",
            step_time_table(run),
        ]
        if any(name in run["scenarios"] for name in (CONSTRAINED, UNCONSTRAINED)):
            parts += ["Structured output:", structured_table(run)]
        parts.append(speculation_table(run))
        parts += [f"Peer {name} failed: {error}" for name, error in run.get("peers_failed", {}).items()]
        if skipped:
            parts.append(f"Prompts skipped (prompt + max new tokens > sequence length): {skipped}.")
        if (long := run["scenarios"].get(LONG)) is not None and long.get("num_considered") is not None:
            parts.append(
                f"long: {long['num_in_window']} of the {long['num_considered']} rows considered have "
                f"{LONG_MIN_PROMPT_TOKENS}-{LONG_MAX_PROMPT_TOKENS} prompt tokens; the first {long['num_prompts']} "
                "(round robin over the files) ran."
            )
        if run.get("concurrency"):
            parts += [
                "Concurrency sweep (per-token latency: inter-token time at the client):",
                concurrency_table(run["concurrency"]),
            ]
    return "\n\n".join(parts) + "\n"
