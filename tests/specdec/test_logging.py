"""configure_logging: JSON lines off a terminal, request_id from contextvars."""

from __future__ import annotations

import io
import json
import logging

import pytest
import structlog

from specdec.logging import bind_request, configure_logging


@pytest.fixture(autouse=True)
def restore_structlog():
    yield
    structlog.reset_defaults()
    logging.getLogger().handlers.clear()


def test_json_lines_carry_service_level_and_request_id() -> None:
    stream = io.StringIO()  # not a tty -> JSON
    configure_logging("primary", level="INFO", stream=stream)
    log = structlog.get_logger()
    with bind_request("req-1", rpc="PrimaryService/Verify"):
        log.info("verified", num_nodes=8)
    log.debug("hidden")  # below the level
    log.warning("outside")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["verified", "outside"]
    assert lines[0]["request_id"] == "req-1" and lines[0]["rpc"] == "PrimaryService/Verify"
    assert lines[0]["service"] == "primary" and lines[0]["level"] == "info" and lines[0]["num_nodes"] == 8
    assert "request_id" not in lines[1]


def test_console_format_and_level_check() -> None:
    stream = io.StringIO()
    configure_logging("gateway", is_json=False, stream=stream)
    structlog.get_logger().info("hello", a=1)
    assert "hello" in stream.getvalue() and not stream.getvalue().startswith("{")
    with pytest.raises(ValueError, match="level"):
        configure_logging("gateway", level="LOUD")
