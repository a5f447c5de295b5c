"""PrimaryService in process on port 0: the RPCs over a real model, their errors, and the KV
leases (only the caller that prefilled a request can step or release it; idle slots expire)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from primary_svc.leases import KVLeases
from primary_svc.run_grammars import RunGrammars
from primary_svc.server import ModelIdentity, PrimaryServicer
from primary_svc.worker import EngineWorker
from specdec.engine.engine import Engine, VerifyWork
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec import pb
from specdec.grammar import ResponseFormat
from specdec.pb import logits_from_pb
from specdec.penalties import penalize
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, primary_pb2
from specdec.weights.shared import SHM_DIR
from tests.grpc_serving import primary_stub
from tests.schemas import NAME_AGE_SCHEMA

PROMPT = [1, 504, 3458, 282, 260, 2114]
RESPONSE_FORMAT = pb.response_format_to_pb(ResponseFormat("json_schema", NAME_AGE_SCHEMA))
ALL_ALLOWED = common_pb2.TokenMask(num_rows=1, bits=b"\xff" * (49152 // 8))  # every token of the vocabulary
LEASE_S = 30.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def primary(default_model_dir, grammar_cache):
    loaded = load_model(default_model_dir, "fp32", max_positions=512, is_shared=True)
    engine = Engine(loaded.model, KVCache(loaded.config, torch.float32, max_bytes=64 << 20), 512)
    worker = EngineWorker(engine)
    identity = ModelIdentity("test-model", "instance-1", 512, (2,), {1: 10.0, 8: 15.0})
    clock = FakeClock()
    servicer = PrimaryServicer(
        loaded,
        worker,
        identity,
        64 << 20,
        leases=KVLeases(LEASE_S, clock),
        run_grammars=RunGrammars(lambda: grammar_cache),
    )
    with primary_stub(servicer) as stub:
        yield stub, engine, servicer, clock
    worker.stop()
    loaded.shared.unlink()


def test_prefill_verify_commit_decode_release(primary):
    stub, engine, *_ = primary
    prefilled = stub.Prefill(primary_pb2.PrefillRequest(request_id="r", token_ids=PROMPT))
    lease = prefilled.kv_lease
    assert len(lease) == 32
    assert prefilled.precision == stub.GetModelInfo(primary_pb2.GetModelInfoRequest()).precision != ""
    tree = common_pb2.TokenTree(token_ids=[700, 701, 702], parents=[-1, 0, -1])
    v = stub.Verify(
        primary_pb2.VerifyRequest(
            request_id="r", tree=tree, kv_lease=lease, logits_format=common_pb2.LOGITS_FORMAT_FP32
        )
    )
    logits = logits_from_pb(v.logits, "logits")
    assert logits.shape == (4, engine.vocab_size)
    assert list(v.argmax_token_ids) == logits.argmax(-1).tolist()
    assert v.num_cached_tokens == len(PROMPT) - 1  # the context; the pending token and the tree are not
    fp8 = stub.Verify(
        primary_pb2.VerifyRequest(
            request_id="r", tree=tree, kv_lease=lease, logits_format=common_pb2.LOGITS_FORMAT_FP8_E4M3
        )
    )
    assert list(fp8.argmax_token_ids) == list(v.argmax_token_ids)  # argmax from fp32, whatever the format
    # A lookahead window beside the tree: its argmaxes come back, the tree's logits stay N + 1 rows.
    lookahead = common_pb2.TokenTree(token_ids=[900, 901, 910, 911], parents=[-1, 0, 0, 1])
    la = stub.Verify(
        primary_pb2.VerifyRequest(
            request_id="r", tree=tree, lookahead=lookahead, kv_lease=lease, logits_format=common_pb2.LOGITS_FORMAT_FP32
        )
    )
    assert logits_from_pb(la.logits, "logits").shape == (4, engine.vocab_size)
    assert list(la.argmax_token_ids) == list(v.argmax_token_ids)
    window = engine.verify("r", [900, 901, 910, 911], [-1, 0, 0, 1])  # the same rows as a tree of their own
    assert list(la.lookahead_argmax_token_ids) == window[1:].argmax(-1).tolist()
    shm = stub.Verify(
        primary_pb2.VerifyRequest(
            request_id="r", tree=tree, return_handle=True, kv_lease=lease, logits_format=common_pb2.LOGITS_FORMAT_FP32
        )
    )
    assert shm.logits.HasField("handle") and torch.equal(logits_from_pb(shm.logits, "logits"), logits)
    # Accept node 0 and a bonus token; the next plain step continues from there.
    d = stub.Decode(
        primary_pb2.DecodeRequest(request_id="r", accepted_nodes=[0], committed_token_ids=[700, 42], kv_lease=lease)
    )
    assert engine.token_ids("r") == PROMPT + [700, 42]
    assert 0 <= d.token_id < engine.vocab_size
    assert d.num_step_rows == 1  # alone: its own row
    assert v.num_step_rows == 4  # alone: the pending token and 3 nodes
    # The step commits node 0, the bonus 42 and Decode's token: all but the newest one are in the context.
    after = stub.Verify(
        primary_pb2.VerifyRequest(
            request_id="r",
            tree=tree,
            kv_lease=lease,
            committed_token_ids=[d.token_id],
            logits_format=common_pb2.LOGITS_FORMAT_FP32,
        )
    )
    assert after.num_cached_tokens == len(PROMPT) + 2 == len(engine.token_ids("r")) - 1
    info = stub.GetModelInfo(primary_pb2.GetModelInfoRequest())
    assert info.vocab_size == engine.vocab_size and info.instance_id == "instance-1"
    assert stub.ExportWeights(primary_pb2.ExportWeightsRequest()).manifest.memory.segment_name
    freed = stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="r", kv_lease=lease)).freed_kv_bytes
    stats = stub.GetStats(primary_pb2.GetStatsRequest())
    assert freed > 0 and stats.kv_bytes == 0 and stats.queue_depth == 0


def fp16(features: torch.Tensor) -> np.ndarray:
    """Features as the wire rounds them (float32 activations travel as float16)."""
    return features.half().float().numpy()


def test_features_come_back_as_the_engine_computes_them_and_leave_the_logits_as_they_were(primary):
    stub, engine, servicer, _ = primary
    hidden_size = servicer.loaded.config.hidden_size
    # Prefill: one row, the last prefilled token's (position len - 2), which predicts the pending token.
    p = stub.Prefill(primary_pb2.PrefillRequest(request_id="f", token_ids=PROMPT, return_features=True))
    assert (p.features.dtype, p.features.num_rows, p.features.hidden_size) == ("float16", 1, hidden_size)
    g = stub.Prefill(primary_pb2.PrefillRequest(request_id="g", token_ids=PROMPT))
    assert not g.HasField("features")

    def references(e: Engine) -> tuple[list, list]:
        prefilled: list[torch.Tensor] = []
        e.open("ref", PROMPT)
        e.prefill("ref", features_out=prefilled)
        e.release("ref")
        e.open("ref", PROMPT[:-1])  # its pending token is the row above: a verify's root row there
        e.prefill("ref")
        root: list[torch.Tensor] = []
        e.step([VerifyWork("ref", [], [])], [], features_out=root)
        e.release("ref")
        return prefilled, root

    prefilled, root = servicer.worker.call(references)
    assert np.array_equal(pb.features_from_pb(p.features), fp16(prefilled[0]))
    np.testing.assert_allclose(pb.features_from_pb(p.features), root[0].numpy(), rtol=2e-3, atol=2e-3)
    # Verify: every logits row's (root, 3 nodes; not the lookahead's), inline or after the logits in the slot.
    tree = common_pb2.TokenTree(token_ids=[700, 701, 702], parents=[-1, 0, -1])
    lookahead = common_pb2.TokenTree(token_ids=[900, 901], parents=[-1, 0])
    ask = dict(request_id="f", tree=tree, kv_lease=p.kv_lease, logits_format=common_pb2.LOGITS_FORMAT_FP32)
    plain = stub.Verify(primary_pb2.VerifyRequest(**ask))
    inline = stub.Verify(primary_pb2.VerifyRequest(**ask, return_features=True, lookahead=lookahead))
    shm = stub.Verify(primary_pb2.VerifyRequest(**ask, return_features=True, return_handle=True))
    rows: list[torch.Tensor] = []
    servicer.worker.call(lambda e: e.step([VerifyWork("f", [700, 701, 702], [-1, 0, -1])], [], features_out=rows))
    assert not plain.HasField("features")
    assert inline.features.num_rows == 4 and not inline.features.HasField("memory")
    assert np.array_equal(pb.features_from_pb(inline.features), fp16(rows[0]))
    assert shm.features.memory.segment_name == shm.logits.handle.memory.segment_name  # one slot, one lifecycle
    assert np.array_equal(pb.features_from_pb(shm.features), fp16(rows[0]))
    expected = logits_from_pb(plain.logits, "logits")
    for v in (inline, shm):
        assert torch.equal(logits_from_pb(v.logits, "logits"), expected)
        assert list(v.argmax_token_ids) == list(plain.argmax_token_ids)
    for request_id, lease in (("f", p.kv_lease), ("g", g.kv_lease)):
        stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=request_id, kv_lease=lease))


@pytest.mark.parametrize(
    "request_, code, field",
    [
        (primary_pb2.VerifyRequest(request_id="missing"), grpc.StatusCode.NOT_FOUND, "request_id"),
        (primary_pb2.VerifyRequest(request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (
            primary_pb2.VerifyRequest(request_id="r", tree=common_pb2.TokenTree(token_ids=[1], parents=[3])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tree.parents",
        ),
        (
            primary_pb2.VerifyRequest(request_id="r", tree=common_pb2.TokenTree(token_ids=[10**8], parents=[-1])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tree.token_ids",
        ),
        (
            primary_pb2.VerifyRequest(
                request_id="r", lookahead=common_pb2.TokenTree(token_ids=[1, 2], parents=[-1, 5])
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lookahead.parents",
        ),
        (
            primary_pb2.VerifyRequest(
                request_id="r", lookahead=common_pb2.TokenTree(token_ids=[1] * 65, parents=[-1] * 65)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lookahead.token_ids",
        ),
        (
            primary_pb2.VerifyRequest(request_id="r", logits_format=17),
            grpc.StatusCode.INVALID_ARGUMENT,
            "logits_format",
        ),
        (
            primary_pb2.DecodeRequest(request_id="r", max_tokens=65),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens",
        ),
        (
            primary_pb2.DecodeRequest(request_id="r", max_tokens=2, allowed_tokens=ALL_ALLOWED),
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens",
        ),
        (
            primary_pb2.DecodeRequest(request_id="r", max_tokens=4, stop_token_ids=[-1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop_token_ids",
        ),
        (
            primary_pb2.DecodeRequest(
                request_id="r", max_tokens=4, response_format=RESPONSE_FORMAT, allowed_tokens=ALL_ALLOWED
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "response_format",
        ),
        (
            primary_pb2.DecodeRequest(
                request_id="r",
                max_tokens=4,
                response_format=common_pb2.ResponseFormat(
                    type=common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, json_schema="{not json"
                ),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "response_format.json_schema",
        ),
        (  # JSON that parses, nested past what the JSON Schema check can recurse through
            primary_pb2.DecodeRequest(
                request_id="r",
                max_tokens=4,
                response_format=common_pb2.ResponseFormat(
                    type=common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, json_schema='{"not": ' * 200 + "{}" + "}" * 200
                ),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "response_format.json_schema",
        ),
        (
            primary_pb2.DecodeRequest(
                request_id="r", max_tokens=4, committed_token_ids=[42], response_format=RESPONSE_FORMAT
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "response_format",
        ),
        (
            primary_pb2.PrefillRequest(request_id="big", token_ids=[1] * 600),
            grpc.StatusCode.INVALID_ARGUMENT,
            "token_ids",
        ),
        (
            primary_pb2.PrefillRequest(request_id="p", token_ids=[1, 2], num_prompt_tokens=3),
            grpc.StatusCode.INVALID_ARGUMENT,
            "num_prompt_tokens",
        ),
    ],
)
def test_bad_requests_get_a_status_naming_the_field(primary, request_, code, field):
    stub, engine, *_ = primary
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="r", token_ids=PROMPT)).kv_lease
    method = {
        primary_pb2.PrefillRequest: stub.Prefill,
        primary_pb2.VerifyRequest: stub.Verify,
        primary_pb2.DecodeRequest: stub.Decode,
    }[type(request_)]
    if request_.request_id == "r":  # the caller that holds the lease, with a bad field
        request_ = type(request_).FromString(request_.SerializeToString())
        request_.kv_lease = lease
    with pytest.raises(grpc.RpcError) as e:
        method(request_)
    assert e.value.code() == code and field in e.value.details()
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="r", kv_lease=lease))
    assert engine.kv_bytes == 0


def test_a_prompt_one_token_short_of_the_context_is_prefilled_and_answers(primary):
    """Prompt + output <= max_context (specdec.context_room; the gateway admits what this takes): a
    prompt of 511 of the 512 tokens is prefilled and verified with a draft beside it, whose row is
    the context's last position; one of 512 is refused, naming token_ids."""
    stub, engine, *_ = primary
    prompt = (PROMPT * 100)[:511]
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="edge", token_ids=prompt)).kv_lease
    tree = common_pb2.TokenTree(token_ids=[700], parents=[-1])
    v = stub.Verify(
        primary_pb2.VerifyRequest(
            request_id="edge", tree=tree, kv_lease=lease, logits_format=common_pb2.LOGITS_FORMAT_FP32
        )
    )
    assert len(v.argmax_token_ids) == 2 and v.num_cached_tokens == 510
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="edge", kv_lease=lease))
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(primary_pb2.PrefillRequest(request_id="over", token_ids=(PROMPT * 100)[:512]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.details()
    assert engine.kv_bytes == 0


def test_a_decode_of_several_tokens_is_as_many_one_token_decodes(primary):
    """max_tokens: the primary steps the request itself, committing each token but the last; the
    tokens are those of one-token calls, a stop token ends the run, and so does the context's end."""
    stub, engine, *_ = primary

    def prefill(rid: str) -> str:
        return stub.Prefill(primary_pb2.PrefillRequest(request_id=rid, token_ids=PROMPT)).kv_lease

    def decode(rid: str, lease: str, pending: list[int], max_tokens: int = 0, stop=()) -> primary_pb2.DecodeResponse:
        return stub.Decode(
            primary_pb2.DecodeRequest(
                request_id=rid, committed_token_ids=pending, kv_lease=lease, max_tokens=max_tokens, stop_token_ids=stop
            )
        )

    leases = {rid: prefill(rid) for rid in ("one", "run", "stop")}
    single, pending = [], []
    for _ in range(9):
        d = decode("one", leases["one"], pending)
        assert list(d.token_ids) == [d.token_id]
        single.append(d.token_id)
        pending = [d.token_id]
    run = decode("run", leases["run"], [], max_tokens=6)
    assert list(run.token_ids) == single[:6] and run.token_id == single[5]
    assert engine.token_ids("run") == PROMPT + single[:5]  # the last one is pending, as after one step
    assert run.forward_ms > 0 and run.num_step_rows == 1
    more = decode("run", leases["run"], [run.token_id], max_tokens=3)
    assert list(more.token_ids) == single[6:9]
    stop_at = single.index(single[3])  # the run ends at the first occurrence of a stop token
    stopped = decode("stop", leases["stop"], [], max_tokens=8, stop=[single[3]])
    assert list(stopped.token_ids) == single[: stop_at + 1]
    for rid, lease in leases.items():
        stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=rid, kv_lease=lease))
    # at the context's end (512) the run stops with the last token pending, as a one-token call would
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="end", token_ids=[5] * 508)).kv_lease
    end = decode("end", lease, [], max_tokens=10)
    assert len(end.token_ids) == 5 and engine.num_tokens("end") == 512
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="end", kv_lease=lease))
    assert engine.kv_bytes == 0


