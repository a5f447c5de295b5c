"""python -m bench load: many clients at once against one stack, for a bounded time.

    python -m bench load --clients 16 --duration 60 --max-new-tokens 64 --mix json,code,prose [--stream]
    python -m bench load --soak                     # 16 clients for 10 minutes
    python -m bench load --address 127.0.0.1:50050  # a stack already running on this machine
    python -m bench load --nodes 2 --gateways 2     # a local cluster of its own (specdec.cluster)
    python -m bench load --chaos                    # the soak with a dependency hurt every minute

Without --address it starts its own stack (a redis-server and the four services, bench/stack.py;
SPECDEC_GATEWAY_* variables such as SPECDEC_GATEWAY_MAX_ACTIVE_REQUESTS reach the gateway). Each
client sends greedy requests back to back (bench/concurrency.py run_load), the prompts of the mix in
turn (json rows with their schema as response_format unless --no-schema), until --duration is over.
Reported: requests/s, generated tokens/s, TTFT p50/p99, inter-token latency p50/p99 and the gap
between a stream's messages p50/p99 with tokens per message (--stream), errors by status code; for
a stack it started, each service's RSS and open file descriptors at the start, every --sample-s, and
at the end, the primary's engine steps (rows and mean time per step: the stream gap's yardstick),
its KV bytes and active requests afterwards, and how many of the prompt tokens it prefilled during
the run came from its prefix cache.
With --stream, after the load each of the mix's requests is sent once more, alone and cold (a
prefix-cache scope of its own: bench/concurrency.py reference_ttft_ms), and every request's TTFT
under load is reported over its own prompt's TTFT alone (p50/p99 of the ratios, overall and in the
first wave): the "TTFT against a single client for the same prompt" (--no-reference skips it).
Loopback only: the gateway's address must be a loopback one.
With --nodes N (and --gateways M, default N) it starts a local cluster instead (bench/nodes.py's:
N nodes, M gateways routing to all of them, one redis-server) and spreads the clients over the
gateways: aggregate requests/s, tokens/s and TTFT across them, with every primary's KV and active
requests afterwards.
With --chaos (bench/chaos_run.py): 16 clients for 10 minutes, streamed, on a stack of its own under
the launcher's supervisor, while every --chaos-period seconds one dependency is stopped (SIGSTOP)
for --chaos-stop-s and continued, or a service is killed (SIGKILL) and restarted, in turn
(--chaos-faults); every greedy output is checked against the same request decoded before the faults.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench import nodes
from bench.chaos import FAULT_ROTATION, fault_schedule, parse_rotation
from bench.concurrency import reference_ttft_ms, run_load, summarize_load
from bench.prompts import DEFAULT_DATA_DIR, load_prompts
from bench.stack import build_request, system_under_test
from primary_svc import step_report
from specdec.cluster import node_name
from specdec.launcher import GATEWAY, PRIMARY, SERVICE_NAMES, Stack
from specdec.host_check import is_loopback
from specdec.v1 import primary_pb2, primary_pb2_grpc
from specdec.flag_spellings import add_spellings

MAX_CLIENTS = 1024
MAX_DURATION_S = 3600.0
SOAK_DURATION_S = 600.0
SOAK_CLIENTS = 16
PROMPTS_PER_SCENARIO = 8
MAX_PROMPT_CHARS = 2000
SCENARIOS = ("json", "code", "prose")


def is_loopback_address(address: str) -> bool:
    """ "127.0.0.1:50050", "localhost:50050", "[::1]:50050" -> True."""
    return is_loopback(address.rpartition(":")[0])


def process_resources(pid: int) -> dict[str, int]:
    """Resident memory (bytes) and open file descriptors of a process, from /proc."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_bytes": rss_kb * 1024, "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


def services_resources(pids: Mapping[str, int]) -> dict[str, dict[str, int]]:
    return {name: process_resources(pid) for name, pid in pids.items()}


def primary_stats(stack: Stack) -> primary_pb2.GetStatsResponse:
    with stack.channel(PRIMARY) as ch:
        return primary_pb2_grpc.PrimaryServiceStub(ch).GetStats(primary_pb2.GetStatsRequest(), timeout=10)


def primary_occupancy(stats: primary_pb2.GetStatsResponse) -> dict[str, int]:
    return {"kv_bytes": stats.kv_bytes, "num_active_requests": stats.num_active_requests}


def prefix_cache_share(before: primary_pb2.GetStatsResponse, after: primary_pb2.GetStatsResponse) -> dict[str, Any]:
    """The primary's prefix cache over the run: prompt tokens its prefills would have computed
    (re-prefills after preemption included) and how many of them came from the cache instead."""
    num_prompt = after.num_prefix_query_tokens - before.num_prefix_query_tokens
    num_reused = after.num_prefix_reused_tokens - before.num_prefix_reused_tokens
    return {
        "prompt_tokens": num_prompt,
        "reused_tokens": num_reused,
        "reused_share": num_reused / num_prompt if num_prompt else None,
        "bytes": after.prefix_cache_bytes,
        "max_bytes": after.max_prefix_cache_bytes,
    }


