"""An OpenAI request body -> GenerateRequest (protobuf).

Only the HTTP shape is checked here: types, the OpenAI spellings, what the protobuf can hold
(a negative seed cannot be a uint64), OpenAI's own ranges where they are narrower than the gRPC
API's (temperature in [0, 2]), and OpenAI features this service does not have (the legacy
`functions`, `best_of`), each a 400 naming the parameter; tools' shapes in http_svc.openai_tools. Whether a
value is in range (a top_p, a penalty, a stop list, a schema, a strategy, a tool's name) is the
gateway's to say, once for every client: its INVALID_ARGUMENT comes back as a 400 naming the same
parameter (http_svc.errors).

Log probabilities: chat's `logprobs: bool` + `top_logprobs: 0..20`; completions' `logprobs:
0..5` (the legacy shape) and `echo: true` (the prompt's text and, with logprobs, its tokens' log
probabilities before the completion's; its first token has none). A completion's `prompt` may be a
string, token ids, or a list of either (up to MAX_PROMPTS): each prompt is a request of its own,
its answer the choice of that index (not with `stream`).

Several choices (`n`, 1..MAX_CHOICES, OpenAI's default 1): each choice is a request of its own,
run side by side, prompt-major (a completion's prompt p has choices p * n .. p * n + n - 1, as
OpenAI numbers them). With a `seed`, choice j samples with seed + j (mod 2^64): the choices differ
and each is reproducible alone; without one, each draws its own. Greedy choices are the same text.
Streamed, the choices' chunks interleave, each with its index; the usage counts a prompt once.

Sampling controls (specdec.penalties, specdec.sampling): temperature, top_p, seed, and
frequency_penalty, presence_penalty, logit_bias (OpenAI), with vLLM's extras top_k, min_p and
repetition_penalty. Penalties count output tokens only; repetition_penalty counts the prompt too.
vLLM's ignore_eos (answers of a set length, as benchmarks ask), stop_token_ids and min_tokens ride
along too.

Fields that change nothing are accepted, as vLLM accepts them, and named in the response header
IGNORED_FIELDS_HEADER: OpenAI's that do not apply here (_IGNORED: user, store, metadata, ...) and
any field neither API knows (also logged as a warning).

Predicted Outputs (`prediction: {"type": "content", "content": str | text parts}`) become
GenerateRequest.prediction: the prediction decoder drafts from it, the output is unchanged.

Speculation settings ride as extra body fields (the OpenAI SDKs send them with `extra_body`):

    {"model": "...", "messages": [...], "speculative_decoding": true, "speculative_degree": 4,
     "draft_length": 8, "acceptance_threshold": 0.0, "strategies": ["prompt_lookup"]}
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from http_svc.errors import bad_request, json_text, shown
from http_svc.openai_tools import set_tool_calls, set_tools
from specdec.errors import quoted, shortened
from specdec.proto_ranges import MAX_INT32, MAX_UINT32, MAX_UINT64
from specdec.speculation_bounds import MAX_REQUEST_DRAFT_LENGTH, MAX_REQUEST_SPECULATIVE_DEGREE
from specdec.v1 import common_pb2, gateway_pb2

CHAT, COMPLETION = "chat", "completion"
# OpenAI's default temperature when a request gives none (the gRPC API's default is greedy).
DEFAULT_TEMPERATURE = 1.0
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
MAX_PROMPTS = 64  # prompts one completions request may batch (each runs as a request of its own)
MAX_CHOICES = 64  # choices one request may ask for: n times its prompts (each choice a request of its own)
# "developer" is OpenAI's newer name for the system turn.
_ROLE_ALIASES = {"developer": "system"}
# OpenAI parameters this service does not implement: refused unless given their neutral value.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
}
# OpenAI parameters accepted and without effect here (named in IGNORED_FIELDS_HEADER when given):
# identifiers and storage of the caller's (user, metadata, store, safety_identifier,
# prompt_cache_key), a processing tier (service_tier: one tier here), and options of reasoning
# models (reasoning_effort, verbosity), which the served model is not.
_IGNORED = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "verbosity",
    "prompt_cache_key",
    "safety_identifier",
)
# The parameters this service reads, by endpoint (every one parse_request passes on: a field read but
# left out here would be named ignored while it changes the answer); what a body holds beyond these,
# _UNSUPPORTED and _IGNORED is unknown: accepted, ignored and named in IGNORED_FIELDS_HEADER.
_COMMON_FIELDS = frozenset(
    {
        "model", "n", "max_tokens", "stop", "stream", "stream_options", "temperature", "top_p", "top_k", "seed",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "logit_bias", "response_format",
        "return_token_ids", "speculative_decoding", "adaptive", "speculative_degree", "draft_length",
        "acceptance_threshold", "strategies", "ignore_eos", "stop_token_ids", "min_tokens", "logprobs", "tools",
        "tool_choice", "parallel_tool_calls", "prediction",
    }
)  # fmt: skip
_FIELDS = {
    CHAT: _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"},
    COMPLETION: _COMMON_FIELDS | {"prompt", "echo"},
}
IGNORED_FIELDS_HEADER = "x-specdec-ignored-fields"
MAX_IGNORED_NAMED = 32  # fields the header names at most (a body may hold thousands)
MAX_TEMPERATURE = 2.0  # OpenAI's range of temperature is [0, 2]
MAX_ABS_PENALTY = 2.0  # OpenAI's range of frequency_penalty and presence_penalty is [-2, 2]
# What a surrogate in the body looks like: an escape of one (\ud800-\udfff), or one encoded as
# UTF-8 (0xED 0xA0-0xBF ..., which json.loads lets through). A body without either holds none.
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_RESPONSE_FORMATS = {
    "text": common_pb2.ResponseFormat.TYPE_TEXT,
    "json_object": common_pb2.ResponseFormat.TYPE_JSON_OBJECT,
    "json_schema": common_pb2.ResponseFormat.TYPE_JSON_SCHEMA,
}


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str  # CHAT or COMPLETION
    model: str
    # One per choice, prompt-major: choice i answers requests[i], of prompt i // num_choices.
    requests: tuple[gateway_pb2.GenerateRequest, ...]
    is_stream: bool
    is_usage_streamed: bool  # stream_options.include_usage: a last chunk with the usage
    is_returning_token_ids: bool  # extra field return_token_ids: each choice carries its token ids
    # Gateway fields whose OpenAI name depends on the request: {"max_new_tokens": "max_tokens"}.
    param_aliases: dict[str, str]
    is_logprobs: bool = False  # the answer carries log probabilities (chat: content; completions: legacy)
    num_top_logprobs: int = 0  # alternatives per token
    is_echo: bool = False  # completions: the prompt comes first in the text (and in the logprobs)
    # The body's fields that had no effect, in body order: OpenAI's ignored ones, then unknown ones.
    ignored_fields: tuple[str, ...] = ()
    unknown_fields: tuple[str, ...] = ()  # of those, the ones no API defines
    num_choices: int = 1  # `n`: choices per prompt

    @property
    def request(self) -> gateway_pb2.GenerateRequest:
        """The first request (with one prompt and n = 1, the only one)."""
        return self.requests[0]

    @property
    def prompt_requests(self) -> tuple[gateway_pb2.GenerateRequest, ...]:
        """The first choice's request of each prompt."""
        return self.requests[:: self.num_choices]


