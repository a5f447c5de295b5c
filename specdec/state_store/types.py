"""The request state store's contract: what is stored per request, and the
interface both stores (Redis, in-memory) implement identically: AsyncStateStore, in coroutines
for the gateway's event loop (synchronous tools and tests wrap a store in SyncStateStore).

Per request the store holds the parameters (a JSON object: the GenerateRequest
through protobuf json_format, or any plain dict), the status, the prompt's
token ids, the committed (generated) token ids, the latest statistics and the
adaptive controller's state. The gateway writes once per step
(`append_step`, one round trip on Redis); a restarted gateway lists the active
requests, claims them and loads everything back to re-prefill (design property
4: nothing lost).

Ownership: a gateway that resumes requests claims them for lease_s seconds
(or takes them over from a holder known to be gone: take_over, a compare-and-set);
an append_step that names its owner takes or renews the lease in the same
atomic write and fails while another owner holds a live lease. Together with
expected_num_tokens this fences a stalled gateway: it cannot write behind the
gateway that took its request over. Single-gateway deployments may ignore
ownership (owner=None skips it).
"""

from __future__ import annotations

import enum
import json
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, Unpack

from specdec.errors import AlreadyExists, FailedPrecondition, Internal, InvalidArgument, NotFound
from specdec.proto_ranges import MAX_TOKEN_ID

DEFAULT_NAMESPACE = "specdec"
DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_LEASE_S = 30.0
# Token ids are stored as little-endian int32, 4 bytes each.
TOKEN_BYTES = 4


class RequestStatus(enum.StrEnum):
    """Lifecycle of a request (mirrors specdec.v1.RequestStatus)."""

    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED})


@dataclass(frozen=True, slots=True)
class StateStoreConfig:
    """ttl_s: every write re-arms the expiry of all of a request's keys, so a
    request disappears ttl_s after its last write. lease_s: ownership lease."""

    namespace: str = DEFAULT_NAMESPACE
    ttl_s: float = DEFAULT_TTL_S
    lease_s: float = DEFAULT_LEASE_S

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in "{}: "):
            raise ValueError(f"namespace must be a non-empty word without '{{}}: ', got {self.namespace!r}")
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")


@dataclass(frozen=True, slots=True)
class RequestState:
    """Everything stored about one request (what recovery loads back)."""

    request_id: str
    params: dict[str, Any]
    status: RequestStatus
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # committed generated tokens, in order
    stats: dict[str, Any]
    controller_state: dict[str, Any]
    finish_reason: str
    error: str
    owner: str  # "" when unclaimed or the lease expired
    created_ms: int
    updated_ms: int
    # The primary's lease on the request's KV slot (PrefillResponse.kv_lease), as the gateway
    # last wrote it: a successor gateway re-prefills the live slot with it. "" when none.
    kv_lease: str = ""
    # The node (gateway.nodes: its primary's address) whose primary holds that slot: the node the
    # request runs on. "" when none was recorded (a single-node gateway, or not prefilled yet).
    node: str = ""


class CreateOptions(TypedDict, total=False):
    """create's keyword arguments (absent: the default)."""

    prompt_token_ids: Sequence[int]  # default ()
    status: RequestStatus  # default QUEUED


class StepFields(TypedDict, total=False):
    """append_step's keyword arguments: what one step writes besides its tokens (None or absent:
    leave the stored value as it is)."""

    # The count of committed tokens before this step; it keys the step (see append_step).
    expected_num_tokens: int | None
    status: RequestStatus | None
    stats: Mapping[str, Any] | None
    controller_state: Mapping[str, Any] | None
    finish_reason: str | None
    error: str | None
    # The writing gateway: it takes or renews the lease in the same write (None: no ownership).
    owner: str | None
    kv_lease: str | None
    node: str | None


