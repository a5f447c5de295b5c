"""GenerateRequest -> GenerationParams: is_adaptive and what degree / draft length mean with it; response
formats and their refusals."""

from __future__ import annotations

import json

import grpc
import pytest

from gateway.config import Limits, SpeculationDefaults
from gateway.params import check_end_tokens, default_strategies, params_from_pb, response_format_from_pb
from specdec.errors import InvalidArgument
from specdec.service.interceptor import ErrorInterceptor
from specdec.task_type import TaskType
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.grpc_serving import serving

JSON_MODE = common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_JSON_OBJECT)
AT_LEAST_2, AT_LEAST_9 = common_pb2.SamplingParams(min_tokens=2), common_pb2.SamplingParams(min_tokens=9)
DEFAULTS = SpeculationDefaults(
    speculative_degree=1, draft_length=8, max_adaptive_degree=4, max_adaptive_draft_length=16
)


def speculation(defaults: SpeculationDefaults = DEFAULTS, **fields):
    req = gateway_pb2.GenerateRequest(prompt="hi", speculation=gateway_pb2.SpeculationConfig(**fields))
    return params_from_pb(req, Limits(), defaults).speculation


def test_adaptive_by_default_with_the_adaptive_bounds_when_the_request_sets_none():
    spec = speculation()
    assert spec.is_adaptive and (spec.speculative_degree, spec.draft_length) == (4, 16)


def test_the_requests_degree_and_draft_length_are_the_bounds_when_adaptive():
    spec = speculation(speculative_degree=2, draft_length=5)
    assert spec.is_adaptive and (spec.speculative_degree, spec.draft_length) == (2, 5)


def test_not_adaptive_keeps_the_fixed_settings_and_their_defaults():
    assert (speculation(is_adaptive=False).speculative_degree, speculation(is_adaptive=False).draft_length) == (1, 8)
    spec = speculation(is_adaptive=False, speculative_degree=3, draft_length=6)
    assert not spec.is_adaptive and (spec.speculative_degree, spec.draft_length) == (3, 6)
    off_by_flag = SpeculationDefaults(is_adaptive=False)
    assert not speculation(off_by_flag).is_adaptive and speculation(off_by_flag, is_adaptive=True).is_adaptive


def test_task_type_given_or_left_to_inference():
    assert speculation().task_type is None
    assert speculation(task_type=common_pb2.TASK_TYPE_CODE).task_type is TaskType.CODE
    with pytest.raises(InvalidArgument) as e:
        speculation(task_type=99)  # a newer client's type
    assert e.value.field == "speculation.task_type"


def fmt(type_, schema: str = ""):
    req = gateway_pb2.GenerateRequest(
        prompt="hi", response_format=common_pb2.ResponseFormat(type=type_, json_schema=schema)
    )
    return params_from_pb(req, Limits(), DEFAULTS)


def test_response_format_free_text_json_mode_and_schema():
    assert fmt(common_pb2.ResponseFormat.TYPE_UNSPECIFIED).response_format is None
    assert fmt(common_pb2.ResponseFormat.TYPE_TEXT).response_format is None
    json_mode = fmt(common_pb2.ResponseFormat.TYPE_JSON_OBJECT)
    assert json_mode.has_schema and json_mode.response_format.kind == "json_object"
    schema = fmt(common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, '{"type": "object"}')
    assert schema.response_format.schema_text == '{"type": "object"}'
    # A constrained request also drafts the grammar's forced text, first; a free one does not.
    assert schema.speculation.strategies[0] == "grammar"
    assert "grammar" not in fmt(common_pb2.ResponseFormat.TYPE_TEXT).speculation.strategies


@pytest.mark.parametrize(
    "type_, schema, field, words",
    [
        (common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, "", "response_format.json_schema", "is required"),
        (common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, "{not json", "response_format.json_schema", "not valid JSON"),
        (
            common_pb2.ResponseFormat.TYPE_JSON_SCHEMA,
            '{"type": "strange"}',
            "response_format.json_schema",
            "not a valid JSON Schema",
        ),
        (common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, "[1, 2]", "response_format.json_schema", "must be a JSON object"),
        (common_pb2.ResponseFormat.TYPE_TEXT, '{"type": "object"}', "response_format.json_schema", "must be empty"),
        (7, "", "response_format.type", "unknown"),
    ],
)
def test_bad_response_formats_are_refused_naming_the_problem(type_, schema, field, words):
    with pytest.raises(InvalidArgument) as e:
        fmt(type_, schema)
    assert e.value.field == field and words in str(e.value)


