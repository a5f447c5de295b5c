"""Validator service configuration: flags, with SPECDEC_VALIDATOR_* / SPECDEC_* environment variables as
defaults. The only module of the service that reads os.environ."""

from __future__ import annotations

import argparse
import dataclasses
import os

from specdec.service.auth import add_service_token_arguments
from specdec.service.flags import Flags
from specdec.service.server import DEFAULT_HOST, ServerConfig
from validator_svc.paths import DEVICES
from specdec.flag_spellings import add_spellings


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


def parse_config(argv: list[str] | None = None) -> ValidatorConfig:
    p = argparse.ArgumentParser(prog="python -m validator_svc", description="The acceptance rule over gRPC.")
    flags = Flags(p, "VALIDATOR", os.environ)
    flags.add("--host", DEFAULT_HOST)
    flags.add("--port", 50053)
    flags.add("--metrics_port", 0)
    flags.add("--device", "auto", choices=DEVICES)
    flags.add("--max_message_bytes", 128 << 20)
    flags.add("--log_level", "INFO")
    flags.add("--num_threads", 1, shared=False, help="torch intra-op threads (default 1; 0: torch's default)")
    add_service_token_arguments(flags)
    a = add_spellings(p).parse_args(argv)
    return ValidatorConfig(
        ServerConfig(host=a.host, port=a.port, metrics_port=a.metrics_port, max_message_bytes=a.max_message_bytes),
        a.device,
        a.log_level,
        a.num_threads,
        a.service_token_file,
        a.allow_unauthenticated,
    )
