"""Bodies a hostile or careless client sends get a 4xx OpenAI error object, never a 5xx: walked
by hand (each naming its parameter), then fuzzed over the request schema with Hypothesis."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

MODEL = "test-model"
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
LONE_SURROGATE = "\ud800"  # valid in a JSON string (escaped), not a character: UTF-8 cannot encode it


def chat(**fields: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def _post(client: TestClient, body: bytes | dict, path: str = CHAT_PATH):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: "\ud800" escaped
    return client.post(path, content=content, headers={"content-type": "application/json"})


def _error(response) -> dict:  # noqa: ANN001
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(messages=[{"role": "user", "content": LONE_SURROGATE}]), "messages[0].content"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]),
            "messages[0].content[0].text",
        ),
        (chat(messages=[{"role": LONE_SURROGATE, "content": "Hi"}]), "messages[0].role"),
        (chat(stop=LONE_SURROGATE), "stop"),
        (chat(stop=["ok", "x" + LONE_SURROGATE]), "stop[1]"),
        (chat(model=LONE_SURROGATE), "model"),
        (chat(user=LONE_SURROGATE), "user"),
        (chat(strategies=[LONE_SURROGATE]), "strategies[0]"),
        (
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"title": LONE_SURROGATE}},
                }
            ),
            "response_format.json_schema.schema.title",
        ),
        (chat(**{LONE_SURROGATE: 1}), "\\ud800"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_parameter(client: TestClient, body: dict, param: str) -> None:
    response = _post(client, body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "surrogate" in error["message"]


def test_a_lone_surrogate_in_a_prompt_is_a_400_naming_it(client: TestClient) -> None:
    response = _post(client, {"model": MODEL, "prompt": "a" + LONE_SURROGATE}, COMPLETION_PATH)
    assert response.status_code == 400 and _error(response)["param"] == "prompt"


def test_a_surrogate_encoded_as_utf_8_bytes_is_a_400_naming_it(client: TestClient) -> None:
    """json.loads decodes bytes with surrogatepass: 0xED 0xA0 0x80 arrives as "\ud800" too."""
    body = b'{"model": "test-model", "prompt": "a\xed\xa0\x80"}'
    response = _post(client, body, COMPLETION_PATH)
    assert response.status_code == 400 and _error(response)["param"] == "prompt"


HUGE = "x" * (1 << 20)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT_PATH, chat(seed=HUGE), "seed"),  # the front's own check
        (CHAT_PATH, chat(max_tokens=[HUGE]), "max_tokens"),
        (CHAT_PATH, chat(logit_bias={HUGE: 1}), "logit_bias"),
        (CHAT_PATH, chat(prediction={"type": HUGE, "content": "a"}), "prediction.type"),
        (CHAT_PATH, chat(messages=[{"role": HUGE, "content": "Hi"}]), "messages[0].role"),  # the gateway's, over gRPC
        (CHAT_PATH, chat(strategies=[HUGE]), "strategies"),
        (CHAT_PATH, chat(model=HUGE), "model"),
        ("/detokenize", {"model": MODEL, "tokens": [HUGE]}, "tokens[0]"),
    ],
)
def test_a_huge_value_is_quoted_by_its_first_characters_and_its_length(
    client: TestClient, path: str, body: dict, param: str
) -> None:
    """Quoted whole, a 1 MiB value made a 1 MiB error body; one the gateway refused made a status
    message past the gRPC client's metadata limit, which reached the caller as a 429."""
    response = _post(client, body, path)
    assert response.status_code == (404 if param == "model" else 400), response.text[:300]
    error = _error(response)
    assert error["param"] == param and len(error["message"]) < 500, error["message"][:300]
    assert "... (10485" in error["message"]  # the length of the value (or of its JSON text): 1048576 + a few


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000, b'{"a":' * 100_000, b'{"model": "m", "messages": ' + b"[" * 100_000],
    ids=["arrays", "objects", "inside-a-field"],
)
def test_a_body_nested_past_the_parser_s_depth_is_a_400(client: TestClient, body: bytes) -> None:
    response = _post(client, body)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] is None and "deep" in error["message"]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _chat_with(fields: str) -> str:
    """A chat body's JSON text with these fields' text added."""
    return json.dumps(chat())[:-1] + ", " + fields + "}"


