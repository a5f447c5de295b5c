"""Admission control: how many requests generate at once, and who waits for a turn.

At most max_active requests generate at once; up to max_queued more wait in a queue; beyond
that a request is refused at once (QueueFull: RESOURCE_EXHAUSTED, with a retry hint in
milliseconds the servicer sends as the trailing metadata RETRY_AFTER_KEY). Waiting requests are
served FIFO per tenant and round-robin across tenants (FairQueue), so one tenant's burst does
not starve another's single request; without API keys every request has the same key and the
queue is plain FIFO. A queued request whose deadline passes, or that is cancelled, leaves the
queue without ever reaching the primary.

    ticket = admission.enter(tenant)          # granted now, queued, or QueueFull
    try:
        waited_s = await ticket.wait_async(deadline, cancel, request_id)
        # DeadlineExceeded / Cancelled: it left the queue
        ... generate ...
    finally:
        ticket.release()                      # the slot goes to the next waiter

A queued request holds no thread, only a future that the grant resolves.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from specdec.errors import Cancelled, DeadlineExceeded, ResourceExhausted
from gateway.metrics import GatewayMetrics

# A full queue's RESOURCE_EXHAUSTED carries RETRY_AFTER_KEY (specdec.errors): when a retry may find
# room, integer milliseconds (HTTP fronts turn it into Retry-After), within these bounds.
MIN_RETRY_AFTER_MS, MAX_RETRY_AFTER_MS = 100, 60_000
DEFAULT_SERVICE_S = 1.0  # a request's time in a slot, until one has been measured
SERVICE_TIME_WEIGHT = 0.2  # weight of the latest request in the moving average of the service time
# How often a queued request looks at its cancel event (a deadline wakes it exactly).
CANCEL_POLL_S = 0.2

T = TypeVar("T")


class FairQueue(Generic[T]):
    """FIFO per key, round-robin across keys: after a key's item is taken, that key goes behind
    the others that wait. E.g. pushed a1 a2 a3 b1 c1 (key = letter) -> popped a1 b1 c1 a2 a3."""

    def __init__(self) -> None:
        self._queues: collections.OrderedDict[str, collections.deque[T]] = collections.OrderedDict()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, key: str, item: T) -> None:
        self._queues.setdefault(key, collections.deque()).append(item)
        self._len += 1

    def pop(self) -> T:
        """The head of the first key's queue (IndexError when empty)."""
        if not self._queues:
            raise IndexError("pop from an empty FairQueue")
        key, queue = next(iter(self._queues.items()))
        item = queue.popleft()
        if queue:
            self._queues.move_to_end(key)
        else:
            del self._queues[key]
        self._len -= 1
        return item

    def remove(self, key: str, item: T) -> bool:
        """Take item out wherever it waits; False when it is not queued (any more)."""
        queue = self._queues.get(key)
        if queue is None:
            return False
        try:
            queue.remove(item)
        except ValueError:
            return False
        if not queue:
            del self._queues[key]
        self._len -= 1
        return True