def build_requests(
    mix: list[str],
    max_new_tokens: int,
    is_speculative: bool,
    is_schema: bool,
    data_dir: Path = DEFAULT_DATA_DIR,
    max_prompt_chars: int = MAX_PROMPT_CHARS,
    num_per_scenario: int = PROMPTS_PER_SCENARIO,
) -> list:
    """The mix's prompts interleaved (json 0, code 0, prose 0, json 1, ...) as GenerateRequests."""
    by_scenario = [load_prompts(data_dir, [s], num_per_scenario, max_chars=max_prompt_chars) for s in mix]
    interleaved = [p for row in zip(*by_scenario) for p in row]
    return [build_request(p, max_new_tokens, is_speculative, is_schema and p.schema is not None) for p in interleaved]


def run(
    address: str | list[str],
    clients: int,
    duration_s: float,
    requests: list,
    is_stream: bool,
    timeout_s: float,
    pids: Mapping[str, int] | None = None,
    sample_s: float = 10.0,
    stack: Stack | None = None,
    is_reference: bool = False,
) -> dict[str, Any]:
    """The load against address; resources of `pids` sampled at the start, every sample_s and at the end;
    with is_reference (streamed), then each request alone (reference_ttft_ms) to compare TTFTs with."""
    samples: list[dict[str, Any]] = []
    before = None if stack is None else primary_stats(stack)
    steps_before = None if stack is None else step_composition(stack)

    def sample(elapsed_s: float) -> None:
        if pids:
            samples.append({"elapsed_s": round(elapsed_s, 1), "services": services_resources(pids)})

    sample(0.0)
    traces, wall_s = run_load(
        address, requests, clients, duration_s, is_stream, timeout_s, on_tick=sample, tick_s=sample_s
    )
    sample(wall_s)
    # the load's own figures first: the reference requests below add steps and cold prefills
    after = None if stack is None else primary_stats(stack)
    steps_after = None if stack is None or steps_before is None else step_composition(stack)
    first = address if isinstance(address, str) else address[0]
    references = reference_ttft_ms(first, requests, timeout_s) if is_reference and is_stream else None
    result: dict[str, Any] = {
        "clients": clients,
        "duration_s": duration_s,
        "stream": is_stream,
        **summarize_load(traces, wall_s, is_stream, clients, references),
        "resources": samples,
    }
    if stack is not None and before is not None and after is not None:
        result["primary_after"] = primary_occupancy(primary_stats(stack))  # after the references too
        result["prefix_cache"] = prefix_cache_share(before, after)
    if steps_before is not None and steps_after is not None:
        result["engine_steps"] = steps_after.minus(steps_before).summary() | {
            "steps_per_s": round((steps_after.num_steps - steps_before.num_steps) / wall_s, 2) if wall_s > 0 else None
        }
    return result


def step_composition(stack: Stack) -> step_report.StepComposition | None:
    """The primary's engine steps so far (rows of verify vs prefill), from its /metrics; None when
    the stack serves no metrics."""
    try:
        return step_report.scrape(stack.metrics_url("primary"))
    except RuntimeError:
        return None