# Bodies with a value nested `depth` deep at the parameter that names it: path, body by depth.
_NESTED_AT = {
    "seed": (CHAT_PATH, lambda d: _chat_with(f'"seed": {_nested(d)}')),
    "temperature": (CHAT_PATH, lambda d: _chat_with(f'"temperature": {_nested(d)}')),
    "stream": (CHAT_PATH, lambda d: _chat_with(f'"stream": {_nested(d)}')),
    "parallel_tool_calls": (CHAT_PATH, lambda d: _chat_with(f'"parallel_tool_calls": {_nested(d)}')),
    "prediction.type": (CHAT_PATH, lambda d: _chat_with(f'"prediction": {{"type": {_nested(d)}}}')),
    "tools[0].function.parameters": (
        CHAT_PATH,
        lambda d: _chat_with(
            f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": {{"a": {_nested(d)}}}}}}}]'
        ),
    ),
    "response_format.json_schema.schema": (
        CHAT_PATH,
        lambda d: _chat_with(
            f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": {{"a": '
            f"{_nested(d)}}}}}}}"
        ),
    ),
    "prompt[1]": (COMPLETION_PATH, lambda d: f'{{"model": "{MODEL}", "prompt": [[1, {_nested(d)}]]}}'),
    "tokens[1]": ("/detokenize", lambda d: f'{{"tokens": [1, {_nested(d)}]}}'),
}


@pytest.mark.parametrize("param", sorted(_NESTED_AT))
def test_a_value_nested_about_as_deep_as_the_parser_allows_gets_no_5xx(client: TestClient, param: str) -> None:
    """The parser accepts what nests up to its recursion limit; the front, deeper down the stack,
    turned such a value back into JSON (an error message showing it, a schema for the gateway) and
    hit the limit there: a RecursionError and a 500. The depths the parser takes are found by
    bisection (they depend on the stack it runs from); the deepest few get no 5xx."""
    path, body = _NESTED_AT[param]

    def is_parsed(depth: int) -> bool:
        response = _post(client, body(depth).encode(), path)
        return not (response.status_code == 400 and _error(response)["param"] is None)

    parsed, refused = 1, 100_000
    assert is_parsed(parsed) and not is_parsed(refused)
    while refused - parsed > 1:
        middle = (parsed + refused) // 2
        parsed, refused = (middle, refused) if is_parsed(middle) else (parsed, middle)
    for depth in range(parsed - 8, parsed + 1):
        response = _post(client, body(depth).encode(), path)
        assert response.status_code < 500, (depth, response.text[:300])
        if response.status_code == 400:
            assert _error(response)["param"].startswith(param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "test-model", "max_tokens": ' + b"9" * 5000 + b"}", None),  # past int()'s digit limit
        (b"\xff\xfe", None),
        (b"null", None),
        (b'["a"]', None),
        (
            b'{"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
            "temperature",
        ),
        (
            b'{"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1e999}',
            "max_tokens",
        ),
        (json.dumps(chat(messages=[[[[]]]])).encode(), "messages[0]"),
        (json.dumps(chat(seed=-1)).encode(), "seed"),
        (json.dumps(chat(top_k=1 << 40)).encode(), "top_k"),
        (json.dumps(chat(logit_bias={"9" * 5000: 1})).encode(), "logit_bias"),  # a key past int()'s digit limit
        (json.dumps(chat(response_format={"type": []})).encode(), "response_format.type"),  # not hashable
        (json.dumps(chat(response_format={"type": {"a": 1}})).encode(), "response_format.type"),
    ],
)
def test_other_hostile_bodies_are_400s(client: TestClient, body: bytes, param: str | None) -> None:
    response = _post(client, body)
    assert response.status_code == 400, response.text
    assert _error(response)["param"] == param


# ---- fuzz ---------------------------------------------------------------------------------------------
# Text of any code point, lone surrogates (which JSON escapes can carry) included: st.text leaves
# them out, whatever its alphabet.
_TEXT = st.lists(st.characters() | st.characters(categories=["Cs"]), min_size=1, max_size=8).map("".join)
_JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _TEXT
)
_JSON = st.recursive(
    _JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)


