"""ValidatorService servicer: protobuf -> the acceptance rule -> protobuf. Translation only.

The rule runs on the validation path chosen at start-up (paths.py: the CUDA kernel or the torch
reference); the logits reach it as the wire's bytes, undecoded."""

from __future__ import annotations

import time

import numpy as np

from specdec.logits_codec import EncodedLogits, decode_logits
from specdec.logprobs import token_logprobs
from specdec import acceptance_mode, pb
from specdec.acceptance_mode import AcceptanceMode
from specdec.errors import InvalidArgument
from specdec.grammar.bitmask import TokenBitmask
from specdec.sampling import SamplingParams
from specdec.speculation_bounds import MAX_TREE_NODES
from specdec.v1 import validator_pb2, validator_pb2_grpc
from validator_svc.acceptance import check_argmax_ids
from validator_svc.paths import TorchPath, ValidationInputs, ValidationPath


class ValidatorServicer(validator_pb2_grpc.ValidatorServiceServicer):
    def __init__(self, path: ValidationPath | None = None) -> None:
        self.path = path if path is not None else TorchPath()

    def Validate(self, request, context):
        start = time.perf_counter()
        pb.request_id_from_pb(request.request_id)
        sampling = pb.sampling_from_pb(request.sampling)
        threshold = float(request.acceptance_threshold)
        mode = _mode_from_pb(request.mode, sampling, threshold)
        token_ids, parents, logits = _tree_and_logits(request)
        allowed, argmax = _mask_and_argmax(request, logits)
        try:
            result = self.path.validate(
                ValidationInputs(
                    token_ids,
                    parents,
                    logits,
                    sampling,
                    mode,
                    acceptance_threshold=threshold,
                    argmax_ids=argmax,
                    position=request.position,
                    allowed=allowed,
                )
            )
        except ValueError as e:
            raise InvalidArgument(str(e).split(" ", 1)[0].rstrip(":"), str(e)) from None
        bonus_logprob = 0.0
        if request.return_bonus_logprob:  # the row where the accepted path ends, raw
            row = result.accepted_nodes[-1] + 1 if len(result.accepted_nodes) else 0
            rows = decode_logits(logits)[row : row + 1]  # [1, V]
            bonus_logprob = token_logprobs(rows, [result.bonus_token], 0)[0].logprob
        return validator_pb2.ValidateResponse(
            accepted_nodes=result.accepted_nodes,
            bonus_token=result.bonus_token,
            accepted_entropies=result.accepted_entropies,
            rejected_entropies=result.rejected_entropies,
            time_ms=(time.perf_counter() - start) * 1000,
            bonus_logprob=bonus_logprob,
        )


def _tree_and_logits(request: validator_pb2.ValidateRequest) -> tuple[list[int], list[int], EncodedLogits]:
    """The request's tree (token ids, parents) and target logits, checked against each other."""
    # The primary verifies no larger tree; at a small vocabulary a huge one is cheap to send and
    # costs seconds of the rule's time, and as many seconds (and a set of its nodes) to check and
    # copy: refused from the fields' lengths, before the tree or the logits are read.
    for name in ("token_ids", "parents"):
        if (num_nodes := len(getattr(request.tree, name))) > MAX_TREE_NODES:
            raise InvalidArgument(f"tree.{name}", f"{num_nodes} nodes exceed the limit of {MAX_TREE_NODES}")
    logits = pb.encoded_logits_from_pb(request.target_logits, "target_logits")
    # The rule needs a merged tree (siblings carry distinct tokens); checked here, so the refusal
    # names the request's field.
    token_ids, parents = pb.tree_from_pb(request.tree, logits.vocab_size, is_siblings_unique=True)
    if logits.num_rows != len(token_ids) + 1:
        raise InvalidArgument(
            "target_logits",
            f"{logits.num_rows} rows for a tree of {len(token_ids)} nodes (expected {len(token_ids) + 1})",
        )
    return token_ids, parents, logits


def _mask_and_argmax(
    request: validator_pb2.ValidateRequest, logits: EncodedLogits
) -> tuple[TokenBitmask | None, list[int] | None]:
    """The request's grammar mask (allowed_tokens) and the primary's argmaxes, checked."""
    allowed = None
    if request.HasField("allowed_tokens"):
        # Disallowed tokens get probability 0: no path that leaves the grammar can be accepted, and
        # the bonus token is one the grammar allows. (Masking here, not only in the primary, also
        # gives exact zeros that an fp8 wire format cannot carry.) The mask stays packed.
        allowed = pb.token_mask_from_pb(request.allowed_tokens, logits.num_rows, logits.vocab_size, "allowed_tokens")
    argmax = list(request.target_argmax_token_ids) or None
    if argmax is not None:
        try:
            check_argmax_ids(argmax, logits.num_rows, logits.vocab_size)
        except ValueError as e:  # the rule's own name for them is argmax_ids
            raise InvalidArgument("target_argmax_token_ids", str(e)) from None
        if allowed is not None:
            _check_argmax_allowed(argmax, allowed)
    return allowed, argmax


def _mode_from_pb(value: int, sampling: SamplingParams, threshold: float) -> AcceptanceMode:
    """The request's acceptance mode. The gateway decided it; it is applied as sent, after checking
    that it fits the step's sampling and threshold (InvalidArgument naming the field otherwise)."""
    try:
        mode = acceptance_mode.from_pb(value)
    except ValueError as e:
        raise InvalidArgument("mode", f"mode {e}") from None
    try:
        acceptance_mode.check_mode(mode, sampling, threshold)
    except ValueError as e:
        raise InvalidArgument(str(e).split(" ", 1)[0], str(e)) from None
    return mode


def _check_argmax_allowed(argmax: list[int], allowed: TokenBitmask) -> None:
    """The consistency check of a constrained step (argmax: one id in range a row, checked): the
    primary's argmax of every row must be a token the grammar allows there (it took them under the
    same mask), or greedy acceptance could leave it."""
    num_rows = allowed.num_rows
    is_allowed = allowed.is_allowed(np.arange(num_rows), argmax)  # [R] bool
    if not is_allowed.all():
        row = int(np.flatnonzero(~is_allowed)[0])
        raise InvalidArgument(
            "target_argmax_token_ids",
            f"row {row}'s token {argmax[row]} is not allowed by "
            "allowed_tokens: the argmax was not taken under the same grammar mask",
        )
