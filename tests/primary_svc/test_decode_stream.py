"""PrimaryService.DecodeStream in process on port 0 over the real model: a run's tokens go out one
engine step at a time, are Decode's tokens, end with the pending one; a caller that cancels mid-run
keeps its request, its KV and what the run committed, and its next call goes on from what it
received (num_context_tokens); bad requests get a status naming the field."""

from __future__ import annotations

import itertools
import threading

import grpc
import numpy as np
import pytest
import torch

from prometheus_client import CollectorRegistry

from primary_svc.leases import KVLeases
from primary_svc.metrics import PrimaryMetrics
from primary_svc.server import ModelIdentity, PrimaryServicer
from primary_svc.worker import EngineWorker
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.answers import AnswerIndex, LearnedAnswers
from specdec.pb import MAX_STEPS_PER_MESSAGE
from specdec.repeats import MAX_REPEAT_TOKENS, RepeatIndex
from specdec.suffix_array import SEPARATOR
from specdec.v1 import common_pb2, logprobs_pb2, primary_pb2
from tests.grpc_serving import primary_stub

PROMPT = [1, 504, 3458, 282, 260, 2114]
MAX_CONTEXT = 512
ALL_ALLOWED = common_pb2.TokenMask(num_rows=1, bits=b"\xff" * (49152 // 8))  # every token of the vocabulary
RUN = 64  # a run's tokens: Decode's longest (server.MAX_DECODE_TOKENS); a stream may run to the context
LONG = RUN + 6  # a streamed run longer than a Decode's


@pytest.fixture(scope="module")
def metrics() -> PrimaryMetrics:
    return PrimaryMetrics(CollectorRegistry())


@pytest.fixture(scope="module")
def primary(fp32_model, metrics, tokenizer):
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32, max_bytes=64 << 20), MAX_CONTEXT)
    worker = EngineWorker(engine)
    identity = ModelIdentity("test-model", "instance-1", MAX_CONTEXT, (2,), {1: 10.0})
    servicer = PrimaryServicer(
        fp32_model, worker, identity, 64 << 20, metrics=metrics, leases=KVLeases(30.0), tokenizer=tokenizer
    )
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


@pytest.mark.parametrize("per_message", [3, 8])
def test_a_stream_asked_for_several_steps_a_message_sends_the_same_tokens_in_fewer_messages(
    primary, reference, per_message
):
    """steps_per_message: the run's first step comes alone, then up to that many steps a message,
    the last message however many are left; the tokens are those of a message a step, each message
    counts its steps (num_steps) and sums their forward time; the last one ends the run."""
    stub, engine, _ = primary
    lease = prefill(stub, "batched")
    messages = list(stream(stub, "batched", lease, [], LONG, steps_per_message=per_message))
    assert [t for m in messages for t in m.token_ids] == reference[:LONG]
    assert [m.num_steps for m in messages] == [1] + [per_message] * ((LONG - 1) // per_message) + (
        [(LONG - 1) % per_message] if (LONG - 1) % per_message else []
    )
    assert all(len(m.token_ids) == m.num_steps and m.forward_ms > 0 for m in messages)
    assert [m.is_run_end for m in messages] == [False] * (len(messages) - 1) + [True]
    assert engine.token_ids("batched") == PROMPT + reference[: LONG - 1]  # the last token pending, as always
    release(stub, "batched", lease)


def test_a_message_of_several_steps_goes_out_at_once_after_a_step_that_completes_a_stop_string(
    primary, reference, tokenizer
):
    """stop_strings, with steps_per_message: a message also ends after the step whose token completes
    one of them in the output's text (the output's committed tokens, then the run's: a stop string
    may start before the run), so that the caller, which cuts there, need not wait out the message;
    the run goes on, its tokens plain decoding's."""
    stub, *_ = primary
    committed = tokenizer.decode(reference[:10])
    # from the committed text's last 2 characters into the run's second token's; and one later on
    spanning = tokenizer.decode(reference[:12])[len(committed) - 2 : len(tokenizer.decode(reference[:11])) + 1]
    later = tokenizer.decode(reference[:30])[-3:]

    def completed_at(stop: str) -> int:  # the run's step (from 1) whose token completes `stop`
        assert stop not in committed
        return next(i for i in range(1, 31) if stop in tokenizer.decode(reference[: 10 + i]))

    stops = {completed_at(spanning), completed_at(later)}
    assert stops == {2, 20}  # the reference's text
    lease = prefill(stub, "hints")
    assert [t for m in stream(stub, "hints", lease, [], 10) for t in m.token_ids] == reference[:10]
    messages = list(
        stream(stub, "hints", lease, reference[9:10], 31, steps_per_message=16, stop_strings=[later, spanning])
    )
    assert [t for m in messages for t in m.token_ids] == reference[10:41]
    # the first step alone, then 16 steps a message, or fewer where a stop string completes, or the run ends
    assert list(itertools.accumulate(m.num_steps for m in messages)) == [1, 2, 18, 20, 31]
    release(stub, "hints", lease)


