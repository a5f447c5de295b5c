"""GenerateResponse / GenerateStreamResponse (protobuf) -> OpenAI response objects and SSE chunks.

`usage` carries the standard counts and, as an extra object, the speculation statistics:

    "usage": {"prompt_tokens": 31, "completion_tokens": 40, "total_tokens": 71,
              "prompt_tokens_details": {"cached_tokens": 0},
              "speculation": {"proposed_tokens": 52, "accepted_tokens": 29, "acceptance_rate": 0.56,
                              "mean_accepted_length": 3.9, "num_steps": 10}}
"""

from __future__ import annotations

import json

from http_svc.openai_request import CHAT, COMPLETION, ParsedRequest
from specdec.v1 import gateway_pb2

# OpenAI's finish reasons: "stop" (a stop string or the end of the text), "length", "tool_calls".
FINISH_REASONS: dict[int, str] = {
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_EOS: "stop",
    gateway_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
SSE_DONE = b"data: [DONE]\n\n"
# The `object` of a whole answer and of a chunk, per endpoint.
OBJECTS = {CHAT: ("chat.completion", "chat.completion.chunk"), COMPLETION: ("text_completion", "text_completion")}


def usage(stats: gateway_pb2.GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.num_prompt_tokens,
        "completion_tokens": stats.num_generated_tokens,
        "total_tokens": stats.num_prompt_tokens + stats.num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.num_cached_prompt_tokens},  # the primary's prefix cache
        "speculation": {
            "proposed_tokens": stats.num_proposed_tokens,
            "accepted_tokens": stats.num_accepted_tokens,
            "acceptance_rate": stats.acceptance_rate,
            "mean_accepted_length": stats.mean_accepted_length,
            "num_steps": stats.num_steps,
        },
    }


def finish_reason(value: int) -> str | None:
    return FINISH_REASONS.get(value)


def completion(
    parsed: ParsedRequest, response_id: str, created: int, model: str, response: gateway_pb2.GenerateResponse
) -> dict:
    """The whole answer of a request without `stream`."""
    if parsed.kind == CHAT:
        choice = {
            "index": 0,
            "message": _message(response),
            "logprobs": None,
            "finish_reason": finish_reason(response.finish_reason),
        }
    else:
        choice = {
            "index": 0,
            "text": response.text,
            "logprobs": None,
            "finish_reason": finish_reason(response.finish_reason),
        }
    if parsed.is_returning_token_ids:
        choice["token_ids"] = list(response.token_ids)
    return {
        "id": response_id,
        "object": OBJECTS[parsed.kind][0],
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(response.stats),
    }


def _message(response: gateway_pb2.GenerateResponse) -> dict:
    """The assistant message: with tools, the content outside the calls (null when there is only
    calls) and the calls, their arguments as JSON text."""
    if not response.HasField("content"):
        return {"role": "assistant", "content": response.text, "refusal": None}
    message: dict = {
        "role": "assistant",
        "content": response.content if response.content or not response.tool_calls else None,
        "refusal": None,
    }
    if response.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in response.tool_calls
        ]
    return message


def _tool_call_delta(delta: gateway_pb2.ToolCallDelta) -> dict:
    """OpenAI's delta.tool_calls[0]: id, type and name on a call's first piece, then arguments."""
    if delta.id:
        return {
            "index": delta.index,
            "id": delta.id,
            "type": "function",
            "function": {"name": delta.name, "arguments": delta.arguments},
        }
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


class ChunkWriter:
    """SSE events of one streamed answer, as the OpenAI clients parse them: `data: <chunk>` per
    step, the finish reason on the last choice chunk, with stream_options.include_usage a chunk
    with no choices and the usage (every chunk before it has "usage": null), then `data: [DONE]`."""

    def __init__(self, parsed: ParsedRequest, response_id: str, created: int, model: str) -> None:
        self.parsed, self.head = (
            parsed,
            {"id": response_id, "object": OBJECTS[parsed.kind][1], "created": created, "model": model},
        )
        self._is_role_sent = False

    def step(self, message: gateway_pb2.GenerateStreamResponse) -> bytes:
        """The events of one GenerateStream message (the final one: finish reason, usage, [DONE])."""
        events = []
        if self.parsed.kind == CHAT and not self._is_role_sent:
            events.append(self._chunk({"role": "assistant", "content": ""}, None, ()))
            self._is_role_sent = True
        if message.HasField("content"):  # a request with tools: content and calls apart
            events += self._tool_events(message)
        elif message.text or message.token_ids:
            events.append(self._chunk(self._delta(message.text), None, message.token_ids))
        if message.is_final:
            events.append(
                self._chunk(
                    {} if self.parsed.kind == CHAT else self._delta(""), finish_reason(message.finish_reason), ()
                )
            )
            if self.parsed.is_usage_streamed:
                events.append(self._event({**self.head, "choices": [], "usage": usage(message.stats)}))
            events.append(SSE_DONE)
        return b"".join(events)

    def _tool_events(self, message: gateway_pb2.GenerateStreamResponse) -> list[bytes]:
        """A chunk per piece: the content, then one per tool-call piece (OpenAI sends one call's
        piece per chunk); the message's token ids ride on its first chunk. A step inside a call
        that completes no piece yet (its name still open) sends nothing, unless token ids are asked for."""
        deltas: list[dict] = [{"tool_calls": [_tool_call_delta(d)]} for d in message.tool_calls]
        if message.content or (self.parsed.is_returning_token_ids and message.token_ids and not deltas):
            deltas.insert(0, {"content": message.content})
        return [self._chunk(delta, None, message.token_ids if i == 0 else ()) for i, delta in enumerate(deltas)]

    def _delta(self, text: str) -> dict:
        return {"content": text} if self.parsed.kind == CHAT else {"text": text}

    def _chunk(self, delta: dict, reason: str | None, token_ids) -> bytes:
        if self.parsed.kind == CHAT:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, **delta, "logprobs": None, "finish_reason": reason}
        if self.parsed.is_returning_token_ids:
            choice["token_ids"] = list(token_ids)
        chunk = {**self.head, "choices": [choice]}
        if self.parsed.is_usage_streamed:
            chunk["usage"] = None
        return self._event(chunk)

    @staticmethod
    def _event(data: dict) -> bytes:
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def error_event(error_json: dict) -> bytes:
    """A failure after the stream began: an event with the error object (the SDKs raise APIError)."""
    return ChunkWriter._event(error_json)
