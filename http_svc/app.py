"""The HTTP routes: an OpenAI-shaped request -> one gateway gRPC call -> an OpenAI-shaped answer.

Starlette on uvicorn rather than FastAPI: the routes take raw bodies, because the errors must
be OpenAI's (400 naming the parameter, from the gateway's own checks), not pydantic's 422; that
leaves FastAPI nothing to do but add a layer per request.

A client that goes away cancels its gRPC call, at any point: while the gateway prefills or
generates a non-streamed answer (a task watches the connection), or mid-stream (the response
cancels the call when it ends, however it ends). The gateway stops the request within a step
and the primary frees its KV cache. Each such client, and one that leaves before its body has
arrived, counts in specdec_http_client_disconnects_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specdec.service.api_keys import AUTHORIZATION, ApiKeys
from specdec.service.server import DEFAULT_MAX_MESSAGE_BYTES
from http_svc.allowed_hosts import AllowedHostsMiddleware
from http_svc.config import HttpConfig
from http_svc.errors import ApiError, from_rpc_error
from http_svc.metrics import HttpMetrics
from http_svc.request_context import RequestContextMiddleware, client_request_id_header
from http_svc.openai_request import (
    CHAT,
    COMPLETION,
    IGNORED_FIELDS_HEADER,
    ParsedRequest,
    ignored_fields_header,
    parse_body,
    parse_request,
)
from http_svc.tokenizer_request import parse_detokenize, parse_tokenize
from http_svc.openai_response import ChunkWriter, completion, error_event, summed_stats
from specdec.errors import InvalidArgument, Unauthenticated, quoted
from specdec.tracing import aio_channel_interceptors, check_client_request_id, is_tracing_on, outgoing_metadata
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

GATEWAY_HEALTH_SERVICE = "specdec.v1.GenerationService"
HEALTH_TIMEOUT_S = 2.0
REQUEST_ID_HEADER = "x-request-id"
ID_PREFIXES = {CHAT: "chatcmpl", COMPLETION: "cmpl"}
ENDPOINTS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}
# Reconnect to a restarted gateway within a second (gRPC's default backoff grows to two minutes).
# Receive what the gateway may send (a whole answer with log probabilities can pass gRPC's default
# 4 MiB): past the limit the call fails RESOURCE_EXHAUSTED, which would read as a 429 to retry.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
)


# The bodies a web page may POST to another site without the browser asking it first (CORS "simple"
# requests): a front without API keys on loopback would otherwise run whatever a visited page sends.
# JSON bodies come with their type (the SDKs, `curl -H 'Content-Type: application/json'`) or none;
# a page's body without a type (a Blob) is refused by its Origin (http_svc.allowed_hosts).
_CROSS_SITE_MEDIA_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})


class _Cancellable(Protocol):
    def cancel(self) -> bool: ...


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class HttpFront:
    """The routes and their state: one gRPC channel to the gateway (opened on the server's loop)."""

    def __init__(
        self, config: HttpConfig, api_keys: ApiKeys | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        self.config, self.api_keys = config, api_keys
        self.metrics = HttpMetrics(
            CollectorRegistry() if registry is None else registry, service_restarts_file=config.service_restarts_file
        )
        self.created = int(time.time())
        self.log = structlog.get_logger("http")
        self._channel: grpc.aio.Channel | None = None
        self.stub: gateway_pb2_grpc.GenerationServiceStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._model_info: gateway_pb2.DescribeModelResponse | None = None

    # --- the application ------------------------------------------------------------------------

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        return Starlette(
            routes=routes,
            lifespan=self._lifespan,
            # Outermost first: without API keys, the Host check (http_svc.allowed_hosts); a span per
            # request (W3C traceparent in, read by the gateway's call), then the client's X-Request-Id
            # bound for the request's log lines.
            middleware=[
                *self._allowed_hosts_middleware(),
                *self._tracing_middleware(),
                Middleware(RequestContextMiddleware),
            ],
            # Starlette calls each handler with instances of its key's class; its type says any
            # Exception, so the narrower handlers need the ignore.
            exception_handlers={
                ApiError: _api_error,  # type: ignore[dict-item]
                HTTPException: _http_error,  # type: ignore[dict-item]
                ClientDisconnect: _client_gone,
                Exception: _internal,
            },
        )

    def _allowed_hosts_middleware(self) -> list[Middleware]:
        """Without API keys, a 403 to a request whose Host is neither loopback nor an --allowed_hosts
        one (DNS rebinding); with keys a page cannot send the user's key, and nothing to check."""
        if self.api_keys is not None:
            return []
        return [Middleware(AllowedHostsMiddleware, allowed_hosts=self.config.allowed_hosts)]

    @staticmethod
    def _tracing_middleware() -> list[Middleware]:
        """A span per request (W3C traceparent in and on to the gateway) while tracing is on."""
        if not is_tracing_on():
            return []
        return [Middleware(OpenTelemetryMiddleware, excluded_urls="health,metrics", exclude_spans=["receive", "send"])]

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        if self.config.gateway_ca_file:
            with open(self.config.gateway_ca_file, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.aio.secure_channel(
                self.config.gateway_address, credentials, CHANNEL_OPTIONS, interceptors=aio_channel_interceptors()
            )
        else:
            self._channel = grpc.aio.insecure_channel(
                self.config.gateway_address, CHANNEL_OPTIONS, interceptors=aio_channel_interceptors()
            )
        self.stub = gateway_pb2_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        try:
            yield
        finally:
            await self._channel.close()

    # --- routes -----------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETION)

    async def models(self, request: Request) -> Response:
        self._check_key(request)
        return JSONResponse({"object": "list", "data": [await self._model_card(request)]})

    async def model(self, request: Request) -> Response:
        self._check_key(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(await self._model_card(request))

    # --- the tokenizer (vLLM's shapes) --------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """{"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens", "token_strs"}."""
        self._check_key(request)
        body = parse_body(await self._body(request))
        tokenize, is_returning_strs = parse_tokenize(body)
        if body.get("model") is not None:
            self._check_model(body["model"])
        answer = await self._gateway_call(request, "Tokenize", tokenize, {"chat.messages": "messages"})
        return JSONResponse(
            {
                "count": len(answer.token_ids),
                "max_model_len": answer.max_model_len,
                "tokens": list(answer.token_ids),
                "token_strs": list(answer.token_texts) if is_returning_strs else None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        """{"tokens": [ids]} -> {"prompt": str}."""
        self._check_key(request)
        body = parse_body(await self._body(request))
        detokenize = parse_detokenize(body)
        if body.get("model") is not None:
            self._check_model(body["model"])
        answer = await self._gateway_call(request, "Detokenize", detokenize, {"token_ids": "tokens"})
        return JSONResponse({"prompt": answer.text})

    async def tokenizer_info(self, request: Request) -> Response:
        """The tokenizer's special tokens, chat template and context length (what lm-eval-harness's
        remote tokenizer reads)."""
        self._check_key(request)
        info = await self._describe_model(request)
        return JSONResponse(
            {
                **dict(info.special_tokens),
                "chat_template": info.chat_template or None,
                "model_max_length": info.max_model_len,
                "vocab_size": info.vocab_size,
                "eos_token_ids": list(info.eos_token_ids),
            }
        )

    async def _gateway_call(self, request: Request, method: str, message: Any, aliases: dict[str, str]) -> Any:
        assert self.stub is not None  # the lifespan connects before any request is served
        call = getattr(self.stub, method)(
            message, metadata=self._metadata(request), timeout=self.config.request_timeout_s
        )
        try:
            return await call
        except grpc.RpcError as e:
            raise from_rpc_error(e, aliases, self.config.default_retry_after_s) from None

    async def _describe_model(self, request: Request) -> gateway_pb2.DescribeModelResponse:
        """The served model's description, asked of the gateway once (it does not change) when this
        front checks keys itself; without --api_keys_file, at every call: the gateway's answer is
        where a caller's key is checked, so one caller's answer must not serve another."""
        if self._model_info is not None:
            return self._model_info
        info = await self._gateway_call(request, "DescribeModel", gateway_pb2.DescribeModelRequest(), {})
        if self.api_keys is not None:
            self._model_info = info
        return info

    async def health(self, _request: Request) -> Response:
        """200 when the gateway reports SERVING (grpc.health.v1), else 503: what a probe needs."""
        assert self._health is not None  # the lifespan connects before any request is served
        try:
            answer = await self._health.Check(
                health_pb2.HealthCheckRequest(service=GATEWAY_HEALTH_SERVICE), timeout=HEALTH_TIMEOUT_S
            )
            gateway = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        except grpc.RpcError as e:
            gateway = e.code().name if hasattr(e, "code") else "UNKNOWN"
        is_ok = gateway == "SERVING"
        return JSONResponse(
            {"status": "ok" if is_ok else "unavailable", "gateway": gateway}, status_code=200 if is_ok else 503
        )

    async def prometheus(self, _request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- generation -------------------------------------------------------------------------------

    async def _generate(self, request: Request, kind: str) -> Response:
        started = time.perf_counter()
        endpoint = ENDPOINTS[kind]
        status, is_stream, aliases, response_id = 500, False, {}, ""
        try:
            self._check_key(request)
            parsed = parse_request(parse_body(await self._body(request)), kind)
            is_stream, aliases = parsed.is_stream, parsed.param_aliases
            if parsed.unknown_fields:  # accepted, as vLLM accepts them, but never silently
                self.log.warning(
                    "request fields ignored", endpoint=endpoint, fields=ignored_fields_header(parsed.unknown_fields)
                )
            self._check_model(parsed.model)
            response_id = f"{ID_PREFIXES[kind]}-{uuid.uuid4().hex}"
            _set_request_ids(parsed, response_id)
            echoed_id = self._client_request_id(request) or response_id
            metadata = outgoing_metadata(self._metadata(request))
            call_args = {"metadata": metadata, "timeout": self.config.request_timeout_s}
            echo_texts = await self._echo_texts(request, parsed)
            if parsed.is_stream:
                response = await self._stream(
                    request, parsed, response_id, call_args, started, echo_texts[0], echoed_id
                )
            else:
                answers = await self._answers(request, parsed, call_args)
                self._count_tokens(summed_stats([a.stats for a in answers], parsed.num_choices))
                response = JSONResponse(
                    completion(parsed, response_id, int(time.time()), self.config.model_name, answers, echo_texts),
                    headers=_headers(parsed, echoed_id),
                )
            status = response.status_code
            return response
        except ApiError as e:
            status = e.status
            raise
        except grpc.RpcError as e:
            error = from_rpc_error(e, aliases, self.config.default_retry_after_s)
            status = error.status
            if status >= 500:
                self.log.warning(
                    "gateway call failed",
                    request_id=response_id,
                    status=status,
                    code=e.code().name if hasattr(e, "code") else "UNKNOWN",
                )
            raise error from None
        except (ClientGone, ClientDisconnect):  # ClientDisconnect: gone while its body was read
            status = 499  # nginx's "client closed request": nobody reads the answer
            self.metrics.disconnects.inc()
            return Response(status_code=499)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if not (status == 200 and is_stream):  # a stream's time is observed at its end
                self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    async def _answers(
        self, request: Request, parsed: ParsedRequest, call_args: dict
    ) -> list[gateway_pb2.GenerateResponse]:
        """Every choice's answer, their requests run side by side; one that fails fails the whole
        (the others are cancelled)."""
        assert self.stub is not None  # the lifespan connects before any request is served
        calls = [self.stub.Generate(r, **call_args) for r in parsed.requests]
        everything = asyncio.gather(*calls)
        try:
            return await self._unless_gone(request, everything, _Calls(calls))
        except BaseException:
            for call in calls:
                call.cancel()
            raise

    async def _echo_texts(self, request: Request, parsed: ParsedRequest) -> list[str]:
        """With `echo`, each prompt's text (token ids decoded by the gateway, special tokens spelled
        out as a text prompt holds them, and as its tokens' log probabilities name them); else empty
        strings."""
        prompts = parsed.prompt_requests
        if not parsed.is_echo:
            return [""] * len(prompts)
        texts = []
        for i, r in enumerate(prompts):
            if r.WhichOneof("input") == "prompt":
                texts.append(r.prompt)
                continue
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            answer = await self._gateway_call(
                request,
                "Detokenize",
                gateway_pb2.DetokenizeRequest(token_ids=r.token_ids.ids, include_special_tokens=True),
                {"token_ids": param},
            )
            texts.append(answer.text)
        return texts

    async def _stream(
        self,
        request: Request,
        parsed: ParsedRequest,
        response_id: str,
        call_args: dict,
        started: float,
        echo_text: str,
        echoed_id: str,
    ) -> Response:
        """The first message of every choice is awaited before the status line, so that a refused
        request (bad parameter, no capacity) still gets its HTTP status; later failures become an
        error event."""
        assert self.stub is not None  # the lifespan connects before any request is served
        calls = [self.stub.GenerateStream(r, **call_args) for r in parsed.requests]
        try:
            firsts = await self._unless_gone(request, asyncio.gather(*(c.read() for c in calls)), _Calls(calls))
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        if any(first is grpc.aio.EOF for first in firsts):
            for call in calls:
                call.cancel()
            raise ApiError(502, "the gateway ended the stream without an answer", "server_error")
        created, model = int(time.time()), self.config.model_name
        writers = [
            ChunkWriter(parsed, response_id, created, model, echo_text, index=i, is_closing=len(calls) == 1)
            for i in range(len(calls))
        ]
        endpoint = ENDPOINTS[parsed.kind]
        self.metrics.first_event.labels(endpoint).observe(time.perf_counter() - started)
        if len(calls) == 1:
            events = self._events(calls[0], firsts[0], writers[0])
        else:
            events = self._choices_events(calls, firsts, writers)
        return _CallStreamingResponse(
            self._observed(events, parsed, endpoint, started),
            _Calls(calls),
            self.metrics.disconnects.inc,
            media_type="text/event-stream",
            headers={**_headers(parsed, echoed_id), "cache-control": "no-cache"},
        )

    async def _observed(
        self, events: AsyncIterator[bytes], parsed: ParsedRequest, endpoint: str, started: float
    ) -> AsyncIterator[bytes]:
        """A stream's events, counted as active while they last and timed to their end; a gateway
        failure after the first events becomes an error event."""
        self.metrics.active.inc()
        try:
            async for event in events:
                yield event
        except grpc.RpcError as e:
            yield error_event(from_rpc_error(e, parsed.param_aliases, self.config.default_retry_after_s).to_json())
        finally:
            self.metrics.active.dec()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)

    async def _events(
        self, call: grpc.aio.UnaryStreamCall, first: gateway_pb2.GenerateStreamResponse, writer: ChunkWriter
    ) -> AsyncIterator[bytes]:
        """One choice's stream."""
        message = first
        while True:
            yield writer.step(message)
            if message.is_final:
                self._count_tokens(message.stats)
                return
            message = await call.read()
            if message is grpc.aio.EOF:
                return

    async def _choices_events(
        self,
        calls: list[grpc.aio.UnaryStreamCall],
        firsts: list[gateway_pb2.GenerateStreamResponse],
        writers: list[ChunkWriter],
    ) -> AsyncIterator[bytes]:
        """Several choices' streams, their chunks interleaved as their messages arrive (each with its
        choice's index); once every choice has ended, the usage of all of them (a prompt counted
        once) and [DONE]."""
        finals: dict[int, gateway_pb2.GenerationStats] = {}
        reads: dict[asyncio.Future, int] = {}

        def take(i: int, message: Any) -> bytes:
            if message is grpc.aio.EOF:
                finals.setdefault(i, gateway_pb2.GenerationStats())
                return b""
            if message.is_final:
                finals[i] = message.stats
            else:
                reads[asyncio.ensure_future(calls[i].read())] = i
            return writers[i].step(message)

        try:
            for i, first in enumerate(firsts):
                yield take(i, first)
            while reads:
                done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
                for read in done:
                    yield take(reads.pop(read), read.result())
        finally:
            for read in reads:
                read.cancel()
        stats = summed_stats([finals[i] for i in range(len(calls))], writers[0].parsed.num_choices)
        self._count_tokens(stats)
        yield writers[0].closing(stats)

    async def _unless_gone(self, request: Request, awaitable: Awaitable[Any], call: _Cancellable) -> Any:
        """awaitable's result; ClientGone (and the call cancelled) if the client disconnects first."""
        answer = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(_disconnected(request))
        self.metrics.active.inc()
        try:
            await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.metrics.active.dec()
            gone.cancel()
        if not answer.done():
            call.cancel()
            answer.cancel()
            raise ClientGone()
        return answer.result()

    # --- helpers ----------------------------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        if self.api_keys is None:
            return
        try:
            self.api_keys.tenant([(AUTHORIZATION, request.headers.get(AUTHORIZATION, ""))])
        except Unauthenticated:
            raise ApiError(
                401, "a valid API key is required (header 'Authorization: Bearer <key>')", "authentication_error"
            ) from None

    def _check_model(self, model: str) -> None:
        if model != self.config.model_name:
            raise ApiError(
                404,
                f"the model {quoted(model)} does not exist; this server serves {self.config.model_name!r} "
                "(GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def _model_card(self, request: Request) -> dict:
        """The model's card; `max_model_len` from the gateway, left out while it cannot be reached (the
        list still answers: a front's probe may read it before its gateway is up)."""
        card = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "specdec"}
        try:
            card["max_model_len"] = (await self._describe_model(request)).max_model_len
        except ApiError as e:
            if e.status < 500:  # the caller's own fault (a key the gateway refuses): theirs to hear
                raise
        return card

    @staticmethod
    def _client_request_id(request: Request) -> str:
        """The client's X-Request-Id ("" without one): echoed in the response, sent to the gateway
        (RequestContextMiddleware binds it); a malformed one is a 400 naming the header."""
        value = client_request_id_header(request.scope)
        if value is None:
            return ""
        try:
            return check_client_request_id(value, "X-Request-Id")
        except InvalidArgument as e:
            raise ApiError(400, str(e), "invalid_request_error", param="X-Request-Id") from None

    @staticmethod
    def _metadata(request: Request) -> tuple[tuple[str, str], ...]:
        """The caller's key, as the gateway reads it (gRPC metadata `authorization: Bearer <key>`)."""
        value = request.headers.get(AUTHORIZATION)
        return ((AUTHORIZATION, value),) if value and value.isascii() and value.isprintable() else ()

    async def _body(self, request: Request) -> bytes:
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type in _CROSS_SITE_MEDIA_TYPES:
            raise ApiError(
                415,
                f"the request body must be JSON (Content-Type: application/json), got {media_type}",
                "invalid_request_error",
            )
        limit = self.config.max_body_bytes
        too_large = ApiError(413, f"the request body is larger than {limit} bytes", "invalid_request_error")
        length = request.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _count_tokens(self, stats: gateway_pb2.GenerationStats) -> None:
        self.metrics.tokens.labels("prompt").inc(stats.num_prompt_tokens)
        self.metrics.tokens.labels("completion").inc(stats.num_generated_tokens)


class _Calls:
    """Several calls cancelled as one (what _unless_gone cancels when the client goes away)."""

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def cancel(self) -> bool:
        return all([call.cancel() for call in self.calls])


class _CallStreamingResponse(StreamingResponse):
    """A streamed answer that cancels its gRPC call when it ends, however it ends (a finished
    call ignores the cancel): a client that disconnects mid-stream stops its request, and
    on_disconnect() counts it."""

    def __init__(
        self, content: AsyncIterator[bytes], call: _Cancellable, on_disconnect: Callable[[], None], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._call, self._on_disconnect = call, on_disconnect
        self._is_sent = False

    async def stream_response(self, send) -> None:
        await super().stream_response(send)
        self._is_sent = True

    async def listen_for_disconnect(self, receive) -> None:
        # ASGI servers before spec 2.4 (uvicorn's HTTP/1.1): this returns when the client went away,
        # and also when the stream has just ended: uvicorn answers http.disconnect once the response
        # is complete, and the wake-up beats the stream's cancel of this. Only the former counts.
        await super().listen_for_disconnect(receive)
        if not self._is_sent:
            self._on_disconnect()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # spec 2.4 servers: a send to a closed connection; nobody to answer
            self._on_disconnect()
        finally:
            self._call.cancel()


def _set_request_ids(parsed: ParsedRequest, response_id: str) -> None:
    """The gateway's request ids: the response id, or `<response id>-<choice index>` when there
    are several choices (prompts or n)."""
    if len(parsed.requests) == 1:
        parsed.request.request_id = response_id
        return
    for i, r in enumerate(parsed.requests):
        r.request_id = f"{response_id}-{i}"


def _headers(parsed: ParsedRequest, response_id: str) -> dict[str, str]:
    """An answer's headers: its id, and the body's fields that had no effect (when any)."""
    headers = {REQUEST_ID_HEADER: response_id}
    if parsed.ignored_fields:
        headers[IGNORED_FIELDS_HEADER] = ignored_fields_header(parsed.ignored_fields)
    return headers


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _api_error(_request: Request, error: ApiError) -> Response:
    return JSONResponse(error.to_json(), status_code=error.status, headers=dict(error.headers))


async def _http_error(_request: Request, error: HTTPException) -> Response:
    return JSONResponse(
        ApiError(error.status_code, str(error.detail), "invalid_request_error").to_json(),
        status_code=error.status_code,
        headers=error.headers,
    )


async def _client_gone(_request: Request, _error: Exception) -> Response:
    """A client gone while its body was read (/tokenize, /detokenize; generations count theirs in
    _generate): nobody reads an answer, and it is no internal error to log."""
    return Response(status_code=499)


async def _internal(_request: Request, error: Exception) -> Response:
    structlog.get_logger("http").exception("internal error", error_type=type(error).__name__)
    return JSONResponse(
        ApiError(500, f"internal error ({type(error).__name__}); see the server log", "server_error").to_json(),
        status_code=500,
    )