def format_result(r: dict[str, Any]) -> str:
    def ms(p: dict[str, float | None]) -> str:
        return "n/a" if p["p50"] is None else f"p50 {p['p50']:.0f} ms, p99 {p['p99']:.0f} ms"

    def ratio(p: dict[str, float | None]) -> str:
        return "n/a" if p["p50"] is None else f"p50 {p['p50']:.1f}x, p99 {p['p99']:.1f}x"

    lines = [
        f"{r['clients']} clients, {r['wall_s']:.1f} s, {'stream' if r['stream'] else 'unary'}: "
        f"{r['num_ok']}/{r['num_requests']} requests ok",
        f"  requests/s {r['requests_per_s'] or 0:.2f} | generated tokens/s {r['tokens_per_s'] or 0:.1f}",
        f"  TTFT {ms(r['ttft_ms'])} (after the first wave: {ms(r['ttft_after_first_wave_ms'])}) | "
        f"inter-token {ms(r['inter_token_ms'])}",
    ]
    if r["stream"] and r["message_gap_ms"]["p50"] is not None:
        lines.append(
            f"  stream message gap {ms(r['message_gap_ms'])} | tokens per message {r['tokens_per_message']:.2f}"
        )
    if "ttft_vs_alone" in r:
        lines.append(
            f"  TTFT over the same prompt's alone (cold, {ms(r['reference_ttft_ms'])}): {ratio(r['ttft_vs_alone'])} "
            f"(first wave: {ratio(r['ttft_vs_alone_first_wave'])})"
        )
    lines.append(f"  errors by code: {r['errors_by_code'] or 'none'}")
    lines += [f"    e.g. {e}" for e in r["error_examples"]]
    if r["resources"]:
        first, last = r["resources"][0]["services"], r["resources"][-1]["services"]
        for name in first:
            a, b = first[name], last[name]
            lines.append(
                f"  {name:<9} RSS {a['rss_bytes'] / 2**20:.0f} -> {b['rss_bytes'] / 2**20:.0f} MiB | "
                f"open fds {a['open_fds']} -> {b['open_fds']}"
            )
    if steps := r.get("steps"):
        share = "n/a" if steps["speculative_share"] is None else f"{100 * steps['speculative_share']:.0f} %"
        per_step = "n/a" if steps["tokens_per_step"] is None else f"{steps['tokens_per_step']:.2f}"
        lines.append(f"  request steps: {steps['num_steps']}, speculative {share}, tokens per step {per_step}")
    if e := r.get("engine_steps"):
        lines.append(
            f"  primary engine steps: {e['steps']} ({e['steps_per_s']}/s), mean {e['mean_step_ms']} ms, "
            f"rows per step: verify {e['verify_rows_per_step']}, prefill {e['prefill_rows_per_step']}; "
            f"preemptions {e['preemptions']:.0f}"
        )
        gap_p99 = r["message_gap_ms"]["p99"]
        if r["stream"] and gap_p99 is not None and e["mean_step_ms"]:
            lines.append(f"  stream message gap p99 over the mean engine step: {gap_p99 / e['mean_step_ms']:.2f}x")
    if "primary_after" in r:
        lines.append(f"  primary afterwards: {r['primary_after']}")
    if "prefix_cache" in r and not r["prefix_cache"]["max_bytes"]:
        lines.append("  primary prefix cache: off")
    elif "prefix_cache" in r:
        c = r["prefix_cache"]
        share = "n/a" if c["reused_share"] is None else f"{100 * c['reused_share']:.1f} %"
        lines.append(
            f"  primary prefix cache: {c['reused_tokens']} of {c['prompt_tokens']} prefilled prompt tokens "
            f"reused ({share}); holds {c['bytes'] / 2**20:.0f} of {c['max_bytes'] / 2**20:.0f} MiB"
        )
    for i, node in enumerate(r.get("nodes", [])):
        lines.append(f"  node {i} afterwards: KV {node['kv_bytes']} bytes, {node['active_requests']} active requests")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--clients",
        type=int,
        default=None,
        help=f"concurrent clients (1..{MAX_CLIENTS}; default 4, {SOAK_CLIENTS} with --soak)",
    )
    p.add_argument("--duration", type=float, default=None, help=f"seconds (max {MAX_DURATION_S:.0f}; default 30)")
    p.add_argument("--soak", action="store_true", help=f"run for {SOAK_DURATION_S / 60:.0f} minutes")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--mix", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    p.add_argument("--stream", action="store_true", help="GenerateStream (TTFT and inter-token latency)")
    p.add_argument("--no-speculation", action="store_true", help="speculation off (the baseline)")
    p.add_argument("--no-schema", action="store_true", help="json prompts without their response_format")
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip sending each request alone after the load (--stream: TTFT against the same prompt alone)",
    )
    p.add_argument(
        "--address",
        default="",
        help="a running gateway on this machine, or a comma list of gateways (python -m inference --serve "
        "--nodes N --gateways M prints them): clients spread over them, figures across them; default: start a stack",
    )
    p.add_argument("--nodes", type=int, default=0, help="start a local cluster of this many nodes (0: one stack)")
    p.add_argument("--gateways", type=int, default=0, help="the local cluster's gateways (default: --nodes)")
    p.add_argument("--precision", default="auto")
    p.add_argument("--threads", type=int, default=0, help="the primary's threads when a stack is started")
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    p.add_argument(
        "--sample-s", type=float, default=None, help="resource samples every this many seconds (10; 60 with --chaos)"
    )
    p.add_argument("--chaos", action="store_true", help="the soak with faults (bench/chaos_run.py)")
    p.add_argument(
        "--chaos-faults",
        default=",".join(FAULT_ROTATION),
        help="the faults in turn: stop:<validator|draft|primary|redis>, kill:<primary|draft|validator|*>",
    )
    p.add_argument("--chaos-period", type=float, default=60.0, help="seconds between faults (first at half)")
    p.add_argument("--chaos-stop-s", type=float, default=15.0, help="how long a stopped dependency stays stopped")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the started stack's service logs here")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    return add_spellings(p)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, their defaults resolved (a soak or chaos run changes them) and checked."""
    p = build_parser()
    a = p.parse_args(argv)
    is_soak = a.soak or a.chaos
    a.clients = a.clients if a.clients is not None else (SOAK_CLIENTS if is_soak else 4)
    a.duration = a.duration if a.duration is not None else (SOAK_DURATION_S if is_soak else 30.0)
    a.sample_s = a.sample_s if a.sample_s is not None else (60.0 if a.chaos else 10.0)
    a.mix = [m for m in a.mix.split(",") if m]
    if not 1 <= a.clients <= MAX_CLIENTS:
        p.error(f"--clients must be in [1, {MAX_CLIENTS}], got {a.clients}")
    if not 0 < a.duration <= MAX_DURATION_S:
        p.error(f"--duration must be in (0, {MAX_DURATION_S:.0f}], got {a.duration}")
    if a.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if not a.mix or set(a.mix) - set(SCENARIOS):
        p.error(f"--mix must be a comma list of {', '.join(SCENARIOS)}, got {','.join(a.mix)!r}")
    a.addresses = [x.strip() for x in a.address.split(",") if x.strip()]
    if any(not is_loopback_address(x) for x in a.addresses):
        p.error(f"--address must be loopback addresses (the load stays on this machine), got {a.address!r}")
    if not 0 < a.timeout_s <= MAX_DURATION_S or a.sample_s <= 0:
        p.error("--timeout-s must be in (0, 3600] and --sample-s > 0")
    if a.nodes < 0 or a.gateways < 0 or (a.gateways and not a.nodes):
        p.error(f"--nodes must be >= 0 and --gateways needs --nodes, got {a.nodes}, {a.gateways}")
    a.gateways = a.gateways or a.nodes
    if a.nodes and (a.address or a.chaos or a.precision != "auto" or a.threads):
        p.error(
            "--nodes starts a cluster of its own, with its services' defaults: leave out --address, --chaos, "
            "--precision and --threads"
        )
    if a.chaos:
        if a.address:
            p.error("--chaos starts a stack of its own (it signals the processes): leave out --address")
        try:
            a.chaos_schedule = fault_schedule(
                a.duration, a.chaos_period, a.chaos_stop_s, a.chaos_period / 2, parse_rotation(a.chaos_faults)
            )
        except ValueError as e:
            p.error(f"--chaos-faults/--chaos-period/--chaos-stop-s: {e}")
    return a


