"""python -m bench auth: what service identity costs per internal RPC.

One in-process server on loopback serving a trivial Validate, called
--num_calls times over one channel, without and with the service token (the
client interceptor that adds the metadata, the server interceptor that checks
it in constant time); the rounds alternate so that drift hits both alike.
Also the check alone (ServiceTokenInterceptor on a call's metadata), no RPC.
Prints median and mean µs per call and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from specdec.service import ErrorInterceptor, create_server
from specdec.service.auth import (
    AUTHORIZATION,
    BEARER,
    ServiceTokenInterceptor,
    authenticated_channel,
    new_service_token,
)
from specdec.v1 import validator_pb2, validator_pb2_grpc
from specdec.flag_spellings import add_spellings


class _TrivialValidator(validator_pb2_grpc.ValidatorServiceServicer):
    def Validate(self, request, context):  # noqa: ANN001, ANN201, N802 - the RPC's name
        return validator_pb2.ValidateResponse(bonus_token=1)


@contextmanager
def _stub(token: str | None) -> Iterator[validator_pb2_grpc.ValidatorServiceStub]:
    auth = [] if token is None else [ServiceTokenInterceptor(token)]
    server, port = create_server(
        "127.0.0.1:0",
        [(validator_pb2_grpc.add_ValidatorServiceServicer_to_server, _TrivialValidator())],
        interceptors=[*auth, ErrorInterceptor()],
        max_workers=4,
    )
    server.start()
    try:
        with authenticated_channel(grpc.insecure_channel(f"127.0.0.1:{port}"), token) as channel:
            yield validator_pb2_grpc.ValidatorServiceStub(channel)
    finally:
        server.stop(None)


def _time_calls(stub: validator_pb2_grpc.ValidatorServiceStub, num_calls: int) -> list[float]:
    request = validator_pb2.ValidateRequest(request_id="bench")
    times_us = []
    for _ in range(num_calls):
        started = time.perf_counter()
        stub.Validate(request, timeout=10)
        times_us.append((time.perf_counter() - started) * 1e6)
    return times_us


def _time_check(token: str, num_checks: int) -> float:
    """µs per server-side check of a call's metadata (constant-time compare included)."""
    interceptor = ServiceTokenInterceptor(token)
    metadata = (("user-agent", "grpc-python"), (AUTHORIZATION, BEARER + token))
    started = time.perf_counter()
    for _ in range(num_checks):
        interceptor._is_authorized(metadata)  # noqa: SLF001 - the check alone is what is measured
    return (time.perf_counter() - started) * 1e6 / num_checks


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench auth", description=__doc__.splitlines()[0])
    p.add_argument("--num_calls", type=int, default=2000, help="calls per round and variant")
    p.add_argument("--num_rounds", type=int, default=5)
    a = add_spellings(p).parse_args(argv)
    token = new_service_token()
    plain: list[float] = []
    authed: list[float] = []
    with _stub(None) as plain_stub, _stub(token) as authed_stub:
        _time_calls(plain_stub, 200)  # warm-up: connections, thread pools
        _time_calls(authed_stub, 200)
        for _ in range(a.num_rounds):
            plain += _time_calls(plain_stub, a.num_calls)
            authed += _time_calls(authed_stub, a.num_calls)
    check_us = _time_check(token, 200_000)
    print(f"unary RPC over loopback, {len(plain)} calls each")
    print(f"  without token: median {statistics.median(plain):7.1f} µs  mean {statistics.fmean(plain):7.1f} µs")
    print(f"  with token:    median {statistics.median(authed):7.1f} µs  mean {statistics.fmean(authed):7.1f} µs")
    print(
        f"  cost per RPC:  median {statistics.median(authed) - statistics.median(plain):+7.1f} µs  "
        f"mean {statistics.fmean(authed) - statistics.fmean(plain):+7.1f} µs"
    )
    print(f"server-side check alone: {check_us:.2f} µs")


if __name__ == "__main__":
    main()
