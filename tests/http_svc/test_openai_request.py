"""OpenAI bodies -> GenerateRequest: the HTTP shape only (values are the gateway's to check)."""

from __future__ import annotations

import json

import pytest

from http_svc.errors import ApiError
from http_svc.openai_request import (
    CHAT,
    COMPLETION,
    DEFAULT_TEMPERATURE,
    MAX_CHOICES,
    ignored_fields_header,
    parse_body,
    parse_request,
)
from specdec.v1 import common_pb2

MODEL = "m"


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def refused(data: dict, kind: str = CHAT) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(data, kind)
    assert e.value.status == 400
    return e.value


def test_a_chat_body_becomes_a_generate_request() -> None:
    parsed = parse_request(
        chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you"}]},
                {"role": "assistant", "content": None},
            ],
            max_tokens=7,
            stop="END",
            temperature=0,
            top_p=0.5,
            seed=3,
            user="u1",
            stream=True,
            stream_options={"include_usage": True},
            return_token_ids=True,
        ),
        CHAT,
    )
    r = parsed.request
    assert [(m.role, m.content) for m in r.chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hello, you"),
        ("assistant", ""),
    ]
    assert r.max_new_tokens == 7 and list(r.stop) == ["END"]
    assert r.sampling.temperature == 0 and r.sampling.top_p == 0.5 and r.sampling.seed == 3
    assert parsed.is_stream and parsed.is_usage_streamed and parsed.is_returning_token_ids
    assert parsed.param_aliases == {"max_new_tokens": "max_tokens"} and parsed.model == MODEL


def test_defaults_are_openai_s() -> None:
    parsed = parse_request({"model": MODEL, "prompt": ["Once"]}, COMPLETION)
    r = parsed.request
    assert r.prompt == "Once" and r.sampling.temperature == DEFAULT_TEMPERATURE
    assert not r.HasField("max_new_tokens") and not r.sampling.HasField("seed") and not r.sampling.HasField("top_p")
    assert not r.HasField("speculation") and not r.HasField("response_format")
    assert not parsed.is_stream and not parsed.is_usage_streamed


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    parsed = parse_request(chat(max_tokens=5, max_completion_tokens=9), CHAT)
    assert parsed.request.max_new_tokens == 9
    assert parsed.param_aliases == {"max_new_tokens": "max_completion_tokens"}


def test_response_formats() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = parse_request(
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}),
        CHAT,
    ).request
    assert r.response_format.type == common_pb2.ResponseFormat.TYPE_JSON_SCHEMA
    assert json.loads(r.response_format.json_schema) == schema
    r = parse_request(chat(response_format={"type": "json_object"}), CHAT).request
    assert r.response_format.type == common_pb2.ResponseFormat.TYPE_JSON_OBJECT
    r = parse_request(chat(response_format={"type": "text"}), CHAT).request
    assert r.response_format.type == common_pb2.ResponseFormat.TYPE_TEXT


def test_speculation_settings_are_extra_fields() -> None:
    r = parse_request(
        chat(
            speculative_decoding=True,
            speculative_degree=3,
            draft_length=6,
            acceptance_threshold=0.5,
            strategies="prompt_lookup,suffix_index",
            adaptive=False,
        ),
        CHAT,
    ).request
    s = r.speculation
    assert s.is_enabled and not s.is_adaptive and s.speculative_degree == 3 and s.draft_length == 6
    assert s.acceptance_threshold == 0.5 and list(s.strategies) == ["prompt_lookup", "suffix_index"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": None}, "model"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"n": "1"}, "n"),
        ({"n": 1.5}, "n"),
        ({"messages": "Hi"}, "messages"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
            "messages[0].tool_calls[0].function",
        ),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": 1 << 64}, "seed"),
        ({"stop": ["a", 1]}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids[1]"),
        ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"min_tokens": -3}, "min_tokens"),
        ({"min_tokens": "4"}, "min_tokens"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
            "response_format.json_schema.schema",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": "yes"}, "stream"),
        ({"speculative_decoding": 1}, "speculative_decoding"),
        ({"strategies": [1]}, "strategies"),
        ({"draft_length": 33}, "draft_length"),
        ({"speculative_degree": 9}, "speculative_degree"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),
        ({"repetition_penalty": None, "min_p": "x"}, "min_p"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": "x"}}, "logit_bias"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"user": 5}, "user"),
    ],
)
def test_a_body_not_of_the_openai_shape_is_a_400_naming_the_parameter(fields: dict, param: str) -> None:
    error = refused(chat(**fields))
    assert error.param == param and error.message.startswith(f"{param}: ")
    assert error.to_json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 1, "logprobs": False, "tools": []},
        {"functions": [], "function_call": "none"},
        {"best_of": 1, "modalities": ["text"]},
        {"audio": None, "web_search_options": None},
    ],
)
def test_neutral_values_of_unsupported_parameters_change_nothing(fields: dict) -> None:
    """Parameters this service does not support pass at their neutral values, and the request is
    exactly the one without them."""
    plain, parsed = parse_request(chat(), CHAT), parse_request(chat(**fields), CHAT)
    assert parsed.requests == plain.requests
    assert (parsed.is_logprobs, parsed.num_top_logprobs, parsed.is_stream) == (False, 0, False)