def test_grammar_drafts_without_a_response_format_are_refused():
    with pytest.raises(InvalidArgument) as e:
        speculation(strategies=["grammar"])
    assert e.value.field == "speculation.strategies"


def nested_schema(depth: int) -> str:
    """An object schema whose properties nest `depth` objects deep (about 2 JSON levels each)."""
    schema = '{"type": "string"}'
    for i in range(depth):
        schema = f'{{"type": "object", "properties": {{"p{i}": {schema}}}, "required": ["p{i}"]}}'
    return schema


def test_a_deeply_nested_schema_is_refused_naming_the_depth_limit():
    """Depth 150 (12 KB): refused by a scan before any recursive schema check or compile ran
    (those took 7-18 s of CPU, then failed INTERNAL with a RecursionError)."""
    with pytest.raises(InvalidArgument) as e:
        fmt(common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, nested_schema(150))
    assert e.value.field == "response_format.json_schema"
    assert "nests 301 levels deep, more than the limit of 64 (max_schema_depth)" in e.value.message
    assert fmt(common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, nested_schema(20)).response_format is not None


def test_json_nesting_depth_ignores_brackets_in_strings():
    from gateway.params import json_nesting_depth

    assert json_nesting_depth('{"a": [{"b": "[["}]}') == 3
    assert json_nesting_depth('{"a": "\\"{{{"}') == 1
    assert json_nesting_depth("[]") == 1 and json_nesting_depth('"x"') == 0


def test_strategies_the_pool_does_not_offer_are_refused_up_front():
    from gateway.params import check_offered

    offered = frozenset({"prompt_lookup", "suffix_index", "grammar"})
    check_offered(["prompt_lookup", "grammar"], offered)
    with pytest.raises(InvalidArgument) as e:
        check_offered(["prompt_lookup", "early_exit"], offered)
    assert e.value.field == "speculation.strategies"
    assert e.value.message == (
        "['early_exit'] are not offered by this deployment; offered: ['grammar', 'prompt_lookup', 'suffix_index']"
    )


def test_response_format_from_pb_defaults_to_the_limits_depth():
    """The default depth is Limits' 64 (a slots dataclass's class attribute is a slot descriptor, not it)."""
    deep = common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, json_schema=nested_schema(150))
    with pytest.raises(InvalidArgument, match="more than the limit of 64"):
        response_format_from_pb(deep)


def test_defaults_include_the_feature_drafter_only_when_the_pool_offers_it():
    def defaults(offered):
        req = gateway_pb2.GenerateRequest(prompt="hi")
        return params_from_pb(req, Limits(), SpeculationDefaults(), offered).speculation.strategies

    assert SpeculationDefaults().strategies == ("prompt_lookup", "suffix_index", "feature")
    assert defaults(frozenset({"prompt_lookup", "suffix_index", "feature"})) == (
        "prompt_lookup",
        "suffix_index",
        "feature",
    )
    assert defaults(frozenset({"prompt_lookup", "suffix_index", "lookahead"})) == ("prompt_lookup", "suffix_index")
    assert defaults(None) == ("prompt_lookup", "suffix_index")  # the pool not reached yet
    assert default_strategies(("prompt_lookup", "corpus"), frozenset({"prompt_lookup"})) == ("prompt_lookup", "corpus")


def test_a_request_naming_its_strategies_keeps_them_and_a_structured_one_drafts_the_grammar_first():
    offered = frozenset({"prompt_lookup", "suffix_index", "feature", "grammar"})
    req = gateway_pb2.GenerateRequest(
        prompt="hi", speculation=gateway_pb2.SpeculationConfig(strategies=["suffix_index"])
    )
    assert params_from_pb(req, Limits(), SpeculationDefaults(), offered).speculation.strategies == ("suffix_index",)
    structured = gateway_pb2.GenerateRequest(
        prompt="hi", response_format=common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_JSON_OBJECT)
    )
    spec = params_from_pb(structured, Limits(), SpeculationDefaults(), offered).speculation
    assert spec.strategies == ("grammar", "prompt_lookup", "suffix_index", "feature")


