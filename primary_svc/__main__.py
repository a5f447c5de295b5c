"""python -m primary_svc: load the model (into shared memory), serve PrimaryService."""

from __future__ import annotations

import os
import sys
import threading
import uuid
from pathlib import Path

import structlog
import torch
from prometheus_client import CollectorRegistry

from primary_svc.autotune import (
    FLOAT_CANDIDATES,
    choose_precision_or_fallback,
    quantized_candidates,
    token_products_vectorized,
)
from primary_svc.config import PrimaryConfig, max_prefill_calls, parse_config
from primary_svc.costs import measure_verify_costs
from primary_svc.leases import KVLeases
from primary_svc.run_grammars import RunGrammars
from primary_svc.server import ModelIdentity, PrimaryServicer
from primary_svc.worker import EngineWorker
from specdec.answers import DEFAULT_ANSWERS, AnswerIndex, AnswersFileError, LearnedAnswers, load_answers
from specdec.engine.background_compile import BackgroundCompiler
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.prefix_cache import PrefixCache
from specdec.engine.loading import LoadedModel, load_model
from specdec.logging import configure_service_telemetry
from specdec.flags import config_or_exit
from specdec.logits_shm import cleanup_stale_slots
from primary_svc.metrics import PrimaryMetrics
from specdec.model.fingerprint import model_fingerprint
from specdec.model.compiled import CompiledStep, CompileSettings
from specdec.model.layout import count_layouts
from specdec.model.linear import calibrate_min_gemm_rows
from specdec.model.llama import Transformer
from specdec.model.loader import load_config, resolve_model_dir
from specdec.model import native
from specdec.model.options import AUTO
from specdec.grammar import GrammarCache, GrammarTokenizerInfo
from specdec.model.tokenizer import Tokenizer
from specdec.service.auth import serve_internal, service_token_or_exit
from specdec.service.gc_tuning import freeze_startup_heap
from specdec.progress import ProgressCallback, no_progress, progress_callback
from specdec.v1 import primary_pb2_grpc

LEASE_CHECK_MAX_S = 5.0


def _servicer(
    config: PrimaryConfig,
    loaded: LoadedModel,
    worker: EngineWorker,
    identity: ModelIdentity,
    metrics: PrimaryMetrics,
    tokenizer: Tokenizer,
) -> PrimaryServicer:
    """The service over the loaded model: KV leases, run grammars, the run answers file and the
    learned answers as the flags say."""
    return PrimaryServicer(
        loaded,
        worker,
        identity,
        config.max_kv_bytes,
        metrics,
        KVLeases(config.kv_lease_s, takeover_s=config.kv_takeover_s),
        start_grammars(tokenizer, loaded),
        load_run_answers(config.run_answers, loaded, worker),
        tokenizer,
        LearnedAnswers(config.learned_answer_tokens) if config.learned_answer_tokens else None,
        max_prefills=max_prefill_calls(config.max_batch),
    )


def main(argv: list[str] | None = None) -> None:
    config = config_or_exit("python -m primary_svc", parse_config, argv)
    configure_service_telemetry("primary_svc", config.log_level, os.environ, "primary")
    log = structlog.get_logger("primary_svc")
    service_token = service_token_or_exit(config.service_token_file, config.is_unauthenticated_allowed)
    on_progress = progress_callback(config.progress_file)
    model_dir = resolve_model_dir(
        config.model_path, config.cache_dir, show_progress=sys.stderr.isatty(), on_progress=on_progress
    )
    instance_id = uuid.uuid4().hex[:12]
    registry = CollectorRegistry()
    metrics = PrimaryMetrics(registry)
    worker, loaded, costs, precision_choice = start_worker(config, model_dir, instance_id, metrics, on_progress)
    tokenizer = Tokenizer.from_dir(model_dir)
    is_native = log_loaded(config, model_dir, loaded, costs)
    eos = tuple(dict.fromkeys(tokenizer.eos_token_ids + loaded.config.eos_token_ids))
    identity = ModelIdentity(model_dir.name, instance_id, config.max_context, eos, costs, precision_choice)
    is_compiled = config.tensormt_optimizer and not is_native
    compiler = start_step_compiler(config, loaded.model, metrics) if is_compiled else None
    if swept := cleanup_stale_slots():
        log.info("removed the logits slots of primaries that exited without cleaning up", num_slots=len(swept))
    servicer = _servicer(config, loaded, worker, identity, metrics, tokenizer)
    stop_expiry = threading.Event()
    threading.Thread(target=expire_leases, args=(servicer, stop_expiry), name="kv-leases", daemon=True).start()

    def on_stopped() -> None:
        stop_expiry.set()
        if compiler is not None:
            compiler.stop()
        worker.stop()
        servicer.logits_slots.release_all()
        if servicer.run_grammars is not None:
            servicer.run_grammars.close()
        if loaded.shared is not None:
            loaded.shared.unlink()

    freeze_startup_heap()  # the model and tables stay out of every collection while serving
    try:
        serve_internal(
            config.server,
            primary_pb2_grpc.add_PrimaryServiceServicer_to_server,
            servicer,
            service_token,
            metrics.rpc,
            registry=registry,
            on_stopped=on_stopped,
        )
    finally:
        if loaded.shared is not None:
            loaded.shared.unlink()