def test_ignore_eos_and_stop_token_ids_reach_the_generate_request() -> None:
    r = parse_request(chat(ignore_eos=True, stop_token_ids=[3, 4], min_tokens=6), CHAT).request
    assert r.ignore_eos and list(r.stop_token_ids) == [3, 4] and r.sampling.min_tokens == 6
    r = parse_request(chat(stop_token_ids=[]), CHAT).request
    assert not r.ignore_eos and not r.stop_token_ids


def test_n_choices_are_requests_of_their_own_each_seed_its_own() -> None:
    parsed = parse_request(chat(n=3, seed=(1 << 64) - 2, temperature=0.7, max_tokens=5), CHAT)
    assert parsed.num_choices == 3 and len(parsed.requests) == 3
    assert [r.sampling.seed for r in parsed.requests] == [(1 << 64) - 2, (1 << 64) - 1, 0]  # mod 2^64
    assert all(r.max_new_tokens == 5 and r.sampling.temperature == pytest.approx(0.7) for r in parsed.requests)
    assert all(r.chat == parsed.request.chat for r in parsed.requests)
    assert parsed.prompt_requests == (parsed.request,)
    unseeded = parse_request(chat(n=2), CHAT).requests
    assert not any(r.sampling.HasField("seed") for r in unseeded)  # each draws its own


def test_n_choices_of_several_prompts_are_prompt_major() -> None:
    parsed = parse_request({"model": MODEL, "prompt": ["a", "b"], "n": 2, "seed": 7}, COMPLETION)
    assert [(r.prompt, r.sampling.seed) for r in parsed.requests] == [("a", 7), ("a", 8), ("b", 7), ("b", 8)]
    assert [r.prompt for r in parsed.prompt_requests] == ["a", "b"]
    streamed = parse_request(chat(n=4, stream=True), CHAT)
    assert streamed.is_stream and len(streamed.requests) == 4
    error = refused({"model": MODEL, "prompt": ["a", "b"], "n": MAX_CHOICES // 2 + 1}, COMPLETION)
    assert error.param == "n" and f"at most {MAX_CHOICES}" in error.message


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"max_tokens": -3}, "max_tokens", "must be at least 1, got -3"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "must be at least 1, got 0"),
        ({"max_tokens": 1 << 32}, "max_tokens", f"must be at most {(1 << 32) - 1}, got {1 << 32}"),
        ({"n": 0}, "n", "must be at least 1, got 0"),
        ({"min_tokens": -1}, "min_tokens", "must be at least 0, got -1"),
    ],
)
def test_an_integer_out_of_range_is_told_the_bound_it_breaks(fields: dict, param: str, message: str) -> None:
    # Not the wire's whole range: a negative max_tokens once heard "must be in [0, 4294967295]",
    # a range whose lower end the gateway refuses too.
    error = refused(chat(**fields))
    assert error.param == param and error.message.endswith(message)


@pytest.mark.parametrize("kind", [CHAT, COMPLETION])
def test_sampling_controls_reach_the_generate_request(kind: str) -> None:
    body = chat() if kind == CHAT else {"model": MODEL, "prompt": "Once"}
    body.update(
        temperature=2,
        frequency_penalty=-2,
        presence_penalty=1.5,
        repetition_penalty=1.2,
        min_p=0.05,
        logit_bias={"42": -100, "7": 2.5},
    )
    s = parse_request(body, kind).request.sampling
    assert s.temperature == 2 and s.frequency_penalty == -2 and s.presence_penalty == 1.5
    assert s.HasField("repetition_penalty") and s.repetition_penalty == pytest.approx(1.2)
    assert s.min_p == pytest.approx(0.05) and dict(s.logit_bias) == {42: -100.0, 7: 2.5}
    assert not parse_request(chat(), CHAT).request.sampling.HasField("repetition_penalty")  # unset: off


def test_fields_without_effect_are_accepted_and_named() -> None:
    parsed = parse_request(chat(foo_bar=1, user="u", reasoning_effort="low", store=None, temperature=1), CHAT)
    assert parsed.ignored_fields == ("user", "reasoning_effort", "foo_bar")  # store=None: not given
    assert parsed.unknown_fields == ("foo_bar",)
    assert parse_request(chat(), CHAT).ignored_fields == ()
    completion = parse_request({"model": MODEL, "prompt": "Once", "messages": [], "best_of": 1}, COMPLETION)
    assert completion.unknown_fields == ("messages",)  # a chat field in a completion body has no effect


