"""Service identity: a shared secret in call metadata between the internal services.

Primary, draft and validator accept a call only when its metadata carries
`authorization: Bearer <service token>`; anything else gets UNAUTHENTICATED
before the servicer runs. The gateway and the draft pool send the token on
every call through an interceptor on their channels. Health checks stay open
(load balancers and container probes carry no secret, and SERVING tells an
attacker nothing); reflection and every API method need the token.

The token is one line in a file (the launcher writes a fresh one, 0600, per
stack; compose mounts it as a secret); a service warns at start when any user
may read it. Comparison is constant-time (hmac.compare_digest), so the
answer's timing does not reveal a prefix.

    token = read_service_token(path)
    server interceptors: [ServiceTokenInterceptor(token), ErrorInterceptor(...)]
    channel = authenticated_channel(grpc.insecure_channel(address), token)
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import structlog
from prometheus_client import CollectorRegistry

from specdec.flags import Flag, add_flags
from specdec.metrics import RpcMetrics
from specdec.service.flags import Flags
from specdec.service.interceptor import ErrorInterceptor, method_name
from specdec.service.server import AddServicerFn, ServerConfig, exit_if_port_will_not_bind, serve

AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case
BEARER = "Bearer "
# Methods that answer without the token: the standard health service only.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_TOKEN_CHARS = 32  # 128 bits as hex; the launcher writes 256 bits
TOKEN_FILE_MODE = 0o600
TOKEN_FILE_NAME = "service_token"


def service_token_flags(*, is_server: bool = True) -> tuple[Flag, ...]:
    """--service_token_file and --allow_unauthenticated, for every service the same way; they set
    the config fields service_token_file and is_unauthenticated_allowed.

    `is_server`: the token guards this service's port; else it is only sent."""
    role = "every caller must send" if is_server else "the internal services expect"
    return (
        Flag(
            "--service_token_file",
            "",
            help=f"file holding the shared secret {role} (required unless --allow_unauthenticated)",
        ),
        Flag(
            "--allow_unauthenticated",
            False,
            help="accept calls without the service token (a trusted network only)"
            if is_server
            else "call the internal services without the service token",
            field="is_unauthenticated_allowed",
            options={"action": "store_true"},
        ),
    )


def add_service_token_arguments(flags: Flags, *, is_server: bool = True) -> None:
    """The service token's flags on a parser of their own (tools that build one by hand)."""
    add_flags(flags, service_token_flags(is_server=is_server), {})


class ServiceTokenError(ValueError):
    """The token file is missing, unreadable or too short."""


def new_service_token() -> str:
    return secrets.token_hex(32)


def write_service_token(path: Path, token: str | None = None) -> str:
    """Write a (new) token to path, readable by this user only; returns the token."""
    token = new_service_token() if token is None else token
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, TOKEN_FILE_MODE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), TOKEN_FILE_MODE)  # O_CREAT's mode does not apply to an existing file
        f.write(token + "\n")
    return token


def read_service_token(path: str | Path) -> str:
    """The token in path (surrounding whitespace stripped); ServiceTokenError when unusable."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ServiceTokenError(f"service token file {str(path)!r}: {e.strerror}") from None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ServiceTokenError(
            f"service token file {str(path)!r}: the token must be one word of at least "
            f"{MIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)"
        )
    return token


class ServiceTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the service token (UNAUTHENTICATED); install it first. `metrics`:
    each refused call is counted there (specdec_rpc_requests_total{code="UNAUTHENTICATED"}): the
    error mapping after it, which counts the others, never sees it, and a caller with a wrong or
    missing token is what an operator must be able to see."""

    def __init__(self, token: str, metrics: RpcMetrics | None = None) -> None:
        if len(token) < MIN_TOKEN_CHARS:
            raise ServiceTokenError(f"the service token must have at least {MIN_TOKEN_CHARS} characters")
        self._expected = (BEARER + token).encode()
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIXES) or self._is_authorized(
            handler_call_details.invocation_metadata
        ):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if self._metrics is not None:
            self._metrics.requests.labels(method_name(handler_call_details.method), "UNAUTHENTICATED").inc()
        return _refusing(handler)

    def _is_authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == AUTHORIZATION:
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)
        return False


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler that answers UNAUTHENTICATED without reading the request."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> None:
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"missing or wrong service token (metadata '{AUTHORIZATION}: {BEARER.strip()} <token>')",
        )

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    return grpc.stream_stream_rpc_method_handler(refuse, **codec)


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the service token to the metadata of every call."""

    def __init__(self, token: str) -> None:
        (self._entry,) = token_metadata(token)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), self._entry),
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # noqa: ANN001, ANN201
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # noqa: ANN001, ANN201
        return continuation(self._details(client_call_details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(
        self,
        method: str,
        timeout: float | None,
        metadata: tuple,
        credentials: Any,
        wait_for_ready: bool | None,
        compression: Any,
    ) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries the service token (none when token is None: auth is off);
    an asyncio caller (the gateway's grpc.aio stubs) passes it with every call."""
    return () if token is None else ((AUTHORIZATION, BEARER + token),)


