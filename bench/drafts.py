"""Draft-pool figures through the whole pipeline: acceptance per decoder and for the pool, per
scenario, speedup over the same stack with speculation off, and the draft process's memory.

    python -m bench.drafts [--scenarios json,code,prose] [--num-prompts 3] [--max-new-tokens 96]
                           [--strategies prompt_lookup,suffix_index,early_exit,layer_skip]

Starts the four services (specdec.launcher.Stack, fp32, the default model), sends every prompt
with speculation off, then on, greedy, and checks the outputs are identical. Figures, not tests.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import grpc

from bench.prompts import load_prompts
from specdec.launcher import DRAFT, PRIMARY, Stack, StackConfig
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, primary_pb2, primary_pb2_grpc


def smaps_rollup(pid: int) -> dict[str, int]:
    """kB counters of /proc/PID/smaps_rollup (Rss, Pss, Private_Clean, Private_Dirty, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


def run(stub, prompt, is_enabled: bool, strategies: list[str], max_new_tokens: int,
        is_adaptive: bool = False) -> gateway_pb2.GenerateResponse:
    req = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
    req.speculation.is_enabled = is_enabled
    if is_enabled:
        req.speculation.strategies.extend(strategies)
        req.speculation.speculative_degree = len(strategies)
        req.speculation.is_adaptive = is_adaptive  # False: every decoder proposes at every step
    if prompt.is_completion:
        req.prompt = prompt.prompt
    else:
        req.chat.messages.extend(gateway_pb2.ChatMessage(role=m["role"], content=m["content"])
                                 for m in prompt.messages())
    return stub.Generate(req, timeout=1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="json,code,prose")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--strategies", default="prompt_lookup,suffix_index")
    p.add_argument("--adaptive", action="store_true",
                   help="let the gateway's controller choose decoders and draft length (bounded by the above)")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    strategies = args.strategies.split(",")
    prompts = load_prompts(args.data_dir, args.scenarios.split(","), args.num_prompts, max_chars=1500)
    results: dict = {"strategies": strategies, "max_new_tokens": args.max_new_tokens, "adaptive": args.adaptive,
                     "scenarios": {}}
    with Stack(StackConfig(strategies=tuple(strategies))) as stack, \
            grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        for scenario in args.scenarios.split(","):
            rows = {"plain_tps": [], "spec_tps": [], "same": 0, "n": 0, "proposed": 0, "accepted": 0,
                    "generated": 0, "steps": 0, "decoders": {}}
            for prompt in (x for x in prompts if x.scenario == scenario):
                plain = run(stub, prompt, False, strategies, args.max_new_tokens)
                spec = run(stub, prompt, True, strategies, args.max_new_tokens, args.adaptive)
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
            speedup = statistics.median(rows["spec_tps"]) / statistics.median(rows["plain_tps"])
            results["scenarios"][scenario] = {
                "prompts": rows["n"], "identical_outputs": rows["same"],
                "plain_tokens_per_s": statistics.median(rows["plain_tps"]),
                "speculative_tokens_per_s": statistics.median(rows["spec_tps"]), "speedup": speedup,
                "pool_acceptance_rate": rows["accepted"] / max(rows["proposed"], 1),
                "mean_accepted_length": rows["generated"] / max(rows["steps"], 1),
                "decoders": {n: {"proposed": v[0], "accepted": v[1], "acceptance_rate": v[1] / max(v[0], 1),
                                 "time_ms": v[2]} for n, v in rows["decoders"].items()}}
            r = results["scenarios"][scenario]
            print(f"[{scenario}] {r['prompts']} prompts, identical {r['identical_outputs']}/{r['prompts']} | plain "
                  f"{r['plain_tokens_per_s']:.1f} tok/s, speculative {r['speculative_tokens_per_s']:.1f} tok/s "
                  f"({speedup:.2f}x) | pool acceptance {r['pool_acceptance_rate']:.1%}, mean accepted length "
                  f"{r['mean_accepted_length']:.2f}")
            for name, d in r["decoders"].items():
                print(f"    {name:16s} proposed {d['proposed']:6d} accepted {d['accepted']:6d} "
                      f"({d['acceptance_rate']:.1%}), {d['time_ms']:.0f} ms drafting")
        with grpc.insecure_channel(stack.addresses[PRIMARY]) as ch:
            weight_bytes = primary_pb2_grpc.PrimaryServiceStub(ch).GetStats(primary_pb2.GetStatsRequest()).weight_bytes
        mem = smaps_rollup(stack.pid(DRAFT))
        private_kb = mem.get("Private_Clean", 0) + mem.get("Private_Dirty", 0)
        results["draft_memory_kb"] = mem
        results["weight_bytes"] = weight_bytes
        print(f"draft process: Rss {mem['Rss'] / 1024:.0f} MiB, Pss {mem['Pss'] / 1024:.0f} MiB, private (USS) "
              f"{private_kb / 1024:.0f} MiB; primary weights {weight_bytes / 2**20:.0f} MiB")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
