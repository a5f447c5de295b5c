"""What a stored request's readers get as its text: a retry of its request id (Resumption.followed)
and GetRequest give the text its own Generate gave, cut at its stop string, though its tokens are
stored up to the one that completes the stop string."""

from __future__ import annotations

import asyncio
import json
import types

import pytest
import structlog

from gateway.config import Limits
from gateway.params import params_to_json
from gateway.server import GenerationServicer
from specdec.errors import FailedPrecondition
from specdec.model.tokenizer import Tokenizer
from specdec.state_store import AsyncInMemoryStateStore, InMemoryStateStore, RequestStatus
from specdec.v1 import gateway_pb2


class Context:
    def time_remaining(self):
        return None


def stored(tokenizer: Tokenizer, request: gateway_pb2.GenerateRequest, text: str) -> GenerationServicer:
    """A servicer with only what reading a stored request touches, over a store holding `request`
    finished with the tokens of `text`."""
    store = AsyncInMemoryStateStore(InMemoryStateStore())
    store.sync.create(
        request.request_id, params_to_json(request), prompt_token_ids=[1, 2], status=RequestStatus.RUNNING
    )
    store.sync.append_step(request.request_id, tokenizer.encode(text))
    store.sync.set_status(request.request_id, RequestStatus.FINISHED, finish_reason="stop")
    s = GenerationServicer.__new__(GenerationServicer)
    s.store, s.tokenizer, s.api_keys, s.owner = store, tokenizer, None, "gateway@10.0.0.1:50050#1"
    s.log, s.config = structlog.get_logger("test"), types.SimpleNamespace(limits=Limits())
    return s


def read(s: GenerationServicer, request: gateway_pb2.GenerateRequest, is_streamed: bool) -> list:
    async def main() -> list:
        return [m async for m in s.followed(request, Context(), is_streamed=is_streamed)]

    return asyncio.run(main())


def test_a_retried_request_and_get_request_give_the_text_cut_at_its_stop_strings(tokenizer: Tokenizer) -> None:
    # " world" completes "wor": Generate kept that token and cut its text to "Hello"; the retry's
    # answer and GetRequest were the decoded tokens, "Hello world", stop string and all
    request = gateway_pb2.GenerateRequest(request_id="r1", prompt="Say hello", stop=["wor", "\n"])
    s = stored(tokenizer, request, "Hello world")
    unary = read(s, request, is_streamed=False)
    assert [m.text for m in unary] == ["Hello "] and list(unary[-1].token_ids) == tokenizer.encode("Hello world")
    streamed = read(s, request, is_streamed=True)
    assert "".join(m.text for m in streamed) == "Hello " and streamed[-1].is_final
    assert sum((list(m.token_ids) for m in streamed), []) == tokenizer.encode("Hello world")
    got = asyncio.run(s.GetRequest(gateway_pb2.GetRequestRequest(request_id="r1"), Context()))
    assert got.text == "Hello " and list(got.token_ids) == tokenizer.encode("Hello world")


def test_min_tokens_keeps_a_stop_string_in_its_first_tokens(tokenizer: Tokenizer) -> None:
    # the first "," is in the first min_tokens tokens: only the second ended the output
    request = gateway_pb2.GenerateRequest(request_id="r2", prompt="List", stop=[","])
    request.sampling.min_tokens = len(tokenizer.encode("a, b"))
    s = stored(tokenizer, request, "a, b,")
    assert [m.text for m in read(s, request, is_streamed=False)] == ["a, b"]


def test_without_stop_strings_the_text_is_the_tokens(tokenizer: Tokenizer) -> None:
    request = gateway_pb2.GenerateRequest(request_id="r3", prompt="Emoji")
    s = stored(tokenizer, request, "ok 🤗")
    assert "".join(m.text for m in read(s, request, is_streamed=True)) == "ok 🤗"
    assert [m.text for m in read(s, request, is_streamed=False)] == ["ok 🤗"]


