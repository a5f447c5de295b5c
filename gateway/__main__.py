"""python -m gateway: the public GenerationService, backed by primary, draft, validator and the state store."""

from __future__ import annotations

import os
import asyncio
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import structlog
import torch
from prometheus_client import CollectorRegistry

from specdec.service.api_keys import ApiKeys
from gateway.backends import Backends, ModelInfo
from gateway.config import GatewayConfig, parse_config
from gateway.node_pool import NodePool
from gateway.nodes import NodeAddress
from gateway.owner_health import health_check
from gateway.owner_id import OwnerId, default_advertise_address
from gateway.owner_probe import OwnerProbe
from gateway.server import GenerationServicer
from specdec.errors import Unavailable
from specdec.logging import configure_service_telemetry
from specdec.flags import config_or_exit
from gateway.metrics import GatewayMetrics
from specdec.model.loader import resolve_model_dir
from specdec.model.tokenizer import Tokenizer
from specdec.service.auth import service_token_or_exit
from specdec.service.aio import AioErrorInterceptor, serve_aio
from specdec.service.server import exit_if_port_will_not_bind
from specdec.service.gc_tuning import freeze_startup_heap
from specdec.state_store import StateStoreConfig, open_async_state_store
from specdec.state_store.redis_url import parse_redis_url
from specdec.v1 import gateway_pb2_grpc

MODEL_INFO_TIMEOUT_S = 600.0
LOOP_STOP_TIMEOUT_S = 10.0  # at shutdown, for running loops to stop within a step and store their end


def main(argv: list[str] | None = None) -> None:
    config = config_or_exit("python -m gateway", parse_config, argv)
    configure_service_telemetry("gateway", config.log_level, os.environ)
    service_token = service_token_or_exit(config.service_token_file, config.is_unauthenticated_allowed)
    try:
        api_keys = ApiKeys.from_file(config.api_keys_file) if config.api_keys_file else None
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --api_keys_file: {e}") from None
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    tokenizer = Tokenizer.from_dir(
        resolve_model_dir(config.model_path, config.cache_dir, show_progress=sys.stderr.isatty())
    )
    with exit_if_port_will_not_bind():  # its clients and the state store are closed by then
        asyncio.run(serve(config, tokenizer, service_token, api_keys))


def _log_ready(log, config: GatewayConfig, nodes: NodePool | None, api_keys: ApiKeys | None, max_context: int) -> None:
    """The gateway's ready line: where it sends requests, TLS, tenants and its state store."""
    log.info(
        "gateway ready",
        primary=config.primary_address if nodes is None else None,
        draft=config.draft_address if nodes is None else None,
        validator=config.validator_address if nodes is None else None,
        nodes=None if nodes is None else list(nodes.listed),
        tls=config.server.is_tls,
        tenants=None if api_keys is None else sorted(api_keys.tenants),
        state_store=f"redis ({parse_redis_url(config.redis_url).kind})" if config.redis_url else "in-process",
        max_context=max_context,
    )


async def serve(
    config: GatewayConfig, tokenizer: Tokenizer, service_token: str | None, api_keys: ApiKeys | None
) -> None:
    """Connect to the services and the state store (inside the event loop that uses them: gRPC aio
    channels and redis.asyncio connections belong to one loop), then serve until SIGTERM/SIGINT."""
    log = structlog.get_logger("gateway")
    make_backends = _backends_factory(config, service_token)
    nodes = None if config.nodes is None else NodePool(config.nodes, make_backends, config.node_pool)
    backends = None
    if nodes is None:
        backends = make_backends(NodeAddress(config.primary_address, config.draft_address, config.validator_address))
    store = open_async_state_store(
        config.redis_url,
        StateStoreConfig(ttl_s=config.state_ttl_s, lease_s=config.owner_lease_s),
        timeout_s=config.state_timeout_s,
    )
    servicer = None
    try:
        if nodes is not None:
            await nodes.start()
        backends, model = await _model_info(backends, nodes)
        owner = OwnerId.new(_advertise_address(config, config.server.port))
        registry = CollectorRegistry()
        metrics = GatewayMetrics(registry)
        servicer = GenerationServicer(
            config,
            backends,
            store,
            tokenizer,
            model,
            str(owner),
            metrics,
            api_keys=api_keys,
            nodes=nodes,
            owner_probe=OwnerProbe(health_check(_peer_credentials(config))),
        )
        _log_ready(log, config, nodes, api_keys, model.max_context)
        freeze_startup_heap()  # the tokenizer, grammars and clients stay out of every collection while serving
        # An asyncio server: open streams and requests hold no thread (gateway.server).
        await serve_aio(
            config.server,
            [(gateway_pb2_grpc.add_GenerationServiceServicer_to_server, servicer)],
            interceptors=[AioErrorInterceptor(metrics.rpc)],
            registry=registry,
            on_started=_resumer(config, servicer, owner, log),
            health_names=[owner.instance_health_name],
        )
    finally:
        await _close(config, servicer, nodes, backends, store)


