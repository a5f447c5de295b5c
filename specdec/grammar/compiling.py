"""Response formats compiled for requests, within a deadline, one compile per schema at a time.

A schema compiles once (then the LRU in specdec.grammar.GrammarCache serves it), usually in a few
to tens of milliseconds, but xgrammar's worst case on this CPU was 66 s for one schema of the json
prompts (long bounded repetitions). A request must not hang on that: the compile runs on a
worker thread and the request waits at most `max_compile_s` (or its own deadline, if sooner),
then gets RESOURCE_EXHAUSTED naming response_format.json_schema. The compile goes on in the
background and lands in the cache, so a retry of the same schema is served at once; concurrent
callers for one schema share one compile. The gateway compiles each request's format here before
anything is stored; the draft pool compiles its own copy here too, from the gateway's early
PrepareGrammar call or at the request's first Propose, whichever comes first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from specdec.errors import ResourceExhausted
from specdec.grammar import CompiledGrammar, GrammarCache, GrammarState, ResponseFormat
from specdec.grammar.compiler import SCHEMA_FIELD


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarSettings:
    max_compile_s: float = 10.0  # longest a request waits for its schema to compile
    num_compile_threads: int = 2
    max_cached_grammars: int = 64
    # Schemas compiling or waiting for a compile thread at once; past it a new schema is refused at once.
    max_pending_compiles: int = 64

    def __post_init__(self) -> None:
        if self.max_compile_s <= 0:
            raise ValueError(f"max_compile_s must be > 0, got {self.max_compile_s}")
        if min(self.num_compile_threads, self.max_cached_grammars, self.max_pending_compiles) < 1:
            raise ValueError("num_compile_threads, max_cached_grammars and max_pending_compiles must be >= 1")


class Grammars:
    """Compiled grammars for requests: cached, deduplicated while compiling, bounded in wait."""

    def __init__(self, cache: GrammarCache, settings: GrammarSettings | None = None) -> None:
        self.cache, self.settings = cache, settings or GrammarSettings()
        self._executor = ThreadPoolExecutor(self.settings.num_compile_threads, thread_name_prefix="grammar")
        self._compiling: dict[ResponseFormat, Future] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def new_state(self, response_format: ResponseFormat, deadline: float | None = None) -> GrammarState:
        """A fresh grammar state for one request; `deadline` is a time.monotonic() bound (the call's)."""
        return self.compile(response_format, deadline).new_state()

    def start(self, response_format: ResponseFormat) -> Future[CompiledGrammar]:
        """The compile of `response_format`, begun now or the one under way; a cached format's, done
        (it never queues behind other compiles). Its result raises InvalidArgument for a bad schema.
        ResourceExhausted naming the schema when max_pending_compiles other schemas are compiling or
        queued: a compile cannot be stopped once begun, so a flood of new (or slow) schemas gets a
        refusal at once instead of a queue that grows without bound, each caller waiting out its
        max_compile_s, while the compile threads work through schemas nobody waits for any more."""
        cached = self.cache.cached(response_format)
        if cached is not None:
            done: Future[CompiledGrammar] = Future()
            done.set_result(cached)
            return done
        with self._lock:
            future = self._compiling.get(response_format)
            is_new = future is None
            if future is None:
                if len(self._compiling) >= self.settings.max_pending_compiles:
                    raise ResourceExhausted(
                        SCHEMA_FIELD,
                        f"cannot compile now: {len(self._compiling)} other schemas are compiling or queued "
                        f"(at most {self.settings.max_pending_compiles}); retry later",
                    )
                future = self._executor.submit(self.cache.compile, response_format)
                self._compiling[response_format] = future
        if is_new:  # outside the lock: a future already done runs the callback right here
            future.add_done_callback(lambda _: self._done(response_format))
        return future

    def compile(self, response_format: ResponseFormat, deadline: float | None = None) -> CompiledGrammar:
        """Raises InvalidArgument (bad schema) or ResourceExhausted (compile too slow)."""
        future = self.start(response_format)
        wait_s = self.settings.max_compile_s
        if deadline is not None:
            wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
        try:
            return future.result(timeout=wait_s)
        except FutureTimeout:
            raise ResourceExhausted(
                SCHEMA_FIELD,
                f"took longer than {wait_s:.1f} s to compile into a grammar; it "
                "keeps compiling in the background, retry later or simplify the schema",
            ) from None

    async def new_state_when_compiled(self, response_format: ResponseFormat, retry_s: float = 0.5) -> GrammarState:
        """A fresh grammar state once the schema has compiled, awaited without blocking the event loop
        and with no bound: for a request that was admitted with this schema (a resumed one), whose
        compile can only be slow, never wrong, and which no caller's deadline bounds. A start refused
        for the pending bound is tried again every retry_s. InvalidArgument passes through."""
        while True:
            try:
                future = self.start(response_format)
            except ResourceExhausted:
                await asyncio.sleep(retry_s)
                continue
            compiled = await asyncio.wrap_future(future)
            return compiled.new_state()

    def _done(self, response_format: ResponseFormat) -> None:
        with self._lock:
            self._compiling.pop(response_format, None)
