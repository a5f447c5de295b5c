"""End to end through real processes: gateway -> draft/primary/validator over gRPC, a real Redis.

One stack for the module (tests/e2e/conftest.py). Greedy output, at the default precision, must not depend on
speculation, degree or draft length; a primary killed mid-request is recovered; bad input
gets a specific status naming the field, and leaves no KV memory behind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.prompts import load_prompts
from specdec.launcher import PRIMARY
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    primary_pb2,
    primary_pb2_grpc,
    validator_pb2,
    validator_pb2_grpc,
)

pytestmark = pytest.mark.e2e

DATA_DIR = Path(__file__).resolve().parents[2] / "bench" / "data"
SETTINGS = [  # (is_enabled, speculative_degree, draft_length)
    (False, 1, 1),
    (True, 1, 4),
    (True, 2, 8),
    (True, 4, 16),
]
MAX_NEW_TOKENS = 32


def generate(
    stub, messages=None, prompt=None, is_enabled=True, degree=1, draft_length=8, max_new_tokens=MAX_NEW_TOKENS, **kwargs
) -> gateway_pb2.GenerateResponse:
    # Fixed settings (not adaptive): every setting of SETTINGS runs as given.
    spec = gateway_pb2.SpeculationConfig(
        is_enabled=is_enabled, speculative_degree=degree, draft_length=draft_length, is_adaptive=False
    )
    req = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens, speculation=spec, **kwargs)
    if prompt is not None:
        req.prompt = prompt
    else:
        req.chat.messages.extend(gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    return stub.Generate(req, timeout=300)


@pytest.fixture(scope="module")
def prompts():
    chosen = load_prompts(DATA_DIR, ["code", "prose", "json"], 1, max_chars=600)
    assert len(chosen) == 3
    return chosen


def primary_stats(stack) -> primary_pb2.GetStatsResponse:
    with stack.channel(PRIMARY) as ch:
        return primary_pb2_grpc.PrimaryServiceStub(ch).GetStats(primary_pb2.GetStatsRequest(), timeout=10)


def test_greedy_output_is_identical_with_and_without_speculation(gateway_stub, prompts, stack):
    for p in prompts:
        messages = [(m["role"], m["content"]) for m in p.messages()]
        outputs = {
            s: generate(gateway_stub, messages, is_enabled=s[0], degree=s[1], draft_length=s[2]) for s in SETTINGS
        }
        baseline = outputs[SETTINGS[0]]
        assert len(baseline.token_ids) > 0
        for setting, out in outputs.items():
            assert list(out.token_ids) == list(baseline.token_ids), (p.id, setting, out.text, baseline.text)
            assert out.text == baseline.text
        speculative = outputs[SETTINGS[2]]
        assert speculative.stats.num_steps <= baseline.stats.num_steps
        assert speculative.stats.num_generated_tokens == len(speculative.token_ids)
        assert speculative.stats.mean_accepted_length >= 1.0
    assert primary_stats(stack).kv_bytes == 0


def test_an_answer_that_ends_at_its_end_token_gains_a_token_a_plain_step(gateway_stub):
    """The step that decodes the end-of-sequence token committed it, though the output leaves it out:
    plain decoding's mean accepted length is 1, not (n - 1) / n."""
    out = generate(gateway_stub, [("user", "Hi")], is_enabled=False)
    assert out.finish_reason == gateway_pb2.FINISH_REASON_EOS
    assert out.stats.num_steps == out.stats.num_generated_tokens + 1 == len(out.token_ids) + 1
    assert out.stats.mean_accepted_length == 1.0


