"""The one server interceptor every service installs.

It turns domain exceptions (specdec/errors.py) into their specific gRPC status,
turns anything unexpected into INTERNAL with a short message (the traceback
goes to the log, never to the client), binds `request_id` into the logging
context of every call whose request carries one, and records per-method
request counts and latencies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import grpc
import structlog

from specdec.errors import InvalidArgument, SpecdecError
from specdec.logging import bind_request
from specdec.tracing import LOG_FIELD, client_request_id_bound, client_request_id_of
from specdec.metrics import RpcMetrics

# Codes of a failed call to another service that are passed through as they
# are: they say something true about this call too (the dependency is down,
# out of time or capacity). Any other downstream failure is a bug here: INTERNAL.
_PASSTHROUGH_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)


def method_name(full_method: str) -> str:
    """'/specdec.v1.PrimaryService/Verify' -> 'PrimaryService/Verify'."""
    service, _, rpc = full_method.lstrip("/").rpartition("/")
    return f"{service.rpartition('.')[2]}/{rpc}"


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions to status codes, binds request_id, records metrics."""

    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self._metrics = metrics
        self._log = structlog.get_logger("specdec.rpc")

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = method_name(handler_call_details.method)
        codec = {
            "request_deserializer": _lenient(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._wrap_unary(handler.unary_unary, method), **codec)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._wrap_stream(handler.unary_stream, method), **codec)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._wrap_unary(handler.stream_unary, method), **codec)
        return grpc.stream_stream_rpc_method_handler(self._wrap_stream(handler.stream_stream, method), **codec)

    def _wrap_unary(
        self, behavior: Callable[[Any, grpc.ServicerContext], Any], method: str
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            with _request_scope(request, method), client_request_scope(context) as malformed:
                try:
                    _check_decoded(request, malformed)
                    return behavior(request, context)
                except Exception as exc:  # noqa: BLE001 - every failure gets a status
                    code, message = self._status_for(exc, context, method)
                    if message is None:
                        raise
                    context.abort(code, message)
                finally:
                    self._record(method, code, started)

        return wrapped

    def _wrap_stream(
        self, behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]], method: str
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            with _request_scope(request, method), client_request_scope(context) as malformed:
                try:
                    _check_decoded(request, malformed)
                    yield from behavior(request, context)
                except Exception as exc:  # noqa: BLE001 - every failure gets a status
                    code, message = self._status_for(exc, context, method)
                    if message is None:
                        raise
                    context.abort(code, message)
                finally:
                    if code == grpc.StatusCode.OK and not context.is_active():
                        code = grpc.StatusCode.CANCELLED  # the client went away mid-stream
                    self._record(method, code, started)

        return wrapped

    def _status_for(
        self, exc: Exception, context: grpc.ServicerContext, method: str
    ) -> tuple[grpc.StatusCode, str | None]:
        """The status for exc; message None when the servicer already set one."""
        already = context.code()
        if already is not None and already != grpc.StatusCode.OK:
            # The servicer aborted the call itself (context.abort): keep its status.
            return already, None
        if isinstance(exc, SpecdecError):
            code = grpc.StatusCode[exc.status_name]
            self._log.info("rpc_error", method=method, code=code.name, error=str(exc))
            return code, str(exc)
        if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call) and exc.code() in _PASSTHROUGH_CODES:
            code = exc.code()
            self._log.warning("rpc_dependency_error", method=method, code=code.name, error=exc.details())
            return code, f"{method}: a dependency failed: {exc.details()}"
        self._log.exception("rpc_internal_error", method=method)
        return grpc.StatusCode.INTERNAL, f"{method}: internal error ({type(exc).__name__}); see the service log"

    def _record(self, method: str, code: grpc.StatusCode, started: float) -> None:
        elapsed_s = time.perf_counter() - started
        # The gRPC access log: one line per call at DEBUG (several calls per step at INFO would
        # drown the rest), tagged with the request's ids like every line logged under the call.
        self._log.debug("rpc", method=method, code=code.name, duration_ms=round(elapsed_s * 1000, 3))
        if self._metrics is None:
            return
        self._metrics.requests.labels(method, code.name).inc()
        self._metrics.rpc_latency.labels(method).observe(elapsed_s)


class _UndecodableRequest:
    """Stands in for a request whose bytes did not parse, so the call gets INVALID_ARGUMENT
    (gRPC itself would answer INTERNAL): typically a string field that is not valid UTF-8."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as INVALID_ARGUMENT
            return _UndecodableRequest(exc)

    return deserialize


def _check_decoded(request: Any, malformed: InvalidArgument | None = None) -> None:
    """Refuse a call whose request did not parse, or whose metadata carries a malformed field."""
    if malformed is not None:
        raise malformed
    if isinstance(request, _UndecodableRequest):
        raise InvalidArgument(
            "request", f"the message does not parse (text fields must be valid UTF-8): {type(request.error).__name__}"
        )


@contextmanager
def client_request_scope(context: Any) -> Iterator[InvalidArgument | None]:
    """Within: the caller's x-request-id (metadata) tags every log line and goes on with every
    internal call made (specdec.tracing). Yields the InvalidArgument naming it when it is
    malformed (the call is refused with it, inside the status mapping), else None."""
    try:
        client_request_id = client_request_id_of(context.invocation_metadata())
    except InvalidArgument as e:
        yield e
        return
    if not client_request_id:
        yield None
        return
    with (
        client_request_id_bound(client_request_id),
        structlog.contextvars.bound_contextvars(**{LOG_FIELD: client_request_id}),
    ):
        yield None


def _request_scope(request: Any, method: str) -> AbstractContextManager[None]:
    """Bind request_id into the logging context when the request has one."""
    request_id = getattr(request, "request_id", "")
    if isinstance(request_id, str) and request_id:
        return bind_request(request_id, rpc=method)
    return nullcontext()
