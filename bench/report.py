"""Aggregation of the benchmark suite's per-request records into results.json, and the machine info.

Pure functions over plain data (no gRPC, no model): `Record` is one request of one system on one
prompt; `summarize_scenario` turns a scenario's records into the figures of results.json.
The markdown tables are bench/tables.py's, the chart bench/chart.py's.

Definitions (also in bench/suite.py's docstring):
    tokens/s            generated tokens / client wall time of the whole call (prefill included);
                        median and spread (min, q1, q3, max) over prompts
    speedup             ratio of medians: median tokens/s of the system / median tokens/s of the baseline,
                        over the prompts both answered without an error
    speedup_per_prompt  median of ratios: spread over prompts of the system's tokens/s / the baseline's
                        on the same prompt
    acceptance rate     accepted draft tokens / proposed draft tokens, summed over prompts
    mean accepted length  generated tokens / steps, summed over prompts
    outside model compute  (total - forward - model-based drafting) / total, summed over prompts:
                        forward is StageTimes.forward_ms (the primary's forward passes themselves),
                        model-based drafting the time_ms of the early_exit / layer_skip decoders
    stage_ms_per_step   each stage's ms summed over prompts / steps summed over prompts; verify is
                        split into forward and verify_minus_forward (RPC, queueing, logits encoding),
                        draft_model is the model-based part of draft
    grammar-forced share  the grammar decoder's accepted draft tokens / all accepted draft tokens
    forced token share  tokens the grammar allowed alone, committed undrafted / generated tokens,
                        summed over prompts (part of the mean accepted length)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import sys
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.overhead import outside_fraction, stage_ms_per_step
from specdec.candidates import decoder_of
from specdec.strategies import GRAMMAR_STRATEGY

BASELINE = "baseline"
SPECULATIVE = "speculative"
STACK_SYSTEMS = (BASELINE, SPECULATIVE)  # through the gateway; the other systems are peers
# A peer's prompt-lookup system is compared with its greedy one: "transformers_lookup" -> "transformers".
LOOKUP_SUFFIX = "_lookup"


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One request of one system on one prompt."""

    system: str
    scenario: str
    prompt_id: str
    num_prompt_tokens: int
    token_ids: tuple[int, ...]
    text: str
    seconds: float  # client wall time of the whole call, prefill included
    error: str = ""  # "" when it ran; else the gRPC status (or exception) and message
    stats: dict[str, Any] | None = None  # the gateway's statistics (bench.stack.stats_dict); stack systems only
    is_json: bool | None = None  # json scenario only: the text parses as JSON
    is_schema_valid: bool | None = None  # json scenario only: ... and validates against the prompt's schema

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """What results.json keeps of a record (the text, not the token ids)."""
        out = dataclasses.asdict(self)
        del out["token_ids"]
        out["num_tokens"] = self.num_tokens
        out["tokens_per_s"] = self.tokens_per_s
        return out


def check_json(text: str, schema: dict | None) -> tuple[bool, bool]:
    """(parses, validates): the whole text is one JSON value, and it satisfies `schema` (Draft 7)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    if schema is None:
        return True, False
    try:
        jsonschema.Draft7Validator(schema).validate(value)
    except (jsonschema.ValidationError, jsonschema.SchemaError):
        return True, False
    return True, True


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """Median, min, max and quartiles (inclusive method); None for no values."""
    if not values:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {
        "median": statistics.median(values),
        "min": min(values),
        "q1": q1,
        "q3": q3,
        "max": max(values),
        "n": len(values),
    }


def merge_entropy_bins(bin_lists: Iterable[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Sum bins with the same (lower, upper) over requests, ascending; upper None is unbounded.

    E.g. [[{0, 0.5, 4 proposed, 3 accepted}], [{0, 0.5, 2, 1}, {0.5, 1, 1, 0}]]
      -> [{0, 0.5, 6, 4, rate 0.667}, {0.5, 1, 1, 0, rate 0.0}]
    """
    totals: dict[tuple[float, float | None], list[int]] = {}
    for bins in bin_lists:
        for b in bins:
            row = totals.setdefault((b["lower"], b["upper"]), [0, 0])
            row[0] += b["num_proposed"]
            row[1] += b["num_accepted"]
    return [
        {"lower": lower, "upper": upper, "num_proposed": p, "num_accepted": a, "acceptance_rate": a / p if p else None}
        for (lower, upper), (p, a) in sorted(totals.items(), key=lambda kv: kv[0][0])
    ]


def sum_counts(count_lists: Iterable[Sequence[int]]) -> list[int]:
    """Element-wise sum of lists of different lengths: [1, 2] + [0, 0, 5] -> [1, 2, 5]."""
    out: list[int] = []
    for counts in count_lists:
        out.extend([0] * (len(counts) - len(out)))
        for i, c in enumerate(counts):
            out[i] += c
    return out


