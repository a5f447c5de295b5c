"""`python -m bench simulate --measure`: a node profile measured on this machine, in process.

The engine's figures as `python -m bench engine` takes them (bench/engine.py): the verify curve after
256 tokens of context (primary_svc.costs.measure_verify_costs, fastest of `repeats`) and the prefill
rate of one 512-token prompt alone (its ms per prompt token). Redis's as `python -m bench.sim_redis`
takes them, when redis-server and redis-benchmark are installed. The gateway's CPU per token needs
the whole stack under load (`python -m bench load` with the gateway's CPU time read from /proc), so it
is carried over from the base profile, with that profile's source.
"""

from __future__ import annotations

import argparse
import shutil
from datetime import datetime, timezone
from typing import Any

from bench.engine import CONTEXT_TOKENS, VERIFY_SIZES, engine_max_context, prefill_rate
from bench.report import machine_info
from bench.sim_profile import NodeProfile
from primary_svc.costs import measure_verify_costs
from specdec.engine.engine import Engine

PREFILL_TOKENS = 512


def engine_figures(
    engine: Engine, repeats: int, rows: tuple[int, ...] = VERIFY_SIZES, prefill_tokens: int = PREFILL_TOKENS
) -> dict[str, Any]:
    """verify_rows, verify_ms and prefill_ms_per_token of `engine`, measured now."""
    curve = measure_verify_costs(engine, repeats, rows, min(CONTEXT_TOKENS, engine.max_context // 2))
    prefill = prefill_rate(engine, prefill_tokens, repeats)
    return {
        "verify_rows": tuple(rows),
        "verify_ms": tuple(curve[k] for k in rows),
        "prefill_ms_per_token": prefill["ms"] / prefill["num_prefilled"],
    }


def redis_figures(num_ops: int) -> dict[str, float] | None:
    """redis_step_ops_per_s and redis_index_ops_per_s from bench.sim_redis; None without Redis."""
    if shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None:
        return None
    from bench.sim_redis import measure

    args = argparse.Namespace(num_requests=10_000, num_ops=num_ops, clients=32, pipeline=[1])
    out = measure(args)
    return {
        "redis_step_ops_per_s": out["evalsha_p1"]["client_ops_per_s"],
        "redis_index_ops_per_s": out["zadd_p1"]["client_ops_per_s"],
    }


def measured_profile(base: NodeProfile, engine: dict[str, Any], redis: dict[str, float] | None) -> NodeProfile:
    """base with the figures measured now replacing its own; each figure's source says which."""
    m = machine_info()
    when = datetime.now(timezone.utc).date().isoformat()
    here = f"measured by `python -m bench simulate --measure` on {when}, {m['cpu_model']} ({m['num_cpus']} CPUs)"
    sources = dict(base.sources)
    sources.update({"verify_ms": f"{here}: measure_verify_costs", "prefill_ms_per_token": f"{here}: Engine.prefill"})
    figures: dict[str, Any] = {
        "verify_rows": engine["verify_rows"],
        "verify_ms": engine["verify_ms"],
        "prefill_ms_per_token": engine["prefill_ms_per_token"],
        "gateway_ms_per_token": base.gateway_ms_per_token,
        "redis_step_ops_per_s": base.redis_step_ops_per_s,
        "redis_index_ops_per_s": base.redis_index_ops_per_s,
    }
    if redis is not None:
        figures.update(redis)
        sources.update({name: f"{here}: bench.sim_redis" for name in redis})
    return NodeProfile(machine=m["cpu_model"], sources=sources, **figures)


def measure_in_process(base: NodeProfile, precision: str, repeats: int, num_redis_ops: int) -> NodeProfile:
    """Load the default model at `precision`, measure its engine and Redis here."""
    from specdec.engine.kv_cache import KVCache
    from specdec.engine.loading import load_model
    from specdec.model.loader import default_cache_dir, resolve_model_dir

    max_context = max(engine_max_context(repeats, CONTEXT_TOKENS), PREFILL_TOKENS + 1)
    loaded = load_model(
        resolve_model_dir(None, default_cache_dir()), precision, max_positions=max_context, is_shared=False
    )
    engine = Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), max_context)
    figures = engine_figures(engine, repeats)
    del engine, loaded
    return measured_profile(base, figures, redis_figures(num_redis_ops))
