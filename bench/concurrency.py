"""The concurrency sweep of `python -m bench --concurrency 1,4,16,32`: N clients at once against one
stack, with speculation off and on (product defaults), greedy.

Each client is a thread with its own gRPC channel that sends one GenerateStream request; all start
together (a barrier). Per wave:
    aggregate tokens/s   all generated tokens / wall time from the start to the last final message
    per-token latency    inter-token time from the client's receive timestamps of the stream:
                         a message with k tokens that arrives g ms after the previous message gives
                         k latencies of g/k ms; the first message (prefill included) is reported
                         apart, as time to first token (TTFT)
    controller           the adaptive controller's choices under load, summed over the wave's
                         requests: steps by speculative_degree and by draft_length (index 0 = a step
                         without speculation), probe steps (the final message's GenerationStats)
Waves use distinct prompts (taken after the main run's), so the draft pool's suffix index, which
learns from finished outputs, never holds the output of the request it drafts for.

The load of `python -m bench load` (bench/load.py) is run_load: N clients, each with its own
channel, send requests back to back (the prompts of the mix in turn) until the duration is over;
a RESOURCE_EXHAUSTED client waits the gateway's retry-after-ms hint (at most what is left of the
run) before its next request. summarize_load: requests/s and generated tokens/s over the run,
TTFT and inter-token latency as above (streamed requests; a unary request's TTFT is its whole
latency), the gap between a stream's messages (p50/p99 over messages, not spread over their tokens:
message_gaps_ms) with the tokens per message, and errors by status code. With reference_ttft_ms
(each of the load's requests once, alone and cold, `reference_ttft_ms`), every request's TTFT is
also given relative to its own prompt's: the load's TTFT "against the same prompt alone", as a
ratio per request, p50 and p99.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from bench.prompts import BenchPrompt
from bench.report import sum_counts
from bench.stack import REQUEST_TIMEOUT_S, SystemUnderTest, build_request, controller_choices, rpc_error
from specdec.errors import RETRY_AFTER_KEY
from specdec.request_id import TENANT_SEPARATOR
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

CONNECT_TIMEOUT_S = 30.0
DEFAULT_RETRY_AFTER_S = 1.0  # a RESOURCE_EXHAUSTED without a hint


@dataclasses.dataclass(frozen=True, slots=True)
class StreamTrace:
    """One streamed request as the client saw it."""

    request_id: str
    sent_at: float  # perf_counter seconds
    arrivals: tuple[tuple[float, int], ...]  # (receive time, tokens in the message), messages with tokens
    error: str = ""
    controller: dict[str, Any] | None = None  # bench.stack.controller_choices of the final message's stats
    request_index: int = -1  # which of run_load's `requests` it was (-1: not from run_load)
    token_ids: tuple[int, ...] = ()  # the generated tokens as received (request_once)
    finished_at: float | None = None  # when the call returned or failed (request_once), perf_counter seconds

    @property
    def ttft_ms(self) -> float | None:
        """Time to the first message with tokens, ms; None without one."""
        return (self.arrivals[0][0] - self.sent_at) * 1000 if self.arrivals else None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ended_at(self) -> float:
        return self.arrivals[-1][0] if self.arrivals else self.sent_at


def token_latencies_ms(trace: StreamTrace) -> list[float]:
    """Per-token inter-token times after the first message, ms.

    E.g. arrivals at 1.0 s (3 tokens), 1.1 s (2 tokens), 1.4 s (1 token) -> [50, 50, 300].
    """
    out: list[float] = []
    for (t0, _), (t1, n) in zip(trace.arrivals, trace.arrivals[1:]):
        out.extend([(t1 - t0) * 1000 / n] * n)
    return out


def message_gaps_ms(trace: StreamTrace) -> list[float]:
    """The time between consecutive messages with tokens, ms, one value per message after the first
    whatever its number of tokens: how long a reader of the stream waits for the next text.

    E.g. arrivals at 1.0 s (3 tokens), 1.1 s (2 tokens), 1.4 s (1 token) -> [100, 300].
    """
    return [(t1 - t0) * 1000 for (t0, _), (t1, _) in zip(trace.arrivals, trace.arrivals[1:])]


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 99)) -> dict[str, float | None]:
    """{"p50": ..., "p99": ...} by linear interpolation; None for no values."""
    if not values:
        return {f"p{q:g}": None for q in qs}
    return {f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(np.asarray(values, dtype=np.float64), qs))}


def summarize_wave(traces: Sequence[StreamTrace]) -> dict[str, Any]:
    """Aggregate tokens/s, latency percentiles and controller choices of one wave."""
    ok = [t for t in traces if not t.error]
    controllers = [t.controller for t in ok if t.controller is not None]
    start = min((t.sent_at for t in traces), default=0.0)
    wall_s = max((t.ended_at for t in ok), default=start) - start
    num_tokens = sum(t.num_tokens for t in ok)
    latencies = [ms for t in ok for ms in token_latencies_ms(t)]
    ttft = [t.ttft_ms for t in ok if t.ttft_ms is not None]
    return {
        "num_requests": len(traces),
        "num_errors": len(traces) - len(ok),
        "errors": sorted({t.error for t in traces if t.error}),
        "num_tokens": num_tokens,
        "wall_s": wall_s,
        "aggregate_tokens_per_s": num_tokens / wall_s if wall_s > 0 else None,
        "token_latency_ms": percentiles(latencies),
        "ttft_ms": percentiles(ttft),
        "num_steps_by_degree": sum_counts(c.get("num_steps_by_degree", []) for c in controllers),
        "num_steps_by_draft_length": sum_counts(c.get("num_steps_by_draft_length", []) for c in controllers),
        "num_probe_steps": sum(c.get("num_probe_steps", 0) for c in controllers),
    }


def _stream_one(
    address: str, request: gateway_pb2.GenerateRequest, barrier: threading.Barrier, out: list[StreamTrace], index: int
) -> None:
    """Thread body: out[index] = the trace, or a trace with the error that stopped it."""
    try:
        _stream(address, request, barrier, out, index)
    except Exception as e:  # a thread's exception would otherwise only be printed
        out[index] = StreamTrace("", time.perf_counter(), (), error=f"{type(e).__name__}: {e}")
        barrier.abort()  # the others must not wait for this client


def _stream(
    address: str, request: gateway_pb2.GenerateRequest, barrier: threading.Barrier, out: list[StreamTrace], index: int
) -> None:
    """Connect, wait for the others, stream one request, store its trace at out[index]."""
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        barrier.wait()
        sent_at = time.perf_counter()
        request_id, arrivals, controller = "", [], None
        try:
            for message in stub.GenerateStream(request, timeout=REQUEST_TIMEOUT_S):
                now = time.perf_counter()
                request_id = message.request_id or request_id
                if message.token_ids:
                    arrivals.append((now, len(message.token_ids)))
                if message.is_final:
                    controller = controller_choices(message.stats)
        except grpc.RpcError as e:
            out[index] = StreamTrace(request_id, sent_at, tuple(arrivals), error=rpc_error(e))
            return
        out[index] = StreamTrace(request_id, sent_at, tuple(arrivals), controller=controller)


def run_wave(sut: SystemUnderTest, requests: Sequence[gateway_pb2.GenerateRequest]) -> list[StreamTrace]:
    """All requests at once, one thread and channel each; their traces in request order."""
    barrier = threading.Barrier(len(requests), timeout=2 * CONNECT_TIMEOUT_S)
    traces: list[StreamTrace] = [StreamTrace("", 0.0, (), error="not run")] * len(requests)
    threads = [
        threading.Thread(target=_stream_one, args=(sut.address, r, barrier, traces, i), daemon=True)
        for i, r in enumerate(requests)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return traces


def run_sweep(
    sut: SystemUnderTest, prompts: Sequence[BenchPrompt], levels: Sequence[int], max_new_tokens: int, is_schema: bool
) -> list[dict[str, Any]]:
    """For each concurrency level: one wave with speculation off, then one with it on, on the same prompts.

    prompts: at least sum(levels) of them; level i takes the next `level` prompts in order.
    """
    if len(prompts) < sum(levels):
        raise ValueError(f"the sweep needs {sum(levels)} prompts, got {len(prompts)}")
    rows, start = [], 0
    for level in levels:
        wave_prompts = prompts[start : start + level]
        start += level
        for is_speculative in (False, True):
            requests = [
                build_request(p, max_new_tokens, is_speculative, is_schema and p.schema is not None)
                for p in wave_prompts
            ]
            traces = run_wave(sut, requests)
            row = {"concurrency": level, "speculation": is_speculative, **summarize_wave(traces)}
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def format_row(row: dict[str, Any]) -> str:
    head = f"[concurrency {row['concurrency']:>3}] speculation {'on ' if row['speculation'] else 'off'} |"
    errors = f"errors {row['num_errors']}/{row['num_requests']}"
    if row["aggregate_tokens_per_s"] is None:
        return f"{head} no output | {errors}"
    lat = row["token_latency_ms"]
    latency = "" if lat["p50"] is None else f" | per-token p50 {lat['p50']:.0f} ms, p99 {lat['p99']:.0f} ms"
    return f"{head} {row['aggregate_tokens_per_s']:.1f} tok/s aggregate{latency} | {errors}"


# --- python -m bench load -------------------------------------------------------------------------


def error_code(trace: StreamTrace) -> str:
    """ "OK" or the status code name of a failed request (rpc_error's "CODE: details")."""
    return trace.error.split(":", 1)[0] if trace.error else "OK"


def retry_after_s(e: grpc.RpcError) -> float:
    """The gateway's retry hint of a RESOURCE_EXHAUSTED, seconds (DEFAULT_RETRY_AFTER_S without one)."""
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                break
    return DEFAULT_RETRY_AFTER_S


def request_once(
    stub: gateway_pb2_grpc.GenerationServiceStub,
    request: gateway_pb2.GenerateRequest,
    is_stream: bool,
    timeout_s: float,
) -> tuple[StreamTrace, float]:
    """One request as the client saw it, and how long to wait before the next (a retry hint, else 0)."""
    sent_at = time.perf_counter()
    request_id, arrivals, controller, token_ids = "", [], None, []
    try:
        if is_stream:
            for message in stub.GenerateStream(request, timeout=timeout_s):
                request_id = message.request_id or request_id
                if message.token_ids:
                    arrivals.append((time.perf_counter(), len(message.token_ids)))
                    token_ids.extend(message.token_ids)
                if message.is_final:
                    controller = controller_choices(message.stats)
        else:
            response = stub.Generate(request, timeout=timeout_s)
            request_id = response.request_id
            if response.token_ids:
                arrivals.append((time.perf_counter(), len(response.token_ids)))
                token_ids.extend(response.token_ids)
            controller = controller_choices(response.stats)
    except grpc.RpcError as e:
        wait = retry_after_s(e) if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else 0.0
        failed = StreamTrace(
            request_id,
            sent_at,
            tuple(arrivals),
            rpc_error(e),
            token_ids=tuple(token_ids),
            finished_at=time.perf_counter(),
        )
        return failed, wait
    done = StreamTrace(
        request_id,
        sent_at,
        tuple(arrivals),
        controller=controller,
        token_ids=tuple(token_ids),
        finished_at=time.perf_counter(),
    )
    return done, 0.0


def _load_client(
    address: str,
    requests: Iterator[tuple[int, gateway_pb2.GenerateRequest]],
    lock: threading.Lock,
    stop_at: float,
    is_stream: bool,
    timeout_s: float,
    out: list[StreamTrace],
) -> None:
    """Thread body: requests back to back until stop_at (perf_counter), their traces appended to out."""
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            while time.perf_counter() < stop_at:
                with lock:
                    index, request = next(requests)
                trace, wait = request_once(stub, request, is_stream, timeout_s)
                with lock:
                    out.append(dataclasses.replace(trace, request_index=index))
                time.sleep(max(0.0, min(wait, stop_at - time.perf_counter())))
    except Exception as e:  # noqa: BLE001 - a thread's exception would otherwise only be printed
        with lock:
            out.append(StreamTrace("", time.perf_counter(), (), error=f"CLIENT: {type(e).__name__}: {e}"))


def run_load(
    address: str | Sequence[str],
    requests: Sequence[gateway_pb2.GenerateRequest],
    num_clients: int,
    duration_s: float,
    is_stream: bool,
    timeout_s: float,
    on_tick: Any = None,
    tick_s: float = 10.0,
) -> tuple[list[StreamTrace], float]:
    """num_clients threads send `requests` in turn (shared, round-robin) for duration_s, client i to
    address[i % len] when several gateways are given (the load across them); requests in flight
    at the end finish (within timeout_s). on_tick(elapsed_s) runs every tick_s meanwhile (resource samples).
    Returns the traces and the wall time, seconds, from the start to the last client's end."""
    cycle, lock = itertools.cycle(enumerate(requests)), threading.Lock()
    addresses = [address] if isinstance(address, str) else list(address)
    traces: list[StreamTrace] = []
    start = time.perf_counter()
    stop_at = start + duration_s
    threads = [
        threading.Thread(
            target=_load_client,
            args=(addresses[i % len(addresses)], cycle, lock, stop_at, is_stream, timeout_s, traces),
            name=f"load-{i}",
            daemon=True,
        )
        for i in range(num_clients)
    ]
    for t in threads:
        t.start()
    next_tick = start + tick_s
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(timeout=0.5)
        if on_tick is not None and time.perf_counter() >= next_tick:
            on_tick(time.perf_counter() - start)
            next_tick += tick_s
    return traces, time.perf_counter() - start


def summarize_load(
    traces: Sequence[StreamTrace],
    wall_s: float,
    is_stream: bool,
    num_clients: int = 0,
    reference_ttft_ms: Sequence[float | None] | None = None,
) -> dict[str, Any]:
    """Throughput over the run, latency percentiles of the requests that succeeded, errors by code;
    with reference_ttft_ms (per request of the load, see reference_ttft_ms), each request's TTFT
    over its prompt's alone."""
    ok = [t for t in traces if not t.error]
    num_tokens = sum(t.num_tokens for t in ok)
    ttft = [t.ttft_ms for t in ok if t.ttft_ms is not None]
    # Every client's first request arrives with all the others at the start, each prompt cold: without
    # that first wave the figure is the steady state's (one request arriving among running ones).
    first_wave = set(sorted(range(len(traces)), key=lambda i: traces[i].sent_at)[:num_clients])
    steady = [t.ttft_ms for i, t in enumerate(traces) if not t.error and t.ttft_ms is not None and i not in first_wave]
    latencies = [ms for t in ok for ms in token_latencies_ms(t)] if is_stream else []
    gaps = [ms for t in ok for ms in message_gaps_ms(t)] if is_stream else []
    num_messages = sum(len(t.arrivals) for t in ok)
    codes = collections.Counter(error_code(t) for t in traces)
    vs_alone = {} if reference_ttft_ms is None else ttft_against_alone(traces, first_wave, reference_ttft_ms)
    return {
        "num_requests": len(traces),
        "num_ok": len(ok),
        "num_tokens": num_tokens,
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "tokens_per_s": num_tokens / wall_s if wall_s > 0 else None,
        "ttft_ms": percentiles(ttft),
        "ttft_after_first_wave_ms": percentiles(steady),
        "inter_token_ms": percentiles(latencies),
        "message_gap_ms": percentiles(gaps),
        "tokens_per_message": num_tokens / num_messages if is_stream and num_messages else None,
        "errors_by_code": {c: n for c, n in sorted(codes.items()) if c != "OK"},
        "error_examples": sorted({t.error for t in traces if t.error})[:5],
        "steps": step_choices(ok),
        **vs_alone,
    }


def ttft_against_alone(
    traces: Sequence[StreamTrace], first_wave: set[int], reference_ttft_ms: Sequence[float | None]
) -> dict[str, Any]:
    """Each successful request's TTFT over the TTFT of the same request sent alone (reference_ttft_ms
    by request_index; requests whose reference is missing are left out): p50/p99 of the ratios, over
    all requests and over the first wave, and the references' own p50/p99.

    E.g. references [100, 200] ms; traces of request 0 at 300 ms and request 1 at 200 ms -> ratios
    [3.0, 1.0]."""
    ratios, first = [], []
    for i, t in enumerate(traces):
        ttft = t.ttft_ms
        if t.error or ttft is None or not 0 <= t.request_index < len(reference_ttft_ms):
            continue
        alone = reference_ttft_ms[t.request_index]
        if alone is None or alone <= 0:
            continue
        ratios.append(ttft / alone)
        if i in first_wave:
            first.append(ttft / alone)
    return {
        "reference_ttft_ms": percentiles([r for r in reference_ttft_ms if r is not None]),
        "ttft_vs_alone": percentiles(ratios),
        "ttft_vs_alone_first_wave": percentiles(first),
    }


def reference_ttft_ms(
    address: str, requests: Sequence[gateway_pb2.GenerateRequest], timeout_s: float
) -> list[float | None]:
    """Each request streamed alone, one after another, cold: under a prefix-cache scope of its own
    (the request id `<scope>/<n>`; without API keys the gateway keeps a client's TENANT_SEPARATOR and the primary
    shares cached prompt rows only within a scope, specdec.request_id.tenant_of), so no earlier
    request's rows are reused and no other scope's are left behind. One unmeasured request first
    warms the stack. Per request: its TTFT in ms, None if it failed."""
    run = uuid.uuid4().hex[:12]
    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)

        def alone(i: int | str, request: gateway_pb2.GenerateRequest) -> float | None:
            scoped = gateway_pb2.GenerateRequest()
            scoped.CopyFrom(request)
            scoped.request_id = f"ttft-reference-{run}-{i}{TENANT_SEPARATOR}{i}"
            trace, _ = request_once(stub, scoped, True, timeout_s)
            return None if trace.error else trace.ttft_ms

        if requests:
            alone("warm-up", requests[0])
        return [alone(i, r) for i, r in enumerate(requests)]


def step_choices(traces: Sequence[StreamTrace]) -> dict[str, Any]:
    """What the requests' steps ran: how many steps, the share that speculated (the controller turns
    speculation down under load), and generated tokens per step."""
    controllers = [t.controller for t in traces if t.controller is not None]
    by_length = sum_counts(c.get("num_steps_by_draft_length", []) for c in controllers)
    num_steps = sum(by_length)
    num_tokens = sum(t.num_tokens for t in traces if t.controller is not None)
    return {
        "num_steps": num_steps,
        "speculative_share": (num_steps - by_length[0]) / num_steps if num_steps and by_length else None,
        "tokens_per_step": num_tokens / num_steps if num_steps else None,
        "num_steps_by_draft_length": by_length,
    }
