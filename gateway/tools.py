"""A request's tools, tool choice and chat turns with tool calls: checked domain objects, and the
JSON schema that a forced choice generates under.

With tool_choice REQUIRED or FUNCTION the answer is JSON under a schema built from the tools, so it
runs through the response_format grammar path (its forced tokens are drafted for free):

    one call      {"name": "get_weather", "arguments": {...get_weather's parameters...}}
    several tools {"anyOf": [<one call of get_weather>, <one call of get_time>]}
    parallel      {"type": "array", "items": <one call>, "minItems": 1}

`name` comes first in every call object (xgrammar keeps the schema's property order), so a stream
knows the function before its arguments begin. A tool's local `$ref`s ("#/$defs/Place", as pydantic
writes nested models) point into its parameters, which sit deeper in the calls' schema: they are
rebased onto where the parameters sit ("#/anyOf/0/properties/arguments/$defs/Place").
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Sequence

from gateway.json_depth import json_nesting_depth
from specdec.errors import InvalidArgument, quoted, shortened
from specdec.grammar import json_pointer
from specdec.grammar.compiler import check_schema_text
from specdec.v1 import gateway_pb2

MAX_TOOLS = 128  # OpenAI's limit
# OpenAI's rule for a function's name.
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_NAME_RULE = "must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'"
_NO_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}}


class ToolMode(enum.Enum):
    AUTO = "auto"  # free text, parsed for calls afterwards
    NONE = "none"  # tools shown, never parsed for
    REQUIRED = "required"  # one or more calls, under the tools' schema
    FUNCTION = "function"  # a call of one named function, under its schema


_MODES = {
    gateway_pb2.ToolChoice.MODE_AUTO: ToolMode.AUTO,
    gateway_pb2.ToolChoice.MODE_NONE: ToolMode.NONE,
    gateway_pb2.ToolChoice.MODE_REQUIRED: ToolMode.REQUIRED,
    gateway_pb2.ToolChoice.MODE_FUNCTION: ToolMode.FUNCTION,
}


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict  # a JSON Schema object

    def to_openai(self) -> dict:
        """The shape chat templates read (transformers passes `tools` as OpenAI's objects)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it


@dataclasses.dataclass(frozen=True, slots=True)
class ToolSpec:
    """What a request asks of tools; `function_name` only with ToolMode.FUNCTION."""

    tools: tuple[FunctionTool, ...] = ()
    mode: ToolMode = ToolMode.AUTO
    function_name: str = ""
    is_parallel: bool = True

    @property
    def is_forced(self) -> bool:
        """The answer is calls, generated under call_schema()."""
        return bool(self.tools) and self.mode in (ToolMode.REQUIRED, ToolMode.FUNCTION)

    @property
    def is_parsed(self) -> bool:
        """The answer is parsed for calls (a request with tools, choice not NONE)."""
        return bool(self.tools) and self.mode is not ToolMode.NONE

    def call_schema(self) -> str:
        """The JSON schema (text) of a forced answer; see the module's docstring."""
        assert self.is_forced
        chosen = [t for t in self.tools if self.mode is ToolMode.REQUIRED or t.name == self.function_name]
        is_array = self.is_parallel and self.mode is ToolMode.REQUIRED
        at = json_pointer.join("", "items") if is_array else ""  # where the one call's schema sits
        if len(chosen) == 1:
            one = _call_schema(chosen[0], at)
        else:
            one = {"anyOf": [_call_schema(t, json_pointer.join(at, "anyOf", i)) for i, t in enumerate(chosen)]}
        if is_array:
            one = {"type": "array", "items": one, "minItems": 1}
        return json.dumps(one)


def _call_schema(tool: FunctionTool, at: str) -> dict:
    """The schema of one call of `tool`, which sits at JSON pointer `at` in the calls' schema."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.name},
            "arguments": _rebased(tool.parameters, json_pointer.join(at, "properties", "arguments")),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# Keywords whose values are instances, not schemas: a "$ref" key inside them is data.
_VALUE_KEYWORDS = frozenset(("const", "enum", "default", "examples", "example"))
# Keywords whose values map names (which may be any word, "default" too) to schemas.
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))


def _rebased(schema: object, at: str) -> object:
    """`schema` with every local `$ref` ("#" or "#/...", relative to the schema's own root) pointing
    to the same place once the schema sits at JSON pointer `at` of a larger one."""
    if isinstance(schema, list):
        return [_rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, object] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            out[key] = json_pointer.rebased(value, at)
        elif key in _VALUE_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(sub, at) for name, sub in value.items()}
        else:
            out[key] = _rebased(value, at)
    return out


def tool_spec_from_pb(req: gateway_pb2.GenerateRequest, max_schema_depth: int) -> ToolSpec:
    """The request's checked tools; InvalidArgument naming tools[i].name / .parameters, tool_choice."""
    if len(req.tools) > MAX_TOOLS:
        raise InvalidArgument("tools", f"at most {MAX_TOOLS} tools, got {len(req.tools)}")
    tools = tuple(_tool_from_pb(t, f"tools[{i}]", max_schema_depth) for i, t in enumerate(req.tools))
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidArgument(f"tools[{i}].name", f"{quoted(name)} is given twice")
    is_parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True
    choice = req.tool_choice
    try:
        mode = ToolMode.AUTO if choice.mode == gateway_pb2.ToolChoice.MODE_UNSPECIFIED else _MODES[choice.mode]
    except KeyError:
        raise InvalidArgument("tool_choice.mode", f"unknown value {choice.mode}") from None
    if mode is ToolMode.FUNCTION:
        if choice.function_name not in names:
            # 128 names of 64 characters would pass the client's metadata limit: shortened.
            known = shortened(str(names), 1000)
            raise InvalidArgument(
                "tool_choice.function_name", f"{quoted(choice.function_name)} is not one of the request's tools {known}"
            )
    elif choice.function_name:
        raise InvalidArgument("tool_choice.function_name", "is only allowed with MODE_FUNCTION")
    if mode in (ToolMode.REQUIRED, ToolMode.FUNCTION) and not tools:
        raise InvalidArgument("tool_choice", f"{mode.value!r} needs tools")
    if mode in (ToolMode.REQUIRED, ToolMode.FUNCTION) and req.response_format.type > 1:  # beyond TYPE_TEXT
        raise InvalidArgument(
            "response_format", f"cannot be combined with tool_choice {mode.value!r}: the calls' schema is the format"
        )
    if tools and req.WhichOneof("input") != "chat":
        raise InvalidArgument("tools", "need chat messages (a raw prompt has no template to show them)")
    return ToolSpec(tools, mode, choice.function_name, is_parallel)


def _tool_from_pb(tool: gateway_pb2.Tool, field: str, max_schema_depth: int) -> FunctionTool:
    if not _NAME.match(tool.name):
        raise InvalidArgument(f"{field}.name", f"{_NAME_RULE}, got {quoted(tool.name)}")
    if not tool.parameters:
        return FunctionTool(tool.name, tool.description, dict(_NO_ARGUMENTS_SCHEMA))
    depth = json_nesting_depth(tool.parameters)
    if depth > max_schema_depth:
        raise InvalidArgument(
            f"{field}.parameters", f"nests {depth} levels deep, more than the limit of {max_schema_depth}"
        )
    try:
        check_schema_text(tool.parameters)
    except InvalidArgument as e:
        raise InvalidArgument(f"{field}.parameters", e.message) from None
    return FunctionTool(tool.name, tool.description, json.loads(tool.parameters))


def tool_calls_from_pb(calls: Sequence[gateway_pb2.ToolCall], field: str) -> tuple[ToolCall, ...]:
    """An assistant turn's calls in the history; arguments need not be valid JSON (a client echoes
    what the model produced), they are rendered as given then."""
    for j, call in enumerate(calls):
        if not call.id:
            raise InvalidArgument(f"{field}[{j}].id", "is required")
        if not _NAME.match(call.name):
            raise InvalidArgument(f"{field}[{j}].name", f"{_NAME_RULE}, got {quoted(call.name)}")
    return tuple(ToolCall(c.id, c.name, c.arguments) for c in calls)
