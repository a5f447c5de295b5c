"""One Propose's arguments (draft.proto ProposeRequest) as a typed record, and its wire form.

The gateway builds a ProposeArgs for each step and sends `to_pb()`; the draft service reads it back
with `from_pb` and hands the record to its pool. The fields are spelled out here only: a call site
passes the record, not its fields.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from specdec import pb
from specdec.v1 import draft_pb2

if TYPE_CHECKING:
    from specdec.grammar.compiler import ResponseFormat


@dataclasses.dataclass(frozen=True, slots=True)
class ProposeArgs:
    request_id: str
    prompt_token_ids: tuple[int, ...] = ()  # first call: creates the request's state
    new_token_ids: tuple[int, ...] = ()  # committed since the previous call
    strategies: tuple[str, ...] = ()  # () = the pool's default_strategies
    speculative_degree: int = 0  # 0 = len(strategies)
    draft_length: int = 0  # 0 = default_draft_length
    max_nodes: int = 0  # 0 = speculative_degree * draft_length (capped)
    response_format: ResponseFormat | None = None  # first call: the output's grammar (None: free text)
    lookahead_argmax_token_ids: tuple[int, ...] = ()  # the primary's argmaxes at the last lookahead rows
    continuation_length: int = 0  # tokens a model-free rank-0 candidate may add past draft_length
    # The primary's features of committed tokens: row i predicts the token at feature_position + i
    # (FeatureConsumer); None: none this call. The sender holds them as the primary gave them, a
    # common_pb2.Features (inline rows or a shared-memory handle, forwarded as is); from_pb decodes
    # them to float32 [n, C].
    features: Any = None
    feature_position: int = 0
    prediction_token_ids: tuple[int, ...] = ()  # first call: the request's predicted output (() = none)

    def to_pb(self) -> draft_pb2.ProposeRequest:
        return draft_pb2.ProposeRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            new_token_ids=self.new_token_ids,
            strategies=self.strategies,
            speculative_degree=self.speculative_degree,
            draft_length=self.draft_length,
            max_nodes=self.max_nodes,
            response_format=None if self.response_format is None else pb.response_format_to_pb(self.response_format),
            lookahead_argmax_token_ids=self.lookahead_argmax_token_ids,
            continuation_length=self.continuation_length,
            features=self.features,
            feature_position=self.feature_position,
            prediction_token_ids=self.prediction_token_ids,
        )

    @classmethod
    def from_pb(cls, request: draft_pb2.ProposeRequest) -> ProposeArgs:
        """The record of a received request; the response format is read on the first call only (the
        one carrying the prompt), features are decoded (InvalidArgument naming a bad field)."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            new_token_ids=tuple(request.new_token_ids),
            strategies=tuple(request.strategies),
            speculative_degree=request.speculative_degree,
            draft_length=request.draft_length,
            max_nodes=request.max_nodes,
            response_format=pb.response_format_from_pb(request.response_format) if request.prompt_token_ids else None,
            lookahead_argmax_token_ids=tuple(request.lookahead_argmax_token_ids),
            continuation_length=request.continuation_length,
            features=pb.features_from_pb(request.features, "features") if request.HasField("features") else None,
            feature_position=request.feature_position,
            prediction_token_ids=tuple(request.prediction_token_ids),
        )
