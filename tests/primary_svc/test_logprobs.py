"""Log probabilities from PrimaryService (in process, port 0, a real fp32 model): the prompt's
(Prefill), a tree's (Verify) and plain steps' (Decode), each equal to log-softmax of a direct
in-process computation of the same rows, and the bad option refused naming its field."""

from __future__ import annotations

import grpc
import pytest
import torch

from primary_svc.server import ModelIdentity, PrimaryServicer
from primary_svc.worker import EngineWorker
from specdec import pb
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.logprobs import token_logprobs
from specdec.v1 import common_pb2, logprobs_pb2, primary_pb2
from tests.grpc_serving import primary_stub

PROMPT = [1, 504, 3458, 282, 260, 2114, 30, 1691, 314, 253]
NUM_TOP = 5
OPTIONS = logprobs_pb2.LogprobsOptions(num_top_logprobs=NUM_TOP)
TOLERANCE = 1e-4  # the same fp32 rows, from forwards of other shapes: they agree to float32 rounding


@pytest.fixture(scope="module")
def primary(default_model_dir):
    loaded = load_model(default_model_dir, "fp32", max_positions=512, is_shared=False)
    engine = Engine(
        loaded.model, KVCache(loaded.config, torch.float32, max_bytes=64 << 20), 512, prefill_chunk_tokens=4
    )
    worker = EngineWorker(engine)
    identity = ModelIdentity("test-model", "instance-1", 512, (2,), {1: 10.0})
    servicer = PrimaryServicer(loaded, worker, identity, 64 << 20)
    with primary_stub(servicer) as stub:
        yield stub, loaded.model
    worker.stop()


def reference_log_probs(model, token_ids: list[int]) -> torch.Tensor:
    """log-softmax of every row of one forward over token_ids, in a KV cache of its own: [n, V], row r
    the distribution of the token after token_ids[: r + 1]."""
    engine = Engine(model, KVCache(model.config, torch.float32, max_bytes=64 << 20), 512)
    engine.open("reference", token_ids[:1])  # the first token pending; the rest verified as a chain
    rows = engine.verify("reference", token_ids[1:], list(range(-1, len(token_ids) - 2)))  # a chain: [n, V]
    engine.release("reference")
    return torch.log_softmax(rows, dim=-1)


def assert_close(values, token_ids: list[int], log_probs: torch.Tensor) -> None:
    assert [v.token_id for v in values] == token_ids
    for v, t, row in zip(values, token_ids, log_probs):
        assert v.logprob == pytest.approx(float(row[t]), abs=TOLERANCE)
        top = torch.topk(row, NUM_TOP)
        assert [a.token_id for a in v.top_logprobs] == top.indices.tolist()
        assert [a.logprob for a in v.top_logprobs] == pytest.approx(top.values.tolist(), abs=TOLERANCE)


def test_prompt_logprobs_are_those_of_one_forward_over_the_prompt(primary):
    stub, model = primary
    r = stub.Prefill(primary_pb2.PrefillRequest(request_id="p", token_ids=PROMPT, prompt_logprobs=OPTIONS))
    assert len(r.prompt_logprobs) == len(PROMPT) - 1  # the first token has no context
    assert_close(r.prompt_logprobs, PROMPT[1:], reference_log_probs(model, PROMPT)[:-1])
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="p", kv_lease=r.kv_lease))


def test_a_trees_logprobs_equal_plain_decodings_of_the_same_tokens(primary):
    stub, model = primary
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="t", token_ids=PROMPT)).kv_lease
    tree = common_pb2.TokenTree(token_ids=[700, 701, 702], parents=[-1, 0, -1])
    v = stub.Verify(
        primary_pb2.VerifyRequest(
            request_id="t", tree=tree, kv_lease=lease, logits_format=common_pb2.LOGITS_FORMAT_FP8_E4M3, logprobs=OPTIONS
        )
    )
    # nodes 0 and 2 sit at the root's row, node 1 at node 0's; whatever the logits' wire format
    ref_root = reference_log_probs(model, PROMPT)[-1:]
    ref_after_700 = reference_log_probs(model, PROMPT + [700])[-1:]
    assert_close(v.node_logprobs[:1], [700], ref_root)
    assert_close(v.node_logprobs[2:], [702], ref_root)
    assert_close(v.node_logprobs[1:2], [701], ref_after_700)
    assert [x.token_id for x in v.row_logprobs] == list(v.argmax_token_ids)
    assert_close(v.row_logprobs[:2], list(v.argmax_token_ids[:2]), torch.cat([ref_root, ref_after_700]))
    # Plain decoding from the same place: the same values as the tree's root row and node 0's row.
    d = stub.Decode(
        primary_pb2.DecodeRequest(
            request_id="t", accepted_nodes=[0], committed_token_ids=[700, 42], kv_lease=lease, logprobs=OPTIONS
        )
    )
    assert_close(d.logprobs, [d.token_id], reference_log_probs(model, PROMPT + [700, 42])[-1:])
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="t", kv_lease=lease))


def test_a_run_of_plain_steps_scores_every_token(primary):
    stub, model = primary
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="d", token_ids=PROMPT)).kv_lease
    d = stub.Decode(primary_pb2.DecodeRequest(request_id="d", kv_lease=lease, max_tokens=6, logprobs=OPTIONS))
    tokens = list(d.token_ids)
    assert len(d.logprobs) == len(tokens) == 6
    reference = reference_log_probs(model, PROMPT + tokens[:-1])[len(PROMPT) - 1 :]
    assert_close(d.logprobs, tokens, reference)
    assert all(x.logprob == x.top_logprobs[0].logprob for x in d.logprobs)  # greedy: each token is its row's top
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="d", kv_lease=lease))


def test_token_logprobs_on_a_hand_computed_row():
    row = torch.tensor([[0.0, float(torch.log(torch.tensor(3.0)))]])  # p = (1/4, 3/4)
    (value,) = token_logprobs(row, [0], 1)
    assert value.logprob == pytest.approx(float(torch.log(torch.tensor(0.25))))
    assert value.top[0][0] == 1 and value.top[0][1] == pytest.approx(float(torch.log(torch.tensor(0.75))))


def test_too_many_top_logprobs_are_refused_naming_the_field(primary):
    stub, _ = primary
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(
            primary_pb2.PrefillRequest(
                request_id="x", token_ids=PROMPT, prompt_logprobs=logprobs_pb2.LogprobsOptions(num_top_logprobs=21)
            )
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_top_logprobs" in e.value.details()
    assert pb.logprobs_request_from_pb(logprobs_pb2.LogprobsOptions(num_top_logprobs=20)).num_top == 20


def test_prompt_logprobs_of_a_prompt_past_the_context_are_refused_naming_the_field(primary):
    # The prompt is scored before the request is opened: a prompt that could never be opened (600 tokens
    # in a 512-token context, within the KV budget) is refused as the Prefill without logprobs is, not
    # forwarded at positions past the model's.
    stub, _ = primary
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(primary_pb2.PrefillRequest(request_id="long", token_ids=[1] * 600, prompt_logprobs=OPTIONS))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids" in e.value.details()
