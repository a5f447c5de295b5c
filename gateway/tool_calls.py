"""The model's answer -> content and tool calls, piece by piece as it streams (or all at once).

Two readers, one per tool choice, behind one interface (`add(text)` per step, `finish()`):

- ForcedCallReader (REQUIRED / FUNCTION): the answer is JSON under the tools' schema
  (gateway.tools), so it is read as it grows: a call's id and name go out as soon as its name
  string closes, then its `arguments` value in pieces, character for character as generated.

      '[{"name": "f", "arguments": {"x": 1}}, {"na'  ->  delta(0, id, "f"), delta(0, args '{"x": 1}'), ...

- AutoCallReader (AUTO): free text, streamed as content, except `<tool_call>...</tool_call>` blocks
  (the default format, Hermes/Qwen2.5's) and an answer that is a bare JSON call or list of calls
  (`{"name": ..., "arguments": ...}`; Llama 3.x writes "parameters"). A block is held until it
  closes, then becomes a call if its JSON names one of the request's tools with object arguments,
  else it is content as written. Text that may be the start of a block is held back.

A call's arguments are JSON text, as OpenAI carries them. With parallel calls off only the first
call of an AUTO answer is kept (a forced one is a single object by its schema).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from gateway.tool_prompt import CALL_CLOSE, CALL_OPEN
from gateway.tools import ToolCall, ToolSpec

_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    id: str = ""  # first piece of a call only
    name: str = ""  # first piece of a call only
    arguments: str = ""


@dataclasses.dataclass(slots=True)
class Piece:
    """What one add()/finish() gives: content text and tool-call pieces."""

    content: str = ""
    deltas: list[ToolCallDelta] = dataclasses.field(default_factory=list)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def reader_for(spec: ToolSpec) -> ForcedCallReader | AutoCallReader:
    assert spec.is_parsed
    return ForcedCallReader() if spec.is_forced else AutoCallReader(spec)


def read_answer(spec: ToolSpec, text: str) -> tuple[str, tuple[ToolCall, ...]]:
    """(content, calls) of a whole answer: what a stream of it would have given, joined."""
    reader = reader_for(spec)
    first, last = reader.add(text), reader.finish()
    return first.content + last.content, reader.calls()


@dataclasses.dataclass(slots=True)
class _Call:
    id: str
    name: str | None = None
    arguments: str = ""
    num_sent_chars: int = -1  # of arguments; -1: the first piece (id, name) is not sent yet


class _Calls:
    """Calls as they are read, and the pieces of them not yet handed out."""

    def __init__(self) -> None:
        self.items: list[_Call] = []

    def new(self) -> _Call:
        self.items.append(_Call(new_call_id()))
        return self.items[-1]

    def pending_deltas(self) -> list[ToolCallDelta]:
        deltas = []
        for index, call in enumerate(self.items):
            if call.name is None:
                continue  # a call's name comes first
            if call.num_sent_chars < 0:
                deltas.append(ToolCallDelta(index, call.id, call.name))
                call.num_sent_chars = 0
            if len(call.arguments) > call.num_sent_chars:
                deltas.append(ToolCallDelta(index, arguments=call.arguments[call.num_sent_chars :]))
                call.num_sent_chars = len(call.arguments)
        return deltas

    def done(self) -> tuple[ToolCall, ...]:
        return tuple(ToolCall(c.id, c.name, c.arguments) for c in self.items if c.name is not None)


class ForcedCallReader:
    """Reads JSON under the calls' schema: one call object, or an array of them. A scanner of JSON
    characters (strings, escapes, nesting) that tracks the keys of the call objects only."""

    def __init__(self) -> None:
        self._calls = _Calls()
        self.depth = 0
        self.call_depth: int | None = None  # 1: the answer is one call object; 2: an array of them
        self.is_in_string = self.is_escaped = False
        self.is_key_next = False  # the next string at call depth is a key
        self.key: str | None = None  # the call object's key being read
        self.captured: list[str] | None = None  # a key's or the name's characters, while read
        self.is_arguments_next = self.is_in_arguments = False

    def add(self, text: str) -> Piece:
        for c in text:
            self._char(c)
        return Piece("", self._calls.pending_deltas())

    def finish(self) -> Piece:
        return Piece("", self._calls.pending_deltas())

    def calls(self) -> tuple[ToolCall, ...]:
        return self._calls.done()

    def _char(self, c: str) -> None:
        if self.is_arguments_next and not c.isspace():
            self.is_arguments_next, self.is_in_arguments = False, True
        if self.is_in_arguments:
            if self.is_in_string or self.depth != self.call_depth or c not in ",}":
                self._calls.items[-1].arguments += c
                self._track(c)
                return
            self.is_in_arguments = False  # the value ended; c belongs to the call object
        if self.is_in_string:
            self._string_char(c)
        elif c == '"':
            self.is_in_string = True
            if self.depth == self.call_depth and (self.is_key_next or self.key == "name"):
                self.captured = []
        elif c in "{[":
            if self.call_depth is None:
                self.call_depth = 1 if c == "{" else 2
            self.depth += 1
            if self.depth == self.call_depth and c == "{":
                self._calls.new()
                self.is_key_next, self.key = True, None
        elif c in "}]":
            self.depth -= 1
        elif self.depth == self.call_depth and c == ",":
            self.is_key_next, self.key = True, None
        elif self.depth == self.call_depth and c == ":":
            self.is_key_next = False
            self.is_arguments_next = self.key in _ARGUMENT_KEYS

    def _string_char(self, c: str) -> None:
        if not self._is_string_end(c):
            if self.captured is not None:
                self.captured.append(c)  # escapes too: json.loads decodes them with the rest
            return
        if self.captured is not None:
            value = json.loads('"' + "".join(self.captured) + '"')
            self.captured = None
            if self.is_key_next:
                self.key = value
            else:
                self._calls.items[-1].name = value
                self.key = None

    def _is_string_end(self, c: str) -> bool:
        """Advance the escape state over c, a character inside a JSON string; True when c (a quote
        not escaped) closes the string."""
        if self.is_escaped:
            self.is_escaped = False
        elif c == "\\":
            self.is_escaped = True
        elif c == '"':
            self.is_in_string = False
            return True
        return False

    def _track(self, c: str) -> None:
        """Nesting and strings inside an arguments value."""
        if self.is_in_string:
            self._is_string_end(c)
        elif c == '"':
            self.is_in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1


class AutoCallReader:
    """Free text with `<tool_call>` blocks or a bare JSON call; see the module's docstring."""

    def __init__(self, spec: ToolSpec) -> None:
        self.names = frozenset(t.name for t in spec.tools)
        self.is_parallel = spec.is_parallel
        self._calls = _Calls()
        self.pending = ""  # text read, not yet content or a call
        self.is_in_block = False
        self.is_bare = False  # the answer began with JSON: held to the end
        self.has_content = False  # non-blank content went out
        self.blank = ""  # trailing whitespace of the content, held: dropped when the answer has calls

    def add(self, text: str) -> Piece:
        self.pending += text
        piece = Piece()
        while not self.is_bare:
            if self.is_in_block:
                at = self.pending.find(CALL_CLOSE)
                if at < 0:
                    break
                self._block(self.pending[:at], piece, is_closed=True)
                self.pending = self.pending[at + len(CALL_CLOSE) :]
                self.is_in_block = False
                continue
            if not self.has_content and not self._calls.items:
                head = self.pending.lstrip()
                if not head or CALL_OPEN.startswith(head[: len(CALL_OPEN)]) and len(head) < len(CALL_OPEN):
                    break  # blank or maybe a block: wait
                if head[0] in "{[":
                    self.is_bare = True
                    break
            at = self.pending.find(CALL_OPEN)
            if at >= 0:
                self._content(self.pending[:at], piece)
                self.pending = self.pending[at + len(CALL_OPEN) :]
                self.is_in_block = True
                continue
            num_held = _num_prefix_chars(self.pending, CALL_OPEN)
            self._content(self.pending[: len(self.pending) - num_held], piece)
            self.pending = self.pending[len(self.pending) - num_held :]
            break
        piece.deltas = self._calls.pending_deltas()
        return piece

    def finish(self) -> Piece:
        piece = Piece()
        if self.is_in_block:
            self._block(self.pending, piece, is_closed=False)  # not closed (length): a call if its JSON is whole
        elif self.is_bare:
            calls = _bare_calls(self.pending, self.names)
            if calls is None:
                self._content(self.pending, piece)
            for name, arguments in calls or ():
                self._add_call(name, arguments)
        else:
            self._content(self.pending, piece)
        self.pending = ""
        if not self._calls.items:
            piece.content += self.blank
        piece.deltas = self._calls.pending_deltas()
        return piece

    def calls(self) -> tuple[ToolCall, ...]:
        return self._calls.done()

    def _block(self, body: str, piece: Piece, is_closed: bool) -> None:
        call = _call_of(_json_or_none(body), self.names)
        if call is None:  # not a call of these tools: the text as written
            self._content(f"{CALL_OPEN}{body}{CALL_CLOSE if is_closed else ''}", piece)
        else:
            self._add_call(*call)

    def _add_call(self, name: str, arguments: str) -> None:
        if self.is_parallel or not self._calls.items:
            call = self._calls.new()
            call.name, call.arguments = name, arguments

    def _content(self, text: str, piece: Piece) -> None:
        """Content goes out up to its last non-blank character; trailing whitespace waits for more
        (dropped at the end of an answer with calls: "Let me check.\n<tool_call>..." -> "Let me check.")."""
        self.blank += text
        kept = self.blank.rstrip()
        if kept:
            piece.content += kept
            self.blank, self.has_content = self.blank[len(kept) :], True


def _num_prefix_chars(text: str, tag: str) -> int:
    """How many trailing characters of text could begin tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call_of(value: Any, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of {"name": <a tool>, "arguments": {...}}; None otherwise."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments: Any = next((value[k] for k in _ARGUMENT_KEYS if k in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _json_or_none(arguments)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _bare_calls(text: str, names: frozenset[str]) -> list[tuple[str, str]] | None:
    value = _json_or_none(text)
    items = value if isinstance(value, list) and value else [value]
    calls = [_call_of(item, names) for item in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
