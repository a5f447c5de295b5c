"""The system under test of `python -m bench`: a redis-server and the four services, and one
benchmark prompt through the gateway as a Record.

    with system_under_test(precision="fp32", num_threads=2, max_context=2112) as sut:
        record = run_request(sut, prompt, "json", BASELINE, max_new_tokens=64, is_constrained=True,
                             tokenizer=tokenizer)

The state lives in a real Redis (unix socket, no persistence), as in production. Every figure of
a request, the adaptive controller's choices included, comes from its GenerationStats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from bench.prompts import BenchPrompt
from bench.report import BASELINE, Record, check_json
from specdec.launcher import Stack, StackConfig
from specdec.redis_server import RedisServerError, redis_server
from specdec.request_id import TENANT_SEPARATOR
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

REQUEST_TIMEOUT_S = 1800.0  # one request, prefill to the last token, on a slow shared CPU


@dataclasses.dataclass(frozen=True, slots=True)
class SystemUnderTest:
    stack: Stack
    stub: gateway_pb2_grpc.GenerationServiceStub
    redis_pid: int  # the state store's redis-server (the chaos soak stops and continues it)

    @property
    def address(self) -> str:
        return self.stack.gateway_address


@contextlib.contextmanager
def system_under_test(
    precision: str,
    num_threads: int,
    max_context: int,
    is_serving_metrics: bool = False,
    log_dir: Path | None = None,
) -> Iterator[SystemUnderTest]:
    """Redis, then the four services (default model, product defaults), and a gateway stub; with
    is_serving_metrics each service serves /metrics (Stack.metrics_url); the services' logs go to
    log_dir and stay there (None: a temporary dir, removed after a clean stop)."""
    with contextlib.ExitStack() as cleanup:
        try:
            server = cleanup.enter_context(redis_server(prefix="specdec-bench-redis-"))
        except RedisServerError as e:
            raise SystemExit(str(e)) from None
        config = StackConfig(
            precision=precision,
            redis_url=server.url,
            num_threads=num_threads,
            max_context=max_context,
            is_serving_metrics=is_serving_metrics,
            log_dir=log_dir,
        )
        with Stack(config) as stack, grpc.insecure_channel(stack.gateway_address) as channel:
            yield SystemUnderTest(stack, gateway_pb2_grpc.GenerationServiceStub(channel), server.pid)


def build_request(
    prompt: BenchPrompt, max_new_tokens: int, is_speculative: bool, is_constrained: bool
) -> gateway_pb2.GenerateRequest:
    """Greedy; speculation off for the baseline, else the product defaults (adaptive controller on)."""
    req = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
    if not is_speculative:
        req.speculation.is_enabled = False
    if prompt.is_completion:
        req.prompt = prompt.prompt
    else:  # rendered by the gateway with the same chat template as BenchPrompt.text
        req.chat.messages.extend(
            gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt.messages()
        )
    if is_constrained:
        req.response_format.type = common_pb2.ResponseFormat.TYPE_JSON_SCHEMA
        req.response_format.json_schema = json.dumps(prompt.schema)
    return req


def controller_choices(stats: gateway_pb2.GenerationStats) -> dict[str, Any]:
    """What each step ran: the adaptive controller's choices (or the fixed settings), index 0 = no speculation."""
    return {
        "num_steps_by_draft_length": list(stats.num_steps_by_draft_length),
        "num_steps_by_degree": list(stats.num_steps_by_degree),
        "num_probe_steps": stats.num_probe_steps,
        "task_type": stats.task_type,
    }


def stats_dict(stats: gateway_pb2.GenerationStats) -> dict[str, Any]:
    """GenerationStats as plain data (bench.report's input)."""
    st = stats.stage_times
    return {
        "num_prompt_tokens": stats.num_prompt_tokens,
        "num_generated_tokens": stats.num_generated_tokens,
        "num_steps": stats.num_steps,
        "num_step_tokens": stats.mean_accepted_length * stats.num_steps,  # the output's and its end token
        "num_proposed": stats.num_proposed_tokens,
        "num_accepted": stats.num_accepted_tokens,
        "num_forced_tokens": stats.num_forced_tokens,
        "num_runs_ended_at_repeat": stats.num_runs_ended_at_repeat,
        "tokens_per_second": stats.tokens_per_second,
        "stage_ms": {
            "draft": st.draft_ms,
            "verify": st.verify_ms,
            "forward": st.forward_ms,
            "validate": st.validate_ms,
            "commit": st.commit_ms,
            "state": st.state_ms,
            "other": st.other_ms,
            "total": st.total_ms,
        },
        "decoders": {
            d.name: {
                "num_proposed": d.num_proposed,
                "num_accepted": d.num_accepted,
                "time_ms": d.time_ms,
                # the decoder's whole subtree, on its rank-0 row (empty / 0 on rank r > 0 rows)
                "num_steps": d.num_steps,
                "num_tested_by_depth": list(d.num_tested_by_depth),
                "num_accepted_by_depth": list(d.num_accepted_by_depth),
            }
            for d in stats.decoders
        },
        "entropy_bins": [
            {"lower": b.lower, "upper": b.upper, "num_proposed": b.num_proposed, "num_accepted": b.num_accepted}
            for b in stats.entropy_bins
        ],
        **controller_choices(stats),
    }


def rpc_error(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"


def run_request(
    sut: SystemUnderTest,
    prompt: BenchPrompt,
    scenario: str,
    system: str,
    max_new_tokens: int,
    is_constrained: bool,
    tokenizer: Any,
) -> Record:
    """One greedy request through the gateway, timed by the client; an RPC error becomes the record's error.
    Outputs of prompts with a schema are checked against it, constrained or not. Each scenario is a
    tenant of its own (its id's prefix): the scenarios that ask the same prompts (json with and
    without its schema) draft nothing from each other's outputs, so every figure is of prompts the
    stack has not answered."""
    req = build_request(prompt, max_new_tokens, is_speculative=system != BASELINE, is_constrained=is_constrained)
    req.request_id = f"{scenario}{TENANT_SEPARATOR}{system}-{prompt.id[:64]}-{uuid.uuid4().hex[:8]}"
    t = time.perf_counter()
    try:
        resp = sut.stub.Generate(req, timeout=REQUEST_TIMEOUT_S)
    except grpc.RpcError as e:
        num_prompt_tokens = len(prompt.token_ids(tokenizer))
        return Record(system, scenario, prompt.id, num_prompt_tokens, (), "", 0.0, error=rpc_error(e))
    seconds = time.perf_counter() - t
    is_json, is_valid = check_json(resp.text, prompt.schema) if prompt.schema is not None else (None, None)
    return Record(
        system,
        scenario,
        prompt.id,
        resp.stats.num_prompt_tokens,
        tuple(resp.token_ids),
        resp.text,
        seconds,
        stats=stats_dict(resp.stats),
        is_json=is_json,
        is_schema_valid=is_valid,
    )
