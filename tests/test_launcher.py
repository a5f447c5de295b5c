"""The process launcher with tiny fake services (a health-only gRPC server in
`python -c`): dependency order, fail-fast with the log tail, timeouts, no
orphans after stop or after the launcher's own death, restart on the same
port, a lost port race; supervision (specdec.supervisor): a killed service
restarted with backoff and counted, one that keeps dying given up."""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import launcher, port_owner
from specdec.progress import ProgressEvent
from specdec.launcher import ServiceError, ServiceSpec, Stack, StackConfig, log_tail, service_specs, waves
from specdec.service.health import check_health
from specdec.supervisor import RestartPolicy, Supervisor

# A fake service: serves only grpc.health.v1 ("" SERVING) through the real
# serve() (and an empty /metrics with --metrics_port), after printing its argv. --mode changes what it does:
#   serve (default), die (stderr line, exit 3), hang (never serves),
#   stubborn (ignores SIGTERM, spawns a grandchild whose pid goes to --pid_file).
FAKE_SERVICE = """
import argparse, os, signal, subprocess, sys, time
p = argparse.ArgumentParser()
p.add_argument("--mode", default="serve")
p.add_argument("--pid_file", default="")
p.add_argument("--host")
p.add_argument("--port", type=int)
p.add_argument("--metrics_port", type=int, default=0)
p.add_argument("--progress_file", default="")
a, _ = p.parse_known_args()
if a.progress_file:
    from specdec.progress import ProgressWriter
    report = ProgressWriter(a.progress_file)
    for done in range(5):
        report("warming up", done, 4)
    report("choosing", 0, 2, "timing x")
print("argv:", " ".join(sys.argv[1:]), flush=True)
if a.mode == "die":
    print("fatal: the fake cannot start", file=sys.stderr, flush=True)
    sys.exit(3)
if a.mode == "hang":
    time.sleep(300)
from specdec.service import ServerConfig, create_server, serve
if a.mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(a.pid_file, "w") as f:
        f.write(str(child.pid))
    server, _ = create_server(f"{a.host}:{a.port}", [])
    server.start()
    time.sleep(300)
from prometheus_client import CollectorRegistry
registry = CollectorRegistry() if a.metrics_port else None
serve(ServerConfig(host=a.host, port=a.port, grace_s=0.0, metrics_port=a.metrics_port), [], registry=registry)
"""


