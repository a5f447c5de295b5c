"""The launcher's restart counts on the HTTP front's /metrics (specdec_service_restarts_total)."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from http_svc.config import parse_config
from http_svc.metrics import HttpMetrics

METRIC = "specdec_service_restarts_total"


def test_restart_counts_are_read_from_the_launchers_file_at_each_scrape(tmp_path: Path) -> None:
    path = tmp_path / "service_restarts.json"
    config = parse_config(["--service_restarts_file", str(path)])
    registry = CollectorRegistry()
    HttpMetrics(registry, service_restarts_file=config.service_restarts_file)
    assert registry.get_sample_value(METRIC, {"service": "validator"}) is None, "no file yet: no samples"
    path.write_text(json.dumps({"primary": 0, "validator": 2}))
    assert registry.get_sample_value(METRIC, {"service": "validator"}) == 2
    assert registry.get_sample_value(METRIC, {"service": "primary"}) == 0
    assert b"# TYPE specdec_service_restarts_total counter" in generate_latest(registry)


def test_without_the_file_there_is_no_restart_metric() -> None:
    registry = CollectorRegistry()
    HttpMetrics(registry, service_restarts_file=parse_config([]).service_restarts_file)
    assert b"specdec_service_restarts" not in generate_latest(registry)