def load_run_answers(path: str, loaded: LoadedModel, worker: EngineWorker) -> AnswerIndex | None:
    """The model's own answers for run drafts (--run_answers); None, and the log says why, where
    there are none or the file cannot serve this model (a warning for a file named on the command
    line; the shipped default's, another model's, is expected for any model but the default)."""
    log = structlog.get_logger("primary_svc")
    if not path:
        return None
    fingerprint = worker.run(lambda: model_fingerprint(loaded.config, loaded.model.norm.weight))
    try:
        answers = load_answers(Path(path), loaded.config.vocab_size, fingerprint)
    except AnswersFileError as e:
        level = log.info if Path(path) == DEFAULT_ANSWERS else log.warning
        level("run_answers_left_out", reason=str(e))
        return None
    log.info("run_answers_loaded", path=path, num_tokens=answers.num_tokens)
    return answers


def start_worker(
    config: PrimaryConfig, model_dir: Path, instance_id: str, metrics: PrimaryMetrics, on_progress: ProgressCallback
) -> tuple[EngineWorker, LoadedModel, dict[int, float], str]:
    """The engine thread, with the model loaded on it: (worker, loaded, verify costs, how the precision
    was chosen)."""
    worker = EngineWorker(
        None,
        config.max_batch,
        config.max_step_tokens,
        config.prefill_chunk_tokens,
        metrics,
        batch_wait_s=config.batch_wait_ms / 1000,
    )
    # Every tensor op of the process on the engine thread, loading included (see primary_svc.worker).
    loaded, engine, costs, precision_choice = worker.run(
        lambda: load_engine(config, model_dir, instance_id, on_progress)
    )
    worker.engine = engine
    native.library()  # every precision's argmax and fp8 encoding use it: built (once a machine) now, not mid-request
    return worker, loaded, costs, precision_choice


def log_loaded(config: PrimaryConfig, model_dir: Path, loaded: LoadedModel, costs: dict[int, float]) -> bool:
    """Log what was loaded; whether its layers run as native calls."""
    log = structlog.get_logger("primary_svc")
    is_native = any(block.native is not None for block in loaded.model.layers)
    matrices = loaded.model.matrices.values()
    log.info(
        "model loaded",
        model_dir=str(model_dir),
        precision=loaded.precision,
        weight_bytes=loaded.weight_bytes,
        verify_costs_ms={k: round(v, 2) for k, v in costs.items()},
        # decided at conversion (specdec.model.precision.choose_layout), which logs why native is not used
        weight_layouts=count_layouts(matrices),
        native_kernels=native.status() if any(m.layout.is_packed for m in matrices) else "not used",
    )
    if loaded.precision == "int8_token" and not token_products_vectorized():
        log.warning(
            "int8_token runs the portable loops on this CPU: int4 or int8 serve many times faster here",
            native_kernels=native.status(),
        )
    if config.tensormt_optimizer and is_native:
        log.warning(
            "--tensormt_optimizer not applied: the layers already run as native calls", precision=loaded.precision
        )
    return is_native


def start_grammars(tokenizer: Tokenizer, loaded: LoadedModel) -> RunGrammars:
    """Greedy runs under a response format mask by the primary's own grammar states; the tokenizer's
    tables (~1 s) are built in the background, so the first constrained run need not wait for them."""
    run_grammars = RunGrammars(
        lambda: GrammarCache(GrammarTokenizerInfo.from_tokenizer(tokenizer, loaded.config.vocab_size))
    )
    threading.Thread(target=warm_grammars, args=(run_grammars,), name="grammar-tables", daemon=True).start()
    return run_grammars