def test_a_run_under_a_response_format_is_as_many_one_token_decodes_under_its_masks(primary, grammar_cache):
    """response_format: the primary masks every token of a run by its own grammar state, following
    the request's committed output across calls, so the tokens are those of one-token Decodes under
    the masks a gateway's grammar state sends; the state is dropped with the request."""
    stub, engine, servicer, _ = primary
    grammar = grammar_cache.compile(ResponseFormat("json_schema", NAME_AGE_SCHEMA))

    def decode(rid, lease, pending, **fields) -> primary_pb2.DecodeResponse:
        return stub.Decode(
            primary_pb2.DecodeRequest(request_id=rid, committed_token_ids=pending, kv_lease=lease, **fields)
        )

    leases = {rid: stub.Prefill(primary_pb2.PrefillRequest(request_id=rid, token_ids=PROMPT)).kv_lease for rid in "ogf"}
    state, masked, pending = grammar.new_state(), [], []
    for _ in range(14):  # as a gateway decodes under a grammar without runs: its mask with each call
        d = decode("o", leases["o"], pending, allowed_tokens=pb.token_mask_to_pb(state.allowed_mask()))
        assert state.accept_tokens([d.token_id])
        masked.append(d.token_id)
        pending = [d.token_id]
    free = decode("f", leases["f"], [], max_tokens=14)
    assert list(free.token_ids) != masked  # the grammar changes the output: the run is really masked
    run = decode("g", leases["g"], [], max_tokens=6, response_format=RESPONSE_FORMAT)
    assert list(run.token_ids) == masked[:6] and engine.output_token_ids("g") == masked[:5]  # the 6th pending
    one = decode("g", leases["g"], [run.token_id], allowed_tokens=pb.token_mask_to_pb(_past(grammar, masked[:6])))
    assert one.token_id == masked[6]  # a one-token step in between (the gateway's mask) ...
    more = decode("g", leases["g"], [one.token_id], max_tokens=7, response_format=RESPONSE_FORMAT)
    assert list(more.token_ids) == masked[7:14]  # ... and the primary's state catches up with it
    assert servicer.run_grammars.num_states == 1
    for rid, lease in leases.items():
        stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=rid, kv_lease=lease))
    assert servicer.run_grammars.num_states == 0 and engine.kv_bytes == 0


