"""The draft pool's client of the primary: a primary that does not answer is Unavailable naming
the flag that points at it and the RPC that failed."""

from __future__ import annotations

import pytest

from draft_svc.primary_client import GrpcPrimaryClient
from specdec.errors import Unavailable
from specdec.launcher import free_port


@pytest.mark.parametrize("method, rpc", [("get_model_info", "GetModelInfo"), ("export_weights", "ExportWeights")])
def test_an_unreachable_primary_is_unavailable_naming_the_rpc(method, rpc):
    address = f"127.0.0.1:{free_port()}"
    client = GrpcPrimaryClient(address, timeout_s=0.5)
    try:
        with pytest.raises(Unavailable) as e:
            getattr(client, method)()
    finally:
        client.close()
    assert e.value.field == "primary_address"
    assert e.value.message.startswith(f"{rpc} on {address} failed: ")