def parse_body(body: bytes) -> dict[str, Any]:
    """The body's JSON object. Refused with a 400: bytes that are not JSON, JSON nested deeper than
    the parser recurses, a number past int()'s digit limit, and a lone surrogate in any string
    (JSON's "\\ud800" escape decodes to one; it is not a character, and neither the protobuf nor the
    answer's UTF-8 can carry it)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(None, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request(None, "the body is nested too deeply to parse") from None
    except ValueError as e:  # an integer of more digits than sys.get_int_max_str_digits()
        raise bad_request(None, f"the body is not acceptable JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(None, "the body must be a JSON object")
    param = _lone_surrogate_at(data) if _may_hold_lone_surrogate(body, data) else None
    if param is not None:
        raise bad_request(param, "must be valid Unicode: a lone surrogate (e.g. \\ud800) is not a character")
    return data


def _may_hold_lone_surrogate(body: bytes, data: dict[str, Any]) -> bool:
    """Checks at C speed before _lone_surrogate_at walks every value in Python (a 4 MiB body of
    small numbers takes it ~0.5 s): no surrogate in the bytes, or none left unpaired once decoded."""
    if not _SURROGATE_BYTES.search(body):
        return False
    try:
        return not _is_encodable(json.dumps(data, ensure_ascii=False))
    except RecursionError:  # nested about as deep as the parser allows: the walk is iterative
        return True


def _lone_surrogate_at(data: dict[str, Any]) -> str | None:
    """The parameter path of a string (value or key) with a lone surrogate, e.g.
    "messages[0].content"; None when there is none. Iterative: the body may nest as deep as the
    parser allowed."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if not _is_encodable(value):
                return path
        elif isinstance(value, list):
            pending.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_encodable(key):  # named escaped, so that the error can name it
                    key = key.encode("utf-8", "backslashreplace").decode()
                    return f"{path}.{key}" if path else key
                pending.append((f"{path}.{key}" if path else key, item))
    return None


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_request(data: dict[str, Any], kind: str) -> ParsedRequest:
    """The GenerateRequest of a /v1/chat/completions (CHAT) or /v1/completions (COMPLETION) body."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "is required: the id of a model /v1/models lists")
    for name, neutral in _UNSUPPORTED.items():
        if data.get(name) not in neutral:
            raise bad_request(name, "is not supported by this server")
    num_choices = 1 if data.get("n") is None else _integer(data["n"], "n", MAX_CHOICES, minimum=1)
    request = gateway_pb2.GenerateRequest()
    if kind == CHAT:
        _set_messages(request, data.get("messages"))
    aliases = _set_max_new_tokens(request, data)
    request.stop.extend(_stop(data.get("stop")))
    request.ignore_eos = _boolean(data.get("ignore_eos"), "ignore_eos", False)
    if data.get("stop_token_ids") is not None:
        request.stop_token_ids.extend(_stop_token_ids(data["stop_token_ids"]))
    _set_sampling(request.sampling, data)
    _set_response_format(request.response_format, data.get("response_format"))
    set_tools(request, data)
    _set_prediction(request, data.get("prediction"))
    _set_speculation(request.speculation, data)
    if data.get("user") is not None and not isinstance(data["user"], str):
        raise bad_request("user", "must be a string")
    is_stream, include_usage = _stream(data)
    is_logprobs, num_top = _logprobs(data, kind)
    is_echo = kind == COMPLETION and _boolean(data.get("echo"), "echo", False)
    if is_logprobs:
        aliases["logprobs.num_top_logprobs"] = "top_logprobs" if kind == CHAT else "logprobs"
        request.logprobs.num_top_logprobs = num_top
        request.logprobs.include_prompt = is_echo
    requests = (request,) if kind == CHAT else _prompt_requests(request, data.get("prompt"))
    if len(requests) > 1 and is_stream:
        raise bad_request("prompt", "several prompts cannot be streamed: send one request per prompt")
    if len(requests) * num_choices > MAX_CHOICES:
        raise bad_request(
            "n", f"n times the prompts must be at most {MAX_CHOICES}, got {num_choices} x {len(requests)}"
        )
    unknown = tuple(k for k in data if k not in _FIELDS[kind] and k not in _UNSUPPORTED and k not in _IGNORED)
    return ParsedRequest(
        kind,
        model,
        _choice_requests(requests, num_choices),
        is_stream,
        include_usage,
        _boolean(data.get("return_token_ids"), "return_token_ids", False),
        aliases,
        is_logprobs,
        num_top,
        is_echo,
        tuple(k for k in data if k in _IGNORED and data[k] is not None) + unknown,
        unknown,
        num_choices,
    )


def _choice_requests(
    prompts: tuple[gateway_pb2.GenerateRequest, ...], num_choices: int
) -> tuple[gateway_pb2.GenerateRequest, ...]:
    """num_choices requests per prompt request, prompt-major; choice j of a seeded request samples
    with seed + j (mod 2^64)."""
    if num_choices == 1:
        return prompts
    requests = []
    for prompt in prompts:
        for j in range(num_choices):
            request = gateway_pb2.GenerateRequest()
            request.CopyFrom(prompt)
            if prompt.sampling.HasField("seed"):
                request.sampling.seed = (prompt.sampling.seed + j) % (MAX_UINT64 + 1)
            requests.append(request)
    return tuple(requests)


def _logprobs(data: dict[str, Any], kind: str) -> tuple[bool, int]:
    """(log probabilities asked, alternatives per token). Chat: `logprobs` true/false and
    `top_logprobs` 0..20, which needs `logprobs` true; completions: `logprobs` 0..5 or null."""
    if kind == COMPLETION:
        if data.get("top_logprobs") is not None:
            raise bad_request("top_logprobs", "is a chat completions parameter; completions take logprobs: 0..5")
        value = data.get("logprobs")
        if value is None:
            return False, 0
        return True, _integer(value, "logprobs", MAX_COMPLETION_LOGPROBS)
    is_logprobs = _boolean(data.get("logprobs"), "logprobs", False)
    if data.get("top_logprobs") is None:
        return is_logprobs, 0
    num_top = _integer(data["top_logprobs"], "top_logprobs", MAX_TOP_LOGPROBS)
    if not is_logprobs:
        raise bad_request("top_logprobs", "needs logprobs: true")
    return True, num_top


def ignored_fields_header(fields: tuple[str, ...]) -> str:
    """The IGNORED_FIELDS_HEADER value: the names comma-separated, each escaped to printable ASCII
    (a body's key may hold anything, a header may not) and shortened (specdec.errors.shortened: a
    client refuses a response whose headers pass its limit, 16 KiB for h11, httpx's), at most
    MAX_IGNORED_NAMED of them. E.g. ("foo", "a\nb") -> 'foo, a\\nb'."""
    named = [shortened(json.dumps(f)[1:-1]) for f in fields[:MAX_IGNORED_NAMED]]
    if len(fields) > MAX_IGNORED_NAMED:
        named.append(f"... {len(fields) - MAX_IGNORED_NAMED} more")
    return ", ".join(named)


def _set_messages(request: gateway_pb2.GenerateRequest, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "must be a non-empty array of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str):
            raise bad_request(f"messages[{i}].role", "must be a string")
        if message.get("function_call") is not None:
            raise bad_request(
                f"messages[{i}].function_call", "the legacy function_call is not supported: use tool_calls"
            )
        turn = request.chat.messages.add(
            role=_ROLE_ALIASES.get(role, role), content=_content(message.get("content"), f"messages[{i}].content")
        )
        set_tool_calls(turn, message, f"messages[{i}]")


def _content(content: Any, param: str) -> str:
    """A message's text: a string, or text parts ({"type": "text", "text": ...}) joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(param, "must be a string or an array of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request(
                f"{param}[{j}].type", 'only text parts ({"type": "text", "text": ...}) are supported by this server'
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{j}].text", "must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _prompt_requests(template: gateway_pb2.GenerateRequest, prompt: Any) -> tuple[gateway_pb2.GenerateRequest, ...]:
    """One request per prompt: a string, token ids, or a non-empty list of strings or of token id
    lists. E.g. "a" -> 1; [1, 2] -> 1 (ids); ["a", "b"] -> 2; [[1, 2], [3]] -> 2."""
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad_request("prompt", "is required: a string, token ids, or a non-empty array of either")
    if len(prompts) > MAX_PROMPTS:
        raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    requests = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        request = gateway_pb2.GenerateRequest()
        request.CopyFrom(template)
        if isinstance(p, str):
            request.prompt = p
        else:
            request.token_ids.ids.extend(_token_ids(p, param))
        requests.append(request)
    return tuple(requests)


