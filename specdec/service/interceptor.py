"""The one server interceptor every threaded service installs: CallGuard (call_guard.py) around
each call, the status it chose given with context.abort."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from specdec.metrics import RpcMetrics
from specdec.service.call_guard import CallGuard, guarded_handler, method_name

__all__ = ["ErrorInterceptor", "method_name"]


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions to status codes, binds request_id, records metrics."""

    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self._guard = CallGuard(metrics)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = method_name(handler_call_details.method)
        return guarded_handler(handler, method, self._wrap_unary, self._wrap_stream)

    def _wrap_unary(
        self, behavior: Callable[[Any, grpc.ServicerContext], Any], method: str
    ) -> Callable[[Any, grpc.ServicerContext], Any]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            with self._guard.call(request, context, method) as call:
                return behavior(call.checked_request(), context)
            context.abort(call.code, call.message)  # raises

        return wrapped

    def _wrap_stream(
        self, behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]], method: str
    ) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with self._guard.call(request, context, method, is_gone=lambda: not context.is_active()) as call:
                yield from behavior(call.checked_request(), context)
                return
            context.abort(call.code, call.message)  # raises

        return wrapped
