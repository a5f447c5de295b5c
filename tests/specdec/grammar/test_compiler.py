"""Response formats: validation with the field named, compilation, the LRU of compiled grammars."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from specdec.errors import InvalidArgument
from specdec.grammar import GrammarCache, ResponseFormat, compile_response_format
from specdec.grammar.compiler import GrammarCacheConfig

from tests.schemas import PERSON_SCHEMA


@pytest.mark.parametrize(
    "schema_text, reason",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('"string"', "must be a JSON object, got str"),
        ('{"type": "foo"}', "is not a valid JSON Schema"),
        ('{"not": ' * 200 + "{}" + "}" * 200, "nests too deeply to check"),  # parses; the check's recursion fails
        ('{"properties": {"a": {"minLength": -1}}}', "at /properties/a/minLength"),
        # numbers JSON has not (Python's json reads them) or a double cannot hold: the engine failed on
        # 1e400 with an empty message (IndexError, INTERNAL) and echoed the schema for NaN
        ('{"type": "integer", "maximum": 1e400}', "is not valid JSON: the number 1e400 is beyond a double's range"),
        ('{"type": "array", "maxItems": 1' + "0" * 400 + "}", "is not valid JSON: the number 1000"),
        ('{"type": "number", "minimum": -Infinity}', "is not valid JSON: -Infinity is not a JSON value"),
        ('{"type": "number", "maximum": NaN}', "is not valid JSON: NaN is not a JSON value"),
        # valid JSON Schema, but the engine refuses it: its reason comes through without the C++ log prefix
        (
            '{"type": "object", "minProperties": 3, "maxProperties": 1}',
            "is not supported by the grammar engine: minProperties is greater than maxProperties",
        ),
    ],
)
def test_invalid_schema_names_the_field(tokenizer_info, schema_text, reason):
    with pytest.raises(InvalidArgument) as info:
        compile_response_format("json_schema", schema_text, tokenizer_info)
    assert info.value.field == "response_format.json_schema"
    assert reason in info.value.message
    assert "[" not in info.value.message.split(":")[0]  # no "[17:07:09] /project/cpp/..." prefix


# Each valid JSON Schema that the engine compiled, then let through an output that does not validate
# (it ignored the keyword): the output it allowed is beside it. Refused now, naming what and where.
@pytest.mark.parametrize(
    "schema, allowed_output, reason, where",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], "'uniqueItems'", "/"),
        ({"not": {"type": "string"}}, "a", "'not'", "/"),
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
            {"a": 1},
            "'dependentRequired'",
            "/",
        ),
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1], "'contains'", "/"),
        ({"type": "object", "required": ["a"]}, {}, "'required' names ['a']", "/"),
        (
            {
                "type": "object",
                "properties": {"p": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}},
            },
            {"p": {"a": 1}},
            "'required' names ['b']",
            "/properties/p",
        ),
        ({"type": "number", "multipleOf": 2}, 3, "'multipleOf'", "/"),
        ({"type": "integer", "multipleOf": 3, "minimum": 0}, 4, "'multipleOf'", "/"),
        ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, "ab", "'pattern' beside 'minLength'", "/"),
        ({"type": "string", "format": "email", "maxLength": 5}, "abcdef@b.co", "'format' beside", "/"),
        ({"type": "string", "pattern": "^(?!a)[a-z]+$"}, "abc", "lookahead", "/"),
        ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, 1, "'allOf' with more than one", "/"),
        ({"anyOf": [{"type": "string"}], "type": "integer"}, "a", "'anyOf' beside ['type']", "/"),
        (
            {"$defs": {"x": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/x", "minimum": 3}}},
            {"a": 1},
            "'$ref' beside ['minimum']",
            "/properties/a",
        ),
        ({"type": "integer", "enum": [1, "a"]}, "a", "'enum' values ['a']", "/"),
        (  # in a definition, found where a $ref (here a recursive one) uses it
            {
                "$defs": {
                    "Tags": {
                        "type": "array",
                        "items": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/Tags"}]},
                        "uniqueItems": True,
                    }
                },
                "$ref": "#/$defs/Tags",
            },
            ["a", "a"],
            "'uniqueItems'",
            "/$defs/Tags",
        ),
        ({"type": "string", "const": "x", "maxLength": 0}, "x", "'const' values ['x']", "/"),
        # a $ref reaches its target as the engine resolves it: into an array by index, to an empty key,
        # through "~1" ("/") and percent-encoding; the checks went to no schema or the wrong one there
        (
            {
                "$defs": {"U": {"anyOf": [{"type": "string"}, {"type": "array", "items": {}, "uniqueItems": True}]}},
                "$ref": "#/$defs/U/anyOf/1",
            },
            [1, 1],
            "'uniqueItems'",
            "/$defs/U/anyOf/1",
        ),
        ({"$defs": {"": {"not": {"type": "string"}}}, "$ref": "#/$defs/"}, "a", "'not'", "/$defs/"),
        # a map may repeat a key, which the engine counts twice and a JSON reader once
        (
            {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
            json.loads('{"a": 1, "a": 2}'),
            "'minProperties' over 1 beyond the 'required'",
            "/",
        ),
        (
            {
                "type": "object",
                "properties": {"a": {}},
                "required": ["a"],
                "patternProperties": {"^x": {}},
                "minProperties": 3,
            },
            json.loads('{"a": 1, "x": 1, "x": 2}'),
            "'minProperties' over 1 beyond the 'required'",
            "/",
        ),
        # the engine writes 'oneOf' as 'anyOf': an output matching two branches breaks it
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1, "'oneOf' branches 0 and 1", "/"),
        ({"oneOf": [{"type": "string"}, {"type": "integer"}, {"const": "x"}]}, "x", "'oneOf' branches 0 and 2", "/"),
        (
            {"oneOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]},
            {},
            "'oneOf' branches 0 and 1",
            "/",
        ),
        ({"$defs": {"a/b c": {"not": {"type": "string"}}}, "$ref": "#/$defs/a~1b%20c"}, "a", "'not'", "/$defs/a~1b c"),
    ],
)
def test_schema_the_engine_would_not_enforce_is_refused(tokenizer_info, schema, allowed_output, reason, where):
    with pytest.raises(jsonschema.ValidationError):  # the output the engine let through breaks the schema
        jsonschema.validate(allowed_output, schema)
    with pytest.raises(InvalidArgument) as info:
        compile_response_format("json_schema", json.dumps(schema), tokenizer_info)
    assert info.value.field == "response_format.json_schema"
    assert reason in info.value.message and f"(at {where})" in info.value.message
    assert "cannot enforce" in info.value.message


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "enum": ["a", "b"]},
        {"type": "integer", "multipleOf": 3},
        {"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 20},
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "string", "minLength": 2, "maxLength": 3},
        {"allOf": [{"$ref": "#/$defs/x"}], "$defs": {"x": {"type": "integer"}}, "description": "d", "default": 1},
        {"type": "object", "allOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]}]},
        {
            "$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
            "$ref": "#/$defs/n",
        },
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "x-vendor": {"not": 1}},
        # 'oneOf' whose branches no output can match both of (types, values, a required discriminator,
        # a required property the other branch does not allow)
        {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
        {"oneOf": [{"const": "a", "title": "A"}, {"const": "b", "title": "B"}]},
        {
            "$defs": {
                pet: {"type": "object", "properties": {"kind": {"const": pet}, "name": {}}, "required": ["kind"]}
                for pet in ("cat", "dog")
            },
            "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],
            "discriminator": {"propertyName": "kind"},
        },
        {
            "oneOf": [
                {"type": "object", "properties": {"cat": {"type": "string"}}, "required": ["cat"]},
                {"type": "object", "properties": {"dog": {"type": "string"}}, "required": ["dog"]},
            ]
        },
        # a minimum the required properties meet, or one over properties that cannot repeat
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": {"type": "integer"},
            "minProperties": 2,
        },
        {"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1},
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
        # a definition nothing uses is not compiled: what it holds does not matter
        {"type": "integer", "$defs": {"unused": {"not": {"type": "string"}}}},
    ],
)
def test_schema_the_engine_enforces_compiles(tokenizer_info, schema):
    compile_response_format("json_schema", json.dumps(schema), tokenizer_info)


@pytest.mark.parametrize(
    "schema, where",
    [
        ({"type": "string", "pattern": "^(\\w{0,20}){0,20}$"}, "/pattern"),  # over 20 s to compile
        ({"type": "string", "pattern": "^[a-z]{0,9000}$"}, "/pattern"),
        ({"type": "object", "patternProperties": {"^(\\w{0,50}){0,50}": {}}}, "/patternProperties/^(\\w{0,50}){0,50}"),
        ({"$defs": {"x": {"type": "string", "pattern": "((a{2,3}){4}){6}"}}, "$ref": "#/$defs/x"}, "/$defs/x/pattern"),
    ],
)
def test_pattern_too_costly_to_compile_is_refused_before_compiling(tokenizer_info, schema, where, monkeypatch):
    """Such a compile cannot be stopped once begun: the schema is refused before it, naming the pattern."""

    def never(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_json_schema", never)
    with pytest.raises(InvalidArgument) as info:
        compile_response_format("json_schema", json.dumps(schema), tokenizer_info)
    assert info.value.field == "response_format.json_schema"
    assert f"(at {where})" in info.value.message and "to compile in bounded time" in info.value.message


@pytest.mark.parametrize(
    "pattern",
    ["^(?:\\S+\\s+){0,199}\\S+$", "^[a-z]{0,4000}$", "^(\\w{0,8}){0,8}$", "^[\\]{]{3}(ab|cd){2}$"],
)
def test_pattern_of_bounded_cost_compiles(tokenizer_info, pattern):
    compile_response_format("json_schema", json.dumps({"type": "string", "pattern": pattern}), tokenizer_info)


def test_engine_refusal_without_a_message_still_names_the_field(tokenizer_info, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("")

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_json_schema", refuse)
    with pytest.raises(InvalidArgument, match="response_format.json_schema: is not supported by the grammar engine"):
        compile_response_format("json_schema", PERSON_SCHEMA, tokenizer_info)


def test_schema_is_required_for_json_schema_and_refused_for_json_object():
    with pytest.raises(InvalidArgument, match="response_format.json_schema: is required"):
        ResponseFormat("json_schema", "")
    with pytest.raises(InvalidArgument, match="response_format.json_schema: must be empty"):
        ResponseFormat("json_object", PERSON_SCHEMA)
    assert ResponseFormat("json_object", "").schema_text is None  # proto3's default string = absent


def test_unknown_kind_names_the_type_field():
    with pytest.raises(InvalidArgument) as info:
        ResponseFormat("yaml")
    assert info.value.field == "response_format.type"


def test_too_long_schema_is_refused_before_parsing(tokenizer_info):
    with pytest.raises(InvalidArgument, match="more than the limit of 10"):
        compile_response_format("json_schema", PERSON_SCHEMA, tokenizer_info, max_schema_chars=10)


def _accepts(grammar, text: str, tokenizer) -> bool:
    state = grammar.new_state()
    return state.accept_tokens(tokenizer.encode(text)) and state.is_completed


def test_json_object_allows_any_object_and_nothing_else(grammar_cache, tokenizer):
    grammar = grammar_cache.compile_response_format("json_object", None)
    assert _accepts(grammar, '{"a": [1, {"b": null}], "c": "x"}', tokenizer)
    assert _accepts(grammar, "{}", tokenizer)
    assert not _accepts(grammar, "[1]", tokenizer)
    assert not _accepts(grammar, '"x"', tokenizer)
    assert not _accepts(grammar, '{"a":1}', tokenizer)  # the layout is fixed: ": " after a key


def test_json_schema_is_strict_about_properties_and_types(grammar_cache, tokenizer):
    grammar = grammar_cache.compile_response_format("json_schema", PERSON_SCHEMA)
    assert _accepts(grammar, '{"name": "Bob", "age": 42, "unit": "celsius"}', tokenizer)
    assert not _accepts(grammar, '{"name": "Bob", "age": "42", "unit": "celsius"}', tokenizer)  # type
    assert not _accepts(grammar, '{"name": "Bob", "age": 42}', tokenizer)  # required
    assert not _accepts(grammar, '{"name": "Bob", "age": 42, "unit": "kelvin"}', tokenizer)  # enum
    assert not _accepts(grammar, '{"name": "Bob", "age": 42, "unit": "celsius", "x": 1}', tokenizer)


def test_cache_returns_the_same_grammar_and_evicts_least_recently_used(tokenizer_info):
    cache = GrammarCache(tokenizer_info, GrammarCacheConfig(max_cached_grammars=2))
    schema = lambda key: json.dumps({"type": "object", "properties": {key: {"type": "integer"}}})  # noqa: E731
    a = cache.compile_response_format("json_schema", schema("a"))
    b = cache.compile_response_format("json_schema", schema("b"))
    assert cache.compile_response_format("json_schema", schema("a")) is a  # hit; a is now the most recent
    cache.compile_response_format("json_schema", schema("c"))  # evicts b, not a
    assert cache.num_cached == 2
    assert cache.compile_response_format("json_schema", schema("a")) is a
    assert cache.compile_response_format("json_schema", schema("b")) is not b
    assert (cache.num_hits, cache.num_misses) == (2, 4)


def test_failed_compile_is_not_cached(tokenizer_info):
    cache = GrammarCache(tokenizer_info)
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            cache.compile_response_format("json_schema", "{not json")
    assert (cache.num_cached, cache.num_misses) == (0, 2)


def test_cache_config_validates():
    with pytest.raises(ValueError, match="max_cached_grammars"):
        GrammarCacheConfig(max_cached_grammars=0)