def _token_ids(value: Any, param: str) -> list[int]:
    """A non-empty list of token ids (their range is the vocabulary's, which the gateway checks)."""
    if not isinstance(value, list) or not value:
        raise bad_request(param, "must be a string or a non-empty array of token ids")
    for j, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad_request(f"{param}[{j}]", f"must be a token id (an integer), got {shown(t, f'{param}[{j}]')}")
        if not 0 <= t <= MAX_INT32:
            raise bad_request(f"{param}[{j}]", f"must be a token id in [0, {MAX_INT32}], got {t}")
    return value


def _stop_token_ids(value: Any) -> list[int]:
    """vLLM's stop_token_ids: token ids, maybe none (how many, and their range, are the gateway's to
    check)."""
    if not isinstance(value, list):
        raise bad_request("stop_token_ids", "must be an array of token ids")
    return _token_ids(value, "stop_token_ids") if value else []


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop", "must be a string or an array of strings")
    return stop


def _set_sampling(sampling: common_pb2.SamplingParams, data: dict[str, Any]) -> None:
    temperature = data.get("temperature")
    sampling.temperature = DEFAULT_TEMPERATURE if temperature is None else _number(temperature, "temperature")
    if not 0.0 <= sampling.temperature <= MAX_TEMPERATURE:
        raise bad_request("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if data.get("top_p") is not None:
        sampling.top_p = _number(data["top_p"], "top_p")
    if data.get("top_k") is not None:
        top_k = _integer(data["top_k"], "top_k", MAX_UINT32)
        if top_k > (1 << 31) - 1:
            raise bad_request("top_k", f"must fit a 32-bit integer, got {top_k}")
        sampling.top_k = top_k
    if data.get("seed") is not None:
        sampling.seed = _integer(data["seed"], "seed", MAX_UINT64)
    if data.get("min_tokens") is not None:  # vLLM's: its range against max_tokens is the gateway's
        sampling.min_tokens = _integer(data["min_tokens"], "min_tokens", MAX_UINT32)
    _set_penalties(sampling, data)


def _set_penalties(sampling: common_pb2.SamplingParams, data: dict[str, Any]) -> None:
    """frequency_penalty, presence_penalty (OpenAI), repetition_penalty, min_p (vLLM) and logit_bias;
    their ranges are the gateway's to check (SamplingParams), but for OpenAI's [-2, 2], checked here
    on the exact number before the protobuf's float32 rounds it."""
    for name in ("frequency_penalty", "presence_penalty"):
        if data.get(name) is not None:
            value = _number(data[name], name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise bad_request(name, f"must be in [-2, 2], got {data[name]}")
            setattr(sampling, name, value)
    if data.get("repetition_penalty") is not None:
        sampling.repetition_penalty = _number(data["repetition_penalty"], "repetition_penalty")
    if data.get("min_p") is not None:
        sampling.min_p = _number(data["min_p"], "min_p")
    bias = data.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad_request("logit_bias", 'must be an object of token id -> bias, e.g. {"1234": -100}')
    for key, value in bias.items():
        # The digits' count is checked before int(), which raises past 4300 digits (leading zeros too).
        digits = key.lstrip("0") if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if digits is None or len(digits) > len(str(MAX_INT32)) or int(digits or "0") > MAX_INT32:
            raise bad_request("logit_bias", f"keys must be token ids (decimal integers >= 0), got {quoted(key)}")
        sampling.logit_bias[int(digits or "0")] = _number(value, "logit_bias")


def _set_response_format(response_format: common_pb2.ResponseFormat, value: Any) -> None:
    if value is None:
        return
    # A type that is not a string (a list: unhashable) is never a dict key to look up.
    if not isinstance(value, dict) or not isinstance(value.get("type"), str) or value["type"] not in _RESPONSE_FORMATS:
        raise bad_request("response_format.type", f"must be one of {list(_RESPONSE_FORMATS)}")
    response_format.type = _RESPONSE_FORMATS[value["type"]]
    if value["type"] != "json_schema":
        return
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema", "must be an object with name and schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request("response_format.json_schema.name", "is required: a string")
    _boolean(spec.get("strict"), "response_format.json_schema.strict", False)  # the output always follows it
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema", "is required: a JSON Schema object")
    response_format.json_schema = json_text(schema, "response_format.json_schema.schema")


def _set_prediction(request: gateway_pb2.GenerateRequest, value: Any) -> None:
    """OpenAI's `prediction`: {"type": "content", "content": a string or text parts}. Its size limit
    and an empty content are the gateway's to refuse (prediction.content)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_request("prediction", 'must be an object {"type": "content", "content": ...}')
    if value.get("type") != "content":
        raise bad_request("prediction.type", f'must be "content", got {shown(value.get("type"), "prediction.type")}')
    if "content" not in value or value["content"] is None:
        raise bad_request("prediction.content", "is required: a string or an array of text parts")
    request.prediction.content = _content(value["content"], "prediction.content")


def _set_speculation(speculation: gateway_pb2.SpeculationConfig, data: dict[str, Any]) -> None:
    if data.get("speculative_decoding") is not None:
        speculation.is_enabled = _boolean(data["speculative_decoding"], "speculative_decoding", True)
    if data.get("adaptive") is not None:
        speculation.is_adaptive = _boolean(data["adaptive"], "adaptive", True)
    # The gateway's request bounds, checked here already so that a 400 names the field before any
    # RPC; 0 leaves the gateway's default.
    for name, maximum in (
        ("speculative_degree", MAX_REQUEST_SPECULATIVE_DEGREE),
        ("draft_length", MAX_REQUEST_DRAFT_LENGTH),
    ):
        if data.get(name) is not None:
            setattr(speculation, name, _integer(data[name], name, maximum))
    if data.get("acceptance_threshold") is not None:
        speculation.acceptance_threshold = _number(data["acceptance_threshold"], "acceptance_threshold")
    strategies = data.get("strategies")
    if isinstance(strategies, str):
        strategies = [s for s in strategies.split(",") if s]
    if strategies is not None:
        if not isinstance(strategies, list) or not all(isinstance(s, str) for s in strategies):
            raise bad_request("strategies", "must be an array of draft decoder names (or one comma-separated string)")
        speculation.strategies.extend(strategies)


def _boolean(value: Any, param: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(param, f"must be true or false, got {shown(value, param)}")
    return value


def _set_max_new_tokens(request: gateway_pb2.GenerateRequest, data: dict[str, Any]) -> dict[str, str]:
    """request.max_new_tokens from max_completion_tokens or max_tokens (the newer name wins when both
    are given); the alias under which the gateway's errors name the field."""
    for name in ("max_completion_tokens", "max_tokens"):
        if data.get(name) is not None:
            request.max_new_tokens = _integer(data[name], name, MAX_UINT32, minimum=1)
            return {"max_new_tokens": name}
    return {}


def _stream(data: dict[str, Any]) -> tuple[bool, bool]:
    """stream, and stream_options.include_usage (only with stream)."""
    is_stream = _boolean(data.get("stream"), "stream", False)
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options", "must be an object")
    include_usage = _boolean((options or {}).get("include_usage"), "stream_options.include_usage", False)
    if options is not None and not is_stream:
        raise bad_request("stream_options", "is only allowed when stream is true")
    return is_stream, include_usage


def _integer(value: Any, param: str, maximum: int = MAX_UINT64, minimum: int = 0) -> int:
    """An integer field in [minimum, maximum]; the error names the bound it breaks, so that a value
    the gateway would refuse by its own smaller range is not told a range it could never take."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(param, f"must be an integer, got {shown(value, param)}")
    if value < minimum:
        raise bad_request(param, f"must be at least {minimum}, got {value}")
    if value > maximum:
        raise bad_request(param, f"must be at most {maximum}, got {value}")
    return value


def _number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(param, f"must be a number, got {shown(value, param)}")
    if not math.isfinite(value):
        raise bad_request(param, "must be finite")
    return float(value)
