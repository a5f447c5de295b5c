"""The state store with its status writes checked against the request's lease like step writes.

A loop writes each step and its end with its owner (gateway.request_record), so a gateway that lost
a request to another (taken over while it was cut off, gateway.owner_probe) is refused and stops
without touching the adopter's record. A status write (set_status) is not checked against the lease
by the store's contract: unchecked, a stopped gateway would mark CANCELLED (or FAILED) the request
its adopter is running. Here set_status is a step that appends nothing, written with the owner, so
the store refuses it (False, as for a request that already ended) while another gateway holds the
lease: for status writes outside a loop (an adopted request cancelled while it waited for a slot,
gateway.resume). Everything else goes to the store as it is.

The Cancel RPC keeps the plain store: a client may cancel its request on any gateway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Unpack

from specdec.errors import FailedPrecondition
from specdec.state_store import AsyncStateStore, RequestState, RequestStatus, StepFields
from specdec.state_store.types import CreateOptions


class OwnerFencedStore:
    """AsyncStateStore over `store` whose set_status writes as `owner`."""

    def __init__(self, store: AsyncStateStore, owner: str) -> None:
        if not owner:
            raise ValueError("owner must not be empty")
        self.store, self.owner = store, owner

    async def set_status(
        self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = ""
    ) -> bool:
        """Move the request to status unless it ended or another gateway holds its lease (False)."""
        try:
            await self.store.append_step(
                request_id, status=status, finish_reason=finish_reason, error=error, owner=self.owner
            )
        except FailedPrecondition:
            return False
        return True

    async def create(self, request_id: str, params: Mapping[str, Any], **options: Unpack[CreateOptions]) -> None:
        await self.store.create(request_id, params, **options)

    async def append_step(self, request_id: str, token_ids: Sequence[int] = (), **step: Unpack[StepFields]) -> int:
        return await self.store.append_step(request_id, token_ids, **step)

    async def claim(self, request_id: str, owner: str) -> bool:
        return await self.store.claim(request_id, owner)

    async def take_over(self, request_id: str, owner: str, dead_owner: str) -> bool:
        return await self.store.take_over(request_id, owner, dead_owner)

    async def load(self, request_id: str) -> RequestState | None:
        return await self.store.load(request_id)

    async def list_active(self) -> list[str]:
        return await self.store.list_active()

    async def delete(self, request_id: str) -> bool:
        return await self.store.delete(request_id)

    async def close(self) -> None:
        """The store is the servicer's: it closes it."""
