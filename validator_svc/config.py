"""Validator service configuration (flags, SPECDEC_VALIDATOR_* / SPECDEC_* env defaults)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from specdec.service.auth import add_service_token_arguments
from specdec.service.server import DEFAULT_HOST, ServerConfig
from validator_svc.paths import DEVICES


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatorConfig:
    server: ServerConfig
    device: str = "auto"  # cuda: the CuPy kernel; cpu: the torch reference; auto: cuda when present (paths.py)
    log_level: str = "INFO"
    # Torch intra-op threads. One: a step's validation is a few small ops on the logits, and every
    # extra thread is an OpenMP worker spinning on the cores the primary's forward needs next.
    num_threads: int = 1
    service_token_file: str = ""  # the shared secret callers must send (specdec.service.auth)
    is_unauthenticated_allowed: bool = False  # serve without a token (a trusted network only)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: torch's default), got {self.num_threads}")


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SPECDEC_VALIDATOR_{name}", os.environ.get(f"SPECDEC_{name}", default))


def parse_config(argv: list[str] | None = None) -> ValidatorConfig:
    p = argparse.ArgumentParser(prog="python -m validator_svc", description="The acceptance rule over gRPC.")
    p.add_argument("--host", default=_env("HOST", DEFAULT_HOST))
    p.add_argument("--port", type=int, default=int(_env("PORT", "50053")))
    p.add_argument("--metrics_port", type=int, default=int(_env("METRICS_PORT", "0")))
    p.add_argument("--device", default=_env("DEVICE", "auto"), choices=DEVICES)
    p.add_argument("--max_message_bytes", type=int, default=int(_env("MAX_MESSAGE_BYTES", str(128 << 20))))
    p.add_argument("--log_level", default=_env("LOG_LEVEL", "INFO"))
    p.add_argument(
        "--num_threads",
        type=int,
        default=int(os.environ.get("SPECDEC_VALIDATOR_NUM_THREADS", "1")),
        help="torch intra-op threads (default 1; 0: torch's default)",
    )
    add_service_token_arguments(p, _env)
    a = p.parse_args(argv)
    return ValidatorConfig(
        ServerConfig(host=a.host, port=a.port, metrics_port=a.metrics_port, max_message_bytes=a.max_message_bytes),
        a.device,
        a.log_level,
        a.num_threads,
        a.service_token_file,
        a.allow_unauthenticated,
    )
