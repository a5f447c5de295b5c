"""Structured logging for the services (structlog).

Each service's __main__ calls configure_logging() once; everything else just
does `log = structlog.get_logger()` and logs key/value events. Lines are JSON
when stderr is not a terminal (containers, CI, log shippers) and coloured
console lines otherwise, and the libraries' stdlib records (grpc, redis, uvicorn's access
log) go through the same processors (structlog's stdlib ProcessorFormatter). Lines logged while
a traced call is served carry its trace_id and span_id, and the client's own request id
(client_request_id, specdec.tracing). The RPC interceptor (specdec/service.py) binds
`request_id` and `rpc` through contextvars for the duration of every call that
carries a request_id, so every event logged under it is tagged without
threading the id through the code.

Request content stays out of the logs: tracebacks list files, lines and
functions, never local variables (a frame's locals hold prompts, token ids and
logits: one such line was 34.5 MB), and no event carries a prompt or an output.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TextIO

import structlog

from specdec.tracing import add_trace_ids, configure_tracing

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MAX_TRACEBACK_FRAMES = 20


def configure_service_telemetry(service: str, level: str, environ: Mapping[str, str], span_service: str = "") -> None:
    """A service process's logs (configure_logging) and traces (configure_tracing: OTLP export only
    when environ names OTEL_EXPORTER_OTLP_ENDPOINT). span_service: the service its spans name, where
    that differs from its logs' `service`."""
    configure_logging(service, level=level)
    configure_tracing(span_service or service, environ)


def configure_logging(
    service: str, *, level: str = "INFO", is_json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog and the stdlib root logger (grpc logs through it).

    is_json None means: JSON unless `stream` is a terminal.
    """
    level = level.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"level must be one of {LOG_LEVELS}, got {level!r}")
    stream = sys.stderr if stream is None else stream
    if is_json is None:
        is_json = not stream.isatty()
    level_no = logging.getLevelNamesMapping()[level]

    def add_service(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        return event

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        add_service,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        add_trace_ids,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if is_json:
        tracebacks = structlog.tracebacks.ExceptionDictTransformer(show_locals=False, max_frames=MAX_TRACEBACK_FRAMES)
        renderer: list[Any] = [structlog.processors.ExceptionRenderer(tracebacks), structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)]
    # One way out for every line: structlog's events and the libraries' stdlib records (grpc, redis,
    # uvicorn's access log) both end in the root handler's ProcessorFormatter, which renders them
    # the same way (JSON, with the request's context bound through contextvars).
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_no)


@contextmanager
def bind_request(request_id: str, **fields: Any) -> Iterator[None]:
    """Tag every event logged inside the block with request_id (and fields)."""
    with structlog.contextvars.bound_contextvars(request_id=request_id, **fields):
        yield
