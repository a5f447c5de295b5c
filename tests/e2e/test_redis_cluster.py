"""The stack on a Redis Cluster: the four services as real processes with the gateway's state in a
real 3-master + 3-replica cluster on loopback (--redis_url redis+cluster://...). Greedy streams with
speculation on complete identical to plain decoding while the master that holds one of them is
killed -9 mid-stream: the gateway's writes to its slots wait for the replica's promotion (retried
within --max_state_retry_s) and no token is lost or repeated."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from specdec.launcher import GATEWAY, Stack, StackConfig
from specdec.redis_cluster import LocalRedisCluster, master_port_of, wait_for_failover
from specdec.state_store import DEFAULT_NAMESPACE
from specdec.v1 import gateway_pb2

pytestmark = pytest.mark.e2e

PROMPTS = (
    "List the planets of the solar system, one per line, with one fact about each.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in a few sentences how a bicycle gear works.",
    "Give a JSON object describing a book with title, author, year and three tags.",
)
MAX_NEW_TOKENS = 96
RETRYING = "state store unavailable; retrying"  # the gateway's log line when a write failed


@pytest.fixture(scope="module")
def stack(redis_cluster: LocalRedisCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = StackConfig(redis_url=redis_cluster.url, log_dir=tmp_path_factory.mktemp("stack-redis-cluster"))
    with Stack(config) as started:
        yield started


def _request(request_id: str, prompt: str, is_enabled: bool) -> gateway_pb2.GenerateRequest:
    spec = gateway_pb2.SpeculationConfig(is_enabled=is_enabled, speculative_degree=2, draft_length=6)
    req = gateway_pb2.GenerateRequest(request_id=request_id, max_new_tokens=MAX_NEW_TOKENS, speculation=spec)
    req.chat.messages.add(role="user", content=prompt)
    return req


def test_greedy_streams_stay_identical_to_plain_while_a_master_is_killed(
    gateway_stub, stream_in_background, redis_cluster: LocalRedisCluster, stack: Stack
) -> None:
    plain = [gateway_stub.Generate(_request(f"plain-{i}", p, False), timeout=300) for i, p in enumerate(PROMPTS)]
    gateway_log = stack.log_path(GATEWAY)
    num_retries_before = gateway_log.read_text().count(RETRYING)
    streams = [stream_in_background(gateway_stub, _request(f"spec-{i}", p, True)) for i, p in enumerate(PROMPTS)]
    last = f"spec-{len(PROMPTS) - 1}"
    victim = master_port_of(redis_cluster, f"{DEFAULT_NAMESPACE}:req:{{{last}}}:meta")
    assert victim is not None
    os.kill(redis_cluster.pid_of(victim), signal.SIGKILL)
    for _, _, reader in streams:
        reader.join(timeout=300)

    for i, (received, errors, _) in enumerate(streams):
        assert not errors, errors
        assert received[-1].is_final and received[-1].finish_reason == plain[i].finish_reason
        assert [t for r in received for t in r.token_ids] == list(plain[i].token_ids), f"spec-{i}"
        assert "".join(r.text for r in received) == plain[i].text
    wait_for_failover(redis_cluster, victim)
    for i in range(len(PROMPTS)):
        state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=f"spec-{i}"), timeout=30)
        assert state.status == gateway_pb2.REQUEST_STATUS_FINISHED
        assert list(state.token_ids) == list(plain[i].token_ids), f"spec-{i}: stored once each"
    # The writes of the last stream started (its master killed right after its first token) were
    # retried across the failover.
    assert gateway_log.read_text().count(RETRYING) > num_retries_before, "the kill missed the streams"


def test_the_stack_serves_new_requests_after_the_failover(gateway_stub) -> None:
    """Runs after the kill: requests on every master, the promoted one among them, are served and
    stored as answered."""
    for i in range(6):
        rid = f"after-{i}"
        out = gateway_stub.Generate(_request(rid, PROMPTS[i % len(PROMPTS)], True), timeout=300)
        assert len(out.token_ids) > 0
        state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=rid), timeout=30)
        assert state.status == gateway_pb2.REQUEST_STATUS_FINISHED
        assert list(state.token_ids) == list(out.token_ids)
