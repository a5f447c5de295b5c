"""Requests that outlive their gateway: adopting, resuming and following stored requests.

Gateways hold no request state outside the state store, so any of them can take over a request
whose gateway died. `Resumption` is that part of the GenerationService servicer (gateway.server):
- resume_active: at start-up, adopt every active request a previous gateway left behind: unowned
  ones, and those held by an earlier instance at this gateway's own address (gateway.owner_id: this
  process holds the port now, so that instance is gone);
- adopt: claim a stored request (the store's owner lease), or take it over from a gone owner (the
  store's compare-and-set take_over), and run its loop here from its stored tokens, on its stored
  node where it still serves, with the dead gateway's KV lease;
- adopt_if_abandoned: the rule for one stored request: adopt it when unowned for a lease
  (gateway.follow.is_orphaned) or held by a gateway that does not answer (gateway.owner_probe);
- keep_leases: every owner_lease_s / 3, renew this gateway's leases and adopt abandoned requests;
- followed: what a client's retry of a stored request receives: its stored output from the first
  token, each step as it is stored, and the final message (gateway.follow), adopting the request on
  the way if its gateway is gone.

Safety: the probe only makes a takeover worth trying. take_over succeeds only while the gone owner
still holds the lease, so of several gateways that found it gone one wins; an owner that was alive
after all is refused at its next step write by the store's owner check, and its loop stops without
writing its end over the adopter's (its end is written as its owner too: RequestRecord.finish; a
request cancelled while it waited for a slot, through OwnerFencedStore).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format

from gateway.admission import Admission, Ticket
from gateway.backends import Backends
from gateway.config import GatewayConfig
from gateway.fenced_store import OwnerFencedStore
from gateway.follow import follow, is_orphaned
from specdec.grammar.compiling import Grammars
from gateway.loop import RequestLoop
from gateway.output import Output, add_stored, stored_output
from gateway.owner_id import OwnerId
from gateway.owner_probe import OwnerProbe
from gateway.params import GenerationParams, params_from_pb, params_pb_from_json
from gateway.stats import RequestStats
from specdec import pb
from specdec.errors import Cancelled, InvalidArgument, Unavailable
from specdec.grammar import GrammarState
from specdec.model.tokenizer import Tokenizer
from specdec.state_store import AsyncStateStore, RequestState, RequestStatus
from specdec.v1 import gateway_pb2

if TYPE_CHECKING:
    from gateway.node_pool import Node

FINISH_REASONS = {
    "length": gateway_pb2.FINISH_REASON_LENGTH,
    "stop": gateway_pb2.FINISH_REASON_STOP,
    "eos": gateway_pb2.FINISH_REASON_EOS,
    "cancelled": gateway_pb2.FINISH_REASON_CANCELLED,
    "deadline": gateway_pb2.FINISH_REASON_DEADLINE,
    "error": gateway_pb2.FINISH_REASON_ERROR,
}


class Resumption:
    """The servicer's adoption of stored requests; what it uses of the servicer is declared here."""

    config: GatewayConfig
    store: AsyncStateStore
    backends: Backends
    tokenizer: Tokenizer
    grammars: Grammars
    admission: Admission
    owner: str
    log: Any
    _active: dict[str, threading.Event]
    _lock: threading.Lock
    _offered_strategies: frozenset[str] | None
    _lease_task: asyncio.Task | None = None  # keep_leases, with a shared store
    # Asks the owners of other gateways' requests whether they still answer (None: a request of a
    # gone gateway is adopted only once its lease lapsed).
    owner_probe: OwnerProbe | None = None

    if TYPE_CHECKING:  # the servicer's own (gateway.server.GenerationServicer)

        def make_loop(self, request_id: str, *args: Any, **kwargs: Any) -> RequestLoop: ...
        def _place(self, request_id: str, prompt_ids: Any, stored_node: str = "") -> Node | None: ...
        def _tenant_of(self, request_id: str) -> str: ...
        def _in_background(self, coro: Any, name: str | None = None, *, is_logged: bool = True) -> asyncio.Task: ...
        def _end(self, request_id: str, ticket: Ticket) -> None: ...
        def _measured(self, loop: RequestLoop, arrived_s: float | None) -> AsyncIterator[Any]: ...
        def _scoped(self, context: Any, client_id: str) -> str: ...
        def _told_as_client(self, request_id: str, client_id: str) -> contextlib.AbstractContextManager[None]: ...

    def start_keeping_leases(self) -> None:
        """keep_leases() in a task, until close()."""
        self._lease_task = asyncio.create_task(self.keep_leases(), name="keep-leases")

    async def resume_active(self) -> list[str]:
        """Finish requests that a previous gateway left running (state from the store): each one's
        loop runs in a task, like an admitted request's."""
        resumed = []
        for request_id in await self.store.list_active():
            if await self._adopt_listed(request_id, is_starting=True):
                resumed.append(request_id)
        if resumed:
            self.log.info("resumed requests", request_ids=resumed)
        return resumed

    async def adopt_if_abandoned(
        self, state: RequestState, *, is_starting: bool = False, is_patient: bool = False
    ) -> bool:
        """Adopt a stored request whose gateway is gone: unowned for a lease (is_orphaned), held by a
        gateway that failed its health checks (owner_probe), or, at start-up (is_starting), held by an
        earlier instance at this gateway's own address. Whether this gateway adopted it.
        is_patient: wait for the checks a verdict takes (a caller that asks once in a while: the
        start-up, the heartbeat); else the cached verdict, checked again when stale (a follower asks
        at every poll)."""
        if state.status.is_terminal or state.owner == self.owner:
            return False
        if is_orphaned(state, self.config.owner_lease_s):
            return await self.adopt(state.request_id)
        if not state.owner:
            return False
        if is_starting and _is_predecessor(self.owner, state.owner):
            return await self.adopt(state.request_id, dead_owner=state.owner)
        if self.owner_probe is None:
            return False
        is_gone = self.owner_probe.is_gone_after_checks if is_patient or is_starting else self.owner_probe.is_gone
        if not await is_gone(state.owner):
            return False
        return await self.adopt(state.request_id, dead_owner=state.owner)

    async def adopt(self, request_id: str, dead_owner: str = "") -> bool:
        """Run a stored request here from its stored tokens (its gateway is gone), if this gateway can
        claim it (no other gateway holds its lease) or take it over from dead_owner (still its holder),
        and does not run it already."""
        with self._lock:
            if request_id in self._active:
                return False
        if dead_owner:
            if not await self.store.take_over(request_id, self.owner, dead_owner):
                return False
            self.log.warning(
                "took over a request from a gateway that does not answer", request_id=request_id, dead_owner=dead_owner
            )
        elif not await self.store.claim(request_id, self.owner):
            return False
        state = await self.store.load(request_id)
        if state is None:
            return False
        try:
            params = params_from_pb(
                _stored_request(state.params), self.config.limits, self.config.speculation, self._offered_strategies
            )
        except InvalidArgument as e:  # this gateway's limits refuse what an earlier one admitted
            await self._fail_unresumable(request_id, e)
            return False
        # Its steps reach no client but through the store, which keeps no log probabilities (a retry
        # that asks for them is refused): not computed, nor do they hold its steps back (plain steps
        # where a sampled one would score processed rows, fp32 logits, no forced or run drafts).
        params = dataclasses.replace(params, logprobs=None)
        cancel = threading.Event()
        with self._lock:
            if request_id in self._active:  # adopted meanwhile by another of this gateway's calls
                return False
            self._active[request_id] = cancel
        if params.response_format is None:
            self._run_adopted(request_id, params, state, cancel, None)
        else:  # a schema not in the cache compiles first, off the event loop (up to a minute)
            self._in_background(
                self._adopt_once_compiled(request_id, params, state, cancel), name=f"resume {request_id}"
            )
        return True

    async def _adopt_once_compiled(
        self, request_id: str, params: GenerationParams, state: RequestState, cancel: threading.Event
    ) -> None:
        """Run an adopted request once its schema has compiled; a schema this gateway now refuses
        (its limits changed) fails the request."""
        assert params.response_format is not None
        try:
            grammar = await self.grammars.new_state_when_compiled(params.response_format)
        except InvalidArgument as e:
            with self._lock:
                self._active.pop(request_id, None)
            await self._fail_unresumable(request_id, e)
            return
        self._run_adopted(request_id, params, state, cancel, grammar)

    async def _fail_unresumable(self, request_id: str, error: InvalidArgument) -> None:
        """An adopted request this gateway cannot run ends FAILED (its followers hear why), rather than
        staying claimed by a gateway that never runs it."""
        await OwnerFencedStore(self.store, self.owner).set_status(
            request_id, RequestStatus.FAILED, error=f"cannot resume here: {error}"
        )
        self.log.warning("could not resume a request", request_id=request_id, error=str(error))

    def _run_adopted(
        self,
        request_id: str,
        params: GenerationParams,
        state: RequestState,
        cancel: threading.Event,
        grammar: GrammarState | None,
    ) -> None:
        """The adopted request's loop, in a task, behind an admission slot."""
        try:
            # The previous gateway's lease: the primary may still hold the request's slot, and lets
            # only the lease's holder re-prefill it (on its stored node; another node has no slot).
            node = self._place(request_id, state.prompt_token_ids, state.node)
            if node is None or node.node_id == state.node:
                (self.backends if node is None else node.backends).adopt_kv_lease(request_id, state.kv_lease)
            loop = self.make_loop(
                request_id,
                params,
                state.prompt_token_ids,
                cancel,
                None,
                state.token_ids,
                RequestStats.of_record(state),
                state.controller_state,
                grammar,
                stored_params=state.params,
                node=node,
            )
        except BaseException:
            # Not run here after all: out of _active, or keep_leases would renew its lease for as long as
            # this gateway lives and no gateway would ever run it. The lease lapses; it is adopted again.
            with self._lock:
                self._active.pop(request_id, None)
            raise
        # A slot like any request's: a restart with many requests in flight must not run more
        # than max_active_requests at once.
        ticket = self.admission.enter(self._tenant_of(request_id), is_accepted=True)
        self._in_background(self._resumed(loop, ticket), name=f"resume {request_id}")
        self.log.info("adopted request", request_id=request_id, num_tokens=len(state.token_ids), node=loop.node_id)

    async def keep_leases(self) -> None:
        """Until cancelled: every lease_s / 3, renew the lease of each request this gateway runs or
        queues (a step's write renews it too, but a queued or slow request writes none), and adopt
        the requests whose gateway is gone (adopt_abandoned, in a task of its own: its health checks
        of other gateways take up to seconds, and never hold up the renewals)."""
        lease_s = self.config.owner_lease_s
        sweep: asyncio.Task | None = None
        try:
            while True:
                await asyncio.sleep(lease_s / 3)
                with self._lock:
                    mine = list(self._active)
                await asyncio.gather(*(self.store.claim(r, self.owner) for r in mine), return_exceptions=True)
                if sweep is None or sweep.done():  # one sweep at a time
                    sweep = asyncio.create_task(self.adopt_abandoned(frozenset(mine)), name="adopt-abandoned")
        finally:
            if sweep is not None:
                sweep.cancel()

    async def adopt_abandoned(self, mine: frozenset[str] = frozenset()) -> list[str]:
        """Adopt every active request (but those in mine, which this gateway runs) whose gateway is
        gone (adopt_if_abandoned, waiting for the health checks a verdict takes); their ids."""
        adopted = []
        try:
            for request_id in await self.store.list_active():
                if request_id not in mine and await self._adopt_listed(request_id, is_patient=True):
                    adopted.append(request_id)
        except Exception as e:  # noqa: BLE001 - the store may be failing over: next round
            self.log.warning("could not adopt requests", error=str(e))
        return adopted

    async def _adopt_listed(self, request_id: str, **kwargs: bool) -> bool:
        """adopt_if_abandoned(its stored state, **kwargs) of a request list_active named; False when it
        is gone meanwhile, and, logged, when its record cannot be read back (Internal: a bug or an
        operator wrote it) or its adoption fails otherwise (stats its loop cannot read, say): one such
        request must not stop a gateway's start (which would fail again at every restart) or its sweeps
        for every request listed after it. A store that does not answer still ends the sweep."""
        try:
            state = await self.store.load(request_id)
            return state is not None and await self.adopt_if_abandoned(state, **kwargs)
        except Unavailable:
            raise
        except Exception as e:  # noqa: BLE001 - this request's fault, not the sweep's
            self.log.warning(
                "could not adopt a stored request", request_id=request_id, error=f"{type(e).__name__}: {e}"
            )
            return False

    def _stored_output(self, params: dict[str, Any]) -> Output:
        """The output of a stored request as its loop cuts its text: at its stop strings, past its
        min_tokens (a request whose parameters no gateway can read has none)."""
        try:
            request = _stored_request(params)
        except InvalidArgument:
            request = gateway_pb2.GenerateRequest()
        return stored_output(self.tokenizer, tuple(request.stop), request.sampling.min_tokens)

    async def followed(self, request, context, is_streamed: bool = False):
        """The stream of a retried request (the same request under a stored id): its stored output
        so far, then each step stored, then a final message; the request is adopted here if its
        gateway is gone."""
        client_id = pb.request_id_from_pb(request.request_id)
        request_id = self._scoped(context, client_id)
        output: Output | None = None
        generated: list[int] = []
        num_sent, state = 0, None
        with self._told_as_client(request_id, client_id):
            async for state in follow(self.store, request_id, self.adopt_if_abandoned):
                if output is None:
                    output = self._stored_output(state.params)
                new = list(state.token_ids[num_sent:])
                num_sent = len(state.token_ids)
                add_stored(output, new, generated)
                delta = output.ready_text(is_final=output.is_stopped)
                if is_streamed and (new or delta):
                    yield gateway_pb2.GenerateStreamResponse(request_id=client_id, text=delta, token_ids=new)
        assert state is not None and output is not None
        if state.status == RequestStatus.FAILED:
            raise Unavailable("request_id", f"request {client_id!r} failed: {state.error or 'see the gateway log'}")
        tail = output.end(is_flushed=not output.is_stopped)
        yield gateway_pb2.GenerateStreamResponse(
            request_id=client_id,
            is_final=True,
            text=tail if is_streamed else output.text,
            token_ids=[] if is_streamed else state.token_ids,
            finish_reason=FINISH_REASONS.get(state.finish_reason, gateway_pb2.FINISH_REASON_UNSPECIFIED),
            stats=RequestStats.of_record(state).to_pb(),
        )

    async def _resumed(self, loop: RequestLoop, ticket: Ticket) -> None:
        try:
            try:
                await ticket.wait_async(None, loop.cancel, loop.request_id)
            except Cancelled:  # while it waited for a slot
                await loop.let_go_nodes()  # never ran: its node is not held for it
                fenced = OwnerFencedStore(self.store, self.owner)  # not over an adopter's writes
                await fenced.set_status(loop.request_id, RequestStatus.CANCELLED, finish_reason="cancelled")
                return
            async for _ in self._measured(loop, None):  # its steps and end in this gateway's metrics
                pass
        except Exception as e:  # noqa: BLE001 - recorded as FAILED in the store by the loop
            self.log.warning("resumed request failed", request_id=loop.request_id, error=str(e))
        finally:
            self._end(loop.request_id, ticket)


def _stored_request(params: dict[str, Any]) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest a request's stored parameters hold; InvalidArgument when they hold none
    (written by a bug or by hand): no gateway can run that request, so its adopter ends it FAILED
    rather than raising out of adopt, which would stop a start-up's resume_active."""
    try:
        return params_pb_from_json(params)
    except json_format.ParseError as e:  # its first line names the field; the rest lists the valid ones
        raise InvalidArgument("params", f"the stored parameters are no request: {str(e).splitlines()[0]}") from None


def _is_predecessor(owner: str, holder: str) -> bool:
    """Whether holder is another instance at owner's address (one that held this gateway's port)."""
    own = OwnerId.parse(owner)
    return own is not None and own.is_other_instance_at(OwnerId.parse(holder))