def test_a_drafted_run_sent_several_steps_a_message_counts_each_message_s_steps_and_drafts(primary, copying):
    """A run that drafts its copies, its steps several a message: the tokens, the drafts, the kept
    drafts and the steps that drafted add up to those of a message a step."""
    stub, engine, _ = primary
    prompt, expected = copying
    runs = {}
    for per_message in (1, 4):
        request_id = f"db{per_message}"
        lease = stub.Prefill(primary_pb2.PrefillRequest(request_id=request_id, token_ids=prompt)).kv_lease
        runs[per_message] = list(
            stream(stub, request_id, lease, [], RUN - 4, lookup_draft_length=8, steps_per_message=per_message)
        )
        release(stub, request_id, lease)
    one, batched = runs[1], runs[4]
    assert [t for m in batched for t in m.token_ids] == [t for m in one for t in m.token_ids] == expected[: RUN - 4]
    assert sum(m.num_steps for m in batched) == len(one) > len(batched)
    for name in ("num_drafted", "num_draft_accepted"):
        assert sum(getattr(m, name) for m in batched) == sum(getattr(m, name) for m in one)
    # the steps that drafted, each a verify of its drafts (the gateway's accepted length is per such step)
    assert all(m.num_drafting_steps == (m.num_drafted > 0) for m in one)
    assert sum(m.num_drafting_steps for m in batched) == sum(m.num_drafting_steps for m in one)
    assert max(m.num_drafting_steps for m in batched) > 1


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
        ({"max_tokens": 4, "stop_strings": ["x", ""]}, grpc.StatusCode.INVALID_ARGUMENT, "stop_strings"),
        ({"max_tokens": 4, "stop_strings": ["x"] * 17}, grpc.StatusCode.INVALID_ARGUMENT, "stop_strings"),
        (
            {"max_tokens": 4, "steps_per_message": MAX_STEPS_PER_MESSAGE + 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "steps_per_message",
        ),
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


@pytest.fixture(scope="module")
def copying(primary, reference) -> tuple[list[int], list[int]]:
    """A prompt whose answer copies it: PROMPT, its first 40 reference tokens, PROMPT again; and the
    first RUN tokens of plain greedy decoding after it, one token per Decode."""
    stub, *_ = primary
    prompt = PROMPT + reference[:40] + PROMPT
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="copy-ref", token_ids=prompt)).kv_lease
    tokens: list[int] = []
    while len(tokens) < RUN:
        d = stub.Decode(
            primary_pb2.DecodeRequest(request_id="copy-ref", committed_token_ids=tokens[-1:], kv_lease=lease)
        )
        tokens.append(d.token_id)
    release(stub, "copy-ref", lease)
    return prompt, tokens


def test_a_run_that_drafts_its_copies_decodes_plain_decoding_s_tokens_several_a_step(primary, copying, metrics):
    """lookup_draft_length: the run drafts what followed the tail's earlier occurrence and keeps the
    drafts the argmaxes agree with: the tokens are plain decoding's, some messages carry several,
    the counts add up; the run's last token is pending and the next call goes on from it."""
    stub, engine, _ = primary
    prompt, expected = copying
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="d", token_ids=prompt)).kv_lease
    messages = list(stream(stub, "d", lease, [], RUN - 4, lookup_draft_length=8))
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == expected[: RUN - 4]
    assert [m.is_run_end for m in messages] == [False] * (len(messages) - 1) + [True]
    assert sum(m.num_drafted for m in messages) > 0 and max(len(m.token_ids) for m in messages) > 2
    assert all(m.num_draft_accepted == len(m.token_ids) - 1 for m in messages[:-1])
    assert all(0 <= m.num_draft_accepted <= m.num_drafted for m in messages)
    assert all(m.num_answer_drafted == 0 for m in messages)  # copies only: this servicer has no answers
    assert engine.token_ids("d") == prompt + expected[: RUN - 5]
    drafted = metrics.registry.get_sample_value("specdec_run_drafted_tokens_total")
    kept = metrics.registry.get_sample_value("specdec_run_draft_accepted_tokens_total")
    assert drafted >= sum(m.num_drafted for m in messages) and 0 < kept <= drafted
    more = list(stream(stub, "d", lease, expected[RUN - 5 : RUN - 4], 4, lookup_draft_length=8))
    assert [t for m in more for t in m.token_ids] == expected[RUN - 4 : RUN]
    release(stub, "d", lease)
    assert engine.kv_bytes == 0


