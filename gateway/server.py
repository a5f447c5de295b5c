"""GenerationService servicer (the public API): protobuf -> RequestLoop -> protobuf.

With API keys (specdec.service.api_keys) every call names its tenant, and a request belongs to the
tenant that made it: the id the client sees, "order-1", is "<tenant>/order-1" everywhere behind
the gateway (state store, primary, draft pool). Another tenant's "order-1" is another request,
and GetRequest/Cancel of an id the caller's tenant does not hold is NOT_FOUND.

A generation starts when admission control (gateway.admission) gives it a slot; until then it is
stored as QUEUED, and a full queue refuses it before anything is stored.

The servicer runs on a grpc.aio server and everything behind it is asynchronous too: the
internal services through grpc.aio stubs (gateway.backends), the state store through an async
client (redis.asyncio), and each admitted request's loop (gateway.loop) is a coroutine in a task
of its own. So a request, open stream or queued one holds no thread, only memory, and the
gateway's one event loop interleaves every request's steps. The loop's task hands each step's
output to the call's coroutine through an asyncio queue; a client that goes away (its coroutine
cancelled) sets the loop's cancel event: the loop stops within a step and stores CANCELLED.
Only CPU work that can take long (a schema's first compile, in _prepare) runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence

import structlog

from gateway.admission import Admission, QueueFull, Ticket
from gateway.backends import Backends, ModelInfo, client_error
from gateway.chat import PromptEncoder
from gateway.call_deadlines import DEFAULT_FLOOR_S, CallDeadlines, DeadlineRule
from gateway.dependencies import DependencyState
from gateway.config import GatewayConfig
from gateway.controller import ControllerConfig
from gateway.acceptance_memory import AcceptanceMemory
from gateway.cost_model import cost_model_for
from gateway.step_costs import StepCosts
from specdec.grammar.compiling import Grammars
from gateway.loop import RequestLoop
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.node_pool import Node, NodePool
from gateway.output import add_stored
from gateway.owner_probe import OwnerProbe
from gateway.params import check_end_tokens, check_offered, params_from_pb, params_to_json
from gateway.resume import FINISH_REASONS, Resumption
from gateway.state_retry import give_up_at, with_state_retries
from gateway.stats import RequestStats
from gateway.tool_calls import Piece, read_answer, reader_for
from gateway.tools import ToolSpec, tool_spec_from_pb
from gateway.tokenization import Tokenization
from specdec import pb
from specdec.context_room import check_fits
from specdec.errors import (
    RETRY_AFTER_KEY,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecdecError,
    Unavailable,
)
from specdec.grammar import GrammarCache, GrammarTokenizerInfo
from specdec.grammar.compiler import GrammarCacheConfig
from specdec.logprobs import TokenLogprob
from specdec.request_id import TENANT_SEPARATOR, tenant_of
from specdec.service.api_keys import ApiKeys
from specdec.model.tokenizer import Tokenizer
from specdec.state_store import AsyncStateStore, RequestStatus
from specdec.strategies import MEASURED_STRATEGIES
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

# While the draft pool offers a strategy it has not measured yet (its weights not attached), its
# GetPoolInfo is asked again at a request's start at most this often.
POOL_INFO_RETRY_S = 5.0
# A request that finds the pool's offer unknown waits for its GetPoolInfo at most this long, then
# starts on the defaults (which leave out what only some pools offer) and without the check of the
# strategies it names. A pool answers in milliseconds, in seconds while a loaded machine starts it.
POOL_INFO_WAIT_S = 10.0
_STEP, _FAILED, _DONE = "step", "failed", "done"  # what a loop's task hands its call's coroutine
STATUSES = {
    RequestStatus.QUEUED: gateway_pb2.REQUEST_STATUS_QUEUED,
    RequestStatus.RUNNING: gateway_pb2.REQUEST_STATUS_RUNNING,
    RequestStatus.FINISHED: gateway_pb2.REQUEST_STATUS_FINISHED,
    RequestStatus.CANCELLED: gateway_pb2.REQUEST_STATUS_CANCELLED,
    RequestStatus.FAILED: gateway_pb2.REQUEST_STATUS_FAILED,
}


class _Retried(Exception):
    """A request id stored already with the same parameters and prompt: the client retries it (its
    gateway died, its connection dropped); the call follows the stored request (gateway.follow)."""


def controller_config_for(acceptance_priors: Mapping[str, Sequence[float]]) -> ControllerConfig:
    """The controller's settings with each drafter's validation acceptance (by depth, GetPoolInfo)
    as its prior alpha: their mean, the per-token acceptance of the geometric model that the
    controller fits (values outside [0, 1] or none: that drafter keeps the task type's prior).

    # E.g. {"feature": (0.7, 0.6, 0.5)} -> decoder_prior_acceptance (("feature", 0.6), ("prediction", 0.9)),
    #   the second the default prior of the prediction decoder
    """
    priors = tuple(
        (name, sum(by_depth) / len(by_depth))
        for name, by_depth in sorted(acceptance_priors.items())
        if by_depth and all(0.0 <= a <= 1.0 for a in by_depth)
    )
    defaults = tuple(p for p in ControllerConfig().decoder_prior_acceptance if p[0] not in acceptance_priors)
    return ControllerConfig(decoder_prior_acceptance=priors + defaults)


def _with_tool_calls(finish_reason: gateway_pb2.FinishReason, has_calls: bool) -> gateway_pb2.FinishReason:
    """TOOL_CALLS for an answer that ended by itself (end of sequence, stop string) with calls."""
    is_ended = finish_reason in (gateway_pb2.FINISH_REASON_EOS, gateway_pb2.FINISH_REASON_STOP)
    return gateway_pb2.FINISH_REASON_TOOL_CALLS if has_calls and is_ended else finish_reason


class _CallPieces:
    """A stream's content and tool-call pieces, read from its messages' text as they go out (the
    request's own GenerateStream and a retry's alike); tools None: the text is the answer."""

    def __init__(self, tools: ToolSpec | None) -> None:
        self.reader = None if tools is None else reader_for(tools)
        self.num_calls = 0

    def read(self, message: gateway_pb2.GenerateStreamResponse) -> None:
        """Put on message the content and call pieces of its text; on the final one also what the
        reader held back to the end, and the finish reason TOOL_CALLS when the answer made calls."""
        if self.reader is None:
            return
        piece = self.reader.add(message.text)
        if message.is_final:  # a retry's final message carries the text held back to the end
            last = self.reader.finish()
            piece = Piece(piece.content + last.content, [*piece.deltas, *last.deltas])
        message.content = piece.content
        message.tool_calls.extend(
            gateway_pb2.ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments) for d in piece.deltas
        )
        self.num_calls += sum(1 for d in piece.deltas if d.id)
        if message.is_final:
            message.finish_reason = _with_tool_calls(message.finish_reason, self.num_calls > 0)


def _check_answerable_on_retry(request: gateway_pb2.GenerateRequest) -> None:
    """FAILED_PRECONDITION for a retry of a request that asked for log probabilities: the state store
    keeps a request's tokens, not their log probabilities (docs/logprobs.md), so a retry cannot give
    the answer the request asked for, and one without them would read as complete (an OpenAI client's
    logprobs silently missing). GetRequest still gives the stored tokens and text."""
    if request.HasField("logprobs"):
        raise FailedPrecondition(
            "logprobs",
            f"request {request.request_id!r} asked for log probabilities, which are not stored: a retry cannot "
            "answer them (GetRequest gives its tokens and text; another request id runs it again)",
        )


async def _in_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) in asyncio's default thread pool (CPU work that can take long: a
    schema's first compile), with the caller's logging context."""
    return await asyncio.to_thread(functools.partial(fn, *args, **kwargs))


class GenerationServicer(Resumption, gateway_pb2_grpc.GenerationServiceServicer):
    nodes: NodePool | None = None  # see __init__

    def __init__(
        self,
        config: GatewayConfig,
        backends: Backends,
        store: AsyncStateStore,
        tokenizer: Tokenizer,
        model: ModelInfo,
        owner: str,
        metrics: GatewayMetrics | None = None,
        grammars: Grammars | None = None,
        api_keys: ApiKeys | None = None,
        nodes: NodePool | None = None,
        owner_probe: OwnerProbe | None = None,
    ) -> None:
        """owner: this gateway's owner id in the store (gateway.owner_id); owner_probe: asks other
        gateways whether they still answer, to adopt their requests when not (gateway.resume)."""
        self.owner_probe = owner_probe
        self.config, self.backends, self.store, self.tokenizer, self.model = config, backends, store, tokenizer, model
        # --nodes: the nodes new requests are routed to, and a request fails over between (None: the
        # one node of `backends`). `backends` is then one of theirs, asked for the model and the pool.
        self.nodes = nodes
        self.max_state_retry_s = config.max_state_retry_s  # a write waits this long for the store to answer
        self.owner, self.metrics, self.api_keys = owner, metrics, api_keys
        self.prompt_encoder = PromptEncoder(tokenizer)
        self.tokenization = Tokenization(tokenizer, self.prompt_encoder, model.vocab_size)
        # Whether the validator and the draft service answer, for all requests (gateway.dependencies).
        self.validator_state, self.draft_state = (
            DependencyState(name, on_change=self._availability_recorder(name)) for name in ("validator", "draft")
        )
        # Their calls' deadlines, from the latency of their recent calls (gateway.call_deadlines).
        self.call_deadlines = CallDeadlines(
            DeadlineRule(floor_s=min(DEFAULT_FLOOR_S, config.rpc_timeout_s), max_s=config.rpc_timeout_s)
        )
        self.grammars = grammars or Grammars(
            GrammarCache(
                GrammarTokenizerInfo.from_tokenizer(tokenizer, model.vocab_size),
                GrammarCacheConfig(config.grammar.max_cached_grammars),
            ),
            config.grammar,
        )
        # The adaptive controller's cost model: this primary's measured verify curve + the gateway's settings.
        self.cost_model = cost_model_for(model.verify_costs_ms, config.costs)
        # What its requests' steps cost and what their drafts earned, measured across requests: the
        # controller's overheads (gateway.step_costs) and each new request's priors (gateway.acceptance_memory).
        self.step_costs = StepCosts()
        self.acceptance_memory = AcceptanceMemory()
        self._offered_strategies: frozenset[str] | None = None  # the draft pool's, once it answered
        # The adaptive controller's settings: the defaults, with the pool's trained drafters' own
        # acceptance as their priors once it reported them (controller_config_for).
        self.controller_config: ControllerConfig | None = None
        self._is_cost_pending = False  # the pool offers a strategy it has not measured yet (asked again)
        self._pool_info_at = 0.0  # monotonic time of the last GetPoolInfo
        self._pool_info_task: asyncio.Task | None = None  # the GetPoolInfo in flight
        self._active: dict[str, threading.Event] = {}
        self.admission = Admission(config.max_active_requests, config.max_queued_requests, metrics)
        self._lock = threading.Lock()
        # Running loops' and not-awaited writes' tasks (the event loop keeps only weak references).
        self._background: set[asyncio.Task] = set()
        self.log = structlog.get_logger("gateway")

    # --- RPCs -------------------------------------------------------------------------------

    async def Generate(self, request, context):
        arrived_s = time.perf_counter()
        try:
            client_id, loop, ticket = await self._start(request, context, is_streamed=False)
        except _Retried:
            return await self._retried_answer(request, context)
        async with contextlib.aclosing(self._run(loop, client_id, ticket, arrived_s)) as steps:
            async for _ in steps:
                pass
        o = loop.outcome
        response = gateway_pb2.GenerateResponse(
            request_id=client_id,
            text=o.text,
            token_ids=o.token_ids,
            finish_reason=FINISH_REASONS[o.finish_reason],
            stats=o.stats.to_pb(),
            logprobs=self._logprobs_pb(o.logprobs),
            prompt_logprobs=self._logprobs_pb(o.prompt_logprobs),
        )
        if loop.params.tools.is_parsed:
            content, calls = read_answer(loop.params.tools, o.text)
            response.content = content
            response.tool_calls.extend(gateway_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
            response.finish_reason = _with_tool_calls(response.finish_reason, bool(calls))
        return response

    async def GenerateStream(self, request, context):
        arrived_s = time.perf_counter()
        try:
            client_id, loop, ticket = await self._start(request, context, is_streamed=True)
        except _Retried:
            async for message in self._retried_stream(request, context):
                yield message
            return
        calls = _CallPieces(loop.params.tools if loop.params.tools.is_parsed else None)
        is_prompt_sent = False  # the prompt's log probabilities ride on the first message
        async with contextlib.aclosing(self._run(loop, client_id, ticket, arrived_s)) as steps:
            async for out in steps:
                message = gateway_pb2.GenerateStreamResponse(
                    request_id=client_id,
                    text=out.text,
                    token_ids=out.token_ids,
                    logprobs=self._logprobs_pb(out.logprobs),
                    prompt_logprobs=[] if is_prompt_sent else self._logprobs_pb(loop.prompt_logprobs),
                )
                is_prompt_sent = True
                calls.read(message)
                yield message
        o = loop.outcome
        final = gateway_pb2.GenerateStreamResponse(
            request_id=client_id,
            is_final=True,
            finish_reason=FINISH_REASONS[o.finish_reason],
            stats=o.stats.to_pb(),
            prompt_logprobs=[] if is_prompt_sent else self._logprobs_pb(o.prompt_logprobs),
        )
        calls.read(final)
        yield final

    async def Tokenize(self, request, context):
        self._tenant(context)  # a valid key, as Generate asks
        which = request.WhichOneof("input")
        as_generate = gateway_pb2.GenerateRequest()
        if which == "prompt":
            as_generate.prompt = request.prompt
        elif which == "chat":
            as_generate.chat.CopyFrom(request.chat)
        params = params_from_pb(as_generate, self.config.limits, self.config.speculation)
        ids, texts = await _in_thread(self.tokenization.encode, params)
        return gateway_pb2.TokenizeResponse(token_ids=ids, token_texts=texts, max_model_len=self.model.max_context)

    async def Detokenize(self, request, context):
        self._tenant(context)
        text = await _in_thread(self.tokenization.decode, list(request.token_ids), request.include_special_tokens)
        return gateway_pb2.DetokenizeResponse(text=text)

    async def DescribeModel(self, request, context):
        self._tenant(context)
        d = self.tokenization.describe(self.model.max_context, self.model.eos_token_ids)
        return gateway_pb2.DescribeModelResponse(
            max_model_len=d.max_model_len,
            vocab_size=d.vocab_size,
            eos_token_ids=d.eos_token_ids,
            special_tokens=d.special_tokens,
            chat_template=d.chat_template,
        )

    def _logprobs_pb(self, values: Sequence[TokenLogprob]) -> list:
        return [pb.token_logprob_to_pb(v, self.tokenization.token_text, self.tokenization.token_bytes) for v in values]

    async def _retried_answer(self, request, context) -> gateway_pb2.GenerateResponse:
        """Generate's answer to a retry of a stored request (followed), its calls read from its text
        as the request's own answer reads them."""
        _check_answerable_on_retry(request)
        final = None
        async for message in self.followed(request, context):
            final = message
        assert final is not None and final.is_final
        response = gateway_pb2.GenerateResponse(
            request_id=final.request_id,
            text=final.text,
            token_ids=final.token_ids,
            finish_reason=final.finish_reason,
            stats=final.stats,
        )
        tools = self._retried_tools(request)
        if tools is not None:
            content, calls = read_answer(tools, final.text)
            response.content = content
            response.tool_calls.extend(gateway_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
            response.finish_reason = _with_tool_calls(response.finish_reason, bool(calls))
        return response

    async def _retried_stream(self, request, context):
        """GenerateStream's messages to a retry of a stored request (followed), with content and
        call pieces as the request's own stream has them."""
        _check_answerable_on_retry(request)
        calls = _CallPieces(self._retried_tools(request))
        async for message in self.followed(request, context, is_streamed=True):
            calls.read(message)
            yield message

    def _retried_tools(self, request: gateway_pb2.GenerateRequest) -> ToolSpec | None:
        """The tools whose calls a retried request's answer carries (None: its text is the answer)."""
        try:
            tools = tool_spec_from_pb(request, self.config.limits.max_schema_depth)
        except InvalidArgument:
            return None
        return tools if tools.is_parsed else None

    async def Cancel(self, request, context):
        request_id = self._scoped(context, pb.request_id_from_pb(request.request_id))
        with self._lock:
            event = self._active.get(request_id)
        if event is not None:
            event.set()
        is_running_here = event is not None
        with self._told_as_client(request_id, request.request_id):
            state = await self.store.load(request_id)
            if state is None and not is_running_here:
                raise NotFound("request_id", f"no request {request.request_id!r}")
            # Another gateway running it sees the status at its next per-step write and stops.
            try:
                was_active = await self.store.set_status(request_id, RequestStatus.CANCELLED, finish_reason="cancelled")
            except NotFound:  # the store lost the record: the loop here stops and writes it back cancelled
                if not is_running_here:
                    raise
                was_active = False
        return gateway_pb2.CancelResponse(was_active=was_active or is_running_here)

    async def GetRequest(self, request, context):
        request_id = self._scoped(context, pb.request_id_from_pb(request.request_id))
        client_id = request.request_id
        with self._told_as_client(request_id, client_id):
            state = await self.store.load(request_id)
        if state is None:
            raise NotFound("request_id", f"no request {client_id!r} (unknown or expired)")
        if not state.status.is_terminal and state.owner != self.owner:  # if its gateway is gone, it goes on here
            self._in_background(self.adopt_if_abandoned(state), name=f"adopt {request_id}")
        from gateway.params import params_pb_from_json

        output = self._stored_output(state.params)  # the text cut at a stop string, as Generate's
        add_stored(output, state.token_ids, [])
        if state.status.is_terminal or output.is_stopped:
            output.end(is_flushed=not output.is_stopped)
        else:  # its last token may end inside a character that its next token completes: not text yet
            output.text += output.detok.held_back()
        return gateway_pb2.GetRequestResponse(
            status=STATUSES[state.status],
            params=params_pb_from_json(state.params),
            token_ids=state.token_ids,
            text=output.text,
            stats=RequestStats.of_record(state).to_pb(),
            finish_reason=FINISH_REASONS.get(state.finish_reason, gateway_pb2.FINISH_REASON_UNSPECIFIED),
            error=state.error,
        )

    # --- helpers ------------------------------------------------------------------------------

    def _tenant(self, context) -> str:
        """The caller's tenant ("" without API keys; Unauthenticated without a valid key)."""
        return "" if self.api_keys is None else self.api_keys.tenant(context.invocation_metadata())

    def _scoped(self, context, client_id: str) -> str:
        """The id behind the gateway of the caller's request client_id (Unauthenticated without a valid key)."""
        if self.api_keys is None:
            return client_id
        prefix = f"{self._tenant(context)}{TENANT_SEPARATOR}"
        if len(prefix) + len(client_id) > pb.MAX_REQUEST_ID_CHARS:
            raise InvalidArgument("request_id", f"must be at most {pb.MAX_REQUEST_ID_CHARS - len(prefix)} characters")
        return prefix + client_id

    def _tenant_of(self, request_id: str) -> str:
        """The tenant of a request id behind the gateway (the inverse of _scoped's prefix)."""
        return tenant_of(request_id) if self.api_keys is not None else ""

    async def _start(self, request, context, *, is_streamed: bool) -> tuple[str, RequestLoop, Ticket]:
        """(the id the client sees, the request's loop, its admission slot), once admission let it in;
        _run() it next, which gives the slot back when the loop ends; `is_streamed`: a GenerateStream
        (make_loop)."""
        client_id = pb.request_id_from_pb(request.request_id) if request.request_id else uuid.uuid4().hex
        request_id = self._scoped(context, client_id)
        tenant = self._tenant(context)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        if request.request_id and await self._is_stored_as_is(request_id, request, client_id):
            raise _Retried()
        # the pool's strategies before the checks, which run in a thread (a first compile): a request's
        # own are checked against them, and the defaults of one that names none are those offered
        offered = await self._offered_by_pool(remaining)
        params, prompt_ids, grammar, stored = await _in_thread(self._prepare, request, client_id, deadline, offered)
        try:  # a slot now, a place in the queue, or refused before anything is stored
            ticket = self.admission.enter(tenant)
        except QueueFull as e:
            # a client's retry of a stored request follows it and takes no slot: not refused for a
            # full queue (its gateway died, and its requests' load came here)
            if request.request_id and await self._is_stored_request(request_id, stored, prompt_ids):
                raise _Retried() from None
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(e.retry_after_ms)),))
            raise
        is_queued = not ticket.is_granted  # as admission decided: a queued ticket may be granted meanwhile
        await self._store_admitted(request_id, client_id, stored, prompt_ids, ticket, is_queued, deadline)
        cancel = threading.Event()
        with self._lock:
            self._active[request_id] = cancel
        context.add_done_callback(lambda _: cancel.set())  # the call ended (or its client went away)
        try:
            with self._told_as_client(request_id, client_id):
                queue_s = await self._await_turn(request_id, ticket, is_queued, deadline, cancel)
            loop = self.make_loop(
                request_id,
                params,
                prompt_ids,
                cancel,
                deadline,
                grammar=grammar,
                stored_params=params_to_json(stored),
                node=self._place(request_id, prompt_ids),
                is_streamed=is_streamed,
            )
        except BaseException as e:
            ticket.release()
            self._end_unlooped(request_id, e)
            raise
        loop.stats.queue_ms = queue_s * 1000
        return client_id, loop, ticket

    async def _is_stored_as_is(self, request_id: str, request, client_id: str) -> bool:
        """Whether request_id holds this very request already (its parameters, prompt included): a
        client's retry, which follows the stored request (_Retried) and needs none of a new request's
        preparation. Asked first: a retry waited for the pool's offer and compiled its schema (a
        second's CPU, or RESOURCE_EXHAUSTED with many compiles under way), and was refused where this
        gateway's pool or limits now refuse what the request's first gateway admitted. False when the
        store does not answer (the request goes on; its create finds a retry then)."""
        stored = request.__class__()
        stored.CopyFrom(request)
        stored.request_id = client_id
        try:
            state = await self.store.load(request_id)
        except SpecdecError:
            return False
        return state is not None and state.params == params_to_json(stored)

    async def _is_stored_request(self, request_id: str, stored, prompt_ids) -> bool:
        """Whether request_id holds this very request (its parameters and prompt), running or ended;
        False too when the store does not answer (the caller's own answer stands)."""
        try:
            state = await self.store.load(request_id)
        except SpecdecError:
            return False
        return (
            state is not None
            and state.params == params_to_json(stored)
            and list(state.prompt_token_ids) == list(prompt_ids)
        )

    async def _store_admitted(
        self,
        request_id: str,
        client_id: str,
        stored,
        prompt_ids,
        ticket: Ticket,
        is_queued: bool,
        deadline: float | None,
    ) -> None:
        """Store the new request (QUEUED, or RUNNING with a slot granted); the slot is given back
        when that fails, and a client that goes away meanwhile finds its request stored as cancelled."""
        status = RequestStatus.QUEUED if is_queued else RequestStatus.RUNNING
        creating = asyncio.ensure_future(self._create(request_id, client_id, stored, prompt_ids, status, deadline))
        try:
            await asyncio.shield(creating)
        except asyncio.CancelledError:  # the client went away: once stored, it is stored as cancelled
            ticket.release()

            def mark_cancelled(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    self._in_background(
                        self.store.set_status(request_id, RequestStatus.CANCELLED, finish_reason="cancelled")
                    )

            creating.add_done_callback(mark_cancelled)
            raise
        except BaseException:
            ticket.release()
            raise

    def _end_unlooped(self, request_id: str, error: BaseException) -> None:
        """A stored request that failed before its loop: no loop will ever end it, so end it here (a
        no-op if the queue already did)."""
        self._forget(request_id)
        if isinstance(error, asyncio.CancelledError):  # the client went away
            self._in_background(self.store.set_status(request_id, RequestStatus.CANCELLED, finish_reason="cancelled"))
        elif not isinstance(error, (Cancelled, DeadlineExceeded)):
            self._in_background(self.store.set_status(request_id, RequestStatus.FAILED, error=str(error)))

    def _prepare(self, request, client_id: str, deadline: float | None, offered: frozenset[str] | None):
        """(params, prompt token ids, grammar state or None, the request as stored): every check that
        can refuse the request, before anything is stored. `offered`: the draft pool's strategies
        (None: not asked, or the pool is down, and the request runs without drafts anyway)."""
        params = params_from_pb(request, self.config.limits, self.config.speculation, offered)
        pb.check_sampling_token_ids(params.sampling, self.model.vocab_size)
        if params.speculation.is_enabled and offered is not None:
            check_offered(request.speculation.strategies, offered)
        prompt_ids = self.prompt_encoder.encode(params)
        field = request.WhichOneof("input")
        field = {"chat": "chat.messages", "token_ids": "token_ids.ids"}.get(field, field)
        if params.prompt_token_ids is not None:
            self.tokenization.check_ids("token_ids.ids", prompt_ids)
        self.tokenization.check_ids("stop_token_ids", params.stop_token_ids)
        check_end_tokens(params, self.model.eos_token_ids)
        if not prompt_ids:
            raise InvalidArgument(field, "the prompt encodes to no tokens")
        check_fits(len(prompt_ids), self.model.max_context, field)  # as the primary's Prefill checks it
        # Compiled before anything is stored: a schema refused here leaves no trace.
        try:
            grammar = (
                None if params.response_format is None else self.grammars.new_state(params.response_format, deadline)
            )
        except (InvalidArgument, ResourceExhausted) as e:  # a bad schema, or one too slow to compile
            if not params.tools.is_forced:
                raise
            # the format is the tools' (the request has none of its own): name them, not response_format
            raise type(e)("tools", f"the calls' schema (from the tools' parameters) {e.message}") from None
        stored = request.__class__()
        stored.CopyFrom(request)
        stored.request_id = client_id
        return params, prompt_ids, grammar, stored

    async def _create(
        self, request_id: str, client_id: str, stored, prompt_ids, status: RequestStatus, deadline: float | None
    ) -> None:
        """Store the new request, retried while the store does not answer (gateway.state_retry). An
        attempt that timed out may still have landed (a stalled Redis runs it once it resumes): a retry
        that then finds the same parameters and prompt stored counts as done, not ALREADY_EXISTS. A
        client's retry of a stored request (same id, parameters and prompt) follows it (_Retried), even
        once it ended; another request under a stored id is ALREADY_EXISTS."""
        params = params_to_json(stored)
        is_retry = False

        async def create() -> None:
            nonlocal is_retry
            try:
                await self.store.create(request_id, params, prompt_token_ids=prompt_ids, status=status)
            except Unavailable:
                is_retry = True
                raise
            except AlreadyExists:
                state = await self.store.load(request_id)
                if state is None or state.params != params or list(state.prompt_token_ids) != list(prompt_ids):
                    raise
                # not this call's own write that landed: the client's retry of the same request, running
                # or ended (its gateway died before the client read the end): it follows the stored one.
                # A record that has tokens, an owner or an end is never a fresh create of this call, even
                # after an attempt of it failed (a retry that reached this gateway while Redis failed over)
                if not is_retry or state.token_ids or state.owner or state.status.is_terminal:
                    raise _Retried() from None

        with self._told_as_client(request_id, client_id):
            give_up = give_up_at(self.max_state_retry_s, deadline)
            await with_state_retries(create, give_up, log=self.log.bind(request_id=request_id))

    async def _await_turn(
        self, request_id: str, ticket: Ticket, is_queued: bool, deadline: float | None, cancel: threading.Event
    ) -> float:
        """Wait in the admission queue (is_queued: stored as QUEUED); the seconds waited. A request
        that leaves the queue (deadline, cancel, its client gone) is recorded as such and never
        reaches the primary."""
        if not is_queued:
            return await ticket.wait_async(deadline, cancel, request_id)
        try:
            queue_s = await ticket.wait_async(deadline, cancel, request_id)
            if cancel.is_set():  # at the very moment it was let in
                raise Cancelled("request_id", f"request {request_id!r} was cancelled while queued")
        except (Cancelled, DeadlineExceeded) as e:
            await self.store.set_status(
                request_id,
                RequestStatus.CANCELLED,
                finish_reason="cancelled" if isinstance(e, Cancelled) else "deadline",
            )
            raise
        try:
            is_running = await with_state_retries(
                lambda: self.store.set_status(request_id, RequestStatus.RUNNING),
                give_up_at(self.max_state_retry_s, deadline),
                cancel,
                self.log.bind(request_id=request_id),
            )
        except NotFound:  # the store lost the record (not ended): the loop's first write stores it again
            self.log.warning("the state store lost a queued request's record", request_id=request_id)
            is_running = True
        if not is_running:  # ended meanwhile
            raise Cancelled("request_id", f"request {request_id!r} was cancelled while queued")
        return queue_s

    async def _run(self, loop: RequestLoop, client_id: str, ticket: Ticket, arrived_s: float | None = None):
        """Each step's output of loop.run(), which runs in a task of its own (see _observed): a
        client that goes away cancels this coroutine, never the loop in the middle of a step. The
        loop's admission slot is given back when the loop ends; when this generator is closed
        before (the client went away), the loop is cancelled and stops within a step."""
        steps: asyncio.Queue = asyncio.Queue()
        arrived_s = time.perf_counter() if arrived_s is None else arrived_s  # the request's arrival, for its latencies

        async def drive() -> None:
            try:
                async for out in self._observed(loop, client_id, arrived_s):
                    steps.put_nowait((_STEP, out))
            except BaseException as e:  # noqa: BLE001 - handed to the coroutine, raised there
                steps.put_nowait((_FAILED, e))
                if isinstance(e, asyncio.CancelledError):  # shutdown: the task itself ends cancelled
                    raise
            else:
                steps.put_nowait((_DONE, None))

        worker = self._in_background(drive(), name=f"request-loop {loop.request_id}", is_logged=False)
        worker.add_done_callback(lambda _: self._end(loop.request_id, ticket))  # the slot goes on
        try:
            while True:
                kind, value = await steps.get()
                if kind is _STEP:
                    yield value
                elif kind is _FAILED:
                    raise value
                else:
                    return
        finally:
            if not worker.done():  # closed early: the client went away
                loop.cancel.set()

    def _end(self, request_id: str, ticket: Ticket) -> None:
        ticket.release()
        self._forget(request_id)

    def _in_background(self, coro, name: str | None = None, *, is_logged: bool = True) -> asyncio.Task:
        """coro in a task, not awaited (a request's loop, a cancelled call's last write), kept until
        it ends; an exception it ends with is logged when is_logged (a loop hands its own to its call)."""
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if is_logged and not t.cancelled() and t.exception() is not None:
                self.log.warning("background task failed", task=t.get_name(), error=str(t.exception()))

        task.add_done_callback(done)
        return task

    def close(self) -> None:
        """Cancel every running loop (each stops within a step and stores CANCELLED)."""
        if self._lease_task is not None:
            self._lease_task.cancel()
        with self._lock:
            for cancel in self._active.values():
                cancel.set()

    async def stop_loops(self, timeout_s: float) -> None:
        """close(), then wait (at most timeout_s) until every loop and pending write has ended: a
        gateway that shuts down leaves each of its requests stored as ended, not RUNNING, before its
        connections to the services and the store close under them."""
        self.close()
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    async def _offered_by_pool(self, remaining_s: float | None = None) -> frozenset[str] | None:
        """The strategies the draft pool offers, None while they are not known. Asked once, and again
        (at most every POOL_INFO_RETRY_S, at a request's start) while a strategy it offers has no
        measured cost yet: the pool measures its model-based drafters once the primary's weights
        attach, after it starts serving. Its measured costs replace the defaults in the cost model
        that the requests started from then on use.

        The question runs beside the requests, one at a time: only a request that finds the offer
        unknown waits for the answer, and then at most POOL_INFO_WAIT_S or its time left
        (`remaining_s`); the others start on what is known. Before, every request that found the cost pending
        waited for its GetPoolInfo, whose deadline is --rpc_timeout_s while few such calls are known,
        so a pool that hung then held a new request for a minute."""
        now = time.monotonic()
        is_due = self._offered_strategies is None or (
            self._is_cost_pending and now - self._pool_info_at >= POOL_INFO_RETRY_S
        )
        if is_due and self._pool_info_task is None and self.draft_state.is_retry_due():
            self._pool_info_at = now
            self._pool_info_task = self._in_background(self._ask_pool_info(), name="draft.GetPoolInfo")
        if self._offered_strategies is None and self._pool_info_task is not None:
            # not cancelled past the wait, nor raising here: still unknown, the request takes the defaults
            wait_s = POOL_INFO_WAIT_S if remaining_s is None else max(0.0, min(POOL_INFO_WAIT_S, remaining_s))
            await asyncio.wait({self._pool_info_task}, timeout=wait_s)
        return self._offered_strategies

    async def _ask_pool_info(self) -> None:
        """GetPoolInfo, and what it says taken in: the offer, the trained drafters' priors, the costs."""
        try:
            info = await self.call_deadlines.call("draft.GetPoolInfo", self.backends.draft_pool_info())
        except (Unavailable, DeadlineExceeded) as e:
            self.draft_state.failed(str(e))  # down or hung: not asked again before its retry is due
            return
        finally:
            self._pool_info_task = None
        self._offered_strategies = frozenset(info.strategies)
        self._is_cost_pending = bool(MEASURED_STRATEGIES & self._offered_strategies - set(info.draft_costs_ms))
        if info.acceptance_priors:
            self.controller_config = controller_config_for(info.acceptance_priors)
        if info.draft_costs_ms:
            self.cost_model = cost_model_for(self.model.verify_costs_ms, self.config.costs, info.draft_costs_ms)
            self.log.info(
                "draft costs measured by the pool",
                draft_costs_ms={k: [round(v, 3) for v in c] for k, c in info.draft_costs_ms.items()},
            )

    def make_loop(
        self,
        request_id,
        params,
        prompt_ids,
        cancel,
        deadline,
        generated=(),
        stats=None,
        controller_state=None,
        grammar=None,
        stored_params=None,
        node: Node | None = None,
        is_streamed: bool = True,
    ) -> RequestLoop:
        """The request's loop, on `node` (None: the gateway's one node); its runs' messages carry a step
        each --stream_interval for a client that `is_streamed` (and for an adopted request, whose
        followers may stream), else each --unary_stream_interval."""
        spec = self.config.speculation
        return RequestLoop(
            request_id,
            params,
            prompt_ids,
            self.backends if node is None else node.backends,
            self.store,  # its record writes every step and its end as this gateway (RequestRecord)
            self.tokenizer,
            self.model,
            (spec.greedy_logits_format, spec.sample_logits_format),
            self.config.recovery_timeout_s,
            self.config.limits.max_tree_nodes,
            cancel,
            self.owner,
            deadline,
            generated,
            stats,
            cost_model=self.cost_model,
            controller_config=self.controller_config,
            controller_state=controller_state,
            grammar=grammar,
            validator_state=self.validator_state if node is None else node.validator_state,
            draft_state=self.draft_state if node is None else node.draft_state,
            call_deadlines=self.call_deadlines,
            stored_params=stored_params,
            step_costs=self.step_costs,
            acceptance_memory=self.acceptance_memory,
            max_state_retry_s=self.max_state_retry_s,
            stats_interval_s=self.config.state_stats_interval_s,
            is_run_drafting=spec.is_run_drafting,
            steps_per_message=self.config.stream_interval if is_streamed else self.config.unary_stream_interval,
            node_id="" if node is None else node.node_id,
            failover=None if node is None else self._failover_of(request_id, prompt_ids),
            node=node,
        )

    def _place(self, request_id: str, prompt_ids, stored_node: str = "") -> Node | None:
        """The node a request runs on (None without --nodes): its stored node while that one is
        healthy (a resumed request, whose slot may live there), else the router's choice."""
        if self.nodes is None:
            return None
        node = self.nodes.nodes.get(stored_node)
        if node is not None and node.is_healthy and stored_node in self.nodes.listed:
            return node
        placed = self.nodes.place(prompt_ids, self._tenant_of(request_id))
        if placed is None:
            raise Unavailable("request_id", f"request {request_id!r}: no node is known yet; retry later")
        return placed

    def _failover_of(self, request_id: str, prompt_ids):
        assert self.nodes is not None
        nodes, scope = self.nodes, self._tenant_of(request_id)

        async def failover(node_id: str, error: str) -> Node | None:
            return await nodes.fail_over(node_id, prompt_ids, scope, error)

        return failover

    def _availability_recorder(self, name: str):
        if self.metrics is None:
            return None
        self.metrics.dependency_available.labels(name).set(1)
        return lambda is_up: self.metrics.dependency_available.labels(name).set(int(is_up))

    @contextlib.contextmanager
    def _told_as_client(self, request_id: str, client_id: str):
        """Within: a dependency's failure (the state store's, an internal service's) reaches the
        client as client_error says, and its details go to the log."""
        try:
            yield
        except SpecdecError as e:
            told = client_error(e, client_id)
            if told is not e:
                self.log.warning(
                    "request failed in a dependency",
                    request_id=request_id,
                    dependency=e.dependency,
                    code=e.status_name,
                    error=str(e),
                )
                raise told from None
            raise

    async def _observed(self, loop: RequestLoop, client_id: str, arrived_s: float) -> AsyncIterator:
        """loop.run(), recording its latencies, tokens and steps as metrics; an internal service's
        failure reaches the client as client_error says (the details are logged)."""
        with self._told_as_client(loop.request_id, client_id):
            async for out in self._measured(loop, arrived_s):
                yield out
            await self._check_not_taken_over(loop, client_id)

    async def _check_not_taken_over(self, loop: RequestLoop, client_id: str) -> None:
        """UNAVAILABLE when the store refused the loop's step because another gateway took the request
        over (this one was found not answering, gateway.owner_probe): the request goes on there, so its
        client retries the same request id (on any gateway) and follows it, rather than hearing that it
        was cancelled."""
        if not loop.is_refused or loop.cancel.is_set() or loop.outcome.finish_reason != "cancelled":
            return
        state = await self.store.load(loop.request_id)
        if state is None or state.status.is_terminal or state.owner in ("", self.owner):
            return
        self.log.warning("request taken over by another gateway", request_id=loop.request_id, owner=state.owner)
        # a retry cannot follow log probabilities (not stored: _check_answerable_on_retry)
        advice = (
            "retry the same request id to follow it"
            if loop.params.logprobs is None
            else "GetRequest gives its tokens (its log probabilities are not stored: a retry cannot answer them)"
        )
        raise Unavailable(
            "request_id",
            f"request {client_id!r} is now run by another gateway (this one lost its lease); {advice}",
        )

    async def _measured(self, loop: RequestLoop, arrived_s: float | None) -> AsyncIterator:
        """loop.run()'s output, its steps, tokens and end counted in the metrics; arrived_s None: a
        request adopted from another gateway, whose prompt, queue and client's latencies (first token,
        end to end) were the first gateway's to measure: only what runs here is counted."""
        if self.metrics is None:
            async for out in loop.run():
                yield out
            return
        metrics, stats = self.metrics, loop.stats
        timer = None
        if arrived_s is not None:
            metrics.prompt_tokens.inc(len(loop.prompt_ids))
            metrics.queue_time.observe(stats.queue_ms / 1000)
            timer = RequestTimer(metrics, arrived_s)
        seen = _StepCounts.of(stats)
        finish_reason = "error"
        try:
            async for out in loop.run():
                if timer is not None:
                    timer.on_tokens(len(out.token_ids), time.perf_counter())
                if stats.num_steps > seen.num_steps:
                    seen = seen.observe_into(metrics, stats)
                yield out
            finish_reason = loop.outcome.finish_reason
        except (asyncio.CancelledError, GeneratorExit, Cancelled):
            finish_reason = "cancelled"
            raise
        except DeadlineExceeded:
            finish_reason = "deadline"
            raise
        finally:
            if stats.num_steps > seen.num_steps:  # a last step that committed nothing to send (an EOS)
                seen.observe_into(metrics, stats)
            metrics.generation_tokens.inc(stats.num_generated_tokens - seen.num_generated_tokens_at_start)
            if timer is not None:
                timer.on_end(finish_reason, time.perf_counter())
            else:
                metrics.request_success.labels(finish_reason).inc()

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._active.pop(request_id, None)


@dataclasses.dataclass(frozen=True, slots=True)
class _StepCounts:
    """A request's step counters as the metrics last saw them (RequestStats only grows)."""

    num_steps: int
    num_proposed: int
    num_accepted: int
    num_draft_steps: int
    stage_ms: dict[str, float]
    decoders: dict[str, tuple[int, int]]
    num_generated_tokens_at_start: int

    @staticmethod
    def of(stats: RequestStats, num_generated_tokens_at_start: int | None = None) -> _StepCounts:
        stage_ms = dict(stats.stage_ms)
        # The loop books no "other" time: it is the steps' wall time the other stages leave, as
        # GenerationStats.stage_times.other_ms gives it.
        stage_ms["other"] = max(0.0, stats.total_ms - sum(ms for stage, ms in stage_ms.items() if stage != "other"))
        return _StepCounts(
            stats.num_steps,
            stats.num_proposed,
            stats.num_accepted,
            stats.num_draft_steps,
            stage_ms,
            {name: (int(row[0]), int(row[1])) for name, row in stats.decoders.items()},
            stats.num_generated_tokens if num_generated_tokens_at_start is None else num_generated_tokens_at_start,
        )

    def observe_into(self, metrics: GatewayMetrics, stats: RequestStats) -> _StepCounts:
        """Record the steps since these counts; the counts now."""
        now = _StepCounts.of(stats, self.num_generated_tokens_at_start)
        # A validation or write booked before the next step's wall time joins the total takes from
        # "other" for a moment: never a negative sample, the rest is counted once the total catches up.
        now.stage_ms["other"] = max(now.stage_ms["other"], self.stage_ms.get("other", 0.0))
        metrics.observe_step(
            num_steps=now.num_steps - self.num_steps,
            num_proposed=now.num_proposed - self.num_proposed,
            num_accepted=now.num_accepted - self.num_accepted,
            num_draft_steps=now.num_draft_steps - self.num_draft_steps,
            stage_seconds={k: (v - self.stage_ms.get(k, 0.0)) / 1000 for k, v in now.stage_ms.items()},
            by_decoder={
                name: (p - self.decoders.get(name, (0, 0))[0], a - self.decoders.get(name, (0, 0))[1])
                for name, (p, a) in now.decoders.items()
                if (p, a) != self.decoders.get(name, (0, 0))
            },
        )
        return now
