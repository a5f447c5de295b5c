"""Bodies of /tokenize and /detokenize (vLLM's shapes) -> the gateway's Tokenize / Detokenize.

    POST /tokenize    {"prompt": "Hello"} or {"messages": [...]}, optional "model",
                      "add_special_tokens" (ignored: the ids are Generate's, a raw prompt's after the
                      BOS where the model takes one, a chat's with the BOS its template writes),
                      "add_generation_prompt" (true: the assistant's turn is opened, as Generate does),
                      "return_token_strs"
    POST /detokenize  {"tokens": [ids]}, optional "model"

Types are checked here, a 400 naming the parameter; the prompt's length and the ids' range are the
gateway's to check (its INVALID_ARGUMENT names the field).
"""

from __future__ import annotations

from typing import Any

from http_svc.errors import bad_request
from http_svc.openai_request import _boolean, _set_messages, _token_ids
from specdec.v1 import gateway_pb2


def parse_tokenize(data: dict[str, Any]) -> tuple[gateway_pb2.TokenizeRequest, bool]:
    """(the request, whether each token's text is to be returned)."""
    _boolean(data.get("add_special_tokens"), "add_special_tokens", False)
    if not _boolean(data.get("add_generation_prompt"), "add_generation_prompt", True):
        raise bad_request(
            "add_generation_prompt", "only true is supported: prompts are rendered as Generate renders them"
        )
    is_returning_strs = _boolean(data.get("return_token_strs"), "return_token_strs", False)
    request = gateway_pb2.TokenizeRequest()
    if data.get("messages") is not None:
        if data.get("prompt") is not None:
            raise bad_request("prompt", "give either prompt or messages, not both")
        chat = gateway_pb2.GenerateRequest()
        _set_messages(chat, data["messages"])
        request.chat.CopyFrom(chat.chat)
    elif isinstance(data.get("prompt"), str):
        request.prompt = data["prompt"]
    else:
        raise bad_request("prompt", "is required: a string (or give messages)")
    return request, is_returning_strs


def parse_detokenize(data: dict[str, Any]) -> gateway_pb2.DetokenizeRequest:
    return gateway_pb2.DetokenizeRequest(token_ids=_token_ids(data.get("tokens"), "tokens"))