def test_a_prefill_with_a_response_format_compiles_it_for_the_request_s_runs(primary, grammar_cache, tokenizer):
    """PrefillRequest.response_format: the compile begins beside the prefill, and the run under the
    format finds it (one compile in all); a malformed one is INVALID_ARGUMENT naming its field."""
    stub, engine, servicer, _ = primary
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    response_format = pb.response_format_to_pb(ResponseFormat("json_schema", schema))
    num_misses = grammar_cache.num_misses
    lease = stub.Prefill(
        primary_pb2.PrefillRequest(request_id="c", token_ids=PROMPT, response_format=response_format)
    ).kv_lease
    deadline = time.monotonic() + 30
    while grammar_cache.num_misses == num_misses and time.monotonic() < deadline:  # begun on a compile thread
        time.sleep(0.005)
    assert grammar_cache.num_misses == num_misses + 1
    run = stub.Decode(
        primary_pb2.DecodeRequest(request_id="c", kv_lease=lease, max_tokens=4, response_format=response_format)
    )
    assert tokenizer.decode(list(run.token_ids)).startswith("{") and grammar_cache.num_misses == num_misses + 1
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="c", kv_lease=lease))
    bad = common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_JSON_SCHEMA)  # no schema
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(primary_pb2.PrefillRequest(request_id="d", token_ids=PROMPT, response_format=bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "response_format.json_schema" in e.value.details()
    assert not engine.has_request("d")


def test_a_drafted_run_under_a_response_format_keeps_only_what_its_masks_decide(primary, grammar_cache):
    """lookup_draft_length under a response_format: each step's drafts are checked against the masked
    argmaxes of the primary's grammar state after the drafts before them, so the run's tokens are
    one-token masked Decodes'. The prompt holds the answer once already, so the run drafts its copy."""
    stub, engine, servicer, _ = primary
    grammar = grammar_cache.compile(ResponseFormat("json_schema", NAME_AGE_SCHEMA))

    def masked_decodes(rid: str, prompt: list[int], n: int) -> list[int]:
        lease = stub.Prefill(primary_pb2.PrefillRequest(request_id=rid, token_ids=prompt)).kv_lease
        state, out = grammar.new_state(), []
        for _ in range(n):
            mask = pb.token_mask_to_pb(state.allowed_mask())
            d = stub.Decode(
                primary_pb2.DecodeRequest(
                    request_id=rid, committed_token_ids=out[-1:], kv_lease=lease, allowed_tokens=mask
                )
            )
            assert state.accept_tokens([d.token_id])
            out.append(d.token_id)
        stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=rid, kv_lease=lease))
        return out

    answer = masked_decodes("ref0", PROMPT, 12)
    prompt = PROMPT + answer + PROMPT
    expected = masked_decodes("ref1", prompt, 12)
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="gd", token_ids=prompt)).kv_lease
    run = stub.Decode(
        primary_pb2.DecodeRequest(
            request_id="gd", kv_lease=lease, max_tokens=12, response_format=RESPONSE_FORMAT, lookup_draft_length=8
        )
    )
    assert list(run.token_ids) == expected and run.num_draft_accepted > 0
    assert engine.output_token_ids("gd") == expected[:11]
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="gd", kv_lease=lease))
    assert servicer.run_grammars.num_states == 0 and engine.kv_bytes == 0


