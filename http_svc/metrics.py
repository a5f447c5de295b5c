"""Prometheus metrics of the HTTP front (GET /metrics), in a registry the caller owns; under
`inference.py --serve` also the launcher's restarts per service, the one place --serve can be scraped."""

from __future__ import annotations

import json
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from specdec.metrics import counter, gauge, histogram

NAMESPACE = "specdec_http"
# A request's time: a few ms (an error, /v1/models) to minutes (a long generation).
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry, service_restarts_file: str = "") -> None:
        self.registry = registry
        if service_restarts_file:
            registry.register(ServiceRestarts(service_restarts_file))
        self.requests = counter(
            registry,
            "requests",
            "HTTP requests answered, by endpoint and status code.",
            ["endpoint", "status"],
            namespace=NAMESPACE,
        )
        self.latency = histogram(
            registry,
            "request_duration_seconds",
            "Time to the whole answer (a stream's last event), by endpoint.",
            _LATENCY_BUCKETS_S,
            ["endpoint"],
            namespace=NAMESPACE,
        )
        self.first_event = histogram(
            registry,
            "time_to_first_event_seconds",
            "Streams: time to the first event with text.",
            _LATENCY_BUCKETS_S,
            ["endpoint"],
            namespace=NAMESPACE,
        )
        self.active = gauge(
            registry, "active_requests", "Generations in flight (streams included).", namespace=NAMESPACE
        )
        self.tokens = counter(
            registry,
            "tokens",
            "Tokens of answered generations, by kind (prompt, completion).",
            ["kind"],
            namespace=NAMESPACE,
        )
        self.disconnects = counter(
            registry, "client_disconnects", "Generations cancelled because the client went away.", namespace=NAMESPACE
        )


class ServiceRestarts(Collector):
    """specdec_service_restarts_total{service}: read at each scrape from the launcher's file
    (specdec.launcher.Stack.restarts_file, JSON {service: restarts}). The launcher owns the counts,
    so they survive a restart of this front too; an unreadable file gives no samples."""

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "specdec_service_restarts",
            "Times the launcher restarted a service that had exited, by service.",
            labels=["service"],
        )
        try:
            with open(self.path, encoding="utf-8") as f:
                counts = {str(service): float(n) for service, n in json.load(f).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            counts = {}
        for service, num_restarts in sorted(counts.items()):
            family.add_metric([service], num_restarts)
        yield family
