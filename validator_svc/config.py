"""Validator service configuration: flags, with SPECDEC_VALIDATOR_* / SPECDEC_* environment variables as
defaults. The only module of the service that reads os.environ."""

from __future__ import annotations

import argparse
import dataclasses
import os

from specdec.flags import check_num_threads, Flag, listen_flags, log_level_flag, parse_flags, values
from specdec.service.auth import service_token_flags
from specdec.service.server import ServerConfig
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
        check_num_threads(self.num_threads)


FLAGS = (
    *listen_flags(50053),
    Flag("--device", choices=DEVICES),
    Flag("--max_message_bytes", 128 << 20, group="server"),
    log_level_flag(),
    Flag("--num_threads", is_shared=False, help="torch intra-op threads (default 1; 0: torch's default)"),
    *service_token_flags(),
)


def parse_config(argv: list[str] | None = None) -> ValidatorConfig:
    p = argparse.ArgumentParser(prog="python -m validator_svc", description="The acceptance rule over gRPC.")
    a = parse_flags("VALIDATOR", os.environ, FLAGS, {"": ValidatorConfig, "server": ServerConfig}, p, argv)
    return ValidatorConfig(server=ServerConfig(**values(a, FLAGS, "server")), **values(a, FLAGS))