@pytest.mark.parametrize("lookup_draft_length", [0, 8])
def test_a_seeded_sampled_run_under_a_response_format_draws_what_masked_one_token_decodes_draw(
    primary, grammar_cache, lookup_draft_length
):
    """Sampled under a response_format: each token of the run is drawn at its position from its row
    masked by the primary's grammar state (a draft is kept where that draw equals it), so a seeded run
    writes what seeded one-token Decodes under a gateway's masks write."""
    stub, engine, servicer, _ = primary
    grammar = grammar_cache.compile(ResponseFormat("json_schema", NAME_AGE_SCHEMA))
    sampling = common_pb2.SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="sref", token_ids=PROMPT)).kv_lease
    state, expected = grammar.new_state(), []
    for position in range(12):
        d = stub.Decode(
            primary_pb2.DecodeRequest(
                request_id="sref",
                committed_token_ids=expected[-1:],
                kv_lease=lease,
                allowed_tokens=pb.token_mask_to_pb(state.allowed_mask()),
                sampling=sampling,
                position=position,
            )
        )
        assert state.accept_tokens([d.token_id])
        expected.append(d.token_id)
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="sref", kv_lease=lease))
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="sg", token_ids=PROMPT)).kv_lease
    run = stub.Decode(
        primary_pb2.DecodeRequest(
            request_id="sg",
            kv_lease=lease,
            max_tokens=12,
            response_format=RESPONSE_FORMAT,
            sampling=sampling,
            lookup_draft_length=lookup_draft_length,
        )
    )
    assert list(run.token_ids) == expected and engine.output_token_ids("sg") == expected[:11]
    assert (run.num_drafted > 0) == (lookup_draft_length > 0)  # the grammar's forced tokens at least
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="sg", kv_lease=lease))
    assert servicer.run_grammars.num_states == 0 and engine.kv_bytes == 0


