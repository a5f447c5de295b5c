"""KV slots as capabilities: each request's slot is leased to the caller that prefilled it.

Prefill grants a lease, an unguessable token only that caller (one gateway
instance) learns; Verify, Decode and Release must present it, and so must a
Prefill of the request while it is live (a recovery that replaces the slot):
without it, ALREADY_EXISTS, and the running request goes on untouched. A wrong or
missing lease gets the same NOT_FOUND as an unknown request id, so nobody
else can step, read or free the request, or learn that it exists. Every
accepted call renews the lease, and a DecodeStream's run at each of its steps
(a run may stream for longer than lease_s); a slot with no call for lease_s is expired
(released by the primary), so a caller that died or a Prefill nobody follows
up cannot hold KV memory forever. A gateway whose request was expired finds
NOT_FOUND at its next step and re-prefills from the committed tokens.

A Prefill without the lease may still replace a slot that has had no call for
takeover_s (far shorter than lease_s): its holder is presumed dead. That is the
case of a gateway that died after a failover's re-prefill but before its next
step stored the new lease: the successor that adopts the request (once the
dead owner failed its health checks, or its lease in the state store lapsed)
holds the old lease, and without this would wait out lease_s. A successor that
adopts sooner than takeover_s retries its Prefill until then.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
import threading
import time
from collections.abc import Callable

from specdec.errors import NotFound

DEFAULT_LEASE_S = 300.0
DEFAULT_TAKEOVER_S = 10.0  # below the gateways' default owner lease (30 s): an adopter never waits it out
LEASE_BYTES = 16  # 128 bits


@dataclasses.dataclass(slots=True)
class _Lease:
    token: str
    renewed_at: float


class KVLeases:
    def __init__(
        self,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
        takeover_s: float = DEFAULT_TAKEOVER_S,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if takeover_s <= 0:
            raise ValueError(f"takeover_s must be > 0, got {takeover_s}")
        self.lease_s, self.takeover_s, self._clock = lease_s, takeover_s, clock
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()

    def grant(self, request_id: str) -> str:
        """A new lease on request_id's slot (replacing any earlier one)."""
        token = secrets.token_hex(LEASE_BYTES)
        with self._lock:
            self._leases[request_id] = _Lease(token, self._clock())
        return token

    def check(self, request_id: str, token: str) -> None:
        """Renew the lease, or NotFound when token is not request_id's current lease."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not hmac.compare_digest(lease.token.encode(), token.encode()):
                raise NotFound("request_id", f"no active request {request_id!r} on this primary")
            lease.renewed_at = self._clock()

    def renew(self, request_id: str, token: str) -> None:
        """Renew the lease when token is still request_id's current one (else nothing): a call in
        progress holds the slot at each of its steps, as a new call would."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None and hmac.compare_digest(lease.token.encode(), token.encode()):
                lease.renewed_at = self._clock()

    def may_replace(self, request_id: str, token: str) -> bool:
        """A Prefill may replace request_id's live slot: token is its lease, or the slot has had no
        call for takeover_s (its holder presumed dead). No renewal: the caller is about to replace it."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            is_holder = hmac.compare_digest(lease.token.encode(), token.encode())
            return is_holder or self._clock() - lease.renewed_at >= self.takeover_s

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._leases.pop(request_id, None)

    def take_expired(self) -> list[str]:
        """The requests whose lease ran out, forgotten here (their slots are the caller's to free)."""
        deadline = self._clock() - self.lease_s
        with self._lock:
            expired = [r for r, lease in self._leases.items() if lease.renewed_at <= deadline]
            for request_id in expired:
                del self._leases[request_id]
        return expired

    def __len__(self) -> int:
        return len(self._leases)