def test_a_seeded_sampled_answer_is_the_same_with_and_without_speculation(gateway_stub):
    """The token at each position is drawn from the seed's stream for that position, by the primary's
    Decode or the validator's walk alike: with a seed, a sampled answer does not depend on
    speculation, degree or draft length (nor on an adaptive plan), and the drafts still get accepted."""
    messages = [
        ("user", "Copy this list exactly, twice: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, kappa.")
    ]
    num_drafted = 0
    for sampling in (
        common_pb2.SamplingParams(temperature=0.7, top_p=0.9, seed=1),
        common_pb2.SamplingParams(temperature=0.7, top_p=0.9, seed=2),
        # the primary's per-node penalties, and min_p where temperature is applied (validator, Decode)
        common_pb2.SamplingParams(
            temperature=0.7, seed=3, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2, logit_bias={13: 1.0}
        ),
    ):
        seed = sampling.seed
        outputs = {
            s: generate(gateway_stub, messages, is_enabled=s[0], degree=s[1], draft_length=s[2], sampling=sampling)
            for s in SETTINGS
        }
        baseline = outputs[SETTINGS[0]]
        for setting, out in outputs.items():
            assert list(out.token_ids) == list(baseline.token_ids), (seed, setting, out.text, baseline.text)
            num_drafted += out.stats.num_generated_tokens - out.stats.num_steps if setting[0] else 0
    assert num_drafted > 0, "no speculative step accepted a draft token: the test shows nothing"


def test_stream_delivers_the_same_text_and_final_stats(gateway_stub):
    messages = [("user", "List the planets of the solar system, one per line.")]
    unary = generate(gateway_stub, messages)
    req = gateway_pb2.GenerateRequest(max_new_tokens=MAX_NEW_TOKENS)
    req.chat.messages.add(role="user", content=messages[0][1])
    chunks = list(gateway_stub.GenerateStream(req, timeout=300))
    assert chunks[-1].is_final and chunks[-1].stats.num_generated_tokens == len(unary.token_ids)
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id=chunks[0].request_id))
    assert state.status == gateway_pb2.REQUEST_STATUS_FINISHED and list(state.token_ids) == list(unary.token_ids)


