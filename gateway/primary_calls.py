"""A request's calls to its primary, carried through the primary's restarts and the request's moves
to another node (PrimaryCalls).

Recovery: the committed tokens are in the state store after every step. If the primary restarts, a
call answers NOT_FOUND (or UNAVAILABLE while it is down): the request waits for it, re-prefills
prompt + committed tokens, and retries the call; greedy output is unchanged. While a primary is
unavailable and the gateway has another node for the request, the request moves there (failover)
and re-prefills the same way. A call also ends at the request's deadline: a hung primary, which
nothing replaces, fails the request DEADLINE_EXCEEDED then.

A busy primary refuses a Prefill past its bound on Prefills under way (RESOURCE_EXHAUSTED with a
retry-after-ms hint, primary_svc.server): the request's own prefill, a recovery's or a streamed
run's re-prefill waits the hinted time and tries again, until its deadline passes or it is
cancelled. A refusal without the hint (a prompt larger than the whole KV budget) is final.

A request cancelled while it waits for its primary (unavailable, or busy) gets Cancelled: the loop
ends it as a cancel between its steps does, not as failed by the primary.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.node_pool import Node
from gateway.request_record import RequestRecord
from specdec.errors import Cancelled, DeadlineExceeded, NotFound, ResourceExhausted, Unavailable

RECOVERY_POLL_S = 0.5
# How often a call waiting to retry a busy primary's refusal looks at the request's cancel.
BUSY_CANCEL_POLL_S = 0.05


async def _nothing() -> None:
    """A primary call that does nothing: PrimaryCalls.call(_nothing, is_fresh=True) only prefills."""


class PrimaryCalls:
    """One request's primary calls with recovery and retries.

    The loop supplies what a recovery changes in it: `prefill_context(is_fresh)` prefills the
    request's prompt and committed tokens on its current primary (is_fresh: the request's own
    prefill, not a recovery's), ending the call at the deadline (within_deadline), and returns the
    weights' precision; `move_to(node)` goes on with another node's services after a failover.
    `failover(node_id, error)` is another node for the request when its node's primary is
    unavailable (gateway.node_pool), or None; the record (gateway.request_record) names the
    request's node and holds its prompt and committed tokens."""

    def __init__(
        self,
        record: RequestRecord,
        prefill_context: Callable[[bool], Awaitable[str]],
        move_to: Callable[[Node], None],
        *,
        cancel: threading.Event,
        log: Any,
        recovery_timeout_s: float,
        deadline: float | None = None,
        failover: Callable[[str, str], Awaitable[Node | None]] | None = None,
    ) -> None:
        self.record, self.prefill_context, self.move_to = record, prefill_context, move_to
        self.cancel, self.log = cancel, log
        self.recovery_timeout_s, self.deadline, self.failover = recovery_timeout_s, deadline, failover
        self.weights_precision = ""  # the weight format of the request's first prefill (_check_weights)
        self.is_step_disturbed = False  # the step being computed waited on a recovery

    def start_step(self) -> None:
        """A new step's calls begin: none of them waited on a recovery yet."""
        self.is_step_disturbed = False

    async def prefill(self) -> None:
        """The request's own prefill of its context, with no call after it."""
        await self.call(_nothing, is_fresh=True)

    async def reprefill(self) -> None:
        """A recovery's prefill of the request's context, with no call after it: the primary forgets
        what it holds past the committed tokens (a tree no validator decided)."""
        await self.call(_nothing, needs_prefill=True)

    async def call(
        self, call: Callable[[], Awaitable[Any]], is_fresh: bool = False, needs_prefill: bool = False
    ) -> Any:
        """Run a primary call; if the primary lost the request (restart), re-prefill and retry.
        `needs_prefill`: re-prefill before the call, as a recovery does.

        A re-prefill carries the lease the backends hold. A live slot leased to someone else (a
        predecessor gateway that died before its step stored the lease) answers ALREADY_EXISTS,
        which the backends report as Unavailable: retried here until the primary expires that slot
        (--kv_lease_s) or recovery_timeout_s passes. A refusal with a retry hint (a busy primary) is
        retried after the hinted time until the request's deadline (DeadlineExceeded) or its cancel
        (Cancelled)."""
        give_up = time.monotonic() + self.recovery_timeout_s
        needs_prefill = needs_prefill or is_fresh
        num_busy = 0
        while True:
            try:
                if needs_prefill:
                    self._check_weights(await self.prefill_context(is_fresh))
                    needs_prefill = False
                return await self.within_deadline(call())
            except NotFound:
                if is_fresh:
                    raise
                self.log.warning("primary lost the request; re-prefilling from the committed tokens")
                needs_prefill = True
                self.is_step_disturbed = True  # the step's time is the recovery's: not a step cost
            except Unavailable as e:
                self.is_step_disturbed = True
                if self.cancel.is_set():  # the request's end, not the primary's: ended as the cancel it is
                    raise Cancelled("request_id", "cancelled while it waited for its primary") from None
                if time.monotonic() > give_up:
                    raise
                needs_prefill = True
                if await self._fail_over(str(e)):
                    continue
                self.log.warning("primary unavailable; waiting", error=str(e))
                await asyncio.sleep(RECOVERY_POLL_S)
            except ResourceExhausted as e:
                if e.retry_after_ms is None:
                    raise  # no hint: retrying cannot help (e.g. more KV than the primary has)
                self.is_step_disturbed = True
                (self.log.warning if num_busy == 0 else self.log.debug)(
                    "primary busy; retrying", attempt=num_busy + 1, retry_after_ms=e.retry_after_ms
                )
                num_busy += 1
                if not await self.within_deadline(self._wait_unless_cancelled(e.retry_after_ms / 1000)):
                    # the request's end, not the primary's refusal: the loop ends it as the cancel it is
                    raise Cancelled("request_id", "cancelled while it waited to retry a busy primary") from None

    async def _wait_unless_cancelled(self, wait_s: float) -> bool:
        """Sleep wait_s; False as soon as the request is cancelled meanwhile."""
        end = time.monotonic() + wait_s
        while not self.cancel.is_set():
            left_s = end - time.monotonic()
            if left_s <= 0:
                return True
            await asyncio.sleep(min(left_s, BUSY_CANCEL_POLL_S))
        return False

    async def within_deadline(self, call: Awaitable[Any]) -> Any:
        """A primary call, ended at the request's deadline: a hung primary (nothing replaces it) fails the
        request DEADLINE_EXCEEDED then, not at --rpc_timeout_s; one that answers in time goes on."""
        if self.deadline is None:
            return await call
        remaining_s = self.deadline - time.monotonic()
        try:
            return await asyncio.wait_for(call, max(0.0, remaining_s))
        except asyncio.TimeoutError:
            # the event loop's timers may fire a clock tick early: wait out the rest, so the request is
            # seen as ended by its deadline (the loop's stop signal), not as failed
            await asyncio.sleep(max(0.0, self.deadline - time.monotonic()) + 0.001)
            raise DeadlineExceeded(
                "primary", "the primary did not answer within the request's deadline", dependency="primary"
            ) from None

    async def _fail_over(self, error: str) -> bool:
        """Move the request to another node (failover) after its primary was unavailable: True when it
        moved; the caller then re-prefills the prompt and the committed tokens there, and the stream
        goes on from the last committed token. The new node's draft pool hears the whole context with
        the next Propose. The old node's slot, if its primary lives, expires with its lease."""
        if self.failover is None:
            return False
        node = await self.failover(self.record.node_id, error)
        if node is None:
            return False
        self.log.warning(
            "request failing over to another node",
            from_node=self.record.node_id,
            to_node=node.node_id,
            num_reprefill_tokens=len(self.record.prompt_ids) + len(self.record.generated),
            error=error,
        )
        self.move_to(node)
        return True

    def _check_weights(self, precision: str) -> None:
        """Keep the weight format of the request's first prefill; a re-prefill on another one (a primary
        restarted with another precision, a failover to a node that chose another) goes on with other
        weights, whose greedy output parts from an undisturbed run's within a few tokens: logged as an
        error, as it breaks the output's equality with plain decoding that the request otherwise has."""
        if not precision:
            return
        if self.weights_precision and precision != self.weights_precision:
            self.log.error(
                "re-prefilled on other weights; the output may differ from an undisturbed run",
                was=self.weights_precision,
                now=precision,
            )
        self.weights_precision = precision
