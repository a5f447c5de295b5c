"""ValidateRequest messages for the servicer tests, built from tensors."""

from __future__ import annotations

import torch

from specdec import pb
from specdec.grammar import TokenBitmask
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, validator_pb2


def validate_request(
    logits: torch.Tensor,
    token_ids,
    parents,
    fmt: str = "fp32",
    *,
    mode: validator_pb2.AcceptanceMode = validator_pb2.ACCEPTANCE_MODE_GREEDY,
    sampling: SamplingParams = SamplingParams(),
    allowed: torch.Tensor | None = None,
    argmax=None,
) -> validator_pb2.ValidateRequest:
    """A step at position 0 of request "r": the tree (token_ids, parents), its target logits [N + 1, V]
    in wire format `fmt`, the grammar's `allowed` mask [N + 1, V] (bool) if any, and the primary's
    argmax token ids if given."""
    req = validator_pb2.ValidateRequest(
        request_id="r",
        mode=mode,
        sampling=pb.sampling_to_pb(sampling),
        position=0,
        tree=common_pb2.TokenTree(token_ids=token_ids, parents=parents),
        target_logits=pb.logits_to_pb(logits, fmt),
        target_argmax_token_ids=argmax or (),
    )
    if allowed is not None:
        req.allowed_tokens.CopyFrom(pb.token_mask_to_pb(TokenBitmask.from_bool(allowed)))
    return req