def _backends_factory(config: GatewayConfig, service_token: str | None) -> Callable[[NodeAddress], Backends]:
    """A node's addresses -> the clients of its three services."""

    def make_backends(node: NodeAddress) -> Backends:
        return Backends(
            node.primary_address,
            node.draft_address,
            node.validator_address,
            config.rpc_timeout_s,
            config.server.max_message_bytes * 32,
            config.is_logits_via_handle,
            service_token=service_token,
        )

    return make_backends


def _resumer(
    config: GatewayConfig, servicer: GenerationServicer, owner: OwnerId, log: Any
) -> Callable[[int], Awaitable[None]]:
    """What runs once the server listens on its port: the owner id names that port, then (with a
    shared store) the requests of gateways that are gone go on here and the leases are kept."""

    async def resume(port: int) -> None:
        # Bound to port 0 (tests): the address names the port the server got. Nothing ran yet:
        # this runs on the server's event loop before its first call is served.
        servicer.owner = str(OwnerId(_advertise_address(config, port), owner.nonce))
        log.info("gateway owner id", owner=servicer.owner)
        if config.redis_url:
            await servicer.resume_active()
            servicer.start_keeping_leases()

    return resume


async def _close(
    config: GatewayConfig,
    servicer: GenerationServicer | None,
    nodes: NodePool | None,
    backends: Backends | None,
    store: Any,
) -> None:
    """Stop every loop (each stores its end), then close the clients under them."""
    if servicer is not None:
        await servicer.stop_loops(max(config.server.grace_s, LOOP_STOP_TIMEOUT_S))
        servicer.grammars.close()
    if nodes is not None:
        await nodes.close()
    elif backends is not None:
        await backends.close()
    await store.close()


def _advertise_address(config: GatewayConfig, port: int) -> str:
    """--advertise_address, else where the server listens (gateway.owner_id.default_advertise_address)."""
    return config.advertise_address or default_advertise_address(config.server.host, port, socket.gethostname())


def _peer_credentials(config: GatewayConfig) -> grpc.ChannelCredentials | None:
    """How this gateway reaches the others' health services: plaintext, or TLS trusting the chain
    it serves itself (gateways of one deployment share their certificate or its CA; the
    certificate must name the advertised addresses)."""
    if not config.server.is_tls:
        return None
    with open(config.server.tls_cert_file, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


async def _model_info(backends: Backends | None, nodes: NodePool | None) -> tuple[Backends, ModelInfo]:
    """The model (GetModelInfo) from the one node's primary, or from the first of --nodes' that
    answers, and that node's backends (the servicer asks its draft pool for the strategies); waits
    up to MODEL_INFO_TIMEOUT_S for one to answer (primaries load their model at start)."""
    give_up = time.monotonic() + MODEL_INFO_TIMEOUT_S
    while True:
        node = None if nodes is None else nodes.first()
        asked = backends if node is None else node.backends
        if node is not None:  # held for good: the servicer asks its draft pool, listed or not
            node.hold()
        try:
            if asked is not None:
                return asked, await asked.model_info()
        except Unavailable:
            pass
        if node is not None:
            await node.let_go()
        if time.monotonic() > give_up:
            raise Unavailable("primary", f"no primary answered GetModelInfo within {MODEL_INFO_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.5)
        if nodes is not None:
            await nodes.resolve()
            await nodes.check()


if __name__ == "__main__":
    main()