@pytest.mark.parametrize("max_tokens", [2, 5, 9, 13])
def test_a_drafted_run_that_ends_inside_a_step_s_drafts_keeps_them_committed_but_its_last(primary, copying, max_tokens):
    """A run's end (max_tokens; a stop token likewise) can fall among a step's accepted drafts: the
    tokens before it stay committed with their KV, the last is pending, and a unary Decode goes on."""
    stub, engine, _ = primary
    prompt, expected = copying
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="e", token_ids=prompt)).kv_lease
    tokens = [t for m in stream(stub, "e", lease, [], max_tokens, lookup_draft_length=8) for t in m.token_ids]
    assert tokens == expected[:max_tokens]
    assert engine.token_ids("e") == prompt + expected[: max_tokens - 1]
    assert engine.num_cached("e") == len(prompt) + max_tokens - 2  # all but the pending token
    d = stub.Decode(
        primary_pb2.DecodeRequest(
            request_id="e",
            committed_token_ids=expected[max_tokens - 1 : max_tokens],
            kv_lease=lease,
            max_tokens=3,
            lookup_draft_length=4,
        )
    )
    assert list(d.token_ids) == expected[max_tokens : max_tokens + 3] and d.num_draft_accepted <= d.num_drafted
    release(stub, "e", lease)


def test_a_drafted_run_ends_at_a_stop_token_among_its_drafts(primary, copying):
    stub, engine, _ = primary
    prompt, expected = copying
    stop = expected[20]
    stop_at = expected.index(stop)
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="f", token_ids=prompt)).kv_lease
    messages = list(stream(stub, "f", lease, [], RUN, lookup_draft_length=8, stop_token_ids=[stop]))
    assert [t for m in messages for t in m.token_ids] == expected[: stop_at + 1] and messages[-1].is_run_end
    assert engine.token_ids("f") == prompt + expected[:stop_at]
    release(stub, "f", lease)


@pytest.mark.parametrize(
    ("fields", "max_tokens"),
    [
        ({"lookup_draft_length": 65}, 4),
        ({"lookup_draft_length": 4, "allowed_tokens": ALL_ALLOWED}, 1),
        ({"lookup_draft_length": 4, "logprobs": logprobs_pb2.LogprobsOptions(num_top_logprobs=1)}, 4),
        ({"lookup_draft_length": 4, "sampling": common_pb2.SamplingParams(frequency_penalty=0.5)}, 4),
    ],
)
def test_bad_drafted_runs_get_invalid_argument_naming_lookup_draft_length(primary, fields, max_tokens):
    stub, engine, _ = primary
    lease = prefill(stub, "bad-draft")
    with pytest.raises(grpc.RpcError) as e:
        list(stream(stub, "bad-draft", lease, [], max_tokens, **fields))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lookup_draft_length" in e.value.details()
    assert engine.token_ids("bad-draft") == PROMPT
    release(stub, "bad-draft", lease)


def test_a_cancelled_drafted_stream_goes_on_from_what_its_caller_received(primary, copying):
    """A caller that cancels a drafted run mid-way: whatever step the engine was in, the request keeps
    at least the tokens received (a step's accepted drafts are committed even when the run ends
    there), and the next call, naming the context the caller knows, goes on with plain decoding's."""
    stub, engine, _ = primary
    prompt, expected = copying
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="dc", token_ids=prompt)).kv_lease
    call = stream(stub, "dc", lease, [], RUN, lookup_draft_length=8)
    received: list[int] = []
    while len(received) < 12:
        received += list(next(call).token_ids)
    call.cancel()
    assert received == expected[: len(received)]
    assert engine.num_tokens("dc") >= len(prompt) + len(received)
    more = stream(stub, "dc", lease, [], 6, num_context_tokens=len(prompt) + len(received), lookup_draft_length=8)
    assert [t for m in more for t in m.token_ids] == expected[len(received) : len(received) + 6]
    release(stub, "dc", lease)
    assert engine.kv_bytes == 0


