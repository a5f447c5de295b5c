"""Service infrastructure shared by the four services: server construction,
graceful shutdown, health, reflection and the error-mapping interceptor."""

from __future__ import annotations

from specdec.service.health import check_health, wait_for_serving
from specdec.service.interceptor import ErrorInterceptor, method_name
from specdec.service.server import (
    DEFAULT_GRACE_S,
    DEFAULT_HOST,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_WORKERS,
    ServerConfig,
    create_server,
    serve,
)

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_HOST",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_WORKERS",
    "ErrorInterceptor",
    "ServerConfig",
    "check_health",
    "create_server",
    "method_name",
    "serve",
    "wait_for_serving",
]
