"""Building, running and stopping a service's gRPC server.

create_server() builds a ready-to-start server (tests call it with port 0 and
start it themselves); serve() is what a service's __main__ runs: start, wait
for SIGTERM/SIGINT, report NOT_SERVING, drain in-flight calls for grace_s,
stop. Every server also serves grpc.health.v1 (SERVING per service name and
for "") and server reflection (grpcurl, grpcui).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specdec.host_check import check_allowed_hosts
from specdec.metrics import MetricsServer, start_metrics_server
from specdec.tracing import server_interceptors

# Loopback unless configured: a service is reachable from other hosts only
# when its deployment says so (compose sets 0.0.0.0 inside the containers).
DEFAULT_HOST = "127.0.0.1"
# Inline fp32 logits of a 65-row tree over a 262144-token vocabulary are 68 MB.
DEFAULT_MAX_MESSAGE_BYTES = 128 * 1024 * 1024
DEFAULT_MAX_WORKERS = 16
DEFAULT_GRACE_S = 5.0
SIGNAL_POLL_S = 0.1  # how often serve() looks for a SIGTERM/SIGINT recorded by its handler
# The health-check name that stands for the whole server.
OVERALL_HEALTH = ""


class PortBindError(OSError):
    """The gRPC server's address, or its /metrics endpoint's, would not bind: in use, or not an
    address of this host."""


@contextlib.contextmanager
def exit_if_port_will_not_bind() -> Iterator[None]:
    """Around a service's serve: a port that will not bind exits with its message (code 1), no
    traceback; every other error keeps its own."""
    try:
        yield
    except PortBindError as e:
        raise SystemExit(f"error: {e}") from None


def start_metrics(
    port: int, registry: CollectorRegistry, host: str, allowed_hosts: tuple[str, ...] = ()
) -> MetricsServer | None:
    """start_metrics_server; a port that will not bind is a PortBindError naming it, as the gRPC
    port's is (exit_if_port_will_not_bind: one line, not a traceback)."""
    try:
        return start_metrics_server(port, registry, host=host, allowed_hosts=allowed_hosts)
    except OSError as e:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise PortBindError(f"could not bind the metrics server to {address} ({e.strerror or e})") from None


AddServicerFn = Callable[[Any, grpc.Server], None]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where and how a service listens; each service's config.py builds one."""

    host: str = DEFAULT_HOST
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_workers: int = DEFAULT_MAX_WORKERS
    grace_s: float = DEFAULT_GRACE_S
    metrics_port: int = 0  # 0: no /metrics endpoint
    # The host names besides loopback ones and IP addresses that a /metrics request's Host may name
    # (specdec.host_check: DNS rebinding); "*": any.
    allowed_hosts: tuple[str, ...] = ()
    tls_cert_file: str = ""  # PEM certificate chain; with tls_key_file: serve TLS instead of plaintext
    tls_key_file: str = ""  # PEM private key of that certificate

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        check_allowed_hosts(self.allowed_hosts)

    @property
    def is_tls(self) -> bool:
        return bool(self.tls_cert_file)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials from the PEM files, or None for plaintext."""
        if not self.is_tls:
            return None
        with open(self.tls_key_file, "rb") as key, open(self.tls_cert_file, "rb") as cert:
            return grpc.ssl_server_credentials([(key.read(), cert.read())])

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


class _NameRecorder:
    """Stands in for the server while a generated add_*_to_server runs, to learn
    the full service names it registers (for health and reflection)."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server
        self.names: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        for h in handlers:
            name = getattr(h, "service_name", None)
            if callable(name) and name() not in self.names:
                self.names.append(name())
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        if service_name not in self.names:
            self.names.append(service_name)
        self._server.add_registered_method_handlers(service_name, method_handlers)


