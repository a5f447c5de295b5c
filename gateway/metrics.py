"""Prometheus metrics the gateway owns: every request's latencies as its client sees them, the
admission queue, the tokens of requests, and the speculation that the gateway alone can count
(only it sees what the primary accepted of each decoder's drafts). Plus the RPC families of
specdec.metrics.RpcMetrics.

The request families take vLLM's names (vllm:X -> specdec_X) so dashboards compare: TTFT, inter-
token latency, time per output token, e2e latency, queue time, requests running/waiting, prompt
and generation tokens, spec_decode_* (docs/metrics.md maps each one).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from specdec.metrics import STAGE_BUCKETS_S, RpcMetrics, counter, gauge, histogram

# Pipeline stages timed per step (gateway.stats.STAGES).
STAGES = ("draft", "verify", "validate", "commit", "state", "other")
# Why admission control turned a request away (gateway.admission).
ADMISSION_REJECTIONS = ("queue_full", "deadline", "cancelled")
# How requests end (gateway.loop's finish reasons).
FINISH_REASONS = ("length", "stop", "eos", "cancelled", "deadline", "error")
# vLLM's buckets for the same families, so the histograms compare bucket by bucket.
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
# A request's wait in the admission queue: none to minutes under overload.
_QUEUE_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Accepted length per speculative step is an integer >= 1 (accepted draft tokens + bonus).
_ACCEPTED_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.rpc = RpcMetrics(registry)
        self._add_requests(registry)
        self._add_admission(registry)
        self._add_speculation(registry)

    def _add_requests(self, registry: CollectorRegistry) -> None:
        h = histogram
        self.ttft = h(registry, "time_to_first_token_seconds", "Arrival to the first token.", _TTFT_BUCKETS_S)
        self.itl = h(
            registry,
            "inter_token_latency_seconds",
            "Time between tokens after the first: a step that commits n tokens after a gap g gives n samples of g/n.",
            _ITL_BUCKETS_S,
        )
        self.tpot = h(
            registry,
            "request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (output tokens - 1).",
            _ITL_BUCKETS_S,
        )
        self.e2e = h(registry, "e2e_request_latency_seconds", "Arrival to the last token.", _REQUEST_BUCKETS_S)
        self.queue_time = h(
            registry, "request_queue_time_seconds", "Admitted requests: time in the admission queue.", _QUEUE_BUCKETS_S
        )
        self.prompt_tokens = counter(registry, "prompt_tokens", "Prompt tokens of requests started.")
        self.generation_tokens = counter(registry, "generation_tokens", "Tokens generated.")
        self.request_success = counter(
            registry,
            "request_success",
            f"Requests ended, by finished_reason: {', '.join(FINISH_REASONS)}.",
            ["finished_reason"],
        )
        self.dependency_available = gauge(
            registry,
            "dependency_available",
            "1 while a dependency answers; 0 while the gateway serves without it.",
            ["dependency"],
        )

    def _add_admission(self, registry: CollectorRegistry) -> None:
        self.num_requests_running = gauge(registry, "num_requests_running", "Requests holding an admission slot.")
        self.num_requests_waiting = gauge(registry, "num_requests_waiting", "Requests in the admission queue.")
        self.admission_wait = histogram(
            registry,
            "admission_wait_seconds",
            "Time a request waited in the admission queue (admitted or not).",
            _QUEUE_BUCKETS_S,
        )
        self.admission_rejections = counter(
            registry,
            "admission_rejections",
            f"Requests admission control turned away, by reason: {', '.join(ADMISSION_REJECTIONS)}.",
            ["reason"],
        )
        for reason in ADMISSION_REJECTIONS:  # exported as 0 before the first one
            self.admission_rejections.labels(reason)

    def _add_speculation(self, registry: CollectorRegistry) -> None:
        self.num_steps = counter(registry, "steps", "Pipeline steps (one primary forward each).")
        self.num_drafts = counter(registry, "spec_decode_num_drafts", "Steps that verified drafts.")
        self.draft_tokens = counter(
            registry, "spec_decode_num_draft_tokens", "Draft tokens verified, by decoder.", ["decoder"]
        )
        self.accepted_tokens = counter(
            registry, "spec_decode_num_accepted_tokens", "Draft tokens accepted, by decoder.", ["decoder"]
        )
        self.accepted_length = histogram(
            registry,
            "spec_decode_accepted_length",
            "Tokens gained per step that verified drafts (accepted draft tokens + 1).",
            _ACCEPTED_LENGTH_BUCKETS,
        )
        self.stage_seconds = histogram(
            registry,
            "step_stage_seconds",
            f"Time per pipeline stage of one step: {', '.join(STAGES)}.",
            STAGE_BUCKETS_S,
            ["stage"],
        )

    def observe_step(
        self,
        *,
        num_steps: int,
        num_proposed: int,
        num_accepted: int,
        stage_seconds: Mapping[str, float],
        by_decoder: Mapping[str, tuple[int, int]],
        num_draft_steps: int = 1,
    ) -> None:
        """Record num_steps pipeline steps (a speculative step is one; a run of plain steps, several).
        Steps that verified drafts (num_draft_steps of them, at least one where drafts were proposed:
        a run's message of several steps may carry several that drafted) add an accepted length of
        num_accepted + 1 each, their accepted drafts shared evenly (the message gives only their sum),
        so that the histogram's sum over its count stays the tokens per drafting step; by_decoder:
        each decoder's (proposed, accepted) draft tokens of the steps."""
        if num_accepted > num_proposed:
            raise ValueError(f"num_accepted {num_accepted} > num_proposed {num_proposed}")
        unknown = set(stage_seconds) - set(STAGES)
        if unknown:
            raise ValueError(f"unknown stages {sorted(unknown)}; expected a subset of {STAGES}")
        self.num_steps.inc(num_steps)
        if num_proposed:
            num_draft_steps = max(1, num_draft_steps)
            self.num_drafts.inc(num_draft_steps)
            for _ in range(num_draft_steps):
                self.accepted_length.observe(num_accepted / num_draft_steps + 1)
        for decoder, (proposed, accepted) in by_decoder.items():
            self.draft_tokens.labels(decoder).inc(proposed)
            self.accepted_tokens.labels(decoder).inc(accepted)
        for stage, seconds in stage_seconds.items():
            self.stage_seconds.labels(stage).observe(seconds)


class RequestTimer:
    """One request's latencies as its client sees them, from its arrival at the gateway (times from
    time.perf_counter). Call on_tokens for each step's committed tokens, then on_end once."""

    def __init__(self, metrics: GatewayMetrics, arrived_s: float) -> None:
        self.metrics, self.arrived_s = metrics, arrived_s
        self.first_token_s: float | None = None
        self.last_token_s = arrived_s
        self.num_tokens = 0

    def on_tokens(self, num_tokens: int, now_s: float) -> None:
        if num_tokens <= 0:
            return
        if self.first_token_s is None:
            self.first_token_s = now_s
            self.metrics.ttft.observe(now_s - self.arrived_s)
        else:
            # E.g. 3 tokens 0.09 s after the previous step's -> three samples of 0.03 s.
            gap_s = (now_s - self.last_token_s) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.observe(gap_s)
        self.last_token_s = now_s
        self.num_tokens += num_tokens

    def on_end(self, finish_reason: str, now_s: float) -> None:
        self.metrics.request_success.labels(finish_reason).inc()
        self.metrics.e2e.observe(now_s - self.arrived_s)
        if self.first_token_s is not None and self.num_tokens > 1:
            self.metrics.tpot.observe((self.last_token_s - self.first_token_s) / (self.num_tokens - 1))
