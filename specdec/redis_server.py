"""A throwaway redis-server on a unix socket, for the test suite and the benchmark: no persistence,
in a fresh directory under /tmp (unix socket paths are limited to ~107 bytes), removed afterwards.

    with redis_server() as server:
        store = RedisStateStore.from_url(server.url)
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import redis

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
POLL_S = 0.05  # between looks at a local server, cluster or group while waiting for a state
_PING_POLL_S = 0.02

T = TypeVar("T")


class RedisServerError(RuntimeError):
    """redis-server is not installed, exited, or did not answer in time."""


@dataclasses.dataclass(frozen=True, slots=True)
class RedisServer:
    socket_path: str
    url: str  # unix:///...sock, for redis.Redis.from_url and the services' --redis_url
    pid: int  # the redis-server process (tests stop and continue it to make outages)


@contextlib.contextmanager
def redis_server(prefix: str = "specdec-redis-") -> Iterator[RedisServer]:
    """Start redis-server, wait until it answers PING, yield it; terminate it and remove its directory."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisServerError("redis-server is not installed (`make redis-server` installs it)")
    with scratch_processes(prefix) as (directory, processes):
        socket_path = str(directory / "redis.sock")
        log_path = directory / "redis.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [
                    binary,
                    "--port",
                    "0",
                    "--unixsocket",
                    socket_path,
                    "--unixsocketperm",
                    "700",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(directory),
                    "--daemonize",
                    "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        processes.append(process)
        await_ping(process, lambda: redis.Redis(unix_socket_path=socket_path), log_path)
        yield RedisServer(socket_path=socket_path, url=f"unix://{socket_path}", pid=process.pid)


@contextlib.contextmanager
def scratch_processes(prefix: str) -> Iterator[tuple[Path, list[subprocess.Popen]]]:
    """A fresh directory under /tmp named `prefix`..., and a list for the processes started in it;
    on exit, however it comes, every process in the list is stopped (stop_processes) and the
    directory removed. The one lifecycle of the local server, cluster and sentinel group."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    processes: list[subprocess.Popen] = []
    try:
        yield directory, processes
    finally:
        stop_processes(processes)
        shutil.rmtree(directory, ignore_errors=True)


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to each, then wait STOP_TIMEOUT_S for each before SIGKILL."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def await_ping(process: subprocess.Popen, connect: Callable[[], redis.Redis], log_path: Path) -> None:
    """Until the redis-server `process` answers PING on a client from `connect`. RedisServerError, with
    the end of its log, when it exits first or does not answer within START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RedisServerError(f"redis-server exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with connect() as probe:
                probe.ping()
            return
        except (redis.ConnectionError, FileNotFoundError):  # FileNotFoundError: its socket is not there yet
            if time.monotonic() > deadline:
                raise RedisServerError(
                    f"redis-server did not answer within {START_TIMEOUT_S} s: {log_path.read_text()[-2000:]}"
                ) from None
            time.sleep(_PING_POLL_S)


def poll_until(check: Callable[[], T | None], timeout_s: float, failure: Callable[[], str]) -> T:
    """Call `check` every POLL_S until it returns something other than None, and return that;
    RedisServerError(failure()) once timeout_s has passed (a wait for a local server, cluster or
    sentinel group to reach a state)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise RedisServerError(failure())
        time.sleep(POLL_S)
