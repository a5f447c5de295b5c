"""The chaos soak's runner (bench/chaos_run.py, `python -m bench load --chaos`) on a real stack, short:
it stops Redis and continues it, kills the validator and has the supervisor restart it, and reports
every request, every output checked against its reference, both faults resumed, and the primary
empty afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import chaos, load
from bench.chaos_run import format_chaos, run_chaos
from bench.stack import SystemUnderTest

pytestmark = pytest.mark.e2e

NUM_CLIENTS = 4
DURATION_S = 30.0
MAX_NEW_TOKENS = 16
SCHEDULE = (chaos.Fault(5.0, chaos.STOP, chaos.REDIS, 4.0), chaos.Fault(15.0, chaos.KILL, "validator", 0.0))


def process_state(pid: int) -> str:
    """The one-letter state of /proc/<pid>/stat: "T" when stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_chaos_runner_hurts_and_heals_the_stack_and_checks_every_output(stack, redis_server, gateway_stub):
    sut = SystemUnderTest(stack, gateway_stub, redis_server.pid)
    requests = load.build_requests(
        ["json", "code", "prose"], MAX_NEW_TOKENS, True, True, max_prompt_chars=300, num_per_scenario=1
    )
    result = run_chaos(sut, requests, NUM_CLIENTS, DURATION_S, SCHEDULE, timeout_s=600.0, sample_s=10.0)
    assert set(result["statuses"]) == {"OK"}, result["error_examples"]
    exact = result["exactness"]
    assert exact.num_checked == exact.num_identical == result["statuses"]["OK"] > 0, exact.mismatches
    assert result["num_references"] == len(requests)
    assert [o.fault.label for o in result["faults"]] == ["stop:redis", "kill:validator"]
    assert all(o.resumed_at is not None and o.num_failed == 0 for o in result["faults"])
    assert result["num_restarts"] == {"primary": 0, "validator": 1, "draft": 0, "gateway": 0}
    assert stack.is_running("validator") and process_state(redis_server.pid) != "T"
    assert result["primary_after"] == {"kv_bytes": 0, "num_active_requests": 0}
    assert {"primary", "validator", "draft", "gateway", "redis"} <= set(result["resources"][-1]["services"])
    text = format_chaos(result)
    assert "| stop:redis |" in text and "| kill:validator |" in text and "greedy outputs identical" in text
