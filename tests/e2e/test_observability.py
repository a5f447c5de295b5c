"""Operating the stack: each service's /metrics after real requests (the families it owns, none of
the others', and values equal to the request's own figures), and one trace per request (the
client's id in every service's log lines for it, spans that form one tree across processes).

One stack (real processes, real Redis, the default model) with the HTTP front, every service's
/metrics and every service's spans written to a directory (SPECDEC_TRACES_DIR)."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.launcher import DRAFT, GATEWAY, HTTP, PRIMARY, VALIDATOR, Stack, StackConfig
from specdec.tracing import CLIENT_REQUEST_ID_KEY, LOG_FIELD, TRACES_DIR_ENV
from specdec.v1 import gateway_pb2
from tests.e2e.disconnecting_client import first_chunk_then_disconnect

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
SERVICES = (PRIMARY, VALIDATOR, DRAFT, GATEWAY, HTTP)
RPC = {"specdec_rpc_requests", "specdec_rpc_latency_seconds"}
GATEWAY_ONLY = {
    "specdec_time_to_first_token_seconds",
    "specdec_inter_token_latency_seconds",
    "specdec_request_time_per_output_token_seconds",
    "specdec_e2e_request_latency_seconds",
    "specdec_request_queue_time_seconds",
    "specdec_num_requests_waiting",
    "specdec_num_requests_running",
    "specdec_spec_decode_num_draft_tokens",
    "specdec_spec_decode_num_accepted_tokens",
    "specdec_spec_decode_accepted_length",
    "specdec_step_stage_seconds",
}
PRIMARY_ONLY = {"specdec_kv_cache_usage_perc", "specdec_kv_bytes", "specdec_engine_step_rows"}
DRAFT_ONLY = {"specdec_draft_proposed_tokens", "specdec_draft_propose_seconds"}
# Every step speculates (fixed settings), so every request calls the draft pool and the validator too.
SPECULATIVE = {"speculative_decoding": True, "adaptive": False, "speculative_degree": 2, "draft_length": 3}
REPEAT = "Repeat this list twice: red, green, blue, red, green, blue."


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory: pytest.TempPathFactory, traces_dir: Path) -> Iterator[Stack]:  # noqa: ANN001
    config = StackConfig(
        redis_url=redis_server.url,
        log_dir=tmp_path_factory.mktemp("stack-observability"),
        is_serving_http=True,
        is_serving_metrics=True,
        log_level="DEBUG",  # the per-call gRPC access line, which the trace test looks for
        extra_env={TRACES_DIR_ENV: str(traces_dir)},
    )
    with Stack(config) as started:
        yield started


def _scrape(stack: Stack, service: str) -> dict[str, dict[tuple, float]]:
    """family name -> {(sample name, sorted labels): value}."""
    text = urllib.request.urlopen(stack.metrics_url(service), timeout=10).read().decode()
    return {
        family.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
        if not family.name.endswith("_created")  # the parser's view of the counters' creation times
    }


def _value(scrape: dict, family: str, sample: str, **labels: str) -> float:
    return scrape.get(family, {}).get((sample, tuple(sorted(labels.items()))), 0.0)


def _total(scrape: dict, family: str, sample: str) -> float:
    """The sum of a family's samples over all its label values."""
    return sum(v for (name, _), v in scrape.get(family, {}).items() if name == sample)


def _stream(stub, content: str, max_new_tokens: int, metadata=()) -> list[gateway_pb2.GenerateStreamResponse]:  # noqa: ANN001
    request = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
    request.speculation.is_enabled, request.speculation.is_adaptive = True, False
    request.speculation.speculative_degree, request.speculation.draft_length = 2, 3
    request.chat.messages.add(role="user", content=content)
    return list(stub.GenerateStream(request, timeout=300, metadata=metadata))


