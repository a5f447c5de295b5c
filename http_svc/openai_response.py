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
from collections.abc import Sequence

from http_svc.openai_logprobs import CompletionLogprobs, chat_logprobs
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


def summed_stats(stats: Sequence[gateway_pb2.GenerationStats], num_choices: int = 1) -> gateway_pb2.GenerationStats:
    """The counts of several requests (a completions request's prompts, or a request's `n`
    choices: stats prompt-major, num_choices a prompt), added up; each prompt's tokens count once."""
    if len(stats) == 1:
        return stats[0]
    total = gateway_pb2.GenerationStats()
    num_step_tokens = 0.0
    for i, s in enumerate(stats):
        if i % num_choices == 0:  # the prompt's first choice: the prompt counts once
            total.num_prompt_tokens += s.num_prompt_tokens
            total.num_cached_prompt_tokens += s.num_cached_prompt_tokens
        total.num_generated_tokens += s.num_generated_tokens
        total.num_proposed_tokens += s.num_proposed_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        total.num_accepted_prediction_tokens += s.num_accepted_prediction_tokens
        total.num_rejected_prediction_tokens += s.num_rejected_prediction_tokens
        total.num_steps += s.num_steps
        num_step_tokens += s.mean_accepted_length * s.num_steps  # an end token counts, as in each request's
    total.acceptance_rate = total.num_accepted_tokens / total.num_proposed_tokens if total.num_proposed_tokens else 0.0
    total.mean_accepted_length = num_step_tokens / total.num_steps if total.num_steps else 0.0
    return total


def finish_reason(value: int) -> str | None:
    return FINISH_REASONS.get(value)


def completion(
    parsed: ParsedRequest,
    response_id: str,
    created: int,
    model: str,
    responses: Sequence[gateway_pb2.GenerateResponse],
    echo_texts: Sequence[str] = (),
) -> dict:
    """The whole answer of a request without `stream`: choice i answers parsed.requests[i];
    `echo_texts`: with `echo`, each prompt's text (choice i's is prompt i // n's)."""
    choices = []
    for i, response in enumerate(responses):
        if parsed.kind == CHAT:
            choice = {
                "index": i,
                "message": _message(response),
                "logprobs": chat_logprobs(response.logprobs) if parsed.is_logprobs else None,
                "finish_reason": finish_reason(response.finish_reason),
            }
        else:
            echo = echo_texts[i // parsed.num_choices] if parsed.is_echo else ""
            logprobs = [*response.prompt_logprobs, *response.logprobs]
            choice = {
                "index": i,
                "text": echo + response.text,
                "logprobs": CompletionLogprobs().add(logprobs) if parsed.is_logprobs else None,
                "finish_reason": finish_reason(response.finish_reason),
            }
        if parsed.is_returning_token_ids:
            choice["token_ids"] = list(response.token_ids)
        choices.append(choice)
    return {
        "id": response_id,
        "object": OBJECTS[parsed.kind][0],
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(summed_stats([r.stats for r in responses], parsed.num_choices)),
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
    """SSE events of one streamed choice, as the OpenAI clients parse them: `data: <chunk>` per
    step, the finish reason on the choice's last chunk; then (`closing`) with
    stream_options.include_usage a chunk with no choices and the usage (every chunk before it has
    "usage": null), then `data: [DONE]`. With several choices (`n`) their writers' chunks
    interleave, and the stream closes once, after the last choice's final step."""

    def __init__(
        self,
        parsed: ParsedRequest,
        response_id: str,
        created: int,
        model: str,
        echo_text: str = "",
        index: int = 0,
        is_closing: bool = True,
    ) -> None:
        """`echo_text`: with `echo`, the prompt's text, the first chunk's; `index`: the choice's;
        `is_closing`: the final step closes the stream (the only choice's writer)."""
        self.parsed, self.head = (
            parsed,
            {"id": response_id, "object": OBJECTS[parsed.kind][1], "created": created, "model": model},
        )
        self.index, self.is_closing = index, is_closing
        self._is_role_sent = False
        self._echo_text: str | None = echo_text if parsed.is_echo else None  # None once sent
        self._completion_logprobs = CompletionLogprobs()

    def step(self, message: gateway_pb2.GenerateStreamResponse) -> bytes:
        """The events of one GenerateStream message (the final one: finish reason, usage, [DONE])."""
        events = []
        if self.parsed.kind == CHAT and not self._is_role_sent:
            events.append(self._chunk({"role": "assistant", "content": ""}, None, (), ()))
            self._is_role_sent = True
        if self._echo_text is not None:
            events.append(self._chunk(self._delta(self._echo_text), None, (), message.prompt_logprobs))
            self._echo_text = None
        if message.HasField("content"):  # a request with tools: content and calls apart
            events += self._tool_events(message)
        elif message.text or message.token_ids:
            events.append(self._chunk(self._delta(message.text), None, message.token_ids, message.logprobs))
        if message.is_final:
            events.append(
                self._chunk(
                    {} if self.parsed.kind == CHAT else self._delta(""), finish_reason(message.finish_reason), (), ()
                )
            )
            if self.is_closing:
                events.append(self.closing(message.stats))
        return b"".join(events)

    def closing(self, stats: gateway_pb2.GenerationStats) -> bytes:
        """The stream's end: the usage chunk (when asked for), then [DONE]."""
        usage_event = b""
        if self.parsed.is_usage_streamed:
            usage_event = self._event({**self.head, "choices": [], "usage": usage(stats)})
        return usage_event + SSE_DONE

    def _tool_events(self, message: gateway_pb2.GenerateStreamResponse) -> list[bytes]:
        """A chunk per piece: the content, then one per tool-call piece (OpenAI sends one call's
        piece per chunk); the message's token ids and log probabilities ride on its first chunk. A
        step inside a call that completes no piece yet (its name still open) sends nothing, unless
        token ids or log probabilities are asked for: they go out on an empty content chunk, else the
        stream would lose those tokens' values."""
        deltas: list[dict] = [{"tool_calls": [_tool_call_delta(d)]} for d in message.tool_calls]
        is_carrying = (self.parsed.is_returning_token_ids and bool(message.token_ids)) or (
            self.parsed.is_logprobs and bool(message.logprobs)
        )
        if message.content or (is_carrying and not deltas):
            deltas.insert(0, {"content": message.content})
        return [
            self._chunk(delta, None, message.token_ids if i == 0 else (), message.logprobs if i == 0 else ())
            for i, delta in enumerate(deltas)
        ]

    def _delta(self, text: str) -> dict:
        return {"content": text} if self.parsed.kind == CHAT else {"text": text}

    def _logprobs(self, values) -> dict | None:
        """A chunk's log probabilities: of its tokens (none on a chunk without tokens)."""
        if not self.parsed.is_logprobs or not values:
            return None
        return chat_logprobs(values) if self.parsed.kind == CHAT else self._completion_logprobs.add(values)

    def _chunk(self, delta: dict, reason: str | None, token_ids, logprobs) -> bytes:
        body = {"delta": delta} if self.parsed.kind == CHAT else delta
        choice = {"index": self.index, **body, "logprobs": self._logprobs(logprobs), "finish_reason": reason}
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
    """A failure after the stream began: an event with the error object (the SDKs raise APIError),
    then [DONE], which ends every stream (vLLM's too): a client reading to [DONE] sees the end."""
    return ChunkWriter._event(error_json) + SSE_DONE