def warm_grammars(run_grammars: RunGrammars) -> None:
    try:
        run_grammars.warm()
    except Exception:  # noqa: BLE001 - the first constrained run builds them again, and reports why not
        structlog.get_logger("primary_svc").exception("grammar tables not built")


def expire_leases(servicer: PrimaryServicer, stop: threading.Event) -> None:
    """Free the KV slots whose lease ran out, checking a few times per lease period."""
    log = structlog.get_logger("primary_svc")
    while not stop.wait(min(servicer.leases.lease_s / 4, LEASE_CHECK_MAX_S)):
        try:
            if expired := servicer.expire_idle_requests():
                log.warning("kv leases expired: slots released", request_ids=expired)
        except Exception:  # noqa: BLE001 - the thread must outlive one failure
            log.exception("kv lease expiry failed")


def load_engine(
    config: PrimaryConfig, model_dir: Path, instance_id: str, on_progress: ProgressCallback = no_progress
) -> tuple[LoadedModel, Engine, dict[int, float], str]:
    """(the model, its engine, the measured verify costs, how the precision was chosen)."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    min_gemm_rows = config.min_gemm_rows or calibrate_min_gemm_rows(load_config(model_dir))
    structlog.get_logger("primary_svc").info("fp32 GEMM padding", min_gemm_rows=min_gemm_rows)
    precision, precision_choice = served_precision(config, model_dir, on_progress)
    on_progress(f"loading the {precision} weights", 0, 0)
    loaded = load_model(
        model_dir,
        precision,
        max_positions=config.max_context,
        device=config.device,
        is_shared=config.is_shared_weights,
        instance_id=instance_id,
        min_gemm_rows=min_gemm_rows,
    )
    engine = Engine(
        loaded.model,
        KVCache(loaded.config, loaded.model.kv_dtype, config.device, max_bytes=config.max_kv_bytes),
        config.max_context,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
    )
    if config.measure_verify_costs:
        on_progress("timing the verify passes", 0, 0)
    costs = measure_verify_costs(engine) if config.measure_verify_costs else {}
    # Attached after the measurement, so that its probe prompt is neither cached nor counted.
    engine.prefix_cache = PrefixCache(config.prefix_cache_bytes) if config.prefix_cache_bytes else None
    log_prefix_cache(engine)
    return loaded, engine, costs, precision_choice


def log_prefix_cache(engine: Engine) -> None:
    """State once whether prompts reuse cached prefixes, and at which multiples (the exactness rule)."""
    log = structlog.get_logger("primary_svc")
    if engine.prefix_cache is None:
        log.info("prefix cache off (--prefix_cache_bytes 0)")
        return
    log.info(
        "prefix cache on",
        max_bytes=engine.prefix_cache.max_bytes,
        block_tokens=engine.prefix_cache.block_tokens,
        # any number of rows where a prefill may be cut anywhere; else whole prefill chunks only
        reuse_multiple_of_tokens=engine.prefix_grid_tokens,
        reason="batch-invariant kernels" if engine.is_cut_anywhere else "not batch invariant: the prefill chunk grid",
    )


def served_precision(
    config: PrimaryConfig, model_dir: Path, on_progress: ProgressCallback = no_progress
) -> tuple[str, str]:
    """(the weight format to serve, how it was chosen): --precision as given, or auto's measured pick."""
    if config.precision != AUTO:
        return config.precision, "requested"
    # A GGUF's own format is quantized, so int4/int8 serve the file as it is; a float checkpoint
    # is served in a float format unless a quantized precision is asked for.
    is_gguf = config.model_path is None or str(config.model_path).lower().endswith(".gguf")
    candidates = quantized_candidates() if is_gguf else FLOAT_CANDIDATES
    choice = choose_precision_or_fallback(model_dir, config.cache_dir, config.num_threads, candidates, on_progress)
    structlog.get_logger("primary_svc").info(
        "precision chosen",
        precision=choice.precision,
        reason=choice.reason,
        expected_tokens_per_s={p: round(v, 1) for p, v in choice.tokens_per_s.items()},
    )
    return choice.precision, choice.reason


def start_step_compiler(config: PrimaryConfig, model: Transformer, metrics: PrimaryMetrics) -> BackgroundCompiler:
    """Install a compiled step on `model` and compile its buckets in the background; serving starts eager."""
    step = CompiledStep(model, CompileSettings(mode=config.compile_mode))
    model.fast_path = step
    compiler = BackgroundCompiler(step, config.compile_cache_dir, on_bucket_ready=metrics.compiled_buckets.set)
    compiler.start()
    return compiler


if __name__ == "__main__":
    main()
