"""inference.py --serve keeps its services up (specdec.supervisor): one real `--serve` process for
the module. A service killed with SIGKILL comes back on its own port, the restart is in the
launcher's log and in specdec_service_restarts_total on the HTTP front's /metrics, and greedy
text is the same as before; a request streaming through a killed primary ends with the same text.
Last, a draft pool whose port is taken keeps failing to start: the launcher gives up after
--max_service_restarts, names it, and stops every service."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import inference
from specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.processes import read_lines, stop

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Explain in a few sentences how a bicycle gear works."
MAX_NEW_TOKENS = 24
MAX_RESTARTS = 2
LONG_NEW_TOKENS = 160
STREAM_ID = "streams-through-a-restart"
# A whole stack start (model load, verify-cost calibration) on a busy 2-core machine.
START_TIMEOUT_S = 900
# One service's restart, model load included.
RESTART_TIMEOUT_S = 300


@dataclasses.dataclass
class Served:
    process: subprocess.Popen
    gateway_address: str
    http_url: str
    log_dir: Path
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_for_log(self, pattern: str, timeout_s: float = RESTART_TIMEOUT_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while (match := re.search(pattern, self.stderr())) is None:
            assert self.process.poll() is None, f"the launcher exited: {self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} in: {self.stderr()[-3000:]}"
            time.sleep(0.2)
        return match


def service_process(launcher_pid: int, module: str) -> tuple[int, int]:
    """(pid, --port) of the launcher's child that runs `python -m module`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher_pid and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == [module]:
            return int(entry.name), int(argv[argv.index("--port") + 1])
    raise AssertionError(f"no {module} process under the launcher {launcher_pid}")


@contextlib.contextmanager
def serving(tmp: Path) -> Iterator[Served]:
    """`inference.py --serve` until it prints its addresses; SIGTERM (then SIGKILL) on the way out."""
    stderr_path = tmp / "launcher.stderr"
    argv = [
        sys.executable,
        "inference.py",
        "--serve",
        "--http_port",
        "0",
        "--log_dir",
        str(tmp / "logs"),
        "--max_service_restarts",
        str(MAX_RESTARTS),
    ]
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        gateway_address, http_url = read_lines(process, 2, START_TIMEOUT_S)
        yield Served(process, gateway_address, http_url, tmp / "logs", stderr_path)
    finally:
        stop(process)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("serve")) as started:
        yield started


