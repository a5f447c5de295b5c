"""DraftService servicer: protobuf -> pool / attacher -> protobuf, nothing else.

Domain errors (specdec.errors) raised below become their gRPC status in the interceptor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc

from draft_svc.costs import DraftCosts
from draft_svc.pool import DraftPool, Proposal
from draft_svc.primary_client import exported_from_pb
from draft_svc.weights import WeightAttacher
from specdec import pb
from specdec.errors import InvalidArgument
from specdec.propose_args import ProposeArgs
from draft_svc.metrics import DraftMetrics
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(
        self,
        pool: DraftPool,
        attacher: WeightAttacher,
        metrics: DraftMetrics | None = None,
        costs: DraftCosts | None = None,
        priors: Mapping[str, Sequence[float]] | None = None,
    ) -> None:
        self._pool, self._attacher, self._metrics = pool, attacher, metrics
        self._costs = costs or DraftCosts()  # measured when the weights attach (draft_svc/costs.py)
        # strategy -> its drafter's validation acceptance by depth (draft_svc/priors.py)
        self._priors = {name: tuple(by_depth) for name, by_depth in (priors or {}).items()}

    def Attach(self, request: draft_pb2.AttachRequest, context: grpc.ServicerContext) -> draft_pb2.AttachResponse:
        if not request.HasField("manifest"):
            raise InvalidArgument("manifest", "is not set")
        attached = self._attacher.attach_offered(exported_from_pb(request.manifest))
        return draft_pb2.AttachResponse(mapped_bytes=attached.mapped_bytes)

    def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.ServicerContext) -> draft_pb2.ProposeResponse:
        args = ProposeArgs.from_pb(request)
        proposal = self._pool.propose(args)
        if args.prompt_token_ids and not context.is_active():
            # An opening call whose caller is gone (its request ended, often cancelled at its prefill):
            # the gateway's Release may have come while this call ran, found nothing and left the state
            # this call made to the pool's --request_ttl_s. A gateway that still runs the request opens
            # it again (a failed call is one the pool has not heard).
            self._pool.release(args.request_id, is_finished=False)
        self._record(proposal)
        return proposal_to_pb(proposal)

    def Release(
        self, request: draft_pb2.DraftServiceReleaseRequest, context: grpc.ServicerContext
    ) -> draft_pb2.DraftServiceReleaseResponse:
        self._pool.release(pb.request_id_from_pb(request.request_id), request.is_finished, request.new_token_ids)
        if self._metrics is not None:  # the released request's state is gone: its bytes too
            self._metrics.requests.set(self._pool.num_requests)
            self._metrics.state_bytes.set(self._pool.num_kv_bytes)
        return draft_pb2.DraftServiceReleaseResponse()

    def PrepareGrammar(
        self, request: draft_pb2.PrepareGrammarRequest, context: grpc.ServicerContext
    ) -> draft_pb2.PrepareGrammarResponse:
        response_format = pb.response_format_from_pb(request.response_format)
        if response_format is None:
            raise InvalidArgument("response_format.type", "names no grammar (TYPE_JSON_SCHEMA or TYPE_JSON_OBJECT)")
        self._pool.prepare_grammar(response_format)
        return draft_pb2.PrepareGrammarResponse()

    def GetPoolInfo(
        self, request: draft_pb2.GetPoolInfoRequest, context: grpc.ServicerContext
    ) -> draft_pb2.GetPoolInfoResponse:
        offered = self._pool.offered_strategies()
        return draft_pb2.GetPoolInfoResponse(
            strategies=offered,
            draft_costs=[
                draft_pb2.MeasuredDraftCost(strategy=name, fixed_ms=c.fixed_ms, per_token_ms=c.per_token_ms)
                for name, c in self._costs.items()
                if name in offered
            ],
            acceptance_priors=[
                draft_pb2.AcceptancePrior(strategy=name, acceptance_by_depth=by_depth)
                for name, by_depth in sorted(self._priors.items())
                if name in offered
            ],
        )

    def _record(self, proposal: Proposal) -> None:
        if self._metrics is None:
            return
        self._metrics.proposed_tokens.inc(proposal.tree.num_nodes)
        self._metrics.propose_seconds.observe(proposal.time_ms / 1e3)
        self._metrics.requests.set(self._pool.num_requests)
        self._metrics.state_bytes.set(self._pool.num_kv_bytes)


def proposal_to_pb(proposal: Proposal) -> draft_pb2.ProposeResponse:
    tree = proposal.tree
    return draft_pb2.ProposeResponse(
        tree=common_pb2.TokenTree(token_ids=tree.token_ids, parents=tree.parents),
        node_sources=tree.node_sources,
        decoders=tree.decoders,
        decoder_stats=[
            common_pb2.DecoderStats(name=s.name, num_proposed=s.num_proposed, time_ms=s.time_ms)
            for s in proposal.decoder_steps
        ],
        time_ms=proposal.time_ms,
        lookahead=common_pb2.TokenTree(token_ids=proposal.lookahead[0], parents=proposal.lookahead[1]),
        continuations=[
            draft_pb2.Continuation(leaf=c.leaf, token_ids=c.token_ids, decoder=c.decoder)
            for c in proposal.continuations
        ],
    )
