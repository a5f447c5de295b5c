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
from collections.abc import Iterator
from pathlib import Path

import redis

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


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
    directory = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    socket_path = str(Path(directory) / "redis.sock")
    log_path = Path(directory) / "redis.log"
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
                directory,
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _await(process, socket_path, log_path)
        yield RedisServer(socket_path=socket_path, url=f"unix://{socket_path}", pid=process.pid)
    finally:
        process.terminate()
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


def _await(process: subprocess.Popen, socket_path: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RedisServerError(f"redis-server exited with {process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with redis.Redis(unix_socket_path=socket_path) as probe:
                probe.ping()
            return
        except (redis.ConnectionError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise RedisServerError(
                    f"redis-server did not answer within {START_TIMEOUT_S} s: {log_path.read_text()[-2000:]}"
                ) from None
            time.sleep(0.02)
