"""PrimaryService.DecodeStream in process on port 0 over the real model: a run's tokens go out one
engine step at a time, are Decode's tokens, end with the pending one; a caller that cancels mid-run
keeps its request, its KV and what the run committed, and its next call goes on from what it
received (num_context_tokens); bad requests get a status naming the field."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from primary_svc.leases import KVLeases
from primary_svc.server import ModelIdentity, PrimaryServicer
from primary_svc.worker import EngineWorker
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.repeats import MAX_REPEAT_TOKENS, RepeatIndex
from specdec.v1 import logprobs_pb2, primary_pb2
from tests.grpc_serving import primary_stub

PROMPT = [1, 504, 3458, 282, 260, 2114]
MAX_CONTEXT = 512
RUN = 64  # a run's tokens: Decode's longest (server.MAX_DECODE_TOKENS); a stream may run to the context
LONG = RUN + 6  # a streamed run longer than a Decode's


@pytest.fixture(scope="module")
def primary(fp32_model):
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32, max_bytes=64 << 20), MAX_CONTEXT)
    worker = EngineWorker(engine)
    identity = ModelIdentity("test-model", "instance-1", MAX_CONTEXT, (2,), {1: 10.0})
    servicer = PrimaryServicer(fp32_model, worker, identity, 64 << 20, leases=KVLeases(30.0))
    with primary_stub(servicer) as stub:
        yield stub, engine, worker
    worker.stop()


@pytest.fixture(scope="module")
def reference(primary) -> list[int]:
    """The first 2 * RUN tokens of plain greedy decoding after PROMPT, one token per Decode."""
    stub, *_ = primary
    lease = prefill(stub, "ref")
    tokens: list[int] = []
    while len(tokens) < 2 * RUN:
        d = stub.Decode(primary_pb2.DecodeRequest(request_id="ref", committed_token_ids=tokens[-1:], kv_lease=lease))
        tokens.append(d.token_id)
    release(stub, "ref", lease)
    return tokens


def prefill(stub, request_id: str) -> str:
    return stub.Prefill(primary_pb2.PrefillRequest(request_id=request_id, token_ids=PROMPT)).kv_lease


def release(stub, request_id: str, lease: str) -> None:
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=request_id, kv_lease=lease))


def stream(stub, request_id: str, lease: str, pending: list[int], max_tokens: int, **fields):
    return stub.DecodeStream(
        primary_pb2.DecodeRequest(
            request_id=request_id, committed_token_ids=pending, kv_lease=lease, max_tokens=max_tokens, **fields
        )
    )


class EngineHold:
    """Holds the engine thread between two steps (a call it runs) until released: while held, the
    request's state is what the steps so far left."""

    def __init__(self, worker: EngineWorker) -> None:
        self.entered, self.released = threading.Event(), threading.Event()

        def hold(engine: Engine) -> None:
            self.entered.set()
            self.released.wait()

        self.thread = threading.Thread(target=worker.call, args=(hold,), daemon=True)
        self.thread.start()
        assert self.entered.wait(timeout=60), "the engine thread never took the hold"

    def release(self) -> None:
        self.released.set()
        self.thread.join(timeout=60)


def test_a_stream_sends_each_step_s_token_before_the_run_ends(primary, reference):
    """A run of LONG steps (longer than a Decode may ask for): its first message is out while the
    engine still has steps of it to take, every message carries one token (the engine step's), only
    the last ends the run and leaves its token pending; the tokens are plain decoding's, each with
    its log probability."""
    stub, engine, worker = primary
    lease = prefill(stub, "s")
    call = stream(stub, "s", lease, [], LONG, logprobs=logprobs_pb2.LogprobsOptions(num_top_logprobs=2))
    messages = [next(call)]
    hold = EngineHold(worker)
    try:
        num_committed = engine.num_tokens("s") - len(PROMPT)  # the engine is still: its steps so far
        # the client holds a token of a run the engine has not finished: its last step leaves LONG - 1
        assert 1 <= num_committed < LONG - 1
        messages += [next(call) for _ in range(num_committed - 1)]  # the steps taken so far, sent already
        assert not any(m.is_run_end for m in messages)
    finally:
        hold.release()
    messages += list(call)
    assert [list(m.token_ids) for m in messages] == [[t] for t in reference[:LONG]]
    assert [m.is_run_end for m in messages] == [False] * (LONG - 1) + [True]
    assert all(m.forward_ms > 0 and m.num_step_rows >= 1 for m in messages)
    assert [len(m.logprobs) for m in messages] == [1] * LONG
    assert all(m.logprobs[0].token_id == m.token_ids[0] and len(m.logprobs[0].top_logprobs) == 2 for m in messages)
    # the last token is pending, as after Decode's run: the next call commits it and goes on
    assert engine.token_ids("s") == PROMPT + reference[: LONG - 1]
    more = list(stream(stub, "s", lease, reference[LONG - 1 : LONG], 3))
    assert [t for m in more for t in m.token_ids] == reference[LONG : LONG + 3]
    release(stub, "s", lease)
    assert engine.kv_bytes == 0


