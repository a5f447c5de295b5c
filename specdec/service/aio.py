"""The asyncio (grpc.aio) flavour of a service's server, for a service whose calls wait far more
than they compute (the public gateway: thousands of open streams must not each hold a thread).

The same contract as specdec.service.server: create_aio_server() builds a server with the
services + health + reflection, serve_aio() runs it until SIGTERM/SIGINT (or stop_event), turns
health NOT_SERVING, drains in-flight calls for grace_s and stops. Its handlers are coroutines
(async generators for streams); AioErrorInterceptor maps exceptions to statuses exactly as
ErrorInterceptor does for the threaded servers, which the internal services keep.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from specdec.metrics import start_metrics_server
from specdec.tracing import aio_server_interceptors
from specdec.service.interceptor import (
    ErrorInterceptor,
    _check_decoded,
    _lenient,
    _request_scope,
    client_request_scope,
    method_name,
)
from specdec.service.server import DEFAULT_MAX_MESSAGE_BYTES, OVERALL_HEALTH, AddServicerFn, ServerConfig, _NameRecorder


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    """ErrorInterceptor for coroutine handlers: domain exceptions -> their status, anything else
    -> INTERNAL (traceback to the log), request_id bound into the log context, per-method metrics.
    A call whose client went away (its handler cancelled) is recorded as CANCELLED."""

    def __init__(self, metrics=None) -> None:  # noqa: ANN001 - RpcMetrics | None
        self._sync = ErrorInterceptor(metrics)  # the status mapping and the metrics, shared

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # client streaming: server reflection only (no service API streams requests)
        method = method_name(handler_call_details.method)
        codec = {
            "request_deserializer": _lenient(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._wrap_unary(handler.unary_unary, method), **codec)
        return grpc.unary_stream_rpc_method_handler(self._wrap_stream(handler.unary_stream, method), **codec)

    def _wrap_unary(self, behavior: Callable[[Any, Any], Awaitable[Any]], method: str):
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            with _request_scope(request, method), client_request_scope(context) as malformed:
                try:
                    _check_decoded(request, malformed)
                    return await behavior(request, context)
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED
                    raise
                except Exception as exc:  # noqa: BLE001 - every failure gets a status
                    code, message = self._status_for(exc, context, method)
                    if message is None:
                        raise
                    await context.abort(code, message)
                finally:
                    self._sync._record(method, code, started)

        return wrapped

    def _wrap_stream(self, behavior: Callable[[Any, Any], AsyncIterator[Any]], method: str):
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            with _request_scope(request, method), client_request_scope(context) as malformed:
                try:
                    _check_decoded(request, malformed)
                    async for response in behavior(request, context):
                        yield response
                except asyncio.CancelledError:
                    code = grpc.StatusCode.CANCELLED  # the client went away mid-stream
                    raise
                except Exception as exc:  # noqa: BLE001 - every failure gets a status
                    code, message = self._status_for(exc, context, method)
                    if message is None:
                        raise
                    await context.abort(code, message)
                finally:
                    self._sync._record(method, code, started)

        return wrapped

    def _status_for(
        self, exc: Exception, context: grpc.aio.ServicerContext, method: str
    ) -> tuple[grpc.StatusCode, str | None]:
        if isinstance(exc, grpc.aio.AbortError):  # the servicer aborted the call itself: keep its status
            code = context.code()
            return (code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN), None
        return self._sync._status_for(exc, context, method)


async def create_aio_server(
    address: str,
    services: Sequence[tuple[AddServicerFn, Any]],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    health_servicer: health.aio.HealthServicer | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int]:
    """An asyncio server (not started) with `services` + health (SERVING) + reflection bound to address;
    awaited in the event loop that will run the server. Returns the server and the bound port."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(interceptors=[*aio_server_interceptors(), *interceptors], options=options)
    recorder = _NameRecorder(server)
    for add_to_server, servicer in services:
        add_to_server(servicer, recorder)
    health_servicer = health.aio.HealthServicer() if health_servicer is None else health_servicer
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in (OVERALL_HEALTH, *recorder.names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((*recorder.names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {address}")
    return server, port


async def serve_aio(
    config: ServerConfig,
    services: Sequence[tuple[AddServicerFn, Any]],
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    registry: CollectorRegistry | None = None,
    stop_event: asyncio.Event | None = None,
    on_started: Callable[[int], Awaitable[None] | None] | None = None,
) -> None:
    """Run an asyncio server until SIGTERM/SIGINT (or stop_event), then stop gracefully: health
    NOT_SERVING, in-flight calls get config.grace_s to finish. on_started(port) runs once it
    serves (a coroutine function is awaited)."""
    log = structlog.get_logger("specdec.service")
    health_servicer = health.aio.HealthServicer()
    server, port = await create_aio_server(
        config.address,
        services,
        max_message_bytes=config.max_message_bytes,
        interceptors=interceptors,
        health_servicer=health_servicer,
        credentials=config.server_credentials(),
    )
    stop = asyncio.Event() if stop_event is None else stop_event
    loop = asyncio.get_running_loop()
    installed = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(signum, stop.set)
            installed.append(signum)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass
    metrics_server = None
    try:
        if registry is not None:
            metrics_server = start_metrics_server(config.metrics_port, registry, host=config.host)
        await server.start()
        log.info(
            "serving",
            host=config.host,
            port=port,
            tls=config.is_tls,
            metrics_port=None if metrics_server is None else metrics_server.port,
        )
        if on_started is not None:
            started = on_started(port)
            if asyncio.iscoroutine(started):
                await started
        await stop.wait()
        log.info("stopping", grace_s=config.grace_s)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(config.grace_s)
        log.info("stopped")
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
        if metrics_server is not None:
            metrics_server.stop()