SAMPLED = common_pb2.SamplingParams(temperature=0.3, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def looping(reference) -> list[int]:
    """A prompt that repeats one passage four times: its answer, sampled at a low temperature, goes on
    repeating it, which a run's drafts copy."""
    return PROMPT + reference[:24] * 4


def sampled_calls(stub, request_id: str, prompt: list[int], sampling, num_tokens: int) -> list[int]:
    """A seeded sampled answer one token per Decode call, each drawn at its position."""
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id=request_id, token_ids=prompt)).kv_lease
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        d = stub.Decode(
            primary_pb2.DecodeRequest(
                request_id=request_id,
                committed_token_ids=tokens[-1:],
                kv_lease=lease,
                sampling=sampling,
                position=len(tokens),
            )
        )
        tokens.append(d.token_id)
    release(stub, request_id, lease)
    return tokens


@pytest.mark.parametrize("lookup_draft_length", [0, 8])
def test_a_seeded_sampled_run_writes_the_tokens_of_a_call_a_token(primary, looping, lookup_draft_length):
    """A sampled run draws each token at its position (DecodeRequest.position + its index in the run),
    so it writes what one Decode call a token writes; drafting its copies, it keeps a draft where the
    draw at that row equals it, so the tokens are the same and several come a step."""
    stub, engine, _ = primary
    prompt = looping
    expected = sampled_calls(stub, "s-ref", prompt, SAMPLED, 40)
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="s", token_ids=prompt)).kv_lease
    first = list(stream(stub, "s", lease, [], 30, sampling=SAMPLED, lookup_draft_length=lookup_draft_length))
    more = list(
        stream(
            stub,
            "s",
            lease,
            [first[-1].token_ids[-1]],
            10,
            sampling=SAMPLED,
            position=30,
            lookup_draft_length=lookup_draft_length,
        )
    )
    assert [t for m in first + more for t in m.token_ids] == expected
    if lookup_draft_length:
        assert sum(m.num_draft_accepted for m in first) > 0 and max(len(m.token_ids) for m in first) > 1
    else:
        assert all(len(m.token_ids) == 1 and m.num_drafted == 0 for m in first + more)
    release(stub, "s", lease)
    assert engine.kv_bytes == 0


def test_an_unseeded_sampled_run_ends_where_asked_and_counts_its_drafts(primary, looping):
    """Without a seed each draw is fresh: the run still ends where asked, and what it kept of its
    drafts is within what it drafted."""
    stub, engine, _ = primary
    prompt = looping
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="u", token_ids=prompt)).kv_lease
    sampling = common_pb2.SamplingParams(temperature=0.3, top_k=20)
    messages = list(stream(stub, "u", lease, [], 24, sampling=sampling, lookup_draft_length=8))
    assert sum(len(m.token_ids) for m in messages) == 24 and messages[-1].is_run_end
    assert all(0 <= m.num_draft_accepted <= m.num_drafted for m in messages)
    release(stub, "u", lease)


