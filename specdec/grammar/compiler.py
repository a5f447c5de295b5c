"""Response formats compiled to token grammars, and a bounded LRU of them by schema text.

Engine: xgrammar, chosen over llguidance on measurements on this 2-vCPU EPYC with SmolLM2's
tokenizer (xgrammar 0.2.9, llguidance 1.9.1; schemas from data/prompts/json.jsonl):

    |                                         | xgrammar              | llguidance              |
    | schemas that compile (of 627)           | 625                   | 619 (coerce_one_of)     |
    | compile median / p99 / max              | 25 ms / 2.9 s / 66 s  | 2 ms / 21 ms / 54 ms    |
    | next-token mask, mean / max (1755 pos.) | 0.03 ms / 7 ms        | 0.17 ms / 12 ms         |
    | rollback, jump-forward string + tokens  | yes                   | yes                     |
    | grammar-forced drafts alone (20 schemas)| 1.44x fewer steps     | 1.31x                   |

A mask is paid once per tree node per step, a compile once per distinct schema (then cached), so
the 5x cheaper mask wins; strict mode (no properties outside the schema) keeps the model from
inventing keys, which is also why more of its output is forced. The cost is xgrammar's compile
tail on schemas with long bounded repetitions (`{0,199}` in a pattern): a few seconds, once 66 s.
`max_schema_chars` bounds the input; a compile deadline belongs to the caller.

Output layout is fixed, not free: no whitespace except the separators ", " and ": " (the layout
the model writes by itself). Free whitespace leaves every separator open and kills forced runs
(docs/architecture.md: compact JSON forces 8-21 % of positions, free whitespace 5-6 %).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import sys
import threading
from typing import Any

import jsonschema
import referencing.exceptions
import xgrammar as xgr

from specdec.errors import InvalidArgument, shortened
from specdec.field_checks import require_at_least_one
from specdec.grammar import json_pointer
from specdec.grammar.state import GrammarState
from specdec.grammar.tokenizer_info import GrammarTokenizerInfo

JSON_OBJECT = "json_object"  # any JSON object
JSON_SCHEMA = "json_schema"  # JSON that validates against the request's schema
KINDS = (JSON_OBJECT, JSON_SCHEMA)
TYPE_FIELD = "response_format.type"
SCHEMA_FIELD = "response_format.json_schema"
DEFAULT_MAX_SCHEMA_CHARS = 64 * 1024
# json_object = an object with any properties (strict mode off, or only "{}" would match).
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's C++ messages start with "[17:07:09] /project/cpp/file.cc:967: Check failed: (x) is false: ".
_ENGINE_LOG_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What the output must be. An empty schema_text counts as none (proto3's default string)."""

    kind: str
    schema_text: str | None = None

    def __post_init__(self) -> None:
        if self.schema_text == "":
            object.__setattr__(self, "schema_text", None)
        if self.kind not in KINDS:
            raise InvalidArgument(TYPE_FIELD, f"must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind == JSON_SCHEMA and self.schema_text is None:
            raise InvalidArgument(SCHEMA_FIELD, f"is required when {TYPE_FIELD} is {JSON_SCHEMA}")
        if self.kind != JSON_SCHEMA and self.schema_text is not None:
            raise InvalidArgument(SCHEMA_FIELD, f"must be empty unless {TYPE_FIELD} is {JSON_SCHEMA}")


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A response format compiled for one vocabulary; immutable, shared by every request using it."""

    response_format: ResponseFormat
    tokenizer_info: GrammarTokenizerInfo
    xgr_grammar: xgr.CompiledGrammar

    def new_state(self) -> GrammarState:
        """A fresh per-request state at the start of the output."""
        return GrammarState(xgr.GrammarMatcher(self.xgr_grammar), self.tokenizer_info)


def compile_response_format(
    kind: str,
    schema_text: str | None,
    tokenizer_info: GrammarTokenizerInfo,
    *,
    max_schema_chars: int = DEFAULT_MAX_SCHEMA_CHARS,
) -> CompiledGrammar:
    """Compile one response format (uncached; `GrammarCache` is the cached way in).

    Raises InvalidArgument naming response_format.json_schema when the schema is not JSON, not a
    valid JSON Schema, too long, or uses something the engine cannot express."""
    response_format = ResponseFormat(kind, schema_text)
    compiler = xgr.GrammarCompiler(tokenizer_info.xgr_info, cache_enabled=False)  # ~0.1 ms to build
    if response_format.kind == JSON_OBJECT:
        grammar = compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
        return CompiledGrammar(response_format, tokenizer_info, grammar)
    text = response_format.schema_text
    assert text is not None
    check_schema_text(text, max_schema_chars)
    try:
        grammar = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError) as e:
        lines = str(e).strip().splitlines()  # none for some refusals (a bound of 1e400 gave an empty message)
        reason = _ENGINE_LOG_PREFIX.sub("", lines[0]) if lines else "it gives no reason"
        reason = shortened(reason, 300)  # it may quote a part of the schema
        raise InvalidArgument(SCHEMA_FIELD, f"is not supported by the grammar engine: {reason}") from None
    return CompiledGrammar(response_format, tokenizer_info, grammar)


def check_schema_text(schema_text: str, max_schema_chars: int = DEFAULT_MAX_SCHEMA_CHARS) -> None:
    """Raise InvalidArgument unless `schema_text` is a JSON Schema object of bounded size."""
    if len(schema_text) > max_schema_chars:
        raise InvalidArgument(
            SCHEMA_FIELD, f"has {len(schema_text)} characters, more than the limit of {max_schema_chars}"
        )
    try:
        schema = json.loads(schema_text, parse_float=_finite_float, parse_int=_finite_int, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(SCHEMA_FIELD, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidArgument(SCHEMA_FIELD, f"must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        # The message quotes the offending part of the schema, which may be most of its 64K characters.
        raise InvalidArgument(
            SCHEMA_FIELD, f"is not a valid JSON Schema: {shortened(e.message, 300)} (at {shortened(where, 300)})"
        ) from None
    except RecursionError:  # the check recurses a few frames a level: JSON that parses can nest past it
        raise InvalidArgument(SCHEMA_FIELD, "nests too deeply to check as a JSON Schema") from None
    costly = _first_costly_pattern(schema, "")
    if costly is not None:
        where, pattern, size, nested = costly
        raise InvalidArgument(
            SCHEMA_FIELD,
            f"regex {pattern[:64]!r} (at {where or '/'}) repeats too much to compile in bounded time: "
            f"{size} atoms once its counted repeats ({{m,n}}) are expanded (limit {_MAX_PATTERN_ATOMS}), "
            f"{nested} from counted repeats inside counted repeats (limit {_MAX_NESTED_REPEATS})",
        )
    unenforced = _first_unenforced(schema, schema, "")
    if unenforced is not None:
        where, what = unenforced
        raise InvalidArgument(
            SCHEMA_FIELD,
            f"{what} (at {where or '/'}): the grammar engine cannot enforce it, so the output could break it",
        )


# What the engine does not enforce, found by checking its outputs with `jsonschema` (xgrammar 0.2.9):
# it ignores these keywords, at most logging a warning on stderr, and the output then need not
# validate. Refused rather than ignored, since the output must always follow the schema.
_IGNORED_KEYWORDS = ("not", "if", "dependentRequired", "dependentSchemas", "dependencies", "contains", "propertyNames")
# The keywords that constrain an instance (annotations and unknown keywords constrain nothing).
_ASSERTIONS = frozenset(
    "type enum const properties required additionalProperties patternProperties propertyNames minProperties "
    "maxProperties items prefixItems additionalItems unevaluatedItems unevaluatedProperties minItems maxItems "
    "uniqueItems contains minContains maxContains minLength maxLength pattern format minimum maximum "
    "exclusiveMinimum exclusiveMaximum multipleOf not if then else dependentRequired dependentSchemas "
    "dependencies allOf anyOf oneOf $ref".split()
)
# Beside one of these, other assertions (or a second of these) are not both enforced: the engine keeps one side.
_COMPOSITIONS = ("$ref", "allOf", "anyOf", "oneOf")
_MAX_INTEGER_MULTIPLE_OF = 1024  # the engine's bound; beyond it multipleOf is ignored
_MAX_MULTIPLE_OF_RANGE = 10_000  # nor is it enforced inside a wider (or one-sided) range
_SUBSCHEMA_KEYS = ("additionalProperties", "items", "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_MAPS = ("properties", "patternProperties")  # definitions are checked where a $ref uses them
_SUBSCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
_LOOKAHEAD = re.compile(r"(?<!\\)\(\?[=!]")  # (?= or (?! not escaped


# A pattern compiles to an automaton with a copy of a counted repeat's body per count: measured with
# xgrammar 0.2.9 here, "[a-z]{0,4000}" 1.2 s and "(?:\\S+\\s+){0,199}" 1.3 s, but a counted repeat of one
# with its own count grows far faster: "(\\w{0,10}){0,10}" 2.8 s, "(\\w{0,5}){0,20}" 5.4 s,
# "(\\w{0,20}){0,20}" over 20 s, "(\\w{0,50}){0,50}" ran out of memory. A compile cannot be stopped once
# begun (it holds a compile thread to its end), so such a pattern is refused before it starts.
_MAX_PATTERN_ATOMS = 4096
_MAX_NESTED_REPEATS = 64  # the product of the counts of counted repeats nested in each other
_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


def _first_costly_pattern(node: object, where: str) -> tuple[str, str, int, int] | None:
    """(JSON pointer, pattern, atoms, nested repeats) of the first regex of the schema (a 'pattern',
    or a 'patternProperties' name) past `_MAX_PATTERN_ATOMS` or `_MAX_NESTED_REPEATS`."""
    if isinstance(node, list):
        items: list[tuple[str | int, object]] = list(enumerate(node))
    elif isinstance(node, dict):
        items = list(node.items())
        regexes = (
            [(json_pointer.join(where, "pattern"), node["pattern"])] if isinstance(node.get("pattern"), str) else []
        )
        if isinstance(node.get("patternProperties"), dict):
            regexes += [
                (json_pointer.join(where, "patternProperties", name), name) for name in node["patternProperties"]
            ]
        for at, pattern in regexes:
            size, nested = _pattern_cost(pattern)
            if size > _MAX_PATTERN_ATOMS or nested > _MAX_NESTED_REPEATS:
                return at, pattern, size, nested
    else:
        return None
    for key, child in items:
        found = _first_costly_pattern(child, json_pointer.join(where, key))
        if found is not None:
            return found
    return None


def _pattern_cost(pattern: str) -> tuple[int, int]:
    """(atoms, nested repeats) of a regex: its characters, classes and escapes once every counted repeat
    is written out, and the largest product of the counts of counted repeats nested in each other.
    A plain scan rather than a parse: it reads any dialect well enough to bound it."""
    # per open group: [atoms of its finished alternatives, of the current one, of its last atom,
    # the last atom's nested repeats, the group's largest nested repeats]
    stack = [[0, 0, 0, 1, 1]]
    i, largest = 0, 1
    while i < len(pattern):
        c, frame = pattern[i], stack[-1]
        count = _COUNT.match(pattern, i) if c == "{" else None
        if c == "(":
            stack.append([0, 0, 0, 1, 1])
            i += 1
            continue
        if c == ")" and len(stack) > 1:
            done = stack.pop()
            size = done[0] + done[1]
            stack[-1][1:4] = [stack[-1][1] + size, size, done[4]]
            stack[-1][4] = max(stack[-1][4], done[4])
            i += 1
            continue
        if c == "|":
            frame[0:3] = [frame[0] + frame[1], 0, 0]
            i += 1
            continue
        if count is not None:
            low, high = int(count.group(1)), count.group(3)
            times = max(1, int(high) if high else low + 1 if count.group(2) is not None else low)
            frame[1] += frame[2] * (times - 1)
            frame[2] *= times
            frame[3] *= times if times > 1 else 1
            frame[4] = max(frame[4], frame[3])
            largest = max(largest, frame[3] if frame[3] != times else 1)
            i = count.end()
            continue
        if c in "*+?^$":
            i += 1
            continue
        if c == "\\":
            i += 2
            if pattern[i - 1 : i] in ("p", "P") and pattern[i : i + 1] == "{":
                i = pattern.find("}", i) + 1 or len(pattern)
        elif c == "[":
            i += 2 if pattern[i + 1 : i + 2] == "^" else 1
            i += 1 if pattern[i : i + 1] == "]" else 0  # a "]" first is itself
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        else:
            i += 1
        frame[1:4] = [frame[1] + 1, 1, 1]
    while len(stack) > 1:
        done = stack.pop()
        stack[-1][1] += done[0] + done[1]
    return stack[0][0] + stack[0][1], largest


def _first_unenforced(
    node: object, root: dict, where: str, seen_refs: set[str] | None = None
) -> tuple[str, str] | None:
    """(JSON pointer, what) of the first part of the schema at `node` that the engine would ignore.
    Definitions count where a `$ref` reaches them (each once): the engine compiles no other."""
    if not isinstance(node, dict):
        return None  # a boolean schema
    seen_refs = set() if seen_refs is None else seen_refs
    found = _unenforced_here(node, root)
    if found is not None:
        return where, found
    ref = node.get("$ref")
    if isinstance(ref, str) and json_pointer.is_local(ref) and ref not in seen_refs:
        seen_refs.add(ref)
        found_there = _first_unenforced(json_pointer.resolve(root, ref), root, json_pointer.pointer(ref), seen_refs)
        if found_there is not None:
            return found_there
    children = [(json_pointer.join(where, key), node[key]) for key in _SUBSCHEMA_KEYS if key in node]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            children += [(json_pointer.join(where, key, name), sub) for name, sub in node[key].items()]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            children += [(json_pointer.join(where, key, i), sub) for i, sub in enumerate(node[key])]
    for path, child in children:
        found_below = _first_unenforced(child, root, path, seen_refs)
        if found_below is not None:
            return found_below
    return None


def _unenforced_here(node: dict, root: dict) -> str | None:
    for key in _IGNORED_KEYWORDS:
        if key in node:
            return f"{key!r} is not supported"
    if node.get("uniqueItems") is True:
        return "'uniqueItems' is not supported"
    compositions = [key for key in _COMPOSITIONS if key in node]
    if compositions:
        others = sorted(key for key in node if key in _ASSERTIONS and key not in compositions)
        if others == ["type"] and len(compositions) == 1 and _branches_have_type(node, compositions[0], root):
            others = []  # the type beside says nothing the branches do not say already
        if len(compositions) > 1 or others:
            return f"{compositions[0]!r} beside {sorted(set(compositions[1:]) | set(others))} is not supported"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "'allOf' with more than one schema is not supported"
        overlap = _overlapping_branches(node.get("oneOf"), root)
        if overlap is not None:
            return (
                f"'oneOf' branches {overlap[0]} and {overlap[1]} may both match one output, which is not supported "
                "(give them different types, or a required property with different 'const' values, or use 'anyOf')"
            )
        ref = node.get("$ref")
        if isinstance(ref, str) and not json_pointer.is_local(ref):
            return f"'$ref' {ref!r} is not supported (only '#' and '#/...' pointers)"
    properties: dict = node["properties"] if isinstance(node.get("properties"), dict) else {}
    missing = [name for name in node.get("required", ()) if name not in properties]
    if missing:
        return f"'required' names {missing}, which 'properties' does not define"
    if _counts_map_keys(node, len(node.get("required", ()))):
        return (
            "'minProperties' over 1 beyond the 'required' properties beside 'additionalProperties' or "
            "'patternProperties' is not supported (the engine counts a key written twice twice)"
        )
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return f"{'pattern' if 'pattern' in node else 'format'!r} beside 'minLength' / 'maxLength' is not supported"
    if isinstance(node.get("pattern"), str) and _LOOKAHEAD.search(node["pattern"]):
        return "a lookahead in 'pattern' is not supported"
    if "multipleOf" in node and not _is_enforced_multiple_of(node):
        return (
            f"'multipleOf' is supported only for 'type': 'integer', a whole multiple up to "
            f"{_MAX_INTEGER_MULTIPLE_OF}, unbounded or within a range of at most {_MAX_MULTIPLE_OF_RANGE} values"
        )
    for key in ("enum", "const"):
        if key in node:
            values = node[key] if key == "enum" else [node[key]]
            beside = {k: v for k, v in node.items() if k in _ASSERTIONS and k != key}
            if beside and isinstance(values, list) and "$ref" not in json.dumps(beside):
                validator = jsonschema.validators.validator_for(root)(beside)
                bad = [v for v in values if not validator.is_valid(v)]
                if bad:
                    return f"{key!r} values {bad} break the schema beside them, which is not supported"
    return None


def _counts_map_keys(node: dict, num_required: int) -> bool:
    """Whether `minProperties` may count a repeated key of an object whose other keys are free (a map).
    Like every grammar engine, xgrammar lets a map repeat a key ({"a": 1, "a": 2}: JSON allows it, a
    context-free grammar cannot exclude it) and counts it each time, while a JSON reader keeps one.
    A minimum up to the required properties and one map key holds whatever repeats."""
    is_map = node.get("additionalProperties", False) is not False or bool(node.get("patternProperties"))
    minimum = node.get("minProperties")
    return is_map and isinstance(minimum, int) and not isinstance(minimum, bool) and minimum > num_required + 1


def _branches_have_type(node: dict, composition: str, root: dict) -> bool:
    """Whether every branch of `composition` (each schema of the list, or the `$ref` target) has a
    `type` within the `type` beside it (integer within number)."""
    allowed = _type_set(node["type"])
    branches = node[composition] if composition != "$ref" else [json_pointer.resolve(root, node["$ref"])]
    if not allowed or not isinstance(branches, list):
        return False
    for branch in branches:
        types = _type_set(branch.get("type")) if isinstance(branch, dict) else set()
        if not types or not types <= allowed | ({"integer"} if "number" in allowed else set()):
            return False
    return True


_MAX_EXCLUDES_DEPTH = 8  # properties (and $refs) followed to prove two branches disjoint


def _overlapping_branches(branches: object, root: dict) -> tuple[int, int] | None:
    """The first two branches of a 'oneOf' that may both match one output the engine writes, or None.
    The engine compiles 'oneOf' as 'anyOf' (either branch, not exactly one): that is exact only when
    no output of one branch validates against another."""
    if not isinstance(branches, list):
        return None
    for j in range(len(branches)):
        for i in range(j):
            a, b = branches[i], branches[j]
            if not (_excludes(a, b, root, 0) and _excludes(b, a, root, 0)):
                return i, j
    return None


def _excludes(a: object, b: object, root: dict, depth: int) -> bool:
    """Whether it is certain that no output the engine writes for schema `a` validates against
    schema `b` (False when that cannot be shown): the values of either lie outside the other, their
    types differ (an integer is a number), `a` requires a property whose schema excludes `b`'s, or
    `a` allows no property that `b` requires (strict mode: no properties outside the schema)."""
    for _ in range(_MAX_EXCLUDES_DEPTH):  # a branch that is a $ref (pydantic writes unions so)
        if not (isinstance(a, dict) and json_pointer.is_local(a.get("$ref"))):
            break
        a = json_pointer.resolve(root, a["$ref"])
    for _ in range(_MAX_EXCLUDES_DEPTH):
        if not (isinstance(b, dict) and json_pointer.is_local(b.get("$ref"))):
            break
        b = json_pointer.resolve(root, b["$ref"])
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > _MAX_EXCLUDES_DEPTH:
        return False
    for one, other in ((a, b), (b, a)):
        values = [one["const"]] if "const" in one else one.get("enum")
        if isinstance(values, list) and not any(_is_valid(value, other, root) for value in values):
            return True
    types_a, types_b = _widened(_type_set(a.get("type"))), _widened(_type_set(b.get("type")))
    if types_a and types_b and not types_a & types_b:
        return True
    properties_a: dict = a["properties"] if isinstance(a.get("properties"), dict) else {}
    properties_b: dict = b["properties"] if isinstance(b.get("properties"), dict) else {}
    for name in a.get("required", ()) if isinstance(a.get("required"), list) else ():
        if name in properties_a and name in properties_b:
            if _excludes(properties_a[name], properties_b[name], root, depth + 1):
                return True
    is_closed = a.get("additionalProperties", False) is False and not a.get("patternProperties")
    required_b = b.get("required", ()) if isinstance(b.get("required"), list) else ()
    return types_a == {"object"} and is_closed and any(name not in properties_a for name in required_b)


def _is_valid(value: Any, schema: dict, root: dict) -> bool:
    """Whether `value` validates against `schema`, a part of `root` (its $refs resolve in `root`);
    True when that cannot be told."""
    try:
        return jsonschema.validators.validator_for(root)(root).evolve(schema=schema).is_valid(value)
    except (referencing.exceptions.Unresolvable, RecursionError):
        return True


def _widened(types: set[str]) -> set[str]:
    """`types` with 'integer' and 'number' each standing for both (an integer is a number)."""
    return types | ({"integer", "number"} if types & {"integer", "number"} else set())


def _type_set(value: object) -> set[str]:
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return {v for v in values if isinstance(v, str)}


def _is_enforced_multiple_of(node: dict) -> bool:
    multiple_of = node["multipleOf"]
    if node.get("type") != "integer" or isinstance(multiple_of, bool) or not isinstance(multiple_of, (int, float)):
        return False
    if multiple_of != int(multiple_of) or not 0 < multiple_of <= _MAX_INTEGER_MULTIPLE_OF:
        return False
    lows = [node[k] for k in ("minimum", "exclusiveMinimum") if isinstance(node.get(k), (int, float))]
    highs = [node[k] for k in ("maximum", "exclusiveMaximum") if isinstance(node.get(k), (int, float))]
    if not lows and not highs:
        return True
    return bool(lows and highs) and min(highs) - max(lows) < _MAX_MULTIPLE_OF_RANGE


def _finite_float(text: str) -> float:
    """A JSON number as a float; one past a double's range (1e400) is refused: Python reads it as
    inf, which the engine cannot parse back (it failed without a message)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is beyond a double's range")
    return value


def _finite_int(text: str) -> int:
    """A JSON integer, refused past a double's range (10**400) as `_finite_float` refuses 1e400."""
    value = int(text)
    if abs(value) > _MAX_DOUBLE:
        raise ValueError(f"the number {text[:32]}... is beyond a double's range")
    return value


_MAX_DOUBLE = int(sys.float_info.max)


def _not_json(name: str) -> float:
    """Python's json reads NaN, Infinity and -Infinity; JSON has no such values."""
    raise ValueError(f"{name} is not a JSON value")


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarCacheConfig:
    max_cached_grammars: int = 64
    max_schema_chars: int = DEFAULT_MAX_SCHEMA_CHARS

    def __post_init__(self) -> None:
        require_at_least_one(self, "max_cached_grammars", "max_schema_chars")


class GrammarCache:
    """Compiled grammars by (kind, schema text), least recently used evicted first.

    Requests often share a schema, and a compile costs 25 ms typically, seconds at worst. Thread-safe:
    the lock guards the table only, so two threads missing on the same schema both compile it
    (the same result; the later one is kept) rather than one waiting on the other.
    """

    def __init__(self, tokenizer_info: GrammarTokenizerInfo, config: GrammarCacheConfig | None = None) -> None:
        self.tokenizer_info = tokenizer_info
        self.config = config or GrammarCacheConfig()
        self._grammars: collections.OrderedDict[ResponseFormat, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    @property
    def num_cached(self) -> int:
        return len(self._grammars)

    def compile_response_format(self, kind: str, schema_text: str | None) -> CompiledGrammar:
        return self.compile(ResponseFormat(kind, schema_text))

    def cached(self, response_format: ResponseFormat) -> CompiledGrammar | None:
        """The format's compiled grammar when the cache holds it (a hit), else None (nothing counted)."""
        with self._lock:
            grammar = self._grammars.get(response_format)
            if grammar is not None:
                self._grammars.move_to_end(response_format)
                self.num_hits += 1
            return grammar

    def compile(self, response_format: ResponseFormat) -> CompiledGrammar:
        grammar = self.cached(response_format)
        if grammar is not None:
            return grammar
        with self._lock:
            self.num_misses += 1
        grammar = compile_response_format(
            response_format.kind,
            response_format.schema_text,
            self.tokenizer_info,
            max_schema_chars=self.config.max_schema_chars,
        )
        with self._lock:
            self._grammars[response_format] = grammar
            self._grammars.move_to_end(response_format)
            while len(self._grammars) > self.config.max_cached_grammars:
                self._grammars.popitem(last=False)
        return grammar
