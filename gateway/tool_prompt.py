"""Chat turns with tools -> the prompt text, through the model's chat template.

A template with its own tool format (it reads `tools`, as Qwen2.5's and Llama 3.x's do) gets the
turns in transformers' shape and renders everything itself:

    tools=[{"type": "function", "function": {"name", "description", "parameters"}}]
    {"role": "assistant", "content": "", "tool_calls": [{"id", "type": "function",
        "function": {"name", "arguments": {...}}}]}        # arguments parsed, as transformers passes them
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "..."}

A template without one (SmolLM2's) gets the default format below, Hermes/Qwen2.5-style, written
into plain turns that any template renders:

    system     <its own text>\\n\\n + DEFAULT_TOOLS_PREAMBLE with one JSON line per tool
    assistant  <content>\\n<tool_call>\\n{"name": "get_weather", "arguments": {...}}\\n</tool_call>
    tool(s)    one "user" turn: <tool_response>\\n<content>\\n</tool_response> per consecutive result

The model's answer in that format is what gateway.tool_calls parses under tool_choice "auto".
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from gateway.tools import FunctionTool, ToolCall

DEFAULT_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


@dataclasses.dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str  # system, user, assistant or tool
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # assistant turns only
    tool_call_id: str = ""  # tool turns only
    name: str = ""  # tool turns: the function that answered (optional)


def has_tool_format(chat_template: str | None) -> bool:
    """The template renders tools itself (it reads the `tools` variable)."""
    return chat_template is not None and "tools" in chat_template


def render(tokenizer: Any, turns: Sequence[ChatTurn], tools: Sequence[FunctionTool]) -> str:
    """The prompt text of `turns` with `tools` shown to the model (none: the plain chat prompt)."""
    if has_tool_format(tokenizer.chat_template):
        kwargs = {"tools": [t.to_openai() for t in tools]} if tools else {}
        return tokenizer.apply_chat_template([_native(t) for t in turns], **kwargs)
    return tokenizer.apply_chat_template(default_format(turns, tools))


def _native(turn: ChatTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in turn.tool_calls
        ]
    if turn.role == "tool":
        message["tool_call_id"] = turn.tool_call_id
        if turn.name:
            message["name"] = turn.name
    return message


def default_format(turns: Sequence[ChatTurn], tools: Sequence[FunctionTool]) -> list[dict[str, str]]:
    """Plain {role, content} turns carrying the tools, calls and results in the default format."""
    messages: list[dict[str, str]] = []
    for turn in turns:
        if turn.role == "tool":
            result = f"{RESPONSE_OPEN}\n{turn.content}\n{RESPONSE_CLOSE}"
            if messages and messages[-1].get("is_tool_response"):
                messages[-1]["content"] += "\n" + result
            else:
                messages.append({"role": "user", "content": result, "is_tool_response": "1"})
        elif turn.tool_calls:
            calls = "\n".join(_call_text(c) for c in turn.tool_calls)
            messages.append({"role": turn.role, "content": f"{turn.content}\n{calls}" if turn.content else calls})
        else:
            messages.append({"role": turn.role, "content": turn.content})
    for m in messages:
        m.pop("is_tool_response", None)
    if tools:
        preamble = DEFAULT_TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t.to_openai()) for t in tools))
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{preamble}"}
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages


def _call_text(call: ToolCall) -> str:
    body = json.dumps({"name": call.name, "arguments": _arguments(call.arguments)}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them: the parsed object; text that is not JSON as is."""
    try:
        return json.loads(text)
    except ValueError:
        return text
