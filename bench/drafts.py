"""Draft-pool figures through the whole pipeline: draft mixes compared on the same prompts, per
scenario: mean accepted length, tokens/s, speedup over the same stack with speculation off, draft ms
per step; per decoder acceptance, acceptance by tree depth and draft ms per step; acceptance by the
primary's entropy; and the draft process's memory.

    python -m bench drafts [--scenarios json,code,prose] [--num-prompts 3] [--max-new-tokens 96]
                           [--mixes "prompt_lookup,suffix_index;feature;prompt_lookup,suffix_index,feature"]
                           [--adaptive] [--tree-leaves 4] [--feature-drafter PATH]

Each mix (";"-separated, each a ","-separated list of strategies; --strategies A,B is one mix) runs
on the same prompts, each on a stack of its own (the suffix index learns every finished answer, so a
shared pool would let a later mix draft from an earlier mix's answers): the four services
(specdec.launcher.Stack, the default model) offering the mix's strategies, once the draft pool has
attached the primary's weights when a model-based decoder is named (the feature drafter: once the
pool reports its measured cost in GetPoolInfo, as it does when the drafter binds), and warmed up on
a short prompt that is not measured, with speculation off and with the mix. Every prompt runs
with speculation off, then with the mix, greedy, and the outputs are compared (both after a two-token
request that puts the prompt in the primary's prefix cache). A mix naming a
strategy the pool does not offer (the feature drafter without its file) is skipped with a note.
Without --adaptive every decoder gives one candidate every step, except a mix of tree decoders
alone, which gives --tree-leaves (the leaves of its tree); with it the gateway's controller chooses.
Figures, not tests.
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

from bench.measure import NUM_PRIMING_TOKENS, NUM_WARMUP_TOKENS, WARMUP_PROMPT
from bench.prompts import DEFAULT_DATA_DIR, BenchPrompt, check_scenarios, load_prompts
from bench.report import step_tokens, sum_decoders
from bench.stack import stats_dict
from specdec import strategies as strategies_module
from specdec.launcher import DRAFT, PRIMARY, Stack, StackConfig
from specdec.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, primary_pb2, primary_pb2_grpc
from specdec.flag_spellings import add_spellings

# The draft decoders that run over the primary's weights, attached by the draft pool in the background
# after it starts serving (draft_svc/weights.py): until then they propose nothing.
MODEL_DECODERS = strategies_module.names_of(strategies_module.MODEL)
# Those, and the corpus decoder, whose index the pool opens (or builds) in the background.
BACKGROUND_DECODERS = MODEL_DECODERS + (strategies_module.CORPUS_STRATEGY,)
# Awaited through their measured cost (GetPoolInfo), not a Propose: they need the primary's features.
FEATURE_DECODERS = strategies_module.FEATURE_STRATEGIES
# Today's mix, the feature drafter alone, and both (the gateway's default set where it is offered).
DEFAULT_MIXES = "prompt_lookup,suffix_index;feature;prompt_lookup,suffix_index,feature"
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


def degree_of(strategies: Sequence[str], tree_leaves: int) -> int:
    """Candidates per step of a fixed mix: one per decoder; a mix of tree decoders alone, its leaves."""
    if strategies and set(strategies) <= strategies_module.TREE_STRATEGIES:
        return len(strategies) * tree_leaves
    return len(strategies)


def run(
    stub,
    prompt: BenchPrompt,
    is_enabled: bool,
    strategies: list[str],
    max_new_tokens: int,
    is_adaptive: bool = False,
    tree_leaves: int = 1,
) -> gateway_pb2.GenerateResponse:
    req = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
    req.speculation.is_enabled = is_enabled
    if is_enabled:
        req.speculation.strategies.extend(strategies)
        req.speculation.speculative_degree = degree_of(strategies, tree_leaves)
        req.speculation.is_adaptive = is_adaptive  # False: every decoder proposes at every step
    if prompt.is_completion:
        req.prompt = prompt.prompt
    else:
        req.chat.messages.extend(
            gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt.messages()
        )
    return stub.Generate(req, timeout=1800)


def warm_up(stub, strategies: list[str], is_adaptive: bool, tree_leaves: int) -> None:
    """One short answer with speculation off and one with the mix, not recorded, on the suite's
    warm-up prompt (bench.measure) before a stack's first measured prompt: the stack's first calls
    pay one-time costs (connections, the draft pool's first Propose of the mix, the first tree's
    verify), which would fall on the first prompt's speculative answer alone. Not a measured prompt:
    the suffix index learns every finished answer and would draft that prompt's answers from it."""
    run(stub, WARMUP_PROMPT, False, [], NUM_WARMUP_TOKENS)
    run(stub, WARMUP_PROMPT, True, strategies, NUM_WARMUP_TOKENS, is_adaptive, tree_leaves)


