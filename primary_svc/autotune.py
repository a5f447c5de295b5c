"""`--precision auto`: measure the candidate weight formats on this machine, serve the fastest.

Which format is fastest depends on the CPU: packed int4/int8 kernels with bf16 activations read
a quarter of fp32's bytes, but on a CPU without native bf16 arithmetic their cost grows with the
rows of a verify far faster than fp32's, and speculation lives on multi-row verifies. So each
candidate is loaded and its verify curve measured (a short context, a few repeats: about a
second per candidate), then scored by what the gateway's controller would get from it:

    tokens/s(alpha) = max over draft length g in 0..MAX_ADAPTIVE_DRAFT_LENGTH of
                      E[tokens per step | g] / (verify_ms(g + 1) + overhead_ms(g)) * 1000
    E[tokens per step | g] = (1 - alpha^(g+1)) / (1 - alpha)     (a chain of g drafts, each accepted
                                                                  with probability alpha, + the bonus)
    overhead_ms(0) = plain step overhead, overhead_ms(g > 0) = speculative step overhead

with MAX_ADAPTIVE_DRAFT_LENGTH the controller's longest choice (specdec.speculation_bounds),
averaged over the controller's task-type priors for alpha (structured, code, creative). g = 0
is plain decoding, so a format whose verify curve is steep still scores its plain speed.

The candidates within reach of the best (CONTENDER_SHARE) are measured a second time, in reverse
order, each size keeping its fastest run, and the format served is the first in order of preference
that scores within TIE_SHARE of the best: one measurement's noise does not pick the format.
Measuring stops after MAX_MEASURE_S (the candidates are tried in order of preference, so a
slow start still measures the likeliest winners); its reason names the candidates not measured.
The choice is cached per machine (CPU model and flags, core count, torch version, threads) and
model, in the primary's cache directory, so only the first start pays for measuring. Any failure
falls back to fp32 with the reason: `auto` never stops the service from starting.

The choice is made once per machine and model, and every later start serves it. The formats'
greedy outputs differ (for the default model and a short chat prompt, int4 and int8 part at the
7th token), and their scores are within a few percent of each other, so two measurements can pick
either: a primary restarted mid-request (the gateway re-prefills it and goes on) or another node of
the cluster (a failover) that measured again could serve other weights, and the request's output
would change. So a start holds the cache's lock (`CACHE_LOCK_FILE`, an flock, released with the
process should it die) from reading the cache to writing its choice: starts at once (a cluster's
nodes, a restart beside another start) wait for the first one's choice instead of measuring their
own, no write loses another's entry (a read-modify-write of the one file), and an incomplete
measurement is cached too. `--precision` pins a format; deleting the cache file measures anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import structlog
import torch

from primary_svc.costs import measure_verify_costs, probe_context_tokens
from specdec.progress import ProgressCallback, no_progress
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.controller_defaults import (
    PLAIN_OVERHEAD_MS,
    PRIOR_ACCEPTANCE_CODE,
    PRIOR_ACCEPTANCE_CREATIVE,
    PRIOR_ACCEPTANCE_STRUCTURED,
    SPECULATIVE_OVERHEAD_MS,
)
from specdec.model import native
from specdec.speculation_bounds import MAX_ADAPTIVE_DRAFT_LENGTH
from specdec.model.options import PRECISIONS

FALLBACK_PRECISION = "fp32"
CANDIDATES = ("int4", "int8_token", "int8", "bf16", "fp32")  # in order of preference on a tie
FLOAT_CANDIDATES = ("bf16", "fp32")
PROBE_SIZES = (1, 2, 4, 8, 16)
PROBE_CONTEXT_TOKENS = 64
PROBE_REPEATS = 3  # fastest of 3 per size and pass: 2 let one noisy sample move a score by 10 %
PRIOR_ACCEPTANCES = (PRIOR_ACCEPTANCE_STRUCTURED, PRIOR_ACCEPTANCE_CODE, PRIOR_ACCEPTANCE_CREATIVE)
CACHE_FILE = "precision_autotune.json"
CACHE_LOCK_FILE = "precision_autotune.lock"  # held by a start from reading the cache to writing its choice
MAX_MEASURE_S = 20.0  # a start-up budget: candidates not reached by then are not measured
MEASURE_ROUNDS = 2  # passes over the candidates: every one, then the contenders again (measure_candidates)
CONTENDER_SHARE = 0.75  # measured again: a candidate that scored at least this share of the best
# Served: the first candidate in order of preference scoring at least this share of the best. The
# formats' scores lie within a few percent of each other (the module docstring), inside the noise
# of one measurement, and int4 also holds the fewest bytes.
TIE_SHARE = 0.95
AUTOTUNE_STAGE = "choosing the weight format"  # its progress events' stage (specdec.progress)
WAITING_DETAIL = "waiting for another start's choice"  # the progress event of a start that waits for the lock


@dataclasses.dataclass(frozen=True, slots=True)
class PrecisionChoice:
    precision: str
    reason: str  # one line for logs and GetModelInfo
    tokens_per_s: dict[str, float]  # candidate -> score (empty on a fallback)
    verify_ms: dict[str, dict[int, float]]  # candidate -> measured curve
    is_cached: bool = False


def expected_tokens_per_s(
    verify_ms: Mapping[int, float],
    acceptance: float,
    plain_overhead_ms: float = PLAIN_OVERHEAD_MS,
    speculative_overhead_ms: float = SPECULATIVE_OVERHEAD_MS,
) -> float:
    """The best tokens/s over draft lengths 0..MAX_ADAPTIVE_DRAFT_LENGTH (see the module docstring)."""
    sizes = sorted(verify_ms)
    costs = [verify_ms[k] for k in sizes]
    best = 0.0
    for g in range(MAX_ADAPTIVE_DRAFT_LENGTH + 1):
        rows = g + 1
        if rows > sizes[-1]:  # past the last point: the last segment's slope
            slope = (costs[-1] - costs[-2]) / (sizes[-1] - sizes[-2]) if len(sizes) > 1 else 0.0
            ms = costs[-1] + slope * (rows - sizes[-1])
        else:
            ms = float(np.interp(rows, sizes, costs))
        tokens = float(g + 1) if acceptance >= 1 else (1 - acceptance ** (g + 1)) / (1 - acceptance)
        ms += plain_overhead_ms if g == 0 else speculative_overhead_ms
        best = max(best, tokens / ms * 1000)
    return best


def score(verify_ms: Mapping[int, float]) -> float:
    """Mean expected tokens/s over the task-type priors."""
    return sum(expected_tokens_per_s(verify_ms, a) for a in PRIOR_ACCEPTANCES) / len(PRIOR_ACCEPTANCES)


def machine_key(num_threads: int) -> str:
    """CPU model and flags, usable cores, torch version, threads and the native kernels (built or not,
    which source): what the measurement depends on."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)}
    cpu_flags = " ".join(sorted(fields.get("flags", "").split()))
    identity = "\0".join(
        [
            fields.get("model name", platform.processor()),
            cpu_flags,
            str(len(os.sched_getaffinity(0))),
            torch.__version__,
            str(num_threads or torch.get_num_threads()),
            native.identity(),
        ]
    )
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def token_products_vectorized() -> bool:
    """Whether int8_token's products have a vector or tile path here (the native kernels' AVX2 or
    AVX-512 build); the portable build runs them in plain loops (a one-row step of 127 ms against
    int4's 5 ms, measured on an AVX2-only EPYC before its AVX2 path: docs/benchmarks.md)."""
    lib = native.library()
    return lib is not None and lib.qgemm_isa().decode() != "portable"


