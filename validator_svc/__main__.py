"""python -m validator_svc: serve the acceptance rule."""

from __future__ import annotations

import os
from typing import Callable

import structlog
import torch
from prometheus_client import CollectorRegistry

from specdec.logging import configure_service_telemetry
from specdec.flags import config_or_exit
from specdec.metrics import RpcMetrics, gauge
from specdec.service.auth import serve_internal, service_token_or_exit
from specdec.v1 import validator_pb2_grpc
from validator_svc.config import ValidatorConfig, parse_config
from validator_svc.kernel import cuda_device_count
from validator_svc.paths import make_path
from validator_svc.server import ValidatorServicer


def build_servicer(
    config: ValidatorConfig, registry: CollectorRegistry, *, device_count: Callable[[], int] = cuda_device_count
) -> ValidatorServicer:
    """Choose the validation path once (paths.make_path), warm it, and say which one serves: in the log
    and as specdec_validation_path{path="cuda"|"torch"} = 1, so a dashboard shows a GPU node that fell
    back to the host rule."""
    path = make_path(config.device, device_count=device_count)
    path.warm_up()
    gauge(
        registry, "validation_path", "The validation path this validator runs (1 on the chosen one's label).", ["path"]
    ).labels(path.name).set(1)
    structlog.get_logger("validator_svc").info("validation path", device=config.device, path=path.name)
    return ValidatorServicer(path)


def main(argv: list[str] | None = None) -> None:
    config = config_or_exit("python -m validator_svc", parse_config, argv)
    configure_service_telemetry("validator_svc", config.log_level, os.environ, "validator")
    service_token = service_token_or_exit(config.service_token_file, config.is_unauthenticated_allowed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    structlog.get_logger("validator_svc").info("starting", device=config.device, num_threads=config.num_threads)
    registry = CollectorRegistry()
    servicer = build_servicer(config, registry)
    serve_internal(
        config.server,
        validator_pb2_grpc.add_ValidatorServiceServicer_to_server,
        servicer,
        service_token,
        RpcMetrics(registry),
        registry=registry,
    )


if __name__ == "__main__":
    main()