def authenticated_channel(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """channel, sending the service token on every call (unchanged when token is None: auth is off)."""
    return channel if token is None else grpc.intercept_channel(channel, _TokenClientInterceptor(token))


def load_service_token(token_file: str, is_unauthenticated_allowed: bool) -> str | None:
    """The token a service runs with: read from token_file; None (no auth) only when explicitly allowed."""
    if token_file:
        return read_service_token(token_file)
    if is_unauthenticated_allowed:
        return None
    raise ServiceTokenError(
        "no service token: give --service_token_file (SPECDEC_SERVICE_TOKEN_FILE), or "
        "--allow_unauthenticated to accept any caller (a trusted network only)"
    )


def internal_interceptors(token: str | None, rpc: RpcMetrics) -> list[grpc.ServerInterceptor]:
    """An internal service's server interceptors: the service token's check first (none without a
    token), which records the calls it refuses in `rpc`, then the error mapping, which records every
    other call there (ErrorInterceptor)."""
    return [*([] if token is None else [ServiceTokenInterceptor(token, rpc)]), ErrorInterceptor(rpc)]


def serve_internal(
    config: ServerConfig,
    add_servicer: AddServicerFn,
    servicer: Any,
    service_token: str | None,
    rpc: RpcMetrics,
    *,
    registry: CollectorRegistry,
    on_stopped: Callable[[], None] | None = None,
) -> None:
    """serve() as an internal service (primary, draft, validator) runs it: its one servicer behind
    the service token's check and the error mapping that records calls in `rpc` (internal_interceptors).
    A port that will not bind exits with its message (code 1), after on_stopped has run."""
    with exit_if_port_will_not_bind():
        serve(
            config,
            [(add_servicer, servicer)],
            interceptors=internal_interceptors(service_token, rpc),
            registry=registry,
            on_stopped=on_stopped,
        )


def service_token_or_exit(token_file: str, is_unauthenticated_allowed: bool) -> str | None:
    """load_service_token for a service's main(): a configuration error exits with its message."""
    try:
        token = load_service_token(token_file, is_unauthenticated_allowed)
    except ServiceTokenError as e:
        raise SystemExit(f"error: {e}") from None
    log = structlog.get_logger("specdec.auth")
    if token is None:
        log.warning("no service token: internal calls are not authenticated (--allow_unauthenticated)")
    elif is_readable_by_others(token_file):
        # Warned, not refused: a Docker Swarm secret is 0444 unless its mode is set, and the
        # token must still be usable there, though any user that reaches the file can read it.
        log.warning(
            "the service token file is readable by any user: chmod 0400 it (0440 where only the "
            "services' user is in its group)",
            file=token_file,
            mode=f"{stat.S_IMODE(os.stat(token_file).st_mode):04o}",
        )
    return token


def is_readable_by_others(path: str | Path) -> bool:
    """Whether the file at path grants read to users outside its owner and group."""
    return bool(os.stat(path).st_mode & stat.S_IROTH)