def _past(grammar, output):
    """The mask a fresh state of `grammar` gives after `output`."""
    state = grammar.new_state()
    assert state.accept_tokens(output)
    return state.allowed_mask()


def test_a_full_kv_cache_makes_a_prefill_wait_until_its_deadline(primary):
    stub, engine, *_ = primary
    per_request = engine.kv_bytes_to_open(500)
    leases = [
        stub.Prefill(primary_pb2.PrefillRequest(request_id=f"fill{i}", token_ids=[5] * 500)).kv_lease
        for i in range(engine.kv_cache.max_bytes // per_request)
    ]  # 64 MiB at ~46 KB per token
    with pytest.raises(grpc.RpcError) as e:  # waits for room, then its deadline passes
        stub.Prefill(primary_pb2.PrefillRequest(request_id="late", token_ids=[5] * 500), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not engine.has_request("late")
    late = stub.Prefill.future(primary_pb2.PrefillRequest(request_id="late", token_ids=[5] * 500), timeout=120)
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="fill0", kv_lease=leases[0]))
    leases[0] = late.result().kv_lease  # admitted once a slot was freed
    for i, lease in enumerate(leases):
        stub.Release(
            primary_pb2.PrimaryServiceReleaseRequest(request_id="late" if i == 0 else f"fill{i}", kv_lease=lease)
        )
    assert engine.kv_bytes == 0


def test_only_the_lease_holder_can_step_or_release_a_request(primary):
    """Another caller (no lease, a made-up one, an old one) gets NOT_FOUND, as for an unknown id."""
    stub, engine, *_ = primary
    old = stub.Prefill(primary_pb2.PrefillRequest(request_id="victim", token_ids=PROMPT)).kv_lease
    lease = stub.Prefill(  # a recovery, by the lease's holder
        primary_pb2.PrefillRequest(request_id="victim", token_ids=PROMPT, kv_lease=old)
    ).kv_lease
    kv_bytes = engine.kv_bytes
    for wrong in ("", "0" * 32, old):
        for call in (
            lambda: stub.Decode(
                primary_pb2.DecodeRequest(request_id="victim", committed_token_ids=[9], kv_lease=wrong)
            ),
            lambda: stub.Verify(primary_pb2.VerifyRequest(request_id="victim", kv_lease=wrong)),
            lambda: stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="victim", kv_lease=wrong)),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            assert e.value.details() == "request_id: no active request 'victim' on this primary"
    assert engine.token_ids("victim") == PROMPT and engine.kv_bytes == kv_bytes, "nothing was stepped or freed"
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="victim", kv_lease=lease))
    assert engine.kv_bytes == 0


def test_a_prefill_of_a_live_request_without_its_lease_is_refused_and_leaves_it_running(primary):
    """Another caller cannot end a running request by re-prefilling its id (no lease, a made-up
    one, an old one): ALREADY_EXISTS, and the request steps on with its lease; its holder can."""
    stub, engine, *_ = primary
    old = stub.Prefill(primary_pb2.PrefillRequest(request_id="victim", token_ids=PROMPT)).kv_lease
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="victim", token_ids=PROMPT, kv_lease=old)).kv_lease
    kv_bytes = engine.kv_bytes
    for wrong in ("", "0" * 32, old):
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(primary_pb2.PrefillRequest(request_id="victim", token_ids=[7, 8, 9], kv_lease=wrong))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert e.value.details().startswith("request_id: request 'victim' is active on this primary")
    assert engine.token_ids("victim") == PROMPT and engine.kv_bytes == kv_bytes
    stub.Decode(primary_pb2.DecodeRequest(request_id="victim", kv_lease=lease))  # the victim steps on
    renewed = stub.Prefill(
        primary_pb2.PrefillRequest(request_id="victim", token_ids=[7, 8, 9], kv_lease=lease)
    ).kv_lease  # its holder replaces it
    assert engine.token_ids("victim") == [7, 8, 9] and renewed != lease
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="victim", kv_lease=renewed))
    assert engine.kv_bytes == 0


