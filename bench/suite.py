"""python -m bench: the headline benchmark. One run, one machine, one model (the default
SmolLM2-135M-Instruct), the same prompts for every system, greedy everywhere.

    python -m bench [--scenarios json,code,prose[,specbench,long]] [--num-prompts 3] [--max-new-tokens 128]
                    [--sequence-length 2048] [--precision auto[,int4,fp32,...]] [--peers transformers,llamacpp]
                    [--no-schema] [--concurrency 1,4,16,32] [--threads N] [--data-dir DIR]
                    [--out results/results.json]
    python -m bench engine|validator|drafts ...     the component benchmarks (bench/__main__.py)

Systems, per precision:
    baseline      the four services through the gateway (gRPC, Redis), speculation off
                  (GenerateRequest.speculation.is_enabled = False)
    speculative   the same stack with the product defaults: speculation on, adaptive controller on
    transformers, transformers_lookup   AutoModelForCausalLM.generate on the same converted weights,
                  greedy / prompt_lookup_num_tokens=10
    llamacpp, llamacpp_lookup   llama-cpp-python on the model's GGUF (Q4_1, measured once per run),
                  greedy / LlamaPromptLookupDecoding; skipped (a line and results.json's
                  peers_skipped) when llama_cpp is not installed: `make bench-deps`
Every system gets the same prompt token ids: the model's chat template (BenchPrompt.text) for chat
prompts, the raw text for completion-style ones. The stack's outputs are compared with the
baseline's token for token, the peers' by decoded text (different engines).

Scenarios (bench/scenarios.py): json runs twice on the stack, on the same prompts: "json" sends each
row's schema as response_format (TYPE_JSON_SCHEMA) to baseline and speculative alike, "json_noschema"
sends no response_format; --no-schema keeps only "json_noschema". The peers run the json prompts
unconstrained, once; their records are listed under both json scenarios. An RPC error is recorded for
that system and scenario, not raised. Every output of a json row is checked: parses as JSON,
validates against the row's schema (jsonschema, Draft 7).

Prompts: the first --num-prompts rows of each scenario file (after --first-prompt rows), in file
order, whose prompt tokens + --max-new-tokens fit --sequence-length; the rows skipped on the way are
counted. The long scenario
(bench/scenarios.py; not in the default set, not in the concurrency sweep) takes, round robin over
specbench, prose and code (the files present), the rows with 1,500-1,900 prompt tokens, and prints how
many rows it considered and how many fit; it asks for 256 new tokens (--max-new-tokens overrides),
and the stack and llama.cpp are started with room for 1,900 + 256 tokens (+ the tree).

Figures (bench/report.py), per scenario and system:
    tokens/s        generated tokens / client wall time of the call, prefill included; median and
                    min/q1/q3/max over prompts
    speedup         ratio of medians: median tok/s of the system / median tok/s of the baseline, over
                    the prompts both answered without an error
                    (speedup_over_own_greedy likewise for a peer's prompt lookup over its greedy)
    speedup_per_prompt  median of ratios: per prompt, the system's tok/s / the baseline's on the same
                    prompt; median and spread over prompts (less sensitive to a slow moment of a noisy
                    machine, which hits both requests of a prompt alike)
    acceptance rate = accepted / proposed draft tokens; mean accepted length = tokens per step
    outside model compute  (total_ms - forward_ms - model-based drafting ms) / total_ms, summed over
                    prompts, from GenerationStats: forward_ms is the primary's forward passes
                    (StageTimes.forward_ms), model-based drafting the time_ms of the early_exit and
                    layer_skip decoders; everything else (RPC, encoding, queueing, validation, state,
                    cheap drafters, Python) is outside
    stage_ms_per_step  the composition of a step: draft (of which draft_model: model-based decoders),
                    forward, verify_minus_forward (RPC, queueing, logits encoding), validate, commit,
                    state, other, total; summed ms over prompts / summed steps (the prefill call is in
                    verify and total: a step count does not include it)
    json            json_parse_rate, schema_validity_rate: shares of the outputs; grammar_forced_share:
                    the grammar decoder's accepted tokens / all accepted draft tokens
    acceptance by entropy bin (GenerationStats.entropy_bins); the adaptive controller's choices
                    (steps by degree / draft length, probe steps, task types) from GenerationStats.
The concurrency sweep is bench/concurrency.py's.

Writes results.json, results.md (the tables, also printed) and results.png next to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.peers import PEERS
from bench.prompts import DEFAULT_DATA_DIR, BenchPrompt, load_prompts
from bench.report import finite, machine_info
from bench.scenarios import (
    LONG,
    LONG_MAX_NEW_TOKENS,
    LONG_MAX_PROMPT_TOKENS,
    LONG_MIN_PROMPT_TOKENS,
    LONG_SOURCES,
    SCENARIOS,
    prompt_file,
    run_scenarios,
)
from specdec.model.options import AUTO
from specdec.model.options import PRECISIONS as WEIGHT_PRECISIONS
from specdec.flag_spellings import add_spellings

PRECISIONS = (AUTO, *WEIGHT_PRECISIONS)
DEFAULT_OUT = Path("results") / "results.json"


@dataclasses.dataclass(frozen=True, slots=True)
class SuiteConfig:
    data_dir: Path = DEFAULT_DATA_DIR
    scenarios: tuple[str, ...] = ("json", "code", "prose")  # prompt files; json runs as bench.scenarios says
    num_prompts: int = 3  # per scenario
    max_new_tokens: int = 128
    sequence_length: int = 2048  # prompt + max_new_tokens budget, as in the reference article
    precisions: tuple[str, ...] = (AUTO,)  # the primary's --precision; auto: its measured choice
    peers: tuple[str, ...] = ("transformers", "llamacpp")
    is_schema: bool = True  # json also with response_format (scenario "json"), not only without
    concurrency: tuple[int, ...] = ()  # client counts of the sweep; (): no sweep
    num_threads: int = 0  # 0: the CPUs this process may use
    out: Path = DEFAULT_OUT
    long_max_new_tokens: int = LONG_MAX_NEW_TOKENS  # the long scenario's requests
    first_prompt: int = 0  # rows of each file passed over first: other prompts than the usual ones

    def __post_init__(self) -> None:
        for name, values, known in (
            ("scenarios", self.scenarios, SCENARIOS),
            ("precision", self.precisions, PRECISIONS),
            ("peers", self.peers, tuple(PEERS)),
        ):
            unknown = set(values) - set(known)
            if unknown:
                raise ValueError(f"--{name}: unknown {sorted(unknown)}; known: {', '.join(known)}")
        if not self.scenarios or not self.precisions:
            raise ValueError("--scenarios and --precision must name at least one")
        if self.num_prompts < 1 or self.max_new_tokens < 1 or self.long_max_new_tokens < 1:
            raise ValueError("--num-prompts and --max-new-tokens must be >= 1")
        if self.sequence_length <= self.max_new_tokens:
            raise ValueError(f"--sequence-length ({self.sequence_length}) must exceed --max-new-tokens")
        if any(n < 1 for n in self.concurrency):
            raise ValueError(f"--concurrency levels must be >= 1, got {self.concurrency}")
        if self.num_threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.num_threads}")
        if self.first_prompt < 0:
            raise ValueError(f"--first-prompt must be >= 0, got {self.first_prompt}")

    @property
    def threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))

    @property
    def measured_scenarios(self) -> tuple[str, ...]:
        """The scenarios measured on the stack, e.g. ("json", "json_noschema", "code")."""
        return run_scenarios(self.scenarios, self.is_schema)

    def new_tokens(self, scenario: str) -> int:
        """max_new_tokens of a scenario's requests."""
        return self.long_max_new_tokens if scenario == LONG else self.max_new_tokens

    @property
    def max_context_tokens(self) -> int:
        """Prompt + output tokens the stack and llama.cpp must hold: --sequence-length, or more for
        the long scenario's longest prompt and its new tokens."""
        long = LONG_MAX_PROMPT_TOKENS + self.long_max_new_tokens if LONG in self.scenarios else 0
        return max(self.sequence_length, long)


