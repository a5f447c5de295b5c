"""python -m bench simulate: N = 1..64 nodes behind G gateways and Redis, under a Poisson load, by
discrete-event simulation from measured per-node figures.

    python -m bench simulate [--node-profile FILE] [--nodes 1,2,4,8,16,32,64] [--gateways 4]
                             [--redis-masters 1] [--cluster-masters 1,3,6] [--routings affinity,random]
                             [--load 0.8 | --rate-per-node R] [--seed 0] [--out FILE]
    python -m bench simulate --measure --measure-out FILE   # a profile measured here, then simulate on it

The node profile (bench/sim_profile.py; default bench/data/node_profile_xeon.json, each figure citing
its measurement in docs/benchmarks.md) gives the engine step time by rows, the prefill cost per
prompt token, the gateway's CPU per generated token and a Redis server's ops/s. The model is in
bench/sim_model.py. Each N gets rate_per_node x N requests a second (default: --load x what one node
completes when every prompt misses the prefix cache, bench.sim_model.node_capacity_req_per_s), so
the offered load per node is the same at every N and what changes is the shared servers' share.

Prints, per routing and N: offered load, generated tok/s, TTFT p50/p99, the prefix-cache hit rate,
Redis ops per request step (a gateway round: one state write) and per second, the busiest Redis
master's and gateway's utilisation, the nodes' mean utilisation; then where the gateways and Redis
(one server, or a Redis Cluster of M masters whose index key sits on one of them) saturate, from the
per-node demand of the largest N whose servers all stayed below 90 %. Deterministic for a --seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.sim_config import ROUTINGS, SimConfig
from bench.sim_model import SimResult, node_capacity_req_per_s, simulate
from bench.sim_profile import DEFAULT_PROFILE, NodeProfile, ProfileError, load_profile
from specdec.flag_spellings import add_spellings

DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64)
SATURATED = 0.9  # a server this busy is past the knee of its queue


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or any(v < 1 or v > 1024 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers in 1..1024, got {text!r}")
    return values


def routing_list(text: str) -> tuple[str, ...]:
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if not values or any(v not in ROUTINGS for v in values):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(ROUTINGS)}, got {text!r}")
    return values


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--node-profile", type=Path, default=DEFAULT_PROFILE, help="measured per-node figures (JSON)")
    p.add_argument("--measure", action="store_true", help="measure the engine and Redis here first")
    p.add_argument("--measure-out", type=Path, default=None, help="write the measured profile here")
    p.add_argument("--measure-precision", default="int4")
    p.add_argument("--measure-repeats", type=int, default=5)
    p.add_argument("--nodes", type=int_list, default=DEFAULT_NODES, help="comma list of node counts N")
    p.add_argument("--gateways", type=int, default=4, help="gateways G (one core each)")
    p.add_argument("--redis-masters", type=int, default=1, help="Redis masters simulated (1: one server)")
    p.add_argument("--cluster-masters", type=int_list, default=(1, 3, 6), help="masters M for the saturation points")
    p.add_argument("--routings", type=routing_list, default=ROUTINGS)
    p.add_argument("--load", type=float, default=0.8, help="offered load per node, x its no-cache capacity")
    p.add_argument("--rate-per-node", type=float, default=None, help="requests/s per node (overrides --load)")
    defaults = SimConfig()
    for field in dataclasses.fields(SimConfig):
        if field.name in ("num_nodes", "num_gateways", "num_redis_masters", "rate_per_s", "routing"):
            continue
        flag = "--" + field.name.replace("_", "-")
        p.add_argument(flag, type=type(getattr(defaults, field.name)), default=getattr(defaults, field.name))
    p.add_argument("--out", type=Path, default=None, help="write every row as JSON here")
    return add_spellings(p).parse_args(list(argv))


def config_for(args: argparse.Namespace, num_nodes: int, routing: str, rate_per_node: float) -> SimConfig:
    names = {f.name for f in dataclasses.fields(SimConfig)}
    fixed = {"num_nodes", "num_gateways", "num_redis_masters", "rate_per_s", "routing"}
    return SimConfig(
        num_nodes=num_nodes,
        num_gateways=args.gateways,
        num_redis_masters=args.redis_masters,
        rate_per_s=rate_per_node * num_nodes,
        routing=routing,
        **{name: getattr(args, name) for name in names - fixed},
    )


def quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def summary(r: SimResult) -> dict[str, Any]:
    c = r.config
    num_ops = r.redis_ops_per_s * c.window_s
    return {
        "routing": c.routing,
        "num_nodes": c.num_nodes,
        "offered_req_per_s": c.rate_per_s,
        "offered_tok_per_s": c.rate_per_s * c.output_tokens,
        "throughput_tok_per_s": r.throughput_tok_per_s,
        "ttft_p50_s": quantile(r.ttft_s, 0.5),
        "ttft_p99_s": quantile(r.ttft_s, 0.99),
        "num_without_first_token": sum(math.isinf(x) for x in r.ttft_s),
        "prefix_hit_rate": r.prefix_hit_rate,
        "redis_ops_per_request_step": num_ops / r.num_request_steps if r.num_request_steps else math.nan,
        "redis_ops_per_s": r.redis_ops_per_s,
        "redis_max_utilisation": r.redis_max_utilisation,
        "gateway_max_utilisation": max(r.gateway_utilisations),
        "node_utilisation": r.node_utilisation,
        "rows_per_step": r.rows_per_step,
        "mean_in_system": r.mean_in_system,
        "arrivals_x_sojourn": r.num_arrivals / c.window_s * r.mean_sojourn_s,
    }


def seconds(x: float) -> str:
    return "unserved" if math.isinf(x) else f"{x:.2f} s" if x >= 1 else f"{x * 1000:.0f} ms"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| routing | N | offered req/s | offered tok/s | tok/s | TTFT p50 | TTFT p99 | prefix hits "
        "| Redis ops / request step | Redis ops/s | Redis util | gateway util | node util |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in rows:
        lines.append(
            f"| {s['routing']} | {s['num_nodes']} | {s['offered_req_per_s']:.1f} | {s['offered_tok_per_s']:,.0f} "
            f"| {s['throughput_tok_per_s']:,.0f} | {seconds(s['ttft_p50_s'])} | {seconds(s['ttft_p99_s'])} "
            f"| {s['prefix_hit_rate']:.1%} | {s['redis_ops_per_request_step']:.2f} | {s['redis_ops_per_s']:,.0f} "
            f"| {s['redis_max_utilisation']:.1%} | {s['gateway_max_utilisation']:.1%} | {s['node_utilisation']:.1%} |"
        )
    return "\n".join(lines)


def saturation(results: list[SimResult], cluster_masters: Sequence[int]) -> list[str]:
    """Where the gateways and Redis saturate, from the per-node demand of the largest N whose servers
    all stayed below SATURATED (that demand is the same at every N: the offered load is per node)."""

    def is_unsaturated(r: SimResult) -> bool:
        busiest = max(r.redis_max_utilisation, max(r.gateway_utilisations), r.node_utilisation)
        return busiest < SATURATED

    calm = [r for r in results if is_unsaturated(r)]
    if not calm:
        return [f"every row had a server at >= {SATURATED:.0%}: no per-node demand to extrapolate from"]
    base = max(calm, key=lambda r: r.config.num_nodes)
    g, a, b = base.gateway_cores_per_node, base.redis_step_busy_per_node, base.redis_index_busy_per_node
    lines = [
        f"per node (from N = {base.config.num_nodes}, {base.config.routing}): gateway {g:.3f} cores, "
        f"Redis {a:.5f} s/s of scripts + {b:.6f} s/s of index commands",
        f"gateways: {base.config.num_gateways} saturate at N ~ {base.config.num_gateways / g:.1f} "
        f"(one gateway core per {1 / g:.2f} nodes)",
    ]
    for m in cluster_masters:
        # the busiest master: its 1/M of the scripts plus every index command
        lines.append(f"Redis, {m} master{'s' if m > 1 else ''}: saturates at N ~ {1 / (a / m + b):,.0f}")
    for r in results:
        if not is_unsaturated(r):
            lines.append(
                f"simulated {r.config.routing} N = {r.config.num_nodes}: gateways {max(r.gateway_utilisations):.0%}, "
                f"Redis {r.redis_max_utilisation:.0%}, nodes {r.node_utilisation:.0%} busy"
            )
            break
    return lines


def load_or_measure(args: argparse.Namespace) -> NodeProfile:
    profile = load_profile(args.node_profile)
    if not args.measure:
        return profile
    from bench.sim_measure import measure_in_process

    profile = measure_in_process(profile, args.measure_precision, args.measure_repeats, num_redis_ops=200_000)
    if args.measure_out is not None:
        args.measure_out.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    return profile


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.measure_out is not None and not args.measure:
        raise SystemExit("python -m bench simulate: error: --measure-out needs --measure")
    if args.measure_repeats < 1:
        raise SystemExit(f"python -m bench simulate: error: --measure-repeats must be >= 1, got {args.measure_repeats}")
    try:
        profile = load_or_measure(args)
        capacity = node_capacity_req_per_s(profile, config_for(args, 1, "affinity", 1.0))
        rate_per_node = args.rate_per_node if args.rate_per_node is not None else args.load * capacity
        configs = [config_for(args, n, routing, rate_per_node) for routing in args.routings for n in args.nodes]
    except (ProfileError, ValueError) as e:
        raise SystemExit(f"python -m bench simulate: error: {e}") from None
    print(f"profile: {profile.machine}")
    print(
        f"one node's capacity without prefix-cache hits {capacity:.2f} req/s; offered {rate_per_node:.2f} req/s a node"
    )
    results = [simulate(profile, c) for c in configs]
    rows = [summary(r) for r in results]
    print(table(rows))
    for line in saturation(results, args.cluster_masters):
        print(line)
    if args.out is not None:
        out = {"profile": profile.to_json(), "rows": rows, "configs": [dataclasses.asdict(c) for c in configs]}
        args.out.write_text(json.dumps(out, indent=1))