def test_a_slot_idle_for_the_takeover_period_may_be_prefilled_without_its_lease(primary):
    """A gateway that died after re-prefilling, before it stored the new lease, leaves its successor
    the old one: once the slot has had no call for takeover_s its holder is presumed dead and the
    successor's Prefill replaces it; a call within that period keeps the holder's claim."""
    stub, engine, servicer, clock = primary
    old = stub.Prefill(primary_pb2.PrefillRequest(request_id="orphan", token_ids=PROMPT)).kv_lease
    lost = stub.Prefill(primary_pb2.PrefillRequest(request_id="orphan", token_ids=PROMPT, kv_lease=old)).kv_lease
    clock.now += servicer.leases.takeover_s * 0.75
    stub.Decode(primary_pb2.DecodeRequest(request_id="orphan", kv_lease=lost))  # its holder is alive: renewed
    clock.now += servicer.leases.takeover_s * 0.75
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(primary_pb2.PrefillRequest(request_id="orphan", token_ids=[7, 8, 9], kv_lease=old))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    clock.now += servicer.leases.takeover_s * 0.25
    adopted = stub.Prefill(primary_pb2.PrefillRequest(request_id="orphan", token_ids=[7, 8, 9], kv_lease=old)).kv_lease
    assert engine.token_ids("orphan") == [7, 8, 9] and adopted not in (old, lost)
    with pytest.raises(grpc.RpcError) as e:  # the presumed-dead holder's lease is void
        stub.Decode(primary_pb2.DecodeRequest(request_id="orphan", kv_lease=lost))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="orphan", kv_lease=adopted))
    assert engine.kv_bytes == 0


def _full_kv_and_a_queued_prefill(primary, request_id: str) -> tuple[list[str], grpc.Future]:  # noqa: ANN001
    """KV filled by 500-token requests fill0, fill1, ... (their leases), and request_id's Prefill of as
    many tokens, queued for room (its call, under way)."""
    stub, engine, servicer, _ = primary
    leases = [
        stub.Prefill(primary_pb2.PrefillRequest(request_id=f"fill{i}", token_ids=[5] * 500)).kv_lease
        for i in range(engine.kv_cache.max_bytes // engine.kv_bytes_to_open(500))
    ]
    queued = stub.Prefill.future(primary_pb2.PrefillRequest(request_id=request_id, token_ids=[5] * 500), timeout=120)
    give_up = time.monotonic() + 60
    while servicer.worker.num_waiting == 0 and time.monotonic() < give_up:
        time.sleep(0.01)
    assert servicer.worker.num_waiting == 1
    return leases, queued


def test_a_prefill_of_a_request_whose_prefill_is_queued_is_refused(primary):
    """A queued Prefill (waiting for KV room) has granted no lease yet: nobody can replace it."""
    stub, engine, servicer, _ = primary
    leases, queued = _full_kv_and_a_queued_prefill(primary, "queued")
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(primary_pb2.PrefillRequest(request_id="queued", token_ids=[6] * 10), timeout=60)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="fill0", kv_lease=leases[0]))
    leases[0] = queued.result().kv_lease  # the queued one was admitted, untouched
    assert engine.token_ids("queued") == [5] * 500
    for i, lease in enumerate(leases):
        stub.Release(
            primary_pb2.PrimaryServiceReleaseRequest(request_id="queued" if i == 0 else f"fill{i}", kv_lease=lease)
        )
    assert engine.kv_bytes == 0


def test_a_queued_prefill_whose_caller_went_away_leaves_the_queue_and_takes_no_slot(primary):
    """A Prefill waiting for KV room whose call ends (its gateway's request was cancelled or ran out of
    time) leaves the queue at once. Before, it stayed queued until its own deadline and, once room
    came, took a slot under a lease nobody had received: the KV stayed held until the lease expired."""
    stub, engine, servicer, _ = primary
    leases, gone = _full_kv_and_a_queued_prefill(primary, "gone")
    gone.cancel()
    give_up = time.monotonic() + 30  # the primary hears of the cancel on its own threads
    while servicer.worker.num_waiting == 1 and time.monotonic() < give_up:
        time.sleep(0.01)
    assert servicer.worker.num_waiting == 0
    for i, lease in enumerate(leases):  # room again: nothing queued takes it
        stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=f"fill{i}", kv_lease=lease))
    servicer.worker.call(lambda engine: None)  # a turn of the engine thread after the releases
    assert not engine.has_request("gone") and engine.kv_bytes == 0