def test_a_plain_stream_carries_one_engine_step_per_message(gateway_stub, stack):
    """Speculation off, the primary streams each run of plain steps (PrimaryService.DecodeStream) and
    the gateway relays each engine step as its own message once stored: every message carries one
    token, and the output is the one speculation gives (greedy exactness). A stop string ends the
    request in the middle of a run: the primary's run is cancelled and nothing stays behind."""
    messages = [("user", "Count from 1 to 30, separated by commas.")]
    speculative = generate(gateway_stub, messages, degree=2, draft_length=8, max_new_tokens=40)
    req = gateway_pb2.GenerateRequest(
        max_new_tokens=40, speculation=gateway_pb2.SpeculationConfig(is_enabled=False, is_adaptive=False)
    )
    req.chat.messages.add(role="user", content=messages[0][1])
    chunks = list(gateway_stub.GenerateStream(req, timeout=300))
    with_tokens = [c for c in chunks if c.token_ids]
    assert len(with_tokens) == len(speculative.token_ids) == chunks[-1].stats.num_generated_tokens
    assert all(len(c.token_ids) == 1 for c in with_tokens)
    assert [t for c in chunks for t in c.token_ids] == list(speculative.token_ids)
    assert "".join(c.text for c in chunks) == speculative.text
    # a stop string from the middle of that output: the request ends at its first occurrence, in a run
    text = "".join(c.text for c in chunks)
    at = len("".join(c.text for c in chunks[:20]))
    stop = text[at : at + 4]
    stopped = list(gateway_stub.GenerateStream(gateway_pb2.GenerateRequest(stop=[stop], **_fields(req)), timeout=300))
    assert stopped[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP and stop not in "".join(c.text for c in stopped)
    assert all(len(c.token_ids) <= 1 for c in stopped) and sum(len(c.token_ids) for c in stopped) < 40
    stats = primary_stats(stack)
    assert stats.num_active_requests == 0 and stats.kv_bytes == 0


def test_a_unary_plain_request_takes_runs_several_steps_a_message_and_counts_every_step(gateway_stub, stack):
    """A client that waits for the whole answer (Generate) gets the primary's runs several engine steps
    a message (the gateway's --unary_stream_interval): the tokens and text of its stream, each engine
    step counted in its stats (a token each, speculation off), and a stop string in the middle of a
    message ends the answer at its first occurrence, the message sent at once after the step that
    completed it, with nothing left behind."""
    req = gateway_pb2.GenerateRequest(
        max_new_tokens=40, speculation=gateway_pb2.SpeculationConfig(is_enabled=False, is_adaptive=False)
    )
    req.chat.messages.add(role="user", content="Count from 1 to 30, separated by commas.")
    chunks = list(gateway_stub.GenerateStream(req, timeout=300))
    unary = gateway_stub.Generate(req, timeout=300)
    assert list(unary.token_ids) == [t for c in chunks for t in c.token_ids]
    assert unary.text == "".join(c.text for c in chunks)
    assert unary.stats.num_steps == unary.stats.num_generated_tokens == len(unary.token_ids) == 40
    stop = unary.text[len(unary.text) // 2 : len(unary.text) // 2 + 3]
    stopped = gateway_stub.Generate(gateway_pb2.GenerateRequest(stop=[stop], **_fields(req)), timeout=300)
    streamed = list(gateway_stub.GenerateStream(gateway_pb2.GenerateRequest(stop=[stop], **_fields(req)), timeout=300))
    assert stopped.finish_reason == streamed[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert stopped.text == "".join(c.text for c in streamed) == unary.text[: unary.text.index(stop)]
    # the primary sent the step that completed it at once (DecodeRequest.stop_strings): no step past it ran
    # for the answer, the step of the token that completed it and dropped the last one counted
    assert stopped.stats.num_steps <= len(stopped.token_ids) + 1 < 40
    stats = primary_stats(stack)
    assert stats.num_active_requests == 0 and stats.kv_bytes == 0


def _fields(req: gateway_pb2.GenerateRequest) -> dict[str, Any]:
    """A request's set fields, to build a variant of it."""
    return {f.name: v for f, v in req.ListFields()}


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache_with_the_same_output(gateway_stub, stack):
    """The primary keeps the KV rows of prompts it prefilled: the same prompt again reuses them
    (reported in the stats) and, the reuse being bit-exact, gives the same greedy output. Longer
    than one prefill chunk (512), so that even a primary reusing only whole chunks (float) reuses."""
    text = " ".join(f"Item {i}: a line of a long inventory list that repeats itself." for i in range(50))
    messages = [("user", f"{text}\nSummarize the list in one sentence.")]
    first = generate(gateway_stub, messages)
    again = generate(gateway_stub, messages)
    assert list(again.token_ids) == list(first.token_ids) and again.text == first.text
    assert again.stats.num_cached_prompt_tokens > first.stats.num_cached_prompt_tokens
    assert again.stats.num_cached_prompt_tokens >= 512
    stats = primary_stats(stack)
    assert stats.kv_bytes == 0 and 0 < stats.prefix_cache_bytes <= stats.max_prefix_cache_bytes
    assert stats.num_prefix_reused_tokens >= again.stats.num_cached_prompt_tokens


def test_stop_strings_and_cancel(gateway_stub):
    messages = [("user", "Count from 1 to 20, separated by commas.")]
    out = generate(gateway_stub, messages, stop=["7"], draft_length=16)
    assert "7" not in out.text and out.finish_reason == gateway_pb2.FINISH_REASON_STOP
    plain = generate(gateway_stub, messages, stop=["7"], is_enabled=False)
    assert list(out.token_ids) == list(plain.token_ids) and out.text == plain.text  # cut at the same token

    # Up to the context's end, so the request is still running when Cancel comes on any CPU.
    req = gateway_pb2.GenerateRequest(request_id="to-cancel", max_new_tokens=4000)
    req.chat.messages.add(role="user", content="Write a long story about a lighthouse keeper.")
    stream = gateway_stub.GenerateStream(req, timeout=300)
    next(stream)
    assert gateway_stub.Cancel(gateway_pb2.CancelRequest(request_id="to-cancel")).was_active
    rest = list(stream)
    assert rest[-1].finish_reason == gateway_pb2.FINISH_REASON_CANCELLED
    assert rest[-1].stats.num_generated_tokens < 4000


def primary_precision(stack) -> str:
    with stack.channel(PRIMARY) as ch:
        info = primary_pb2_grpc.PrimaryServiceStub(ch).GetModelInfo(primary_pb2.GetModelInfoRequest(), timeout=10)
        return info.precision


def test_killed_primary_is_recovered_with_the_same_text(gateway_stub, stack, stream_in_background):
    messages = [("user", "Explain in a few sentences how a bicycle gear works.")]
    reference = generate(gateway_stub, messages, max_new_tokens=40)
    precision = primary_precision(stack)
    req = gateway_pb2.GenerateRequest(request_id="survives-primary-crash", max_new_tokens=40)
    req.chat.messages.add(role="user", content=messages[0][1])
    req.speculation.is_enabled = True
    received, errors, reader = stream_in_background(gateway_stub, req, timeout_s=600)
    stack.restart(PRIMARY)  # SIGKILL, then a fresh process on the same port
    reader.join(timeout=600)
    assert not errors, errors
    # The restart serves its predecessor's weights (--precision auto's cached choice): other weights'
    # greedy output parts from this one at the 7th token (primary_svc.autotune)
    assert primary_precision(stack) == precision
    assert received[-1].is_final
    assert [tok for c in received for tok in c.token_ids] == list(reference.token_ids)
    assert "".join(c.text for c in received) == reference.text


def test_bad_input_gets_a_specific_status_naming_the_field_and_frees_everything(gateway_stub, stack):
    def expect(code, field, **kwargs):
        req = gateway_pb2.GenerateRequest(**kwargs)
        with pytest.raises(grpc.RpcError) as e:
            gateway_stub.Generate(req, timeout=60)
        assert e.value.code() == code, (field, e.value.code(), e.value.details())
        assert field in e.value.details(), (field, e.value.details())

    bad = grpc.StatusCode.INVALID_ARGUMENT
    expect(bad, "prompt", prompt="")
    expect(bad, "prompt", prompt="word " * 5000)  # longer than the context
    expect(bad, "max_new_tokens", prompt="hi", max_new_tokens=0)
    expect(bad, "max_new_tokens", prompt="hi", max_new_tokens=10**9)
    expect(bad, "sampling.temperature", prompt="hi", sampling=common_pb2.SamplingParams(temperature=-1))
    expect(bad, "sampling.top_p", prompt="hi", sampling=common_pb2.SamplingParams(top_p=0))
    expect(bad, "sampling.top_p", prompt="hi", sampling=common_pb2.SamplingParams(top_p=1.5))
    expect(bad, "sampling.top_k", prompt="hi", sampling=common_pb2.SamplingParams(top_k=-2))
    expect(
        bad,
        "speculation.speculative_degree",
        prompt="hi",
        speculation=gateway_pb2.SpeculationConfig(speculative_degree=100),
    )
    expect(bad, "speculation.draft_length", prompt="hi", speculation=gateway_pb2.SpeculationConfig(draft_length=999))
    expect(
        bad,
        "speculation.acceptance_threshold",
        prompt="hi",
        speculation=gateway_pb2.SpeculationConfig(acceptance_threshold=1.5),
    )
    expect(
        bad,
        "speculation.acceptance_threshold",
        prompt="hi",
        speculation=gateway_pb2.SpeculationConfig(acceptance_threshold=-0.1),
    )
    expect(bad, "speculation.strategies", prompt="hi", speculation=gateway_pb2.SpeculationConfig(strategies=["x"]))
    expect(
        bad,
        "chat.messages[0].role",
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="wizard", content="hi")]),
    )
    expect(bad, "request_id", prompt="hi", request_id="x" * 500)

    for call, req in (
        (gateway_stub.GetRequest, gateway_pb2.GetRequestRequest(request_id="no-such-request")),
        (gateway_stub.Cancel, gateway_pb2.CancelRequest(request_id="no-such-request")),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "request_id" in e.value.details()

    with grpc.insecure_channel(stack.gateway_address) as ch:
        # Field 2 (prompt), length-delimited, two bytes that are not UTF-8.
        raw = ch.unary_unary("/specdec.v1.GenerationService/Generate")
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\x12\x02\xff\xfe", timeout=10)
        assert e.value.code() == bad and "UTF-8" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # over the message size limit
            gateway_stub.Generate(gateway_pb2.GenerateRequest(prompt="x" * (8 << 20)), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    with stack.channel(PRIMARY) as ch:
        manifest = (
            primary_pb2_grpc.PrimaryServiceStub(ch)
            .ExportWeights(primary_pb2.ExportWeightsRequest(), timeout=10)
            .manifest
        )
    with stack.channel("draft") as ch:
        draft = draft_pb2_grpc.DraftServiceStub(ch)
        for field, corrupt in (
            ("segment_name", lambda m: setattr(m.memory, "segment_name", "../../etc/passwd")),
            ("num_bytes", lambda m: setattr(m.memory, "num_bytes", m.memory.num_bytes + 64)),
            ("offset", lambda m: setattr(m.tensors[0], "offset", 1 << 40)),
        ):
            bad_manifest = common_pb2.WeightManifest()
            bad_manifest.CopyFrom(manifest)
            corrupt(bad_manifest)
            with pytest.raises(grpc.RpcError) as e:
                draft.Attach(draft_pb2.AttachRequest(manifest=bad_manifest), timeout=30)
            assert e.value.code() == bad and field in e.value.details(), (field, e.value.details())
    with stack.channel("validator") as ch:
        logits = common_pb2.Logits(
            inline_logits=common_pb2.InlineLogits(
                format=common_pb2.LOGITS_FORMAT_FP32, num_rows=2, vocab_size=8, data=b"\0" * 12
            )
        )
        with pytest.raises(grpc.RpcError) as e:
            validator_pb2_grpc.ValidatorServiceStub(ch).Validate(
                validator_pb2.ValidateRequest(
                    request_id="r",
                    mode=validator_pb2.ACCEPTANCE_MODE_GREEDY,
                    tree=common_pb2.TokenTree(token_ids=[1], parents=[-1]),
                    target_logits=logits,
                ),
                timeout=10,
            )
        assert e.value.code() == bad and "target_logits" in e.value.details()

    stats = primary_stats(stack)
    assert stats.kv_bytes == 0 and stats.num_active_requests == 0


def test_killed_gateway_is_resumed_from_redis_by_its_successor(gateway_stub, stack):
    from specdec.launcher import GATEWAY

    messages = [("user", "Describe the water cycle in four sentences.")]
    reference = generate(gateway_stub, messages, max_new_tokens=40)
    req = gateway_pb2.GenerateRequest(request_id="survives-gateway-crash", max_new_tokens=40)
    req.chat.messages.add(role="user", content=messages[0][1])
    stream = gateway_stub.GenerateStream(req, timeout=600)
    first = next(stream)  # the request is running and in Redis
    assert first.token_ids
    stack.restart(GATEWAY)  # SIGKILL mid-request; the successor resumes it
    with pytest.raises(grpc.RpcError):
        list(stream)  # this client's stream died with the old gateway
    with grpc.insecure_channel(stack.gateway_address) as ch:
        from specdec.v1 import gateway_pb2_grpc

        stub = gateway_pb2_grpc.GenerationServiceStub(ch)
        give_up = time.monotonic() + 300
        while True:
            state = stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="survives-gateway-crash"), timeout=10)
            if state.status != gateway_pb2.REQUEST_STATUS_RUNNING or time.monotonic() > give_up:
                break
            time.sleep(0.2)
    assert state.status == gateway_pb2.REQUEST_STATUS_FINISHED, state
    assert list(state.token_ids) == list(reference.token_ids)
    assert state.text == reference.text