def test_a_run_given_the_model_s_answers_drafts_from_them_and_decodes_plain_decoding_s_tokens(
    fp32_model, primary, reference
):
    """--run_answers: where the run's tail repeats nothing earlier in its context, it drafts what the
    model's answers continue with (here an answer holding plain decoding's own tokens): the tokens
    are plain decoding's, several a step, and the answers' drafted and kept tokens are counted."""
    _, engine, worker = primary
    registry = CollectorRegistry()
    answers = AnswerIndex(np.append(np.asarray(reference, dtype=np.int32), SEPARATOR).astype(np.int32), 49152)
    identity = ModelIdentity("test-model", "instance-2", MAX_CONTEXT, (2,), {1: 10.0})
    servicer = PrimaryServicer(
        fp32_model, worker, identity, 64 << 20, PrimaryMetrics(registry), KVLeases(30.0), answers=answers
    )
    with primary_stub(servicer) as stub:
        lease = prefill(stub, "answers")
        messages = list(stream(stub, "answers", lease, [], RUN, lookup_draft_length=8))
        release(stub, "answers", lease)
    assert [t for m in messages for t in m.token_ids] == reference[:RUN]
    assert max(len(m.token_ids) for m in messages) > 2
    drafted = registry.get_sample_value("specdec_run_answer_drafted_tokens_total")
    kept = registry.get_sample_value("specdec_run_answer_accepted_tokens_total")
    assert 0 < kept <= drafted <= registry.get_sample_value("specdec_run_drafted_tokens_total")
    assert sum(m.num_answer_drafted for m in messages) == drafted  # each step says how many of its drafts
    assert sum(m.num_answer_accepted for m in messages) == kept
    assert engine.kv_bytes == 0


def test_a_tenants_speculating_outputs_are_drafted_in_its_later_runs_and_no_one_elses(fp32_model, primary, reference):
    """learned_answers: at the Release of a request that drafted in a run, its output is kept for its
    tenant; the same question asked again by that tenant drafts it from the run's first step (the
    prompt's tail stood before it), several tokens a step, the tokens plain decoding's. Another
    tenant's run, and the output of a run that did not draft (speculation off), learn nothing."""
    _, engine, worker = primary
    registry = CollectorRegistry()
    learned = LearnedAnswers()
    identity = ModelIdentity("test-model", "instance-3", MAX_CONTEXT, (2,), {1: 10.0})
    servicer = PrimaryServicer(
        fp32_model, worker, identity, 64 << 20, PrimaryMetrics(registry), KVLeases(30.0), learned_answers=learned
    )

    def run(request_id: str, lookup_draft_length: int) -> list[primary_pb2.DecodeResponse]:
        lease = prefill(stub, request_id)
        messages = list(stream(stub, request_id, lease, [], RUN, lookup_draft_length=lookup_draft_length))
        release(stub, request_id, lease)
        assert [t for m in messages for t in m.token_ids] == reference[:RUN]
        return messages

    with primary_stub(servicer) as stub:
        run("a/plain", 0)
        assert learned.num_tokens("a") == 0  # speculation off: nothing kept
        first = run("a/first", 8)
        assert learned.num_tokens("a") > RUN
        again, other = run("a/again", 8), run("b/other", 8)
    assert sum(m.num_answer_accepted for m in again) > RUN // 2  # the output drafted back
    assert len(again) < len(first) // 2 and len(other) == len(first)  # b drafted nothing of a's
    assert engine.kv_bytes == 0


def test_the_kv_gauges_follow_a_slot_that_grows_while_its_request_decodes(fp32_model, tokenizer):
    """specdec_kv_bytes and kv_cache_usage_perc say what the engine holds after each step, not what
    it held at the last Prefill or Release: a run longer than the prompt's slot grows the slot.
    The worker and the servicer share one PrimaryMetrics, as primary_svc.__main__ wires them."""
    max_bytes = 64 << 20
    metrics = PrimaryMetrics(CollectorRegistry())
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32, max_bytes=max_bytes), MAX_CONTEXT)
    worker = EngineWorker(engine, metrics=metrics)
    identity = ModelIdentity("test-model", "instance-kv", MAX_CONTEXT, (2,), {1: 10.0})
    servicer = PrimaryServicer(
        fp32_model, worker, identity, max_bytes, metrics=metrics, leases=KVLeases(30.0), tokenizer=tokenizer
    )
    value = metrics.registry.get_sample_value
    try:
        with primary_stub(servicer) as stub:
            lease = prefill(stub, "kv")
            opened = engine.kv_bytes
            assert value("specdec_kv_bytes") == opened > 0
            assert len(list(stream(stub, "kv", lease, [], LONG))) == LONG  # past the prompt's slot
            worker.call(lambda e: None)  # the engine thread observed the metrics after the run's last step
            assert engine.kv_bytes > opened
            assert value("specdec_kv_bytes") == engine.kv_bytes
            assert value("specdec_kv_cache_usage_perc") == engine.kv_bytes / max_bytes
            release(stub, "kv", lease)
            assert value("specdec_kv_bytes") == engine.kv_bytes == 0
    finally:
        worker.stop()