def create_server(
    address: str,
    services: Sequence[tuple[AddServicerFn, Any]],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_workers: int = DEFAULT_MAX_WORKERS,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    health_servicer: health.HealthServicer | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.Server, int]:
    """A server (not started) with `services` + health + reflection bound to address.

    services: (add_XServicer_to_server, servicer) pairs from the generated stubs.
    credentials: TLS (ServerConfig.server_credentials()); None serves plaintext.
    Returns the server and the bound port (the real one when address ends in :0).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        interceptors=[*server_interceptors(), *interceptors],
        options=server_options(max_message_bytes),
    )
    health_servicer = health.HealthServicer() if health_servicer is None else health_servicer
    names, port = add_services(server, services, health_servicer, address, credentials)
    for name in names:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The channel options of every server, threaded or asyncio."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Two servers on one port would split traffic silently; fail the bind instead.
        ("grpc.so_reuseport", 0),
    ]


def add_services(
    server: Any,
    services: Sequence[tuple[AddServicerFn, Any]],
    health_servicer: Any,
    address: str,
    credentials: grpc.ServerCredentials | None,
) -> tuple[list[str], int]:
    """Add `services`, health and reflection to server (threaded or asyncio) and bind it to address.
    Returns the health-check names to report SERVING (the whole server's and each service's) and
    the bound port."""
    recorder = _NameRecorder(server)
    for add_to_server, servicer in services:
        add_to_server(servicer, recorder)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*recorder.names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio raises here where older releases returned 0
        port = 0
    if port == 0:
        raise PortBindError(f"could not bind the gRPC server to {address} (in use, or not an address of this host)")
    return [OVERALL_HEALTH, *recorder.names], port


def _record_stop_signals() -> tuple[dict[int, Any], list[int]]:
    """On the main thread, SIGTERM and SIGINT append to the returned list instead of their handlers;
    returns (the previous handlers, to restore, and that list)."""
    previous: dict[int, Any] = {}
    received_signals: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            # The handler only records the signal: Event.set() from a handler can deadlock on the
            # Event's lock when the signal lands while this same thread is inside stop.wait().
            previous[signum] = signal.signal(signum, lambda signum, _frame: received_signals.append(signum))
    return previous, received_signals


def serve(
    config: ServerConfig,
    services: Sequence[tuple[AddServicerFn, Any]],
    *,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    registry: CollectorRegistry | None = None,
    stop_event: threading.Event | None = None,
    on_started: Callable[[int], None] | None = None,
    on_stopped: Callable[[], None] | None = None,
) -> None:
    """Run a server until SIGTERM/SIGINT (or stop_event), then stop gracefully.

    registry: served on config.metrics_port (when not 0) at /metrics.
    On stop: health turns NOT_SERVING (load balancers drain), in-flight calls
    get config.grace_s to finish, then on_stopped runs (release shared memory,
    close clients).
    """
    log = structlog.get_logger("specdec.service")
    health_servicer = health.HealthServicer()
    stop = threading.Event() if stop_event is None else stop_event
    previous, received_signals = _record_stop_signals()
    metrics_server = None
    try:
        # Inside the try: a port that will not bind still runs on_stopped, which stops the service's
        # background threads before the interpreter exits (one still in native code there aborts it).
        server, port = create_server(
            config.address,
            services,
            max_message_bytes=config.max_message_bytes,
            max_workers=config.max_workers,
            interceptors=interceptors,
            health_servicer=health_servicer,
            credentials=config.server_credentials(),
        )
        if registry is not None:
            metrics_server = start_metrics(config.metrics_port, registry, config.host, config.allowed_hosts)
        server.start()
        metrics_port = None if metrics_server is None else metrics_server.port
        log.info("serving", host=config.host, port=port, tls=config.is_tls, metrics_port=metrics_port)
        if on_started is not None:
            on_started(port)
        while not received_signals and not stop.wait(SIGNAL_POLL_S):
            pass
        log.info("stopping", grace_s=config.grace_s)
        health_servicer.enter_graceful_shutdown()
        server.stop(config.grace_s).wait()
        log.info("stopped")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if metrics_server is not None:
            metrics_server.stop()
        if on_stopped is not None:
            on_stopped()
