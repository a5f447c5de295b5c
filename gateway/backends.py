"""The gateway's view of the three internal services: typed calls, domain errors.

Every call is a coroutine on grpc.aio stubs: a request's loop waits for the primary without
holding a thread (gateway.server). Make Backends inside the event loop that will use it (grpc.aio
channels belong to one loop). Protobuf stays here; the request loop sees plain values. A failed call becomes the domain
error of its status (NotFound, Unavailable, ...), so the loop can recover from a restarted
primary (NOT_FOUND after a re-prefill is needed, UNAVAILABLE while it is down).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any, AsyncGenerator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.admission import MAX_RETRY_AFTER_MS, MIN_RETRY_AFTER_MS
from specdec import acceptance_mode, pb
from specdec.acceptance_mode import AcceptanceMode
from specdec.engine.tree import node_depths
from specdec.grammar.bitmask import TokenBitmask
from specdec.grammar.compiler import ResponseFormat
from specdec.logprobs import LogprobsRequest, TokenLogprob
from specdec.errors import (
    RETRY_AFTER_KEY,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecdecError,
    StateLost,
    Unavailable,
)
from specdec.propose_args import ProposeArgs
from specdec.verify_args import VerifyArgs
from specdec.sampling import SamplingParams
from specdec.service.auth import token_metadata
from specdec.tracing import aio_channel_interceptors, outgoing_metadata
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    primary_pb2,
    primary_pb2_grpc,
    validator_pb2,
    validator_pb2_grpc,
)

_ERRORS: dict[grpc.StatusCode, type[SpecdecError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int
    instance_id: str
    verify_costs_ms: dict[int, float]


@dataclasses.dataclass(frozen=True, slots=True)
class PrimaryStats:
    """The primary's load and prefix cache (GetStats), what a gateway's router weighs."""

    num_active_requests: int
    kv_bytes: int
    max_kv_bytes: int
    queue_depth: int
    prefix_block_tokens: int  # 0: no prefix cache
    num_prefix_query_tokens: int
    num_prefix_reused_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class PoolInfo:
    """What the draft pool offers (GetPoolInfo), what its model-based strategies' Propose costs on
    its machine (strategy -> (fixed_ms, per_token_ms), for those measured so far) and what its trained
    drafters' validation says of their acceptance."""

    strategies: tuple[str, ...]
    draft_costs_ms: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    # strategy -> its drafter's validation acceptance by depth (a trained drafter's file)
    acceptance_priors: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class DraftTree:
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    node_sources: tuple[int, ...]  # bit i set: decoders[i] proposed the node
    decoders: tuple[str, ...]
    decoder_ms: dict[str, float]
    time_ms: float
    # lookahead rows to verify beside the tree (never accepted), and how deep they reach
    lookahead_token_ids: tuple[int, ...] = ()
    lookahead_parents: tuple[int, ...] = ()
    # (leaf node, decoder, tokens): what a rank-0 candidate proposed past its draft, which ends at
    # that node (ProposeResponse.continuations)
    continuations: tuple[tuple[int, str, tuple[int, ...]], ...] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def lookahead_depth(self) -> int:
        return max(node_depths(self.lookahead_parents), default=0)