def test_a_stream_ends_at_a_stop_token_with_it_pending(primary, reference):
    stub, engine, _ = primary
    lease = prefill(stub, "stop")
    stop_at = reference.index(reference[4])
    messages = list(stream(stub, "stop", lease, [], 16, stop_token_ids=[reference[4]]))
    assert [m.token_ids[0] for m in messages] == reference[: stop_at + 1] and messages[-1].is_run_end
    assert engine.num_tokens("stop") == len(PROMPT) + stop_at
    release(stub, "stop", lease)


def test_a_cancelled_stream_keeps_the_request_and_goes_on_from_what_its_caller_received(primary, reference):
    """The caller cancels after 3 messages: the request stays open with its KV and at least those
    tokens committed; the next call names the context the caller knows and continues exactly where
    its stream stopped, whatever the run committed past it; the tokens are plain decoding's."""
    stub, engine, _ = primary
    lease = prefill(stub, "c")
    call = stream(stub, "c", lease, [], RUN)
    received = [next(call).token_ids[0] for _ in range(3)]
    call.cancel()
    assert received == reference[:3]
    assert engine.has_request("c") and engine.kv_bytes_of("c") > 0
    assert engine.num_tokens("c") >= len(PROMPT) + 3  # what was received was committed
    more = stream(stub, "c", lease, [], 5, num_context_tokens=len(PROMPT) + 3)
    assert [m.token_ids[0] for m in more] == reference[3:8]
    assert engine.token_ids("c") == PROMPT + reference[:7]  # the run's last token pending
    # a unary Decode names its context the same way
    d = stub.Decode(
        primary_pb2.DecodeRequest(
            request_id="c", committed_token_ids=[reference[7]], kv_lease=lease, num_context_tokens=len(PROMPT) + 7
        )
    )
    assert d.token_id == reference[8]
    stats = stub.GetStats(primary_pb2.GetStatsRequest())
    assert stats.num_active_requests == 1 and stats.kv_bytes > 0
    release(stub, "c", lease)
    assert engine.kv_bytes == 0


def test_a_stream_asked_to_stop_at_a_repeat_ends_where_the_context_repeats_itself(primary, reference):
    """stop_at_repeat_tokens n: the run ends after the first token with which the context's last n
    tokens occurred earlier (prompt and output), that token pending, as at a stop token."""
    stub, engine, _ = primary
    n = 2
    index = RepeatIndex(PROMPT, n)
    stop_at = next(i for i, token in enumerate(reference) if index.extend([token]) or index.tail_repeats())
    lease = prefill(stub, "rep")
    messages = list(stream(stub, "rep", lease, [], 2 * RUN, stop_at_repeat_tokens=n))
    assert [m.token_ids[0] for m in messages] == reference[: stop_at + 1] and messages[-1].is_run_end
    assert engine.num_tokens("rep") == len(PROMPT) + stop_at
    release(stub, "rep", lease)


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"max_tokens": MAX_CONTEXT + 1}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ({"max_tokens": 4, "stop_token_ids": [-1]}, grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
        ({"num_context_tokens": len(PROMPT) + 1}, grpc.StatusCode.INVALID_ARGUMENT, "num_context_tokens"),
        ({"num_context_tokens": len(PROMPT) - 1}, grpc.StatusCode.INVALID_ARGUMENT, "num_context_tokens"),
        (
            {"max_tokens": 4, "stop_at_repeat_tokens": MAX_REPEAT_TOKENS + 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop_at_repeat_tokens",
        ),
        ({"committed_token_ids": [10**8]}, grpc.StatusCode.INVALID_ARGUMENT, "committed_token_ids"),
        ({"kv_lease": "not-the-lease"}, grpc.StatusCode.NOT_FOUND, "request_id"),
    ],
)
def test_bad_stream_requests_get_a_status_naming_the_field_and_leave_the_request(primary, fields, code, field):
    stub, engine, _ = primary
    lease = prefill(stub, "bad")
    request = primary_pb2.DecodeRequest(request_id="bad", kv_lease=lease)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(request, name).extend(value)
        else:
            setattr(request, name, value)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.DecodeStream(request))
    assert e.value.code() == code and field in e.value.details()
    assert engine.token_ids("bad") == PROMPT  # untouched: it decodes on as before
    assert len(list(stream(stub, "bad", lease, [], 2))) == 2
    release(stub, "bad", lease)
    assert engine.kv_bytes == 0