def sum_decoders(stats: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Decoder name -> proposed, accepted, time_ms summed over requests, and its acceptance rate
    (None for a decoder that proposed nothing); on a decoder's rank-0 row also what its whole
    subtree did (decoder_figures)."""
    sums: dict[str, dict[str, Any]] = {}
    for s in stats:
        for name, d in s["decoders"].items():
            row = sums.setdefault(
                name,
                {
                    "num_proposed": 0,
                    "num_accepted": 0,
                    "time_ms": 0.0,
                    "num_steps": 0,
                    "num_tested_by_depth": [],
                    "num_accepted_by_depth": [],
                },
            )
            for key in ("num_proposed", "num_accepted", "time_ms"):
                row[key] += d[key]
            row["num_steps"] += d.get("num_steps", 0)  # absent in results written before it was counted
            for key in ("num_tested_by_depth", "num_accepted_by_depth"):
                row[key] = sum_counts((row[key], d.get(key, [])))
    return {
        name: {
            **row,
            "acceptance_rate": row["num_accepted"] / row["num_proposed"] if row["num_proposed"] else None,
            **decoder_figures(row),
        }
        for name, row in sorted(sums.items())
    }


def decoder_figures(row: dict[str, Any]) -> dict[str, Any]:
    """A decoder's subtree per step it ran: acceptance at each tree depth d (the walk went on through
    its depth-d node / the walk tested it there), its mean accepted length (its accepted draft tokens
    per step + the bonus token) and its draft ms per step. None where it never ran.

    # E.g. 4 steps, tested by depth [4, 3, 1], accepted by depth [3, 1], 10 ms
    #   -> acceptance by depth [0.75, 0.33, 0.0], mean accepted length 2.0, 2.5 ms a step
    """
    steps, tested, accepted = row["num_steps"], row["num_tested_by_depth"], row["num_accepted_by_depth"]
    return {
        "acceptance_by_depth": [a / t if t else None for t, a in zip(tested, [*accepted, *[0] * len(tested)])],
        "mean_accepted_length": 1.0 + sum(accepted) / steps if steps else None,
        "draft_ms_per_step": row["time_ms"] / steps if steps else None,
    }


def grammar_forced_share(decoders: dict[str, dict[str, float | None]], num_accepted: int) -> float | None:
    """The grammar decoder's accepted draft tokens / all accepted draft tokens; None when none accepted."""
    if not num_accepted:
        return None
    num_forced = sum(d["num_accepted"] or 0 for name, d in decoders.items() if decoder_of(name) == GRAMMAR_STRATEGY)
    return num_forced / num_accepted


def forced_token_share(stats: Sequence[dict[str, Any]]) -> float | None:
    """Tokens the grammar allowed alone (committed without a draft) / generated tokens; None when
    nothing was generated."""
    generated = sum(s["num_generated_tokens"] for s in stats)
    return sum(s["num_forced_tokens"] for s in stats) / generated if generated else None


def step_tokens(stats: dict[str, Any]) -> float:
    """The tokens a request's steps committed: its output's, and the stop token that ended it (absent
    in results written before it was counted: the output's alone)."""
    return stats.get("num_step_tokens", stats["num_generated_tokens"])


