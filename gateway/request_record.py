"""A running request's record in the state store: what the gateway's loop (gateway.loop) writes there.

The loop computes steps; this writes them. Every write is retried while the store does not answer
(gateway.state_retry: backoff within --max_state_retry_s and the request's deadline, until a cancel),
and a record the store refuses or lost is repaired from the gateway's memory where that is safe:

- a step write refused because the record's token count moved back (a Redis failover lost the last
  writes it acknowledged: replication is asynchronous) writes the lost steps back with the step, when
  every stored token is this gateway's own (write_back_lost); a retried write whose first attempt was
  applied (its reply lost) is recognised as stored (is_stored);
- a record that is gone, not ended (a Redis restarted without persistence), is created again whole:
  parameters, prompt, committed tokens, stats, controller state, the primary's lease and node
  (restore); a store that refuses that too ends the request UNAVAILABLE naming the lost state;
- a record that ended elsewhere (another gateway or a cancel) refuses the step: append_step answers
  False and the loop leaves the step out of the output.

The primary's KV lease (and the node that granted it) goes to the store with the next step after a
prefill, so that a successor gateway re-prefills the live slot with it (prefilled).

Every step's tokens go to the store before the step's output goes out; the request's stats and
controller state go with its first and last steps and with one step each stats_interval_s between
(is_stats_due), and with its end: encoding and storing them with every token took gateway CPU from
every plain token (docs/benchmarks.md, "Per-step overheads"). They lag by at most the interval in
what a successor resumes from (RequestStats.of_record makes its token counts whole again) and in
what GetRequest shows of a running request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, Unpack

from gateway.state_retry import DEFAULT_MAX_STATE_RETRY_S, give_up_at, with_state_retries
from specdec.errors import AlreadyExists, FailedPrecondition, Internal, NotFound, StateLost, Unavailable
from specdec.state_store import AsyncStateStore, RequestState, RequestStatus, StepFields

T = TypeVar("T")

# How often a running request's stats and controller state go to the store with its steps (the
# gateway's --state_stats_interval_s; 0: with every step).
DEFAULT_STATS_INTERVAL_S = 0.1
# The stats and controller state as the store keeps them (RequestStats.to_dict, ControllerState.to_dict).
Snapshot = Callable[[], tuple[dict[str, Any], dict[str, Any] | None]]


class RequestRecord:
    """One request's record, written by its loop: the store, the request's identity (id, owner,
    stored parameters, prompt), the retry budget, and the lease and node still to be stored.

    `generated` is the loop's own list of committed tokens (the same object: the loop extends it, and
    cuts a refused step off it); lost steps and a lost record are written back from it, with the
    stats and controller state of `snapshot`."""

    def __init__(
        self,
        store: AsyncStateStore,
        request_id: str,
        owner: str,
        prompt_ids: Sequence[int],
        generated: list[int],
        cancel: threading.Event,
        log: Any,
        *,
        deadline: float | None = None,
        stored_params: Mapping[str, Any] | None = None,
        max_retry_s: float = DEFAULT_MAX_STATE_RETRY_S,
        node_id: str = "",
        snapshot: Snapshot = lambda: ({}, None),
        stats_interval_s: float = DEFAULT_STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stats_interval_s < 0:
            raise ValueError(f"stats_interval_s must be >= 0, got {stats_interval_s}")
        self.store, self.request_id, self.owner = store, request_id, owner
        self.snapshot, self.stats_interval_s, self.clock = snapshot, stats_interval_s, clock
        self._stats_due_at: float | None = None  # None: the next step carries them (none stored yet)
        self.prompt_ids, self.generated = prompt_ids, generated
        # The request's parameters as stored (params_to_json): what restore writes back should the
        # store lose the record. None: not known here, so a lost record cannot be written back.
        self.stored_params = None if stored_params is None else dict(stored_params)
        self.cancel, self.deadline, self.max_retry_s, self.log = cancel, deadline, max_retry_s, log
        # The node the request runs on (gateway.nodes; "" with a single node).
        self.node_id = node_id
        self.kv_lease = ""  # the latest prefill's lease, stored or not (restore writes it back)
        # The latest prefill's lease and node until a step's write has stored them.
        self.unstored_kv_lease: str | None = None
        self.unstored_node: str | None = None

    def prefilled(self, kv_lease: str) -> None:
        """The primary granted kv_lease on the request's node: stored with the next step."""
        self.unstored_kv_lease = kv_lease or None
        self.unstored_node = self.node_id or None
        self.kv_lease = kv_lease

    def is_stats_due(self, is_final: bool) -> bool:
        """Whether the step being committed writes the stats and controller state besides its tokens:
        the request's first and last steps and one step each stats_interval_s (for the others the
        store keeps those it has)."""
        now = self.clock()
        if not is_final and self._stats_due_at is not None and now < self._stats_due_at:
            return False
        self._stats_due_at = now + self.stats_interval_s
        return True

    async def append_step(
        self,
        kept: list[int],
        num_stored: int,
        stats: dict[str, Any] | None,
        controller: dict[str, Any] | None,
    ) -> bool:
        """Append a step's tokens to the record holding num_stored tokens, with the stats and controller
        state when given (None: the stored ones stay) and a lease and node not yet stored; False when
        the store refuses it (the request ended elsewhere, or its record holds tokens that are not
        this gateway's)."""
        num_attempts = 0
        kv_lease, node = self.unstored_kv_lease, self.unstored_node

        async def append() -> None:
            nonlocal num_attempts
            num_attempts += 1
            await self._write(
                kept,
                expected_num_tokens=num_stored,
                stats=stats,
                controller_state=controller,
                kv_lease=kv_lease,
                node=node,
            )

        try:
            await self.with_retries(append)
        except FailedPrecondition:
            # A retried write whose first attempt had been applied (its reply was lost) is stored.
            if num_attempts > 1 and await self.is_stored(num_stored + len(kept)):
                return True
            return await self.write_back_lost(num_stored, kept, stats, controller, kv_lease, node)
        except NotFound as e:  # the record is gone (not ended): this step goes back with the rest
            if stats is None:
                stats, controller = self.snapshot()
            await self.restore(e, num_stored + len(kept), stats, controller)
        if self.unstored_kv_lease == kv_lease:  # not renewed by a re-prefill meanwhile
            self.unstored_kv_lease = None
        if self.unstored_node == node:
            self.unstored_node = None
        return True

    async def write_back_lost(
        self,
        num_stored: int,
        kept: list[int],
        stats: dict[str, Any] | None,
        controller: dict[str, Any] | None,
        kv_lease: str | None,
        node: str | None,
    ) -> bool:
        """A store failover can lose the last writes it acknowledged (Redis replicates asynchronously:
        a promoted replica may lack them), so the record holds fewer tokens than this gateway stored,
        every one of them its own. Then the lost steps go back from memory with this one; False when the
        record holds anything else (ended, another gateway's tokens, or this gateway no longer owns it)."""
        state = await self.with_retries(lambda: self.store.load(self.request_id))
        if state is None or state.status.is_terminal:
            return False
        stored = list(state.token_ids)
        if len(stored) >= num_stored or stored != self.generated[: len(stored)]:
            return False
        lost = self.generated[len(stored) : num_stored]
        self.log.warning("the state store lost acknowledged steps; writing them back", num_tokens=len(lost))
        try:
            await self.with_retries(
                lambda: self._write(
                    lost + list(kept),
                    expected_num_tokens=len(stored),
                    stats=stats,
                    controller_state=controller,
                    kv_lease=kv_lease,
                    node=node,
                )
            )
        except FailedPrecondition:
            return False
        return True

    async def finish(
        self,
        status: RequestStatus,
        finish_reason: str,
        error: str,
        stats: dict[str, Any],
        controller: dict[str, Any] | None,
    ) -> None:
        """Record the request's end with its final stats and controller state, as its owner (a lost
        record is written back whole with it; one that ended elsewhere keeps its end); never raises:
        the request is over either way, and a store that would not take it is logged."""
        try:
            try:
                await self.with_retries(
                    lambda: self._write(
                        status=status,
                        finish_reason=finish_reason,
                        error=error,
                        stats=stats,
                        controller_state=controller,
                    )
                )
            except FailedPrecondition:  # ended elsewhere, or another gateway holds it: not over its writes
                return
            except NotFound as e:
                await self.restore(
                    e, len(self.generated), stats, controller, status, finish_reason=finish_reason, error=error
                )
        except Exception as e:  # noqa: BLE001 - the request is over either way; say why it was not recorded
            self.log.warning("could not record the final status", error=str(e))

    async def restore(
        self,
        lost: NotFound,
        num_tokens: int,
        stats: Mapping[str, Any],
        controller: Mapping[str, Any] | None,
        status: RequestStatus | None = None,
        *,
        finish_reason: str | None = None,
        error: str | None = None,
    ) -> None:
        """The store no longer holds the request (lost, not ended: an ended one refuses writes with
        FailedPrecondition), yet this gateway runs it: write the whole state back from memory, the
        parameters, prompt, first num_tokens generated tokens, stats, controller state and the
        primary's lease, with status when given (a final one). Unavailable, naming the lost state,
        when the store refuses (StateLost): never NotFound about the client's own live request."""
        message = "the state store lost the request's record; writing it back from the gateway's memory"
        self.log.warning(message, error=str(lost), num_tokens=num_tokens)

        timed_out = False  # an attempt of the create timed out (it may have landed all the same)

        async def create() -> None:
            nonlocal timed_out
            try:
                await self._create_back()
            except Unavailable:
                timed_out = True
                raise
            except AlreadyExists:
                # An attempt that timed out may have landed (a stalled Redis runs it once it resumes):
                # that record, still bare, is this create's own and the refill fills it; anything
                # else under the id is not (it was created by another gateway meanwhile).
                if not timed_out or not self._is_bare_own(await self.store.load(self.request_id)):
                    raise

        async def refill() -> None:
            await self._write(
                self.generated[:num_tokens],
                expected_num_tokens=0,
                status=status,
                stats=stats,
                controller_state=controller,
                finish_reason=finish_reason,
                error=error,
                kv_lease=self.kv_lease or None,
                node=self.node_id or None,
            )

        try:
            await self.with_retries(create)
            await self.with_retries(refill)
        except Exception as e:  # noqa: BLE001 - whatever the store answers, the client hears UNAVAILABLE
            raise StateLost(
                "state_store",
                f"the stored state of request {self.request_id!r} was lost (the state store no longer holds it) "
                f"and writing it back failed: {type(e).__name__}: {e}",
                dependency="state_store",
            ) from e
        self.log.warning("request's stored state written back", num_tokens=num_tokens)

    async def _create_back(self) -> None:
        """restore's create: the record as a new request's, running, from the parameters and prompt."""
        if self.stored_params is None:
            raise Internal("params", "the request's stored parameters are not known to its loop")
        await self.store.create(
            self.request_id, self.stored_params, prompt_token_ids=self.prompt_ids, status=RequestStatus.RUNNING
        )

    def _is_bare_own(self, state: RequestState | None) -> bool:
        """Whether state is this request's record as restore's create writes it: its parameters and
        prompt, no tokens, running, no other gateway's lease (this one's heartbeat may have claimed it)."""
        return (
            state is not None
            and state.params == self.stored_params
            and list(state.prompt_token_ids) == list(self.prompt_ids)
            and not state.token_ids
            and state.status == RequestStatus.RUNNING
            and state.owner in ("", self.owner)
        )

    async def is_stored(self, num_tokens: int) -> bool:
        """Whether the record is live and holds exactly num_tokens tokens."""
        state = await self.with_retries(lambda: self.store.load(self.request_id))
        return state is not None and len(state.token_ids) == num_tokens and not state.status.is_terminal

    async def _write(self, token_ids: Sequence[int] = (), **step: Unpack[StepFields]) -> int:
        """One step of the request's record, written as its owner (the store refuses it where another
        gateway holds the lease or the request ended)."""
        fields: StepFields = {**step, "owner": self.owner}
        return await self.store.append_step(self.request_id, token_ids, **fields)

    async def with_retries(self, write: Callable[[], Awaitable[T]]) -> T:
        """write(), retried with bounded backoff while the state store is unavailable; Unavailable once
        max_retry_s (or the request's deadline) would pass, or at once after a cancel."""
        return await with_state_retries(write, give_up_at(self.max_retry_s, self.deadline), self.cancel, self.log)
