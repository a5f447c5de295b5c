"""A generation request, validated: GenerateRequest (protobuf) -> GenerationParams (domain).

Every field a caller controls is checked here, before anything is allocated, and a bad one
raises InvalidArgument naming the protobuf field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any

from gateway.config import Limits, SpeculationDefaults
from gateway.json_depth import json_nesting_depth
from gateway.tool_prompt import ChatTurn, render
from gateway.tools import ToolSpec, tool_calls_from_pb, tool_spec_from_pb
from specdec import pb
from specdec.acceptance_mode import check_threshold
from specdec.errors import InvalidArgument, quoted
from specdec.grammar.compiler import JSON_SCHEMA, SCHEMA_FIELD, ResponseFormat, check_schema_text
from specdec.logprobs import LogprobsRequest
from specdec.model.tokenizer import check_stop_strings
from specdec.sampling import MAX_MIN_TOKENS_IDS, SamplingParams
from specdec.speculation_bounds import range_error
from specdec.strategies import DEFAULTS_WHEN_OFFERED, GRAMMAR_STRATEGY, PREDICTION_STRATEGY
from specdec.strategies import NAMES as STRATEGY_NAMES
from specdec.task_type import TaskType
from specdec.task_type import from_pb as task_type_from_pb
from specdec.v1 import common_pb2, gateway_pb2

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculationParams:
    is_enabled: bool
    speculative_degree: int  # fixed; an upper bound when is_adaptive
    draft_length: int  # fixed; an upper bound when is_adaptive
    acceptance_threshold: float
    strategies: tuple[str, ...]
    task_type: TaskType | None  # None: inferred from the prompt
    is_adaptive: bool = False  # the controller chooses decoders and draft length per step


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationParams:
    prompt: str | None
    messages: tuple[ChatTurn, ...] | None
    max_new_tokens: int
    stop: tuple[str, ...]
    sampling: SamplingParams
    speculation: SpeculationParams
    response_format: ResponseFormat | None = None  # None: free text (or a forced tool call's schema)
    tools: ToolSpec = ToolSpec()
    prompt_token_ids: tuple[int, ...] | None = None  # a tokenized prompt (then prompt and messages are None)
    logprobs: LogprobsRequest | None = None  # None: no log probabilities
    prediction: str | None = None  # the predicted output (Predicted Outputs); None: none
    ignore_eos: bool = False  # the model's end-of-sequence tokens do not end the output
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the output (finish reason stop)

    def end_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """The tokens that end the output: the model's end-of-sequence ones (unless ignore_eos) and
        stop_token_ids."""
        return frozenset(() if self.ignore_eos else eos_token_ids) | frozenset(self.stop_token_ids)

    @property
    def has_schema(self) -> bool:
        """The output is constrained to JSON (a structured task)."""
        return self.response_format is not None

    def prompt_text(self, tokenizer: Any) -> str:
        if self.prompt_token_ids is not None:
            return tokenizer.decode(self.prompt_token_ids)
        if self.messages is None:
            assert self.prompt is not None  # a request has a prompt or messages (_input_from_pb)
            return self.prompt
        return render(tokenizer, self.messages, self.tools.tools)


def params_from_pb(
    req: gateway_pb2.GenerateRequest,
    limits: Limits,
    defaults: SpeculationDefaults,
    offered: frozenset[str] | None = None,
) -> GenerationParams:
    """The request's checked parameters; `offered`: the draft pool's strategies (None: unknown), which
    decide the defaults of a request that names none (default_strategies)."""
    prompt, messages, prompt_token_ids = _input_from_pb(req, limits)
    max_new_tokens = _max_new_tokens_from_pb(req, limits)
    check_stop_strings(req.stop, "stop", limits.max_stop_strings, limits.max_stop_chars)
    sampling = pb.sampling_from_pb(req.sampling)
    tools = tool_spec_from_pb(req, limits.max_schema_depth)
    response_format = response_format_from_pb(req.response_format, limits.max_schema_depth)
    if tools.is_forced:  # the calls are generated under their schema, like a json_schema response format
        response_format = ResponseFormat(JSON_SCHEMA, tools.call_schema())
    prediction = _prediction_from_pb(req, limits)
    speculation = _speculation_from_pb(
        req.speculation,
        limits,
        defaults,
        is_structured=response_format is not None,
        offered=offered,
        has_prediction=prediction is not None,
    )
    logprobs = pb.logprobs_request_from_pb(req.logprobs) if req.HasField("logprobs") else None
    for name, is_asked in (("ignore_eos", req.ignore_eos), ("sampling.min_tokens", sampling.min_tokens > 0)):
        if is_asked and response_format is not None:
            field = "response_format" if req.HasField("response_format") else "tool_choice"
            raise InvalidArgument(
                name, f"cannot be combined with {field}: a finished grammar allows only the end of the sequence"
            )
    if sampling.min_tokens > max_new_tokens:
        raise InvalidArgument(
            "sampling.min_tokens", f"must be at most max_new_tokens ({max_new_tokens}), got {sampling.min_tokens}"
        )
    _check_stop_token_ids(req.stop_token_ids, limits)
    return GenerationParams(
        prompt,
        messages,
        max_new_tokens,
        tuple(req.stop),
        sampling,
        speculation,
        response_format,
        tools=tools,
        prompt_token_ids=prompt_token_ids,
        logprobs=logprobs,
        prediction=prediction,
        ignore_eos=req.ignore_eos,
        stop_token_ids=tuple(req.stop_token_ids),
    )


def _max_new_tokens_from_pb(req: gateway_pb2.GenerateRequest, limits: Limits) -> int:
    """max_new_tokens within its limit (the default when unset)."""
    max_new_tokens = limits.default_max_new_tokens
    if req.HasField("max_new_tokens"):
        max_new_tokens = req.max_new_tokens
        if not 1 <= max_new_tokens <= limits.max_new_tokens:
            raise InvalidArgument("max_new_tokens", f"must be in [1, {limits.max_new_tokens}], got {max_new_tokens}")
    return max_new_tokens


def check_end_tokens(params: GenerationParams, eos_token_ids: Iterable[int]) -> None:
    """min_tokens can hold back all of the request's end tokens (its stop_token_ids and the model's
    end-of-sequence ones): at most MAX_MIN_TOKENS_IDS of them."""
    num_ids = len(params.end_token_ids(eos_token_ids))
    if params.sampling.min_tokens and num_ids > MAX_MIN_TOKENS_IDS:
        raise InvalidArgument(
            "sampling.min_tokens",
            f"holds back at most {MAX_MIN_TOKENS_IDS} end tokens; this request has {num_ids} (stop_token_ids and EOS)",
        )


def _check_stop_token_ids(ids: Sequence[int], limits: Limits) -> None:
    """At most limits.max_stop_token_ids ids, none negative (their range's top is the vocabulary's,
    which the server checks, as for a prompt's ids)."""
    if len(ids) > limits.max_stop_token_ids:
        raise InvalidArgument("stop_token_ids", f"at most {limits.max_stop_token_ids} token ids, got {len(ids)}")
    for i, t in enumerate(ids):
        if t < 0:
            raise InvalidArgument(f"stop_token_ids[{i}]", f"must be a token id >= 0, got {t}")


def _prediction_from_pb(req: gateway_pb2.GenerateRequest, limits: Limits) -> str | None:
    """The predicted output's text, or None; an empty one or one past the limit is refused."""
    if not req.HasField("prediction"):
        return None
    content = req.prediction.content
    if not content:
        raise InvalidArgument("prediction.content", "must not be empty (leave prediction unset for none)")
    if len(content) > limits.max_prediction_chars:
        raise InvalidArgument("prediction.content", f"longer than {limits.max_prediction_chars} characters")
    return content


def response_format_from_pb(
    pb_format: common_pb2.ResponseFormat, max_schema_depth: int = Limits().max_schema_depth
) -> ResponseFormat | None:
    """None for free text; else a checked format (not nested deeper than max_schema_depth, the
    schema parses and is a valid JSON Schema). Compiling it into a grammar is the server's (it
    takes a deadline)."""
    response_format = pb.response_format_from_pb(pb_format)
    if response_format is not None and response_format.schema_text is not None:
        depth = json_nesting_depth(response_format.schema_text)
        if depth > max_schema_depth:
            raise InvalidArgument(
                SCHEMA_FIELD, f"nests {depth} levels deep, more than the limit of {max_schema_depth} (max_schema_depth)"
            )
        check_schema_text(response_format.schema_text)
    return response_format


def check_offered(requested: Sequence[str], offered: frozenset[str]) -> None:
    """Refuse strategies a request names that the draft pool was not started with, before anything
    runs (adaptive requests ignored them silently, others failed mid-request)."""
    missing = [s for s in requested if s not in offered]
    if missing:
        raise InvalidArgument(
            "speculation.strategies", f"{missing} are not offered by this deployment; offered: {sorted(offered)}"
        )


def _input_from_pb(req: gateway_pb2.GenerateRequest, limits: Limits):
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidArgument("prompt", "give a prompt or chat messages")
    if which == "prompt":
        if not req.prompt.strip():
            raise InvalidArgument("prompt", "must not be empty")
        if len(req.prompt) > limits.max_prompt_chars:
            raise InvalidArgument("prompt", f"longer than {limits.max_prompt_chars} characters")
        return req.prompt, None, None
    if which == "token_ids":
        # the ids' range is the vocabulary's, which the server checks (GenerationServicer._prepare)
        if not req.token_ids.ids:
            raise InvalidArgument("token_ids.ids", "must not be empty")
        return None, None, tuple(req.token_ids.ids)
    messages = req.chat.messages
    if not messages:
        raise InvalidArgument("chat.messages", "must not be empty")
    if len(messages) > limits.max_chat_messages:
        raise InvalidArgument("chat.messages", f"at most {limits.max_chat_messages} messages")
    num_chars = sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in messages)
    if num_chars > limits.max_prompt_chars:
        raise InvalidArgument("chat.messages", f"longer than {limits.max_prompt_chars} characters in all")
    turns = tuple(_turn_from_pb(m, f"chat.messages[{i}]") for i, m in enumerate(messages))
    if not any(t.content.strip() or t.tool_calls for t in turns):
        raise InvalidArgument("chat.messages", "every message is empty")
    return None, turns, None


