"""Requests that outlive their gateway: adopting, resuming and following stored requests.

Gateways hold no request state outside the state store, so any of them can take over a request
whose gateway died. `Resumption` is that part of the GenerationService servicer (gateway.server):
- resume_active: at start-up, adopt every active request a previous gateway left behind;
- adopt: claim a stored request (the store's owner lease) and run its loop here from its stored
  tokens, on its stored node where it still serves, with the dead gateway's KV lease;
- keep_leases: every owner_lease_s / 3, renew this gateway's leases and adopt the orphaned requests
  (gateway.follow.is_orphaned);
- followed: what a client's retry of a stored request receives: its stored output from the first
  token, each step as it is stored, and the final message (gateway.follow), adopting the request on
  the way if its gateway is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING, Any


from gateway.admission import Admission, Ticket
from gateway.backends import Backends
from gateway.config import GatewayConfig
from gateway.follow import follow, is_orphaned
from gateway.grammars import Grammars
from gateway.loop import RequestLoop
from gateway.params import params_from_pb
from gateway.stats import RequestStats
from specdec import pb
from specdec.errors import Cancelled, Unavailable
from specdec.model.tokenizer import IncrementalDetokenizer, Tokenizer
from specdec.state_store import AsyncStateStore, RequestStatus
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

    if TYPE_CHECKING:  # the servicer's own (gateway.server.GenerationServicer)

        def make_loop(self, request_id: str, *args: Any, **kwargs: Any) -> RequestLoop: ...
        def _place(self, request_id: str, prompt_ids: Any, stored_node: str = "") -> Node | None: ...
        def _tenant_of(self, request_id: str) -> str: ...
        def _in_background(self, coro: Any, name: str | None = None, *, is_logged: bool = True) -> asyncio.Task: ...
        def _end(self, request_id: str, ticket: Ticket) -> None: ...
        def _scoped(self, context: Any, client_id: str) -> str: ...
        def _told_as_client(self, request_id: str, client_id: str) -> contextlib.AbstractContextManager[None]: ...

    def start_keeping_leases(self) -> None:
        """keep_leases() in a task, until close()."""
        self._lease_task = asyncio.create_task(self.keep_leases(), name="keep-leases")

    async def resume_active(self) -> list[str]:
        """Finish requests that a previous gateway left running (state from the store): each one's
        loop runs in a task, like an admitted request's."""
        resumed = [request_id for request_id in await self.store.list_active() if await self.adopt(request_id)]
        if resumed:
            self.log.info("resumed requests", request_ids=resumed)
        return resumed

    async def adopt(self, request_id: str) -> bool:
        """Run a stored request here from its stored tokens (its gateway is gone), if this gateway can
        claim it (no other gateway holds its lease) and does not run it already."""
        from gateway.params import params_pb_from_json

        with self._lock:
            if request_id in self._active:
                return False
        if not await self.store.claim(request_id, self.owner):
            return False
        state = await self.store.load(request_id)
        if state is None:
            return False
        params = params_from_pb(
            params_pb_from_json(state.params), self.config.limits, self.config.speculation, self._offered_strategies
        )
        cancel = threading.Event()
        with self._lock:
            if request_id in self._active:  # adopted meanwhile by another of this gateway's calls
                return False
            self._active[request_id] = cancel
        grammar = None if params.response_format is None else self.grammars.new_state(params.response_format)
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
            RequestStats.from_dict(state.stats),
            state.controller_state,
            grammar,
            stored_params=state.params,
            node=node,
        )
        # A slot like any request's: a restart with many requests in flight must not run more
        # than max_active_requests at once.
        ticket = self.admission.enter(self._tenant_of(request_id), is_accepted=True)
        self._in_background(self._resumed(loop, ticket), name=f"resume {request_id}")
        self.log.info("adopted request", request_id=request_id, num_tokens=len(state.token_ids), node=loop.node_id)
        return True

    async def keep_leases(self) -> None:
        """Until cancelled: every lease_s / 3, renew the lease of each request this gateway runs or
        queues (a step's write renews it too, but a queued or slow request writes none), and adopt
        the requests whose gateway is gone (gateway.follow.is_orphaned)."""
        lease_s = self.config.owner_lease_s
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                with self._lock:
                    mine = list(self._active)
                await asyncio.gather(*(self.store.claim(r, self.owner) for r in mine), return_exceptions=True)
                for request_id in await self.store.list_active():
                    state = None if request_id in mine else await self.store.load(request_id)
                    if state is not None and is_orphaned(state, lease_s):
                        await self.adopt(request_id)
            except Exception as e:  # noqa: BLE001 - the store may be failing over: next round
                self.log.warning("could not renew or adopt requests", error=str(e))

    async def followed(self, request, context, is_streamed: bool = False):
        """The stream of a retried request (the same request under a stored id): its stored output
        so far, then each step stored, then a final message; the request is adopted here if its
        gateway is gone."""
        client_id = pb.request_id_from_pb(request.request_id)
        request_id = self._scoped(context, client_id)
        detok = IncrementalDetokenizer(self.tokenizer)
        num_sent, text, state = 0, "", None
        with self._told_as_client(request_id, client_id):
            async for state in follow(self.store, request_id, self.adopt, self.config.owner_lease_s):
                new = list(state.token_ids[num_sent:])
                num_sent, delta = len(state.token_ids), detok.add(new)
                text += delta
                if is_streamed and (new or delta):
                    yield gateway_pb2.GenerateStreamResponse(request_id=client_id, text=delta, token_ids=new)
        assert state is not None
        if state.status == RequestStatus.FAILED:
            raise Unavailable("request_id", f"request {client_id!r} failed: {state.error or 'see the gateway log'}")
        tail = detok.finish()
        yield gateway_pb2.GenerateStreamResponse(
            request_id=client_id,
            is_final=True,
            text=tail if is_streamed else text + tail,
            token_ids=[] if is_streamed else state.token_ids,
            finish_reason=FINISH_REASONS.get(state.finish_reason, gateway_pb2.FINISH_REASON_UNSPECIFIED),
            stats=RequestStats.from_dict(state.stats).to_pb(),
        )

    async def _resumed(self, loop: RequestLoop, ticket: Ticket) -> None:
        try:
            try:
                await ticket.wait_async(None, loop.cancel, loop.request_id)
            except Cancelled:  # while it waited for a slot
                await self.store.set_status(loop.request_id, RequestStatus.CANCELLED, finish_reason="cancelled")
                return
            async for _ in loop.run():
                pass
        except Exception as e:  # noqa: BLE001 - recorded as FAILED in the store by the loop
            self.log.warning("resumed request failed", request_id=loop.request_id, error=str(e))
        finally:
            self._end(loop.request_id, ticket)
