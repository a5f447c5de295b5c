"""Child processes that tests start (a whole serving stack): their first lines of output, and a stop
that cannot hang the test run."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading


def read_lines(process: subprocess.Popen, num_lines: int, timeout_s: float) -> list[str]:
    """The first `num_lines` lines of its stdout, stripped, within timeout_s. Read in a thread: a
    select() on a buffered pipe misses lines already read into the buffer."""
    assert process.stdout is not None
    stdout = process.stdout
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stdout:
            lines.put(line.strip())

    threading.Thread(target=pump, daemon=True).start()
    try:
        return [lines.get(timeout=timeout_s) for _ in range(num_lines)]
    except queue.Empty:
        raise AssertionError(f"{process.args!r} did not start in time (exit status {process.poll()})") from None


def stop(process: subprocess.Popen, timeout_s: float = 120) -> None:
    """SIGTERM (its graceful stop), then SIGKILL if it has not exited within timeout_s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