def run_chaos_main(a: argparse.Namespace, requests: list) -> None:
    from bench.chaos_run import format_chaos, run_chaos

    with system_under_test(a.precision, a.threads, 4096, is_serving_metrics=True, log_dir=a.log_dir) as sut:
        result = run_chaos(sut, requests, a.clients, a.duration, a.chaos_schedule, a.timeout_s, a.sample_s)
    print(format_chaos(result), flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1, default=_plain))


def _plain(value: Any) -> Any:
    """JSON for the chaos result's dataclasses."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def run_on_a_cluster(a: argparse.Namespace, requests: list) -> dict[str, Any]:
    """The load spread over the gateways of a local cluster of a.nodes nodes; each primary's KV bytes
    and active requests afterwards."""
    with nodes.cluster(a.nodes, a.gateways, a.log_dir) as stack:
        gateways = [stack.addresses[node_name(GATEWAY, g)] for g in range(a.gateways)]
        result = run(gateways, a.clients, a.duration, requests, a.stream, a.timeout_s, is_reference=not a.no_reference)
        after = [nodes.primary_stats(stack, n) for n in range(a.nodes)]
    result["nodes"] = [{"kv_bytes": s.kv_bytes, "active_requests": s.num_active_requests} for s in after]
    return result


def main(argv: list[str] | None = None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    requests = build_requests(a.mix, a.max_new_tokens, not a.no_speculation, not a.no_schema)
    if a.chaos:
        run_chaos_main(a, requests)
        return
    if a.nodes:
        result = run_on_a_cluster(a, requests)
    elif a.address:
        result = run(
            a.addresses,
            a.clients,
            a.duration,
            requests,
            a.stream,
            a.timeout_s,
            sample_s=a.sample_s,
            is_reference=not a.no_reference,
        )
    else:
        with system_under_test(a.precision, a.threads, 4096, is_serving_metrics=True, log_dir=a.log_dir) as sut:
            pids = {name: sut.stack.pid(name) for name in SERVICE_NAMES}
            result = run(
                sut.address,
                a.clients,
                a.duration,
                requests,
                a.stream,
                a.timeout_s,
                pids,
                a.sample_s,
                sut.stack,
                is_reference=not a.no_reference,
            )
    print(format_result(result), flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