class AsyncStateStore(Protocol):
    """The state store (AsyncRedisStateStore, AsyncInMemoryStateStore); synchronous callers wrap
    one in specdec.state_store.sync.SyncStateStore.

    Errors (specdec.errors): NotFound for an unknown request_id, AlreadyExists
    for create() of an existing one, FailedPrecondition for a write to a
    finished request, a token-count mismatch or a lost lease, Unavailable when
    the backend cannot be reached, Internal (record_corrupt) for a stored record
    that cannot be read back (a bug or an operator wrote it).
    """

    async def create(self, request_id: str, params: Mapping[str, Any], **options: Unpack[CreateOptions]) -> None:
        """Store a new request (active until a terminal status)."""
        ...

    async def append_step(self, request_id: str, token_ids: Sequence[int] = (), **step: Unpack[StepFields]) -> int:
        """The per-step write, atomic and one round trip: append committed
        tokens and replace whichever fields of `step` are given. expected_num_tokens (the count before
        this step) keys the step: a replay of a step already applied (the log ends
        with exactly its tokens at that position; its reply was lost) succeeds with
        the count and writes nothing; any other write at a count that does not match
        fails (FailedPrecondition). Returns the number of committed tokens after the write."""
        ...

    async def set_status(
        self, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = ""
    ) -> bool:
        """Move a request to status; False (no change) when it already ended."""
        ...

    async def claim(self, request_id: str, owner: str) -> bool:
        """Take (or renew) the request's lease for owner; False when another
        owner holds a live lease or the request has ended."""
        ...

    async def take_over(self, request_id: str, owner: str, dead_owner: str) -> bool:
        """Compare-and-set of the lease: give it to owner only while its holder is exactly dead_owner
        (a gateway found not answering), whatever time that lease has left; False when anyone else
        holds it, nobody does (claim is for that), or the request has ended. Two gateways that both
        found dead_owner gone race here, and one wins."""
        ...

    async def load(self, request_id: str) -> RequestState | None:
        """Everything stored about the request; None when unknown or expired."""
        ...

    async def list_active(self) -> list[str]:
        """Ids of requests not yet ended (queued or running), oldest first."""
        ...

    async def delete(self, request_id: str) -> bool:
        """Forget the request now; False when it did not exist."""
        ...

    async def close(self) -> None:
        """Release the backend connection."""
        ...


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """[5, 258] -> b'\\x05\\x00\\x00\\x00\\x02\\x01\\x00\\x00' (int32 little-endian)."""
    packed = array("i")
    assert packed.itemsize == TOKEN_BYTES
    for t in token_ids:
        t = int(t)
        if not 0 <= t <= MAX_TOKEN_ID:
            raise InvalidArgument("token_ids", f"token id {t} is outside [0, {MAX_TOKEN_ID}]")
        packed.append(t)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def decode_token_ids(data: bytes | None) -> tuple[int, ...]:
    """Inverse of encode_token_ids (None, from a missing key, -> ())."""
    if not data:
        return ()
    if len(data) % TOKEN_BYTES:
        raise ValueError(f"token log of {len(data)} bytes is not a whole number of int32")
    packed = array("i")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return tuple(packed)


def encode_json(field: str, value: Mapping[str, Any]) -> str:
    """Compact JSON of a plain dict (params, stats, controller state)."""
    try:
        return json.dumps(dict(value), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(field, f"not JSON-serializable: {e}") from None


def check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidArgument("request_id", "must not be empty")
    # Braces would break the Redis Cluster hash tag {request_id} of the keys.
    if "{" in request_id or "}" in request_id:
        raise InvalidArgument("request_id", f"must not contain braces, got {request_id!r}")


def check_keywords(function: str, given: Mapping[str, Any], declared: frozenset[str]) -> None:
    """Refuse keyword arguments that are not declared (a misspelled one would be dropped)."""
    unknown = sorted(set(given) - declared)
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword arguments {unknown}")


def check_step(step: StepFields) -> None:
    """Refuse keyword arguments that are not StepFields and out-of-range values."""
    check_keywords("append_step", step, StepFields.__optional_keys__)
    status, expected_num_tokens = step.get("status"), step.get("expected_num_tokens")
    if status is not None and not isinstance(status, RequestStatus):
        raise InvalidArgument("status", f"must be a RequestStatus, got {status!r}")
    if expected_num_tokens is not None and expected_num_tokens < 0:
        raise InvalidArgument("expected_num_tokens", f"must be >= 0, got {expected_num_tokens}")


# The contract's errors, built here so that both stores word them alike.
def request_exists(request_id: str) -> AlreadyExists:
    return AlreadyExists("request_id", f"request {request_id!r} exists already")


def request_not_found(request_id: str) -> NotFound:
    return NotFound("request_id", f"no stored request {request_id!r}")


def request_ended(request_id: str, status: str) -> FailedPrecondition:
    return FailedPrecondition("request_id", f"request {request_id!r} has ended ({status})")


def lease_held(request_id: str, holder: str, owner: str | None) -> FailedPrecondition:
    """The write of owner refused: holder has a live lease on the request."""
    return FailedPrecondition("owner", f"the lease of {request_id!r} is held by {holder!r}, not {owner!r}")


def record_corrupt(request_id: str, field: str, problem: str) -> Internal:
    """A stored record the store cannot read back (a bug or an operator wrote it): the store's fault,
    not the caller's, told apart from a store that does not answer (Unavailable)."""
    return Internal(
        "state_store",
        f"the stored record of request {request_id!r} is corrupt: {field} {problem}",
        dependency="state_store",
    )


def token_count_mismatch(num_stored: int, expected_num_tokens: int) -> FailedPrecondition:
    return FailedPrecondition(
        "expected_num_tokens",
        f"the store holds {num_stored} committed tokens, the writer expected {expected_num_tokens} "
        "(a retried or concurrent write)",
    )


async def set_status_by_step(
    store: AsyncStateStore, request_id: str, status: RequestStatus, *, finish_reason: str = "", error: str = ""
) -> bool:
    """set_status for any store: a step that appends nothing; False when the request already ended."""
    try:
        await store.append_step(request_id, status=status, finish_reason=finish_reason, error=error)
    except FailedPrecondition:
        return False
    return True