def _names(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def parse_config(argv: Sequence[str] | None = None) -> SuiteConfig:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--scenarios", default="json,code,prose")
    p.add_argument("--num-prompts", type=int, default=3, help="prompts per scenario")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"new tokens per request (default 128; {LONG}: {LONG_MAX_NEW_TOKENS}); given, it holds for every scenario",
    )
    p.add_argument("--sequence-length", type=int, default=2048, help="prompt + output budget")
    p.add_argument(
        "--precision",
        default=AUTO,
        help=f"comma list of {', '.join(PRECISIONS)} (default auto: the format the primary measures fastest here)",
    )
    p.add_argument("--peers", default="transformers,llamacpp", help="comma list; empty for none")
    p.add_argument(
        "--no-schema",
        action="store_true",
        help="run the json prompts only without response_format (default: with and without)",
    )
    p.add_argument("--concurrency", default="", help="client counts of the sweep, e.g. 1,4,16,32")
    p.add_argument("--threads", type=int, default=0, help="threads of the primary and the peers; 0: all CPUs")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results.json path (.md and .png beside it)")
    p.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        help="rows of each scenario file to pass over (e.g. 3: rows the default run does not use)",
    )
    a = add_spellings(p).parse_args(argv)
    try:
        return SuiteConfig(
            a.data_dir,
            _names(a.scenarios),
            a.num_prompts,
            128 if a.max_new_tokens is None else a.max_new_tokens,
            a.sequence_length,
            _names(a.precision),
            _names(a.peers),
            not a.no_schema,
            tuple(int(n) for n in _names(a.concurrency)),
            a.threads,
            a.out,
            LONG_MAX_NEW_TOKENS if a.max_new_tokens is None else a.max_new_tokens,
            a.first_prompt,
        )
    except ValueError as e:
        p.error(str(e))