def test_prefills_beyond_the_bound_are_refused_so_the_calls_that_free_kv_room_find_a_thread(primary):
    """A Prefill waiting for KV room holds an RPC thread. Before, enough of them (several gateways'
    requests) took every thread of the server, and the Release that would free room waited for one
    until the Prefills' deadlines passed. Past max_prefills a Prefill is refused at once,
    RESOURCE_EXHAUSTED with a retry hint, and a Release is served."""
    _, engine, fixture_servicer, _ = primary
    servicer = PrimaryServicer(
        fixture_servicer.loaded, fixture_servicer.worker, fixture_servicer.identity, 64 << 20, max_prefills=2
    )
    with primary_stub(servicer, max_workers=3) as stub:  # two Prefills' threads, one for the rest
        leases = [
            stub.Prefill(primary_pb2.PrefillRequest(request_id=f"fill{i}", token_ids=[5] * 500)).kv_lease
            for i in range(engine.kv_cache.max_bytes // engine.kv_bytes_to_open(500))
        ]
        queued = [
            stub.Prefill.future(primary_pb2.PrefillRequest(request_id=f"queued{i}", token_ids=[5] * 500), timeout=120)
            for i in range(2)
        ]
        give_up = time.monotonic() + 60
        while servicer.worker.num_waiting < 2 and time.monotonic() < give_up:
            time.sleep(0.01)
        assert servicer.worker.num_waiting == 2
        with pytest.raises(grpc.RpcError) as e:
            stub.Prefill(primary_pb2.PrefillRequest(request_id="refused", token_ids=[5] * 500), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details().startswith("request_id: this primary serves 2 prefills at once already")
        assert ("retry-after-ms", "500") in e.value.trailing_metadata()
        assert not engine.has_request("refused")
        stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="fill0", kv_lease=leases[0]), timeout=30)
        stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="fill1", kv_lease=leases[1]), timeout=30)
        leases[:2] = [q.result().kv_lease for q in queued]  # admitted in the room the Releases freed
        for i, lease in enumerate(leases):
            request_id = f"queued{i}" if i < 2 else f"fill{i}"
            stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id=request_id, kv_lease=lease))
    assert engine.kv_bytes == 0


def test_a_prefill_whose_call_ended_before_it_was_queued_takes_no_slot(primary, monkeypatch):
    """A Prefill whose caller went away before the handler asked to hear of the call's end (gRPC then
    runs no callback: add_callback returns False) is cancelled at once. Before, it was queued as if its
    caller waited, and took a slot under a lease nobody received, held until the lease expired."""
    stub, engine, servicer, _ = primary
    ended, done = threading.Event(), threading.Event()
    prefill = servicer._prefill

    def after_the_call_ended(request, request_id, token_ids, prompt_logprobs, context):  # noqa: ANN001, ANN202
        try:
            give_up = time.monotonic() + 30
            while context.is_active() and time.monotonic() < give_up:
                ended.set()
                time.sleep(0.01)
            return prefill(request, request_id, token_ids, prompt_logprobs, context)
        finally:
            done.set()

    monkeypatch.setattr(servicer, "_prefill", after_the_call_ended)
    call = stub.Prefill.future(primary_pb2.PrefillRequest(request_id="early", token_ids=PROMPT))
    assert ended.wait(30)
    call.cancel()
    assert done.wait(60)
    servicer.worker.call(lambda engine: None)  # a turn of the engine thread after the call
    assert not engine.has_request("early") and engine.kv_bytes == 0


def _wait_for_queue_depth(worker: EngineWorker, depth: int) -> None:
    give_up = time.monotonic() + 30
    while worker.queue_depth != depth and time.monotonic() < give_up:
        time.sleep(0.01)
    assert worker.queue_depth == depth


@pytest.mark.parametrize("method", ["Verify", "Decode"])
def test_a_queued_verify_or_decode_whose_caller_went_away_leaves_the_queue_unrun(primary, method):
    """A Verify or Decode whose call ends (its caller cancelled, or its deadline passed) while it waits
    for the engine leaves the queue: no forward for nobody, and its RPC thread is free. Before, only
    Prefill and DecodeStream heard of their call's end: a Verify ran its tree, a Decode its whole run."""
    stub, engine, servicer, _ = primary
    worker = servicer.worker
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="gone", token_ids=PROMPT)).kv_lease
    num_items = worker.stats.num_items
    held = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(worker.call, lambda engine: held.wait())  # the engine thread, busy
        try:
            _wait_for_queue_depth(worker, 0)
            if method == "Verify":
                tree = common_pb2.TokenTree(token_ids=[700, 701], parents=[-1, 0])
                call = stub.Verify.future(primary_pb2.VerifyRequest(request_id="gone", tree=tree, kv_lease=lease))
            else:
                call = stub.Decode.future(primary_pb2.DecodeRequest(request_id="gone", kv_lease=lease, max_tokens=8))
            _wait_for_queue_depth(worker, 1)  # the call's work, in the engine thread's inbox
            call.cancel()
            _wait_for_queue_depth(worker, 2)  # and the turn that sees its end
        finally:
            held.set()
        holding.result()
    worker.call(lambda engine: None)  # the turns after
    assert worker.stats.num_items == num_items, "nothing ran for the call"
    assert engine.token_ids("gone") == PROMPT
    stub.Decode(primary_pb2.DecodeRequest(request_id="gone", kv_lease=lease))  # the request steps on
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="gone", kv_lease=lease))
    assert engine.kv_bytes == 0