def measure_mix(
    stub, name: str, mix: list[str], prompts: list[BenchPrompt], scenarios: list[str], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """One mix's stack warmed up, then every scenario's prompts plain then speculative: {scenario: its
    figures, with this stack's plain tokens/s}."""
    warm_up(stub, mix, args.adaptive, args.tree_leaves)
    out = {}
    for scenario in scenarios:
        chosen = [x for x in prompts if x.scenario == scenario]
        r = measure_scenario(stub, chosen, {name: mix}, args.max_new_tokens, args.adaptive, args.tree_leaves)
        out[scenario] = {"prompts": r["prompts"], "plain_tokens_per_s": r["plain_tokens_per_s"], **r["mixes"][name]}
    return out


def bin_label(lower: float, upper: float) -> str:
    return f"[{lower:g}, {'inf' if math.isinf(upper) else f'{upper:g}'})"


def measure_scenario(
    stub,
    prompts: list[BenchPrompt],
    mixes: dict[str, list[str]],
    max_new_tokens: int,
    is_adaptive: bool,
    tree_leaves: int = 1,
) -> dict:
    """Each prompt plain, then with each mix; the scenario's figures per mix (medians of tokens/s,
    summed counts). Before either, a short request with speculation off puts the prompt in the
    primary's prefix cache (as the suite's priming request, bench.measure): otherwise the plain run
    would pay the prompt's prefill and leave it cached for the mixes, whose tokens/s would gain it."""
    plain_tps: list[float] = []
    plain_ids: list[list[int]] = []
    spec_stats: dict[str, list[dict[str, Any]]] = {name: [] for name in mixes}
    spec_tps: dict[str, list[float]] = {name: [] for name in mixes}
    same = dict.fromkeys(mixes, 0)
    for prompt in prompts:
        run(stub, prompt, False, [], NUM_PRIMING_TOKENS)
        plain = run(stub, prompt, False, [], max_new_tokens)
        plain_tps.append(plain.stats.tokens_per_second)
        plain_ids.append(list(plain.token_ids))
        for name, strategies in mixes.items():
            spec = run(stub, prompt, True, strategies, max_new_tokens, is_adaptive, tree_leaves)
            same[name] += list(plain.token_ids) == list(spec.token_ids)
            spec_tps[name].append(spec.stats.tokens_per_second)
            spec_stats[name].append(stats_dict(spec.stats))
    plain_median = statistics.median(plain_tps) if plain_tps else 0.0
    return {
        "prompts": len(prompts),
        "plain_tokens_per_s": plain_median,
        "mixes": {name: mix_figures(spec_stats[name], spec_tps[name], plain_median, same[name]) for name in mixes},
    }


def mix_figures(stats: list[dict[str, Any]], tps: list[float], plain_tps: float, num_same: int) -> dict[str, Any]:
    """One mix over a scenario's prompts: speed, accepted length, draft time per speculative step (the
    gateway's draft stage: the Propose round trip), per decoder figures (bench.report.sum_decoders)."""
    steps = sum(s["num_steps"] for s in stats)
    speculative_steps = steps - sum(s["num_steps_by_draft_length"][0] for s in stats if s["num_steps_by_draft_length"])
    proposed, accepted = sum(s["num_proposed"] for s in stats), sum(s["num_accepted"] for s in stats)
    spec_tps = statistics.median(tps) if tps else 0.0
    entropy: dict[str, list[int]] = {}
    for s in stats:
        for b in s["entropy_bins"]:
            agg = entropy.setdefault(bin_label(b["lower"], b["upper"]), [0, 0])
            agg[0] += b["num_proposed"]
            agg[1] += b["num_accepted"]
    return {
        "identical_outputs": num_same,
        "speculative_tokens_per_s": spec_tps,
        "speedup": spec_tps / plain_tps if plain_tps else None,
        "pool_acceptance_rate": accepted / max(proposed, 1),
        "mean_accepted_length": sum(step_tokens(s) for s in stats) / max(steps, 1),
        "speculative_steps": speculative_steps,
        "draft_ms_per_step": sum(s["stage_ms"]["draft"] for s in stats) / max(speculative_steps, 1),
        "decoders": sum_decoders(stats),
        # Decision events (rows where the tree offered a child) by the primary's entropy there, nats.
        "entropy_bins": {
            label: {"decisions": v[0], "accepted": v[1], "acceptance_rate": v[1] / max(v[0], 1)}
            for label, v in entropy.items()
        },
    }


def print_scenario(scenario: str, r: dict) -> None:
    print(f"[{scenario}] {r['prompts']} prompts")
    for mix, m in r["mixes"].items():
        speedup = "—" if m["speedup"] is None else f"{m['speedup']:.2f}x"
        print(
            f"  {mix}: identical {m['identical_outputs']}/{r['prompts']} | {m['speculative_tokens_per_s']:.1f} tok/s "
            f"against plain {m['plain_tokens_per_s']:.1f} ({speedup}) | mean accepted length "
            f"{m['mean_accepted_length']:.2f}, pool acceptance "
            f"{m['pool_acceptance_rate']:.1%} | draft {m['draft_ms_per_step']:.1f} ms per speculative step"
        )
        for name, d in m["decoders"].items():
            line = (
                f"      {name:16s} accepted/proposed {d['num_accepted']:6d}/{d['num_proposed']:<6d} "
                f"({(d['acceptance_rate'] or 0.0):.1%})"
            )
            if d["mean_accepted_length"] is not None:
                depths = " ".join("—" if a is None else f"{a:.0%}" for a in d["acceptance_by_depth"])
                line += (
                    f", mean accepted length {d['mean_accepted_length']:.2f}, "
                    f"{d['draft_ms_per_step']:.2f} ms/step, by depth {depths}"
                )
            print(line)
        bins = [f"{label} {b['accepted']}/{b['decisions']}" for label, b in m["entropy_bins"].items() if b["decisions"]]
        if bins:
            print(f"      accepted/decided by entropy (nats): {', '.join(bins)}")


def parse_mixes(mixes: str, strategies: str | None) -> dict[str, list[str]]:
    """ "a,b;c" -> {"a,b": [a, b], "c": [c]}; --strategies, when given, is the one mix."""
    text = strategies if strategies else mixes
    out = {}
    for mix in text.split(";"):
        names = [n for n in mix.split(",") if n]
        if names:
            strategies_module.check_names(names)
            out[",".join(names)] = names
    if not out:
        raise SystemExit("no draft mix to run")
    return out


def wait_for_measured_costs(stack: Stack, strategies: Sequence[str], timeout_s: float) -> tuple[set[str], float]:
    """(the strategies the pool offers, seconds waited): until every offered strategy of
    specdec.strategies.MEASURED_STRATEGIES among `strategies` has its measured cost (its drafter bound
    to the attached weights; a feature drafter proposes nothing before it has the primary's features,
    so a Propose probe cannot tell)."""
    started = time.monotonic()
    with stack.channel(DRAFT) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        while True:
            info = stub.GetPoolInfo(draft_pb2.GetPoolInfoRequest(), timeout=60)
            offered = set(info.strategies)
            wanted = offered & strategies_module.MEASURED_STRATEGIES & set(strategies)
            if wanted <= {c.strategy for c in info.draft_costs}:
                for c in info.draft_costs:
                    print(f"draft pool measured {c.strategy}: {c.fixed_ms:.2f} ms + {c.per_token_ms:.2f} ms per depth")
                return offered, time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"the draft pool did not measure {sorted(wanted)} within {timeout_s:g} s")
            time.sleep(PROBE_INTERVAL_S)


