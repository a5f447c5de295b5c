"""A front without --api_keys_file in front of a gateway with API keys: the gateway checks every
caller's key (the front forwards it), the model's description included."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from starlette.testclient import TestClient

from specdec.errors import Unauthenticated
from specdec.service.api_keys import ApiKeys, key_hash, new_key
from specdec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.grpc_serving import serving
from tests.http_svc.conftest import FakeGateway

KEY = new_key()


class _KeyedGateway(FakeGateway):
    """Describes its model to a caller with KEY only, as the gateway with API keys does."""

    keys = ApiKeys({key_hash(KEY): "alice"})

    def DescribeModel(self, request, context):  # noqa: ANN001, N802
        try:
            self.keys.tenant(context.invocation_metadata())
        except Unauthenticated as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        return gateway_pb2.DescribeModelResponse(max_model_len=2048, vocab_size=100, chat_template="{{ secret }}")


@pytest.fixture
def fake_gateway() -> Iterator[tuple[FakeGateway, str]]:
    servicer = _KeyedGateway()
    with serving(gateway_pb2_grpc.add_GenerationServiceServicer_to_server, servicer) as address:
        yield servicer, address


@pytest.mark.parametrize("path", ["/tokenizer_info", "/v1/models", "/v1/models/test-model"])
def test_a_caller_without_a_key_is_refused_after_one_with_a_key_was_served(client: TestClient, path: str) -> None:
    """The description is the gateway's answer to a caller with a key: served from memory to a later
    caller without one, it skipped the only key check this front has."""
    assert client.get(path, headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    for headers in ({}, {"authorization": "Bearer not-a-key"}):
        response = client.get(path, headers=headers)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["code"] == "invalid_api_key"