def _turn_from_pb(m: gateway_pb2.ChatMessage, field: str) -> ChatTurn:
    if m.role not in CHAT_ROLES:
        raise InvalidArgument(f"{field}.role", f"must be one of {CHAT_ROLES}, got {quoted(m.role)}")
    if m.tool_calls and m.role != "assistant":
        raise InvalidArgument(f"{field}.tool_calls", f"only assistant turns call tools, this one is {quoted(m.role)}")
    if m.role == "tool" and not m.tool_call_id:
        raise InvalidArgument(f"{field}.tool_call_id", "is required in a tool turn: the id of the call it answers")
    if m.role != "tool" and (m.tool_call_id or m.name):
        raise InvalidArgument(
            f"{field}.tool_call_id" if m.tool_call_id else f"{field}.name", "is only allowed in a tool turn"
        )
    calls = tool_calls_from_pb(m.tool_calls, f"{field}.tool_calls")
    return ChatTurn(m.role, m.content, calls, m.tool_call_id, m.name)


def default_strategies(configured: Sequence[str], offered: frozenset[str] | None) -> tuple[str, ...]:
    """The strategies of a request that names none: the configured defaults, less those a draft pool
    offers only where it can (specdec.strategies.DEFAULTS_WHEN_OFFERED: a feature drafter whose file
    loads for the attached model) unless the pool lists them. While the pool's offer is unknown
    (`offered` None: not reached yet) they are left out. The cost model then decides, step by step,
    whether a default that is offered runs.

    # E.g. configured (prompt_lookup, suffix_index, feature): offered {prompt_lookup, suffix_index}
    #   -> (prompt_lookup, suffix_index); offered {..., feature} -> all three; None -> the first two
    """
    return tuple(s for s in configured if s not in DEFAULTS_WHEN_OFFERED or (offered is not None and s in offered))