@pytest.fixture(scope="module")
def gateway_stub(served: Served) -> Iterator[gateway_pb2_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(served.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def reference(gateway_stub: gateway_pb2_grpc.GenerationServiceStub) -> gateway_pb2.GenerateResponse:
    """The greedy answer before any service was killed."""
    return gateway_stub.Generate(request(), timeout=600)


def request(request_id: str = "", max_new_tokens: int = MAX_NEW_TOKENS) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(request_id=request_id, max_new_tokens=max_new_tokens)
    req.chat.messages.add(role="user", content=PROMPT)
    req.speculation.is_enabled = True
    return req


def restarts_metric(served: Served, service: str) -> float:
    with urllib.request.urlopen(f"{served.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf'^specdec_service_restarts_total{{service="{service}"}} (\S+)$', text, re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


def kill_and_await_restart(served: Served, name: str, module: str) -> None:
    pid, port = service_process(served.process.pid, module)
    os.kill(pid, signal.SIGKILL)
    served.wait_for_log(rf"service '{name}' was killed by SIGKILL; restarting it in 0\.5 s \(restart 1; log: ")
    served.wait_for_log(rf"service '{name}' is serving again at 127\.0\.0\.1:{port} \(restart 1, up in ")
    new_pid, new_port = service_process(served.process.pid, module)
    assert new_pid != pid and new_port == port, "the others hold its address"


def test_a_killed_validator_comes_back_on_its_port_and_the_text_is_the_same(
    served: Served, gateway_stub: gateway_pb2_grpc.GenerationServiceStub, reference: gateway_pb2.GenerateResponse
) -> None:
    assert restarts_metric(served, "validator") == 0
    kill_and_await_restart(served, "validator", "validator_svc")
    after = gateway_stub.Generate(request(), timeout=600)
    assert list(after.token_ids) == list(reference.token_ids) and after.text == reference.text
    assert restarts_metric(served, "validator") == 1 and restarts_metric(served, "primary") == 0


def test_a_request_streams_through_a_killed_primary_with_the_same_text(
    served: Served, gateway_stub: gateway_pb2_grpc.GenerationServiceStub, stream_in_background
) -> None:
    # Long enough to be mid-stream when the kill lands.
    reference = gateway_stub.Generate(request(max_new_tokens=LONG_NEW_TOKENS), timeout=600)
    received, errors, consumer = stream_in_background(gateway_stub, request(STREAM_ID, LONG_NEW_TOKENS), 600)
    kill_and_await_restart(served, "primary", "primary_svc")  # its KV caches are gone: the gateway re-prefills
    consumer.join(timeout=600)
    assert not errors, errors
    assert received[-1].is_final
    assert [t for r in received for t in r.token_ids] == list(reference.token_ids)
    assert "".join(r.text for r in received) == reference.text
    gateway_log = (served.log_dir / "gateway.log").read_text()
    assert re.search(rf'"request_id": "{STREAM_ID}".*"event": "primary unavailable; waiting"', gateway_log)
    after = gateway_stub.Generate(request(max_new_tokens=LONG_NEW_TOKENS), timeout=600)
    assert after.text == reference.text
    assert restarts_metric(served, "primary") == 1


def test_a_service_that_keeps_dying_is_given_up_and_everything_stops(served: Served) -> None:
    pids = [service_process(served.process.pid, m)[0] for m in ("primary_svc", "validator_svc", "gateway")]
    pid, port = service_process(served.process.pid, "draft_svc")
    # A listener on its port (SO_REUSEADDR: the killed one may leave TIME_WAIT there) fails every
    # restart's bind; gRPC's SO_REUSEPORT is off, so it cannot share the port either.
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                squatter.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, "the killed draft pool's port stayed busy"
                time.sleep(0.01)
        squatter.listen()
        assert served.process.wait(timeout=RESTART_TIMEOUT_S) == inference.EXIT_STACK_FAILED
    stderr = served.stderr()
    assert "service 'draft' failed to restart: exited with code 1 while starting" in stderr
    assert "restarting it in 1 s (restart 2;" in stderr
    last = stderr[stderr.index("error: ") :]
    assert f"service 'draft' exited with code 1; gave up after {MAX_RESTARTS} restarts in a row; log: " in last
    assert "draft.log" in last
    for service_pid in pids:
        assert not is_alive(service_pid)


def is_alive(pid: int) -> bool:
    try:  # a zombie is dead, merely not reaped yet by whoever inherited it
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_sigterm_while_a_service_awaits_its_restart_stops_everything_cleanly(tmp_path: Path) -> None:
    """A stack of its own (the module's is given up above): no restart once the stop has begun."""
    with serving(tmp_path) as served:
        modules = ("primary_svc", "validator_svc", "draft_svc", "gateway", "http_svc")
        pids = [service_process(served.process.pid, m)[0] for m in modules]
        validator_pid, validator_port = service_process(served.process.pid, "validator_svc")
        os.kill(validator_pid, signal.SIGKILL)
        served.wait_for_log(r"service 'validator' was killed by SIGKILL; restarting it in 0\.5 s")
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=120) == 0, served.stderr()[-3000:]
    stderr = served.stderr()
    assert "stopping the services..." in stderr and "serving again" not in stderr and "error" not in stderr
    assert not any(is_alive(pid) for pid in pids)
    assert not any(
        "validator_svc" in argv and f"{validator_port}" in argv for argv in map(cmdline, Path("/proc").iterdir())
    ), "a validator restarted during the stop was left behind"


def cmdline(proc: Path) -> list[str]:
    try:
        return (proc / "cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []
