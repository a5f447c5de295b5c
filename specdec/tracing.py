"""One trace per request, across the services.

Two things travel with every call that serves a request, in its gRPC metadata:
- the client's own id for it (`x-request-id`: the HTTP header X-Request-Id, or the gRPC metadata
  a client sends the gateway), bound into every log line logged while the call is served
  (`client_request_id`) and sent on with every internal call the gateway makes for it;
- the W3C trace context (`traceparent`), which OpenTelemetry's gRPC and ASGI instrumentation read
  and write: each service opens a span per call it serves and per call it makes, so a request is
  one trace (HTTP front -> gateway -> draft/primary/validator). Log lines carry its trace_id and
  span_id.

Tracing is on only when spans are exported: with OTEL_EXPORTER_OTLP_ENDPOINT set (OpenTelemetry's
standard variable; the OTLP exporter reads it and its siblings itself), SPECDEC_TRACES_DIR, or an
exporter a test adds; otherwise no OpenTelemetry interceptor is installed at all (configure_tracing
says why).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, server_interceptor
from opentelemetry.instrumentation.grpc.filters import health_check, negate
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

from specdec.errors import InvalidArgument
from specdec.request_id import MAX_REQUEST_ID_CHARS

CLIENT_REQUEST_ID_KEY = "x-request-id"  # gRPC metadata keys are lower case; HTTP headers are not case sensitive
LOG_FIELD = "client_request_id"
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
# A directory: each service also writes its finished spans there as JSON lines (<service>.jsonl),
# for a look at traces without a collector (and for the end-to-end test).
TRACES_DIR_ENV = "SPECDEC_TRACES_DIR"

_client_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("client_request_id", default="")


def check_client_request_id(value: str, field: str = CLIENT_REQUEST_ID_KEY) -> str:
    """value if it is 1..MAX_REQUEST_ID_CHARS printable ASCII characters, else InvalidArgument(field)."""
    if not value or len(value) > MAX_REQUEST_ID_CHARS or not (value.isascii() and value.isprintable()):
        raise InvalidArgument(field, f"must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters")
    return value


def client_request_id_of(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The client's request id in call metadata ("" when there is none); InvalidArgument if malformed."""
    for key, value in metadata or ():
        if key == CLIENT_REQUEST_ID_KEY:
            return check_client_request_id(value if isinstance(value, str) else "")
    return ""


def current_client_request_id() -> str:
    return _client_request_id.get()


@contextmanager
def client_request_id_bound(client_request_id: str) -> Iterator[None]:
    """Within: outgoing_metadata() carries client_request_id (nothing when it is "")."""
    token = _client_request_id.set(client_request_id)
    try:
        yield
    finally:
        _client_request_id.reset(token)


def outgoing_metadata(base: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
    """base plus the client's request id of the call being served (the trace context is added by
    the OpenTelemetry client interceptor)."""
    client_request_id = _client_request_id.get()
    return (*base, (CLIENT_REQUEST_ID_KEY, client_request_id)) if client_request_id else base


def add_trace_ids(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: the current span's trace_id and span_id (hex, as tracing backends show them)."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event.setdefault("trace_id", format(context.trace_id, "032x"))
        event.setdefault("span_id", format(context.span_id, "016x"))
    return event


def configure_tracing(
    service: str, environ: Mapping[str, str], processors: Iterable[SpanProcessor] = ()
) -> TracerProvider | None:
    """Install the process's tracer provider when spans go somewhere: to an OTLP exporter when
    environ names an endpoint, to a file when it names a directory (TRACES_DIR_ENV), to
    `processors` (tests: an in-memory exporter's). With none of them tracing stays off (None):
    no provider, and no OpenTelemetry interceptor on the channels and servers made afterwards
    (is_tracing_on), because even unsampled spans cost a grpc.aio call a few hundred µs here
    (bench/tracing_overhead.py). The client's request id travels either way."""
    processors = list(processors)
    if environ.get(TRACES_DIR_ENV):
        processors.append(_file_processor(Path(environ[TRACES_DIR_ENV]) / f"{service}.jsonl"))
    if environ.get(OTLP_ENDPOINT_ENV):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        processors.append(BatchSpanProcessor(OTLPSpanExporter()))
    if not processors:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for processor in processors:
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return provider


def is_tracing_on() -> bool:
    """Whether configure_tracing installed a provider (spans are recorded and exported)."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def _file_processor(path: Path) -> SpanProcessor:
    path.parent.mkdir(parents=True, exist_ok=True)
    out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the life of the process
    return SimpleSpanProcessor(ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"))


def server_interceptors() -> list[Any]:
    """A span per call served (health checks aside), child of the caller's trace context; none
    while tracing is off."""
    return [server_interceptor(filter_=negate(health_check()))] if is_tracing_on() else []


def aio_server_interceptors() -> list[Any]:
    return [aio_server_interceptor(filter_=negate(health_check()))] if is_tracing_on() else []


def aio_channel_interceptors() -> list[Any]:
    """For a grpc.aio channel: a span per call made, its trace context sent in the metadata; none
    while tracing is off."""
    return list(aio_client_interceptors(filter_=negate(health_check()))) if is_tracing_on() else []
