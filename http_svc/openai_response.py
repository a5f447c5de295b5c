"""GenerateResponse / GenerateStreamResponse (protobuf) -> OpenAI response objects and SSE chunks.

`usage` carries the standard counts and, as an extra object, the speculation statistics:

    "usage": {"prompt_tokens": 31, "completion_tokens": 40, "total_tokens": 71,
              "prompt_tokens_details": {"cached_tokens": 0},
              "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
              "speculation": {"proposed_tokens": 52, "accepted_tokens": 29, "acceptance_rate": 0.56,
                              "mean_accepted_length": 3.9, "num_steps": 10}}

OpenAI's Predicted Outputs counts (completion_tokens_details), exactly as counted here:
accepted_prediction_tokens, the prediction decoder's draft tokens the primary accepted (the
output's tokens that a verify took from the prediction; a bonus token that happens to equal the
prediction's next token is not one); rejected_prediction_tokens, the prediction's tokens the output
did not use: its token count less the prediction positions that output tokens followed by the
alignment the decoder drafts from (specdec.prediction), so an unreached tail counts as rejected,
as OpenAI bills it. Both 0 without a prediction.
"""

from __future__ import annotations

import json

from http_svc.openai_request import CHAT, COMPLETION, ParsedRequest
from specdec.v1 import gateway_pb2

# OpenAI's finish reasons: "stop" (a stop string or the end of the text), "length".
FINISH_REASONS: dict[int, str] = {
    gateway_pb2.FINISH_REASON_LENGTH: "length",
    gateway_pb2.FINISH_REASON_STOP: "stop",
    gateway_pb2.FINISH_REASON_EOS: "stop",
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
        "completion_tokens_details": {
            "accepted_prediction_tokens": stats.num_accepted_prediction_tokens,
            "rejected_prediction_tokens": stats.num_rejected_prediction_tokens,
        },
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
            "message": {"role": "assistant", "content": response.text, "refusal": None},
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
        if message.text or message.token_ids:
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
