"""Prometheus metrics of the HTTP front (GET /metrics), in a registry the caller owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

NAMESPACE = "specdec_http"
# A request's time: a few ms (an error, /v1/models) to minutes (a long generation).
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.latency = Histogram(
            "request_duration_seconds",
            "Time to the whole answer (a stream's last event), by endpoint.",
            ["endpoint"],
            namespace=NAMESPACE,
            registry=registry,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.first_event = Histogram(
            "time_to_first_event_seconds",
            "Streams: time to the first event with text.",
            ["endpoint"],
            namespace=NAMESPACE,
            registry=registry,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.active = Gauge(
            "active_requests", "Generations in flight (streams included).", namespace=NAMESPACE, registry=registry
        )
        self.tokens = Counter(
            "tokens",
            "Tokens of answered generations, by kind (prompt, completion).",
            ["kind"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.disconnects = Counter(
            "client_disconnects",
            "Generations cancelled because the client went away.",
            namespace=NAMESPACE,
            registry=registry,
        )
