"""Tools / function calling on a live stack, through the official `openai` client, LangChain's
ChatOpenAI and the gRPC API: forced calls (tool_choice required / a named function) generated
under the tools' schemas, streamed as OpenAI's deltas, tool results fed back in the history, a
two-tool agent loop, and bad tools refused with a 400 naming the parameter.

The 135M model is not asked to choose wisely: where a call is needed, tool_choice forces it, and
the tests assert the protocol (calls parsed, arguments valid against the schema, the history
accepted), plus that greedy forced calls with speculation on equal those of plain decoding."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from specdec.launcher import Stack
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 32}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The local time in a timezone", "parameters": TIME_PARAMETERS},
    },
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
MAX_TOKENS = 96
STACK_OPTIONS = {"is_serving_http": True}  # the module's stack (tests/e2e/conftest.py) serves HTTP too


@pytest.fixture(scope="module")
def chat_model(stack: Stack) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=f"{stack.http_url}/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS
    )


def _create(client: openai.OpenAI, **kwargs):
    kwargs = {"messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=MODEL, **kwargs)


def _assert_valid_call(call) -> dict:  # noqa: ANN001 - the SDK's ChatCompletionMessageToolCall
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


# ---- the openai client ----------------------------------------------------------------------------


def test_required_calls_follow_the_schemas_and_equal_plain_decoding(client: openai.OpenAI):
    answer = _create(client, tools=TOOLS, tool_choice="required")
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _assert_valid_call(call)
    plain = _create(client, tools=TOOLS, tool_choice="required", extra_body={"speculative_decoding": False})
    assert [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert len({c.id for c in choice.message.tool_calls + plain.choices[0].message.tool_calls}) == 2 * len(
        choice.message.tool_calls
    )


def test_a_named_function_is_called_once(client: openai.OpenAI):
    answer = _create(
        client,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
    )
    calls = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_time"]
    _assert_valid_call(calls[0])


def test_streamed_calls_are_openai_deltas_that_add_up_to_the_whole_answer(client: openai.OpenAI):
    whole = _create(client, tools=TOOLS, tool_choice="required").choices[0].message.tool_calls
    chunks = list(_create(client, tools=TOOLS, tool_choice="required", stream=True))
    pieces: dict[int, list] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            pieces.setdefault(delta.index, []).append(delta)
    assert sorted(pieces) == list(range(len(whole)))
    for index, call in enumerate(whole):
        first, *rest = pieces[index]
        assert first.id.startswith("call_") and first.type == "function" and first.function.name == call.function.name
        assert all(d.id is None and d.function.name is None for d in rest)
        assert "".join(d.function.arguments for d in pieces[index]) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert not any(c.choices[0].delta.content for c in chunks)


def test_auto_and_none_render_the_tools_and_answer_in_one_of_the_shapes(client: openai.OpenAI):
    without = _create(client, max_tokens=8)
    auto = _create(client, tools=TOOLS, max_tokens=24)
    none = _create(client, tools=TOOLS, tool_choice="none", max_tokens=24)
    # the tools are in the prompt of both (the default format lists them in the system turn)
    assert auto.usage.prompt_tokens == none.usage.prompt_tokens > without.usage.prompt_tokens + 50
    assert none.choices[0].message.tool_calls is None and isinstance(none.choices[0].message.content, str)
    message = auto.choices[0].message
    if message.tool_calls:
        assert auto.choices[0].finish_reason in ("tool_calls", "length")
        for call in message.tool_calls:
            assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert isinstance(message.content, str) and auto.choices[0].finish_reason in ("stop", "length")


def test_a_history_with_calls_and_results_is_accepted(client: openai.OpenAI):
    call = _create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message
    history = [
        *QUESTION,
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    answer = _create(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=24)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answer.choices[0].message.content, str)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {"messages": [*QUESTION, {"role": "tool", "content": "18 C"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    *QUESTION,
                    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "a b"}}]},
                ]
            },
            "messages[1].tool_calls[0].function.name",
        ),
    ],
)
def test_bad_tools_are_a_400_naming_the_parameter(client: openai.OpenAI, extra: dict, param: str):
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body=body, cast_to=object)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(f"{param}: ")


# ---- gRPC -----------------------------------------------------------------------------------------


def test_grpc_forced_call_has_parsed_calls_and_the_finish_reason(stack: Stack):
    request = gateway_pb2.GenerateRequest(max_new_tokens=MAX_TOKENS, parallel_tool_calls=False)
    request.chat.messages.add(role="user", content=QUESTION[0]["content"])
    request.tools.add(name="get_weather", description="The weather", parameters=json.dumps(WEATHER_PARAMETERS))
    request.tool_choice.mode = gateway_pb2.ToolChoice.MODE_FUNCTION
    request.tool_choice.function_name = "get_weather"
    with grpc.insecure_channel(stack.gateway_address) as channel:
        answer = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=600)
    assert answer.finish_reason == gateway_pb2.FINISH_REASON_TOOL_CALLS
    assert answer.HasField("content") and answer.content == ""
    [call] = answer.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    # the text is the call as generated: {"name": ..., "arguments": ...}
    assert json.loads(answer.text) == {"name": "get_weather", "arguments": json.loads(call.arguments)}
    # the schema's fixed parts were not generated a step each: forced, or drafted in the primary's run
    assert answer.stats.num_steps < answer.stats.num_generated_tokens


# ---- LangChain ------------------------------------------------------------------------------------


@tool
def get_weather(city: str, unit: str) -> str:
    """The weather in a city, in celsius or fahrenheit."""
    return json.dumps({"city": city, "temperature": 18, "unit": unit})


@tool
def get_time(timezone: str) -> str:
    """The local time in a timezone."""
    return json.dumps({"timezone": timezone, "time": "14:05"})


class Forecast(BaseModel):
    """A weather forecast."""

    city: str = Field(description="the city", max_length=24)
    temperature: int = Field(description="degrees celsius")


def test_langchain_bind_tools(chat_model: ChatOpenAI):
    answer = chat_model.bind_tools([get_weather, get_time], tool_choice="required").invoke(QUESTION[0]["content"])
    assert answer.tool_calls and answer.response_metadata["finish_reason"] == "tool_calls"
    for call in answer.tool_calls:
        schema = {"get_weather": get_weather, "get_time": get_time}[call["name"]].args_schema.model_json_schema()
        jsonschema.validate(call["args"], schema)
        assert call["id"].startswith("call_")
    assert not answer.invalid_tool_calls


def test_langchain_structured_output_by_function_calling(chat_model: ChatOpenAI):
    forecast = chat_model.with_structured_output(Forecast, method="function_calling").invoke(
        "Give the forecast for Paris."
    )
    assert isinstance(forecast, Forecast) and len(forecast.city) <= 24


def test_langchain_streamed_tool_call_chunks_add_up(chat_model: ChatOpenAI):
    bound = chat_model.bind_tools([get_weather, get_time], tool_choice="get_weather")
    merged = None
    for chunk in bound.stream(QUESTION[0]["content"]):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and [c["name"] for c in merged.tool_calls] == ["get_weather"]
    jsonschema.validate(merged.tool_calls[0]["args"], get_weather.args_schema.model_json_schema())


def test_langchain_agent_loop_completes_a_two_tool_task(chat_model: ChatOpenAI):
    """Call get_weather, feed its result, call get_time, feed its result, answer: each call forced
    by tool_choice, each result accepted in the history that the next request renders."""
    tools = {"get_weather": get_weather, "get_time": get_time}
    messages: list = [HumanMessage("What is the weather in Paris, and what time is it there?")]
    for name in ("get_weather", "get_time"):
        answer = chat_model.bind_tools(list(tools.values()), tool_choice=name).invoke(messages)
        [call] = answer.tool_calls
        assert call["name"] == name
        messages += [answer, ToolMessage(tools[name].invoke(call["args"]), tool_call_id=call["id"])]
    final = chat_model.bind_tools(list(tools.values()), tool_choice="none").invoke(messages)
    assert not final.tool_calls and isinstance(final.content, str)
    assert final.response_metadata["finish_reason"] in ("stop", "length")
    assert [type(m).__name__ for m in messages] == [
        "HumanMessage",
        "AIMessage",
        "ToolMessage",
        "AIMessage",
        "ToolMessage",
    ]
