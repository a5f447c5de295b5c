"""A request followed through the state store: what a client that retries a request id gets.

Gateways hold no request state outside the store, so a client whose gateway died (or whose
connection dropped) retries the same request id on any gateway. That gateway does not start the
request again: it follows the stored request, sending what is stored (the whole output so far,
then each step as it is appended) until the request ends. A request whose gateway is gone is
adopted on the way (`adopt`, gateway.resume.Resumption.adopt_if_abandoned: unowned since its lease
lapsed, or held by a gateway that no longer answers its health check, gateway.owner_probe): its loop
resumes on this gateway from the stored tokens, and the follower reads that loop's steps from the
store too.

Ownership stays with the store's lease (specdec.state_store): a gateway renews the leases of its
requests every `lease_s / 3` (heartbeat, GenerationServicer.keep_leases), each step's write renews and
checks it, and only a claim of an unowned request or a takeover from the very owner found gone
(a compare-and-set) succeeds, so exactly one gateway runs a request at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from specdec.errors import NotFound
from specdec.state_store import AsyncStateStore, RequestState

FOLLOW_POLL_S = 0.05  # a followed request's steps reach its client within this of being stored


def is_orphaned(state: RequestState, lease_s: float, now_ms: int | None = None) -> bool:
    """Active, unowned, and not written for a lease: its gateway is gone (a live one claims each of
    its requests, queued or running, every lease_s / 3: within a lease of its creation)."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    return not state.status.is_terminal and not state.owner and now_ms - state.updated_ms >= lease_s * 1000


async def follow(
    store: AsyncStateStore,
    request_id: str,
    adopt: Callable[[RequestState], Awaitable[bool]],
    poll_s: float = FOLLOW_POLL_S,
    cancel: asyncio.Event | None = None,
) -> AsyncIterator[RequestState]:
    """The stored request each time its output grew, and once more when it ended (the last state
    yielded is terminal). adopt(state): called with each active state read; it takes the request
    over when its gateway is gone, and returns whether it did."""
    num_seen = -1
    while cancel is None or not cancel.is_set():
        state = await store.load(request_id)
        if state is None:
            raise NotFound("request_id", f"no request {request_id!r} (unknown or expired)")
        if len(state.token_ids) > num_seen or state.status.is_terminal:
            num_seen = len(state.token_ids)
            yield state
        if state.status.is_terminal:
            return
        await adopt(state)
        await asyncio.sleep(poll_s)
