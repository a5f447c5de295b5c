"""Compile a `CompiledStep`'s row buckets on a background thread while the engine serves eagerly.

Buckets compile smallest first (decode and small trees benefit first). Each compile runs the
regions on dummy inputs, never on a request's KV cache, and the step switches a bucket to its
compiled graphs only when all of them exist; so the engine thread keeps running forwards
throughout and never waits. A failed compile leaves the remaining buckets eager.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import structlog

from specdec.model.compiled import CompiledStep, configure_inductor_cache


class BackgroundCompiler:
    def __init__(
        self,
        step: CompiledStep,
        cache_dir: Path | None = None,
        on_bucket_ready: Callable[[int], None] = lambda num_ready: None,
    ) -> None:
        self.step, self.cache_dir = step, cache_dir  # cache_dir: inductor's on-disk cache (None: its default)
        self.on_bucket_ready = on_bucket_ready  # called with the number of ready buckets
        self.seconds_per_bucket: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-compiler", daemon=True)
        self._log = structlog.get_logger("specdec.compile")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop after the bucket being compiled (a compile itself cannot be interrupted)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread; True when it has finished."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        buckets = self.step.settings.buckets
        if self.cache_dir is not None:
            configure_inductor_cache(self.cache_dir)
        self._log.info(
            "step compile started",
            buckets=list(buckets),
            mode=self.step.settings.mode,
            cache_dir=None if self.cache_dir is None else str(self.cache_dir),
        )
        for num_rows in buckets:
            if self._stop.is_set():
                self._log.info("step compile stopped", ready_buckets=list(self.step.ready_buckets))
                return
            try:
                seconds = self.step.compile_bucket(num_rows)
            except Exception as e:  # noqa: BLE001 - any compiler failure leaves the step eager
                self._log.error(
                    "step compile failed; remaining buckets stay eager",
                    bucket=num_rows,
                    error=repr(e),
                    ready_buckets=list(self.step.ready_buckets),
                )
                return
            self.seconds_per_bucket[num_rows] = seconds
            self.on_bucket_ready(len(self.step.ready_buckets))
            self._log.info(
                "step bucket compiled",
                bucket=num_rows,
                seconds=round(seconds, 2),
                ready=len(self.step.ready_buckets),
                total=len(buckets),
            )
        self._log.info("step compile finished", seconds=round(sum(self.seconds_per_bucket.values()), 1))
