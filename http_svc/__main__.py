"""python -m http_svc: the OpenAI-compatible HTTP API in front of the gateway's gRPC API."""

from __future__ import annotations

import os
import structlog
import uvicorn
from prometheus_client import CollectorRegistry

from specdec.service.api_keys import ApiKeys
from http_svc.app import HttpFront
from http_svc.config import parse_config
from specdec.logging import configure_service_telemetry
from specdec.flags import config_or_exit
from specdec.service.server import exit_if_port_will_not_bind, start_metrics

# In-flight answers get this long to finish after SIGTERM (the gRPC services drain for 5 s too).
GRACEFUL_STOP_S = 5


def main(argv: list[str] | None = None) -> None:
    config = config_or_exit("python -m http_svc", parse_config, argv)
    configure_service_telemetry("http", config.log_level, os.environ)
    log = structlog.get_logger("http")
    try:
        api_keys = ApiKeys.from_file(config.api_keys_file) if config.api_keys_file else None
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --api_keys_file: {e}") from None
    registry = CollectorRegistry()
    front = HttpFront(config, api_keys, registry)
    if config.metrics_port:
        with exit_if_port_will_not_bind():
            start_metrics(config.metrics_port, registry, config.host, config.allowed_hosts)
    log.info(
        "http ready",
        host=config.host,
        port=config.port,
        gateway=config.gateway_address,
        model=config.model_name,
        tls=config.is_tls,
        api_keys=api_keys is not None,
    )
    uvicorn.run(
        front.app(),
        host=config.host,
        port=config.port,
        ssl_certfile=config.tls_cert_file or None,
        ssl_keyfile=config.tls_key_file or None,
        log_config=None,
        access_log=True,  # through the root handler: JSON, with the request's client_request_id
        timeout_graceful_shutdown=GRACEFUL_STOP_S,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
