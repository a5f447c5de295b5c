"""How many tokens a request's context holds, declared once for the gateway (admission, where an
output ends, how long a plain run goes) and the primary's engine (Prefill, prompt scoring).

max_context (the primary's --max_context; GetModelInfo's max_context_length, DescribeModel's and
/v1/models' max_model_len) bounds a request's prompt and output together, as vLLM's max_model_len
does: prompt + output <= max_context. That is the engine's own bound: a request commits at most
max_context tokens (Engine.commit), and an output's last token is decided from the row of the token
before it, never run itself, so it needs no KV row or position of its own. A prompt of
max_context - 1 tokens thus gets one token; one of max_context tokens does not fit.
"""

from __future__ import annotations

from specdec.errors import InvalidArgument


def output_room(num_tokens: int, max_context: int) -> int:
    """How many more tokens a request of `num_tokens` tokens (prompt, or prompt and output so far)
    may generate; below 1 when it has no room for one."""
    return max_context - num_tokens


def check_fits(num_tokens: int, max_context: int, field: str) -> None:
    """InvalidArgument naming `field` unless a request of `num_tokens` tokens has room to generate one more."""
    if output_room(num_tokens, max_context) < 1:
        raise InvalidArgument(
            field,
            f"{num_tokens} tokens do not fit the context of {max_context} tokens with room to generate "
            f"(at most {max_context - 1})",
        )