def run_mix(
    name: str,
    mix: list[str],
    args: argparse.Namespace,
    prompts: list[BenchPrompt],
    scenarios: list[str],
    extra_env: dict,
) -> dict[str, dict[str, Any]] | None:
    """One mix on a stack of its own (the suffix index learns every finished output: mixes sharing a
    pool would draft later prompts from earlier mixes' answers), every scenario's prompts plain then
    speculative: {scenario: its figures, with this stack's plain tokens/s}; None when the pool does not
    offer the mix (the feature drafter without its file)."""
    with (
        Stack(StackConfig(strategies=tuple(mix), extra_env=extra_env)) as stack,
        grpc.insecure_channel(stack.gateway_address) as channel,
    ):
        offered, waited_s = wait_for_measured_costs(stack, mix, args.attach_timeout_s)
        if not set(mix) <= offered:
            missing = sorted(set(mix) - offered)
            print(f"skipping mix {name}: the draft pool does not offer {missing} (see {stack.log_path(DRAFT)})")
            return None
        # The corpus decoder joins once its index is open: at once when `python -m draft_svc.corpus
        # build` built it beforehand; the default probe's ids are in no corpus, so it is not awaited.
        proposing = [s for s in mix if s in MODEL_DECODERS and s not in FEATURE_DECODERS]
        waited_s += wait_for_model_decoders(stack, proposing, args.attach_timeout_s)
        if waited_s:
            print(f"[{name}] draft pool ready after {waited_s:.1f} s")
        out = measure_mix(gateway_pb2_grpc.GenerationServiceStub(channel), name, mix, prompts, scenarios, args)
        with stack.channel(PRIMARY) as ch:
            weight_bytes = primary_pb2_grpc.PrimaryServiceStub(ch).GetStats(primary_pb2.GetStatsRequest()).weight_bytes
        mem = smaps_rollup(stack.pid(DRAFT))
        private_kb = mem.get("Private_Clean", 0) + mem.get("Private_Dirty", 0)
        print(
            f"[{name}] draft process: Rss {mem['Rss'] / 1024:.0f} MiB, Pss {mem['Pss'] / 1024:.0f} MiB, private "
            f"(USS) {private_kb / 1024:.0f} MiB; primary weights {weight_bytes / 2**20:.0f} MiB"
        )
        for figure in out.values():
            figure.update(draft_memory_kb=mem, weight_bytes=weight_bytes)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="json,code,prose")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--mixes", default=DEFAULT_MIXES, help="draft mixes compared, ';'-separated")
    p.add_argument("--strategies", default=None, help="one mix instead of --mixes, e.g. prompt_lookup,suffix_index")
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="let the gateway's controller choose decoders and draft length (bounded by the above)",
    )
    p.add_argument("--tree-leaves", type=int, default=4, help="candidates of a fixed mix of tree decoders alone")
    p.add_argument("--feature-drafter", default=None, help="the draft pool's feature drafter file (default: its own)")
    p.add_argument(
        "--attach-timeout-s",
        type=float,
        default=120.0,
        help="how long to wait for the draft pool to attach the primary's weights",
    )
    p.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR))
    p.add_argument("--out", default=None)
    args = add_spellings(p).parse_args()
    check_scenarios(p, args.scenarios, args.data_dir)
    mixes = parse_mixes(args.mixes, args.strategies)
    scenarios = args.scenarios.split(",")
    prompts = load_prompts(args.data_dir, scenarios, args.num_prompts, max_chars=1500)
    extra_env = {} if args.feature_drafter is None else {"SPECDEC_DRAFT_FEATURE_DRAFTER": args.feature_drafter}
    results: dict = {
        "mixes": mixes,
        "max_new_tokens": args.max_new_tokens,
        "adaptive": args.adaptive,
        "tree_leaves": args.tree_leaves,
        "scenarios": {},
    }
    results["skipped_mixes"] = {}
    for name, mix in mixes.items():
        figures = run_mix(name, mix, args, prompts, scenarios, extra_env)
        if figures is None:
            results["skipped_mixes"][name] = mix
            continue
        for scenario, figure in figures.items():
            results["scenarios"].setdefault(scenario, {"prompts": figure["prompts"], "mixes": {}})
            results["scenarios"][scenario]["mixes"][name] = figure
    for scenario, r in results["scenarios"].items():
        print_scenario(scenario, r)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
