"""Prometheus metrics the draft pool owns: what it proposes, how long that takes, and the state it
keeps per request (plus the RPC families of specdec.metrics.RpcMetrics). Acceptance is the
gateway's to count (gateway.metrics): only it sees what the primary accepted."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.metrics import NAMESPACE, STAGE_BUCKETS_S, RpcMetrics


class DraftMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.rpc = RpcMetrics(registry)
        self.proposed_tokens = Counter(
            "draft_proposed_tokens",
            "Draft tokens proposed (nodes of the token trees sent back).",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.propose_seconds = Histogram(
            "draft_propose_seconds",
            "Time the pool took to build one step's token tree.",
            namespace=NAMESPACE,
            registry=registry,
            buckets=STAGE_BUCKETS_S,
        )
        self.requests = Gauge(
            "draft_requests", "Requests whose draft state the pool holds.", namespace=NAMESPACE, registry=registry
        )
        self.state_bytes = Gauge(
            "draft_state_bytes",
            "Bytes of per-request draft state (model-based decoders' KV).",
            namespace=NAMESPACE,
            registry=registry,
        )
