"""ServiceMetrics on a registry of the test's own, and the /metrics endpoint."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from specdec.metrics import ServiceMetrics, start_metrics_server


def test_observe_step_counts_tokens_and_stages() -> None:
    registry = CollectorRegistry()
    metrics = ServiceMetrics(registry)
    # Two steps: 5 proposed / 3 accepted (+1 bonus), then 4 proposed / 0 accepted (+1 bonus).
    metrics.observe_step(num_proposed=5, num_accepted=3, stage_seconds={"draft": 0.002, "verify": 0.04})
    metrics.observe_step(num_proposed=4, num_accepted=0, stage_seconds={"verify": 0.03})
    value = registry.get_sample_value
    assert value("specdec_steps_total") == 2
    assert value("specdec_tokens_total", {"kind": "proposed"}) == 9
    assert value("specdec_tokens_total", {"kind": "accepted"}) == 3
    assert value("specdec_tokens_total", {"kind": "generated"}) == 5
    assert value("specdec_accepted_length_sum") == 4 + 1
    assert value("specdec_accepted_length_bucket", {"le": "1.0"}) == 1
    assert value("specdec_stage_latency_seconds_count", {"stage": "verify"}) == 2
    assert value("specdec_stage_latency_seconds_count", {"stage": "draft"}) == 1


def test_observe_step_rejects_inconsistent_input() -> None:
    metrics = ServiceMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="num_accepted"):
        metrics.observe_step(num_proposed=1, num_accepted=2, stage_seconds={})
    with pytest.raises(ValueError, match="unknown stages"):
        metrics.observe_step(num_proposed=1, num_accepted=1, stage_seconds={"warmup": 1.0})


def test_registries_are_independent() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    ServiceMetrics(a).kv_bytes.set(123)
    ServiceMetrics(b)
    assert a.get_sample_value("specdec_kv_bytes") == 123
    assert b.get_sample_value("specdec_kv_bytes") == 0


def test_metrics_endpoint_serves_the_registry() -> None:
    assert start_metrics_server(0, CollectorRegistry()) is None  # port 0 disables it
    registry = CollectorRegistry()
    ServiceMetrics(registry).queue_depth.set(4)
    with socket.socket() as s:  # a free port (the endpoint itself cannot bind port 0: 0 means off)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_metrics_server(port, registry)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    finally:
        server.stop()
    assert "specdec_queue_depth 4.0" in body
