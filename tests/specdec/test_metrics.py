"""The per-service metric classes on registries of the test's own, and the /metrics endpoint."""

from __future__ import annotations

import http.client
import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from draft_svc.metrics import DraftMetrics
from gateway import config as gateway_config
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.server import _StepCounts
from gateway.stats import RequestStats
from primary_svc.metrics import PrimaryMetrics
from specdec.metrics import RpcMetrics, start_metrics_server
from specdec.service.server import ServerConfig
from validator_svc import config as validator_config


def _names(registry: CollectorRegistry) -> set[str]:
    return {m.name for m in registry.collect()}


def test_observe_step_counts_drafts_by_decoder_and_stages() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    # A speculative step: 5 proposed (3 by ngram, 2 by suffix) / 3 accepted (+1 bonus); a plain
    # run of 2 steps without drafts.
    metrics.observe_step(
        num_steps=1,
        num_proposed=5,
        num_accepted=3,
        stage_seconds={"draft": 0.002, "verify": 0.04},
        by_decoder={"ngram": (3, 3), "suffix": (2, 0)},
    )
    metrics.observe_step(num_steps=2, num_proposed=0, num_accepted=0, stage_seconds={"verify": 0.03}, by_decoder={})
    value = registry.get_sample_value
    assert value("specdec_steps_total") == 3
    assert value("specdec_spec_decode_num_drafts_total") == 1
    assert value("specdec_spec_decode_num_draft_tokens_total", {"decoder": "ngram"}) == 3
    assert value("specdec_spec_decode_num_accepted_tokens_total", {"decoder": "suffix"}) == 0
    assert value("specdec_spec_decode_accepted_length_sum") == 4
    assert value("specdec_spec_decode_accepted_length_count") == 1
    assert value("specdec_step_stage_seconds_count", {"stage": "verify"}) == 2
    assert value("specdec_step_stage_seconds_count", {"stage": "draft"}) == 1


def test_a_request_s_steps_give_the_other_stage_the_wall_time_the_stages_leave() -> None:
    """specdec_step_stage_seconds{stage="other"} adds up to the request's other_ms (its wall time
    less the booked stages): the loop books no "other" time itself, so it is derived per step."""
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    stats = RequestStats()
    seen = _StepCounts.of(stats)
    # (draft, verify, validate booked, wall) ms per step; the third's check is booked before its wall
    # time joins the total (the next step's commit), as the loop books a wait that overlapped a step
    for draft_ms, verify_ms, validate_ms, wall_ms in ((2.0, 30.0, 0.0, 40.0), (1.0, 20.0, 0.0, 25.0), (0, 0, 3.0, 0)):
        stats.num_steps += 1
        stats.stage_ms["draft"] += draft_ms
        stats.stage_ms["verify"] += verify_ms
        stats.stage_ms["validate"] += validate_ms
        stats.total_ms += wall_ms
        seen = seen.observe_into(metrics, stats)
    stats.num_steps += 1
    stats.stage_ms["verify"] += 10.0
    stats.total_ms += 20.0  # the wait included
    seen.observe_into(metrics, stats)
    value = registry.get_sample_value
    other_s = stats.to_pb().stage_times.other_ms / 1000
    assert other_s == pytest.approx(0.019)
    assert value("specdec_step_stage_seconds_sum", {"stage": "other"}) == pytest.approx(other_s)
    assert value("specdec_step_stage_seconds_count", {"stage": "other"}) == 4
    assert value("specdec_step_stage_seconds_bucket", {"stage": "other", "le": "0.0001"}) == 1  # none negative


def test_observe_step_rejects_inconsistent_input() -> None:
    metrics = GatewayMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="num_accepted"):
        metrics.observe_step(num_steps=1, num_proposed=1, num_accepted=2, stage_seconds={}, by_decoder={})
    with pytest.raises(ValueError, match="unknown stages"):
        metrics.observe_step(num_steps=1, num_proposed=1, num_accepted=1, stage_seconds={"warmup": 1.0}, by_decoder={})


