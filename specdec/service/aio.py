"""The asyncio (grpc.aio) flavour of a service's server, for a service whose calls wait far more
than they compute (the public gateway: thousands of open streams must not each hold a thread).

The same contract as specdec.service.server: create_aio_server() builds a server with the
services + health + reflection, serve_aio() runs it until SIGTERM/SIGINT (or stop_event), turns
health NOT_SERVING, drains in-flight calls for grace_s and stops. Its handlers are coroutines
(async generators for streams); AioErrorInterceptor maps exceptions to statuses with the same
CallGuard as ErrorInterceptor does for the threaded servers, which the internal services keep.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2
from prometheus_client import CollectorRegistry

from specdec.metrics import RpcMetrics
from specdec.tracing import aio_server_interceptors
from specdec.service.call_guard import CallGuard, guarded_handler, method_name
from specdec.service.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    AddServicerFn,
    ServerConfig,
    add_services,
    server_options,
    start_metrics,
)


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    """ErrorInterceptor for coroutine handlers: CallGuard (call_guard.py) around each call, the
    status it chose given with an awaited context.abort. A call whose client went away (its
    handler cancelled) is recorded as CANCELLED."""

    def __init__(self, metrics: RpcMetrics | None = None) -> None:
        self._guard = CallGuard(metrics)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # client streaming: server reflection only (no service API streams requests)
        method = method_name(handler_call_details.method)
        return guarded_handler(handler, method, self._wrap_unary, self._wrap_stream)

    def _wrap_unary(
        self, behavior: Callable[[Any, Any], Awaitable[Any]], method: str
    ) -> Callable[[Any, Any], Awaitable[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._guard.call(request, context, method) as call:
                return await behavior(call.checked_request(), context)
            await context.abort(call.code, call.message)  # raises

        return wrapped

    def _wrap_stream(
        self, behavior: Callable[[Any, Any], AsyncIterator[Any]], method: str
    ) -> Callable[[Any, Any], AsyncIterator[Any]]:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with self._guard.call(request, context, method) as call:
                async for response in behavior(call.checked_request(), context):
                    yield response
                return
            await context.abort(call.code, call.message)  # raises

        return wrapped


async def create_aio_server(
    address: str,
    services: Sequence[tuple[AddServicerFn, Any]],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    health_servicer: health.aio.HealthServicer | None = None,
    credentials: grpc.ServerCredentials | None = None,
    health_names: Sequence[str] = (),
) -> tuple[grpc.aio.Server, int]:
    """An asyncio server (not started) with `services` + health (SERVING) + reflection bound to address;
    awaited in the event loop that will run the server. Returns the server and the bound port.
    health_names: more names reported SERVING beside the services' (e.g. an instance's own name, which
    tells a peer that asks for it whether this very process still holds the address)."""
    server = grpc.aio.server(
        interceptors=[*aio_server_interceptors(), *interceptors], options=server_options(max_message_bytes)
    )
    health_servicer = health.aio.HealthServicer() if health_servicer is None else health_servicer
    names, port = add_services(server, services, health_servicer, address, credentials)
    for name in (*names, *health_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


async def serve_aio(
    config: ServerConfig,
    services: Sequence[tuple[AddServicerFn, Any]],
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    registry: CollectorRegistry | None = None,
    stop_event: asyncio.Event | None = None,
    on_started: Callable[[int], Awaitable[None] | None] | None = None,
    health_names: Sequence[str] = (),
) -> None:
    """Run an asyncio server until SIGTERM/SIGINT (or stop_event), then stop gracefully: health
    NOT_SERVING, in-flight calls get config.grace_s to finish. on_started(port) runs once it
    serves (a coroutine function is awaited). health_names: as create_aio_server's."""
    log = structlog.get_logger("specdec.service")
    health_servicer = health.aio.HealthServicer()
    server, port = await create_aio_server(
        config.address,
        services,
        max_message_bytes=config.max_message_bytes,
        interceptors=interceptors,
        health_servicer=health_servicer,
        credentials=config.server_credentials(),
        health_names=health_names,
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
            metrics_server = start_metrics(config.metrics_port, registry, config.host, config.allowed_hosts)
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