class QueueFull(ResourceExhausted):
    """The admission queue holds max_queued requests already; retry after retry_after_ms."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__("request_id", message)
        self.retry_after_ms = retry_after_ms


class Ticket:
    """One request's place: a slot (granted) or a place in the queue. release() exactly once,
    in a finally (it is idempotent)."""

    def __init__(self, admission: Admission, key: str, is_granted: bool) -> None:
        self._admission, self.key = admission, key
        self._granted = threading.Event()
        if is_granted:
            self._granted.set()
        self.queued_at = admission.clock()
        self.granted_at: float | None = self.queued_at if is_granted else None  # let in at once: waited 0
        self.is_released = False
        self._waker: Callable[[], object] | None = None  # wait_async's: called (lock held) when granted

    @property
    def is_granted(self) -> bool:
        return self._granted.is_set()

    async def wait_async(self, deadline: float | None, cancel: threading.Event, request_id: str) -> float:
        """Wait until the ticket holds a slot, holding no thread; the seconds it waited. A deadline
        (time.monotonic) that passes first -> DeadlineExceeded, a cancel first -> Cancelled, the
        coroutine cancelled (its client went away) -> asyncio.CancelledError: either way it left the
        queue (and a slot granted at that same moment went on to the next waiter)."""
        a = self._admission
        if not self._granted.is_set():
            loop = asyncio.get_running_loop()
            granted = loop.create_future()

            def resolve() -> None:
                if not granted.done():
                    granted.set_result(None)

            with a._lock:
                self._waker = lambda: loop.call_soon_threadsafe(resolve)
            try:
                while not self._granted.is_set():
                    timeout = CANCEL_POLL_S if deadline is None else min(CANCEL_POLL_S, max(0.0, deadline - a.clock()))
                    try:
                        await asyncio.wait_for(asyncio.shield(granted), timeout)
                    except asyncio.TimeoutError:
                        pass
                    if self._granted.is_set():
                        break
                    self._leave_if_ended(deadline, cancel, request_id)
            except asyncio.CancelledError:
                self.release()
                a.record_abandoned("cancelled", a.clock() - self.queued_at)
                raise
        return self._admitted()

    def _leave_if_ended(self, deadline: float | None, cancel: threading.Event, request_id: str) -> None:
        """Leave the queue (DeadlineExceeded / Cancelled) when the deadline passed or it was cancelled."""
        a = self._admission
        is_late = deadline is not None and a.clock() >= deadline
        if is_late or cancel.is_set():
            waited_s = a.clock() - self.queued_at
            self.release()
            a.record_abandoned("deadline" if is_late else "cancelled", waited_s)
            if is_late:
                raise DeadlineExceeded(
                    "request_id",
                    f"request {request_id!r} waited {waited_s:.1f} s in the "
                    "admission queue and its deadline passed before it could start",
                )
            raise Cancelled("request_id", f"request {request_id!r} was cancelled while queued")

    def _admitted(self) -> float:
        assert self.granted_at is not None, "a ticket is admitted once granted"
        waited_s = self.granted_at - self.queued_at
        self._admission.record_admitted(waited_s)
        return waited_s

    def release(self) -> None:
        """Give the slot back (to the next waiter), or leave the queue."""
        self._admission._release(self)


class Admission:
    def __init__(
        self,
        max_active: int,
        max_queued: int,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.max_active, self.max_queued, self.metrics, self.clock = max_active, max_queued, metrics, clock
        self._lock = threading.Lock()
        self._queue: FairQueue[Ticket] = FairQueue()
        self._num_active = 0
        self._service_s = DEFAULT_SERVICE_S

    @property
    def num_active(self) -> int:
        return self._num_active

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def enter(self, key: str, is_accepted: bool = False) -> Ticket:
        """A slot now when one is free and nobody waits; else a place in the queue; else QueueFull.
        An accepted request (one a previous gateway admitted, resumed from the store) is never
        refused: it waits for a slot like the others, beyond max_queued if need be."""
        with self._lock:
            if self._num_active < self.max_active and not self._queue:
                self._num_active += 1
                self._record_depth()
                return Ticket(self, key, is_granted=True)
            if len(self._queue) >= self.max_queued and not is_accepted:
                retry_ms = self._retry_after_ms()
                if self.metrics is not None:
                    self.metrics.admission_rejections.labels("queue_full").inc()
                raise QueueFull(
                    f"the gateway is at capacity ({self.max_active} requests running, "
                    f"{self.max_queued} waiting); retry in {retry_ms} ms",
                    retry_ms,
                )
            ticket = Ticket(self, key, is_granted=False)
            self._queue.push(key, ticket)
            self._record_depth()
            return ticket

    def record_admitted(self, waited_s: float) -> None:
        if self.metrics is not None:
            self.metrics.admission_wait.observe(waited_s)

    def record_abandoned(self, reason: str, waited_s: float) -> None:
        if self.metrics is not None:
            self.metrics.admission_rejections.labels(reason).inc()
            self.metrics.admission_wait.observe(waited_s)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.is_released:
                return
            ticket.is_released = True
            if not ticket.is_granted:
                self._queue.remove(ticket.key, ticket)
                self._record_depth()
                return
            now = self.clock()
            assert ticket.granted_at is not None  # set with is_granted
            held_s = now - ticket.granted_at
            self._service_s += SERVICE_TIME_WEIGHT * (held_s - self._service_s)
            if self._queue:  # the slot passes straight to the next waiter
                nxt = self._queue.pop()
                nxt.granted_at = now
                nxt._granted.set()
                if nxt._waker is not None:
                    nxt._waker()
                self._record_depth()
            else:
                self._num_active -= 1
                self._record_depth()

    def _retry_after_ms(self) -> int:
        """About when the queue next has room: one of max_active running requests ends every
        service time / max_active on average. Lock held."""
        ms = int(self._service_s / self.max_active * 1000)
        return max(MIN_RETRY_AFTER_MS, min(MAX_RETRY_AFTER_MS, ms))

    def _record_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.num_requests_waiting.set(len(self._queue))
            self.metrics.num_requests_running.set(self._num_active)
