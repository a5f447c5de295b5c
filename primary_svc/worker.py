"""One thread owns the engine; RPC threads hand it work and wait. It runs a scheduler loop.

The engine thread keeps two queues (policy: primary_svc.scheduler):

- verify: the pending Verify/Decode items of running requests (one per request per step);
- waiting: prefills, FIFO: a new request's Prefill (its KV is allocated only when its whole prompt
  fits the free KV bytes, admission instead of failure; it waits at most until its RPC deadline, and
  leaves the queue when its RPC ends before, taking no KV), and
  preempted requests, which re-prefill from their committed tokens before their verify runs.

Each step the policy fills a budget of `max_step_tokens` rows with the verify rows first, then with
prefill chunks of at most `prefill_chunk_tokens` rows per waiting request, so a long prompt is
prefilled over several steps while the others keep decoding. Whatever arrived while a step ran
joins the next one (continuous batching); before a step with verify work the loop waits a few
milliseconds at most (`batch_wait_s`) for the running requests that usually come back that soon
(`_gather`), since on a CPU a step holds every core and the others would otherwise miss it.

Where the model is batch invariant (packed int4/int8 kernels: a row gets the same bits whatever the
batch) the verify rows and every prefill chunk run as ONE forward; elsewhere (fp32/bf16, whose GEMMs
round differently with the row count) the verify rows run as one forward and each chunk in a forward
of its own, cut where an uninterrupted prefill cuts, so the cache holds the same bits as before.

With a prefix cache (specdec.engine.prefix_cache) a prefill is admitted with its whole prompt's
KV, as without one, and then copies the cached prefix of its prompt into the slot at admission: only
the rest runs in chunks. The cache's rows are copies under a budget of their own; they never count
against the KV budget admission and preemption work with.

When the verify rows need more KV than is free, running requests are preempted, newest admitted
first: their KV is released and they re-prefill (from their committed tokens) when room returns.

Each verify item first commits the previous step of its request (accepted path + new tokens), then
joins the queue; an item whose commit or tree is invalid fails alone.

Every tensor operation of the process runs on this one thread: the model's loading and the
start-up measurements (`run` before the engine exists), and per RPC the caller's `finish`
(argmax, grammar mask, logits encoding) right after the forward, so RPC threads only build
protobufs from plain values. Torch's OpenMP runtime keeps one team of worker threads per
calling thread, and a forward on a second thread ran 2x slower than on the first (int4,
measured: 27-33 ms per step when one thread did everything, 56-88 ms when the model had been
loaded on another thread).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from primary_svc.scheduler import (
    DEFAULT_MAX_STEP_TOKENS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    RunningEntry,
    SchedulerPolicy,
    StepPlan,
    VerifyEntry,
    WaitingEntry,
    choose_victims,
)
from specdec.engine.engine import Engine, PrefillChunk, VerifyWork
from specdec.engine.prefix_cache import PrefixCacheStats
from specdec.engine.tree import chain_parents
from specdec.errors import Cancelled, DeadlineExceeded, NotFound, ResourceExhausted, SpecdecError
from specdec.request_id import tenant_of
from primary_svc.metrics import PrimaryMetrics

STEP_HISTORY = 4096  # steps whose composition `step_history` keeps
# Steps a new prompt sits out at most, in all, waiting for a prefix another prefill computes
# (scheduler, "Shared prefixes"): one is the usual (the leader's chunk runs in the very step).
MAX_PREFIX_HOLDS = 2
# A request whose last result went out longer ago than this is no longer expected back soon: a step
# does not wait for it (its client streams slowly, its gateway drafts a long tree, or it is done).
RETURN_WINDOW_S = 0.25
RETURN_MARGIN = 1.5  # a step waits for a request until 1.5x its usual time to come back
RETURN_GAP_SMOOTHING = 0.5  # weight of the newest gap in a request's smoothed time to come back


@dataclasses.dataclass(frozen=True, slots=True)
class RunStep:
    """What a run of plain steps does after a step (the `repeat` of EngineWorker.verify).

    E.g. drafts [x, y, z] verified, x and y accepted, w decided after them: committed (x, y, w),
    accepted_nodes (0, 1); the next step drafts `draft_token_ids` as a chain after w."""

    committed_token_ids: Sequence[int]  # the step's tokens: its accepted drafts, then the token it decided
    accepted_nodes: Sequence[int] = ()  # the drafts among them: the step's chain's first nodes
    draft_token_ids: Sequence[int] = ()  # the next step's drafts, a chain after the decided token
    is_last: bool = False  # the run ends with this step: its decided token stays pending


@dataclasses.dataclass(slots=True, eq=False)
class _VerifyItem:
    request_id: str
    accepted_nodes: Sequence[int]
    committed_token_ids: Sequence[int]
    tree_token_ids: Sequence[int]
    tree_parents: Sequence[int]
    num_lookahead: int  # the tree's last nodes that are lookahead rows (VerifyWork.num_lookahead)
    finish: Callable[[torch.Tensor], Any]
    # After each step, repeat(finish's result) -> what the step commits and whether one more plain
    # step of this request follows (a run of plain steps in one call, EngineWorker.verify)
    repeat: Callable[[Any], RunStep] | None = None
    forward_ms: float = 0.0  # the forwards of the steps so far
    # Given: receives the features of the verify's logits rows [N+L+1, C] before `finish` runs.
    features_out: list[torch.Tensor] | None = None
    # Given: on_step(finish's result, the step's forward ms, is_last) after each step of the call, once
    # the request's next step (if any) has committed the step's token: a streamed run's messages.
    on_step: Callable[[Any, float, bool], None] | None = None
    # Set by the caller (its RPC ended): the run stops at the next step boundary, its tokens committed.
    cancel: threading.Event | None = None
    # > 0: the request's context is first cut back to this many tokens (DecodeRequest.num_context_tokens)
    num_context_tokens: int = 0
    # (the last result, forward ms), or the error that ended the call
    future: Future = dataclasses.field(default_factory=Future)

    @property
    def is_cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def work(self) -> VerifyWork:
        return VerifyWork(self.request_id, self.tree_token_ids, self.tree_parents, self.num_lookahead)


@dataclasses.dataclass(slots=True, eq=False)
class _PrefillItem:
    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    deadline: float | None  # time.monotonic() past which it fails (while it waits)
    # The request is live (open, or its Prefill queued): called before its state is dropped; what it
    # raises refuses this Prefill and leaves the live request as it was.
    on_replace: Callable[[], None]
    finish: Callable[[int], Any]  # finish(num_cached) on the engine thread once prefilled
    future: Future
    # Given: receives the features [1, C] of the last prefilled row before `finish` runs, when the
    # prefill computed that row (not when the prefix cache held it).
    features_out: list[torch.Tensor] | None = None
    # Set by the caller (its RPC ended): it leaves the queue, its KV released, CANCELLED (wake() it).
    cancel: threading.Event | None = None


@dataclasses.dataclass(slots=True, eq=False)
class _CallItem:
    fn: Callable[[], Any]
    future: Future


@dataclasses.dataclass(slots=True, eq=False)
class _Waiting:
    entry: WaitingEntry
    prefill: _PrefillItem | None = None  # a new request's Prefill
    verify: _VerifyItem | None = None  # a preempted request's verify, run once it is re-prefilled
    num_holds: int = 0  # steps it sat out for a prefix another prefill was computing


@dataclasses.dataclass(frozen=True, slots=True)
class StepComposition:
    num_verify_items: int
    num_verify_rows: int
    num_prefill_chunks: int
    num_prefill_rows: int
    num_forwards: int


@dataclasses.dataclass(slots=True)
class BatchStats:
    num_batches: int = 0  # steps with verify work
    num_items: int = 0  # verify items run
    max_batch_seen: int = 0
    num_steps: int = 0
    num_prefill_chunks: int = 0
    num_preemptions: int = 0


@dataclasses.dataclass(slots=True)
class _Forwarded:
    """What a step's forwards gave (EngineWorker._forward)."""

    results: list[torch.Tensor]  # one logits tensor per verify item, in order
    verify_features: list[torch.Tensor] | None  # one per verify item, when a call asked
    prefill_features: dict[str, torch.Tensor]  # request id -> its last prefilled row's, when asked
    num_forwards: int
    forward_ms: float  # the verifies' forward (batch invariant: the whole step's)
    step_s: float


