"""PrimaryService in process on port 0: the RPCs over a real model, and their errors."""
from __future__ import annotations

import grpc
import pytest
import torch

from primary_svc.server import ModelIdentity, PrimaryServicer
from primary_svc.worker import EngineWorker
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.pb import logits_from_pb
from specdec.service.interceptor import ErrorInterceptor
from specdec.service.server import create_server
from specdec.v1 import common_pb2, primary_pb2, primary_pb2_grpc

PROMPT = [1, 504, 3458, 282, 260, 2114]


@pytest.fixture(scope="module")
def primary(default_model_dir):
    loaded = load_model(default_model_dir, "fp32", max_positions=512, is_shared=True)
    engine = Engine(loaded.model, KVCache(loaded.config, torch.float32, max_bytes=64 << 20), 512)
    worker = EngineWorker(engine)
    identity = ModelIdentity("test-model", "instance-1", 512, (2,), {1: 10.0, 8: 15.0})
    servicer = PrimaryServicer(loaded, worker, identity, 64 << 20)
    server, port = create_server("127.0.0.1:0", [(primary_pb2_grpc.add_PrimaryServiceServicer_to_server, servicer)],
                                 interceptors=[ErrorInterceptor()])
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield primary_pb2_grpc.PrimaryServiceStub(channel), engine
    server.stop(0)
    worker.stop()
    loaded.shared.unlink()


def test_prefill_verify_commit_decode_release(primary):
    stub, engine = primary
    stub.Prefill(primary_pb2.PrefillRequest(request_id="r", token_ids=PROMPT))
    tree = common_pb2.TokenTree(token_ids=[700, 701, 702], parents=[-1, 0, -1])
    v = stub.Verify(primary_pb2.VerifyRequest(request_id="r", tree=tree,
                                              logits_format=common_pb2.LOGITS_FORMAT_FP32))
    logits = logits_from_pb(v.logits, "logits")
    assert logits.shape == (4, engine.vocab_size)
    assert list(v.argmax_token_ids) == logits.argmax(-1).tolist()
    fp8 = stub.Verify(primary_pb2.VerifyRequest(request_id="r", tree=tree,
                                                logits_format=common_pb2.LOGITS_FORMAT_FP8_E4M3))
    assert list(fp8.argmax_token_ids) == list(v.argmax_token_ids)     # argmax from fp32, whatever the format
    shm = stub.Verify(primary_pb2.VerifyRequest(request_id="r", tree=tree, return_handle=True,
                                                logits_format=common_pb2.LOGITS_FORMAT_FP32))
    assert shm.logits.HasField("handle") and torch.equal(logits_from_pb(shm.logits, "logits"), logits)
    # Accept node 0 and a bonus token; the next plain step continues from there.
    d = stub.Decode(primary_pb2.DecodeRequest(request_id="r", accepted_nodes=[0], committed_token_ids=[700, 42]))
    assert engine.token_ids("r") == PROMPT + [700, 42]
    assert 0 <= d.token_id < engine.vocab_size
    info = stub.GetModelInfo(primary_pb2.GetModelInfoRequest())
    assert info.vocab_size == engine.vocab_size and info.instance_id == "instance-1"
    assert stub.ExportWeights(primary_pb2.ExportWeightsRequest()).manifest.memory.segment_name
    freed = stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="r")).freed_kv_bytes
    assert freed > 0 and stub.GetStats(primary_pb2.GetStatsRequest()).kv_bytes == 0


@pytest.mark.parametrize("request_, code, field", [
    (primary_pb2.VerifyRequest(request_id="missing"), grpc.StatusCode.NOT_FOUND, "request_id"),
    (primary_pb2.VerifyRequest(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (primary_pb2.VerifyRequest(request_id="r", tree=common_pb2.TokenTree(token_ids=[1], parents=[3])),
     grpc.StatusCode.INVALID_ARGUMENT, "tree.parents"),
    (primary_pb2.VerifyRequest(request_id="r", tree=common_pb2.TokenTree(token_ids=[10**8], parents=[-1])),
     grpc.StatusCode.INVALID_ARGUMENT, "tree.token_ids"),
    (primary_pb2.VerifyRequest(request_id="r", logits_format=17), grpc.StatusCode.INVALID_ARGUMENT, "logits_format"),
    (primary_pb2.PrefillRequest(request_id="big", token_ids=[1] * 600), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    (primary_pb2.PrefillRequest(request_id="p", token_ids=[1, 2], num_prompt_tokens=3),
     grpc.StatusCode.INVALID_ARGUMENT, "num_prompt_tokens"),
])
def test_bad_requests_get_a_status_naming_the_field(primary, request_, code, field):
    stub, engine = primary
    stub.Prefill(primary_pb2.PrefillRequest(request_id="r", token_ids=PROMPT))
    method = stub.Prefill if isinstance(request_, primary_pb2.PrefillRequest) else stub.Verify
    with pytest.raises(grpc.RpcError) as e:
        method(request_)
    assert e.value.code() == code and field in e.value.details()
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="r"))
    assert engine.kv_bytes == 0


def test_kv_budget_gives_resource_exhausted(primary):
    stub, engine = primary
    with pytest.raises(grpc.RpcError) as e:
        for i in range(100):       # 64 MiB of KV at ~46 KB per token: a few requests of 500 tokens
            stub.Prefill(primary_pb2.PrefillRequest(request_id=f"fill{i}", token_ids=[5] * 500))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "kv_cache" in e.value.details()
    for i in range(100):
        try:
            stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=f"fill{i}"))
        except grpc.RpcError:
            break
    assert engine.kv_bytes == 0
