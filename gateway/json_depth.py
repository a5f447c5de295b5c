"""How deep JSON text nests, without parsing it (a parser would recurse as deep as the text)."""

from __future__ import annotations


def json_nesting_depth(text: str) -> int:
    """How deep the objects and arrays of JSON text nest, by one scan without parsing (and without
    recursion). Brackets inside strings do not count. E.g. '{"a": [{"b": "[["}]}' -> 3."""
    depth = max_depth = 0
    is_in_string = is_escaped = False
    for c in text:
        if is_in_string:
            if is_escaped:
                is_escaped = False
            elif c == "\\":
                is_escaped = True
            elif c == '"':
                is_in_string = False
        elif c == '"':
            is_in_string = True
        elif c in "{[":
            depth += 1
            max_depth = max(max_depth, depth)
        elif c in "}]":
            depth -= 1
    return max_depth
