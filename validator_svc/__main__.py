"""python -m validator_svc: serve the acceptance rule."""
from __future__ import annotations

import structlog
import torch
from prometheus_client import CollectorRegistry

from specdec.logging import configure_logging
from specdec.metrics import ServiceMetrics
from specdec.service.auth import service_token_or_exit, token_interceptors
from specdec.service.interceptor import ErrorInterceptor
from specdec.service.server import serve
from specdec.v1 import validator_pb2_grpc
from validator_svc.config import parse_config
from validator_svc.server import ValidatorServicer


def main(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    configure_logging("validator_svc", level=config.log_level)
    service_token = service_token_or_exit(config.service_token_file, config.is_unauthenticated_allowed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    structlog.get_logger("validator_svc").info("starting", device=config.device, num_threads=config.num_threads)
    registry = CollectorRegistry()
    serve(config.server, [(validator_pb2_grpc.add_ValidatorServiceServicer_to_server, ValidatorServicer())],
          interceptors=[*token_interceptors(service_token), ErrorInterceptor(ServiceMetrics(registry))],
          registry=registry)


if __name__ == "__main__":
    main()