def test_a_retried_request_with_tools_answers_its_calls_as_its_own_answer_did(tokenizer: Tokenizer) -> None:
    """Its calls read from its text, as the request's own Generate and GenerateStream read them
    (a retry used to answer the raw text, markup and all, with no calls)."""
    request = gateway_pb2.GenerateRequest(request_id="r4")
    request.chat.messages.add(role="user", content="Weather in Paris?")
    request.tools.add(name="get_weather", parameters=json.dumps({"type": "object"}))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    s = stored(tokenizer, request, "Let me look." + call)
    answer = asyncio.run(s._retried_answer(request, Context()))
    assert answer.content == "Let me look." and answer.finish_reason == gateway_pb2.FINISH_REASON_TOOL_CALLS
    assert [(c.name, json.loads(c.arguments)) for c in answer.tool_calls] == [("get_weather", {"city": "Paris"})]

    async def stream() -> list:
        return [m async for m in s._retried_stream(request, Context())]

    messages = asyncio.run(stream())
    assert "".join(m.content for m in messages) == "Let me look."
    deltas = [d for m in messages for d in m.tool_calls]
    assert deltas[0].name == "get_weather" and json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris"}
    assert messages[-1].is_final and messages[-1].finish_reason == gateway_pb2.FINISH_REASON_TOOL_CALLS


def test_a_follower_cuts_a_stream_stored_a_token_a_step(tokenizer: Tokenizer) -> None:
    """Each stored step read on its own (a step of one token, the last completing "wor")."""
    from gateway.output import add_stored, stored_output

    output, generated = stored_output(tokenizer, ("wor",), 0), []
    for t in tokenizer.encode("Hello world"):
        add_stored(output, [t], generated)
    assert output.is_stopped and output.text == "Hello " and generated == tokenizer.encode("Hello world")


def test_a_retry_of_a_request_that_asked_for_logprobs_is_refused_not_answered_without_them(
    tokenizer: Tokenizer,
) -> None:
    """The store keeps no log probabilities: a retry's answer would have none, read as complete."""
    request = gateway_pb2.GenerateRequest(request_id="r5", prompt="Say hello")
    request.logprobs.num_top_logprobs = 2
    s = stored(tokenizer, request, "Hello world")
    with pytest.raises(FailedPrecondition, match="log probabilities") as e:
        asyncio.run(s._retried_answer(request, Context()))
    assert e.value.field == "logprobs"

    async def stream() -> list:
        return [m async for m in s._retried_stream(request, Context())]

    with pytest.raises(FailedPrecondition, match="log probabilities"):
        asyncio.run(stream())
    got = asyncio.run(s.GetRequest(gateway_pb2.GetRequestRequest(request_id="r5"), Context()))
    assert got.text == "Hello world"  # the stored output is still there to read


def test_get_request_of_a_running_request_leaves_out_a_character_its_tokens_have_begun(
    tokenizer: Tokenizer,
) -> None:
    """Its next token completes the character: the text so far is not cut short with U+FFFD."""
    ids = tokenizer.encode("ok 🤗")
    *begun, last = ids
    assert tokenizer.decode(begun).endswith("\ufffd")  # the emoji's bytes span more than one token
    store = AsyncInMemoryStateStore(InMemoryStateStore())
    store.sync.create("r6", {"prompt": "Emoji"}, prompt_token_ids=[1, 2], status=RequestStatus.RUNNING)
    s = stored(tokenizer, gateway_pb2.GenerateRequest(request_id="r0", prompt="x"), "")
    s.store = store
    store.sync.append_step("r6", begun, owner=s.owner)  # run by this gateway: GetRequest adopts nothing

    def text() -> str:
        return asyncio.run(s.GetRequest(gateway_pb2.GetRequestRequest(request_id="r6"), Context())).text

    assert text() == "ok "
    store.sync.append_step("r6", [last], owner=s.owner)
    assert text() == "ok 🤗"
    store.sync.set_status("r6", RequestStatus.FINISHED, finish_reason="length")
    assert text() == "ok 🤗"