def test_a_client_deadline_stops_the_request_within_a_step_and_frees_its_kv(gateway_stub, stack):
    # 3000 tokens cannot be generated within 1.5 s on any machine this runs on (400 within 3 s could:
    # the request then finished just as the deadline passed).
    req = gateway_pb2.GenerateRequest(request_id="short-deadline", max_new_tokens=3000)
    req.chat.messages.add(role="user", content="Write a very long essay about the history of bridges.")
    with pytest.raises(grpc.RpcError) as e:
        gateway_stub.Generate(req, timeout=1.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="short-deadline"), timeout=10)
        if state.status != gateway_pb2.REQUEST_STATUS_RUNNING and primary_stats(stack).kv_bytes == 0:
            break
        time.sleep(0.2)
    assert state.status == gateway_pb2.REQUEST_STATUS_CANCELLED
    assert state.finish_reason in (gateway_pb2.FINISH_REASON_DEADLINE, gateway_pb2.FINISH_REASON_CANCELLED)
    assert len(state.token_ids) < 3000 and primary_stats(stack).kv_bytes == 0


# The default model loops on this prompt when greedy ("A joy that brings laughter, a joy that brings
# laughter, ..."): what the penalties are for.
LOOP_MESSAGES = [("user", "Write a short poem about joy.")]
LOOP_NEW_TOKENS = 48
PENALTIES: dict[str, dict[str, Any]] = {  # each control alone, in the gRPC API's SamplingParams
    "frequency_penalty": {"frequency_penalty": 1.0},
    "presence_penalty": {"presence_penalty": 1.0},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "logit_bias": {},  # filled from the plain answer: its most frequent token banned, see below
}