def test_each_service_exports_its_own_families(stack: Stack, gateway_stub) -> None:  # noqa: ANN001
    _stream(gateway_stub, "Name a colour.", 4)
    families = {service: set(_scrape(stack, service)) for service in SERVICES}
    assert families[VALIDATOR] == RPC | {"specdec_validation_path"}
    assert GATEWAY_ONLY <= families[GATEWAY] and not GATEWAY_ONLY & (families[PRIMARY] | families[DRAFT])
    assert PRIMARY_ONLY <= families[PRIMARY] and not PRIMARY_ONLY & (families[GATEWAY] | families[DRAFT])
    assert DRAFT_ONLY <= families[DRAFT] and not DRAFT_ONLY & (families[GATEWAY] | families[PRIMARY])
    assert all(name.startswith("specdec_http_") or name == "specdec_service_restarts" for name in families[HTTP])


def test_the_gateway_counts_a_request_as_its_client_saw_it(stack: Stack, gateway_stub) -> None:  # noqa: ANN001
    before = _scrape(stack, GATEWAY)
    messages = _stream(gateway_stub, REPEAT, 24)
    after = _scrape(stack, GATEWAY)
    final = messages[-1]
    assert final.is_final
    finish_reason = gateway_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
    stats = final.stats
    token_counts = [len(m.token_ids) for m in messages if m.token_ids]
    assert sum(token_counts) == stats.num_generated_tokens > 1

    def delta(family: str, sample: str, **labels: str) -> float:
        return _value(after, family, sample, **labels) - _value(before, family, sample, **labels)

    assert delta("specdec_time_to_first_token_seconds", "specdec_time_to_first_token_seconds_count") == 1
    assert delta("specdec_e2e_request_latency_seconds", "specdec_e2e_request_latency_seconds_count") == 1
    tpot = "specdec_request_time_per_output_token_seconds"
    assert delta(tpot, f"{tpot}_count") == 1
    # one inter-token sample per token after the first step's
    itl = "specdec_inter_token_latency_seconds"
    assert delta(itl, f"{itl}_count") == stats.num_generated_tokens - token_counts[0]
    assert delta("specdec_generation_tokens", "specdec_generation_tokens_total") == stats.num_generated_tokens
    assert delta("specdec_prompt_tokens", "specdec_prompt_tokens_total") == stats.num_prompt_tokens
    assert delta("specdec_request_success", "specdec_request_success_total", finished_reason=finish_reason) == 1
    assert delta("specdec_steps", "specdec_steps_total") == stats.num_steps
    for family, expected in (
        ("specdec_spec_decode_num_draft_tokens", stats.num_proposed_tokens),
        ("specdec_spec_decode_num_accepted_tokens", stats.num_accepted_tokens),
    ):
        sample = f"{family}_total"
        assert _total(after, family, sample) - _total(before, family, sample) == expected
    for decoder in stats.decoders:
        sample = "specdec_spec_decode_num_accepted_tokens_total"
        assert delta("specdec_spec_decode_num_accepted_tokens", sample, decoder=decoder.name) == decoder.num_accepted
    assert _value(after, "specdec_num_requests_running", "specdec_num_requests_running") == 0


def test_kv_use_is_a_fraction_and_returns_to_zero(stack: Stack, gateway_stub) -> None:  # noqa: ANN001
    _stream(gateway_stub, "Name a planet.", 4)
    primary = _scrape(stack, PRIMARY)
    assert _value(primary, "specdec_kv_cache_usage_perc", "specdec_kv_cache_usage_perc") == 0.0  # released at the end
    assert (
        _value(
            primary, "specdec_rpc_requests", "specdec_rpc_requests_total", code="OK", method="PrimaryService/Prefill"
        )
        >= 1
    )


def _post(stack: Stack, body: dict, headers: dict[str, str]) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        f"{stack.http_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _log_lines(stack: Stack, service: str) -> list[dict]:
    lines = stack.log_path(service).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def _spans(traces_dir: Path) -> list[dict]:
    """Every whole line of the services' span files (one still being written ends without a newline)."""
    return [
        json.loads(line)
        for path in traces_dir.glob("*.jsonl")
        for line in path.read_text().split("\n")[:-1]
        if line.strip()
    ]


