"""What the error interceptors do around every call, threaded or asyncio: one core, two thin
adapters (ErrorInterceptor in interceptor.py, AioErrorInterceptor in aio.py).

Around the handler, CallGuard.call:
- binds `request_id` (when the request carries one) and the caller's x-request-id into the
  logging context;
- refuses a request that did not parse (INVALID_ARGUMENT instead of gRPC's INTERNAL);
- turns domain exceptions (specdec/errors.py) into their specific gRPC status, a dependency's
  UNAVAILABLE/DEADLINE_EXCEEDED/RESOURCE_EXHAUSTED/CANCELLED into the same, and anything
  unexpected into INTERNAL with a short message (the traceback goes to the log, never to the
  client); a status the servicer set itself (context.abort) is kept;
- records per-method request counts and latencies, and one DEBUG access-log line.
The adapters only call the handler inside it (with the checked request) and abort with the status
it chose, each in its own flavour (context.abort raises; the asyncio one is awaited).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from specdec.errors import InvalidArgument, SpecdecError
from specdec.logging import bind_request
from specdec.metrics import RpcMetrics
from specdec.tracing import LOG_FIELD, client_request_id_bound, client_request_id_of

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
# A handler factory of an adapter: (the servicer's behaviour, the method's name) -> the guarded one.
Wrap = Callable[[Callable[..., Any], str], Callable[..., Any]]


def method_name(full_method: str) -> str:
    """'/specdec.v1.PrimaryService/Verify' -> 'PrimaryService/Verify'."""
    service, _, rpc = full_method.lstrip("/").rpartition("/")
    return f"{service.rpartition('.')[2]}/{rpc}"


@dataclass(slots=True)
class GuardedCall:
    """One call inside CallGuard.call, and how it ended. message set: the adapter aborts the call
    with (code, message)."""

    request: Any
    malformed: InvalidArgument | None  # a malformed field of the call's metadata
    code: grpc.StatusCode = grpc.StatusCode.OK
    message: str | None = None

    def checked_request(self) -> Any:
        """The request for the handler; InvalidArgument when it did not parse or the metadata is
        malformed (raised inside the guard, which maps it)."""
        _check_decoded(self.request, self.malformed)
        return self.request


class CallGuard:
    """The status mapping, logging context and metrics of every call."""

    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self._metrics = metrics
        self._log = structlog.get_logger("specdec.rpc")

    @contextmanager
    def call(
        self, request: Any, context: Any, method: str, *, is_gone: Callable[[], bool] | None = None
    ) -> Iterator[GuardedCall]:
        """Run the handler within, on the yielded call's checked_request(). A failure is swallowed
        when the adapter must abort the call (call.message is set), re-raised otherwise (the
        servicer's own abort, a cancellation).
        is_gone: whether the client went away (a threaded stream's end), recorded as CANCELLED."""
        started = time.perf_counter()
        call = GuardedCall(request, None)
        # the access log line is written inside the scopes too: it carries the request's ids
        with _request_scope(request, method), client_request_scope(context) as call.malformed:
            try:
                yield call
            except asyncio.CancelledError:
                call.code = grpc.StatusCode.CANCELLED  # the client went away
                raise
            except Exception as exc:  # noqa: BLE001 - every failure gets a status
                call.code, call.message = self._status_for(exc, context, method)
                if call.message is None:
                    raise
            finally:
                if call.code == grpc.StatusCode.OK and is_gone is not None and is_gone():
                    call.code = grpc.StatusCode.CANCELLED  # the client went away mid-stream
                self._record(method, call.code, started)

    def _status_for(self, exc: Exception, context: Any, method: str) -> tuple[grpc.StatusCode, str | None]:
        """The status for exc; message None when the servicer already set one."""
        kept = _servicer_status(exc, context)
        if kept is not None:
            return kept, None
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


def guarded_handler(handler: Any, method: str, wrap_unary: Wrap, wrap_stream: Wrap) -> grpc.RpcMethodHandler:
    """handler with its behaviour wrapped (by response kind) and a request deserializer that turns
    unparsable bytes into an _UndecodableRequest, which the guard refuses."""
    codec = {
        "request_deserializer": _lenient(handler.request_deserializer),
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary, method), **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream, method), **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary, method), **codec)
    return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream, method), **codec)


def _servicer_status(exc: Exception, context: Any) -> grpc.StatusCode | None:
    """The status the servicer set itself (it aborted the call), to keep; None when it set none."""
    code = context.code()
    if isinstance(exc, grpc.aio.AbortError):
        return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    if code is not None and code != grpc.StatusCode.OK:
        return code
    return None


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