@dataclasses.dataclass(frozen=True, slots=True)
class Selection:
    prompts: tuple[BenchPrompt, ...]
    num_skipped: int  # rows passed over before the selection was complete: too long for the budget
    # the long scenario's filter (select_long): rows of its source files, and those inside its window
    num_considered: int | None = None
    num_in_window: int | None = None


def select_prompts(
    candidates: Iterable[BenchPrompt],
    count_tokens: Callable[[BenchPrompt], int],
    num_prompts: int,
    max_new_tokens: int,
    sequence_length: int,
) -> Selection:
    """The first num_prompts candidates, in order, whose tokens + max_new_tokens fit sequence_length.

    E.g. token counts [10, 50, 20, 30], max_new_tokens 8, sequence_length 32, num_prompts 2
      -> the 1st and 3rd, 1 skipped (the 4th is never looked at).
    """
    chosen: list[BenchPrompt] = []
    num_skipped = 0
    for prompt in candidates:
        if len(chosen) == num_prompts:
            break
        if count_tokens(prompt) + max_new_tokens > sequence_length:
            num_skipped += 1
        else:
            chosen.append(prompt)
    return Selection(tuple(chosen), num_skipped)


def select_long(
    groups: Sequence[Sequence[BenchPrompt]], count_tokens: Callable[[BenchPrompt], int], num_prompts: int
) -> Selection:
    """The long scenario's prompts: of each group (a source file's rows, in file order), the rows whose
    tokens fall in [LONG_MIN_PROMPT_TOKENS, LONG_MAX_PROMPT_TOKENS]; then round robin over the groups,
    the first num_prompts. Every row is counted, so the output can say how many were considered and how
    many fit; num_skipped is the rows outside the window.

    E.g. groups [[a: 1600, b: 300], [c: 2500, d: 1900]], num_prompts 3 -> a, d; 4 considered, 2 fit.
    """
    fits = [[p for p in g if LONG_MIN_PROMPT_TOKENS <= count_tokens(p) <= LONG_MAX_PROMPT_TOKENS] for g in groups]
    num_considered, num_in_window = sum(map(len, groups)), sum(map(len, fits))
    chosen = interleave(fits)[:num_prompts]
    return Selection(tuple(chosen), num_considered - num_in_window, num_considered, num_in_window)


def long_sources(data_dir: Path) -> tuple[str, ...]:
    """The long scenario's source files present in data_dir (specbench is not shipped)."""
    return tuple(name for name in LONG_SOURCES if (data_dir / f"{name}.jsonl").is_file())


