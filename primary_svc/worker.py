"""One thread owns the engine; RPC threads hand it work and wait. Verify work is batched.

Dynamic batching: verify items from different requests that are waiting together run as ONE
forward (`Engine.verify_batch`): the linear layers read the weights once for all of them.
The worker takes up to `max_batch` queued items; when fewer than `min_batch` are there and
other requests are active (so more work may be about to arrive), it waits for more, but
never past `max_wait_ms` after the oldest item arrived. With a single active request it
never waits: batch-1 latency is untouched.

Each verify item first commits the previous step of its request (accepted path + new
tokens), then joins the batch; an item whose commit or tree is invalid fails alone.

Every tensor operation of the process runs on this one thread: the model's loading and the
start-up measurements (`call` before the engine exists), and per RPC the caller's `finish`
(argmax, grammar mask, logits encoding) right after the forward, so RPC threads only build
protobufs from plain values. Torch's OpenMP runtime keeps one team of worker threads per
calling thread, and a forward on a second thread ran 2x slower than on the first (int4,
measured: 27-33 ms per step when one thread did everything, 56-88 ms when the model had been
loaded on another thread).
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from specdec.engine.engine import Engine, VerifyWork
from specdec.errors import SpecdecError


@dataclasses.dataclass(slots=True)
class _VerifyItem:
    request_id: str
    accepted_nodes: Sequence[int]
    committed_token_ids: Sequence[int]
    tree_token_ids: Sequence[int]
    tree_parents: Sequence[int]
    finish: Callable[[torch.Tensor], Any]
    future: Future
    enqueued_at: float


@dataclasses.dataclass(slots=True)
class _CallItem:
    fn: Callable[[Engine], Any]
    future: Future
    enqueued_at: float


@dataclasses.dataclass(slots=True)
class BatchStats:
    num_batches: int = 0
    num_items: int = 0
    max_batch_seen: int = 0


class EngineWorker:
    """The engine thread. `engine` may be None at first: build it with `call` (on this thread)
    and set it before serving."""

    def __init__(self, engine: Engine | None, max_batch: int = 32, min_batch: int = 4,
                 max_wait_ms: float = 2.0) -> None:
        self.engine = engine
        self.max_batch, self.min_batch, self.max_wait_s = max_batch, min_batch, max_wait_ms / 1000
        self.stats = BatchStats()
        self._queue: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine thread and return its result (or raise its exception)."""
        future: Future = Future()
        self._queue.put(_CallItem(fn, future, time.monotonic()))
        return future.result()

    def verify(self, request_id: str, accepted_nodes: Sequence[int], committed_token_ids: Sequence[int],
               tree_token_ids: Sequence[int], tree_parents: Sequence[int],
               finish: Callable[[torch.Tensor], Any] = lambda logits: logits) -> tuple[Any, float]:
        """Commit the previous step, verify the tree; returns (finish(logits [N+1, V]), forward ms).

        `finish` runs on the engine thread; an exception it raises fails this item alone."""
        future: Future = Future()
        self._queue.put(_VerifyItem(request_id, accepted_nodes, committed_token_ids, tree_token_ids,
                                    tree_parents, finish, future, time.monotonic()))
        return future.result()

    def stop(self) -> None:
        self._stopped.set()
        self._queue.put(None)
        self._thread.join(timeout=5)

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            item = self._queue.get()
            if item is None:
                break
            items = [item] + self._drain(self.max_batch - 1)
            verifies = [i for i in items if isinstance(i, _VerifyItem)]
            if (verifies and len(verifies) < self.min_batch and self.engine is not None
                    and self.engine.num_active_requests > len(verifies)):
                deadline = verifies[0].enqueued_at + self.max_wait_s
                while len(verifies) < self.min_batch and (remaining := deadline - time.monotonic()) > 0:
                    try:
                        more = self._queue.get(timeout=remaining)
                    except queue.Empty:
                        break
                    if more is None:
                        self._stopped.set()
                        break
                    items.append(more)
                    if isinstance(more, _VerifyItem):
                        verifies.append(more)
            for i in items:
                if isinstance(i, _CallItem):
                    self._run_call(i)
            if verifies:
                self._run_verifies(verifies)
        self._fail_pending()

    def _drain(self, limit: int) -> list:
        out = []
        while len(out) < limit:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._stopped.set()
                break
            out.append(item)
        return out

    def _run_call(self, item: _CallItem) -> None:
        try:
            item.future.set_result(item.fn(self.engine))
        except BaseException as e:  # handed to the waiting RPC thread, which maps it to a status
            item.future.set_exception(e)

    def _run_verifies(self, items: list[_VerifyItem]) -> None:
        ready, seen = [], set()
        for i in items:
            if i.request_id in seen:   # the same request twice: run the second in a later batch
                self._queue.put(i)
                continue
            try:
                if i.accepted_nodes or i.committed_token_ids:   # nothing to commit: a (re)verify only
                    self.engine.commit(i.request_id, i.accepted_nodes, i.committed_token_ids)
                work = VerifyWork(i.request_id, i.tree_token_ids, i.tree_parents)
                self.engine.check_verify(work)
            except SpecdecError as e:
                i.future.set_exception(e)
                continue
            seen.add(i.request_id)
            ready.append((i, work))
        if not ready:
            return
        start = time.perf_counter()
        try:
            results = self.engine.verify_batch([w for _, w in ready])
        except BaseException as e:
            for i, _ in ready:
                i.future.set_exception(e)
            return
        forward_ms = (time.perf_counter() - start) * 1000
        self.stats.num_batches += 1
        self.stats.num_items += len(ready)
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(ready))
        for (i, _), logits in zip(ready, results):
            try:
                i.future.set_result((i.finish(logits), forward_ms))
            except BaseException as e:  # handed to the waiting RPC thread, which maps it to a status
                i.future.set_exception(e)

    def _fail_pending(self) -> None:
        for item in self._drain(10**9):
            item.future.set_exception(RuntimeError("the engine worker stopped"))
