"""OpenAI's tools over HTTP: the request's tools, choice and history calls -> GenerateRequest, the
gateway's field names -> OpenAI's parameters, and parsed calls -> the message and stream deltas
the SDKs read."""

from __future__ import annotations

import json

import pytest

from http_svc.errors import ApiError, param_for
from http_svc.openai_request import CHAT, parse_request
from http_svc.openai_response import ChunkWriter, completion
from specdec.v1 import gateway_pb2, logprobs_pb2

MODEL = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": WEATHER}}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_tools_choice_and_history_become_the_generate_request() -> None:
    messages = [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "X"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
    ]
    body = chat(
        messages=messages,
        tools=[TOOL, {"type": "function", "function": {"name": "noop"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    r = parse_request(body, CHAT).request
    assert [(t.name, t.description, t.parameters) for t in r.tools] == [
        ("get_weather", "d", json.dumps(WEATHER)),
        ("noop", "", ""),
    ]
    assert r.tool_choice.mode == gateway_pb2.ToolChoice.MODE_FUNCTION and r.tool_choice.function_name == "get_weather"
    assert r.HasField("parallel_tool_calls") and not r.parallel_tool_calls
    user, assistant, result = r.chat.messages
    assert user.name == ""  # a participant's name, not a tool's
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [("call_1", "get_weather", '{"city": "X"}')]
    assert (result.role, result.tool_call_id, result.name, result.content) == ("tool", "call_1", "get_weather", "18 C")
    for choice, mode in (("auto", "MODE_AUTO"), ("none", "MODE_NONE"), ("required", "MODE_REQUIRED")):
        r = parse_request(chat(tools=[TOOL], tool_choice=choice), CHAT).request
        assert r.tool_choice.mode == gateway_pb2.ToolChoice.Mode.Value(mode)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": 1}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
        ({"parallel_tool_calls": 1}, "parallel_tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": {}}]}, "messages[0].tool_calls"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "tool", "tool_call_id": 3, "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "function_call": {"name": "f"}}]}, "messages[0].function_call"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_a_tool_body_not_of_the_openai_shape_is_a_400_naming_the_parameter(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_request(chat(**fields), CHAT)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(f"{param}: ")


def test_gateway_fields_are_named_as_openai_parameters() -> None:
    assert param_for("tools[2].name", {}) == "tools[2].function.name"
    assert param_for("tools[0].parameters", {}) == "tools[0].function.parameters"
    assert param_for("chat.messages[3].tool_calls[1].name", {}) == "messages[3].tool_calls[1].function.name"
    assert param_for("chat.messages[3].tool_calls[1].arguments", {}) == "messages[3].tool_calls[1].function.arguments"
    assert param_for("chat.messages[3].tool_call_id", {}) == "messages[3].tool_call_id"
    assert param_for("tool_choice.function_name", {}) == "tool_choice.function.name"
    assert param_for("tool_choice.mode", {}) == "tool_choice"


def test_calls_in_a_whole_answer() -> None:
    parsed = parse_request(chat(tools=[TOOL], tool_choice="required"), CHAT)
    response = gateway_pb2.GenerateResponse(
        text='[{"name": "get_weather", "arguments": {}}]',
        content="",
        tool_calls=[gateway_pb2.ToolCall(id="call_a", name="get_weather", arguments="{}")],
        finish_reason=gateway_pb2.FINISH_REASON_TOOL_CALLS,
    )
    choice = completion(parsed, "chatcmpl-1", 0, MODEL, [response])["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
    }
    response.content, response.finish_reason = "no call", gateway_pb2.FINISH_REASON_EOS
    del response.tool_calls[:]
    message = completion(parsed, "chatcmpl-1", 0, MODEL, [response])["choices"][0]["message"]
    assert message["content"] == "no call" and "tool_calls" not in message


def test_streamed_calls_are_openai_deltas() -> None:
    writer = ChunkWriter(parse_request(chat(tools=[TOOL], stream=True), CHAT), "chatcmpl-1", 0, MODEL)

    def deltas(message: gateway_pb2.GenerateStreamResponse) -> list[dict]:
        events = writer.step(message).decode().split("\n\n")
        return [json.loads(e[6:])["choices"][0] for e in events if e.startswith("data: {")]

    first = deltas(gateway_pb2.GenerateStreamResponse(text="Sure.", content="Sure.", token_ids=[1]))
    assert [c["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "Sure."}]
    assert deltas(gateway_pb2.GenerateStreamResponse(text='<tool_call>{"na', content="", token_ids=[2])) == []
    step = gateway_pb2.GenerateStreamResponse(
        text="...",
        content="",
        tool_calls=[
            gateway_pb2.ToolCallDelta(index=0, id="call_a", name="get_weather"),
            gateway_pb2.ToolCallDelta(index=0, arguments='{"city"'),
        ],
    )
    assert [c["delta"] for c in deltas(step)] == [
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]},
    ]
    last = deltas(
        gateway_pb2.GenerateStreamResponse(
            is_final=True, content="", finish_reason=gateway_pb2.FINISH_REASON_TOOL_CALLS
        )
    )
    assert last[-1]["finish_reason"] == "tool_calls"


def test_streamed_calls_keep_every_tokens_log_probability() -> None:
    """A step inside a call whose name is still open gives no piece; its tokens' log probabilities
    still go out, on a chunk of their own, so the stream carries one per token as the whole answer does."""
    writer = ChunkWriter(parse_request(chat(tools=[TOOL], stream=True, logprobs=True), CHAT), "chatcmpl-1", 0, MODEL)

    def chunks(message: gateway_pb2.GenerateStreamResponse) -> list[dict]:
        events = writer.step(message).decode().split("\n\n")
        return [json.loads(e[6:])["choices"][0] for e in events if e.startswith("data: {")]

    held = gateway_pb2.GenerateStreamResponse(
        text='<tool_call>{"na',
        content="",
        token_ids=[2, 3],
        logprobs=[
            logprobs_pb2.TokenLogprob(token_id=2, logprob=-0.5, text="<tool_call>"),
            logprobs_pb2.TokenLogprob(token_id=3, logprob=-0.25, text='{"na'),
        ],
    )
    sent = [c for c in chunks(held) if c["logprobs"] is not None]
    assert [e["logprob"] for c in sent for e in c["logprobs"]["content"]] == [-0.5, -0.25]
    assert all("tool_calls" not in c["delta"] and not c["delta"].get("content") for c in sent)
