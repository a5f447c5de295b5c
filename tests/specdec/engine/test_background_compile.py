"""The background compiler's schedule, against a stand-in step (the real compile is tested in
tests/specdec/model/test_compiled.py): smallest bucket first, progress reported, failures contained."""

from __future__ import annotations

import threading

from specdec.engine.background_compile import BackgroundCompiler
from specdec.model.compiled import CompileSettings


class FakeStep:
    def __init__(
        self, buckets: tuple[int, ...], failing: int | None = None, gate: threading.Event | None = None
    ) -> None:
        self.settings = CompileSettings(buckets=buckets)
        self.compiled: list[int] = []
        self.failing, self.gate = failing, gate
        self.threads: set[str] = set()

    @property
    def ready_buckets(self) -> tuple[int, ...]:
        return tuple(self.compiled)

    def compile_bucket(self, num_rows: int) -> float:
        self.threads.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(5)
        if num_rows == self.failing:
            raise RuntimeError("inductor failed")
        self.compiled.append(num_rows)
        return 0.01


def test_buckets_compile_in_order_off_the_calling_thread_and_report_progress(tmp_path):
    step, progress = FakeStep((1, 2, 4, 8)), []
    compiler = BackgroundCompiler(step, tmp_path / "inductor", on_bucket_ready=progress.append)
    compiler.start()
    assert compiler.join(120)  # the thread imports dynamo first: seconds
    assert step.compiled == [1, 2, 4, 8]
    assert progress == [1, 2, 3, 4]
    assert set(compiler.seconds_per_bucket) == {1, 2, 4, 8}
    assert threading.current_thread().name not in step.threads
    assert (tmp_path / "inductor").is_dir()  # the cache directory is set up on the compiling thread


def test_a_failed_bucket_leaves_the_rest_eager():
    step, progress = FakeStep((1, 2, 4), failing=2), []
    compiler = BackgroundCompiler(step, on_bucket_ready=progress.append)
    compiler.start()
    assert compiler.join(5)
    assert step.compiled == [1] and progress == [1]


def test_stop_ends_after_the_bucket_in_progress():
    gate = threading.Event()
    step = FakeStep((1, 2, 4), gate=gate)
    compiler = BackgroundCompiler(step)
    compiler.start()
    compiler.stop()
    gate.set()
    assert compiler.join(5)
    assert step.compiled in ([], [1])
