"""inference.py --redis_cluster: the command line starts a local 3-master Redis Cluster, points the
gateway at it (--redis_url redis+cluster://...), runs the request and stops every node on exit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.port_owner import listening_inodes

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
# A whole stack start (model load, verify-cost calibration) on a busy 2-core machine, plus the run.
CLI_TIMEOUT_S = 900
PROMPT = "Name three moons of Jupiter."


def test_a_request_runs_with_its_state_in_a_local_cluster_that_is_stopped_after() -> None:
    done = subprocess.run(
        [sys.executable, "inference.py", "--redis_cluster", "--prompt", PROMPT, "--max_new_tokens", "8", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["num_generated_tokens"] == 8 and result["finish_reason"] == "length"
    match = re.search(r"state store: --redis_url (redis\+cluster://\S+)", done.stderr)
    assert match is not None, done.stderr[-3000:]
    ports = [int(node.rpartition(":")[2]) for node in match.group(1).removeprefix("redis+cluster://").split(",")]
    assert len(ports) == 6
    assert not any(listening_inodes(port) for port in ports), "every node stopped"
