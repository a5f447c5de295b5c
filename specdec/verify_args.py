"""One Verify's arguments (primary.proto VerifyRequest) as a typed record, and its wire form.

The gateway builds a VerifyArgs for each step and sends `to_pb()`; the primary reads it back with
`from_pb`, which checks every field as it decodes it (InvalidArgument naming the field), and works
from the record. The fields are spelled out here only.

The grammar mask is held decoded, a TokenBitmask of the tree's N + 1 rows, on both sides: the
gateway's grammar fills one, and `from_pb` knows the tree it is checked against (its row count is
the tree's), so the primary gets it checked with the rest of the request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from specdec import pb
from specdec.logits_codec import FORMAT_FP32
from specdec.logprobs import LogprobsRequest
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, primary_pb2

if TYPE_CHECKING:
    from specdec.grammar.bitmask import TokenBitmask


@dataclasses.dataclass(frozen=True, slots=True)
class VerifyArgs:
    request_id: str
    committed_token_ids: tuple[int, ...] = ()  # committed since the previous Verify or Prefill
    accepted_nodes: tuple[int, ...] = ()  # the previous step's accepted path, as indices into its tree
    tree_token_ids: tuple[int, ...] = ()  # the draft tree to verify, N nodes (none: the root only)
    tree_parents: tuple[int, ...] = ()
    lookahead_token_ids: tuple[int, ...] = ()  # lookahead rows off the same root, never accepted
    lookahead_parents: tuple[int, ...] = ()
    logits_format: str = FORMAT_FP32  # the returned logits' wire format (specdec.logits_codec)
    return_handle: bool = False  # the logits through shared memory instead of inline bytes
    allowed_tokens: TokenBitmask | None = None  # the grammar's mask of the tree's N + 1 rows; None: any
    kv_lease: str = ""  # PrefillResponse.kv_lease of the request
    return_features: bool = False  # the features of every logits row come back
    logprobs: LogprobsRequest | None = None  # None: no log probabilities
    sampling: SamplingParams | None = None  # the request's penalties and logit_bias; None: none sent

    @property
    def num_rows(self) -> int:
        """The logits rows returned: the root's, then one a tree node (the lookahead rows are not)."""
        return len(self.tree_token_ids) + 1

    def to_pb(self) -> primary_pb2.VerifyRequest:
        return primary_pb2.VerifyRequest(
            request_id=self.request_id,
            accepted_nodes=self.accepted_nodes,
            committed_token_ids=self.committed_token_ids,
            tree=common_pb2.TokenTree(token_ids=self.tree_token_ids, parents=self.tree_parents),
            lookahead=common_pb2.TokenTree(token_ids=self.lookahead_token_ids, parents=self.lookahead_parents),
            logits_format=pb.LOGITS_FORMAT_ENUMS[self.logits_format],
            return_handle=self.return_handle,
            allowed_tokens=None if self.allowed_tokens is None else pb.token_mask_to_pb(self.allowed_tokens),
            kv_lease=self.kv_lease,
            return_features=self.return_features,
            logprobs=None if self.logprobs is None else pb.logprobs_request_to_pb(self.logprobs),
            sampling=None if self.sampling is None else pb.sampling_to_pb(self.sampling),
        )

    @classmethod
    def from_pb(
        cls,
        request: primary_pb2.VerifyRequest,
        vocab_size: int,
        check_lease: Callable[[str, str], None] | None = None,
    ) -> VerifyArgs:
        """The record of a received request, checked against a vocabulary of `vocab_size` tokens
        (InvalidArgument naming the bad field). `check_lease(request_id, kv_lease)` runs once the
        request id is read and before any other field is checked: a caller without the request's
        lease is told NOT_FOUND, as for an unknown request, whatever else its request holds. The
        trees' sizes and depths against the engine's bounds are the engine's to check."""
        request_id = pb.request_id_from_pb(request.request_id)
        if check_lease is not None:
            check_lease(request_id, request.kv_lease)
        token_ids, parents = pb.tree_from_pb(request.tree, vocab_size)
        lookahead_ids, lookahead_parents = pb.tree_from_pb(request.lookahead, vocab_size, "lookahead")
        logits_format = pb.logits_format_from_pb(request.logits_format)
        allowed = (
            pb.token_mask_from_pb(request.allowed_tokens, len(token_ids) + 1, vocab_size, "allowed_tokens")
            if request.HasField("allowed_tokens")
            else None
        )
        logprobs = pb.logprobs_request_from_pb(request.logprobs) if request.HasField("logprobs") else None
        sampling = pb.sampling_from_pb(request.sampling) if request.HasField("sampling") else None
        if sampling is not None:
            pb.check_sampling_token_ids(sampling, vocab_size)
        return cls(
            request_id=request_id,
            committed_token_ids=tuple(request.committed_token_ids),
            accepted_nodes=tuple(request.accepted_nodes),
            tree_token_ids=tuple(token_ids),
            tree_parents=tuple(parents),
            lookahead_token_ids=tuple(lookahead_ids),
            lookahead_parents=tuple(lookahead_parents),
            logits_format=logits_format,
            return_handle=request.return_handle,
            allowed_tokens=allowed,
            kv_lease=request.kv_lease,
            return_features=request.return_features,
            logprobs=logprobs,
            sampling=sampling,
        )
