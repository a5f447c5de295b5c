"""Prometheus metrics the draft pool owns: what it proposes, how long that takes, and the state it
keeps per request (plus the RPC families of specdec.metrics.RpcMetrics). Acceptance is the
gateway's to count (gateway.metrics): only it sees what the primary accepted."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from specdec.metrics import STAGE_BUCKETS_S, RpcMetrics, counter, gauge, histogram


class DraftMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.rpc = RpcMetrics(registry)
        self.proposed_tokens = counter(
            registry, "draft_proposed_tokens", "Draft tokens proposed (nodes of the token trees sent back)."
        )
        self.propose_seconds = histogram(
            registry, "draft_propose_seconds", "Time the pool took to build one step's token tree.", STAGE_BUCKETS_S
        )
        self.requests = gauge(registry, "draft_requests", "Requests whose draft state the pool holds.")
        self.state_bytes = gauge(
            registry, "draft_state_bytes", "Bytes of per-request draft state (model-based decoders' KV)."
        )