def interleave(groups: Sequence[Sequence[BenchPrompt]]) -> list[BenchPrompt]:
    """Round robin over groups: [[a1, a2], [b1]] -> [a1, b1, a2]."""
    out: list[BenchPrompt] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def choose_prompts(config: SuiteConfig, tokenizer: Any) -> tuple[dict[str, Selection], list[BenchPrompt]]:
    """Per measured scenario, its prompts (the json variants share theirs); and the concurrency sweep's own
    prompts (the rows after the measured ones, the files mixed)."""
    files = [name for name in config.scenarios if name != LONG]  # the sweep's: short prompts
    num_sweep = math.ceil(sum(config.concurrency) / len(files)) if files else 0

    def count_tokens(p: BenchPrompt) -> int:
        return len(p.token_ids(tokenizer))

    by_file, sweep_groups = {}, []
    if LONG in config.scenarios:
        groups = [load_prompts(config.data_dir, [name], num_prompts=1 << 30) for name in long_sources(config.data_dir)]
        by_file[LONG] = select_long(groups, count_tokens, config.num_prompts)
    for name in files:
        rows = load_prompts(config.data_dir, [name], num_prompts=1 << 30)[config.first_prompt :]
        main = select_prompts(rows, count_tokens, config.num_prompts, config.max_new_tokens, config.sequence_length)
        by_file[name] = main
        if num_sweep:
            rest = rows[len(main.prompts) + main.num_skipped :]  # the rows after the last one examined
            sweep_groups.append(
                select_prompts(rest, count_tokens, num_sweep, config.max_new_tokens, config.sequence_length).prompts
            )
    selections = {s: by_file[prompt_file(s)] for s in config.measured_scenarios}
    return selections, interleave(sweep_groups)[: sum(config.concurrency)]


def describe_selection(s: Selection, data_dir: Path) -> str:
    """E.g. "2 prompts (a, b), 1 skipped as too long", or the long scenario's filter."""
    head = f"{len(s.prompts)} prompts ({', '.join(p.id for p in s.prompts)})"
    if s.num_considered is None:
        return f"{head}, {s.num_skipped} skipped as too long"
    return (
        f"{head}: of {s.num_considered} rows of {', '.join(long_sources(data_dir))}, {s.num_in_window} have "
        f"{LONG_MIN_PROMPT_TOKENS}-{LONG_MAX_PROMPT_TOKENS} prompt tokens (chat template included)"
    )


def config_dict(config: SuiteConfig) -> dict[str, Any]:
    out = dataclasses.asdict(config)
    out.update(
        data_dir=str(config.data_dir),
        out=str(config.out),
        num_threads=config.threads,
        measured_scenarios=list(config.measured_scenarios),
        max_context_tokens=config.max_context_tokens,
    )
    if LONG in config.scenarios:
        out["long_filter"] = {
            "sources": list(long_sources(config.data_dir)),
            "min_prompt_tokens": LONG_MIN_PROMPT_TOKENS,
            "max_prompt_tokens": LONG_MAX_PROMPT_TOKENS,
        }
    return out


def write_results(results: dict[str, Any], out: Path) -> str:
    """results.json, results.md and results.png at out's place; returns the markdown."""
    from bench.chart import write_chart
    from bench.tables import render_markdown

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite(results), indent=2))
    markdown = render_markdown(results)
    out.with_suffix(".md").write_text(markdown)
    write_chart(results, out.with_suffix(".png"))
    return markdown


def main(argv: Sequence[str] | None = None) -> None:
    """Choose the prompts, measure every precision (bench/measure.py), write and print the results."""
    from bench.measure import measure_precision, peers_skipped
    from specdec.model.loader import default_cache_dir, resolve_model_dir
    from specdec.model.tokenizer import Tokenizer

    config = parse_config(argv)
    model_dir = resolve_model_dir(None, default_cache_dir())
    tokenizer = Tokenizer.from_dir(model_dir)
    selections, sweep_prompts = choose_prompts(config, tokenizer)
    if len(sweep_prompts) < sum(config.concurrency):
        raise SystemExit(
            f"the concurrency sweep needs {sum(config.concurrency)} prompts that fit the sequence "
            f"length beyond the measured ones; the data has {len(sweep_prompts)}"
        )
    for scenario, s in selections.items():
        print(f"[{scenario}] {describe_selection(s, config.data_dir)}", flush=True)
    skipped = peers_skipped(config.peers)
    for name, reason in skipped.items():
        print(f"peer {name} skipped: {reason}", flush=True)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "config": config_dict(config),
        "peers_skipped": skipped,
        "definitions": __doc__,
        "runs": {},
        "records": {},
    }
    cache: dict[str, Any] = {}  # measurements shared by the precisions (llama.cpp runs its own weights)
    for precision in config.precisions:
        run, records = measure_precision(
            precision,
            config,
            selections,
            sweep_prompts,
            tokenizer,
            model_dir,
            [p for p in config.peers if p not in skipped],
            cache,
        )
        results["runs"][precision] = run
        results["records"][precision] = [r.to_dict() for r in records]
    print(write_results(results, config.out))
    print(f"wrote {config.out}, {config.out.with_suffix('.md')}, {config.out.with_suffix('.png')}")
