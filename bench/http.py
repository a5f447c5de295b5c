"""python -m bench http: what the OpenAI-compatible HTTP front adds per request and per streamed token.

A trivial GenerationService (it answers at once: Generate with one token, GenerateStream with
--num_tokens messages of one token each, then the final one) runs in a process of its own, and
the real HTTP front (`python -m http_svc`) in another, pointed at it; both are started by the
launcher. Clients in this process call the same service directly over gRPC (one shared
channel, as a gRPC client would) and through the front over HTTP (a keep-alive connection per
client thread), at each --concurrency, the two paths alternating round by round so that drift
hits both alike. The model's time is left out on purpose: what is measured is the front's own
cost (HTTP parsing, JSON, the extra gRPC hop, SSE framing).

Prints, per concurrency, µs per non-streamed request and µs per streamed token (a stream's time
/ its tokens), median and p99, for each path and the difference (HTTP - gRPC).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specdec.launcher import ServiceSpec, Stack, StackConfig
from specdec.v1 import gateway_pb2, gateway_pb2_grpc
from specdec.flag_spellings import add_spellings

TRIVIAL, FRONT = "trivial-gateway", "http"
MODEL = "bench"


class TrivialGateway(gateway_pb2_grpc.GenerationServiceServicer):
    """Answers without a model: the cost left is the RPC's."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    @staticmethod
    def _stats(num_tokens: int) -> gateway_pb2.GenerationStats:
        return gateway_pb2.GenerationStats(
            num_prompt_tokens=8, num_generated_tokens=num_tokens, num_steps=num_tokens, mean_accepted_length=1.0
        )

    def Generate(self, request, context):  # noqa: N802 - the RPC's name
        return gateway_pb2.GenerateResponse(
            request_id=request.request_id,
            text=" token",
            token_ids=[42],
            finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
            stats=self._stats(1),
        )

    def GenerateStream(self, request, context):  # noqa: N802 - the RPC's name
        for _ in range(self.num_tokens):
            yield gateway_pb2.GenerateStreamResponse(request_id=request.request_id, text=" token", token_ids=[42])
        yield gateway_pb2.GenerateStreamResponse(
            request_id=request.request_id,
            is_final=True,
            finish_reason=gateway_pb2.FINISH_REASON_LENGTH,
            stats=self._stats(self.num_tokens),
        )


def serve_trivial(argv: list[str]) -> None:
    """The trivial gateway's process (the launcher passes --host, --port, ...)."""
    from specdec.service.server import ServerConfig, serve

    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--num_tokens", type=int, default=32)
    a, _ = add_spellings(p).parse_known_args(argv)
    serve(
        ServerConfig(host=a.host, port=a.port, max_workers=32, grace_s=0.0),
        [(gateway_pb2_grpc.add_GenerationServiceServicer_to_server, TrivialGateway(a.num_tokens))],
    )


class HttpClient:
    """One keep-alive connection (one per client thread)."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.connection = http.client.HTTPConnection(host, int(port), timeout=60)

    def post(self, body: bytes) -> bytes:
        self.connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = self.connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {data[:200]!r}")
        return data


def _bodies() -> tuple[bytes, bytes]:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "temperature": 0}
    return json.dumps(base).encode(), json.dumps({**base, "stream": True}).encode()


def _run(concurrency: int, num_requests: int, call, make_state=lambda: None) -> list[float]:
    """µs per call, num_requests calls spread over `concurrency` threads; call(state) does one, with
    the thread's make_state() (made before the clock starts: a connection)."""
    times_us: list[float] = []
    lock = threading.Lock()
    per_thread = max(1, num_requests // concurrency)

    def worker(_: int) -> None:
        state = make_state()
        mine = []
        for _ in range(per_thread):
            started = time.perf_counter()
            call(state)
            mine.append((time.perf_counter() - started) * 1e6)
        with lock:
            times_us.extend(mine)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, range(concurrency)))
    return times_us


def measure(
    gateway_address: str, http_address: str, concurrency: int, num_requests: int, num_rounds: int, num_tokens: int
) -> dict[str, list[float]]:
    unary_body, stream_body = _bodies()
    request = gateway_pb2.GenerateRequest(max_new_tokens=16)
    request.chat.messages.add(role="user", content="Hello")
    results: dict[str, list[float]] = {"grpc": [], "http": [], "grpc_stream": [], "http_stream": []}
    with grpc.insecure_channel(gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        paths = {
            "grpc": lambda _: stub.Generate(request, timeout=60),
            "http": lambda client: client.post(unary_body),
            "grpc_stream": lambda _: list(stub.GenerateStream(request, timeout=60)),
            "http_stream": lambda client: client.post(stream_body),
        }
        # HTTP clients: a keep-alive connection per thread and run (the server drops idle ones after 5 s).
        states = {
            name: (lambda: HttpClient(http_address)) if name.startswith("http") else (lambda: None) for name in paths
        }
        for name, call in paths.items():  # warm-up: connections, thread pools
            _run(concurrency, min(num_requests, 50), call, states[name])
        for _ in range(num_rounds):
            for name, call in paths.items():
                times = _run(concurrency, num_requests // num_rounds, call, states[name])
                results[name] += times if "stream" not in name else [t / num_tokens for t in times]
    return results


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-trivial"]:
        serve_trivial(argv[1:])
        return
    p = argparse.ArgumentParser(prog="python -m bench http", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,16", help="client threads, comma-separated")
    p.add_argument("--num_requests", type=int, default=600, help="requests per path and concurrency")
    p.add_argument("--num_rounds", type=int, default=3)
    p.add_argument("--num_tokens", type=int, default=32, help="messages (one token each) per stream")
    a = add_spellings(p).parse_args(argv)
    py = sys.executable
    specs = [
        ServiceSpec(TRIVIAL, (py, "-m", "bench", "http", "serve-trivial", "--num_tokens", str(a.num_tokens))),
        ServiceSpec(
            FRONT,
            (py, "-m", "http_svc", "--model_name", MODEL),
            depends_on=(TRIVIAL,),
            address_flags=(("--gateway_address", TRIVIAL),),
            health_http_path="/health",
        ),
    ]
    load_before = os.getloadavg()
    with Stack(StackConfig(log_level="WARNING"), specs=specs) as stack:
        rows = []
        for concurrency in (int(c) for c in a.concurrency.split(",")):
            r = measure(
                stack.addresses[TRIVIAL],
                stack.addresses[FRONT],
                concurrency,
                a.num_requests,
                a.num_rounds,
                a.num_tokens,
            )
            rows.append((concurrency, r))
    load_after = os.getloadavg()
    print(
        f"HTTP front overhead against gRPC direct (trivial GenerationService, {a.num_tokens}-token streams); "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} CPUs"
    )
    print("| clients | what | gRPC median / p99 µs | HTTP median / p99 µs | added median / p99 µs |")
    print("|---|---|---|---|---|")
    for concurrency, r in rows:
        for what, g, h in (
            ("per request", r["grpc"], r["http"]),
            ("per streamed token", r["grpc_stream"], r["http_stream"]),
        ):
            print(
                f"| {concurrency} | {what} ({len(h)}) | {statistics.median(g):.0f} / {_p99(g):.0f} | "
                f"{statistics.median(h):.0f} / {_p99(h):.0f} | {statistics.median(h) - statistics.median(g):+.0f} / "
                f"{_p99(h) - _p99(g):+.0f} |"
            )


if __name__ == "__main__":
    main()