def mostly(typed: st.SearchStrategy) -> st.SearchStrategy:
    """`typed` three times in four, any JSON value the fourth."""
    return st.integers(0, 3).flatmap(lambda i: typed if i < 3 else _JSON)


_MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"]))},
    optional={"content": mostly(_TEXT)},
)
# Each field of the request schema: mostly values of its own type (so that requests get past the
# front to the gateway's checks), sometimes any JSON at all.
_FIELDS = {
    "max_tokens": mostly(st.integers(min_value=-1, max_value=1 << 33)),
    "max_completion_tokens": mostly(st.integers(min_value=-1, max_value=10_000)),
    "temperature": mostly(st.floats(allow_nan=True)),
    "top_p": mostly(st.floats()),
    "top_k": mostly(st.integers(min_value=-1, max_value=1 << 40)),
    "seed": mostly(st.integers(min_value=-1, max_value=1 << 65)),
    "stop": mostly(_TEXT | st.lists(_TEXT, max_size=20)),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": mostly(st.booleans())})),
    "n": mostly(st.integers(min_value=0, max_value=3)),
    "user": mostly(_TEXT),
    "response_format": mostly(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
            optional={"json_schema": st.fixed_dictionaries({"name": _TEXT}, optional={"schema": _JSON})},
        )
    ),
    "speculative_decoding": mostly(st.booleans()),
    "adaptive": mostly(st.booleans()),
    "speculative_degree": mostly(st.integers(min_value=-1, max_value=100)),
    "draft_length": mostly(st.integers(min_value=-1, max_value=100)),
    "acceptance_threshold": mostly(st.floats()),
    "strategies": mostly(st.lists(st.sampled_from(["prompt_lookup", "suffix", "nope"]), max_size=3) | _TEXT),
    "return_token_ids": mostly(st.booleans()),
    "logprobs": mostly(st.booleans()),
}
# A request: the model, messages and a prompt (each endpoint reads its own), and up to 3 other fields.
_REQUESTS = st.tuples(
    st.fixed_dictionaries(
        {
            "model": st.just(MODEL),
            "messages": mostly(st.lists(_MESSAGE, min_size=1, max_size=3)),
            "prompt": mostly(_TEXT | st.lists(_TEXT, max_size=2)),
        }
    ),
    st.lists(st.sampled_from(sorted(_FIELDS)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: _FIELDS[name] for name in names})
    ),
).map(lambda parts: {**parts[0], **parts[1]})
_BODIES = mostly(_REQUESTS)


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=_BODIES, path=st.sampled_from([CHAT_PATH, COMPLETION_PATH]))
def test_no_request_body_gets_a_5xx(client: TestClient, body: object, path: str) -> None:
    response = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        _error(response)


@pytest.mark.parametrize("media_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETION_PATH, "/tokenize", "/detokenize"])
def test_a_body_a_web_page_could_post_from_another_site_is_a_415(
    client: TestClient, media_type: str, path: str
) -> None:
    """A browser lets any page POST these types to another site without asking it first (CORS simple
    requests): a front without API keys on loopback would have run what a visited page sent. JSON
    with its type, or with none (a raw body), is read as before."""
    body = json.dumps(chat()).encode()
    response = client.post(path, content=body, headers={"content-type": f"{media_type}; charset=utf-8"})
    assert response.status_code == 415, response.text
    assert "application/json" in _error(response)["message"]
    assert client.post(CHAT_PATH, content=body).status_code == 200


def test_a_huge_unknown_field_is_named_shortened(client: TestClient) -> None:
    """The ignored field's name, whole in the header, made a 1 MiB response header, past what an
    HTTP client reads (h11, httpx's: 16 KiB): the answer to a served request was lost."""
    response = _post(client, chat(**{HUGE: 1}))
    assert response.status_code == 200, response.text[:300]
    assert response.headers["x-specdec-ignored-fields"] == "x" * 100 + f"... ({len(HUGE)} characters)"
