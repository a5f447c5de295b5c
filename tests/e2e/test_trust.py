"""Trust boundaries on a live stack whose gateway has two tenants (API keys): the public API
needs a key, a request belongs to the tenant that made it, and a caller of the primary that
holds the service token still cannot step or free someone else's request (its KV slot is
leased to its gateway)."""
from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from gateway.api_keys import key_hash, new_key
from specdec.launcher import PRIMARY, Stack, StackConfig
from specdec.v1 import gateway_pb2, primary_pb2, primary_pb2_grpc

pytestmark = pytest.mark.e2e

KEYS = {"alice": new_key(), "bob": new_key()}
PROMPT = "List the planets of the solar system, one per line, with one fact about each."


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:  # noqa: ANN001
    folder = tmp_path_factory.mktemp("stack-trust")
    keys_file = folder / "api_keys"
    keys_file.write_text("".join(f"{tenant} {key_hash(key)}\n" for tenant, key in KEYS.items()))
    with Stack(StackConfig(redis_url=redis_server.url, log_dir=folder, api_keys_file=keys_file)) as started:
        yield started


def as_tenant(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[name]}"),)


def _request(request_id: str, max_new_tokens: int = 40) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(request_id=request_id, max_new_tokens=max_new_tokens)
    req.chat.messages.add(role="user", content=PROMPT)
    return req


def _stream_in_background(stub, request_id: str, tenant: str) -> tuple[list, threading.Thread]:
    """Start a GenerateStream, wait for its first message, read the rest in a thread."""
    stream = stub.GenerateStream(_request(request_id), timeout=300, metadata=as_tenant(tenant))
    received = [next(stream)]
    reader = threading.Thread(target=lambda: received.extend(stream))
    reader.start()
    return received, reader


def test_the_public_api_needs_a_known_key(gateway_stub):
    for metadata in ((), (("authorization", "Bearer not-a-key"),), (("authorization", KEYS["alice"]),)):
        for call in (lambda: gateway_stub.Generate(_request("anonymous"), timeout=30, metadata=metadata),
                     lambda: gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="anonymous"),
                                                     timeout=30, metadata=metadata)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
            assert "authorization" in e.value.details()


def test_a_request_belongs_to_the_tenant_that_made_it(gateway_stub):
    reference = gateway_stub.Generate(_request("reference"), timeout=300, metadata=as_tenant("alice"))
    received, reader = _stream_in_background(gateway_stub, "order-1", "alice")
    for call in (gateway_stub.GetRequest, gateway_stub.Cancel):   # bob, about alice's running request
        message = (gateway_pb2.GetRequestRequest if call is gateway_stub.GetRequest else gateway_pb2.CancelRequest)
        with pytest.raises(grpc.RpcError) as e:
            call(message(request_id="order-1"), timeout=30, metadata=as_tenant("bob"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert e.value.details() == ("request_id: no request 'order-1' (unknown or expired)"
                                     if call is gateway_stub.GetRequest else "request_id: no request 'order-1'")
    reader.join(timeout=300)
    assert received[-1].is_final and received[-1].finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert [t for r in received for t in r.token_ids] == list(reference.token_ids)
    assert {r.request_id for r in received} == {"order-1"}
    state = gateway_stub.GetRequest(gateway_pb2.GetRequestRequest(request_id="order-1"), timeout=30,
                                    metadata=as_tenant("alice"))
    assert state.status == gateway_pb2.REQUEST_STATUS_FINISHED and state.text == reference.text
    # The same id is another request for bob: no collision with alice's, nothing learnt from it.
    own = gateway_stub.Generate(_request("order-1", max_new_tokens=4), timeout=300, metadata=as_tenant("bob"))
    assert own.request_id == "order-1" and own.token_ids == reference.token_ids[:4]


def test_another_caller_of_the_primary_cannot_step_or_free_a_running_request(gateway_stub, stack):
    """The attack of the issue, with the service token: Decode/Verify/Release of a running request's
    id. Each gets NOT_FOUND (it does not hold the KV lease) and the victim's output is unchanged."""
    reference = gateway_stub.Generate(_request("victim-reference"), timeout=300, metadata=as_tenant("alice"))
    received, reader = _stream_in_background(gateway_stub, "victim", "alice")
    with stack.channel(PRIMARY) as ch:
        primary = primary_pb2_grpc.PrimaryServiceStub(ch)
        victim = "alice/victim"     # the id behind the gateway
        attacks = (lambda: primary.Decode(primary_pb2.DecodeRequest(request_id=victim, committed_token_ids=[1]),
                                          timeout=30),
                   lambda: primary.Verify(primary_pb2.VerifyRequest(request_id=victim), timeout=30),
                   lambda: primary.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=victim), timeout=30))
        for attack in attacks:
            with pytest.raises(grpc.RpcError) as e:
                attack()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
    reader.join(timeout=300)
    assert received[-1].is_final
    assert [t for r in received for t in r.token_ids] == list(reference.token_ids)
    assert "".join(r.text for r in received) == reference.text