class EngineWorker:
    """The engine thread. `engine` may be None at first: build it with `run` (on this thread)
    and set it before serving."""

    def __init__(
        self,
        engine: Engine | None,
        max_batch: int = 32,
        max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        metrics: PrimaryMetrics | None = None,
        batch_wait_s: float = 0.0,
        return_window_s: float = RETURN_WINDOW_S,
    ) -> None:
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        self.max_batch = max_batch
        self.batch_wait_s, self.return_window_s = batch_wait_s, return_window_s
        self.max_step_tokens, self.prefill_chunk_tokens = max_step_tokens, prefill_chunk_tokens
        SchedulerPolicy(max_step_tokens, prefill_chunk_tokens)  # the settings' check, before the thread
        self._policy: SchedulerPolicy | None = None
        self._engine: Engine | None = None
        self.engine = engine
        self.metrics = metrics
        self.stats = BatchStats()
        self.step_history: collections.deque[StepComposition] = collections.deque(maxlen=STEP_HISTORY)
        # Rows (verify + prefill, every request's) of the step whose items are being finished: set by
        # the engine thread before it calls their `finish`, so a `finish` may read it (the load).
        self.step_rows = 0
        self.step_requests = 0  # the verify items and prefill chunks of that step
        self._inbox: queue.Queue = queue.Queue()
        self._verifies: collections.deque[_VerifyItem] = collections.deque()
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._deferred: list[_VerifyItem] = []  # a second verify of a request already queued
        self._admitted_seq: dict[str, int] = {}
        self._returning: dict[str, float] = {}  # request -> when its last verify result went out
        self._return_gap: dict[str, float] = {}  # request -> how long it takes to come back (smoothed), s
        self._prefix_stats_seen = PrefixCacheStats()  # what the metrics counted so far
        self._seq = itertools.count()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> Engine | None:
        return self._engine

    @engine.setter
    def engine(self, engine: Engine | None) -> None:
        self._engine = engine
        if engine is not None:
            # Chunks may be cut anywhere only where every row's bits are independent of the cut.
            if not engine.is_cut_anywhere and engine.prefix_cache is not None:
                if engine.prefill_chunk_tokens != self.prefill_chunk_tokens:
                    raise ValueError(
                        f"the engine's prefix cache reuses rows at multiples of {engine.prefill_chunk_tokens} "
                        f"tokens but this scheduler cuts prompts every {self.prefill_chunk_tokens}"
                    )
            self._policy = SchedulerPolicy(
                self.max_step_tokens, self.prefill_chunk_tokens, engine.is_cut_anywhere, max_verify_items=self.max_batch
            )

    def _built(self) -> tuple[Engine, SchedulerPolicy]:
        """The engine and its policy, for work that arrives only once the engine is built: the
        service serves RPCs after `run` built it (primary_svc.__main__)."""
        assert self._engine is not None and self._policy is not None, "work arrived before the engine was built"
        return self._engine, self._policy

    def built_engine(self) -> Engine:
        """The engine, for the servicer's RPCs (served once it is built)."""
        return self._built()[0]

    @property
    def queue_depth(self) -> int:
        return self._inbox.qsize() + len(self._verifies) + len(self._waiting)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread and return its result (or raise its exception): the model's
        loading, before the engine exists."""
        future: Future = Future()
        self._inbox.put(_CallItem(fn, future))
        return future.result()

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread and return its result (or raise its exception)."""
        return self.run(lambda: fn(self._built()[0]))

    def prefill(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_prompt_tokens: int = 0,
        timeout_s: float | None = None,
        on_replace: Callable[[], None] = lambda: None,
        finish: Callable[[int], Any] = lambda num_cached: num_cached,
        features_out: list[torch.Tensor] | None = None,
        cancel: threading.Event | None = None,
    ) -> Any:
        """Open the request (replacing an open one of that id) and prefill it; returns finish(num_cached).

        It waits in the queue until its prompt fits the KV budget, at most timeout_s (then
        DEADLINE_EXCEEDED); a prompt larger than the whole budget fails at once (RESOURCE_EXHAUSTED).
        `cancel` set (then wake()) while it waits or is prefilled: it leaves the queue, CANCELLED, and
        takes no KV; one that finished keeps its slot."""
        future: Future = Future()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._inbox.put(
            _PrefillItem(
                request_id,
                list(token_ids),
                num_prompt_tokens,
                deadline,
                on_replace,
                finish,
                future,
                features_out,
                cancel,
            )
        )
        return future.result()

    def verify(
        self,
        request_id: str,
        accepted_nodes: Sequence[int],
        committed_token_ids: Sequence[int],
        tree_token_ids: Sequence[int],
        tree_parents: Sequence[int],
        finish: Callable[[torch.Tensor], Any] = lambda logits: logits,
        num_lookahead: int = 0,
        repeat: Callable[[Any], RunStep] | None = None,
        features_out: list[torch.Tensor] | None = None,
        num_context_tokens: int = 0,
        cancel: threading.Event | None = None,
    ) -> tuple[Any, float]:
        """Commit the previous step, verify the tree (its last `num_lookahead` nodes lookahead rows);
        returns (finish(logits [N+1+L, V], the L lookahead rows last), forward ms).

        `finish` runs on the engine thread; an exception it raises fails this item alone. With
        `repeat` (an empty tree: plain decoding), the request stays in the queue for more steps: after
        each, repeat(finish's result) gives the step's RunStep: the tokens to commit before the next
        (its decided token, after the drafts it accepted) and the next step's drafts, or is_last to
        return that result; a step that would not fit the context is not taken (drafts that would not
        are not verified). A run that ends keeps its last step's accepted drafts committed, its decided
        token pending. The returned forward ms are every step's. One call then decodes several tokens,
        each step beside the other requests', without a round trip between them. `features_out` receives
        the features of the logits rows [N+1+L, C] before `finish` runs (the step then runs eagerly).
        `num_context_tokens` > 0: the request's context is cut back to that many tokens before the commit
        (Engine.truncate). `cancel` set (then wake()): the call's step leaves the queue unrun (CANCELLED),
        its commit done, and a run takes no further step, as stream_decode's."""
        item = _VerifyItem(
            request_id,
            accepted_nodes,
            committed_token_ids,
            tree_token_ids,
            tree_parents,
            num_lookahead,
            finish,
            repeat,
            features_out=features_out,
            cancel=cancel,
            num_context_tokens=num_context_tokens,
        )
        self._inbox.put(item)
        return item.future.result()

    def stream_decode(
        self,
        request_id: str,
        accepted_nodes: Sequence[int],
        committed_token_ids: Sequence[int],
        finish: Callable[[torch.Tensor], Any],
        repeat: Callable[[Any], RunStep] | None,
        on_step: Callable[[Any, float, bool], None],
        cancel: threading.Event,
        num_context_tokens: int = 0,
    ) -> Future:
        """A run of plain steps as `verify` with `repeat` runs it (one step without), without waiting: on_step(finish's
        result, the step's forward ms, is_last) on the engine thread after each step, the step's token
        committed by then unless is_last. Setting `cancel` ends the run at the next step boundary (no
        further step is taken; a step already queued is dropped); what was committed stays, as the KV.
        The returned future holds (the last result, forward ms) or the error that ended the run."""
        item = _VerifyItem(
            request_id,
            accepted_nodes,
            committed_token_ids,
            tree_token_ids=(),
            tree_parents=(),
            num_lookahead=0,
            finish=finish,
            repeat=repeat,
            on_step=on_step,
            cancel=cancel,
            num_context_tokens=num_context_tokens,
        )
        self._inbox.put(item)
        return item.future

    def wake(self) -> None:
        """A turn of the engine thread, which may be waiting for work: to see a call's `cancel`."""
        self._inbox.put(_CallItem(lambda: None, Future()))

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout=5)

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            for item in self._next_items():
                if item is None:
                    self._stopped.set()
                    break
                self._intake_or_fail(item)
            if self._stopped.is_set():
                break
            self._expire_waiting()
            if self._verifies and self.batch_wait_s > 0:
                self._gather()
                if self._stopped.is_set():
                    break
            if self._verifies or self._waiting:
                try:
                    self._step()
                except Exception as e:  # noqa: BLE001 - a scheduling bug must not hang every caller
                    self._fail_queued(e)
                deferred, self._deferred = self._deferred, []
                for item in deferred:
                    self._intake_or_fail(item)
            self._observe()
        self._fail_pending()

    def _gather(self) -> None:
        """Before a step with verify work, wait for the running requests whose results just went out
        and that usually come back within `batch_wait_s`, so that they share this step.

        On a CPU the engine's threads take every core for a step: a step started with the first
        request back leaves the gateway no core to turn the others around, and they miss it. At a
        few requests a verify row costs a fraction of a step (4 rows ~1.7x one), so one step of all
        of them beats a step each. A request is waited for until its usual return time (1.5x its
        smoothed gap, or the whole bound before it has one); one that usually takes longer than
        the bound (a long draft, a slow client) is not waited for at all."""
        engine, _ = self._built()
        start = time.monotonic()
        while len(self._verifies) < self.max_batch:
            now = time.monotonic()
            self._returning = {rid: t for rid, t in self._returning.items() if now - t < self.return_window_s}
            queued = {v.request_id for v in self._verifies}
            until = start
            for rid, out_at in self._returning.items():
                gap = self._return_gap.get(rid)
                if rid in queued or not engine.has_request(rid) or (gap is not None and gap > self.batch_wait_s):
                    continue
                until = max(until, start + self.batch_wait_s if gap is None else out_at + RETURN_MARGIN * gap)
            until = min(until, start + self.batch_wait_s)
            if now >= until:
                return
            try:
                item = self._inbox.get(timeout=until - now)
            except queue.Empty:
                return
            if item is None:
                self._stopped.set()
                return
            self._intake_or_fail(item)

    def _next_items(self) -> list:
        """What arrived; blocks when there is nothing to run (until the next waiting deadline)."""
        if self._verifies or self._has_runnable_waiting():
            block, timeout = False, None
        else:
            deadlines = [w.prefill.deadline for w in self._waiting if w.prefill and w.prefill.deadline]
            block, timeout = True, (max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)
        items = []
        try:
            items.append(self._inbox.get(block=block, timeout=timeout))
        except queue.Empty:
            return items
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _has_runnable_waiting(self) -> bool:
        if not self._waiting or self.engine is None:
            return False
        if any(w.entry.is_admitted for w in self._waiting):
            return True
        free = self.engine.kv_cache.free_bytes
        return free is None or self._waiting[0].entry.kv_bytes_to_admit <= free

    def _intake_or_fail(self, item: Any) -> None:
        try:
            self._intake(item)
        except Exception as e:  # noqa: BLE001 - handed to the caller; the engine thread goes on
            if not item.future.done():
                item.future.set_exception(e)

    def _fail_queued(self, error: BaseException) -> None:
        """Fail every queued verify and prefill; the waiting ones release their KV."""
        for item in list(self._verifies):
            item.future.set_exception(error)
        self._verifies.clear()
        for w in list(self._waiting):
            self._fail_waiting(w, error)

    def _intake(self, item: Any) -> None:
        if isinstance(item, _CallItem):
            try:
                item.future.set_result(item.fn())
            except BaseException as e:  # handed to the waiting RPC thread, which maps it to a status
                item.future.set_exception(e)
            self._forget_closed()
        elif isinstance(item, _VerifyItem):
            self._intake_verify(item)
        else:
            self._intake_prefill(item)

    def _intake_verify(self, item: _VerifyItem) -> None:
        rid = item.request_id
        if (out_at := self._returning.pop(rid, None)) is not None:  # how long it took to come back
            gap, before = time.monotonic() - out_at, self._return_gap.get(rid)
            self._return_gap[rid] = gap if before is None else before + RETURN_GAP_SMOOTHING * (gap - before)
        if any(v.request_id == rid for v in self._verifies) or any(
            w.verify is not None and w.verify.request_id == rid for w in self._waiting
        ):
            self._deferred.append(item)  # runs after the queued one
            return
        engine, _ = self._built()
        try:
            if item.num_context_tokens:  # tokens of a cancelled run the caller never received go first
                engine.truncate(rid, item.num_context_tokens)
            if item.accepted_nodes or item.committed_token_ids:  # nothing to commit: a (re)verify only
                engine.commit(rid, item.accepted_nodes, item.committed_token_ids)
            engine.check_verify(item.work(), is_evicted_ok=True)
        except SpecdecError as e:
            item.future.set_exception(e)
            return
        if engine.is_evicted(rid):
            self._wait_for_reprefill(item)
        else:
            self._verifies.append(item)

    def _wait_for_reprefill(self, item: _VerifyItem) -> None:
        """A preempted request's (committed) verify: re-prefill first, ahead of new prompts. It is
        admitted only with room for its tree too, so its verify cannot need to preempt it again."""
        (engine, _), rid = self._built(), item.request_id
        need = engine.kv_bytes_to_open(len(engine.token_ids(rid)) + len(item.tree_token_ids))
        self._waiting.appendleft(_Waiting(WaitingEntry(rid, engine.num_to_prefill(rid), need), verify=item))

    def _intake_prefill(self, item: _PrefillItem) -> None:
        (engine, _), rid = self._built(), item.request_id
        try:
            is_queued = any(w.prefill is not None and w.entry.request_id == rid for w in self._waiting)
            if engine.has_request(rid) or is_queued:  # a re-prefill (recovery) replaces the old state
                item.on_replace()
            if engine.has_request(rid):
                self._drop(rid, NotFound("request_id", f"request {rid!r} was replaced by a new prefill"))
                engine.release(rid)
            self._drop(rid, NotFound("request_id", f"request {rid!r} was replaced by a new prefill"))
            engine.check_open(rid, item.token_ids)
            need = engine.kv_bytes_to_open(len(item.token_ids))
            max_bytes = engine.kv_cache.max_bytes
            if max_bytes is not None and need > max_bytes:
                raise ResourceExhausted(
                    "kv_cache",
                    f"{len(item.token_ids)} tokens need {need} KV bytes, more than the whole budget of {max_bytes}",
                )
        except BaseException as e:
            item.future.set_exception(e)
            return
        self._waiting.append(_Waiting(WaitingEntry(rid, len(item.token_ids) - 1, need), prefill=item))

    def _drop(self, request_id: str, error: SpecdecError) -> None:
        """Fail and forget the queued work of request_id."""
        for v in [v for v in self._verifies if v.request_id == request_id]:
            self._verifies.remove(v)
            v.future.set_exception(error)
        for w in [w for w in self._waiting if w.entry.request_id == request_id]:
            self._waiting.remove(w)
            for i in (w.prefill, w.verify):
                if i is not None:
                    i.future.set_exception(error)
        self._admitted_seq.pop(request_id, None)

    def _forget_closed(self) -> None:
        """Queued work of requests a call released (Release, lease expiry) fails as NOT_FOUND."""
        if self.engine is None:
            return
        gone = {v.request_id for v in self._verifies if not self.engine.has_request(v.request_id)}
        gone |= {w.entry.request_id for w in self._waiting if w.entry.is_admitted or w.verify is not None}
        for rid in gone:
            if not self.engine.has_request(rid):
                self._drop(rid, NotFound("request_id", f"no active request {rid!r} on this primary"))
        for rid in [r for r in self._admitted_seq if not self.engine.has_request(r)]:
            del self._admitted_seq[rid]

    def _expire_waiting(self) -> None:
        now = time.monotonic()
        for w in list(self._waiting):
            if w.prefill is None:
                continue
            # Open once admitted, and still when preempted since (evicted, not admitted): it has no
            # lease yet, so nothing else would ever release it; _fail_waiting does.
            rid = w.entry.request_id
            if w.prefill.cancel is not None and w.prefill.cancel.is_set():  # its caller is gone
                self._fail_waiting(w, Cancelled("request_id", f"the prefill of request {rid!r} was cancelled"))
                continue
            if not w.prefill.deadline or w.prefill.deadline > now:
                continue
            self._fail_waiting(
                w, DeadlineExceeded("deadline", f"request {rid!r} waited past its deadline for KV room or its prefill")
            )

    def _drop_cancelled(self) -> None:
        """Queued steps of cancelled runs leave the queue: their callers are gone, and each token they
        committed stays (the request and its KV stay open for the caller's next call). So does the step
        of a preempted request waiting to re-prefill, before it takes KV room (once admitted, its
        re-prefill finishes and its step leaves the queue then): it stays evicted, as the next call
        finds it."""
        cancelled = [v for v in self._verifies if v.is_cancelled]
        for item in cancelled:
            self._verifies.remove(item)
        for w in list(self._waiting):
            if w.verify is not None and w.verify.is_cancelled and not w.entry.is_admitted:
                self._waiting.remove(w)
                cancelled.append(w.verify)
        for item in cancelled:
            item.future.set_exception(Cancelled("request_id", f"the run of request {item.request_id!r} was cancelled"))

    def _step(self) -> None:
        """One engine step: the scheduler's plan, admissions, then one forward over the verifies and
        prefill chunks it holds, and each call's result handed back."""
        self._drop_cancelled()
        engine, policy = self._built()
        by_id = {v.request_id: v for v in self._verifies}  # before a preemption takes any out
        plan = self._plan_step(engine, policy)
        waiting = {w.entry.request_id: w for w in self._waiting}
        self._admit(engine, plan, waiting)
        chunks = [
            PrefillChunk(rid, min(n, waiting[rid].entry.num_remaining))
            for rid, n in plan.prefill_chunks
            if rid in waiting and waiting[rid].entry.is_admitted and waiting[rid] in self._waiting
        ]
        verify_items = [by_id[rid] for rid in plan.verify_ids if rid in by_id]
        for item in verify_items:
            self._verifies.remove(item)
        if not verify_items and not chunks:
            return
        forwarded = self._forward(engine, verify_items, chunks, waiting)
        if forwarded is None:  # failed: every call of the step was told
            return
        self._record(verify_items, plan, chunks, forwarded.num_forwards, forwarded.step_s)
        self._finish_prefills(engine, chunks, waiting, forwarded.prefill_features)
        repeated = self._finish_verifies(engine, verify_items, forwarded)
        self._note_returns(engine, verify_items, repeated)

    def _plan_step(self, engine: Engine, policy: SchedulerPolicy) -> StepPlan:
        """The scheduler's plan for the queued verifies and the waiting prefills, with the KV room it
        lacks made by preempting (EngineWorker._preempt)."""
        entries = []
        for v in self._verifies:
            work = v.work()
            rows = engine.num_tokens(v.request_id) - engine.num_cached(v.request_id) + len(v.tree_token_ids)
            entries.append(VerifyEntry(v.request_id, rows, engine.kv_growth_bytes(work)))
        plan = policy.plan(
            entries, [w.entry for w in self._waiting], engine.kv_cache.free_bytes, self._held_for_shared_prefix(engine)
        )
        if plan.kv_shortfall_bytes > 0:
            self._preempt(plan, {e.request_id: e.kv_growth_bytes for e in entries})
        return plan

    def _admit(self, engine: Engine, plan: StepPlan, waiting: dict[str, _Waiting]) -> None:
        """Open the requests the plan admits (or readmit preempted ones); one the engine refuses fails."""
        for rid in plan.admit_ids:
            w = waiting[rid]
            try:
                if w.prefill is not None and not engine.has_request(rid):
                    engine.open(rid, w.prefill.token_ids, w.prefill.num_prompt_tokens)
                else:  # preempted: during its prefill (it is open), or waiting to verify
                    engine.readmit(rid, 0 if w.verify is None else len(w.verify.tree_token_ids))
            except SpecdecError as e:
                self._fail_waiting(w, e)
                continue
            w.entry.is_admitted = True
            w.entry.num_remaining = engine.num_to_prefill(rid)  # less what the prefix cache held
            self._admitted_seq[rid] = next(self._seq)

    def _forward(
        self, engine: Engine, verify_items: list[_VerifyItem], chunks: list[PrefillChunk], waiting: dict[str, _Waiting]
    ) -> _Forwarded | None:
        """The step's forwards: one over everything when the model is batch invariant, else the
        verifies together and each prefill chunk apart. None when they failed (the calls are told)."""
        works = [i.work() for i in verify_items]
        num_forwards, forward_ms = 0, 0.0
        results: list[torch.Tensor] = []
        # Features only where a call asked: a step with them runs eagerly (Transformer.forward).
        verify_features: list[torch.Tensor] | None = (
            [] if any(i.features_out is not None for i in verify_items) else None
        )
        feature_ids = {
            c.request_id for c in chunks if (p := waiting[c.request_id].prefill) and p.features_out is not None
        }
        prefill_features: dict[str, torch.Tensor] = {}
        start = time.perf_counter()
        try:
            if engine.model.is_batch_invariant:  # one forward: every row's bits are its own
                results = engine.step(works, chunks, verify_features, prefill_features if feature_ids else None)
                num_forwards = int(bool(works) or any(c.num_tokens for c in chunks))  # 0: all from the prefix cache
            else:
                if works:
                    results = engine.step(works, [], verify_features)
                    num_forwards += 1
                forward_ms = (time.perf_counter() - start) * 1000
                for chunk in chunks:
                    engine.step(
                        [], [chunk], prefill_features_out=prefill_features if chunk.request_id in feature_ids else None
                    )
                    num_forwards += chunk.num_tokens > 0
        except BaseException as e:
            for item in verify_items:
                item.future.set_exception(e)
            for chunk in chunks:
                self._fail_waiting(waiting[chunk.request_id], e)
            return None
        step_s = time.perf_counter() - start
        if engine.model.is_batch_invariant:
            forward_ms = step_s * 1000
        return _Forwarded(results, verify_features, prefill_features, num_forwards, forward_ms, step_s)

    def _finish_prefills(
        self,
        engine: Engine,
        chunks: list[PrefillChunk],
        waiting: dict[str, _Waiting],
        prefill_features: dict[str, torch.Tensor],
    ) -> None:
        """Requests whose prefill is complete leave the waiting queue: a Prefill call gets its result,
        a preempted request's verify goes back to the front of the queue."""
        for chunk in chunks:
            w = waiting[chunk.request_id]
            w.entry.num_remaining = engine.num_to_prefill(chunk.request_id)
            if w.entry.num_remaining == 0:
                self._waiting.remove(w)
                if w.prefill is not None:
                    if w.prefill.features_out is not None and chunk.request_id in prefill_features:
                        w.prefill.features_out.append(prefill_features[chunk.request_id])
                    try:
                        w.prefill.future.set_result(w.prefill.finish(engine.num_cached(chunk.request_id)))
                    except BaseException as e:  # handed to the waiting RPC thread
                        w.prefill.future.set_exception(e)
                if w.verify is not None:
                    self._verifies.appendleft(w.verify)

    def _finish_verifies(self, engine: Engine, verify_items: list[_VerifyItem], forwarded: _Forwarded) -> set[str]:
        """Each verify's result to its call, or, for a run of plain steps that goes on, its next step
        queued. Returns the requests that stay for one more step of their call."""
        repeated = set()
        forward_ms = forwarded.forward_ms
        for i, (item, logits) in enumerate(zip(verify_items, forwarded.results)):
            try:
                if item.features_out is not None and forwarded.verify_features is not None:
                    item.features_out.append(forwarded.verify_features[i])
                result = item.finish(logits)
                item.forward_ms += forward_ms
                step = None if item.repeat is None else item.repeat(result)
                room = self._room(engine, item.request_id) - (0 if step is None else len(step.committed_token_ids))
                if step is not None and not step.is_last and not item.is_cancelled and room >= 0:
                    repeated.add(item.request_id)
                    drafts = tuple(step.draft_token_ids[:room])
                    self._intake_verify(
                        dataclasses.replace(
                            item,
                            accepted_nodes=step.accepted_nodes,
                            committed_token_ids=step.committed_token_ids,
                            tree_token_ids=drafts,
                            tree_parents=chain_parents(len(drafts)),
                            num_context_tokens=0,
                        )
                    )
                    if item.on_step is not None and not item.future.done():  # committed: the run goes on
                        item.on_step(result, forward_ms, False)
                else:
                    if step is not None and step.accepted_nodes:  # its accepted drafts stay; its token is pending
                        engine.commit(item.request_id, step.accepted_nodes, step.committed_token_ids[:-1])
                    if item.on_step is not None:
                        item.on_step(result, forward_ms, True)
                    item.future.set_result((result, item.forward_ms))
            except BaseException as e:  # handed to the waiting RPC thread, which maps it to a status
                item.future.set_exception(e)
        return repeated

    def _note_returns(self, engine: Engine, verify_items: list[_VerifyItem], repeated: set[str]) -> None:
        """When the results went out, for the batch wait's guess of when each request comes back
        (requests that stay for another step of their call are not timed).

        A streamed run's end (DecodeStream) counts only for a request already seen coming back after
        a result: such a run is most often the whole rest of its request, whose caller releases it
        instead of coming back, and the steps after it waited the whole bound, or until the Release
        came (without speculation, 32 streams: ~2 ms a step, 3 % of the engine thread)."""
        if self.batch_wait_s > 0:
            now = time.monotonic()
            self._returning.update(
                (item.request_id, now)
                for item in verify_items
                if item.request_id not in repeated and (item.on_step is None or item.request_id in self._return_gap)
            )
            if len(self._return_gap) > 4 * self.max_batch:  # forget requests that are gone
                self._return_gap = {r: g for r, g in self._return_gap.items() if engine.has_request(r)}

    @staticmethod
    def _room(engine: Engine, request_id: str) -> int:
        """Tokens the request's context has room for (a repeated plain step's, and its drafts); -1 when
        the request is gone."""
        return engine.max_context - engine.num_tokens(request_id) if engine.has_request(request_id) else -1

    def _held_for_shared_prefix(self, engine: Engine) -> set[str]:
        """New prompts that would compute prefix-cache blocks a prompt ahead of them is computing now:
        held this step (scheduler, "Shared prefixes"), they reuse those rows a step later. A prompt is
        held only for at least a whole block more than the cache holds for it already, at most
        MAX_PREFIX_HOLDS steps. Prompts ahead: admitted ones still prefilling, and new ones not held."""
        cache = engine.prefix_cache
        if cache is None or all(w.entry.is_admitted or w.prefill is None for w in self._waiting):
            return set()
        b = cache.block_tokens
        ahead: dict[tuple[str, tuple[int, ...]], list[Sequence[int]]] = {}  # by tenant and first block
        held = set()
        for w in self._waiting:
            if w.prefill is None or len(w.prefill.token_ids) <= b:
                continue
            rid, prompt = w.entry.request_id, w.prefill.token_ids
            key = (tenant_of(rid), tuple(prompt[:b]))
            if not w.entry.is_admitted and w.num_holds < MAX_PREFIX_HOLDS and key in ahead:
                shared = max(engine.reusable_prompt_rows(rid, prompt, other) for other in ahead[key])
                if shared - engine.reusable_prompt_rows(rid, prompt) >= b:
                    w.num_holds += 1
                    held.add(rid)
                    continue
            ahead.setdefault(key, []).append(prompt)
        return held

    def _preempt(self, plan: StepPlan, growth: dict[str, int]) -> None:
        """Release running requests, newest first, until the step's verify rows fit the KV budget."""
        engine, _ = self._built()
        resident = engine.resident_request_ids()
        running = [
            RunningEntry(
                rid,
                self._admitted_seq.get(rid, -1),
                engine.kv_bytes_of(rid),
                growth.get(rid, 0) if rid in plan.verify_ids else 0,
            )
            for rid in resident
        ]
        for rid in choose_victims(running, plan.kv_shortfall_bytes):
            if len(engine.resident_request_ids()) <= 1:
                # Alone and still too large: nothing to wait for, its verify fails.
                for v in [v for v in self._verifies if v.request_id == rid]:
                    self._verifies.remove(v)
                    v.future.set_exception(
                        ResourceExhausted("kv_cache", f"request {rid!r} alone needs more KV than max_kv_bytes")
                    )
                if rid in plan.verify_ids:
                    plan.verify_ids.remove(rid)
                break
            engine.evict(rid)
            self._admitted_seq.pop(rid, None)
            self.stats.num_preemptions += 1
            if self.metrics is not None:
                self.metrics.preemptions.inc()
            plan.prefill_chunks = [(r, n) for r, n in plan.prefill_chunks if r != rid]
            for w in self._waiting:  # preempted in the middle of its prefill
                if w.entry.request_id == rid:
                    w.entry.is_admitted = False
                    w.entry.num_remaining = engine.num_to_prefill(rid)
            if rid in plan.verify_ids:
                plan.verify_ids.remove(rid)
            for item in [v for v in self._verifies if v.request_id == rid]:  # it waits for the re-prefill
                self._verifies.remove(item)
                self._wait_for_reprefill(item)

    def _fail_waiting(self, w: _Waiting, error: BaseException) -> None:
        if w in self._waiting:
            self._waiting.remove(w)
        rid = w.entry.request_id
        engine, _ = self._built()
        if engine.has_request(rid):
            engine.release(rid)
        self._admitted_seq.pop(rid, None)
        for i in (w.prefill, w.verify):
            if i is not None:
                i.future.set_exception(error)

    def _record(
        self, verify_items: list, plan: StepPlan, chunks: list[PrefillChunk], num_forwards: int, step_s: float
    ) -> None:
        verify_rows = plan.num_verify_rows if verify_items else 0
        prefill_rows = sum(c.num_tokens for c in chunks)
        self.step_rows = verify_rows + prefill_rows  # what the items' `finish` read next
        self.step_requests = len(verify_items) + len(chunks)
        self.stats.num_steps += 1
        self.stats.num_prefill_chunks += len(chunks)
        if verify_items:
            self.stats.num_batches += 1
            self.stats.num_items += len(verify_items)
            self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(verify_items))
        self.step_history.append(
            StepComposition(len(verify_items), verify_rows, len(chunks), prefill_rows, num_forwards)
        )
        if self.metrics is not None:
            self.metrics.engine_steps.inc()
            self.metrics.step_seconds.observe(step_s)
            self.metrics.step_rows.labels(kind="verify").observe(verify_rows)
            self.metrics.step_rows.labels(kind="prefill").observe(prefill_rows)

    def _observe(self) -> None:
        if self.metrics is None or self.engine is None:
            return
        # The KV gauges after every turn, not only after a Prefill or Release RPC: a slot grows while
        # its request decodes and a preemption frees another's, both inside steps.
        self.metrics.observe_kv(self.engine.kv_bytes, self.engine.kv_cache.max_bytes or 0)
        resident = self.engine.resident_request_ids()  # a preempted request holds no slot until re-prefilled
        self.metrics.active_requests.set(len(resident))
        self.metrics.scheduler_waiting.set(len(self._waiting))
        # what the turn left: Verify and Decode calls come and go between the RPCs that set it too
        self.metrics.queue_depth.set(self.queue_depth)
        waiting = {w.entry.request_id for w in self._waiting}
        self.metrics.scheduler_running.set(sum(1 for r in resident if r not in waiting))
        if (cache := self.engine.prefix_cache) is not None:
            self._prefix_stats_seen = self.metrics.observe_prefix_cache(cache, self._prefix_stats_seen)

    def _fail_pending(self) -> None:
        error = RuntimeError("the engine worker stopped")
        items: list = list(self._verifies) + self._deferred
        for w in self._waiting:
            items += [i for i in (w.prefill, w.verify) if i is not None]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                items.append(item)
        for item in items:
            if not item.future.done():
                item.future.set_exception(error)