def _whole_trace(traces_dir: Path, trace_id: str, timeout_s: float = 30.0) -> list[dict]:
    """The trace's spans once its root and every span's parent are written: a service exports a span
    when it ends, so the HTTP front's root, which ends after the response went out, can come last."""
    give_up = time.monotonic() + timeout_s
    while True:
        spans = [s for s in _spans(traces_dir) if s["context"]["trace_id"] == trace_id]
        ids = {s["context"]["span_id"] for s in spans}
        has_root = any(s["parent_id"] is None for s in spans)
        if (has_root and all(s["parent_id"] in ids for s in spans if s["parent_id"] is not None)) or (
            time.monotonic() > give_up
        ):
            return spans
        time.sleep(0.1)


def test_one_http_request_is_one_trace_across_the_services(stack: Stack, traces_dir: Path) -> None:
    client_id = f"trace-{uuid.uuid4().hex}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": REPEAT}], "max_tokens": 16, **SPECULATIVE}
    status, headers, answer = _post(stack, body, {"X-Request-Id": client_id})
    assert status == 200, answer
    assert headers.get("x-request-id") == client_id  # echoed, not replaced by the completion's id
    by_service = {
        service: [e for e in _log_lines(stack, service) if e.get(LOG_FIELD) == client_id] for service in SERVICES
    }
    assert all(by_service.values()), {s: len(v) for s, v in by_service.items()}
    assert any(e["logger"] == "uvicorn.access" for e in by_service[HTTP])  # the access log, as JSON
    trace_ids = {e["trace_id"] for events in by_service.values() for e in events if "trace_id" in e}
    assert len(trace_ids) == 1, trace_ids
    (trace_id,) = trace_ids
    spans = _whole_trace(traces_dir, f"0x{trace_id}")
    by_id = {s["context"]["span_id"]: s for s in spans}
    services = {s["resource"]["attributes"]["service.name"] for s in spans}
    assert services == {"http", "gateway", "primary", "draft", "validator"}, services
    roots = [s for s in spans if s["parent_id"] is None]
    assert len(roots) == 1 and roots[0]["resource"]["attributes"]["service.name"] == "http"
    assert all(s["parent_id"] in by_id for s in spans if s["parent_id"] is not None)  # one tree
    verify = next(s for s in spans if s["name"].endswith("PrimaryService/Verify") and s["kind"] == "SpanKind.SERVER")
    caller = by_id[verify["parent_id"]]
    assert caller["kind"] == "SpanKind.CLIENT" and caller["resource"]["attributes"]["service.name"] == "gateway"


def test_a_grpc_client_request_id_reaches_every_service(stack: Stack, gateway_stub) -> None:  # noqa: ANN001
    client_id = f"grpc-{uuid.uuid4().hex}"
    _stream(gateway_stub, REPEAT, 8, metadata=((CLIENT_REQUEST_ID_KEY, client_id),))
    for service in (PRIMARY, VALIDATOR, DRAFT, GATEWAY):
        assert any(e.get(LOG_FIELD) == client_id for e in _log_lines(stack, service)), service


def test_a_malformed_request_id_is_refused_naming_it(stack: Stack, gateway_stub) -> None:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as e:
        _stream(gateway_stub, "Hi", 1, metadata=((CLIENT_REQUEST_ID_KEY, "x" * 200),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and CLIENT_REQUEST_ID_KEY in e.value.details()
    status, _, answer = _post(
        stack, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, {"X-Request-Id": "y" * 200}
    )
    assert status == 400 and answer["error"]["param"] == "X-Request-Id"


def _http_metric(stack: Stack, sample: str) -> float:
    text = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
    return next((float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == sample), 0.0)


def test_a_client_that_disconnects_mid_stream_is_counted(stack: Stack) -> None:
    disconnects = "specdec_http_client_disconnects_total"
    before = _http_metric(stack, disconnects)
    messages = [{"role": "user", "content": "Write a long story."}]
    first_chunk_then_disconnect(
        stack.http_url, {"model": MODEL, "messages": messages, "max_tokens": 400, "stream": True}
    )
    give_up = time.monotonic() + 120
    while _http_metric(stack, disconnects) == before and time.monotonic() < give_up:
        time.sleep(0.1)
    assert _http_metric(stack, disconnects) == before + 1
