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
import re
import threading

import jsonschema
import xgrammar as xgr

from specdec.errors import InvalidArgument
from specdec.field_checks import require_at_least_one
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
        reason = _ENGINE_LOG_PREFIX.sub("", str(e).strip().splitlines()[0])
        raise InvalidArgument(SCHEMA_FIELD, f"is not supported by the grammar engine: {reason}") from None
    return CompiledGrammar(response_format, tokenizer_info, grammar)


def check_schema_text(schema_text: str, max_schema_chars: int = DEFAULT_MAX_SCHEMA_CHARS) -> None:
    """Raise InvalidArgument unless `schema_text` is a JSON Schema object of bounded size."""
    if len(schema_text) > max_schema_chars:
        raise InvalidArgument(
            SCHEMA_FIELD, f"has {len(schema_text)} characters, more than the limit of {max_schema_chars}"
        )
    try:
        schema = json.loads(schema_text)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(SCHEMA_FIELD, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidArgument(SCHEMA_FIELD, f"must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        raise InvalidArgument(SCHEMA_FIELD, f"is not a valid JSON Schema: {e.message} (at {where})") from None
    except RecursionError:  # the check recurses a few frames a level: JSON that parses can nest past it
        raise InvalidArgument(SCHEMA_FIELD, "nests too deeply to check as a JSON Schema") from None


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
