"""Prometheus metrics the primary owns: its KV cache, its scheduler and engine steps, its prefix
cache (plus the RPC families of specdec.metrics.RpcMetrics)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from specdec.metrics import RpcMetrics, counter, gauge, histogram

if TYPE_CHECKING:
    from specdec.engine.prefix_cache import PrefixCache, PrefixCacheStats

# Rows of one primary engine step by kind: 0 (none of that kind) to a few thousand (the step budget).
_STEP_ROWS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Wall time of one engine step's forwards, seconds: a few ms (one row, int4) to seconds (long prefills).
_STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
# Row kinds of a primary engine step: verify/decode rows of running requests, prefill chunk rows.
STEP_ROW_KINDS = ("verify", "prefill")
# Prompt tokens of the primary's prefix-cache lookups: those that could have come from the cache
# (every prompt row of the batched prefill) and those that did (hit share = reused / queried).
PREFIX_CACHE_TOKEN_KINDS = ("queried", "reused")


class PrimaryMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.rpc = RpcMetrics(registry)
        self.queue_depth = gauge(registry, "queue_depth", "Calls waiting for the engine thread.")
        self.active_requests = gauge(registry, "kv_requests", "Requests holding a KV slot.")
        self.kv_bytes = gauge(registry, "kv_bytes", "KV-cache bytes in use.")
        # vLLM: vllm:kv_cache_usage_perc (a fraction too, despite its name).
        self.kv_usage = gauge(registry, "kv_cache_usage_perc", "KV-cache use as a fraction of --max_kv_bytes (0..1).")
        self.scheduler_waiting = gauge(
            registry, "scheduler_waiting_requests", "Prefills waiting (for KV room or to finish their chunks)."
        )
        self.scheduler_running = gauge(registry, "scheduler_running_requests", "Prefilled requests holding KV.")
        self.engine_steps = counter(
            registry, "engine_steps", "Engine steps (one budgeted batch of verify rows and prefill chunks)."
        )
        self.step_rows = histogram(
            registry,
            "engine_step_rows",
            f"Rows of one engine step, by kind: {', '.join(STEP_ROW_KINDS)}.",
            _STEP_ROWS_BUCKETS,
            ["kind"],
        )
        self.step_seconds = histogram(
            registry,
            "engine_step_seconds",
            "Wall time of one engine step's forwards (verify rows and prefill chunks), seconds.",
            _STEP_SECONDS_BUCKETS,
        )
        self.preemptions = counter(
            registry, "preemptions", "Requests whose KV was released to let others grow (they re-prefill)."
        )
        self.run_drafted_tokens = counter(
            registry, "run_drafted_tokens", "Tokens runs of plain steps drafted and verified (lookup_draft_length)."
        )
        self.run_draft_accepted_tokens = counter(
            registry, "run_draft_accepted_tokens", "Of the runs' drafted tokens, those their steps kept."
        )
        self.run_answer_drafted_tokens = counter(
            registry,
            "run_answer_drafted_tokens",
            "Of the runs' drafted tokens, those drafted from the model's own answers (--run_answers).",
        )
        self.run_answer_accepted_tokens = counter(
            registry, "run_answer_accepted_tokens", "Of the tokens drafted from the answers, those their steps kept."
        )
        self.compiled_buckets = gauge(
            registry, "compiled_buckets", "Row buckets of the compiled engine step that are ready (0: eager only)."
        )
        self._add_prefix_cache(registry)

    def _add_prefix_cache(self, registry: CollectorRegistry) -> None:
        self.prefix_cache_queries = counter(
            registry, "prefix_cache_queries", "Prompts looked up in the prefix cache (when a request gets its KV slot)."
        )
        self.prefix_cache_hits = counter(
            registry, "prefix_cache_hits", "Prefix-cache lookups that reused at least one token."
        )
        self.prefix_cache_tokens = counter(
            registry,
            "prefix_cache_tokens",
            f"Prompt tokens of prefix-cache lookups, by kind: {', '.join(PREFIX_CACHE_TOKEN_KINDS)}.",
            ["kind"],
        )
        for kind in PREFIX_CACHE_TOKEN_KINDS:
            self.prefix_cache_tokens.labels(kind)
        self.prefix_cache_evictions = counter(
            registry, "prefix_cache_evictions", "Prefix-cache blocks evicted to make room (least recently used first)."
        )
        self.prefix_cache_bytes = gauge(
            registry, "prefix_cache_bytes", "Bytes of KV rows held by the prefix cache (apart from kv_bytes)."
        )
        self.prefix_cache_blocks = gauge(registry, "prefix_cache_blocks", "Blocks held by the prefix cache.")

    def observe_kv(self, kv_bytes: int, max_kv_bytes: int) -> None:
        self.kv_bytes.set(kv_bytes)
        self.kv_usage.set(kv_bytes / max_kv_bytes if max_kv_bytes > 0 else 0.0)

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
