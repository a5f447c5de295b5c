"""Draft-pool figures through the whole pipeline: acceptance per decoder and for the pool, per
scenario, acceptance by the primary's entropy, speedup over the same stack with speculation off,
and the draft process's memory.

    python -m bench.drafts [--scenarios json,code,prose] [--num-prompts 3] [--max-new-tokens 96]
                           [--strategies prompt_lookup,suffix_index,early_exit,layer_skip] [--adaptive]

Starts the four services (specdec.launcher.Stack, fp32, the default model) offering --strategies,
waits until the draft pool has attached the primary's weights when a model-based decoder
(early_exit, layer_skip) is named, then sends every prompt with speculation off, then on, greedy,
and checks the outputs are identical. Figures, not tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.prompts import DEFAULT_DATA_DIR, BenchPrompt, load_prompts
from specdec import strategies
from specdec.launcher import DRAFT, PRIMARY, Stack, StackConfig
from specdec.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, primary_pb2, primary_pb2_grpc

# The draft decoders that run over the primary's weights, attached by the draft pool in the background
# after it starts serving (draft_svc/weights.py): until then they propose nothing.
MODEL_DECODERS = strategies.names_of(strategies.MODEL)
# Those, and the corpus decoder, whose index the pool opens (or builds) in the background.
BACKGROUND_DECODERS = MODEL_DECODERS + (strategies.CORPUS_STRATEGY,)
# The probe's prompt: any ids inside every vocabulary; a few tokens keep the probe's forward cheap.
PROBE_TOKEN_IDS = (1, 2, 3, 4)
PROBE_INTERVAL_S = 0.25


def smaps_rollup(pid: int) -> dict[str, int]:
    """kB counters of /proc/PID/smaps_rollup (Rss, Pss, Private_Clean, Private_Dirty, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


def wait_for_model_decoders(
    stack: Stack, strategies: Sequence[str], timeout_s: float = 120.0, probe_token_ids: Sequence[int] = PROBE_TOKEN_IDS
) -> float:
    """Block until every background decoder among `strategies` (model-based, corpus) proposes tokens
    in the stack's draft pool; returns the seconds waited. Raises TimeoutError after timeout_s.

    Each probe is one Propose of `probe_token_ids` (for the corpus decoder: text its corpus holds)
    straight to the draft service under a fresh request id, released unfinished afterwards (so
    nothing joins the suffix index)."""
    wanted = [s for s in strategies if s in BACKGROUND_DECODERS]
    started = time.monotonic()
    if not wanted:
        return 0.0
    with stack.channel(DRAFT) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        for attempt in itertools.count():
            request_id = f"bench-attach-probe-{attempt}"
            reply = stub.Propose(
                draft_pb2.ProposeRequest(
                    request_id=request_id, prompt_token_ids=probe_token_ids, strategies=wanted, draft_length=1
                ),
                timeout=60,
            )
            stub.Release(draft_pb2.DraftServiceReleaseRequest(request_id=request_id), timeout=60)
            if {s.name for s in reply.decoder_stats if s.num_proposed > 0} >= set(wanted):
                break
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(
                    f"the draft pool did not propose with {wanted} within {timeout_s:g} s "
                    f"(weights not attached, corpus index not built? see {stack.log_path(DRAFT)})"
                )
            time.sleep(PROBE_INTERVAL_S)
    return time.monotonic() - started


def run(
    stub, prompt: BenchPrompt, is_enabled: bool, strategies: list[str], max_new_tokens: int, is_adaptive: bool = False
) -> gateway_pb2.GenerateResponse:
    req = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
    req.speculation.is_enabled = is_enabled
    if is_enabled:
        req.speculation.strategies.extend(strategies)
        req.speculation.speculative_degree = len(strategies)
        req.speculation.is_adaptive = is_adaptive  # False: every decoder proposes at every step
    if prompt.is_completion:
        req.prompt = prompt.prompt
    else:
        req.chat.messages.extend(
            gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt.messages()
        )
    return stub.Generate(req, timeout=1800)


def bin_label(lower: float, upper: float) -> str:
    return f"[{lower:g}, {'inf' if math.isinf(upper) else f'{upper:g}'})"


def measure_scenario(
    stub, prompts: list[BenchPrompt], strategies: list[str], max_new_tokens: int, is_adaptive: bool
) -> dict:
    """Each prompt plain, then speculative; the scenario's figures (medians of tokens/s, summed counts)."""
    rows: dict[str, Any] = {
        "plain_tps": [],
        "spec_tps": [],
        "same": 0,
        "n": 0,
        "proposed": 0,
        "accepted": 0,
        "generated": 0,
        "steps": 0,
        "decoders": {},
        "entropy": {},
    }
    for prompt in prompts:
        plain = run(stub, prompt, False, strategies, max_new_tokens)
        spec = run(stub, prompt, True, strategies, max_new_tokens, is_adaptive)
        rows["n"] += 1
        rows["same"] += list(plain.token_ids) == list(spec.token_ids)
        rows["plain_tps"].append(plain.stats.tokens_per_second)
        rows["spec_tps"].append(spec.stats.tokens_per_second)
        s = spec.stats
        rows["proposed"] += s.num_proposed_tokens
        rows["accepted"] += s.num_accepted_tokens
        rows["generated"] += s.num_generated_tokens
        rows["steps"] += s.num_steps
        for d in s.decoders:
            agg = rows["decoders"].setdefault(d.name, [0, 0, 0.0])
            agg[0] += d.num_proposed
            agg[1] += d.num_accepted
            agg[2] += d.time_ms
        for b in s.entropy_bins:
            agg = rows["entropy"].setdefault(bin_label(b.lower, b.upper), [0, 0])
            agg[0] += b.num_proposed
            agg[1] += b.num_accepted
    plain_tps, spec_tps = statistics.median(rows["plain_tps"]), statistics.median(rows["spec_tps"])
    return {
        "prompts": rows["n"],
        "identical_outputs": rows["same"],
        "plain_tokens_per_s": plain_tps,
        "speculative_tokens_per_s": spec_tps,
        "speedup": spec_tps / plain_tps,
        "pool_acceptance_rate": rows["accepted"] / max(rows["proposed"], 1),
        "mean_accepted_length": rows["generated"] / max(rows["steps"], 1),
        "decoders": {
            n: {"proposed": v[0], "accepted": v[1], "acceptance_rate": v[1] / max(v[0], 1), "time_ms": v[2]}
            for n, v in rows["decoders"].items()
        },
        # Decision events (rows where the tree offered a child) by the primary's entropy there, nats.
        "entropy_bins": {
            label: {"decisions": v[0], "accepted": v[1], "acceptance_rate": v[1] / max(v[0], 1)}
            for label, v in rows["entropy"].items()
        },
    }


def print_scenario(scenario: str, r: dict) -> None:
    print(
        f"[{scenario}] {r['prompts']} prompts, identical {r['identical_outputs']}/{r['prompts']} | plain "
        f"{r['plain_tokens_per_s']:.1f} tok/s, speculative {r['speculative_tokens_per_s']:.1f} tok/s "
        f"({r['speedup']:.2f}x) | pool acceptance {r['pool_acceptance_rate']:.1%}, mean accepted length "
        f"{r['mean_accepted_length']:.2f}"
    )
    for name, d in r["decoders"].items():
        print(
            f"    {name:16s} proposed {d['proposed']:6d} accepted {d['accepted']:6d} "
            f"({d['acceptance_rate']:.1%}), {d['time_ms']:.0f} ms drafting"
        )
    bins = [f"{label} {b['accepted']}/{b['decisions']}" for label, b in r["entropy_bins"].items() if b["decisions"]]
    if bins:
        print(f"    accepted/decided by entropy (nats): {', '.join(bins)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="json,code,prose")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--strategies", default="prompt_lookup,suffix_index")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="let the gateway's controller choose decoders and draft length (bounded by the above)",
    )
    p.add_argument(
        "--attach-timeout-s",
        type=float,
        default=120.0,
        help="how long to wait for the draft pool to attach the primary's weights",
    )
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    strategies = args.strategies.split(",")
    scenarios = args.scenarios.split(",")
    prompts = load_prompts(args.data_dir, scenarios, args.num_prompts, max_chars=1500)
    results: dict = {
        "strategies": strategies,
        "max_new_tokens": args.max_new_tokens,
        "adaptive": args.adaptive,
        "scenarios": {},
    }
    with (
        Stack(StackConfig(strategies=tuple(strategies))) as stack,
        grpc.insecure_channel(stack.gateway_address) as channel,
    ):
        # The corpus decoder joins once its index is open: at once when `python -m draft_svc.corpus
        # build` built it beforehand; the default probe's ids are in no corpus, so it is not awaited.
        waited_s = wait_for_model_decoders(stack, [s for s in strategies if s in MODEL_DECODERS], args.attach_timeout_s)
        if waited_s:
            print(f"draft pool proposing with {[s for s in strategies if s in MODEL_DECODERS]} after {waited_s:.1f} s")
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        for scenario in scenarios:
            chosen = [x for x in prompts if x.scenario == scenario]
            results["scenarios"][scenario] = measure_scenario(
                stub, chosen, strategies, args.max_new_tokens, args.adaptive
            )
            print_scenario(scenario, results["scenarios"][scenario])
        with stack.channel(PRIMARY) as ch:
            weight_bytes = primary_pb2_grpc.PrimaryServiceStub(ch).GetStats(primary_pb2.GetStatsRequest()).weight_bytes
        mem = smaps_rollup(stack.pid(DRAFT))
        private_kb = mem.get("Private_Clean", 0) + mem.get("Private_Dirty", 0)
        results["draft_memory_kb"] = mem
        results["weight_bytes"] = weight_bytes
        print(
            f"draft process: Rss {mem['Rss'] / 1024:.0f} MiB, Pss {mem['Pss'] / 1024:.0f} MiB, private (USS) "
            f"{private_kb / 1024:.0f} MiB; primary weights {weight_bytes / 2**20:.0f} MiB"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