def test_fields_that_take_effect_are_not_named_ignored() -> None:
    """Tools, log probabilities, echo and a prediction change the answer: the header (and the
    warning) must not tell the client they were dropped."""
    tool = {"type": "function", "function": {"name": "f"}}
    parsed = parse_request(
        chat(
            tools=[tool],
            tool_choice="auto",
            parallel_tool_calls=True,
            logprobs=True,
            top_logprobs=2,
            prediction={"type": "content", "content": "Hi"},
        ),
        CHAT,
    )
    assert parsed.ignored_fields == () and parsed.unknown_fields == ()
    legacy = parse_request({"model": MODEL, "prompt": "a", "logprobs": 1, "echo": True}, COMPLETION)
    assert legacy.ignored_fields == () and legacy.unknown_fields == ()


def test_the_ignored_fields_header_is_printable_ascii_and_bounded() -> None:
    assert ignored_fields_header(("foo", "a\r\nb", "\u00e9")) == "foo, a\\r\\nb, \\u00e9"
    value = ignored_fields_header(tuple(f"f{i}" for i in range(100)))
    assert value.endswith(", ... 68 more") and value.count(",") == 32
    # Long names too: a 1 MiB one, whole, made a response header no HTTP client reads.
    value = ignored_fields_header(tuple(f"{i}" * (1 << 20) for i in range(100)))
    assert len(value) < 8192 and value.startswith("0" * 100 + f"... ({1 << 20} characters), 1111")


def test_prompts() -> None:
    for prompt in (None, 5, [], [[]], [True], {"a": 1}):
        assert refused({"model": MODEL, "prompt": prompt}, COMPLETION).param.startswith("prompt")
    assert refused({"model": MODEL, "prompt": [1, -2]}, COMPLETION).param == "prompt[1]"
    assert refused({"model": MODEL, "prompt": ["a", [1, "b"]]}, COMPLETION).param == "prompt[1][1]"
    assert refused({"model": MODEL, "prompt": ["a"] * 65}, COMPLETION).param == "prompt"
    assert refused({"model": MODEL, "prompt": ["a", "b"], "stream": True}, COMPLETION).param == "prompt"


def test_token_id_prompts_and_lists_of_prompts_are_one_request_each() -> None:
    (ids,) = parse_request({"model": MODEL, "prompt": [1, 2, 3]}, COMPLETION).requests
    assert list(ids.token_ids.ids) == [1, 2, 3] and ids.WhichOneof("input") == "token_ids"
    many = parse_request({"model": MODEL, "prompt": ["a", [7, 8]], "max_tokens": 3}, COMPLETION).requests
    assert [r.WhichOneof("input") for r in many] == ["prompt", "token_ids"]
    assert many[0].prompt == "a" and list(many[1].token_ids.ids) == [7, 8]
    assert all(r.max_new_tokens == 3 for r in many)  # every prompt gets the request's parameters


def test_logprobs_parameters() -> None:
    chat_request = parse_request(chat(logprobs=True, top_logprobs=20), CHAT)
    assert chat_request.is_logprobs and chat_request.request.logprobs.num_top_logprobs == 20
    assert not chat_request.request.logprobs.include_prompt
    assert not parse_request(chat(logprobs=False), CHAT).request.HasField("logprobs")
    legacy = parse_request({"model": MODEL, "prompt": "a", "logprobs": 5, "echo": True}, COMPLETION)
    assert legacy.is_echo and legacy.request.logprobs.num_top_logprobs == 5 and legacy.request.logprobs.include_prompt
    assert refused({"model": MODEL, "prompt": "a", "logprobs": 6}, COMPLETION).param == "logprobs"
    assert refused({"model": MODEL, "prompt": "a", "logprobs": True}, COMPLETION).param == "logprobs"
    assert refused({"model": MODEL, "prompt": "a", "echo": 1}, COMPLETION).param == "echo"
    echo_only = parse_request({"model": MODEL, "prompt": "a", "echo": True}, COMPLETION)
    assert echo_only.is_echo and not echo_only.request.HasField("logprobs")


def test_a_body_that_is_not_one_json_object_is_a_400_saying_why() -> None:
    assert parse_body(b'{"a": 1}') == {"a": 1}
    for body, why in ((b"{", "not valid JSON"), (b"[1]", "must be a JSON object"), (b"\xff", "not valid JSON")):
        with pytest.raises(ApiError) as e:
            parse_body(body)
        error = e.value.to_json()["error"]
        assert e.value.status == 400 and why in error["message"] and error["param"] is None, (body, error)
        assert e.value.status == 400 and e.value.param is None