EMPTY_TREE = DraftTree((), (), (), (), {}, 0.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Prefilled:
    time_ms: float  # the primary's time for the prefill
    num_cached_prompt_tokens: int  # prompt tokens whose KV rows came from the primary's prefix cache
    kv_lease: str = ""  # the primary's new lease on the slot: stored, so that a successor gateway holds it too
    features: Any = None  # common_pb2.Features of the last prefilled row (return_features), or None
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.. (prefill's prompt_logprobs)
    precision: str = ""  # the weight format the primary serves ("": not reported)


@dataclasses.dataclass(frozen=True, slots=True)
class Verified:
    logits: Any  # common_pb2.Logits, passed through to the validator untouched
    argmax_token_ids: tuple[int, ...]
    forward_ms: float
    lookahead_argmax_token_ids: tuple[int, ...] = ()
    other_step_rows: int = 0  # other requests' rows in the primary's engine step that ran it (the load)
    features: Any = None  # common_pb2.Features of the N+1 logits rows (return_features), or None
    # With logprobs asked: node i's token at its parent's row [N]; row r's argmax (a greedy bonus) [N+1]
    node_logprobs: tuple[TokenLogprob, ...] = ()
    row_logprobs: tuple[TokenLogprob, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Decoded:
    token_id: int  # the last token decoded: pending, as after one step
    forward_ms: float
    other_step_rows: int = 0  # as Verified.other_step_rows
    token_ids: tuple[int, ...] = ()  # every token of the call, in order (DecodeRequest.max_tokens)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of the call, when asked
    # The run ended with it: token_id is pending (the next call commits it). A streamed step that is not
    # the run's end (decode_stream) carries a token the primary committed itself.
    is_run_end: bool = True
    num_drafted: int = 0  # tokens the primary drafted and verified for this step (lookup_draft_length)
    num_draft_accepted: int = 0  # of them, those among token_ids
    num_answer_drafted: int = 0  # of num_drafted, those from the model's own answers (--run_answers)
    num_answer_accepted: int = 0  # of them, those among token_ids
    num_steps: int = 1  # the engine steps of a streamed message (DecodeRequest.steps_per_message)
    num_drafting_steps: int = 0  # of num_steps, those that drafted (num_drafted counts all their drafts)


@dataclasses.dataclass(frozen=True, slots=True)
class Validation:
    accepted_nodes: tuple[int, ...]
    bonus_token: int
    accepted_entropies: tuple[float, ...]
    rejected_entropies: tuple[float, ...]
    bonus_logprob: float | None = None  # asked of the validator (is_bonus_scored): the bonus token's raw logprob


def features_of_rows(features: Any, rows: Sequence[int]) -> Any:
    """Rows `rows` of a Verified's or Prefilled's features, for a Propose: inline rows are sliced (only
    they travel on), a shared-memory handle goes on naming them (Features.rows)."""
    return pb.select_feature_rows(features, rows)


def _logprobs_pb(request: LogprobsRequest | None) -> Any:
    return None if request is None else pb.logprobs_request_to_pb(request)


def _decoded(r: primary_pb2.DecodeStreamResponse) -> Decoded:
    """One streamed message of a run (one step, or several: DecodeRequest.steps_per_message), with the
    rows of its last step beside the request's own (its root and drafts)."""
    token_ids = tuple(r.token_ids)
    # a message of one step: its rows less the request's root and drafts (also a primary that predates
    # num_other_rows); of several: the primary's count for the last (num_drafted sums them all)
    other_step_rows = r.num_other_rows if r.num_steps > 1 else max(0, r.num_step_rows - 1 - r.num_drafted)
    return Decoded(
        token_ids[-1],
        r.forward_ms,
        other_step_rows,
        token_ids,
        _logprobs(r.logprobs),
        r.is_run_end,
        r.num_drafted,
        r.num_draft_accepted,
        r.num_answer_drafted,
        r.num_answer_accepted,
        max(1, r.num_steps),
        # a primary that predates the field: a message that drafted counts as one drafting step
        r.num_drafting_steps or int(r.num_drafted > 0),
    )


def _logprobs(values: Sequence[Any]) -> tuple[TokenLogprob, ...]:
    return tuple(pb.token_logprob_from_pb(v) for v in values)


def _mask(allowed: TokenBitmask | None) -> common_pb2.TokenMask | None:
    return None if allowed is None else pb.token_mask_to_pb(allowed)


# Failures of an internal service that a client may retry; any other is a fault of the service.
_RETRYABLE = (Unavailable, DeadlineExceeded, ResourceExhausted, Cancelled)


def _domain_error(e: grpc.RpcError, service: str) -> SpecdecError:
    cls = _ERRORS.get(e.code(), Unavailable if e.code() == grpc.StatusCode.UNKNOWN else None)
    error = (
        Unavailable(service, f"{e.code().name}: {e.details()}")
        if cls is None
        else cls(service, e.details() or e.code().name)
    )
    error.dependency = service  # the loop recovers from some; a client never sees it as its own (client_error)
    if isinstance(error, ResourceExhausted):  # a busy primary's refused Prefill says when to retry
        error.retry_after_ms = _retry_after_ms(e)
    return error


def _retry_after_ms(e: grpc.RpcError) -> int | None:
    """The retry-after-ms hint in a failed call's trailing metadata (RETRY_AFTER_KEY), within
    MIN_RETRY_AFTER_MS..MAX_RETRY_AFTER_MS; None when it has none."""
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            with contextlib.suppress(ValueError):
                return max(MIN_RETRY_AFTER_MS, min(MAX_RETRY_AFTER_MS, int(value)))
    return None


def client_error(error: SpecdecError, request_id: str) -> SpecdecError:
    """What a client is told of `error`: its own fields' errors as they are; an internal service's
    failure without naming that service or its details (they belong in the log), as UNAVAILABLE
    (or the like) when retrying may help, else INTERNAL. Both name the request."""
    if getattr(error, "dependency", None) is None:
        return error
    if isinstance(error, StateLost):
        return Unavailable(
            "request_id", f"the stored state of request {request_id!r} was lost (the state store no longer holds it)"
        )
    if isinstance(error, _RETRYABLE):
        return type(error)("request_id", f"request {request_id!r} could not be completed now; retry later")
    return Internal("request_id", f"request {request_id!r} failed inside the service; the gateway log has the details")


class Backends:
    def __init__(
        self,
        primary_address: str,
        draft_address: str,
        validator_address: str,
        timeout_s: float,
        max_message_bytes: int = 128 << 20,
        is_logits_via_handle: bool = False,
        service_token: str | None = None,
    ) -> None:
        self.is_logits_via_handle = is_logits_via_handle  # logits through /dev/shm, primary -> validator
        # Reconnect quickly: a restarted service must be found again within a step or two
        # (gRPC's default backoff grows to two minutes).
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        # service_token: sent on every call (specdec.service.auth); None when the services run without one.
        self._metadata = token_metadata(service_token)
        self._channels = [
            grpc.aio.insecure_channel(a, options=options, interceptors=aio_channel_interceptors())
            for a in (primary_address, draft_address, validator_address)
        ]
        self.primary = primary_pb2_grpc.PrimaryServiceStub(self._channels[0])
        self.draft = draft_pb2_grpc.DraftServiceStub(self._channels[1])
        self.validator = validator_pb2_grpc.ValidatorServiceStub(self._channels[2])
        self.timeout_s = timeout_s
        # Other requests' rows in the primary's engine step, as its latest Verify/Decode reported them
        # (the step's rows less the calling request's own): a new request's controller starts from
        # this load instead of from an idle primary.
        self.other_step_rows = 0
        # request id -> the primary's lease on its KV slot (PrefillResponse.kv_lease): only the
        # gateway instance that prefilled a request can step or release it.
        self._kv_leases: dict[str, str] = {}

    async def close(self) -> None:
        for c in self._channels:
            await c.close()

    async def _call(self, service: str, method, request):
        try:
            return await method(request, timeout=self.timeout_s, metadata=outgoing_metadata(self._metadata))
        except grpc.RpcError as e:
            raise _domain_error(e, service) from None

    # --- primary ---------------------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        r = await self._call("primary", self.primary.GetModelInfo, primary_pb2.GetModelInfoRequest())
        return ModelInfo(
            r.vocab_size,
            tuple(r.eos_token_ids),
            r.max_context_length,
            r.instance_id,
            {c.num_nodes: c.time_ms for c in r.verify_costs},
        )

    async def is_primary_serving(self, timeout_s: float) -> bool:
        """One grpc.health.v1 Check of the primary's server: SERVING within timeout_s."""
        stub = health_pb2_grpc.HealthStub(self._channels[0])
        try:
            r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    async def primary_stats(self, timeout_s: float) -> PrimaryStats:
        try:
            r = await self.primary.GetStats(
                primary_pb2.GetStatsRequest(), timeout=timeout_s, metadata=outgoing_metadata(self._metadata)
            )
        except grpc.RpcError as e:
            raise _domain_error(e, "primary") from None
        return PrimaryStats(
            r.num_active_requests,
            r.kv_bytes,
            r.max_kv_bytes,
            r.queue_depth,
            r.prefix_block_tokens,
            r.num_prefix_query_tokens,
            r.num_prefix_reused_tokens,
        )

    async def prefill(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int = 0,
        *,
        return_features: bool = False,
        prompt_logprobs: LogprobsRequest | None = None,
        response_format: ResponseFormat | None = None,
    ) -> Prefilled:
        """`num_prompt_tokens`: how many of `token_ids` are the prompt (a recovery sends the generated
        tokens after it). The lease this gateway holds on the request, if any, goes with it: the
        primary lets only its holder replace a live slot (else ALREADY_EXISTS). `return_features`: the
        last prefilled row's features come back (Prefilled.features). `response_format`: the primary
        begins compiling it for the request's runs beside the prefill."""
        r = await self._call(
            "primary",
            self.primary.Prefill,
            primary_pb2.PrefillRequest(
                request_id=request_id,
                token_ids=token_ids,
                num_prompt_tokens=num_prompt_tokens,
                kv_lease=self._kv_leases.get(request_id, ""),
                return_features=return_features,
                prompt_logprobs=_logprobs_pb(prompt_logprobs),
                response_format=None if response_format is None else pb.response_format_to_pb(response_format),
            ),
        )
        self._kv_leases[request_id] = r.kv_lease
        return Prefilled(
            r.time_ms,
            r.num_cached_prompt_tokens,
            r.kv_lease,
            r.features if r.HasField("features") else None,
            _logprobs(r.prompt_logprobs),
            r.precision,
        )

    def adopt_kv_lease(self, request_id: str, kv_lease: str) -> None:
        """Hold a lease another gateway stored (a resumed request): its slot may still be live."""
        if kv_lease:
            self._kv_leases[request_id] = kv_lease

    def forget_kv_lease(self, request_id: str) -> None:
        """Drop the lease held on request_id's slot without a Release (a request that ended on
        another node after a failover: its slot here expires with its lease)."""
        self._kv_leases.pop(request_id, None)

    async def verify(
        self,
        request_id: str,
        accepted_nodes: Sequence[int],
        committed_token_ids: Sequence[int],
        tree: DraftTree,
        logits_format: str,
        allowed: TokenBitmask | None = None,
        *,
        return_features: bool = False,
        logprobs: LogprobsRequest | None = None,
        sampling: SamplingParams | None = None,
    ) -> Verified:
        """`allowed`: the grammar's packed mask of the tree's N + 1 rows, or None. `return_features`: the
        rows' features come back (Verified.features), beside the logits in shared memory when those are.
        `sampling`: the request's, when it has penalties or a logit_bias; the primary then returns every
        row processed from its node's history (VerifyRequest.sampling)."""
        r = await self._call(
            "primary",
            self.primary.Verify,
            VerifyArgs(
                request_id,
                committed_token_ids=tuple(committed_token_ids),
                accepted_nodes=tuple(accepted_nodes),
                tree_token_ids=tree.token_ids,
                tree_parents=tree.parents,
                lookahead_token_ids=tree.lookahead_token_ids,
                lookahead_parents=tree.lookahead_parents,
                logits_format=logits_format,
                return_handle=self.is_logits_via_handle,
                allowed_tokens=allowed,
                kv_lease=self._kv_leases.get(request_id, ""),
                return_features=return_features,
                logprobs=logprobs,
                sampling=sampling,
            ).to_pb(),
        )
        own = 1 + len(tree.token_ids) + len(tree.lookahead_token_ids)  # the pending row, the tree's, lookahead's
        self.other_step_rows = max(0, r.num_step_rows - own)
        return Verified(
            r.logits,
            tuple(r.argmax_token_ids),
            r.forward_ms,
            tuple(r.lookahead_argmax_token_ids),
            self.other_step_rows,
            r.features if r.HasField("features") else None,
            _logprobs(r.node_logprobs),
            _logprobs(r.row_logprobs),
        )

    async def decode_stream(
        self,
        request_id: str,
        accepted_nodes: Sequence[int],
        committed_token_ids: Sequence[int],
        sampling: SamplingParams,
        position: int,
        allowed: TokenBitmask | None = None,
        *,
        max_tokens: int = 1,
        stop_token_ids: Sequence[int] = (),
        response_format: ResponseFormat | None = None,
        logprobs: LogprobsRequest | None = None,
        num_context_tokens: int = 0,
        stop_at_repeat_tokens: int = 0,
        lookup_draft_length: int = 0,
        steps_per_message: int = 1,
        stop_strings: Sequence[str] = (),
    ) -> AsyncGenerator[Decoded, None]:
        """Plain steps from committed_token_ids (PrimaryService.DecodeStream): one Decoded per engine
        step as the primary decides it, the last with is_run_end. `max_tokens` > 1 (no `allowed`): a
        run of that many steps in one call, ending early after a token of `stop_token_ids`; the primary
        commits every token of it but the last. With `response_format` (instead of `allowed`) the
        primary masks every token by its own state of the request's grammar. `num_context_tokens`: the
        context the caller knows before committed_token_ids (the primary drops tokens of a cancelled run
        past it). `stop_at_repeat_tokens` > 0: the run also ends where the context's last that many
        tokens occurred earlier. `lookup_draft_length` > 0: the primary drafts the run's copies itself,
        up to that many tokens a step (DecodeRequest.lookup_draft_length). `steps_per_message` > 1:
        after the run's first step, each Decoded carries up to that many steps (Decoded.num_steps), and
        one ends early after a step that completes one of `stop_strings` (DecodeRequest.stop_strings).
        Closing the iterator early (aclose, or cancelling the awaiting task) cancels the call: the
        primary stops the run at its next step and keeps the request open."""
        request = primary_pb2.DecodeRequest(
            request_id=request_id,
            accepted_nodes=accepted_nodes,
            committed_token_ids=committed_token_ids,
            sampling=pb.sampling_to_pb(sampling),
            position=position,
            allowed_tokens=_mask(allowed),
            kv_lease=self._kv_leases.get(request_id, ""),
            max_tokens=max_tokens,
            stop_token_ids=stop_token_ids,
            response_format=None if response_format is None else pb.response_format_to_pb(response_format),
            num_context_tokens=num_context_tokens,
            stop_at_repeat_tokens=stop_at_repeat_tokens,
            lookup_draft_length=lookup_draft_length,
            steps_per_message=steps_per_message,
            stop_strings=stop_strings,
            logprobs=_logprobs_pb(logprobs),
        )
        async with contextlib.aclosing(self._streamed(request)) as messages:  # closed with this one: the call too
            async for decoded in messages:
                yield decoded

    async def _streamed(self, request: primary_pb2.DecodeRequest) -> AsyncGenerator[Decoded, None]:
        """DecodeStream's messages as Decoded. No deadline on the whole call: a run goes on to its
        request's end, minutes of steps for a long answer under load. Each message must come within
        timeout_s of the last instead, so a hung primary still fails the run then (DEADLINE_EXCEEDED,
        as the call's deadline did)."""
        call = self.primary.DecodeStream(request, metadata=outgoing_metadata(self._metadata))
        try:
            while True:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        r = await call.read()
                except TimeoutError:
                    raise DeadlineExceeded(
                        "primary", f"no step of the decode stream within {self.timeout_s:g} s", dependency="primary"
                    ) from None
                if r is grpc.aio.EOF:
                    return
                decoded = _decoded(r)
                self.other_step_rows = decoded.other_step_rows
                yield decoded
        except grpc.RpcError as e:
            raise _domain_error(e, "primary") from None
        finally:
            call.cancel()  # a no-op once the call is over

    async def release_primary(self, request_id: str) -> None:
        release = primary_pb2.PrimaryServiceReleaseRequest(
            request_id=request_id, kv_lease=self._kv_leases.pop(request_id, "")
        )
        await self._call("primary", self.primary.Release, release)

    # --- draft -------------------------------------------------------------------------------

    async def propose(self, args: ProposeArgs) -> DraftTree:
        """The draft pool's proposal for one step, as a tree (ProposeArgs: what a call carries)."""
        r = await self._call("draft", self.draft.Propose, args.to_pb())
        return DraftTree(
            tuple(r.tree.token_ids),
            tuple(r.tree.parents),
            tuple(r.node_sources),
            tuple(r.decoders),
            {s.name: s.time_ms for s in r.decoder_stats},
            r.time_ms,
            tuple(r.lookahead.token_ids),
            tuple(r.lookahead.parents),
            tuple((c.leaf, c.decoder, tuple(c.token_ids)) for c in r.continuations),
        )

    async def draft_pool_info(self) -> PoolInfo:
        """The strategies the draft pool offers, and the costs it measured."""
        r = await self._call("draft", self.draft.GetPoolInfo, draft_pb2.GetPoolInfoRequest())
        return PoolInfo(
            tuple(r.strategies),
            {c.strategy: (c.fixed_ms, c.per_token_ms) for c in r.draft_costs},
            {p.strategy: tuple(p.acceptance_by_depth) for p in r.acceptance_priors},
        )

    async def prepare_grammar(self, response_format: ResponseFormat) -> None:
        """Have the draft pool compile a request's response format before its first Propose."""
        request = draft_pb2.PrepareGrammarRequest(response_format=pb.response_format_to_pb(response_format))
        await self._call("draft", self.draft.PrepareGrammar, request)

    async def release_draft(self, request_id: str, is_finished: bool, new_token_ids: Sequence[int] = ()) -> None:
        """The pool forgets the request; a finished one's output joins its suffix index, the tokens
        since its last Propose (`new_token_ids`) included."""
        await self._call(
            "draft",
            self.draft.Release,
            draft_pb2.DraftServiceReleaseRequest(
                request_id=request_id, is_finished=is_finished, new_token_ids=new_token_ids
            ),
        )

    # --- validator ---------------------------------------------------------------------------

    async def validate(
        self,
        request_id: str,
        mode: AcceptanceMode,
        sampling: SamplingParams,
        acceptance_threshold: float,
        position: int,
        tree: DraftTree,
        verified: Verified,
        allowed: TokenBitmask | None = None,
        is_bonus_scored: bool = False,
    ) -> Validation:
        r = await self._call(
            "validator",
            self.validator.Validate,
            validator_pb2.ValidateRequest(
                request_id=request_id,
                mode=acceptance_mode.to_pb(mode),
                sampling=pb.sampling_to_pb(sampling),
                acceptance_threshold=acceptance_threshold,
                position=position,
                tree=common_pb2.TokenTree(token_ids=tree.token_ids, parents=tree.parents),
                target_logits=verified.logits,
                target_argmax_token_ids=verified.argmax_token_ids,
                allowed_tokens=_mask(allowed),
                return_bonus_logprob=is_bonus_scored,
            ),
        )
        return Validation(
            tuple(r.accepted_nodes),
            r.bonus_token,
            tuple(r.accepted_entropies),
            tuple(r.rejected_entropies),
            r.bonus_logprob if is_bonus_scored else None,
        )
