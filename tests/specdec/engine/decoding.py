"""Plain greedy decoding through the engine's own verify/commit, the row-by-row reference that tree
and chain verifies are compared with."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.engine.engine import Engine


def decode_one_token_at_a_time(
    engine: Engine, request_id: str, prompt: Sequence[int], num_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """Open `request_id` over prompt, prefill it, then greedily decode num_tokens tokens, one verify of
    an empty tree and one commit each: (the tokens, their logits rows [num_tokens, V]). Row i is the
    logits after the prompt and tokens[:i]. The request stays open."""
    engine.open(request_id, list(prompt))
    engine.prefill(request_id)
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for _ in range(num_tokens):
        rows.append(engine.verify(request_id, (), ())[0])
        tokens.append(int(rows[-1].argmax()))
        engine.commit(request_id, (), (tokens[-1],))
    return tokens, torch.stack(rows)
