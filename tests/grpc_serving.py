"""In-process gRPC servers for tests: a servicer on a free loopback port, built by the services' own
`create_server` (health, reflection, the shared interceptors), stopped when the test is done."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from specdec.service.interceptor import ErrorInterceptor
from specdec.service.server import DEFAULT_MAX_WORKERS, create_server
from specdec.v1 import primary_pb2_grpc


@contextlib.contextmanager
def serving(
    add_servicer: Callable[[Any, grpc.Server], None],
    servicer: Any,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_workers: int = DEFAULT_MAX_WORKERS,
) -> Iterator[str]:
    """`servicer` (added with its stubs' add_XServicer_to_server) served on 127.0.0.1:0 by max_workers
    RPC threads; yields the address it bound."""
    server, port = create_server(
        "127.0.0.1:0", [(add_servicer, servicer)], interceptors=interceptors, max_workers=max_workers
    )
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@contextlib.contextmanager
def primary_stub(
    servicer: primary_pb2_grpc.PrimaryServiceServicer, max_workers: int = DEFAULT_MAX_WORKERS
) -> Iterator[primary_pb2_grpc.PrimaryServiceStub]:
    """A PrimaryService client of `servicer`, served as primary_svc serves it: behind the
    ErrorInterceptor that maps domain errors to their gRPC codes, by max_workers RPC threads."""
    add = primary_pb2_grpc.add_PrimaryServiceServicer_to_server
    with (
        serving(add, servicer, [ErrorInterceptor()], max_workers) as address,
        grpc.insecure_channel(address) as channel,
    ):
        yield primary_pb2_grpc.PrimaryServiceStub(channel)