def quantized_candidates() -> tuple[str, ...]:
    """CANDIDATES for a quantized source on this machine: int8_token only where its products are
    vectorized; elsewhere measuring it would only cost start-up time."""
    is_vector = token_products_vectorized()
    return tuple(p for p in CANDIDATES if p != "int8_token" or is_vector)


def measure_candidate(model_dir: Path, precision: str) -> dict[int, float]:
    positions = probe_context_tokens(PROBE_SIZES, PROBE_REPEATS, PROBE_CONTEXT_TOKENS)
    loaded = load_model(model_dir, precision, max_positions=positions, is_shared=False)
    engine = Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), loaded.model.max_positions)
    return measure_verify_costs(engine, PROBE_REPEATS, PROBE_SIZES, PROBE_CONTEXT_TOKENS)


def choose_precision_or_fallback(
    model_dir: Path,
    cache_dir: Path,
    num_threads: int,
    candidates: Sequence[str] = CANDIDATES,
    on_progress: ProgressCallback = no_progress,
) -> PrecisionChoice:
    """`choose_precision`, but any error becomes fp32 with the error as the reason."""
    try:
        return choose_precision(model_dir, cache_dir, num_threads, candidates, on_progress=on_progress)
    except Exception as e:
        return PrecisionChoice(
            FALLBACK_PRECISION, f"auto fell back to {FALLBACK_PRECISION}: {type(e).__name__}: {e}", {}, {}
        )


