"""The engine's step inside the running service against the same step in-process.

    figures = service_vs_engine("fp32", num_threads=2, prompt=prompt, tokenizer=tokenizer, num_steps=64)

A plain (k=1) decoding step should cost the same whether the primary runs it behind gRPC or a
script calls the engine directly: anything else is overhead of the service around the forward
(threads, the OpenMP runtime, contention with the other services). Measured three ways, same
prompt, same precision, greedy:

* `service_forward_ms`: the primary's own forward time per Decode (DecodeResponse.forward_ms),
  with the whole stack (redis, gateway, draft pool, validator) up and idle beside it;
* `service_rpc_ms`: the client's wall time per Decode RPC (forward + gRPC + the primary's queue);
* `gateway_forward_ms`: forward time per step of a plain request through the gateway (its
  GenerationStats), the path users take;
* `engine_ms`: `Engine.decode` per step in this process, after the stack is stopped.

Medians over the steps after the first (the first decode warms caches up).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.prompts import BenchPrompt
from bench.report import BASELINE
from bench.stack import run_request, system_under_test
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.launcher import Stack
from specdec.model.loader import default_cache_dir, resolve_model_dir
from specdec.sampling import SamplingParams
from specdec.v1 import primary_pb2, primary_pb2_grpc

MAX_CONTEXT = 2048
PROBE_REQUEST_ID = "bench-service-step"


def service_vs_engine(
    precision: str, num_threads: int, prompt: BenchPrompt, tokenizer: Any, num_steps: int
) -> dict[str, float]:
    prompt_ids = prompt.token_ids(tokenizer)
    with system_under_test(precision, num_threads, MAX_CONTEXT) as sut:
        record = run_request(sut, prompt, prompt.scenario, BASELINE, num_steps, False, tokenizer)
        forward_ms, rpc_ms = _primary_decode_steps(sut.stack, prompt_ids, num_steps)
    gateway_ms = (
        record.stats["stage_ms"]["forward"] / max(record.stats["num_steps"], 1)
        if record.stats is not None
        else float("nan")
    )
    engine_ms = _engine_decode_steps(precision, num_threads, prompt_ids, num_steps)
    out = {
        "service_forward_ms": forward_ms,
        "service_rpc_ms": rpc_ms,
        "gateway_forward_ms": gateway_ms,
        "engine_ms": engine_ms,
    }
    out["service_over_engine"] = forward_ms / engine_ms
    return out


def _primary_decode_steps(stack: Stack, prompt_ids: list[int], num_steps: int) -> tuple[float, float]:
    """Median (forward ms, RPC wall ms) of greedy Decode calls made directly to the primary."""
    with stack.channel("primary") as channel:
        stub = primary_pb2_grpc.PrimaryServiceStub(channel)
        lease = stub.Prefill(primary_pb2.PrefillRequest(request_id=PROBE_REQUEST_ID, token_ids=prompt_ids)).kv_lease
        forward: list[float] = []
        wall: list[float] = []
        committed: list[int] = []
        try:
            for step in range(num_steps):
                start = time.perf_counter()
                resp = stub.Decode(
                    primary_pb2.DecodeRequest(
                        request_id=PROBE_REQUEST_ID, committed_token_ids=committed, position=step, kv_lease=lease
                    )
                )
                wall.append((time.perf_counter() - start) * 1000)
                forward.append(resp.forward_ms)
                committed = [resp.token_id]
        finally:
            stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=PROBE_REQUEST_ID, kv_lease=lease))
    return statistics.median(forward[1:]), statistics.median(wall[1:])


def _engine_decode_steps(precision: str, num_threads: int, prompt_ids: list[int], num_steps: int) -> float:
    """Median ms of Engine.decode in this process (the step `bench engine` measures)."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    loaded = load_model(
        resolve_model_dir(None, default_cache_dir()), precision, max_positions=MAX_CONTEXT, is_shared=False
    )
    engine = Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), MAX_CONTEXT)
    engine.open(PROBE_REQUEST_ID, prompt_ids)
    try:
        engine.prefill(PROBE_REQUEST_ID)
        times = []
        for step in range(num_steps):
            start = time.perf_counter()
            engine.decode(PROBE_REQUEST_ID, SamplingParams(), step)
            times.append((time.perf_counter() - start) * 1000)
    finally:
        engine.release(PROBE_REQUEST_ID)
    return statistics.median(times[1:])