def fake(
    name: str,
    *args: str,
    depends_on: tuple[str, ...] = (),
    address_flags: tuple[tuple[str, str], ...] = (),
    startup_timeout_s: float = 20.0,
    is_taking_service_token: bool = False,
    started_beside: tuple[str, ...] = (),
) -> ServiceSpec:
    return ServiceSpec(
        name,
        (sys.executable, "-c", FAKE_SERVICE, *args),
        depends_on=depends_on,
        started_beside=started_beside,
        address_flags=address_flags,
        startup_timeout_s=startup_timeout_s,
        is_taking_service_token=is_taking_service_token,
    )


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead, merely not reaped yet by whoever inherited it
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_dead(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def is_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        return check_health(channel, timeout_s=5.0)


@pytest.fixture
def config() -> StackConfig:
    return StackConfig(stop_grace_s=2.0)


# ---- pure parts ------------------------------------------------------------------------------------


def test_waves_follow_dependencies() -> None:
    specs = service_specs(StackConfig())
    # the gateway starts beside the validator and the pool, after them in their wave
    assert [[s.name for s in wave] for wave in waves(specs)] == [["primary"], ["validator", "draft", "gateway"]]
    beside = [
        fake("c", started_beside=("b",)),
        fake("b", started_beside=("a",)),
        fake("a"),
        fake("d", depends_on=("c",)),
    ]
    assert [[s.name for s in wave] for wave in waves(beside)] == [["a", "b", "c"], ["d"]]
    a, b = fake("a", depends_on=("b",)), fake("b", depends_on=("a",))
    with pytest.raises(ValueError, match="cycle"):
        waves([a, b])
    with pytest.raises(ValueError, match="cycle"):
        waves([fake("a", started_beside=("b",)), fake("b", started_beside=("a",))])
    with pytest.raises(ValueError, match="unknown"):
        waves([fake("a", depends_on=("zz",))])
    with pytest.raises(ValueError, match="unknown"):
        waves([fake("a", started_beside=("zz",))])
    with pytest.raises(ValueError, match="depends_on"):
        fake("a", address_flags=(("--x", "b"),))
    fake("a", address_flags=(("--x", "b"),), started_beside=("b",))  # an address of a service beside it


def test_service_specs_pass_the_fixed_flags() -> None:
    config = StackConfig(
        model_path="/m.gguf",
        precision="bf16",
        cache_dir=Path("/c"),
        strategies=("prompt_lookup",),
        num_threads=1,
        python="py",
    )
    specs = {s.name: s for s in service_specs(config)}
    assert specs["primary"].command == (
        "py",
        "-m",
        "primary_svc",
        "--model_path",
        "/m.gguf",
        "--cache_dir",
        "/c",
        "--precision",
        "bf16",
        "--max_context",
        "4096",
        "--num_threads",
        "1",
    )
    # + grammar-forced and prediction drafts
    assert specs["draft"].command[-2:] == ("--strategies", "prompt_lookup,grammar,prediction")
    assert dict(specs["draft"].address_flags) == {"--primary_address": "primary"}
    assert dict(specs["gateway"].address_flags) == {
        "--primary_address": "primary",
        "--draft_address": "draft",
        "--validator_address": "validator",
    }
    # An empty redis_url is passed too: the gateway must not pick one up from the environment. It
    # goes as the gateway's own variable, not in its command line, which any user can read (ps).
    defaults = service_specs(StackConfig())
    assert dict(defaults[3].env) == {"SPECDEC_GATEWAY_REDIS_URL": ""}
    with_password = service_specs(StackConfig(redis_url="redis://:s3cret@127.0.0.1:6379"))
    assert not any("s3cret" in part for spec in with_password for part in spec.command)
    assert dict(with_password[3].env) == {"SPECDEC_GATEWAY_REDIS_URL": "redis://:s3cret@127.0.0.1:6379"}
    assert not any("--model_path" in s.command or "--cache_dir" in s.command for s in defaults)
    with pytest.raises(ValueError, match="strategies"):
        StackConfig(strategies=("a,b",))


def test_the_http_front_is_a_client_of_the_gateway_with_its_keys() -> None:
    assert "http" not in {s.name for s in service_specs(StackConfig())}
    config = StackConfig(
        model_path="/m.gguf", api_keys_file=Path("/k"), is_serving_http=True, http_port=8123, python="py"
    )
    http = service_specs(config)[-1]
    assert http.command == ("py", "-m", "http_svc", "--model_path", "/m.gguf", "--api_keys_file", "/k")
    assert http.depends_on == ("gateway",) and dict(http.address_flags) == {"--gateway_address": "gateway"}
    assert http.health_http_path == "/health" and http.port == 8123
    assert not http.is_taking_service_token  # it calls the public API only, with the caller's key
    assert [[s.name for s in wave] for wave in waves(service_specs(config))][-1] == ["http"]


def test_every_real_service_gets_the_service_token() -> None:
    assert all(s.is_taking_service_token for s in service_specs(StackConfig()))


def test_the_service_token_is_private_shared_and_removed_on_stop(config: StackConfig) -> None:
    stack = Stack(config, specs=[fake("a", is_taking_service_token=True), fake("b")])
    with stack:
        argv = stack.log_path("a").read_text().split()
        path = Path(argv[argv.index("--service_token_file") + 1])
        assert path.read_text().strip() == stack.service_token and len(stack.service_token) == 64
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert "--service_token_file" not in stack.log_path("b").read_text(), "only the services that take it"
        stack.restart("a")
        argv = stack.log_path("a").read_text().split()
        assert argv[len(argv) - argv[::-1].index("--service_token_file")] == str(path), "a restart keeps it"
    assert not path.exists() and not path.parent.exists()


def test_log_tail_keeps_the_last_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(path, num_lines=2) == "line 98\nline 99"
    assert log_tail(tmp_path / "missing.log") == ""


# ---- real child processes --------------------------------------------------------------------------


def test_start_in_order_then_stop(config: StackConfig) -> None:
    stack = Stack(config, specs=[fake("a"), fake("b", depends_on=("a",), address_flags=(("--upstream", "a"),))])
    with stack:
        addresses = stack.addresses
        pids = [stack.pid("a"), stack.pid("b")]
        log_dir = stack.log_dir
        assert all(is_serving(address) for address in addresses.values())
        assert f"--upstream {addresses['a']}" in stack.log_path("b").read_text()
        assert addresses["a"] != addresses["b"]
    assert not any(is_alive(pid) for pid in pids)
    assert not log_dir.exists(), "a clean stop removes the temporary log dir"


def test_a_dying_service_fails_the_start_at_once_with_its_log(config: StackConfig) -> None:
    stack = Stack(config, specs=[fake("a"), fake("b", "--mode", "die", depends_on=("a",))])
    started = time.monotonic()
    with pytest.raises(ServiceError, match="fatal: the fake cannot start") as info:
        stack.start()
    assert time.monotonic() - started < 15.0
    assert info.value.name == "b" and "exited with code 3" in str(info.value)
    assert not is_alive(stack.pid("a")), "the services already started are stopped"
    assert info.value.log_path.exists(), "the logs are kept after a failure"
    stack.stop()
    assert info.value.log_path.exists()
    shutil.rmtree(stack.log_dir)


def test_a_service_that_never_serves_times_out(config: StackConfig) -> None:
    stack = Stack(config, specs=[fake("a", "--mode", "hang", startup_timeout_s=1.0)])
    with pytest.raises(ServiceError, match="not SERVING within 1 s"):
        stack.start()
    assert not is_alive(stack.pid("a"))
    shutil.rmtree(stack.log_dir)


def test_stop_kills_a_stubborn_service_and_what_it_spawned(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    stack = Stack(StackConfig(stop_grace_s=0.5), specs=[fake("a", "--mode", "stubborn", "--pid_file", str(pid_file))])
    with stack:
        grandchild = int(pid_file.read_text())
        assert is_alive(grandchild)
        leader = stack.pid("a")
    assert not is_alive(leader)
    assert wait_dead(grandchild), "no orphans: the whole process group is killed"


def test_an_exception_inside_the_stack_stops_it(config: StackConfig) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with Stack(config, specs=[fake("a")]) as stack:
            pid = stack.pid("a")
            raise RuntimeError("boom")
    assert not is_alive(pid)
    assert stack.log_dir.exists(), "the logs are kept: the failure may be a service's"
    shutil.rmtree(stack.log_dir)


def test_restart_comes_back_on_the_same_port(config: StackConfig) -> None:
    with Stack(config, specs=[fake("a")]) as stack:
        address, pid = stack.addresses["a"], stack.pid("a")
        stack.restart("a")
        assert stack.addresses["a"] == address
        assert stack.pid("a") != pid and not is_alive(pid)
        assert is_serving(address)
        assert "restarted by the launcher" in stack.log_path("a").read_text()


@contextlib.contextmanager
def started_past_a_lost_port(config: StackConfig, monkeypatch: pytest.MonkeyPatch, taken: int) -> Iterator[Stack]:
    """A stack of fake "a" whose first free port, `taken`, is lost to a race before "a" binds it: the
    stack once the launcher has moved "a" to another port and logged why."""
    ports = iter([taken])
    real_free_port = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", lambda host: next(ports, None) or real_free_port(host))
    with Stack(config, specs=[fake("a")]) as stack:
        assert int(stack.addresses["a"].rsplit(":", 1)[1]) != taken
        assert f"port {taken} was taken" in stack.log_path("a").read_text()
        yield stack


def test_a_port_lost_to_a_race_is_retried_on_another(config: StackConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind((launcher.LOOPBACK, 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with started_past_a_lost_port(config, monkeypatch, taken) as stack:
            assert is_serving(stack.addresses["a"])


def test_a_service_started_beside_one_that_moved_port_is_relaunched_with_its_new_address(
    config: StackConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b is launched with a's address before a serves; a then loses its port to a race and moves:
    b is launched again, naming a's new port, before the launcher waits for it."""
    with socket.socket() as squatter:
        squatter.bind((launcher.LOOPBACK, 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = launcher.free_port
        monkeypatch.setattr(launcher, "free_port", lambda host: next(ports, None) or real_free_port(host))
        specs = [fake("a"), fake("b", started_beside=("a",), address_flags=(("--upstream", "a"),))]
        with Stack(config, specs=specs) as stack:
            moved = stack.addresses["a"]
            assert int(moved.rsplit(":", 1)[1]) != taken
            # the first b may be stopped before it prints its argv; the one that serves names the new port
            argv_lines = [line for line in stack.log_path("b").read_text().splitlines() if line.startswith("argv:")]
            assert f"--upstream {moved}" in argv_lines[-1]
            assert not any(f"--upstream {moved}" in line for line in argv_lines[:-1])
            assert is_serving(stack.addresses["b"])


def test_sigterm_stops_a_cooperative_service_within_the_grace(tmp_path: Path) -> None:
    config = StackConfig(stop_grace_s=5.0, log_dir=tmp_path)
    stack = Stack(config, specs=[fake("a")]).start()
    started = time.monotonic()
    stack.stop()
    assert time.monotonic() - started < config.stop_grace_s, "it was not left to the SIGKILL"
    assert "stopped" in (tmp_path / "a.log").read_text(), "serve() ran its graceful stop"


def test_a_stopped_service_still_gets_its_graceful_stop(tmp_path: Path) -> None:
    # A SIGSTOPped process keeps a SIGTERM pending: without a SIGCONT it sat out the grace and was
    # SIGKILLed, and a primary's segments stayed in /dev/shm.
    stack = Stack(StackConfig(stop_grace_s=5.0, log_dir=tmp_path), specs=[fake("a")]).start()
    os.kill(stack.pid("a"), signal.SIGSTOP)
    stack.stop()
    assert "stopped" in (tmp_path / "a.log").read_text(), "serve() ran its graceful stop"
    assert stack.exit_code("a") != -signal.SIGKILL


SHM_DIR = Path("/dev/shm")


def test_shared_memory_a_service_named_after_its_pid_is_removed_once_it_is_gone(tmp_path: Path) -> None:
    # As a primary stopped while it starts (before it handles SIGTERM) or killed leaves its weight
    # and logits segments: before, they stayed in /dev/shm until another primary started.
    leaves_segments = (
        "import os, pathlib\n"
        "for prefix in ('specdec-weights', 'specdec-logits'):\n"
        "    pathlib.Path(f'/dev/shm/{prefix}-{os.getpid()}-test').write_bytes(b'x')\n"
    )
    spec = ServiceSpec("a", (sys.executable, "-c", leaves_segments + FAKE_SERVICE))
    others = SHM_DIR / f"specdec-weights-{os.getpid()}-test"  # a process that still runs
    others.write_bytes(b"x")
    pid = None
    try:
        stack = Stack(StackConfig(stop_grace_s=2.0, log_dir=tmp_path), specs=[spec]).start()
        pid = stack.pid("a")
        assert sorted(p.name for p in SHM_DIR.glob(f"specdec-*-{pid}-test")) == [
            f"specdec-logits-{pid}-test",
            f"specdec-weights-{pid}-test",
        ]
        stack.stop()
        assert not list(SHM_DIR.glob(f"specdec-*-{pid}-*"))
        assert others.exists()
    finally:
        others.unlink(missing_ok=True)
        for path in SHM_DIR.glob(f"specdec-*-{pid}-test") if pid is not None else ():
            path.unlink()


def test_the_launcher_knows_the_segment_names_of_the_primary() -> None:
    from specdec import logits_shm
    from specdec.weights import shared

    assert launcher.SHM_SEGMENT_PREFIXES == (shared.SEGMENT_PREFIX, logits_shm.SLOT_PREFIX)
    assert launcher.SHM_DIR == shared.SHM_DIR == SHM_DIR


def test_restart_while_the_launcher_has_an_rpc_in_flight(config: StackConfig) -> None:
    # The e2e tests restart a service while a stream to the gateway is open in
    # another thread: the fork for the new child must not hang on gRPC's state.
    with Stack(config, specs=[fake("a"), fake("b")]) as stack:
        with grpc.insecure_channel(stack.addresses["a"]) as channel:
            request = health_pb2.HealthCheckRequest(service="")
            watch = health_pb2_grpc.HealthStub(channel).Watch(request, timeout=60)
            first = next(watch)  # the stream stays open: Watch reports every change
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            stack.restart("b")
            assert is_serving(stack.addresses["b"])
            watch.cancel()


def test_services_die_with_a_launcher_killed_by_sigkill(tmp_path: Path) -> None:
    # A launcher that cannot clean up (kill -9, an OOM kill): on Linux the
    # kernel SIGTERMs its children (PR_SET_PDEATHSIG), so nothing is orphaned.
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signals are Linux-only")
    script = (
        f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "from test_launcher import fake; from specdec.launcher import Stack, StackConfig; "
        f"s = Stack(StackConfig(log_dir={str(tmp_path)!r}), specs=[fake('a')]).start(); "
        "print(s.pid('a'), flush=True); time.sleep(300)"
    )
    launcher_process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=launcher.REPO_ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # its secrets dir, which a killed launcher cannot remove
    )
    service_pid = None
    try:
        service_pid = int(launcher_process.stdout.readline())
        assert is_alive(service_pid)
        launcher_process.kill()
        launcher_process.wait()
        assert wait_dead(service_pid), "the service outlived its launcher"
    finally:
        launcher_process.kill()
        launcher_process.wait()
        if service_pid is not None and is_alive(service_pid):
            os.kill(service_pid, signal.SIGKILL)  # leave no orphan behind a failure


def test_a_metrics_port_lost_to_a_race_is_retried_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    # the second free port asked for is the service's /metrics port: another process holds it by then
    config = StackConfig(stop_grace_s=2.0, is_serving_metrics=True)
    with socket.socket() as squatter:
        squatter.bind((launcher.LOOPBACK, 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real_free_port = launcher.free_port
        answers = iter([None, taken])
        monkeypatch.setattr(launcher, "free_port", lambda host: next(answers, None) or real_free_port(host))
        with Stack(config, specs=[fake("a")]) as stack:
            assert is_serving(stack.addresses["a"])
            assert stack.metrics_url("a") and f":{taken}/" not in stack.metrics_url("a")
            assert f"port {taken} was taken" in stack.log_path("a").read_text()


def test_a_restart_keeps_the_metrics_port_that_was_printed_for_scraping() -> None:
    # inference.py --serve prints every service's /metrics URL once, for Prometheus; a restart drew
    # a fresh port, and the restarted service was never scraped again.
    with Stack(StackConfig(stop_grace_s=2.0, is_serving_metrics=True), specs=[fake("a")]) as stack:
        url = stack.metrics_url("a")
        stack.restart("a")
        assert stack.metrics_url("a") == url
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200


def test_a_restart_whose_metrics_port_was_taken_meanwhile_moves_only_that_port() -> None:
    with Stack(StackConfig(stop_grace_s=2.0, is_serving_metrics=True), specs=[fake("a")]) as stack:
        address, metrics_port = stack.addresses["a"], int(stack.metrics_url("a").rsplit(":", 1)[1].split("/")[0])
        stack.kill("a")
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind((launcher.LOOPBACK, metrics_port))
            squatter.listen()
            stack.restart("a", is_killing=False)
            assert stack.addresses["a"] == address and is_serving(address)
            assert f":{metrics_port}/" not in stack.metrics_url("a")


# ---- supervision -----------------------------------------------------------------------------------

# Short waits, so a test sees a few restarts in a row within a second.
FAST_RESTARTS = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, stable_after_s=2.0, max_rapid_restarts=2)


def poll_until_restarted(supervisor: Supervisor, name: str, num_restarts: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while supervisor.stack.num_restarts(name) < num_restarts or not supervisor.stack.is_running(name):
        assert time.monotonic() < deadline, f"{name} was not restarted {num_restarts} times"
        supervisor.poll()  # a restart returns once the service is SERVING
        time.sleep(0.01)


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [RestartPolicy().backoff_s(n) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(ValueError, match="initial_backoff_s"):
        RestartPolicy(initial_backoff_s=0.0)


def test_a_killed_service_is_restarted_on_its_port_with_backoff_and_counted(config: StackConfig) -> None:
    messages: list[str] = []
    with Stack(config, specs=[fake("a"), fake("b")]) as stack:
        supervisor = Supervisor(stack, FAST_RESTARTS, say=messages.append)
        address, pid = stack.addresses["a"], stack.pid("a")
        os.kill(pid, signal.SIGKILL)
        poll_until_restarted(supervisor, "a", 1)
        assert stack.addresses["a"] == address and stack.pid("a") != pid and is_serving(address)
        assert (stack.num_restarts("a"), stack.num_restarts("b")) == (1, 0)
        assert json.loads(stack.restarts_file.read_text()) == {"a": 1, "b": 0}
        assert messages[0].startswith("service 'a' was killed by SIGKILL; restarting it in 0.05 s (restart 1; log: ")
        assert messages[1].startswith(f"service 'a' is serving again at {address} (restart 1, up in ")
        assert "restarted by the launcher at" in stack.log_path("a").read_text()
        # Killed again at once: the wait doubles. Then up past stable_after_s: it starts afresh.
        stack.kill("a")
        poll_until_restarted(supervisor, "a", 2)
        assert "restarting it in 0.1 s (restart 2;" in messages[2]
        time.sleep(FAST_RESTARTS.stable_after_s)
        stack.kill("a")
        poll_until_restarted(supervisor, "a", 3)
        assert "restarting it in 0.05 s (restart 3;" in messages[4]
        assert stack.is_running("b") and stack.num_restarts("b") == 0


def test_a_hung_service_is_killed_and_restarted(config: StackConfig) -> None:
    """SIGSTOP: the process runs and holds its port, but answers nothing; before, --serve watched
    exits only, so a hung primary stayed hung for good."""
    messages: list[str] = []
    policy = dataclasses.replace(FAST_RESTARTS, liveness_interval_s=0.1, hang_after_s=1.0)
    with Stack(config, specs=[fake("a"), fake("b")]) as stack:
        supervisor = Supervisor(stack, policy, say=messages.append)
        address, pid = stack.addresses["a"], stack.pid("a")
        for _ in range(5):  # checks that find it answering
            supervisor.poll()
            time.sleep(0.1)
        assert stack.num_restarts("a") == 0 and not messages
        os.killpg(pid, signal.SIGSTOP)
        poll_until_restarted(supervisor, "a", 1)
        assert stack.addresses["a"] == address and stack.pid("a") != pid and is_serving(address)
        assert messages[0].startswith("service 'a' answered no health check for ")
        assert messages[1].startswith("service 'a' was killed by SIGKILL; restarting it in ")
        assert stack.num_restarts("b") == 0


def test_a_service_that_keeps_dying_is_given_up_naming_it(config: StackConfig) -> None:
    messages: list[str] = []
    with Stack(config, specs=[fake("a")]) as stack, socket.socket() as squatter:
        supervisor = Supervisor(stack, FAST_RESTARTS, say=messages.append)
        port = int(stack.addresses["a"].rsplit(":", 1)[1])
        stack.kill("a")
        # Every restart now fails to bind: the fake's serve() raises, it exits with code 1.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((launcher.LOOPBACK, port))
        squatter.listen()
        deadline = time.monotonic() + 60
        with pytest.raises(ServiceError) as info:
            while time.monotonic() < deadline:
                supervisor.poll()
                time.sleep(0.01)
        assert info.value.name == "a"
        assert info.value.reason == "exited with code 1; gave up after 2 restarts in a row"
        assert info.value.log_path == stack.log_path("a") and "could not bind the gRPC server to" in info.value.log_tail
        assert stack.num_restarts("a") == FAST_RESTARTS.max_rapid_restarts
        assert [m.split(";")[0] for m in messages] == [
            "service 'a' was killed by SIGKILL",
            "service 'a' failed to restart: exited with code 1 while starting",
            "service 'a' exited with code 1",
            "service 'a' failed to restart: exited with code 1 while starting",
        ]
    shutil.rmtree(stack.log_dir)  # kept, as a failure's logs are


def test_no_restart_once_the_supervisor_is_interrupted(config: StackConfig) -> None:
    # Ctrl-C (SIGTERM in inference.py) unwinds run() during the backoff: the stack stops, nothing restarts.
    policy = RestartPolicy(initial_backoff_s=5.0)
    with pytest.raises(KeyboardInterrupt), Stack(config, specs=[fake("a")]) as stack:
        supervisor = Supervisor(stack, policy)
        pid = stack.pid("a")
        stack.kill("a")
        threading.Timer(0.5, _thread.interrupt_main).start()
        supervisor.run(poll_s=0.01)
    assert stack.num_restarts("a") == 0 and stack.pid("a") == pid and not stack.is_running("a")
    shutil.rmtree(stack.log_dir)  # kept, as an interrupted start's logs are


# ---- ports that tell the truth ---------------------------------------------------------------------


def test_a_fixed_port_held_by_another_process_fails_before_anything_starts(config: StackConfig) -> None:
    with socket.socket() as squatter:
        squatter.bind((launcher.LOOPBACK, 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        stack = Stack(config, specs=[fake("a"), dataclasses.replace(fake("b", depends_on=("a",)), port=taken)])
        with pytest.raises(launcher.PortInUseError) as raised:
            stack.start()
    assert raised.value.port == taken and raised.value.name == "b"
    assert f"port {taken} on {launcher.LOOPBACK}" in str(raised.value) and "in use" in str(raised.value)
    # the check comes before the first launch, and leaves no log dir behind: no service wrote a log
    assert not stack.log_dir.exists()
    stack.stop()


def test_another_health_server_on_our_port_does_not_pass_for_the_service(
    config: StackConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port is lost to a race with a server that answers grpc.health.v1 SERVING itself: the
    launcher waits for its own process to hold the listener, so the service fails to bind and is
    relaunched elsewhere, instead of the stranger being taken for it."""
    health = grpc_health.HealthServicer()
    squatter = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health, squatter)
    taken = squatter.add_insecure_port(f"{launcher.LOOPBACK}:0")
    squatter.start()
    try:
        with started_past_a_lost_port(config, monkeypatch, taken) as stack:
            assert launcher.is_listening_itself(stack._get("a"))
    finally:
        squatter.stop(0)


def test_port_owner_finds_the_listener_of_a_process_group() -> None:
    with socket.socket() as listener, socket.socket() as bound_only:
        listener.bind((launcher.LOOPBACK, 0))
        listener.listen()
        bound_only.bind((launcher.LOOPBACK, 0))
        port, idle_port = listener.getsockname()[1], bound_only.getsockname()[1]
        assert port_owner.is_listening_in_group(os.getpgid(0), port)
        assert not port_owner.is_listening_in_group(os.getpgid(0), idle_port)  # bound, not listening
        with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True) as other:
            try:
                assert not port_owner.is_listening_in_group(other.pid, port)
            finally:
                other.kill()


def test_start_up_progress_is_relayed_while_the_launcher_waits(config: StackConfig) -> None:
    heard: list[tuple[str, ProgressEvent]] = []
    spec = dataclasses.replace(fake("a"), is_reporting_progress=True)
    with Stack(config, specs=[spec, fake("b")], on_progress=lambda name, event: heard.append((name, event))) as stack:
        assert "--progress_file" in stack._get("a").argv and "--progress_file" not in stack._get("b").argv
    assert heard == [
        *(("a", ProgressEvent("warming up", done, 4)) for done in range(5)),
        ("a", ProgressEvent("choosing", 0, 2, "timing x")),
    ]


def test_service_specs_ask_the_primary_for_its_progress() -> None:
    reporting = [s.name for s in service_specs(StackConfig(is_serving_http=True)) if s.is_reporting_progress]
    assert reporting == ["primary"]
