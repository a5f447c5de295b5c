"""What tracing adds to a step: the same internal call timed with tracing off (no exporter: spans
are not sampled) and on (every span recorded and exported), as the gateway makes it (a grpc.aio
client with the OpenTelemetry client interceptor, the client's x-request-id in the metadata) to a
service as the services run (specdec.service.server: the OpenTelemetry server interceptor, the
ErrorInterceptor binding the request's ids into the log context).

    python -m bench.tracing_overhead --num_calls 2000 --num_rounds 3
    python -m bench.tracing_overhead --stack --num_requests 6 --num_rounds 2

--stack times whole steps instead: the services as real processes (default model), the same
greedy speculative requests with tracing off and on (spans written to files), the mean step time
(GenerationStats total_ms / num_steps) of each, the stacks alternating.

A step makes three such calls (Propose, Verify, Validate), so a step's tracing cost is about three
times the per-call difference. Each mode runs in a process of its own (a process has one tracer
provider), the modes alternating, and the figures are each mode's median over its rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc

from specdec.logging import configure_logging
from specdec.service.interceptor import ErrorInterceptor
from specdec.service.server import create_server
from specdec.tracing import aio_channel_interceptors, client_request_id_bound, configure_tracing, outgoing_metadata
from specdec.v1 import primary_pb2, primary_pb2_grpc

# none: no OpenTelemetry interceptors at all (the services before tracing); off: the interceptors
# with nothing sampled (the default); on: every span recorded and exported (in memory).
MODES = ("none", "off", "on")


class _Servicer(primary_pb2_grpc.PrimaryServiceServicer):
    """The cheapest call there is, so that the figure is the per-call machinery alone."""

    def GetModelInfo(self, request, context):  # noqa: ANN001, N802 - the generated stub's names
        return primary_pb2.GetModelInfoResponse(model_id="bench", vocab_size=1)


async def _time_calls(address: str, num_calls: int, is_instrumented: bool) -> float:
    """Mean seconds per call over num_calls, after a warm-up."""
    interceptors = aio_channel_interceptors() if is_instrumented else []
    async with grpc.aio.insecure_channel(address, interceptors=interceptors) as channel:
        stub = primary_pb2_grpc.PrimaryServiceStub(channel)
        request = primary_pb2.GetModelInfoRequest()
        with client_request_id_bound("bench-request"):
            for _ in range(200):
                await stub.GetModelInfo(request, metadata=outgoing_metadata())
            started = time.perf_counter()
            for _ in range(num_calls):
                await stub.GetModelInfo(request, metadata=outgoing_metadata())
            return (time.perf_counter() - started) / num_calls


def run_mode(mode: str, num_calls: int) -> float:
    """One mode in this process: mean µs per call. Logging as the services run it (INFO, JSON)."""
    configure_logging("bench", level="INFO", is_json=True)
    if mode == "on":
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        configure_tracing("bench", {}, [SimpleSpanProcessor(InMemorySpanExporter())])
    else:
        configure_tracing("bench", {})
    if mode == "none":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[ErrorInterceptor()])
        primary_pb2_grpc.add_PrimaryServiceServicer_to_server(_Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        server, port = create_server(
            "127.0.0.1:0",
            [(primary_pb2_grpc.add_PrimaryServiceServicer_to_server, _Servicer())],
            interceptors=[ErrorInterceptor()],
        )
    server.start()
    try:
        return asyncio.run(_time_calls(f"127.0.0.1:{port}", num_calls, mode != "none")) * 1e6
    finally:
        server.stop(0)


STACK_PROMPT = "Repeat this list twice: red, green, blue, red, green, blue."


def _stack_step_ms(is_traced: bool, num_requests: int, max_new_tokens: int) -> float:
    """Mean ms per step over num_requests on a fresh stack, tracing on or off."""
    import tempfile

    from specdec.launcher import Stack, StackConfig
    from specdec.tracing import TRACES_DIR_ENV
    from specdec.v1 import gateway_pb2, gateway_pb2_grpc

    with tempfile.TemporaryDirectory() as traces_dir:
        config = StackConfig(extra_env={TRACES_DIR_ENV: traces_dir} if is_traced else {})
        with Stack(config) as stack, grpc.insecure_channel(stack.gateway_address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            total_ms, num_steps = 0.0, 0
            for i in range(num_requests + 1):  # the first warms up
                request = gateway_pb2.GenerateRequest(max_new_tokens=max_new_tokens)
                request.speculation.is_enabled, request.speculation.is_adaptive = True, False
                request.speculation.speculative_degree, request.speculation.draft_length = 2, 3
                request.chat.messages.add(role="user", content=f"{STACK_PROMPT} ({i})")
                stats = stub.Generate(request, timeout=600).stats
                if i:
                    total_ms, num_steps = total_ms + stats.stage_times.total_ms, num_steps + stats.num_steps
    return total_ms / num_steps


def _stack_main(num_requests: int, num_rounds: int, max_new_tokens: int) -> None:
    ms: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(num_rounds):
        for is_traced in (False, True):
            ms[is_traced].append(_stack_step_ms(is_traced, num_requests, max_new_tokens))
    off, on = (statistics.median(ms[is_traced]) for is_traced in (False, True))
    print(f"mean step time, median of {num_rounds} stacks x {num_requests} requests x {max_new_tokens} tokens:")
    print(f"  tracing off: {off:.2f} ms  (stacks: {', '.join(f'{v:.2f}' for v in ms[False])})")
    print(f"  tracing on:  {on:.2f} ms  (stacks: {', '.join(f'{v:.2f}' for v in ms[True])})")
    print(f"  difference:  {on - off:+.2f} ms per step ({(on - off) / off:+.1%})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_calls", type=int, default=2000)
    parser.add_argument("--num_rounds", type=int, default=3)
    parser.add_argument("--mode", choices=MODES, help="(internal) time one mode in this process")
    parser.add_argument("--stack", action="store_true", help="time whole steps on real stacks instead")
    parser.add_argument("--num_requests", type=int, default=6)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.stack:
        _stack_main(args.num_requests, args.num_rounds, args.max_new_tokens)
        return
    if args.mode is not None:
        print(f"{run_mode(args.mode, args.num_calls):.2f}")
        return
    us: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.num_rounds):
        for mode in MODES:
            argv_mode = [
                sys.executable,
                "-m",
                "bench.tracing_overhead",
                "--mode",
                mode,
                "--num_calls",
                str(args.num_calls),
            ]
            us[mode].append(float(subprocess.run(argv_mode, check=True, capture_output=True, text=True).stdout))
    median = {mode: statistics.median(us[mode]) for mode in MODES}
    print(f"per internal call, median of {args.num_rounds} rounds x {args.num_calls} calls:")
    for mode in MODES:
        delta = median[mode] - median["none"]
        rounds = ", ".join(f"{v:.1f}" for v in us[mode])
        print(
            f"  {mode:>4}: {median[mode]:7.1f} us  ({delta:+6.1f} us per call, {3 * delta:+6.1f} us per step"
            f" of 3 calls, vs none; rounds: {rounds})"
        )


if __name__ == "__main__":
    main()