def choose_precision(
    model_dir: Path,
    cache_dir: Path,
    num_threads: int,
    candidates: Sequence[str] = CANDIDATES,
    measure: Callable[[Path, str], dict[int, float]] = measure_candidate,
    max_measure_s: float = MAX_MEASURE_S,
    on_progress: ProgressCallback = no_progress,
) -> PrecisionChoice:
    """The candidate with the best score on this machine, or fp32 with the reason why: the cached
    choice when there is one, else measured and cached (under the cache's lock: see the module doc).
    on_progress: an event before each candidate's measurement and one with the choice."""
    candidates = tuple(p for p in candidates if p in PRECISIONS)
    key = f"{machine_key(num_threads)}/{Path(model_dir).name}"
    cache_path = Path(cache_dir) / CACHE_FILE
    with _cache_lock(Path(cache_dir), lambda: on_progress(AUTOTUNE_STAGE, 0, len(candidates), WAITING_DETAIL)):
        cached = _cached_choice(cache_path, key, candidates)
        if cached is not None:
            return cached
        choice = measure_candidates(model_dir, candidates, measure, max_measure_s, on_progress)
        if choice.tokens_per_s:  # measured (a fallback is an error's, which a later start may not meet)
            _write_cache(cache_path, key, choice)
        return choice


def measure_candidates(
    model_dir: Path,
    candidates: Sequence[str],
    measure: Callable[[Path, str], dict[int, float]] = measure_candidate,
    max_measure_s: float = MAX_MEASURE_S,
    on_progress: ProgressCallback = no_progress,
) -> PrecisionChoice:
    """Measure the candidates in order, then the contenders again in reverse order (MEASURE_ROUNDS),
    until max_measure_s has passed; serve the preferred one among the best scored (TIE_SHARE), or
    fp32 with the reason when none could be measured.

    One pass of two samples a size let a noisy stretch decide: on a 2-vCPU EPYC the same int4 curve
    scored 242.7 and 218.3 in two passes, and a start served int8 (a one-row step 10 % slower) on
    a 2-row sample of 6.5 ms that measures 4.9-5.6 otherwise (docs/benchmarks.md, "--precision auto,
    measured twice"). The second pass runs backwards, so a stretch that slowed the last candidates
    of the first slows the first ones of the second, and each size keeps its fastest run of both."""
    log = structlog.get_logger("primary_svc")
    start = time.perf_counter()
    curves: dict[str, dict[int, float]] = {}
    failures = []
    order, num_done, total = list(candidates), 0, len(candidates)
    for round_index in range(MEASURE_ROUNDS):
        for precision in order:
            on_progress(AUTOTUNE_STAGE, num_done, total, f"timing {precision}" + (" again" if round_index else ""))
            num_done += 1
            if curves and time.perf_counter() - start > max_measure_s:  # a loaded or slow machine
                if not round_index:
                    failures.append(f"{precision}: not measured, the {max_measure_s:.0f} s budget ran out")
                continue
            try:
                curve = measure(model_dir, precision)
            except Exception as e:  # a format this model or torch build cannot serve is not a candidate
                if not round_index:
                    failures.append(f"{precision}: {e}")
                    log.info("precision candidate unavailable", precision=precision, error=str(e))
                continue
            before = curves.get(precision, curve)
            curves[precision] = {k: min(ms, before.get(k, ms)) for k, ms in curve.items()}
        if not curves:
            break
        best_score = max(score(c) for c in curves.values())
        # again: the candidates that noise could have put behind the best, last measured first
        order = [p for p in reversed(order) if p in curves and score(curves[p]) >= CONTENDER_SHARE * best_score]
        if len(order) < 2 or time.perf_counter() - start > max_measure_s:
            break
        total += len(order)
    choice = _choice(candidates, curves, failures, time.perf_counter() - start)
    if curves:
        on_progress(AUTOTUNE_STAGE, total, total, f"chose {choice.precision}")
    return choice