def test_request_timer_spreads_a_step_over_its_tokens() -> None:
    registry = CollectorRegistry()
    timer = RequestTimer(GatewayMetrics(registry), arrived_s=10.0)
    timer.on_tokens(1, 10.5)  # TTFT 0.5
    timer.on_tokens(3, 10.8)  # 3 tokens 0.3 s later: 3 samples of 0.1
    timer.on_tokens(0, 10.9)  # a step that committed nothing: no sample
    timer.on_tokens(1, 11.0)
    timer.on_end("length", 11.1)
    value = registry.get_sample_value
    assert value("specdec_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value("specdec_inter_token_latency_seconds_count") == 4  # every token after the first
    assert value("specdec_inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert value("specdec_request_time_per_output_token_seconds_sum") == pytest.approx(0.5 / 4)
    assert value("specdec_e2e_request_latency_seconds_sum") == pytest.approx(1.1)
    assert value("specdec_request_success_total", {"finished_reason": "length"}) == 1


def test_each_service_exports_only_its_own_families() -> None:
    gateway, primary, draft, validator = (CollectorRegistry() for _ in range(4))
    GatewayMetrics(gateway), PrimaryMetrics(primary), DraftMetrics(draft), RpcMetrics(validator)
    rpc = {"specdec_rpc_requests", "specdec_rpc_latency_seconds"}
    assert _names(validator) == rpc
    assert rpc < _names(gateway) and rpc < _names(primary) and rpc < _names(draft)
    assert "specdec_kv_cache_usage_perc" in _names(primary) - _names(gateway) - _names(draft)
    assert "specdec_time_to_first_token_seconds" in _names(gateway) - _names(primary) - _names(draft)
    assert "specdec_draft_proposed_tokens" in _names(draft) - _names(gateway) - _names(primary)
    assert not (_names(gateway) - rpc) & (_names(primary) - rpc)


def test_kv_use_is_a_fraction_of_the_budget() -> None:
    registry = CollectorRegistry()
    PrimaryMetrics(registry).observe_kv(kv_bytes=256, max_kv_bytes=1024)
    assert registry.get_sample_value("specdec_kv_cache_usage_perc") == 0.25
    assert registry.get_sample_value("specdec_kv_bytes") == 256


def test_metrics_endpoint_serves_the_registry() -> None:
    assert start_metrics_server(0, CollectorRegistry()) is None  # port 0 disables it
    registry = CollectorRegistry()
    PrimaryMetrics(registry).queue_depth.set(4)
    with socket.socket() as s:  # a free port (the endpoint itself cannot bind port 0: 0 means off)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_metrics_server(port, registry)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    finally:
        server.stop()
    assert "specdec_queue_depth 4.0" in body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, headers: dict[str, str]) -> tuple[int, str]:
    """GET /metrics with exactly these headers (Host too: http.client adds none of its own here)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.putrequest("GET", "/metrics", skip_host=True, skip_accept_encoding=True)
        for key, value in headers.items():
            connection.putheader(key, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


@pytest.fixture
def metrics_port() -> Iterator[int]:
    """A running metrics endpoint with one sample, allowing the host `prometheus.lan`."""
    registry = CollectorRegistry()
    PrimaryMetrics(registry).queue_depth.set(4)
    server = start_metrics_server(_free_port(), registry, allowed_hosts=("prometheus.lan",))
    assert server is not None
    try:
        yield server.port
    finally:
        server.stop()


@pytest.mark.parametrize(
    "host",
    ["localhost:9100", "127.0.0.1:9100", "[::1]:9100", "10.1.2.3:9100", "10.1.2.3", "[fd00::5]:9100"]
    + ["prometheus.lan:9100", "PROMETHEUS.lan"],
)
def test_the_metrics_endpoint_answers_loopback_ip_addresses_and_allowed_hosts(metrics_port: int, host: str) -> None:
    """A scraper names its target's address (Kubernetes pod discovery, a static target) or a name
    the operator allowed; no page can make a browser send an IP address for another site."""
    status, body = _get(metrics_port, {"Host": host})
    assert status == 200 and "specdec_queue_depth 4.0" in body
    assert _get(metrics_port, {})[0] == 200  # no Host (HTTP/1.0)


@pytest.mark.parametrize("host", ["attacker.example:9100", "127.0.0.1.attacker.example", "localhost.attacker.example"])
def test_the_metrics_endpoint_refuses_another_host_name(metrics_port: int, host: str) -> None:
    """DNS rebinding: a page whose site's name re-resolved to this address sends that name as Host."""
    status, body = _get(metrics_port, {"Host": host})
    assert status == 403 and repr(host) in body and "--allowed_hosts" in body
    assert "specdec_" not in body


def test_the_metrics_endpoint_refuses_a_page_of_another_origin(metrics_port: int) -> None:
    status, body = _get(metrics_port, {"Host": "127.0.0.1:9100", "Origin": "http://attacker.example"})
    assert status == 403 and "'http://attacker.example'" in body and "specdec_" not in body
    assert _get(metrics_port, {"Host": "127.0.0.1:9100", "Origin": "http://localhost:3000"})[0] == 200


def test_every_service_s_metrics_endpoint_has_the_host_check() -> None:
    """--allowed_hosts (SPECDEC_ALLOWED_HOSTS) reaches each service's ServerConfig, which serve()
    hands to the endpoint; a bad entry stops the start."""
    config = gateway_config.parse_config(["--metrics_port", "9100", "--allowed_hosts", "prometheus.lan, b.lan"])
    assert config.server.allowed_hosts == ("prometheus.lan", "b.lan")
    assert validator_config.parse_config([]).server.allowed_hosts == ()
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerConfig(allowed_hosts=("http://prometheus.lan",))