def max_repeats(text: str) -> int:
    """How often the answer's most repeated word trigram occurs (1: no trigram repeats)."""
    words = text.lower().replace(",", " ").split()
    trigrams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return max((trigrams.count(t) for t in trigrams), default=0)


@pytest.fixture(scope="module")
def loop_answer(gateway_stub) -> gateway_pb2.GenerateResponse:
    return generate(gateway_stub, LOOP_MESSAGES, is_enabled=False, max_new_tokens=LOOP_NEW_TOKENS)


@pytest.mark.parametrize("name", list(PENALTIES))
def test_greedy_output_with_a_penalty_is_identical_with_and_without_speculation(gateway_stub, loop_answer, name):
    """The primary processes each tree node's row from that node's own history, as Decode processes the
    same position, so speculation (any degree, any draft length) changes nothing; and the control does
    change the answer (else the test would show nothing).

    Drafts are accepted by construction: each speculative run is given the answer without the control
    (loop_answer) as its prediction, and a fixed plan drafts with the prediction decoder first (alone
    at degree 1). The control leaves that answer's beginning as it is (a frequency or presence penalty
    lowers only tokens already generated, the logit bias a token that comes later), so its drafts
    there are accepted; past the token the control turns they are rejected and the primary's own
    token follows: both under the control. The default decoders' drafts alone need not be accepted:
    under a frequency penalty the answer stops repeating the text prompt lookup copies."""
    fields: dict[str, Any] = dict(PENALTIES[name])
    if name == "logit_bias":
        fields["logit_bias"] = {max(set(loop_answer.token_ids), key=list(loop_answer.token_ids).count): -100.0}
    sampling = common_pb2.SamplingParams(**fields)
    baseline = generate(
        gateway_stub, LOOP_MESSAGES, is_enabled=False, max_new_tokens=LOOP_NEW_TOKENS, sampling=sampling
    )
    prediction = gateway_pb2.Prediction(content=loop_answer.text)
    assert list(baseline.token_ids) != list(loop_answer.token_ids), f"{name} changed nothing"
    # Asked twice at most: a request's steps may all run plain for reasons of the moment (the draft
    # service's breaker open after a slow call on a loaded machine), which leaves exactness shown
    # but nothing drafted; every output of both rounds must equal the baseline's.
    num_drafted = 0
    for _ in range(2):
        for setting in SETTINGS[1:]:
            out = generate(
                gateway_stub,
                LOOP_MESSAGES,
                is_enabled=setting[0],
                degree=setting[1],
                draft_length=setting[2],
                max_new_tokens=LOOP_NEW_TOKENS,
                sampling=sampling,
                prediction=prediction,
            )
            assert list(out.token_ids) == list(baseline.token_ids), (name, setting, out.text, baseline.text)
            num_drafted += out.stats.num_generated_tokens - out.stats.num_steps
        if num_drafted > 0:
            break
    assert num_drafted > 0, "no speculative step accepted a draft token: the test shows nothing"


