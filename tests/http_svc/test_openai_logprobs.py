"""The OpenAI shapes of log probabilities, from hand-made TokenLogprob messages."""

from __future__ import annotations

import math

from http_svc.openai_logprobs import CompletionLogprobs, chat_logprobs
from specdec.v1 import logprobs_pb2


def token(text: str, logprob: float, *top: tuple[str, float]) -> logprobs_pb2.TokenLogprob:
    return logprobs_pb2.TokenLogprob(
        token_id=len(text),
        text=text,
        logprob=logprob,
        top_logprobs=[logprobs_pb2.TopLogprob(text=t, logprob=p) for t, p in top],
    )


def test_the_legacy_object_names_offsets_and_alternatives_with_the_chosen_token():
    values = [token("Hi", math.nan), token(" there", -1.5, (" you", -0.5)), token("!", -0.125, ("!", -0.125))]
    legacy = CompletionLogprobs().add(values)
    assert legacy == {
        "tokens": ["Hi", " there", "!"],
        "token_logprobs": [None, -1.5, -0.125],  # the prompt's first token has no context
        "top_logprobs": [None, {" you": -0.5, " there": -1.5}, {"!": -0.125}],
        "text_offset": [0, 2, 8],
    }


def test_streamed_chunks_continue_the_offsets():
    legacy = CompletionLogprobs()
    assert legacy.add([token("ab", -1.0)])["text_offset"] == [0]
    assert legacy.add([token("c", -2.0), token("de", -3.0)])["text_offset"] == [2, 3]


def test_chat_content_carries_bytes_and_alternatives():
    shaped = chat_logprobs([token("é", -0.25, ("é", -0.25), ("e", -2.0))])
    assert shaped == {
        "content": [
            {
                "token": "é",
                "logprob": -0.25,
                "bytes": [0xC3, 0xA9],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
                    {"token": "e", "logprob": -2.0, "bytes": [0x65]},
                ],
            }
        ],
        "refusal": None,
    }
