"""Prometheus metrics of one service.

Every metric object lives in a ServiceMetrics built around a CollectorRegistry
that the caller owns (no module-level metric objects: tests build their own
registry and read it back with registry.get_sample_value). Each service
exposes its registry on its own HTTP port; the scrape target identifies the
service, so names carry no service label.

Names follow Prometheus conventions: counters end in _total, durations are in
seconds, sizes in bytes.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from specdec.engine.prefix_cache import PrefixCache, PrefixCacheStats

NAMESPACE = "specdec"
# Port value that disables the metrics endpoint.
METRICS_DISABLED_PORT = 0
# Pipeline stages timed per step (GenerationStats.stage_times, without total).
STAGES = ("draft", "verify", "validate", "commit", "state", "other")
# Token kinds counted: prompt and generated tokens of requests; proposed and
# accepted draft tokens (acceptance rate = accepted / proposed).
TOKEN_KINDS = ("prompt", "generated", "proposed", "accepted")

# RPC latencies span sub-millisecond (Validate of a small tree) to tens of
# seconds (a long Generate).
_RPC_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A pipeline stage of one step: sub-ms (validate, Redis) to a few hundred ms
# (a verify of a large tree on CPU).
_STAGE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Accepted length per step is an integer >= 1 (accepted draft tokens + bonus).
_ACCEPTED_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
# Rows of one primary engine step by kind: 0 (none of that kind) to a few thousand (the step budget).
_STEP_ROWS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Row kinds of a primary engine step: verify/decode rows of running requests, prefill chunk rows.
STEP_ROW_KINDS = ("verify", "prefill")
# A request's wait in the gateway's admission queue: none to minutes under overload.
_ADMISSION_WAIT_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Why admission control turned a request away (gateway.admission).
ADMISSION_REJECTIONS = ("queue_full", "deadline", "cancelled")
# Prompt tokens of the primary's prefix-cache lookups: those that could have come from the cache
# (every prompt row of the batched prefill) and those that did (hit share = reused / queried).
PREFIX_CACHE_TOKEN_KINDS = ("queried", "reused")


class ServiceMetrics:
    """The metric set every service exports (each service uses its subset)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "rpc_requests",
            "RPCs handled, by method and status code.",
            ["method", "code"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.rpc_latency = Histogram(
            "rpc_latency_seconds",
            "RPC handling time, by method.",
            ["method"],
            namespace=NAMESPACE,
            registry=registry,
            buckets=_RPC_BUCKETS_S,
        )
        self.tokens = Counter(
            "tokens", f"Tokens by kind: {', '.join(TOKEN_KINDS)}.", ["kind"], namespace=NAMESPACE, registry=registry
        )
        self.steps = Counter(
            "steps", "Pipeline steps (one primary forward each).", namespace=NAMESPACE, registry=registry
        )
        self.accepted_length = Histogram(
            "accepted_length",
            "Tokens gained per step (accepted draft tokens + 1).",
            namespace=NAMESPACE,
            registry=registry,
            buckets=_ACCEPTED_LENGTH_BUCKETS,
        )
        self.stage_latency = Histogram(
            "stage_latency_seconds",
            f"Time per pipeline stage of one step: {', '.join(STAGES)}.",
            ["stage"],
            namespace=NAMESPACE,
            registry=registry,
            buckets=_STAGE_BUCKETS_S,
        )
        self.queue_depth = Gauge(
            "queue_depth", "Requests (or work items) waiting to be served.", namespace=NAMESPACE, registry=registry
        )
        self.active_requests = Gauge(
            "active_requests", "Requests being served.", namespace=NAMESPACE, registry=registry
        )
        self.kv_bytes = Gauge("kv_bytes", "KV-cache bytes in use.", namespace=NAMESPACE, registry=registry)
        self.dependency_available = Gauge(
            "dependency_available",
            "1 while a dependency answers; 0 while the gateway serves without it.",
            ["dependency"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.scheduler_waiting = Gauge(
            "scheduler_waiting_requests",
            "Primary: prefills waiting (for KV room or to finish their chunks).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.scheduler_running = Gauge(
            "scheduler_running_requests",
            "Primary: prefilled requests holding KV.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.engine_steps = Counter(
            "engine_steps",
            "Primary: engine steps (one budgeted batch of verify rows and prefill chunks).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.step_rows = Histogram(
            "engine_step_rows",
            f"Primary: rows of one engine step, by kind: {', '.join(STEP_ROW_KINDS)}.",
            ["kind"],
            namespace=NAMESPACE,
            registry=registry,
            buckets=_STEP_ROWS_BUCKETS,
        )
        self.preemptions = Counter(
            "preemptions",
            "Primary: requests whose KV was released to let others grow (they re-prefill).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.compiled_buckets = Gauge(
            "compiled_buckets",
            "Row buckets of the compiled engine step that are ready (0: eager only).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.admission_wait = Histogram(
            "admission_wait_seconds",
            "Time a request waited in the gateway's admission queue (admitted or not).",
            namespace=NAMESPACE,
            registry=registry,
            buckets=_ADMISSION_WAIT_BUCKETS_S,
        )
        self.admission_rejections = Counter(
            "admission_rejections",
            f"Requests admission control turned away, by reason: {', '.join(ADMISSION_REJECTIONS)}.",
            ["reason"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for reason in ADMISSION_REJECTIONS:  # exported as 0 before the first one
            self.admission_rejections.labels(reason)
        self.prefix_cache_queries = Counter(
            "prefix_cache_queries",
            "Primary: prompts looked up in the prefix cache (when a request gets its KV slot).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "prefix_cache_hits",
            "Primary: prefix-cache lookups that reused at least one token.",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.prefix_cache_tokens = Counter(
            "prefix_cache_tokens",
            f"Primary: prompt tokens of prefix-cache lookups, by kind: {', '.join(PREFIX_CACHE_TOKEN_KINDS)}.",
            ["kind"],
            namespace=NAMESPACE,
            registry=registry,
        )
        for kind in PREFIX_CACHE_TOKEN_KINDS:
            self.prefix_cache_tokens.labels(kind)
        self.prefix_cache_evictions = Counter(
            "prefix_cache_evictions",
            "Primary: prefix-cache blocks evicted to make room (least recently used first).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.prefix_cache_bytes = Gauge(
            "prefix_cache_bytes",
            "Primary: bytes of KV rows held by the prefix cache (apart from kv_bytes).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.prefix_cache_blocks = Gauge(
            "prefix_cache_blocks", "Primary: blocks held by the prefix cache.", namespace=NAMESPACE, registry=registry
        )

    def observe_prefix_cache(self, cache: PrefixCache, seen: PrefixCacheStats) -> PrefixCacheStats:
        """Bring the prefix-cache metrics up to the cache's counts; `seen`: the counts of the last
        call. Returns the counts now seen (the cache counts on the engine thread, the counters follow)."""
        now = dataclasses.replace(cache.stats)
        self.prefix_cache_queries.inc(now.num_queries - seen.num_queries)
        self.prefix_cache_hits.inc(now.num_hits - seen.num_hits)
        self.prefix_cache_tokens.labels("queried").inc(now.num_query_tokens - seen.num_query_tokens)
        self.prefix_cache_tokens.labels("reused").inc(now.num_reused_tokens - seen.num_reused_tokens)
        self.prefix_cache_evictions.inc(now.num_evicted_blocks - seen.num_evicted_blocks)
        self.prefix_cache_bytes.set(cache.num_bytes)
        self.prefix_cache_blocks.set(cache.num_blocks)
        return now

    def observe_step(self, *, num_proposed: int, num_accepted: int, stage_seconds: dict[str, float]) -> None:
        """Record one speculative step: num_accepted draft tokens + 1 bonus token."""
        if num_accepted > num_proposed:
            raise ValueError(f"num_accepted {num_accepted} > num_proposed {num_proposed}")
        unknown = set(stage_seconds) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; expected a subset of {STAGES}")
        self.steps.inc()
        self.tokens.labels("proposed").inc(num_proposed)
        self.tokens.labels("accepted").inc(num_accepted)
        self.tokens.labels("generated").inc(num_accepted + 1)
        self.accepted_length.observe(num_accepted + 1)
        for stage, seconds in stage_seconds.items():
            self.stage_latency.labels(stage).observe(seconds)


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running /metrics endpoint."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_metrics_server(port: int, registry: CollectorRegistry, host: str = "127.0.0.1") -> MetricsServer | None:
    """Serve `registry` on http://host:port/metrics; port 0 disables it (returns None)."""
    if port == METRICS_DISABLED_PORT:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(httpd, thread)