def _choice(
    candidates: Sequence[str], curves: dict[str, dict[int, float]], failures: list[str], seconds: float
) -> PrecisionChoice:
    """The first of `candidates` within TIE_SHARE of the best score among the measured `curves`, the
    reason naming every score; fp32 when none was measured."""
    if not curves:
        return PrecisionChoice(
            FALLBACK_PRECISION,
            f"auto fell back to {FALLBACK_PRECISION}: no candidate could be measured ({'; '.join(failures)})",
            {},
            {},
        )
    scores = {p: score(c) for p, c in curves.items()}
    top = max(scores.values())
    best = next(p for p in candidates if scores.get(p, -1.0) >= TIE_SHARE * top)  # the preferred of the best
    ranking = ", ".join(f"{p} {s:.1f}" for p, s in sorted(scores.items(), key=lambda x: -x[1]))
    reason = (
        f"auto chose {best}: expected tokens/s {ranking} (measured in {seconds:.1f} s"
        + (f"; preferred within {100 * (1 - TIE_SHARE):.0f} % of the best" if scores[best] < top else "")
        + (f"; unavailable: {'; '.join(failures)}" if failures else "")
        + ")"
    )
    return PrecisionChoice(best, reason, scores, curves)


@contextlib.contextmanager
def _cache_lock(cache_dir: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """The cache's lock (CACHE_LOCK_FILE), held within: another start waits here for this one's
    choice, after on_wait() (a start's progress says what it waits for). The kernel releases an
    flock with its process, so a start that dies frees it. A cache directory that cannot be written
    goes unlocked (nothing is cached there either)."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / CACHE_LOCK_FILE, "a")
    except OSError as e:
        structlog.get_logger("primary_svc").warning("precision choice not locked", error=str(e))
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another start is measuring
            on_wait()
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cached_choice(cache_path: Path, key: str, candidates: Sequence[str]) -> PrecisionChoice | None:
    """The choice cached under key, if it is one of the candidates."""
    cached = _read_cache(cache_path).get(key)
    if cached is None or cached.get("precision") not in candidates:
        return None
    return PrecisionChoice(
        cached["precision"],
        cached["reason"] + " (cached)",
        cached["tokens_per_s"],
        {p: {int(k): v for k, v in c.items()} for p, c in cached["verify_ms"].items()},
        is_cached=True,
    )


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, choice: PrecisionChoice) -> None:
    entries = _read_cache(path)
    entries[key] = {
        "precision": choice.precision,
        "reason": choice.reason,
        "tokens_per_s": choice.tokens_per_s,
        "verify_ms": {p: {str(k): v for k, v in c.items()} for p, c in choice.verify_ms.items()},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)  # atomic: concurrent starts never read half a file
    except OSError as e:
        structlog.get_logger("primary_svc").warning("precision choice not cached", error=str(e))