def _speculation_from_pb(
    spec: gateway_pb2.SpeculationConfig,
    limits: Limits,
    defaults: SpeculationDefaults,
    is_structured: bool = False,
    offered: frozenset[str] | None = None,
    has_prediction: bool = False,
) -> SpeculationParams:
    is_enabled = spec.is_enabled if spec.HasField("is_enabled") else defaults.is_enabled
    is_adaptive = spec.is_adaptive if spec.HasField("is_adaptive") else defaults.is_adaptive
    degree = spec.speculative_degree or (
        min(defaults.max_adaptive_degree, limits.max_speculative_degree) if is_adaptive else defaults.speculative_degree
    )
    if error := range_error(degree, 1, limits.max_speculative_degree):
        raise InvalidArgument("speculation.speculative_degree", error)
    # A prediction is mostly right and drafts long: up to the limit, unless the request says otherwise.
    draft_length = spec.draft_length or (
        limits.max_draft_length
        if has_prediction
        else min(defaults.max_adaptive_draft_length, limits.max_draft_length)
        if is_adaptive
        else defaults.draft_length
    )
    if error := range_error(draft_length, 1, limits.max_draft_length):
        raise InvalidArgument("speculation.draft_length", error)
    threshold = float(spec.acceptance_threshold)
    try:
        check_threshold(threshold)
    except ValueError as e:
        raise InvalidArgument("speculation.acceptance_threshold", str(e)) from None
    # A constrained output also drafts what the grammar forces, first: it is free and exact.
    configured = default_strategies(defaults.strategies, offered)
    strategies = tuple(spec.strategies) or (
        (GRAMMAR_STRATEGY, *configured) if is_structured and GRAMMAR_STRATEGY not in configured else configured
    )
    for s in strategies:
        if s not in STRATEGY_NAMES:
            raise InvalidArgument("speculation.strategies", f"unknown strategy {quoted(s)}; known: {STRATEGY_NAMES}")
    if GRAMMAR_STRATEGY in strategies and not is_structured:
        raise InvalidArgument(
            "speculation.strategies",
            f"{GRAMMAR_STRATEGY!r} drafts need a response_format (TYPE_JSON_OBJECT or TYPE_JSON_SCHEMA)",
        )
    if PREDICTION_STRATEGY in strategies and not has_prediction:
        raise InvalidArgument("speculation.strategies", f"{PREDICTION_STRATEGY!r} drafts need a prediction")
    if has_prediction and PREDICTION_STRATEGY not in strategies and (offered is None or PREDICTION_STRATEGY in offered):
        # A prediction drafts first, beside the other decoders (the controller weighs them all);
        # a draft pool that does not offer it leaves the request as it was.
        strategies = (PREDICTION_STRATEGY, *strategies)
    try:
        task_type = task_type_from_pb(spec.task_type)
    except ValueError as e:
        raise InvalidArgument("speculation.task_type", str(e)) from None
    return SpeculationParams(is_enabled, degree, draft_length, threshold, strategies, task_type, is_adaptive)


def params_to_json(req: gateway_pb2.GenerateRequest) -> dict:
    """The request as stored in the state store (protobuf JSON), to rebuild it on recovery."""
    from google.protobuf import json_format

    return json.loads(json_format.MessageToJson(req, preserving_proto_field_name=True))


def params_pb_from_json(d: dict) -> gateway_pb2.GenerateRequest:
    from google.protobuf import json_format

    return json_format.ParseDict(d, gateway_pb2.GenerateRequest())
