"""Running the systems of `python -m bench` on the chosen prompts, one precision at a time.

    run, records = measure_precision("fp32", config, selections, sweep_prompts, tokenizer, model_dir,
                                     peers=["transformers"], cache={})

Order: the stack first (redis + four services; per scenario and prompt a two-token request with
speculation off that puts the prompt in the primary's prefix cache and its schema compiled, then the
speculative request, then the baseline, so drift on a noisy machine hits both alike and both find the
prompt cached; then the concurrency sweep),
stopped before the peers run, so that idle services do not share the CPU with them. Each system
answers one short warm-up request first, and one under a small schema where a scenario is
constrained (not recorded; the warm-up prompts are not benchmark prompts, so the suffix index never
learns a measured output from them). The peers run each prompt
once: the json variants (bench/scenarios.py) differ only on the stack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.concurrency import run_sweep
from bench.peer_process import PeerProcess
from bench.peers import default_gguf_path, llama_cpp_missing
from bench.prompts import BenchPrompt
from bench.report import BASELINE, SPECULATIVE, Record, check_json, summarize_scenario
from bench.scenarios import is_constrained, prompt_file
from bench.stack import SystemUnderTest, run_request, system_under_test
from gateway.config import Limits
from specdec.v1 import primary_pb2, primary_pb2_grpc

if TYPE_CHECKING:  # bench.suite imports this module
    from bench.suite import Selection, SuiteConfig

WARMUP_PROMPT = BenchPrompt("warmup", "warmup", "Say hello.", None, None, False)
# Where a scenario is constrained, a warm-up under a schema as well: each service's first constrained
# call (the draft pool's first compile and grammar-forced Propose, the gateway's first tree masks, a
# masked Verify and Validate) costs its request ~20-30 ms once per stack (docs/benchmarks.md,
# "First constrained request"), which would fall on whichever measured prompt came first.
WARMUP_JSON_PROMPT = BenchPrompt(
    "warmup-json",
    "warmup",
    "Greet me in JSON.",
    None,
    {"type": "object", "properties": {"greeting": {"type": "string"}}, "required": ["greeting"]},
    False,
)
NUM_WARMUP_TOKENS = 8
# A prompt's priming request: two tokens, so that the primary decodes a run under its schema and
# compiles it beside the prefill (gateway.decode_run.DecodeRuns.run_format); one token would not.
NUM_PRIMING_TOKENS = 2
# KV room beyond the sequence length for the draft tokens of the last verify: the gateway's tree bound.
MAX_TREE_NODES = Limits().max_tree_nodes
MEASURED_ONCE = ("llamacpp",)  # peers whose weights do not depend on --precision
# transformers runs these as they are; the quantized formats have no CPU path there: it runs fp32.
FLOAT_PRECISIONS = ("fp32", "bf16", "fp16")


def peers_skipped(peers: Sequence[str]) -> dict[str, str]:
    """Peer name -> why it cannot run here."""
    reason = llama_cpp_missing() if "llamacpp" in peers else ""
    return {"llamacpp": reason} if reason else {}


def print_record(precision: str, r: Record) -> None:
    head = f"[{precision} {r.scenario}] {r.prompt_id} {r.system:>19}:"
    if r.error:
        print(f"{head} error {r.error} (recorded, not measured)", flush=True)
        return
    extra = ""
    if r.stats is not None and r.stats["num_proposed"]:
        extra = (
            f", acceptance {r.stats['num_accepted'] / r.stats['num_proposed']:.1%}, "
            f"{r.stats['num_generated_tokens'] / max(r.stats['num_steps'], 1):.2f} tokens/step"
        )
    if r.is_json is not None:
        extra += ", " + (
            "schema-valid JSON" if r.is_schema_valid else "JSON, not schema-valid" if r.is_json else "not JSON"
        )
    print(f"{head} {r.num_tokens} tokens in {r.seconds:.2f} s = {r.tokens_per_s:.1f} tok/s{extra}", flush=True)


def measure_stack(
    sut: SystemUnderTest,
    selections: Mapping[str, Selection],
    new_tokens: Mapping[str, int],  # scenario -> max_new_tokens of its requests
    tokenizer: Any,
    precision: str,
) -> list[Record]:
    is_any_constrained = any(
        is_constrained(scenario, prompt) for scenario, selection in selections.items() for prompt in selection.prompts
    )
    for system in (BASELINE, SPECULATIVE):
        run_request(sut, WARMUP_PROMPT, WARMUP_PROMPT.scenario, system, NUM_WARMUP_TOKENS, False, tokenizer)
        if is_any_constrained:
            run_request(sut, WARMUP_JSON_PROMPT, "warmup", system, NUM_WARMUP_TOKENS, True, tokenizer)
    records = []
    for scenario, selection in selections.items():
        for prompt in selection.prompts:
            # Speculative first: the pool's suffix index learns every output this server returns, so
            # a repeated request drafts from the very text it is asked for (measured, int4, third run
            # of a prompt: mean accepted length 4.8-5.4 against 2.3-3.0 on a fresh stack; a second
            # run, right after the baseline's, was within noise of a fresh one). It still learns from
            # earlier prompts of its scenario, as a server does from a tenant's. json_noschema repeats
            # json's prompts as a tenant of its own (run_request), so it drafts nothing from json's.
            # Before either, a priming request with speculation off puts the prompt in the primary's
            # prefix cache and has the gateway and the primary compile its schema, so both find them
            # there (otherwise the second would, and the first would not; a request with speculation
            # off never reaches the suffix index, nor the draft pool's own compile).
            run_request(
                sut, prompt, scenario, BASELINE, NUM_PRIMING_TOKENS, is_constrained(scenario, prompt), tokenizer
            )
            for system in (SPECULATIVE, BASELINE):
                record = run_request(
                    sut, prompt, scenario, system, new_tokens[scenario], is_constrained(scenario, prompt), tokenizer
                )
                print_record(precision, record)
                records.append(record)
    return records


def peer_record(
    system: str,
    scenario: str,
    prompt: BenchPrompt,
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    seconds: float,
    tokenizer: Any,
) -> Record:
    text = tokenizer.decode(token_ids)
    is_json, is_valid = check_json(text, prompt.schema) if prompt.schema is not None else (None, None)
    return Record(
        system,
        scenario,
        prompt.id,
        len(prompt_ids),
        tuple(token_ids),
        text,
        seconds,
        is_json=is_json,
        is_schema_valid=is_valid,
    )


def measure_peer(
    peer: Any, selections: Mapping[str, Selection], new_tokens: Mapping[str, int], tokenizer: Any, precision: str
) -> list[Record]:
    warmup_ids = WARMUP_PROMPT.token_ids(tokenizer)
    for system in peer.systems:
        peer.run(system, warmup_ids, NUM_WARMUP_TOKENS)
    records = []
    done: dict[tuple[str, str, str], Record] = {}  # (prompt file, prompt id, system) -> its first record
    for scenario, selection in selections.items():
        for prompt in selection.prompts:
            prompt_ids = prompt.token_ids(tokenizer)
            for system in peer.systems:
                key = (prompt_file(scenario), prompt.id, system)
                if key in done:  # the peers run json unconstrained: one measurement serves both variants
                    records.append(dataclasses.replace(done[key], scenario=scenario))
                    continue
                try:
                    token_ids, seconds = peer.run(system, prompt_ids, new_tokens[scenario])
                    record = peer_record(system, scenario, prompt, prompt_ids, token_ids, seconds, tokenizer)
                except Exception as e:  # a peer's failure is a figure of this run, not the end of it
                    record = Record(
                        system, scenario, prompt.id, len(prompt_ids), (), "", 0.0, error=f"{type(e).__name__}: {e}"
                    )
                print_record(precision, record)
                records.append(record)
                done[key] = record
    return records


def make_peer(
    name: str, precision: str, num_threads: int, sequence_length: int, tokenizer: Any, model_dir: Path
) -> PeerProcess:
    """The peer in a child process of its own (see bench.peer_process)."""
    options = {"num_threads": num_threads, "eos_token_ids": list(tokenizer.eos_token_ids)}
    if name == "transformers":
        options |= {"model_dir": str(model_dir), "precision": precision}
    else:
        options |= {"gguf_path": str(default_gguf_path()), "num_context": sequence_length}
    return PeerProcess(name, options)


def prompt_token_mismatches(
    records: Sequence[Record], tokenizer: Any, selections: Mapping[str, Selection]
) -> list[str]:
    """Prompts whose token count at the gateway differs from the ids the peers get (should be none)."""
    expected = {p.id: len(p.token_ids(tokenizer)) for s in selections.values() for p in s.prompts}
    return sorted(
        {
            f"{r.prompt_id}: gateway {r.num_prompt_tokens}, peers {expected[r.prompt_id]}"
            for r in records
            if not r.error and r.num_prompt_tokens != expected[r.prompt_id]
        }
    )


def measure_precision(
    precision: str,
    config: SuiteConfig,
    selections: Mapping[str, Selection],
    sweep_prompts: Sequence[BenchPrompt],
    tokenizer: Any,
    model_dir: Path,
    peers: Sequence[str],
    cache: dict[str, list[Record]],
) -> tuple[dict[str, Any], list[Record]]:
    """Every system at one precision: (the run's summary for results.json, its records)."""
    max_context = config.max_context_tokens + MAX_TREE_NODES
    new_tokens = {name: config.new_tokens(name) for name in selections}
    with system_under_test(precision, config.threads, max_context) as sut:
        served = served_precision(sut)
        print(f"[{precision}] the primary serves {served['precision']} ({served['precision_choice']})", flush=True)
        records = measure_stack(sut, selections, new_tokens, tokenizer, precision)
        sweep = (
            run_sweep(sut, sweep_prompts, config.concurrency, config.max_new_tokens, config.is_schema)
            if config.concurrency
            else []
        )
    mismatches = prompt_token_mismatches(records, tokenizer, selections)
    for line in mismatches:
        print(f"warning: prompt token count differs, {line}", flush=True)
    peer_precision = served["precision"] if served["precision"] in FLOAT_PRECISIONS else "fp32"
    failed = _measure_peers(peers, peer_precision, config, selections, tokenizer, model_dir, cache, records)
    scenarios = {
        name: _scenario_summary(name, s, new_tokens[name], [r for r in records if r.scenario == name])
        for name, s in selections.items()
    }
    return (
        {
            "scenarios": scenarios,
            "concurrency": sweep,
            "prompt_token_mismatches": mismatches,
            "peers_failed": failed,
            "served_precision": served["precision"],
            "precision_choice": served["precision_choice"],
            "transformers_precision": peer_precision,
        },
        records,
    )


def _measure_peers(
    peers: Sequence[str],
    precision: str,
    config: SuiteConfig,
    selections: Mapping[str, Selection],
    tokenizer: Any,
    model_dir: Path,
    cache: dict[str, list[Record]],
    records: list[Record],
) -> dict[str, str]:
    """Each peer's records (cached across precisions) appended to `records`; {peer: why} of those that failed."""

    def measure_new(name: str) -> list[Record]:
        peer = make_peer(name, precision, config.threads, config.max_context_tokens, tokenizer, model_dir)
        try:
            new_tokens = {scenario: config.new_tokens(scenario) for scenario in selections}
            measured = measure_peer(peer, selections, new_tokens, tokenizer, precision)
        finally:
            peer.close()  # one model at a time on the machine
        if name in MEASURED_ONCE:
            cache[name] = measured
        return measured

    failed = {}
    for name in peers:
        try:
            records.extend(cache[name] if name in cache else measure_new(name))
        except Exception as e:  # e.g. a model that does not load: the other systems' figures still count
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"peer {name} failed: {failed[name]}", flush=True)
    return failed


def _scenario_summary(name: str, s: Selection, max_new_tokens: int, records: list[Record]) -> dict[str, Any]:
    """One scenario's entry of results.json: its prompts and every system's summary over `records`."""
    return {
        "num_prompts": len(s.prompts),
        "num_skipped": s.num_skipped,
        "max_new_tokens": max_new_tokens,
        "num_considered": s.num_considered,  # long only (null otherwise): its token window's filter
        "num_in_window": s.num_in_window,
        "prompt_file": prompt_file(name),
        "prompt_ids": [p.id for p in s.prompts],
        "is_constrained": any(is_constrained(name, p) for p in s.prompts),
        "systems": summarize_scenario(records),
    }


def served_precision(sut: SystemUnderTest) -> dict[str, str]:
    """The weight format the primary serves (auto's pick) and how it was chosen."""
    with sut.stack.channel("primary") as channel:
        info = primary_pb2_grpc.PrimaryServiceStub(channel).GetModelInfo(primary_pb2.GetModelInfoRequest(), timeout=30)
    return {"precision": info.precision, "precision_choice": info.precision_choice}
