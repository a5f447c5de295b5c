"""Log probabilities (protobuf TokenLogprob) -> OpenAI's two shapes.

Chat completions: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...],
"refusal": null}`, one entry per generated token; `bytes` are the token's own (a token holding part of
a character has the `token` U+FFFD, and its bytes join with the next tokens' into the character).

Completions (the legacy shape lm-eval-harness reads): parallel lists over the choice's tokens,
`tokens`, `token_logprobs`, `top_logprobs` (a {token: logprob} object per token, holding the
`logprobs` most likely ones and the chosen one) and `text_offset` (each token's character offset in
the choice's text). With `echo` the prompt's tokens come first; its first token has no context to
be predicted from, so its logprob and top_logprobs are null.

The values are the primary's raw distribution at temperature 1 (specdec.logprobs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec.v1 import logprobs_pb2


def _logprob(value: float) -> float | None:
    """JSON has no NaN: the gateway's NaN (a prompt's first token) is null."""
    return None if math.isnan(value) else value


def chat_logprobs(values: Sequence[logprobs_pb2.TokenLogprob]) -> dict:
    def entry(value: logprobs_pb2.TokenLogprob | logprobs_pb2.TopLogprob) -> dict:
        # the token's own bytes: a token holding part of a character has the text U+FFFD, but its
        # bytes join with its neighbours' into the character, as OpenAI's do (empty: not sent)
        token_bytes = value.token_bytes or value.text.encode()
        return {"token": value.text, "logprob": _logprob(value.logprob), "bytes": list(token_bytes)}

    content = [{**entry(v), "top_logprobs": [entry(t) for t in v.top_logprobs]} for v in values]
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """The legacy object of one choice, built over its tokens (streamed: chunk by chunk, offsets
    continuing)."""

    def __init__(self, text_offset: int = 0) -> None:
        self.text_offset = text_offset

    def add(self, values: Sequence[logprobs_pb2.TokenLogprob]) -> dict:
        """The object of these tokens, the next in the choice's text."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for v in values:
            tokens.append(v.text)
            logprob = _logprob(v.logprob)
            token_logprobs.append(logprob)
            if logprob is None:
                top_logprobs.append(None)
            else:
                top = {t.text: t.logprob for t in v.top_logprobs}
                top.setdefault(v.text, v.logprob)  # the chosen token is always there (as vLLM does)
                top_logprobs.append(top)
            offsets.append(self.text_offset)
            self.text_offset += len(v.text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }
