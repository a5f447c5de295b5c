"""A peer of the benchmark in a child process, so that a peer that crashes is a recorded failure.

    peer = PeerProcess("llamacpp", {"gguf_path": "...", "num_context": 2048, "num_threads": 2,
                                    "eos_token_ids": [2]})
    token_ids, seconds = peer.run("llamacpp", prompt_ids, max_new_tokens=64)
    peer.close()

llama.cpp's native code can die with a signal (its AMX buffer type segfaults on batches > 1
on some Xeons): in-process that would end the whole benchmark run. The child
(`python -m bench.peer_worker`) holds the model; requests and replies are JSON lines on its
stdin/stdout (plain data only, nothing pickled). When the child dies, the call that was running
raises `PeerCrashed` naming the signal, and the next call starts a fresh child.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from specdec.launcher import REPO_ROOT


WORKER = (sys.executable, "-m", "bench.peer_worker")


class PeerCrashed(RuntimeError):
    pass


class PeerProcess:
    def __init__(self, name: str, options: dict[str, Any], worker: Sequence[str] = WORKER) -> None:
        self.name, self.options, self.worker = name, dict(options), tuple(worker)
        self._process: subprocess.Popen | None = None
        self.systems: tuple[str, ...] = tuple(self._start()["systems"])

    def _start(self) -> dict[str, Any]:
        self._process = subprocess.Popen(
            [*self.worker, self.name, json.dumps(self.options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO_ROOT,
            text=True,
            bufsize=1,
        )
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            self._process = None
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise PeerCrashed(f"the {self.name} peer process died ({how})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._process is None:
            self._start()
        assert self._process is not None and self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # the child is gone: _read reports how it ended
        return self._read()

    def run(self, system: str, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float]:
        reply = self.call(
            {"op": "run", "system": system, "prompt_ids": list(prompt_ids), "max_new_tokens": max_new_tokens}
        )
        return reply["token_ids"], reply["seconds"]

    def close(self) -> None:
        if self._process is not None:
            assert self._process.stdin is not None  # started with stdin=PIPE
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    def __del__(self) -> None:
        self.close()