def test_slots_without_a_call_for_the_lease_period_are_released(primary):
    stub, engine, servicer, clock = primary
    stub.Prefill(primary_pb2.PrefillRequest(request_id="ghost", token_ids=PROMPT))  # nobody follows up
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="busy", token_ids=PROMPT)).kv_lease
    clock.now += LEASE_S * 0.75
    stub.Decode(primary_pb2.DecodeRequest(request_id="busy", kv_lease=lease))  # a step renews the lease
    assert servicer.expire_idle_requests() == []
    clock.now += LEASE_S * 0.5
    assert servicer.expire_idle_requests() == ["ghost"]
    assert not engine.has_request("ghost") and engine.has_request("busy")
    clock.now += LEASE_S
    assert servicer.expire_idle_requests() == ["busy"]
    assert engine.kv_bytes == 0 and engine.num_active_requests == 0
    with pytest.raises(grpc.RpcError) as e:  # its gateway re-prefills when it sees this
        stub.Decode(primary_pb2.DecodeRequest(request_id="busy", kv_lease=lease))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_streamed_run_renews_its_lease_at_every_step(primary):
    """A DecodeStream run may go on for far longer than the lease period (a long answer, under load):
    each of its steps renews the request's lease, so expiry leaves a slot whose run is stepping. Before,
    only the call's start renewed it: expiry released the slot mid-run and the run failed NOT_FOUND."""
    stub, engine, servicer, clock = primary
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="long", token_ids=PROMPT)).kv_lease
    call = stub.DecodeStream(primary_pb2.DecodeRequest(request_id="long", kv_lease=lease, max_tokens=40))
    tokens = list(next(call).token_ids)

    def lease_period_passes(engine: Engine) -> None:  # between two steps of the run, on the engine thread
        clock.now += LEASE_S * 1.5

    servicer.worker.call(lease_period_passes)
    # queued behind the engine step that follows the call above: a step of the run, which renewed the lease
    assert servicer.expire_idle_requests() == []
    tokens += [t for m in call for t in m.token_ids]
    assert len(tokens) == 40 and engine.has_request("long")
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="long", kv_lease=lease))


def test_penalties_process_every_tree_row_from_its_own_history(primary):
    """VerifyRequest.sampling: each returned row (and its argmax) is the raw row processed from the
    context plus the node's path (specdec.penalties), as Decode processes the same position."""
    stub, engine, *_ = primary
    lease = stub.Prefill(
        primary_pb2.PrefillRequest(request_id="pen", token_ids=PROMPT + [700], num_prompt_tokens=len(PROMPT))
    ).kv_lease
    tree = common_pb2.TokenTree(token_ids=[700, 701, 700], parents=[-1, 0, 1])
    fp32 = common_pb2.LOGITS_FORMAT_FP32

    def verify(sampling: common_pb2.SamplingParams | None) -> primary_pb2.VerifyResponse:
        request = primary_pb2.VerifyRequest(request_id="pen", tree=tree, kv_lease=lease, logits_format=fp32)
        if sampling is not None:
            request.sampling.CopyFrom(sampling)
        return stub.Verify(request)

    raw = logits_from_pb(verify(None).logits, "logits")  # [4, V]
    banned = int(raw[0].argmax())
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=((banned, -100.0),))
    v = verify(pb.sampling_to_pb(params))
    processed = logits_from_pb(v.logits, "logits")
    expected = penalize(raw, params, PROMPT, [700], [700, 701, 700], [-1, 0, 1])
    assert torch.equal(processed, expected) and not torch.equal(processed, raw)
    assert list(v.argmax_token_ids) == expected.argmax(-1).tolist() and v.argmax_token_ids[0] != banned
    # Decode of the root's token: row 0 as Verify processed it
    d = stub.Decode(primary_pb2.DecodeRequest(request_id="pen", kv_lease=lease, sampling=pb.sampling_to_pb(params)))
    assert d.token_id == v.argmax_token_ids[0]
    with pytest.raises(grpc.RpcError) as e:
        verify(common_pb2.SamplingParams(logit_bias={engine.vocab_size: 1.0}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("sampling.logit_bias")
    stub.Release(primary_pb2.PrimaryServiceReleaseRequest(request_id="pen", kv_lease=lease))


def test_a_release_while_a_verify_writes_the_request_s_logits_slot_leaves_no_slot_behind(primary, monkeypatch):
    """A Verify's logits are written to the request's /dev/shm slot on the engine thread, in its finish;
    a Release that arrives meanwhile still removes the slot (once the request is gone, nobody can)."""
    stub, engine, servicer, _ = primary
    lease = stub.Prefill(primary_pb2.PrefillRequest(request_id="slot", token_ids=PROMPT)).kv_lease
    slots, is_writing, may_write = servicer.logits_slots, threading.Event(), threading.Event()
    write = slots.write

    def held_write(*args, **kwargs):  # on the engine thread, in the Verify's finish
        is_writing.set()
        assert may_write.wait(timeout=60)
        return write(*args, **kwargs)

    monkeypatch.setattr(slots, "write", held_write)
    verify = primary_pb2.VerifyRequest(request_id="slot", kv_lease=lease, return_handle=True)
    release = primary_pb2.PrimaryServiceReleaseRequest(request_id="slot", kv_lease=lease)
    with ThreadPoolExecutor(2) as threads:
        verified = threads.submit(stub.Verify, verify)
        assert is_writing.wait(timeout=60)
        released = threads.submit(stub.Release, release)
        for _ in range(60_000):  # until the Release's engine call is queued: its handler did all before it
            if servicer.worker.queue_depth:
                break
            time.sleep(0.001)
        may_write.set()
        name = verified.result().logits.handle.memory.segment_name
        assert released.result().freed_kv_bytes > 0
    assert not (SHM_DIR / name).exists()
    assert engine.kv_bytes == 0
