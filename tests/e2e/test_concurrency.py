"""Many clients at once through the real stack: greedy output does not depend on the company a request
keeps, and the load generator (python -m bench load) runs against a stack and reports its figures."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench import load
from specdec.launcher import SERVICE_NAMES
from specdec.v1 import gateway_pb2_grpc

pytestmark = pytest.mark.e2e

NUM_CLIENTS = 16
MAX_NEW_TOKENS = 16
# Short prompts: the test is about outputs under company, not about 16 long prefills queued in the primary.
MAX_PROMPT_CHARS = 300


# The module's stack (tests/e2e/conftest.py), but the gateway waits up to 10 minutes for a primary
# call: 16 prefills queue in the primary one after another, which on a small shared CPU passes the
# default 60 s.
STACK_OPTIONS = {"extra_env": {"SPECDEC_GATEWAY_RPC_TIMEOUT_S": "600"}}


def test_greedy_outputs_under_16_concurrent_clients_match_each_request_alone(gateway_stub, stack):
    requests = load.build_requests(
        ["json", "code", "prose"],
        MAX_NEW_TOKENS,
        is_speculative=True,
        is_schema=False,
        max_prompt_chars=MAX_PROMPT_CHARS,
    )[:NUM_CLIENTS]
    assert len(requests) == NUM_CLIENTS
    alone = [gateway_stub.Generate(r, timeout=300) for r in requests]

    def one(request):
        with grpc.insecure_channel(stack.gateway_address) as channel:  # a client each
            return gateway_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=600)

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        together = list(pool.map(one, requests))
    for i, (a, t) in enumerate(zip(alone, together)):
        assert a.token_ids, f"request {i} generated nothing"
        assert list(t.token_ids) == list(a.token_ids), f"request {i}: {t.text!r} != {a.text!r}"


def test_the_load_generator_runs_two_clients_for_a_few_seconds(stack):
    requests = load.build_requests(
        ["json", "prose"], 8, is_speculative=True, is_schema=False, max_prompt_chars=MAX_PROMPT_CHARS
    )
    pids = {name: stack.pid(name) for name in SERVICE_NAMES}
    result = load.run(
        stack.gateway_address,
        2,
        3.0,
        requests[:4],
        is_stream=True,
        timeout_s=300,
        pids=pids,
        sample_s=1.0,
        stack=stack,
        is_reference=True,
    )
    assert result["num_requests"] >= 2 and result["num_ok"] == result["num_requests"], result["error_examples"]
    assert result["errors_by_code"] == {} and result["num_tokens"] > 0
    assert result["tokens_per_s"] > 0 and result["requests_per_s"] > 0
    assert result["ttft_ms"]["p50"] is not None and result["ttft_ms"]["p99"] >= result["ttft_ms"]["p50"]
    first, last = result["resources"][0]["services"], result["resources"][-1]["services"]
    assert set(first) == set(last) == set(SERVICE_NAMES)
    assert all(s["rss_bytes"] > 0 and s["open_fds"] > 0 for s in (*first.values(), *last.values()))
    assert result["primary_after"] == {"kv_bytes": 0, "num_active_requests": 0}
    cache = result["prefix_cache"]  # the requests repeat the mix's prompts: the repeats reuse theirs
    assert cache["prompt_tokens"] > 0 and 0 <= cache["reused_tokens"] <= cache["prompt_tokens"]
    assert cache["bytes"] <= cache["max_bytes"]
    assert "requests/s" in load.format_result(result) and "prefix cache" in load.format_result(result)
    # then each of the 4 requests alone, cold (a prefix-cache scope of its own): every request's TTFT
    # under the load over its own prompt's (the KV check above already ran after them)
    assert result["reference_ttft_ms"]["p50"] > 0 and result["ttft_vs_alone"]["p50"] > 0
    assert result["ttft_vs_alone_first_wave"]["p99"] > 0
    assert "same prompt's alone" in load.format_result(result)
