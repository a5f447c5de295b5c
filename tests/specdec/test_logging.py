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


def test_a_logged_traceback_carries_no_local_variables() -> None:
    """An internal error while a request's prompt is in a local variable: the frames are logged,
    the prompt is not."""
    stream = io.StringIO()
    configure_logging("gateway", stream=stream)

    def step(prompt: str) -> None:
        token_ids = [ord(c) for c in prompt]
        raise RuntimeError(f"step failed after {len(token_ids)} tokens")

    try:
        step("SECRET PROMPT: my bank password is hunter2")
    except RuntimeError:
        structlog.get_logger().exception("rpc_internal_error")
    line = stream.getvalue()
    assert "hunter2" not in line and "SECRET" not in line
    event = json.loads(line)
    frames = event["exception"][0]["frames"]
    assert [f["name"] for f in frames][-1] == "step" and all("locals" not in f or not f["locals"] for f in frames)
    assert event["exception"][0]["exc_value"] == "step failed after 42 tokens"
