"""python -m bench nodes: several nodes behind several gateways on loopback (specdec.cluster).

    python -m bench nodes --nodes 2 --gateways 2 --streams 32 --max-new-tokens 64

Two measurements, each on a cluster of its own with one redis-server:

1. Prefix affinity. A mix of requests sharing a few long system prompts (--systems of them, each
   with --questions user questions, sent round-robin over the gateways by --streams clients) runs on
   --nodes nodes and then on one node; reported: each node's prefix-cache hit rate (prompt tokens
   whose KV rows came from its cache, GetStats), the cluster's over the single node's, requests/s,
   generated tokens/s and TTFT p50/p99 across the gateways.
2. Failover. --streams greedy streams spread over the gateways; once every stream has its first
   tokens, the node holding most requests is killed (SIGKILL of its primary, draft pool and
   validator; --kill primary: its primary alone), and once every stream went on, one gateway
   (--kill_gateway, the default): its clients retry the same request id on the next gateway, which
   sends the stored output from the start and takes the request over once the dead gateway fails
   its health checks (gateway.owner_probe; before that, only once its --owner_lease_s lapsed).
   Reported: each moved stream's time to resume (its last token before
   the node kill to its first after), the tokens re-prefilled (the gateways' "failing over" log
   lines: prompt + committed tokens), each retried stream's wait (gateway kill to its first token
   past what it had read), requests lost, and streams whose tokens differ from the same request's
   undisturbed run (a token lost or repeated).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from specdec.cluster import cluster_specs, node_name
from specdec.flag_spellings import add_spellings
from specdec.launcher import DRAFT, GATEWAY, PRIMARY, VALIDATOR, Stack, StackConfig
from specdec.redis_server import redis_server
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, primary_pb2, primary_pb2_grpc

TOPICS = ("rivers", "volcanoes", "bridges", "owls", "comets", "glaciers", "deserts", "lighthouses", "tides", "bees")
ROLES = ("a ship's navigator", "a patent examiner", "a museum guide", "a mountain rescuer", "a court stenographer")


def system_prompt(i: int) -> str:
    """A long (~300-token) system prompt, one per index."""
    role = ROLES[i % len(ROLES)]
    return f"You are {role}. " + " ".join(
        f"Rule {r}: as {role}, answer briefly and precisely, citing handbook section {i}.{r}." for r in range(18)
    )


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@contextlib.contextmanager
def cluster(
    num_nodes: int, num_gateways: int, log_dir: Path | None, gateway_args: Sequence[str] = ()
) -> Iterator[Stack]:
    with redis_server() as redis:
        config = StackConfig(redis_url=redis.url, log_dir=log_dir, is_keeping_logs=log_dir is not None)
        with Stack(config, specs=cluster_specs(config, num_nodes, num_gateways, gateway_args)) as stack:
            yield stack


def primary_stats(stack: Stack, node: int) -> primary_pb2.GetStatsResponse:
    with stack.channel(node_name(PRIMARY, node)) as channel:
        return primary_pb2_grpc.PrimaryServiceStub(channel).GetStats(primary_pb2.GetStatsRequest(), timeout=30)


class Stream:
    """One GenerateStream read in a thread, with each message's arrival time. When its gateway goes
    away (UNAVAILABLE) and retry_gateways is given, the same request is sent to the next of them: its
    stored output comes again from the start and replaces what was read."""

    def __init__(
        self, stack: Stack, gateway: int, request: gateway_pb2.GenerateRequest, retry_gateways: Sequence[int] = ()
    ) -> None:
        self.stack, self.request, self.retry_gateways = stack, request, list(retry_gateways)
        self.token_ids: list[int] = []
        self.arrivals: list[tuple[float, int]] = []  # (perf_counter, num tokens so far)
        self.start_s, self.error = time.perf_counter(), ""
        self.num_before_retry: int | None = None  # tokens read when the first gateway went away
        self.retried_at = float("nan")
        self.has_first = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(gateway,), daemon=True)
        self.thread.start()

    def _read(self, gateway: int) -> None:
        address = self.stack.addresses[node_name(GATEWAY, gateway)]
        with grpc.insecure_channel(address) as channel:
            for m in gateway_pb2_grpc.GenerationServiceStub(channel).GenerateStream(self.request, timeout=1800):
                if m.token_ids:
                    self.token_ids.extend(m.token_ids)
                    self.arrivals.append((time.perf_counter(), len(self.token_ids)))
                    self.has_first.set()

    def _run(self, gateway: int) -> None:
        try:
            try:
                self._read(gateway)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or not self.retry_gateways:
                    raise
                self.num_before_retry, self.retried_at, self.token_ids = len(self.token_ids), time.perf_counter(), []
                self._read(self.retry_gateways[0])
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"
        finally:
            self.has_first.set()

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0][0] - self.start_s if self.arrivals else float("nan")

    def first_new_after(self, t: float, num_known: int = 0) -> float:
        """When the first token past num_known arrived after t (nan: none)."""
        return next((at for at, n in self.arrivals if at > t and n > num_known), float("nan"))


def run_streams(stack: Stack, requests: Sequence[gateway_pb2.GenerateRequest], num_gateways: int) -> list[Stream]:
    streams = [Stream(stack, i % num_gateways, r) for i, r in enumerate(requests)]
    for s in streams:
        s.thread.join()
    return streams


def affinity_requests(num_systems: int, num_questions: int, max_new_tokens: int) -> list[gateway_pb2.GenerateRequest]:
    requests = []
    for q in range(num_questions):  # interleaved: each system prompt's requests arrive spread out
        for i in range(num_systems):
            topic = TOPICS[q % len(TOPICS)]
            requests.append(
                gateway_pb2.GenerateRequest(
                    request_id=f"affinity-{i}-{q}",
                    prompt=f"{system_prompt(i)}\nQuestion {q}: what should I know about {topic}?\nAnswer:",
                    max_new_tokens=max_new_tokens,
                )
            )
    return requests


def measure_affinity(args: argparse.Namespace, num_nodes: int) -> dict:
    with cluster(num_nodes, args.gateways if num_nodes > 1 else 1, args.log_dir) as stack:
        requests = affinity_requests(args.systems, args.questions, args.max_new_tokens)
        started = time.perf_counter()
        streams: list[Stream] = []
        for i in range(0, len(requests), args.streams):  # --streams at a time
            streams += run_streams(stack, requests[i : i + args.streams], args.gateways if num_nodes > 1 else 1)
        elapsed_s = time.perf_counter() - started
        stats = [primary_stats(stack, n) for n in range(num_nodes)]
    per_node = [
        {
            "node": n,
            "prompt_tokens": s.num_prefix_query_tokens,
            "reused_tokens": s.num_prefix_reused_tokens,
            "hit_rate": s.num_prefix_reused_tokens / max(1, s.num_prefix_query_tokens),
        }
        for n, s in enumerate(stats)
    ]
    queried = sum(s.num_prefix_query_tokens for s in stats)
    ttfts = [s.ttft_s * 1000 for s in streams if s.arrivals]
    return {
        "nodes": num_nodes,
        "requests": len(requests),
        "errors": [s.error for s in streams if s.error],
        "hit_rate": sum(s.num_prefix_reused_tokens for s in stats) / max(1, queried),
        "per_node": per_node,
        "requests_per_s": len(requests) / elapsed_s,
        "tokens_per_s": sum(len(s.token_ids) for s in streams) / elapsed_s,
        "ttft_ms_p50": percentile(ttfts, 0.5),
        "ttft_ms_p99": percentile(ttfts, 0.99),
    }


def failover_requests(num_streams: int, max_new_tokens: int, prefix: str) -> list[gateway_pb2.GenerateRequest]:
    requests = []
    for i in range(num_streams):
        r = gateway_pb2.GenerateRequest(request_id=f"{prefix}-{i}", max_new_tokens=max_new_tokens)
        r.chat.messages.add(role="user", content=f"Write a long, detailed essay about {TOPICS[i % len(TOPICS)]} ({i}).")
        requests.append(r)
    return requests


def reprefilled_tokens(stack: Stack, num_gateways: int) -> list[int]:
    """num_reprefill_tokens of every "failing over" line in the gateways' logs."""
    counts = []
    for g in range(num_gateways):
        for line in stack.log_path(node_name(GATEWAY, g)).read_text().splitlines():
            if "failing over" in line:
                with contextlib.suppress(ValueError, KeyError):
                    counts.append(int(json.loads(line)["num_reprefill_tokens"]))
    return counts


