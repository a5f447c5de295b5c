"""python -m bench sampled: seeded sampled decoding through the stack, speculation off and on.

The suite (`python -m bench`) is greedy everywhere; users of a chat API mostly sample. Each prompt
of each scenario (the first --num-prompts rows of bench/data/<scenario>.jsonl whose prompt and answer
fit 2,048 tokens, chat prompts through the model's template, json without its schema) is answered
once per seed by two systems of one stack:

    plain        speculation off (GenerateRequest.speculation.is_enabled = False): the primary alone
    speculative  the product defaults (adaptive controller, default decoders, runs that draft)

(after a two-token request with speculation off that puts the prompt in the primary's prefix cache,
so that both find it there) with the same sampling (--temperature, --top-p) and a fixed seed
(--schema: json rows under their schema, as response_format). A seeded token is drawn from the
seed's stream for its position whatever decided it (specdec.sampling.make_generator), so the two
answers must be the same tokens: the `same` column counts the pairs that are.

Printed per scenario: median tokens/s of each system (output tokens / client wall time, prefill
included), the speedup (ratio of medians), tokens per step of the speculative system and the share
of its tokens the primary's runs drafted and kept (`prompt_lookup@run` and `answers@run` in
GenerationStats.decoders).

    python -m bench sampled [--scenarios code,prose,json] [--num-prompts 3] [--seeds 1,2]
                            [--temperature 0.7] [--top-p 0.9] [--max-new-tokens 128] [--schema]
                            [--precision auto] [--num-threads 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.measure import NUM_PRIMING_TOKENS, NUM_WARMUP_TOKENS, WARMUP_PROMPT
from bench.prompts import DEFAULT_DATA_DIR, BenchPrompt, check_scenarios, load_prompts
from bench.stack import REQUEST_TIMEOUT_S, SystemUnderTest, build_request, system_under_test
from bench.suite import Selection, select_prompts
from specdec.flag_spellings import add_spellings
from specdec.model.loader import default_cache_dir, resolve_model_dir
from specdec.model.tokenizer import Tokenizer
from specdec.v1 import common_pb2, gateway_pb2

SYSTEMS = ("plain", "speculative")
RUN_DRAFTS = ("prompt_lookup@run", "answers@run")  # GenerationStats.decoders' rows of the primary's own drafts
MAX_CONTEXT = 2048


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    token_ids: tuple[int, ...]
    seconds: float
    stats: gateway_pb2.GenerationStats

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def run_drafted_accepted(self) -> int:
        return sum(d.num_accepted for d in self.stats.decoders if d.name in RUN_DRAFTS)


def answer(
    sut: SystemUnderTest,
    prompt: BenchPrompt,
    system: str,
    sampling: common_pb2.SamplingParams,
    max_new_tokens: int,
    is_schema: bool = False,
) -> Answer:
    """One answer, timed by the client; is_schema: the row's JSON schema as its response_format."""
    is_constrained = is_schema and prompt.schema is not None
    req = build_request(prompt, max_new_tokens, is_speculative=system == "speculative", is_constrained=is_constrained)
    req.sampling.CopyFrom(sampling)
    started = time.perf_counter()
    response = sut.stub.Generate(req, timeout=REQUEST_TIMEOUT_S)
    return Answer(tuple(response.token_ids), time.perf_counter() - started, response.stats)


def answer_prompt(
    sut: SystemUnderTest,
    prompt: BenchPrompt,
    samplings: list[common_pb2.SamplingParams],
    max_new_tokens: int,
    is_schema: bool = False,
) -> list[dict[str, Answer]]:
    """Per sampling (seed), the prompt's plain and speculative answer. First a short request with
    speculation off puts the prompt in the primary's prefix cache (as the suite's priming request,
    bench.measure): otherwise the plain answer, asked first, would pay the prompt's prefill and leave
    it cached for the speculative one, which would gain that prefill as speedup. With speculation off,
    it teaches the learned answers nothing."""
    answer(sut, prompt, "plain", samplings[0], NUM_PRIMING_TOKENS, is_schema)
    return [{s: answer(sut, prompt, s, sampling, max_new_tokens, is_schema) for s in SYSTEMS} for sampling in samplings]


def warm_up(sut: SystemUnderTest, temperature: float) -> None:
    """One short answer of each system, not recorded, on the suite's warm-up prompt (bench.measure):
    not a measured one, whose speculative answer the primary would keep as a learned answer and draft
    that prompt's measured answers from."""
    sampling = common_pb2.SamplingParams(temperature=temperature, seed=0)
    for system in SYSTEMS:
        answer(sut, WARMUP_PROMPT, system, sampling, NUM_WARMUP_TOKENS)