def test_ignore_eos_and_stop_token_ids_decide_the_tokens_that_end_the_output():
    def end(**fields):
        params = params_from_pb(gateway_pb2.GenerateRequest(prompt="hi", **fields), Limits(), DEFAULTS)
        return params.end_token_ids((2, 3))

    assert end() == {2, 3}
    assert end(ignore_eos=True) == set()
    assert end(stop_token_ids=[7, 3]) == {2, 3, 7}
    assert end(ignore_eos=True, stop_token_ids=[7]) == {7}


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
        ({"stop_token_ids": [5, -1]}, "stop_token_ids[1]", ">= 0"),
        ({"ignore_eos": True, "response_format": JSON_MODE}, "ignore_eos", "response_format"),
        ({"sampling": AT_LEAST_2, "response_format": JSON_MODE}, "sampling.min_tokens", "response_format"),
        ({"sampling": AT_LEAST_9, "max_new_tokens": 8}, "sampling.min_tokens", "at most max_new_tokens (8)"),
    ],
)
def test_bad_end_tokens_are_refused_naming_the_field(fields, field, words):
    with pytest.raises(InvalidArgument) as e:
        params_from_pb(gateway_pb2.GenerateRequest(prompt="hi", **fields), Limits(), DEFAULTS)
    assert e.value.field == field and words in str(e.value)


def test_min_tokens_holds_back_a_full_stop_list_and_the_models_end_tokens():
    """64 stop ids (the request limit) and the model's own end tokens fit what min_tokens holds back;
    more (a gateway whose operator raised the stop limit) are refused naming min_tokens."""
    req = gateway_pb2.GenerateRequest(prompt="hi", stop_token_ids=range(100, 164), sampling=AT_LEAST_2)
    params = params_from_pb(req, Limits(), DEFAULTS)
    check_end_tokens(params, (2, 3))
    assert len(params.sampling.holding_back(params.end_token_ids((2, 3)), 0).min_tokens_ids) == 66
    wide = gateway_pb2.GenerateRequest(prompt="hi", stop_token_ids=range(100, 228), sampling=AT_LEAST_2)
    with pytest.raises(InvalidArgument) as e:
        check_end_tokens(params_from_pb(wide, Limits(max_stop_token_ids=200), DEFAULTS), (2, 3))
    assert e.value.field == "sampling.min_tokens" and "at most 128" in str(e.value)


HUGE = "x" * (1 << 20)  # a 1 MiB value: quoted whole, its status message would pass any metadata limit


class CheckingGateway(gateway_pb2_grpc.GenerationServiceServicer):
    """Checks each request as the gateway does (params_from_pb), errors mapped by the ErrorInterceptor."""

    def Generate(self, request, context):  # noqa: ANN001, N802
        params_from_pb(request, Limits(), DEFAULTS)
        return gateway_pb2.GenerateResponse()


def _chat(role: str) -> gateway_pb2.ChatMessages:
    return gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=role, content="Hi")])


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(chat=_chat(HUGE)), "chat.messages[0].role"),
        (dict(prompt="hi", speculation=gateway_pb2.SpeculationConfig(strategies=[HUGE])), "speculation.strategies"),
        (dict(prompt="hi", tools=[gateway_pb2.Tool(name=HUGE)]), "tools[0].name"),
        (
            dict(
                prompt="hi",
                tools=[gateway_pb2.Tool(name="f")],
                tool_choice=gateway_pb2.ToolChoice(mode=gateway_pb2.ToolChoice.MODE_FUNCTION, function_name=HUGE),
            ),
            "tool_choice.function_name",
        ),
        (  # within the schema's 64K characters, a part the JSON Schema check's message quotes
            dict(
                prompt="hi",
                response_format=common_pb2.ResponseFormat(
                    type=common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, json_schema=json.dumps({"type": "x" * 60000})
                ),
            ),
            "response_format.json_schema",
        ),
    ],
)
def test_a_huge_value_is_an_invalid_argument_naming_its_field_over_grpc(fields: dict, field: str) -> None:
    """The message quotes the value's first characters and its length: quoted whole it went in the
    grpc-message trailer, which the client refused past its metadata limit, so the caller saw
    RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") for its own bad field."""
    add = gateway_pb2_grpc.add_GenerationServiceServicer_to_server
    with (
        serving(add, CheckingGateway(), [ErrorInterceptor()]) as address,
        grpc.insecure_channel(address) as channel,
    ):
        with pytest.raises(grpc.RpcError) as raised:
            gateway_pb2_grpc.GenerationServiceStub(channel).Generate(gateway_pb2.GenerateRequest(**fields), timeout=30)
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert error.details().startswith(f"{field}: ") and " characters)" in error.details()
    assert len(error.details()) < 500
