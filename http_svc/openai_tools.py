"""OpenAI's tools in a chat request -> the GenerateRequest's tools, tool choice and history calls.

    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "...",
               "parameters": {...JSON Schema...}, "strict": true}}],
    "tool_choice": "auto" | "none" | "required" | {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": true,
    "messages": [..., {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                  "type": "function", "function": {"name": "get_weather", "arguments": "{\\"city\\": ...}"}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]

Only the shape is checked here (400 naming the parameter, e.g. `tools[0].function.name`); names,
schemas and the choice's function are the gateway's to check, and its INVALID_ARGUMENT comes back
under the same OpenAI names (http_svc.errors). `strict` is accepted: forced calls always follow
the schema, "auto" ones are parsed as the model wrote them.
"""

from __future__ import annotations

from typing import Any

from http_svc.errors import bad_request, json_text, shown
from specdec.v1 import gateway_pb2

_MODES = {
    "auto": gateway_pb2.ToolChoice.MODE_AUTO,
    "none": gateway_pb2.ToolChoice.MODE_NONE,
    "required": gateway_pb2.ToolChoice.MODE_REQUIRED,
}


def set_tools(request: gateway_pb2.GenerateRequest, data: dict[str, Any]) -> None:
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools", "must be an array of {type: function, function: {...}} objects")
        for i, tool in enumerate(tools):
            _add_tool(request, tool, f"tools[{i}]")
    _set_choice(request.tool_choice, data.get("tool_choice"))
    parallel = data.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            got = shown(parallel, "parallel_tool_calls")
            raise bad_request("parallel_tool_calls", f"must be true or false, got {got}")
        request.parallel_tool_calls = parallel


def _add_tool(request: gateway_pb2.GenerateRequest, tool: Any, param: str) -> None:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"{param}.type", 'must be "function" (the only kind of tool)')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{param}.function", "must be an object with name, description and parameters")
    name = function.get("name")
    if not isinstance(name, str):
        raise bad_request(f"{param}.function.name", "is required: a string")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{param}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{param}.function.parameters", "must be a JSON Schema object")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{param}.function.strict", "must be true or false")
    request.tools.add(
        name=name,
        description=description or "",
        parameters="" if parameters is None else json_text(parameters, f"{param}.function.parameters"),
    )


def _set_choice(choice: gateway_pb2.ToolChoice, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, str):
        if value not in _MODES:
            raise bad_request("tool_choice", f'must be one of {list(_MODES)} or {{"type": "function", ...}}')
        choice.mode = _MODES[value]
        return
    if not isinstance(value, dict) or value.get("type") != "function":
        raise bad_request("tool_choice", f'must be one of {list(_MODES)} or {{"type": "function", ...}}')
    function = value.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("tool_choice.function.name", "is required: the name of one of the tools")
    choice.mode = gateway_pb2.ToolChoice.MODE_FUNCTION
    choice.function_name = function["name"]


def set_tool_calls(turn: gateway_pb2.ChatMessage, message: dict[str, Any], param: str) -> None:
    """An assistant turn's tool_calls, a tool turn's tool_call_id and name."""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"{param}.tool_calls", "must be an array of tool calls")
        for j, call in enumerate(calls):
            _add_call(turn, call, f"{param}.tool_calls[{j}]")
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{param}.{key}", "must be a string")
        if value is not None and (key == "tool_call_id" or turn.role == "tool"):
            setattr(turn, key, value)  # a user's "name" (a participant's) is not a tool's: not passed on


def _add_call(turn: gateway_pb2.ChatMessage, call: Any, param: str) -> None:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise bad_request(f"{param}.type", 'must be "function"')
    if not isinstance(call.get("id"), str):
        raise bad_request(f"{param}.id", "is required: a string")
    function = call.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{param}.function", "must be an object with name and arguments")
    if not isinstance(function.get("name"), str):
        raise bad_request(f"{param}.function.name", "is required: a string")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        raise bad_request(f"{param}.function.arguments", "must be a string (the arguments' JSON text)")
    turn.tool_calls.add(id=call["id"], name=function["name"], arguments=arguments)
