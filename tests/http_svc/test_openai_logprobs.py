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


def test_the_bytes_of_tokens_that_split_a_character_join_into_it(tokenizer):
    """A byte-level token holding part of "🤗" has the text U+FFFD; its `bytes` are its part, so
    the entries' bytes join into the text, as OpenAI's do (they were U+FFFD's three bytes each)."""
    from gateway.chat import PromptEncoder
    from gateway.tokenization import Tokenization
    from specdec import pb
    from specdec.logprobs import TokenLogprob

    tokenization = Tokenization(tokenizer, PromptEncoder(tokenizer), tokenizer.vocab_size)
    ids = tokenizer.encode("ok 🤗<|im_end|>")
    values = [
        pb.token_logprob_to_pb(TokenLogprob(t, -1.0, ((t, -1.0),)), tokenization.token_text, tokenization.token_bytes)
        for t in ids
    ]
    content = chat_logprobs(values)["content"]
    assert sum(1 for c in content if c["token"] == "\ufffd") >= 2  # " 🤗" comes in several tokens
    assert bytes(b for c in content for b in c["bytes"]).decode() == "ok 🤗<|im_end|>"
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
