"""Checks that the threaded and the asyncio service tests (test_service.py, test_service_aio.py) run
alike against their own servers: the same fake GenerateStream behind each (two messages, then the
final one or, for prompt "fail", InvalidArgument)."""

from __future__ import annotations

import grpc
import pytest

from specdec.v1 import gateway_pb2, gateway_pb2_grpc


def check_stream_errors_arrive_after_the_messages_sent(channel: grpc.Channel) -> None:
    stub = gateway_pb2_grpc.GenerationServiceStub(channel)
    ok = list(stub.GenerateStream(gateway_pb2.GenerateRequest(request_id="s1", prompt="hi"), timeout=5))
    assert [list(m.token_ids) for m in ok] == [[1], [2], []] and ok[-1].is_final
    received = []
    with pytest.raises(grpc.RpcError) as e:
        for message in stub.GenerateStream(gateway_pb2.GenerateRequest(request_id="s2", prompt="fail"), timeout=5):
            received.append(list(message.token_ids))
    assert received == [[1], [2]]
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens: must be > 0")