def fitting_prompts(
    data_dir: str | Path,
    scenario: str,
    num_prompts: int,
    max_new_tokens: int,
    count_tokens: Callable[[BenchPrompt], int],
) -> Selection:
    """The scenario's first num_prompts rows whose prompt (chat template applied) and max_new_tokens fit
    MAX_CONTEXT, as the suite chooses them (bench.suite.select_prompts); the stack would refuse the others."""
    rows = load_prompts(data_dir, [scenario], num_prompts=1 << 30)
    return select_prompts(rows, count_tokens, num_prompts, max_new_tokens, MAX_CONTEXT)


def scenario_row(scenario: str, pairs: list[dict[str, Answer]]) -> dict[str, Any]:
    """A scenario's figures over its pairs; without pairs (no row fit the context), none, so that the
    other scenarios' rows are still printed and written."""
    if not pairs:
        return {"scenario": scenario, "answers": 0, **{key: None for key, _ in COLUMNS[2:]}, "same": "0/0"}
    rates = {s: statistics.median(p[s].tokens_per_second for p in pairs) for s in SYSTEMS}
    speculative = [p["speculative"] for p in pairs]
    num_tokens = sum(len(a.token_ids) for a in speculative)
    return {
        "scenario": scenario,
        "answers": len(pairs),
        **{f"{s}_tok_s": round(rates[s], 1) for s in SYSTEMS},
        "speedup": round(rates["speculative"] / rates["plain"], 2) if rates["plain"] else 0.0,
        "tokens_per_step": round(num_tokens / max(1, sum(a.stats.num_steps for a in speculative)), 2),
        "run_drafted_share": round(sum(a.run_drafted_accepted for a in speculative) / max(1, num_tokens), 3),
        "same": f"{sum(p['plain'].token_ids == p['speculative'].token_ids for p in pairs)}/{len(pairs)}",
    }


COLUMNS = (
    ("scenario", "scenario"),
    ("answers", "answers"),
    ("plain_tok_s", "plain tok/s"),
    ("speculative_tok_s", "speculative tok/s"),
    ("speedup", "speedup"),
    ("tokens_per_step", "tok/step"),
    ("run_drafted_share", "run-drafted share"),
    ("same", "same tokens"),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--scenarios", default="code,prose,json")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--schema", action="store_true", help="json rows with their schema as response_format")
    p.add_argument("--precision", default="auto")
    p.add_argument("--num-threads", type=int, default=0, help="the primary's torch threads (0: torch's default)")
    p.add_argument("--out", default=None, help="also write the rows and settings as JSON here")
    args = add_spellings(p).parse_args()
    check_scenarios(p, args.scenarios, args.data_dir)
    return args


def main() -> None:
    args = parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    scenarios = [s for s in args.scenarios.split(",") if s]
    tokenizer = Tokenizer.from_dir(resolve_model_dir(None, default_cache_dir()))

    def count_tokens(prompt: BenchPrompt) -> int:
        return len(prompt.token_ids(tokenizer))

    selections = {
        s: fitting_prompts(args.data_dir, s, args.num_prompts, args.max_new_tokens, count_tokens) for s in scenarios
    }
    for scenario, selection in selections.items():
        if selection.num_skipped:
            print(f"# {scenario}: {selection.num_skipped} rows passed over (prompt + answer over {MAX_CONTEXT} tokens)")
    rows = []
    with system_under_test(args.precision, args.num_threads, MAX_CONTEXT) as sut:
        warm_up(sut, args.temperature)
        for scenario in scenarios:
            pairs = []
            for prompt in selections[scenario].prompts:
                samplings = [
                    common_pb2.SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=seed)
                    for seed in seeds
                ]
                for seed, pair in zip(seeds, answer_prompt(sut, prompt, samplings, args.max_new_tokens, args.schema)):
                    pairs.append(pair)
                    print(
                        json.dumps(
                            {
                                "prompt": prompt.id,
                                "seed": seed,
                                **{f"{s}_tok_s": round(pairs[-1][s].tokens_per_second, 1) for s in SYSTEMS},
                                "tokens": len(pairs[-1]["speculative"].token_ids),
                                "steps": pairs[-1]["speculative"].stats.num_steps,
                                "same": pairs[-1]["plain"].token_ids == pairs[-1]["speculative"].token_ids,
                            }
                        ),
                        flush=True,
                    )
            rows.append(scenario_row(scenario, pairs))
    print()
    print(
        f"# sampled: temperature {args.temperature}, top_p {args.top_p}, seeds {seeds}, precision {args.precision}"
        + (", json under its schema" if args.schema else "")
    )
    print("| " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |")
    if args.out:
        keys = ("temperature", "top_p", "seeds", "precision", "max_new_tokens", "schema")
        settings = {k: getattr(args, k) for k in keys}
        Path(args.out).write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
