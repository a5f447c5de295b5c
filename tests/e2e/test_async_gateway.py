"""The asyncio gateway: open streams and queued requests cost memory, not threads.

A gateway that runs 8 requests at a time holds 200 open streams (8 generating, 192 queued) with
about as many threads as it had idle, read from /proc/<gateway pid>/status; when their clients go
away every one of them is stored as CANCELLED and the stack goes idle.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.launcher import GATEWAY, PRIMARY, Stack
from specdec.v1 import gateway_pb2, primary_pb2, primary_pb2_grpc

pytestmark = pytest.mark.e2e

MAX_ACTIVE = 8
NUM_STREAMS = 200
# No thread per stream, nor per generating request (each loop is a coroutine): at most asyncio's
# small default pool (a schema's compile) and gRPC's own threads come and go.
MAX_EXTRA_THREADS = 16


# The module's stack (tests/e2e/conftest.py): metrics served, admission sized for the test.
STACK_OPTIONS = {
    "is_serving_metrics": True,
    "extra_env": {
        "SPECDEC_GATEWAY_MAX_ACTIVE_REQUESTS": str(MAX_ACTIVE),
        "SPECDEC_GATEWAY_MAX_QUEUED_REQUESTS": str(NUM_STREAMS),
    },
}


def num_threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line in /proc/{pid}/status")


def metric(stack: Stack, name: str) -> float:
    with urllib.request.urlopen(stack.metrics_url(GATEWAY), timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def await_metrics(stack: Stack, expected: dict[str, float], timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while True:
        seen = {name: metric(stack, name) for name in expected}
        if seen == expected:
            return
        assert time.monotonic() < give_up, f"gateway metrics {seen}, expected {expected}"
        time.sleep(0.2)


def request(i: int) -> gateway_pb2.GenerateRequest:
    """Long enough that none of the eight running streams ends before the test cancels them all."""
    return gateway_pb2.GenerateRequest(
        request_id=f"open-{i}", prompt=f"Count slowly from {i} to one thousand:", max_new_tokens=4000
    )


def test_200_open_streams_against_8_slots_hold_no_thread_each(gateway_stub, stack):
    pid = stack.pid(GATEWAY)
    idle_threads = num_threads(pid)
    calls = [gateway_stub.GenerateStream(request(i), timeout=600) for i in range(NUM_STREAMS)]
    try:
        await_metrics(
            stack,
            {"specdec_num_requests_running": MAX_ACTIVE, "specdec_num_requests_waiting": NUM_STREAMS - MAX_ACTIVE},
            timeout_s=300,
        )
        open_threads = num_threads(pid)
        assert open_threads - idle_threads < MAX_EXTRA_THREADS, (idle_threads, open_threads)
    finally:
        for call in calls:
            call.cancel()  # the clients go away
    await_metrics(stack, {"specdec_num_requests_running": 0, "specdec_num_requests_waiting": 0}, timeout_s=120)
    give_up = time.monotonic() + 60
    pending = set(range(NUM_STREAMS))
    while pending:
        for i in sorted(pending):
            state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=f"open-{i}"), timeout=10)
            if state.status == gateway_pb2.REQUEST_STATUS_CANCELLED:
                pending.discard(i)
        assert not pending or time.monotonic() < give_up, f"not stored as cancelled: {sorted(pending)[:10]}"
        time.sleep(0.2)
    with stack.channel(PRIMARY) as ch:
        stats = primary_pb2_grpc.PrimaryServiceStub(ch).GetStats(primary_pb2.GetStatsRequest(), timeout=10)
    assert (stats.kv_bytes, stats.num_active_requests) == (0, 0)
    assert num_threads(pid) - idle_threads < MAX_EXTRA_THREADS
    # The gateway still serves after all that.
    response = gateway_stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=4), timeout=120)
    assert response.token_ids


def test_grpc_status_codes_are_unchanged_on_the_async_server(gateway_stub):
    with pytest.raises(grpc.RpcError) as bad:
        gateway_stub.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_new_tokens=0), timeout=30)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in bad.value.details()
    with pytest.raises(grpc.RpcError) as missing:
        gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="never-made"), timeout=30)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
