"""Admission control end to end: a gateway that runs one request at a time and queues one more.

A request beyond the queue is refused with RESOURCE_EXHAUSTED and a retry hint, and leaves nothing
behind; a queued request whose deadline passes gets DEADLINE_EXCEEDED without reaching the primary
(its Prefill count does not move); a queued request that is let in reports its wait in its stats.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.errors import RETRY_AFTER_KEY
from specdec.launcher import GATEWAY, PRIMARY, Stack
from specdec.v1 import gateway_pb2, primary_pb2, primary_pb2_grpc

pytestmark = pytest.mark.e2e

LONG_PROMPT = "Write a very long essay about the history of bridges, with many sections."


# The module's stack (tests/e2e/conftest.py): metrics served, one request at a time and one waiting.
STACK_OPTIONS = {
    "is_serving_metrics": True,
    "extra_env": {"SPECDEC_GATEWAY_MAX_ACTIVE_REQUESTS": "1", "SPECDEC_GATEWAY_MAX_QUEUED_REQUESTS": "1"},
}


def metric(stack: Stack, service: str, name: str, labels: dict[str, str] | None = None) -> float:
    with urllib.request.urlopen(stack.metrics_url(service), timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    return 0.0


def num_prefills(stack: Stack) -> float:
    return metric(stack, PRIMARY, "specdec_rpc_requests_total", {"method": "PrimaryService/Prefill"})


def primary_stats(stack: Stack) -> primary_pb2.GetStatsResponse:
    with stack.channel(PRIMARY) as ch:
        return primary_pb2_grpc.PrimaryServiceStub(ch).GetStats(primary_pb2.GetStatsRequest(), timeout=10)


def request(request_id: str, content: str = LONG_PROMPT, max_new_tokens: int = 1000) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(request_id=request_id, max_new_tokens=max_new_tokens)
    req.chat.messages.add(role="user", content=content)
    return req


def status_of(stub, request_id: str) -> gateway_pb2.GetRequestResponse:
    return stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=request_id), timeout=10)


def await_status(stub, request_id: str, is_done, timeout_s: float = 120) -> gateway_pb2.GetRequestResponse:
    give_up = time.monotonic() + timeout_s
    while True:
        state = status_of(stub, request_id)
        if is_done(state) or time.monotonic() > give_up:
            return state
        time.sleep(0.1)


def start_holder(stub, request_id: str):
    """A long streamed request that holds the one slot: its stream, once its first tokens came.

    It may run to the context's end (the prompt repeats itself at hundreds of tokens a second), so
    it is still running whenever a test ends it with Cancel.
    """
    stream = stub.GenerateStream(request(request_id, max_new_tokens=8000), timeout=600)
    assert next(stream).token_ids
    return stream


def await_idle(stub, stack: Stack, timeout_s: float = 60) -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        stats = primary_stats(stack)
        if (
            stats.kv_bytes == 0
            and stats.num_active_requests == 0
            and metric(stack, GATEWAY, "specdec_num_requests_running") == 0
            and metric(stack, GATEWAY, "specdec_num_requests_waiting") == 0
        ):
            return
        time.sleep(0.1)
    pytest.fail(f"the stack did not go idle: {primary_stats(stack)}")


def test_a_request_beyond_the_queue_is_refused_with_a_retry_hint_and_leaves_nothing_behind(gateway_stub, stack):
    holder = start_holder(gateway_stub, "holder-1")
    queued_result: dict = {}

    def run_queued() -> None:
        try:
            queued_result["response"] = gateway_stub.Generate(request("queued-1", "Say hello.", 8), timeout=600)
        except grpc.RpcError as e:
            queued_result["error"] = e

    queued = threading.Thread(target=run_queued)
    queued.start()
    state, give_up = None, time.monotonic() + 60
    while state is None or state.status != gateway_pb2.REQUEST_STATUS_QUEUED:
        try:
            state = status_of(gateway_stub, "queued-1")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() < give_up
        time.sleep(0.05)

    with pytest.raises(grpc.RpcError) as refused:
        gateway_stub.Generate(request("refused-1", "Say hello.", 8), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert "capacity" in refused.value.details()
    hints = [v for k, v in refused.value.trailing_metadata() if k == RETRY_AFTER_KEY]
    assert len(hints) == 1 and int(hints[0]) > 0
    with pytest.raises(grpc.RpcError) as missing:
        status_of(gateway_stub, "refused-1")  # refused before anything was stored
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert metric(stack, GATEWAY, "specdec_admission_rejections_total", {"reason": "queue_full"}) == 1

    assert gateway_stub.Cancel(gateway_pb2.CancelRequest(request_id="holder-1"), timeout=10).was_active
    assert list(holder)[-1].finish_reason == gateway_pb2.FINISH_REASON_CANCELLED
    queued.join(timeout=300)
    assert "error" not in queued_result, queued_result
    response = queued_result["response"]
    assert response.token_ids and response.stats.queue_ms > 0
    assert status_of(gateway_stub, "queued-1").status == gateway_pb2.REQUEST_STATUS_FINISHED
    await_idle(gateway_stub, stack)


def test_a_queued_request_past_its_deadline_never_reaches_the_primary(gateway_stub, stack):
    holder = start_holder(gateway_stub, "holder-2")
    prefills = num_prefills(stack)
    with pytest.raises(grpc.RpcError) as late:
        gateway_stub.Generate(request("late-1", "Say hello.", 8), timeout=3)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    state = await_status(gateway_stub, "late-1", lambda s: s.status != gateway_pb2.REQUEST_STATUS_QUEUED, 30)
    assert state.status == gateway_pb2.REQUEST_STATUS_CANCELLED and not state.token_ids
    # The gateway's own deadline and the client's go off together; either names the end.
    assert state.finish_reason in (gateway_pb2.FINISH_REASON_DEADLINE, gateway_pb2.FINISH_REASON_CANCELLED)
    assert num_prefills(stack) == prefills  # the holder's steps are Verify/Decode, not Prefill
    assert (
        sum(
            metric(stack, GATEWAY, "specdec_admission_rejections_total", {"reason": r})
            for r in ("deadline", "cancelled")
        )
        == 1
    )

    assert gateway_stub.Cancel(gateway_pb2.CancelRequest(request_id="holder-2"), timeout=10).was_active
    assert list(holder)[-1].finish_reason == gateway_pb2.FINISH_REASON_CANCELLED
    await_idle(gateway_stub, stack)
    assert num_prefills(stack) == prefills  # nothing was left in the queue to start later
    assert status_of(gateway_stub, "late-1").status == gateway_pb2.REQUEST_STATUS_CANCELLED