def test_a_repetition_or_frequency_penalty_breaks_the_default_models_loop(gateway_stub):
    plain = generate(gateway_stub, LOOP_MESSAGES, max_new_tokens=2 * LOOP_NEW_TOKENS)
    assert max_repeats(plain.text) >= 3, plain.text  # the loop, greedy
    controls: tuple[dict[str, Any], ...] = ({"repetition_penalty": 1.3}, {"frequency_penalty": 1.0})
    for fields in controls:
        out = generate(
            gateway_stub,
            LOOP_MESSAGES,
            max_new_tokens=2 * LOOP_NEW_TOKENS,
            sampling=common_pb2.SamplingParams(**fields),
        )
        assert max_repeats(out.text) < max_repeats(plain.text), (fields, out.text, plain.text)


def test_a_logit_bias_beyond_the_vocabulary_is_invalid_argument(gateway_stub):
    with pytest.raises(grpc.RpcError) as e:
        generate(gateway_stub, [("user", "Hi")], sampling=common_pb2.SamplingParams(logit_bias={1 << 30: 1.0}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling.logit_bias: token id 1073741824 is not below the vocab_size")


COPYING_MESSAGES = [
    (
        "user",
        "Write a Python class Point with x and y, then write three functions that each create a Point and print "
        "its x and y.",
    )
]
COPYING_NEW_TOKENS = 192


@pytest.mark.parametrize("is_json", [False, True])
def test_plain_runs_draft_or_end_where_the_answer_repeats_itself_with_the_same_output(gateway_stub, is_json):
    """The default model's answer to COPYING_MESSAGES comes to repeat its own lines (greedy). Under the
    product's adaptive speculation the primary streams plain runs, which draft the copies in the
    primary (DecodeRequest.lookup_draft_length; under a response format checked by the primary's own
    grammar state), counted under prompt_lookup@run. The output is plain decoding's, also under a
    response format."""
    fmt = common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_JSON_OBJECT) if is_json else None
    plain = generate(
        gateway_stub, COPYING_MESSAGES, is_enabled=False, max_new_tokens=COPYING_NEW_TOKENS, response_format=fmt
    )
    req = gateway_pb2.GenerateRequest(max_new_tokens=COPYING_NEW_TOKENS, response_format=fmt)  # product defaults
    req.chat.messages.extend(gateway_pb2.ChatMessage(role=r, content=c) for r, c in COPYING_MESSAGES)
    out = gateway_stub.Generate(req, timeout=300)
    assert list(out.token_ids) == list(plain.token_ids), (out.text, plain.text)
    in_runs = {d.name: d for d in out.stats.decoders}.get("prompt_lookup@run")
    assert in_runs is not None and in_runs.num_accepted > 0, out.stats
    assert out.stats.num_steps < out.stats.num_generated_tokens and out.stats.num_accepted_tokens > 0
