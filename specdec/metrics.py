"""Prometheus metrics: the families every service exports, and the /metrics endpoint.

Each service owns the families of what it does and exports only those (gateway.metrics,
primary_svc.metrics, draft_svc.metrics; the validator's path gauge in validator_svc); every one
also exports the RPC families below, which its interceptor records (specdec.service.interceptor).
Every metric object lives in a class built around a CollectorRegistry that the caller owns (no
module-level metric objects: tests build their own registry and read it back with
registry.get_sample_value). Each service exposes its registry on its own HTTP port; the scrape
target identifies the service, so names carry no service label.

Names follow Prometheus conventions: counters end in _total, durations are in seconds, sizes in
bytes, fractions are 0..1; where a user would compare with vLLM, the name is vLLM's with the
`specdec_` namespace for `vllm:` (docs/metrics.md has the mapping).
"""

from __future__ import annotations

import functools
import socket
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from specdec.host_check import allowed_host_set, host_of, is_allowed, is_ip_address, origin_host

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

NAMESPACE = "specdec"
# Port value that disables the metrics endpoint.
METRICS_DISABLED_PORT = 0

# RPC latencies span sub-millisecond (Validate of a small tree) to tens of
# seconds (a long Generate).
RPC_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A pipeline stage of one step: sub-ms (validate, Redis) to a few hundred ms
# (a verify of a large tree on CPU).
STAGE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


_Family = TypeVar("_Family", Counter, Gauge)


def family(
    kind: type[_Family],
    registry: CollectorRegistry,
    name: str,
    documentation: str,
    labels: Sequence[str] = (),
    *,
    namespace: str = NAMESPACE,
) -> _Family:
    """A metric family of `kind` and `namespace` in `registry`: a declaration names only what differs."""
    return kind(name, documentation, list(labels), namespace=namespace, registry=registry)


# counter(registry, name, documentation, labels=(), *, namespace=NAMESPACE), and gauge(...) alike
counter = functools.partial(family, Counter)
gauge = functools.partial(family, Gauge)


def histogram(
    registry: CollectorRegistry,
    name: str,
    documentation: str,
    buckets: Sequence[float],
    labels: Sequence[str] = (),
    *,
    namespace: str = NAMESPACE,
) -> Histogram:
    return Histogram(name, documentation, list(labels), namespace=namespace, registry=registry, buckets=buckets)


class RpcMetrics:
    """Calls handled by a service, by method and status code, and their handling time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = counter(
            registry, "rpc_requests", "RPCs handled, by method and status code.", ["method", "code"]
        )
        self.rpc_latency = histogram(
            registry, "rpc_latency_seconds", "RPC handling time, by method.", RPC_BUCKETS_S, ["method"]
        )


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running /metrics endpoint."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start_metrics_server(
    port: int, registry: CollectorRegistry, host: str = "127.0.0.1", allowed_hosts: Iterable[str] = ()
) -> MetricsServer | None:
    """Serve `registry` on http://host:port/metrics; port 0 disables it (returns None). It answers
    without authentication, so a request whose Host names neither localhost, a loopback or other IP
    address nor one of `allowed_hosts` ("*": any), or whose Origin names neither a loopback host nor
    one of them, gets a 403 (host_checked)."""
    if port == METRICS_DISABLED_PORT:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"metrics port must be in [0, 65535], got {port}")

    class Server(ThreadingWSGIServer):
        """prometheus_client's server, with the address family of `host` (an IPv6 one too)."""

    Server.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    # prometheus_client's start_http_server starts serving its own app, without the Host check:
    # this builds the same server around the checked one before it accepts a connection.
    app = host_checked(make_wsgi_app(registry), allowed_hosts)
    httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)


class _QuietHandler(WSGIRequestHandler):
    """No line on stderr per request (a scrape every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def host_checked(app: WSGIApplication, allowed_hosts: Iterable[str] = ()) -> WSGIApplication:
    """`app` behind the Host rule of specdec.host_check (DNS rebinding): a Host that is an IP address
    passes too (a scraper names its target's address, and no page can make a browser send one for
    another site), an Origin only when loopback or allowed (a scraper sends none)."""
    allowed = allowed_host_set(allowed_hosts)

    def checked(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        for header, key, host_of_value, answered in _CHECKED_HEADERS:
            value = environ.get(key)
            if value is None:
                continue
            host = host_of_value(value)
            if is_allowed(host, allowed) or (header == "Host" and is_ip_address(host)):
                continue
            body = f"403: the {header} header {value[:200]!r} is not allowed: this endpoint answers {answered}\n"
            start_response("403 Forbidden", [("Content-Type", "text/plain; charset=utf-8")])
            return [body.encode()]
        return app(environ, start_response)

    return checked


# The headers host_checked checks: (name, WSGI key, its host, what the endpoint answers).
_CHECKED_HEADERS = (
    (
        "Host",
        "HTTP_HOST",
        host_of,
        "requests to localhost, an IP address or a host of --allowed_hosts (which keeps web pages from "
        "reading it through DNS rebinding)",
    ),
    ("Origin", "HTTP_ORIGIN", origin_host, "pages of localhost, a loopback address or a host of --allowed_hosts only"),
)
