"""The readers of tool calls in the model's answer: forced JSON read piece by piece, free text with
<tool_call> blocks or a bare JSON call; every split of a text into steps gives the same result."""

from __future__ import annotations

import json

import pytest

from gateway.tool_calls import ToolCallDelta, read_answer, reader_for
from gateway.tools import FunctionTool, ToolMode, ToolSpec

TOOLS = (
    FunctionTool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}}),
    FunctionTool("get_time", "", {"type": "object", "properties": {}}),
)
FORCED = ToolSpec(TOOLS, ToolMode.REQUIRED)
AUTO = ToolSpec(TOOLS, ToolMode.AUTO)


def streamed(spec: ToolSpec, text: str, step: int) -> tuple[str, list[ToolCallDelta], tuple]:
    reader = reader_for(spec)
    content, deltas = "", []
    for i in range(0, len(text), step):
        piece = reader.add(text[i : i + step])
        content, deltas = content + piece.content, deltas + piece.deltas
    last = reader.finish()
    return content + last.content, deltas + last.deltas, reader.calls()


def calls_of(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """(name, arguments) per call from the pieces, as a client adds them up."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id:
            assert d.index not in calls and d.name  # a call's first piece names it, once
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_forced_calls_stream_name_first_then_arguments_as_written(step: int):
    text = '[{"name": "get_weather", "arguments": {"city": "Pa\\"ri}s", "x": [1, {"a": "]"}]}}, '
    text += '{"name": "get_time", "arguments": {}}]'
    content, deltas, calls = streamed(FORCED, text, step)
    expected = [("get_weather", '{"city": "Pa\\"ri}s", "x": [1, {"a": "]"}]}'), ("get_time", "{}")]
    assert content == "" and calls_of(deltas) == expected
    assert [(c.name, c.arguments) for c in calls] == expected
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_a_forced_single_object_and_a_truncated_one():
    _, calls = read_answer(ToolSpec(TOOLS, ToolMode.FUNCTION, "get_time"), '{"name": "get_time", "arguments": {}}')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    # cut by max_new_tokens: the call so far (finish_reason stays "length")
    _, calls = read_answer(FORCED, '[{"name": "get_weather", "arguments": {"city": "Ro')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Ro')]
    _, calls = read_answer(FORCED, '[{"name": "get_wea')
    assert calls == ()


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_auto_blocks_become_calls_and_the_rest_stays_content(step: int):
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, deltas, calls = streamed(AUTO, text, step)
    assert content == "Let me check."  # the whitespace before the calls is dropped
    assert calls_of(deltas) == [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    assert [c.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    "text",
    [
        "Plain text, no calls.",
        "a < b and <tool_ is not a tag",
        '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "get_time", "argu',  # cut, not JSON
        '{"answer": 42}',  # JSON, but not a call
        "  \n",
    ],
)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_auto_text_without_valid_calls_is_content_as_written(text: str, step: int):
    content, deltas, calls = streamed(AUTO, text, step)
    assert (content, deltas, calls) == (text, [], ())


def test_auto_bare_json_calls_llama_parameters_and_string_arguments():
    _, calls = read_answer(AUTO, ' {"name": "get_time", "parameters": {}}')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    text = json.dumps([{"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}, {"name": "get_time"}])
    content, calls = read_answer(AUTO, text)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    ]


def test_auto_without_parallel_calls_keeps_the_first():
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    _, calls = read_answer(ToolSpec(TOOLS, ToolMode.AUTO, is_parallel=False), block + block)
    assert len(calls) == 1
