"""Service infrastructure in process on port 0: health, reflection, the error
interceptor (status codes, no tracebacks, request_id in the log context,
metrics), graceful stop, and the container health-check command."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from specdec import errors, healthcheck
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.metrics import RpcMetrics
from specdec.service.server import PortBindError
from specdec.service import ErrorInterceptor, ServerConfig, create_server, method_name, serve, wait_for_serving
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, validator_pb2, validator_pb2_grpc
from tests.specdec.service_checks import check_stream_errors_arrive_after_the_messages_sent

REPO_ROOT = Path(__file__).resolve().parents[2]
# What Validate raises, chosen by the request_id the test sends.
DOMAIN_ERRORS = {
    "invalid": InvalidArgument("tree.parents", "parent 3 of node 1 is not below 1"),
    "missing": NotFound("request_id", "no active request 'missing'"),
    "full": ResourceExhausted("kv_cache", "no free KV blocks"),
    "early": FailedPrecondition("request_id", "Verify before Prefill"),
}


class FakeValidator(validator_pb2_grpc.ValidatorServiceServicer):
    """Raises what the request_id asks for; records the logging context."""

    def __init__(self) -> None:
        self.contexts: list[dict] = []

    def Validate(
        self,
        request: validator_pb2.ValidateRequest,  # noqa: N802 - the RPC's name
        context: grpc.ServicerContext,
    ) -> validator_pb2.ValidateResponse:
        self.contexts.append(structlog.contextvars.get_contextvars())
        if request.request_id in DOMAIN_ERRORS:
            raise DOMAIN_ERRORS[request.request_id]
        if request.request_id == "bug":
            raise RuntimeError("secret internal detail at /srv/model.py:12")
        if request.request_id == "downstream":
            # A call to a service that is down (nothing listens on port 1).
            with grpc.insecure_channel("127.0.0.1:1") as dead:
                validator_pb2_grpc.ValidatorServiceStub(dead).Validate(validator_pb2.ValidateRequest(), timeout=2)
        if request.request_id == "self-abort":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "the servicer's own status")
        return validator_pb2.ValidateResponse(accepted_nodes=[0], bonus_token=7)


class FakeGateway(gateway_pb2_grpc.GenerationServiceServicer):
    """Streams two messages, then fails when asked to."""

    def GenerateStream(
        self,
        request: gateway_pb2.GenerateRequest,  # noqa: N802 - the RPC's name
        context: grpc.ServicerContext,
    ) -> Iterator[gateway_pb2.GenerateStreamResponse]:
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, token_ids=[1])
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, token_ids=[2])
        if request.prompt == "fail":
            raise InvalidArgument("max_new_tokens", "must be > 0")
        yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, is_final=True)


@pytest.fixture
def server(registry: CollectorRegistry) -> Iterator[tuple[int, FakeValidator]]:
    validator = FakeValidator()
    server, port = create_server(
        "127.0.0.1:0",
        [
            (validator_pb2_grpc.add_ValidatorServiceServicer_to_server, validator),
            (gateway_pb2_grpc.add_GenerationServiceServicer_to_server, FakeGateway()),
        ],
        interceptors=[ErrorInterceptor(RpcMetrics(registry))],
    )
    server.start()
    yield port, validator
    server.stop(None)


def test_method_name_drops_the_package() -> None:
    assert method_name("/specdec.v1.PrimaryService/Verify") == "PrimaryService/Verify"


def test_every_domain_error_names_a_status_code() -> None:
    subclasses = errors.SpecdecError.__subclasses__()
    assert len(subclasses) >= 8
    for cls in subclasses:
        assert grpc.StatusCode[cls.status_name] not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN), cls
        error = cls("speculation.draft_length", "must be <= 64")
        assert (str(error), error.field) == ("speculation.draft_length: must be <= 64", "speculation.draft_length")
    with pytest.raises(ValueError, match="field"):
        errors.InvalidArgument("", "no field named")


def test_health_is_serving_per_service(channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "specdec.v1.ValidatorService", "specdec.v1.GenerationService"):
        response = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, name
    with pytest.raises(grpc.RpcError) as e:
        stub.Check(health_pb2.HealthCheckRequest(service="specdec.v1.NoSuchService"), timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_services(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"specdec.v1.ValidatorService", "specdec.v1.GenerationService", "grpc.health.v1.Health"} <= names


def test_success_passes_through_with_request_id_bound(channel: grpc.Channel, server) -> None:
    stub = validator_pb2_grpc.ValidatorServiceStub(channel)
    response = stub.Validate(validator_pb2.ValidateRequest(request_id="ok"), timeout=5)
    assert (list(response.accepted_nodes), response.bonus_token) == ([0], 7)
    assert server[1].contexts[-1] == {"request_id": "ok", "rpc": "ValidatorService/Validate"}
    # The binding ends with the call: the next call's context is its own.
    stub.Validate(validator_pb2.ValidateRequest(request_id=""), timeout=5)
    assert server[1].contexts[-1] == {}


@pytest.mark.parametrize(
    ("request_id", "code", "message"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "tree.parents: parent 3 of node 1 is not below 1"),
        ("missing", grpc.StatusCode.NOT_FOUND, "request_id: no active request 'missing'"),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, "kv_cache: no free KV blocks"),
        ("early", grpc.StatusCode.FAILED_PRECONDITION, "request_id: Verify before Prefill"),
    ],
)
def test_domain_errors_get_their_code_and_name_the_field(
    channel: grpc.Channel, request_id: str, code: grpc.StatusCode, message: str
) -> None:
    stub = validator_pb2_grpc.ValidatorServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Validate(validator_pb2.ValidateRequest(request_id=request_id), timeout=5)
    assert (e.value.code(), e.value.details()) == (code, message)


def test_unexpected_errors_are_internal_without_details(channel: grpc.Channel) -> None:
    stub = validator_pb2_grpc.ValidatorServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Validate(validator_pb2.ValidateRequest(request_id="bug"), timeout=5)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert e.value.details() == "ValidatorService/Validate: internal error (RuntimeError); see the service log"
    assert "secret" not in e.value.details() and "Traceback" not in e.value.details()


def test_a_dependency_that_is_down_gives_unavailable(channel: grpc.Channel) -> None:
    stub = validator_pb2_grpc.ValidatorServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Validate(validator_pb2.ValidateRequest(request_id="downstream"), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert e.value.details().startswith("ValidatorService/Validate: a dependency failed: ")


def test_the_servicers_own_abort_is_kept(channel: grpc.Channel) -> None:
    stub = validator_pb2_grpc.ValidatorServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Validate(validator_pb2.ValidateRequest(request_id="self-abort"), timeout=5)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.PERMISSION_DENIED, "the servicer's own status")


def test_stream_errors_arrive_after_the_messages_sent(channel: grpc.Channel) -> None:
    check_stream_errors_arrive_after_the_messages_sent(channel)


def test_metrics_count_calls_by_code(channel: grpc.Channel, registry: CollectorRegistry) -> None:
    stub = validator_pb2_grpc.ValidatorServiceStub(channel)
    stub.Validate(validator_pb2.ValidateRequest(request_id="ok"), timeout=5)
    for rid in ("invalid", "bug"):
        with pytest.raises(grpc.RpcError):
            stub.Validate(validator_pb2.ValidateRequest(request_id=rid), timeout=5)
    method = "ValidatorService/Validate"
    for code in ("OK", "INVALID_ARGUMENT", "INTERNAL"):
        assert registry.get_sample_value("specdec_rpc_requests_total", {"method": method, "code": code}) == 1.0
    assert registry.get_sample_value("specdec_rpc_latency_seconds_count", {"method": method}) == 3.0


def test_wait_for_serving_and_the_healthcheck_command(server) -> None:
    address = f"127.0.0.1:{server[0]}"
    wait_for_serving(address, "specdec.v1.ValidatorService", timeout_s=5)
    assert healthcheck.main([address]) == 0
    assert healthcheck.main([address, "--service", "specdec.v1.NoSuchService"]) == 1


def test_the_healthcheck_command_checks_an_http_server_too() -> None:
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{httpd.server_address[1]}"
        assert healthcheck.main([address, "--http_path", "/health"]) == 0
        assert healthcheck.main([address, "--http_path", "/down"]) == 1
        assert healthcheck.main(["127.0.0.1:1", "--http_path", "/health", "--timeout", "0.3"]) == 1
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["127.0.0.1:1", "--http_path", "health"], "--http_path must start with '/'"),
        (["127.0.0.1:1", "--timeout", "0"], "--timeout must be > 0"),
        (["127.0.0.1:1", "--timeout", "nan"], "--timeout must be > 0"),
        (["127.0.0.1:1", "--tls_server_name", "a.example"], "--tls_server_name: a name"),
        (["127.0.0.1:1", "--tls_ca_file", "/nonexistent.pem"], "--tls_ca_file: no file"),
    ],
)
def test_the_healthcheck_command_refuses_bad_flags_in_one_line(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A path without its "/" was a traceback (urllib's InvalidURL: "nonnumeric port: '1health'").
    with pytest.raises(SystemExit) as raised:
        healthcheck.main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_wait_for_serving_times_out_on_a_dead_address() -> None:
    with pytest.raises(TimeoutError, match="did not report"):
        wait_for_serving("127.0.0.1:1", timeout_s=0.3)
    assert healthcheck.main(["127.0.0.1:1", "--timeout", "0.3"]) == 1


def test_server_config_validates_and_formats_the_address() -> None:
    assert ServerConfig().address == "127.0.0.1:0"
    assert ServerConfig(host="::", port=50051).address == "[::]:50051"
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="max_workers"):
        ServerConfig(max_workers=0)


def test_serve_stops_on_the_stop_event_and_reports_not_serving() -> None:
    stop = threading.Event()
    started: list[int] = []
    stopped = threading.Event()
    registry = CollectorRegistry()
    RpcMetrics(registry).requests.labels("Validator/Validate", "OK").inc(3)
    metrics_port = _free_port()
    thread = threading.Thread(
        target=serve,
        kwargs=dict(
            config=ServerConfig(grace_s=0.5, metrics_port=metrics_port, allowed_hosts=("prometheus.lan",)),
            services=[(validator_pb2_grpc.add_ValidatorServiceServicer_to_server, FakeValidator())],
            registry=registry,
            stop_event=stop,
            on_started=started.append,
            on_stopped=stopped.set,
        ),
    )
    thread.start()
    try:
        address = f"127.0.0.1:{_wait_for(lambda: started)[0]}"
        wait_for_serving(address, timeout_s=5)
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'specdec_rpc_requests_total{code="OK",method="Validator/Validate"} 3.0' in body
        # The Host check (DNS rebinding) with the config's allowed hosts: specdec.metrics.host_checked.
        for host, status in (("prometheus.lan:9100", 200), ("attacker.example:9100", 403)):
            request = urllib.request.Request(f"http://127.0.0.1:{metrics_port}/metrics", headers={"Host": host})
            try:
                assert urllib.request.urlopen(request, timeout=5).status == status
            except urllib.error.HTTPError as e:
                assert e.code == status
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive() and stopped.is_set()
    assert healthcheck.main([address, "--timeout", "0.3"]) == 1
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1)


@pytest.mark.parametrize(
    ("server", "config_of"),
    [
        ("gRPC", lambda port: ServerConfig(port=port)),
        # Before, http.server's OSError went out as a traceback (exit_if_port_will_not_bind let it by).
        ("metrics", lambda port: ServerConfig(port=0, metrics_port=port)),
    ],
)
def test_a_port_that_will_not_bind_is_named_and_still_runs_on_stopped(
    server: str, config_of: Callable[[int], ServerConfig]
) -> None:
    # on_stopped stops a service's background threads: left running past the failed start, one in
    # native code when the interpreter exits aborts the process instead of exiting it with code 1.
    stopped = threading.Event()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(PortBindError, match=f"could not bind the {server} server to 127.0.0.1:{port}"):
            serve(
                config_of(port),
                [(validator_pb2_grpc.add_ValidatorServiceServicer_to_server, FakeValidator())],
                registry=CollectorRegistry(),
                stop_event=threading.Event(),
                on_stopped=stopped.set,
            )
    assert stopped.is_set()


def test_sigterm_stops_a_serving_process_gracefully(tmp_path: Path) -> None:
    script = tmp_path / "serve_one.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        from specdec.logging import configure_logging
        from specdec.service import ServerConfig, serve
        from specdec.v1 import validator_pb2_grpc

        def started(port):
            print(port, flush=True)

        configure_logging("sigterm-test", stream=sys.stderr)
        serve(ServerConfig(grace_s=0.5), [(validator_pb2_grpc.add_ValidatorServiceServicer_to_server,
                                           validator_pb2_grpc.ValidatorServiceServicer())],
              on_started=started, on_stopped=lambda: print("stopped", flush=True))
    """)
    )
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        port = int(process.stdout.readline())
        wait_for_serving(f"127.0.0.1:{port}", timeout_s=10)
        process.terminate()  # SIGTERM
        out, err = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert out.strip() == "stopped"
    events = [json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")]
    assert events == ["serving", "stopping", "stopped"]  # JSON lines: stderr is a pipe, not a tty


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate: Callable[[], list[int]], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.01)
    return value