def kill_node(stack: Stack, node: int, is_whole_node: bool) -> None:
    for service in (PRIMARY, DRAFT, VALIDATOR) if is_whole_node else (PRIMARY,):
        stack.kill(node_name(service, node), signal.SIGKILL)


def kill_a_gateway(stack: Stack, streams: Sequence[Stream], node_killed_at: float) -> float:
    """Once every running stream went on after the node kill, SIGKILL of gateway 0; when."""
    while any(s.thread.is_alive() and math.isnan(s.first_new_after(node_killed_at)) for s in streams):
        time.sleep(0.05)
    killed_at = time.perf_counter()
    stack.kill(node_name(GATEWAY, 0), signal.SIGKILL)
    return killed_at


def gateway_kill_figures(streams: Sequence[Stream], killed_at: float) -> dict:
    """The retried streams' wait: the gateway kill to the first token past what each had read."""
    retried = [s for s in streams if s.num_before_retry is not None]
    waits_ms = [(s.first_new_after(killed_at, s.num_before_retry or 0) - killed_at) * 1000 for s in retried]
    return {
        "retried_streams": len(retried),
        "retried_wait_ms_p50": percentile(waits_ms, 0.5),
        "retried_wait_ms_max": max(waits_ms, default=float("nan")),
    }


def measure_failover(args: argparse.Namespace) -> dict:
    gateway_args = ("--owner_lease_s", str(args.owner_lease_s))
    with cluster(args.nodes, args.gateways, args.log_dir, gateway_args) as stack:
        reference = run_streams(stack, failover_requests(args.streams, args.max_new_tokens, "ref"), args.gateways)
        retry_to = [(g + 1) % args.gateways for g in range(args.gateways)]
        streams = [
            Stream(stack, i % args.gateways, r, [retry_to[i % args.gateways]] if args.kill_gateway else ())
            for i, r in enumerate(failover_requests(args.streams, args.max_new_tokens, "run"))
        ]
        for s in streams:
            s.has_first.wait(1800)
        loads = [primary_stats(stack, n).num_active_requests for n in range(args.nodes)]
        victim = max(range(args.nodes), key=lambda n: loads[n])
        killed_at = time.perf_counter()
        kill_node(stack, victim, args.kill == "node")
        gateway_killed_at = kill_a_gateway(stack, streams, killed_at) if args.kill_gateway else None
        for s in streams:
            s.thread.join()
        gateway_figures = {} if gateway_killed_at is None else gateway_kill_figures(streams, gateway_killed_at)
        resume_ms = []
        for s in streams:
            before = [t for t, _ in s.arrivals if t <= killed_at]
            after = [t for t, _ in s.arrivals if t > killed_at]
            if before and after and s.num_before_retry is None:
                resume_ms.append((after[0] - before[-1]) * 1000)
        reprefilled = reprefilled_tokens(stack, args.gateways)
    return {
        "nodes": args.nodes,
        "gateways": args.gateways,
        "streams": args.streams,
        "killed": args.kill,
        "active_per_node_at_kill": loads,
        "killed_node": victim,
        "moved_requests": len(reprefilled),
        "reprefilled_tokens_total": sum(reprefilled),
        "reprefilled_tokens_mean": statistics.mean(reprefilled) if reprefilled else 0,
        "gap_across_kill_ms_p50": percentile(resume_ms, 0.5),
        "gap_across_kill_ms_max": max(resume_ms, default=float("nan")),
        **gateway_figures,
        "lost_requests": sum(1 for s in streams if s.error),
        "errors": [s.error for s in streams if s.error],
        "identical_to_undisturbed": sum(s.token_ids == r.token_ids for s, r in zip(streams, reference)),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench nodes", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--streams", type=int, default=32, help="concurrent streams")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--systems", type=int, default=4, help="shared system prompts in the affinity mix")
    p.add_argument("--questions", type=int, default=8, help="requests per system prompt")
    p.add_argument("--skip", choices=("affinity", "failover"), action="append", default=[])
    p.add_argument("--kill", choices=("node", "primary"), default="node", help="what of a node the failover kills")
    p.add_argument(
        "--kill_gateway",
        type=lambda v: v.lower() in ("1", "true", "yes"),
        default=True,
        metavar="true|false",
        help="then kill a gateway (its clients retry on the next one)",
    )
    p.add_argument("--owner_lease_s", type=float, default=30.0, help="the gateways' --owner_lease_s")
    p.add_argument("--log_dir", type=Path, help="keep the clusters' logs here")
    args = add_spellings(p).parse_args(argv)
    for name in ("nodes", "gateways", "streams", "max_new_tokens", "systems", "questions"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.kill_gateway and args.gateways < 2 and "failover" not in args.skip:
        p.error("--gateways must be >= 2 to kill one (a gateway to retry on); or --kill_gateway false")
    if args.nodes < 2 and "failover" not in args.skip:
        p.error("--nodes must be >= 2 for the failover part (a node to kill and one to move to); or --skip failover")
    report: dict = {}
    if "affinity" not in args.skip:
        report["affinity"] = [measure_affinity(args, args.nodes), measure_affinity(args, 1)]
        cluster_rate, single_rate = (r["hit_rate"] for r in report["affinity"])
        report["hit_rate_nodes_over_single"] = cluster_rate / single_rate if single_rate else float("nan")
    if "failover" not in args.skip:
        report["failover"] = measure_failover(args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
