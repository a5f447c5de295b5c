"""ValidatorService servicer: protobuf -> the acceptance rule -> protobuf. Translation only."""
from __future__ import annotations

import time

from specdec import pb
from specdec.errors import InvalidArgument
from specdec.v1 import validator_pb2, validator_pb2_grpc
from validator_svc.acceptance import MODE_GREEDY, MODE_SAMPLE, MODE_THRESHOLD, validate_tree

MODES = {validator_pb2.ACCEPTANCE_MODE_GREEDY: MODE_GREEDY, validator_pb2.ACCEPTANCE_MODE_SAMPLE: MODE_SAMPLE,
         validator_pb2.ACCEPTANCE_MODE_THRESHOLD: MODE_THRESHOLD}


class ValidatorServicer(validator_pb2_grpc.ValidatorServiceServicer):
    def Validate(self, request, context):
        start = time.perf_counter()
        pb.request_id_from_pb(request.request_id)
        sampling = pb.sampling_from_pb(request.sampling)
        threshold = float(request.acceptance_threshold)
        mode = MODES.get(request.mode)
        if request.mode == validator_pb2.ACCEPTANCE_MODE_UNSPECIFIED:
            mode = MODE_GREEDY if sampling.is_greedy else MODE_SAMPLE
        if mode is None:
            raise InvalidArgument("mode", f"unknown acceptance mode {request.mode}")
        if mode == MODE_THRESHOLD and not 0.0 < threshold <= 1.0:
            raise InvalidArgument("acceptance_threshold", f"threshold mode needs a value in (0, 1], got {threshold}")
        if mode != MODE_THRESHOLD:
            threshold = 0.0
        if mode == MODE_GREEDY and not sampling.is_greedy:
            raise InvalidArgument("mode", "greedy acceptance needs sampling.temperature = 0")
        logits = pb.logits_from_pb(request.target_logits, "target_logits")
        vocab_size = logits.shape[1]
        token_ids, parents = pb.tree_from_pb(request.tree, vocab_size)
        if logits.shape[0] != len(token_ids) + 1:
            raise InvalidArgument("target_logits", f"{logits.shape[0]} rows for a tree of {len(token_ids)} nodes "
                                  f"(expected {len(token_ids) + 1})")
        argmax = list(request.target_argmax_token_ids) or None
        draft_probs = pb.logits_from_pb(request.draft_probs, "draft_probs") if request.HasField("draft_probs") \
            else None
        try:
            result = validate_tree(token_ids, parents, logits, sampling, acceptance_threshold=threshold,
                                   draft_probs=draft_probs, argmax_ids=argmax, step=request.step)
        except ValueError as e:
            raise InvalidArgument(str(e).split(" ", 1)[0].rstrip(":"), str(e)) from None
        return validator_pb2.ValidateResponse(
            accepted_nodes=result.accepted_nodes, bonus_token=result.bonus_token,
            accepted_entropies=result.accepted_entropies, rejected_entropies=result.rejected_entropies,
            time_ms=(time.perf_counter() - start) * 1000)
