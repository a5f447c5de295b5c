"""Log probabilities of chosen tokens under the primary's raw distribution, and their wire form.

logprob(t | row) = logits[t] - logsumexp(logits): the log-softmax of the raw float32 logits row at
temperature 1, before temperature, top-k, top-p and grammar masks (OpenAI's `logprobs`: the model's
distribution, not the sampler's). The primary computes them from the rows its forward produced, so
the wire format that carries logits to the validator (fp32, bf16, fp8) does not change them, and a
token verified in a tree gets the value of the same position decoded plainly (the rows agree up to
the forward's float32 rounding).

Top alternatives are the row's `num_top` largest logprobs, most likely first; ties keep the lower
token id first (torch.topk on a CPU, stable for equal values in practice, not promised).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from specdec.errors import InvalidArgument

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclasses.dataclass(frozen=True, slots=True)
class LogprobsRequest:
    num_top: int = 0  # alternatives per position, 0..MAX_TOP_LOGPROBS
    is_prompt_included: bool = False  # the prompt's logprobs too

    def __post_init__(self) -> None:
        if not 0 <= self.num_top <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                "logprobs.num_top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.num_top}"
            )


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Row r's logprob of token_ids[r] and its top `num_top` alternatives, for logits [R, V].

    E.g. a row [0, ln 3] (V = 2), token 0, num_top 1 -> logprob ln(1/4), top ((1, ln(3/4)),)."""
    assert logits.dim() == 2 and logits.shape[0] == len(token_ids), (tuple(logits.shape), len(token_ids))
    if not token_ids:
        return []
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(list(token_ids), dtype=torch.int64)
    chosen = log_probs.gather(1, ids[:, None])[:, 0].tolist()  # [R]
    if num_top > 0:
        top_values, top_ids = torch.topk(log_probs, min(num_top, log_probs.shape[1]), dim=-1)  # [R, num_top]
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(int(t), float(c), top) for t, c, top in zip(token_ids, chosen, tops)]
