"""Gateway flags for the adaptive controller: --adaptive (default on), its bounds and cost settings."""

from __future__ import annotations

import pytest

from gateway.config import parse_config


def test_adaptive_is_on_by_default_and_a_flag_or_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv("SPECDEC_GATEWAY_ADAPTIVE", raising=False)
    monkeypatch.delenv("SPECDEC_ADAPTIVE", raising=False)
    assert parse_config([]).speculation.is_adaptive
    assert not parse_config(["--no-adaptive"]).speculation.is_adaptive
    monkeypatch.setenv("SPECDEC_GATEWAY_ADAPTIVE", "false")
    assert not parse_config([]).speculation.is_adaptive
    assert parse_config(["--adaptive"]).speculation.is_adaptive
    monkeypatch.setenv("SPECDEC_GATEWAY_ADAPTIVE", "maybe")
    with pytest.raises(ValueError, match="SPECDEC_GATEWAY_ADAPTIVE"):
        parse_config([])


def test_adaptive_bounds_and_cost_settings_come_from_flags():
    config = parse_config(
        ["--max_adaptive_degree", "2", "--max_adaptive_draft_length", "6", "--speculative_overhead_ms", "7.5"]
    )
    assert (config.speculation.max_adaptive_degree, config.speculation.max_adaptive_draft_length) == (2, 6)
    assert config.costs.speculative_overhead_ms == 7.5
    with pytest.raises(ValueError, match="max_adaptive_degree"):
        parse_config(["--max_adaptive_degree", "0"])


def test_admission_limits_come_from_flags_or_the_environment(monkeypatch):
    for name in ("MAX_ACTIVE_REQUESTS", "MAX_QUEUED_REQUESTS"):
        monkeypatch.delenv(f"SPECDEC_GATEWAY_{name}", raising=False)
        monkeypatch.delenv(f"SPECDEC_{name}", raising=False)
    config = parse_config(["--max_active_requests", "4", "--max_queued_requests", "10"])
    assert (config.max_active_requests, config.max_queued_requests) == (4, 10)
    monkeypatch.setenv("SPECDEC_GATEWAY_MAX_QUEUED_REQUESTS", "0")
    assert parse_config([]).max_queued_requests == 0
    with pytest.raises(ValueError, match="max_active_requests"):
        parse_config(["--max_active_requests", "0"])


def test_a_malformed_redis_url_fails_at_start_naming_the_flag(monkeypatch):
    monkeypatch.delenv("SPECDEC_GATEWAY_REDIS_URL", raising=False)
    monkeypatch.delenv("SPECDEC_REDIS_URL", raising=False)
    url = "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"
    assert parse_config(["--redis_url", url]).redis_url == url
    with pytest.raises(ValueError, match="--redis_url .* is not host:port"):
        parse_config(["--redis_url", "redis+cluster://127.0.0.1"])
    with pytest.raises(ValueError, match="--redis_url .* names no service"):
        parse_config(["--redis_url", "redis+sentinel://127.0.0.1:26379"])


def test_the_advertised_address_comes_from_the_flag_or_the_gateway_environment(monkeypatch):
    monkeypatch.delenv("SPECDEC_GATEWAY_ADVERTISE_ADDRESS", raising=False)
    monkeypatch.setenv("SPECDEC_ADVERTISE_ADDRESS", "shared:1")  # not a shared flag: every service would read it
    assert parse_config([]).advertise_address == ""
    assert parse_config(["--advertise_address", "10.0.0.5:50050"]).advertise_address == "10.0.0.5:50050"
    monkeypatch.setenv("SPECDEC_GATEWAY_ADVERTISE_ADDRESS", "[fd00::5]:50050")
    assert parse_config([]).advertise_address == "[fd00::5]:50050"
    for bad in ("10.0.0.5", "10.0.0.5:0", "host:port", "a#b:1"):
        with pytest.raises(ValueError, match="--advertise_address"):
            parse_config(["--advertise_address", bad])


def test_the_grammar_compile_bounds_come_from_flags():
    config = parse_config(["--max_grammar_compile_s", "2.5", "--max_grammar_compiles", "8"])
    assert (config.grammar.max_compile_s, config.grammar.max_pending_compiles) == (2.5, 8)
    assert parse_config([]).grammar.max_pending_compiles == 64
    with pytest.raises(ValueError, match="max_pending_compiles"):
        parse_config(["--max_grammar_compiles", "0"])