def speculation_figures(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance, accepted length, time per stage, per-decoder figures, entropy bins and the steps' plans."""
    proposed = sum(s["num_proposed"] for s in stats)
    accepted = sum(s["num_accepted"] for s in stats)
    steps = sum(s["num_steps"] for s in stats)
    decoders = sum_decoders(stats)
    return {
        "acceptance_rate": accepted / proposed if proposed else None,
        "num_proposed": proposed,
        "num_accepted": accepted,
        "mean_accepted_length": sum(step_tokens(s) for s in stats) / steps if steps else None,
        "outside_model_fraction": outside_fraction(stats),
        "stage_ms_per_step": stage_ms_per_step(stats),
        "decoders": decoders,
        "grammar_forced_share": grammar_forced_share(decoders, accepted),
        "forced_token_share": forced_token_share(stats),
        "entropy_bins": merge_entropy_bins(s["entropy_bins"] for s in stats),
        "num_steps_by_degree": sum_counts(s["num_steps_by_degree"] for s in stats),
        "num_steps_by_draft_length": sum_counts(s["num_steps_by_draft_length"] for s in stats),
        "num_probe_steps": sum(s["num_probe_steps"] for s in stats),
        "task_types": sorted({s["task_type"] for s in stats if s["task_type"]}),
    }


def num_same(records: Sequence[Record], references: dict[str, Record], by_text: bool) -> int | None:
    """How many records equal their prompt's reference (token ids, or decoded text across engines)."""
    pairs = [(r, references[r.prompt_id]) for r in records if r.prompt_id in references]
    if not pairs:
        return None
    return sum((r.text == ref.text) if by_text else (r.token_ids == ref.token_ids) for r, ref in pairs)


def speedups(records: Sequence[Record], references: Sequence[Record]) -> tuple[float | None, dict | None]:
    """(ratio of medians, spread of per-prompt ratios) of tokens/s over the references', both over the
    prompts that both answered (a prompt that failed on either side is left out of both medians, so
    they are of the same work).

    E.g. tok/s a: 4 vs 2, b: 2 vs 1, c: 3 vs 3 -> medians 3 / 2 = 1.5; per prompt [2, 2, 1], median 2.
    """
    ok_refs = {r.prompt_id: r for r in references if not r.error}
    ok = [r for r in records if not r.error and r.prompt_id in ok_refs]
    tps, ref_tps = spread([r.tokens_per_s for r in ok]), spread([ok_refs[r.prompt_id].tokens_per_s for r in ok])
    ratio_of_medians = tps["median"] / ref_tps["median"] if tps and ref_tps and ref_tps["median"] > 0 else None
    per_prompt = [
        r.tokens_per_s / ok_refs[r.prompt_id].tokens_per_s
        for r in ok
        if r.prompt_id in ok_refs and ok_refs[r.prompt_id].tokens_per_s > 0
    ]
    return ratio_of_medians, spread(per_prompt)


def json_figures(records: Sequence[Record]) -> dict[str, Any]:
    """Outputs of prompts with a schema: how many parse as JSON, how many validate, and the rates."""
    n = len(records)
    num_json = sum(bool(r.is_json) for r in records)
    num_valid = sum(bool(r.is_schema_valid) for r in records)
    return {
        "num_json": num_json,
        "num_schema_valid": num_valid,
        "json_parse_rate": num_json / n if n else None,
        "schema_validity_rate": num_valid / n if n else None,
    }


def summarize_system(
    records: Sequence[Record], baseline: Sequence[Record], own_greedy: Sequence[Record] | None = None
) -> dict[str, Any]:
    """The figures of one system in one scenario; baseline/own_greedy: the reference systems' records."""
    ok = [r for r in records if not r.error]
    ok_baseline = [r for r in baseline if not r.error]
    is_peer = any(r.system not in STACK_SYSTEMS for r in records)  # another engine: compare decoded text
    speedup, per_prompt = speedups(records, baseline)
    out: dict[str, Any] = {
        "num_prompts": len(records),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error}),
        "tokens_per_s": spread([r.tokens_per_s for r in ok]),
        "num_tokens": sum(r.num_tokens for r in ok),
        "speedup": speedup,
        "speedup_per_prompt": per_prompt,
        "num_same_as_baseline": num_same(ok, {r.prompt_id: r for r in ok_baseline}, by_text=is_peer),
        "compared_by": "text" if is_peer else "token_ids",
    }
    if own_greedy is not None:
        out["speedup_over_own_greedy"], out["speedup_over_own_greedy_per_prompt"] = speedups(records, own_greedy)
        out["num_same_as_own_greedy"] = num_same(ok, {r.prompt_id: r for r in own_greedy if not r.error}, by_text=False)
    checked = [r for r in ok if r.is_json is not None]
    if checked:
        out.update(json_figures(checked))
    stats = [r.stats for r in ok if r.stats is not None]
    if stats:
        out.update(speculation_figures(stats))
    return out


def summarize_scenario(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """System name -> summarize_system, for one scenario's records (baseline first, then as they came)."""
    by_system: dict[str, list[Record]] = {}
    for r in records:
        by_system.setdefault(r.system, []).append(r)
    baseline = by_system.get(BASELINE, [])
    out = {}
    for system, rows in by_system.items():
        own = system.removesuffix(LOOKUP_SUFFIX) if system.endswith(LOOKUP_SUFFIX) else None
        out[system] = summarize_system(rows, baseline, by_system.get(own) if own else None)
    return out


def machine_info() -> dict[str, Any]:
    """CPU model, cores, AVX-512 (VNNI, BF16), AMX and AVX2 flags, library versions and the date of the run."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "cpu_model": fields.get("model name", platform.processor()),
        "num_cpus": os.cpu_count(),
        "num_usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "avx512": "avx512f" in flags,
        "avx512_vnni": "avx512_vnni" in flags,  # the int8 dot products of the quantized kernels
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": "amx_tile" in flags,
        "avx2": "avx2" in flags,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in ("torch", "transformers", "llama_cpp_python", "grpcio")},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def finite(value: Any) -> Any:
    """value with infinities as None, recursively (JSON has no infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
