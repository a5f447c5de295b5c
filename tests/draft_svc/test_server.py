"""The draft service over gRPC: Propose/Release translation and errors, Attach validation, attaching
to a (fake) primary and following its restarts, and a real `python -m draft_svc` process whose memory
beyond the shared weights is its own small state."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from draft_svc.__main__ import build
from draft_svc.config import from_args
from draft_svc.metrics import DraftMetrics
from specdec.propose_args import ProposeArgs
from draft_svc.primary_client import GrpcPrimaryClient
from specdec import pb
from specdec.engine.loading import config_to_json, load_model
from specdec.features import encode_features
from specdec.logits_shm import LogitsSlots
from specdec.service.health import wait_for_serving
from specdec.service.interceptor import ErrorInterceptor
from specdec.service.server import create_server
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, primary_pb2, primary_pb2_grpc
from specdec.weights.shared import SHM_DIR
from specdec.weights.wire import manifest_to_pb

REPO = Path(__file__).parents[2]
MAX_CONTEXT = 256
PROMPT = [1, 504, 3458, 282, 260, 2114, 30, 365, 504, 3458]
FEATURES = common_pb2.Features(dtype="float16", num_rows=1, hidden_size=4, data=bytes(8))  # one row of zeros


class FakePrimary(primary_pb2_grpc.PrimaryServiceServicer):
    """GetModelInfo + ExportWeights of a primary that owns `loaded`'s real shared segment."""

    def __init__(self, loaded) -> None:
        self.loaded = loaded
        self.instance_id = loaded.shared.manifest.owner_instance_id
        self.num_exports = 0
        self.is_down = False  # answers UNAVAILABLE, as a primary still loading its model

    def manifest_pb(self) -> common_pb2.WeightManifest:
        manifest = dataclasses.replace(self.loaded.shared.manifest, owner_instance_id=self.instance_id)
        return manifest_to_pb(manifest, config_to_json(self.loaded.config), "fp32", "smollm2-test")

    def GetModelInfo(self, request, context):
        if self.is_down:
            context.abort(grpc.StatusCode.UNAVAILABLE, "loading")
        c = self.loaded.config
        return primary_pb2.GetModelInfoResponse(
            model_id="smollm2-test",
            model_config_json=config_to_json(c),
            precision="fp32",
            vocab_size=c.vocab_size,
            max_context_length=MAX_CONTEXT,
            instance_id=self.instance_id,
        )

    def ExportWeights(self, request, context):
        self.num_exports += 1
        return primary_pb2.ExportWeightsResponse(manifest=self.manifest_pb())


@pytest.fixture(scope="module")
def owner(default_model_dir):
    torch.set_num_threads(2)
    loaded = load_model(default_model_dir, "fp32", max_positions=MAX_CONTEXT, is_shared=True)
    yield loaded
    loaded.shared.unlink()


@pytest.fixture(scope="module")
def primary(owner):
    fake = FakePrimary(owner)
    server, port = create_server("127.0.0.1:0", [(primary_pb2_grpc.add_PrimaryServiceServicer_to_server, fake)])
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(0)


@contextlib.contextmanager
def _served(servicer) -> Iterator[draft_pb2_grpc.DraftServiceStub]:  # noqa: ANN001
    """The draft servicer on an in-process gRPC server (port 0), and a stub of it."""
    server, port = create_server(
        "127.0.0.1:0",
        [(draft_pb2_grpc.add_DraftServiceServicer_to_server, servicer)],
        interceptors=[ErrorInterceptor()],
    )
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield draft_pb2_grpc.DraftServiceStub(channel)
    finally:
        channel.close()
        server.stop(0)


@pytest.fixture()
def draft(primary):
    """An in-process draft service (port 0) whose attacher is driven by the test (no monitor thread)."""
    fake, address = primary
    config = from_args(
        [
            "--primary_address",
            address,
            "--strategies",
            "prompt_lookup,early_exit,layer_skip",
            "--early_exit_layers",
            "2",
            "--skipped_layers",
            ",".join(map(str, range(3, 30))),
        ],
        {},
    )
    client = GrpcPrimaryClient(address)
    servicer, pool, attacher = build(config, client)
    with _served(servicer) as stub:
        yield stub, pool, attacher
    pool.close()
    client.close()


def _code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_propose_and_release_over_grpc_before_and_after_attaching(draft, primary):
    stub, pool, attacher = draft
    request = draft_pb2.ProposeRequest(
        request_id="r", prompt_token_ids=PROMPT, draft_length=2, strategies=["prompt_lookup", "early_exit"]
    )
    # Not attached yet: prompt lookup works ([504 3458] occurred before: 282 260 follows), early exit is empty.
    r = stub.Propose(request)
    assert list(r.decoders) == ["prompt_lookup", "early_exit"]
    assert list(r.tree.token_ids) == [282, 260] and list(r.tree.parents) == [-1, 0]
    assert list(r.node_sources) == [0b01, 0b01]
    assert [(s.name, s.num_proposed) for s in r.decoder_stats] == [("prompt_lookup", 2), ("early_exit", 0)]
    assert not r.continuations  # none asked for
    # the same step with continuation_length: prompt lookup's tokens past the draft, after its leaf
    r = stub.Propose(
        draft_pb2.ProposeRequest(
            request_id="r2",
            prompt_token_ids=PROMPT,
            draft_length=2,
            strategies=["prompt_lookup"],
            continuation_length=3,
        )
    )
    assert list(r.tree.token_ids) == [282, 260] and len(r.continuations) == 1
    c = r.continuations[0]
    assert c.leaf == 1 and c.decoder == "prompt_lookup" and 1 <= len(c.token_ids) <= 3
    stub.Release(draft_pb2.DraftServiceReleaseRequest(request_id="r2"))

    assert attacher.refresh().instance_id == primary[0].instance_id
    r = stub.Propose(
        draft_pb2.ProposeRequest(
            request_id="r", new_token_ids=[282], draft_length=2, strategies=["early_exit", "layer_skip"]
        )
    )
    assert [(s.name, s.num_proposed) for s in r.decoder_stats] == [("early_exit", 2), ("layer_skip", 2)]
    assert len(r.tree.token_ids) >= 2 and r.time_ms > 0
    stub.Release(draft_pb2.DraftServiceReleaseRequest(request_id="r", is_finished=True))
    assert pool.num_requests == 0
    stub.Release(draft_pb2.DraftServiceReleaseRequest(request_id="r"))  # idempotent: released already, OK
    assert pool.num_requests == 0
    code, details = _code_and_details(lambda: stub.Release(draft_pb2.DraftServiceReleaseRequest(request_id="")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "request_id: must not be empty"
    bad = draft_pb2.DraftServiceReleaseRequest(request_id="r", is_finished=True, new_token_ids=[10**6])
    code, details = _code_and_details(lambda: stub.Release(bad))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("new_token_ids: token id 1000000")


def test_the_state_gauges_fall_when_a_request_is_released(primary):
    """specdec_draft_requests and specdec_draft_state_bytes say what the pool holds once a Release
    dropped a request's state, not what it held at the last Propose."""
    _, address = primary
    config = from_args(["--primary_address", address, "--strategies", "early_exit", "--early_exit_layers", "2"], {})
    client = GrpcPrimaryClient(address)
    metrics = DraftMetrics(CollectorRegistry())
    servicer, pool, attacher = build(config, client, metrics)
    value = metrics.registry.get_sample_value
    try:
        with _served(servicer) as stub:
            attacher.refresh()
            propose = draft_pb2.ProposeRequest(
                request_id="r", prompt_token_ids=PROMPT, draft_length=2, strategies=["early_exit"]
            )
            stub.Propose(propose)
            assert value("specdec_draft_requests") == 1
            assert value("specdec_draft_state_bytes") == pool.num_kv_bytes > 0  # the early exit's KV
            stub.Release(draft_pb2.DraftServiceReleaseRequest(request_id="r", is_finished=True))
            assert pool.num_requests == 0 and pool.num_kv_bytes == 0
            assert value("specdec_draft_requests") == 0
            assert value("specdec_draft_state_bytes") == 0
    finally:
        pool.close()
        client.close()


class GoneCaller:
    """The context of a call whose caller went away while it ran (cancelled: no answer is wanted)."""

    def is_active(self) -> bool:
        return False


def test_an_opening_propose_whose_caller_went_away_leaves_no_state(primary):
    """A request ending at its prefill cancels its first Propose and sends Release, which may reach
    the pool while that Propose still runs and find nothing: the Propose then drops the state it
    opened (before, it stayed until --request_ttl_s, 15 minutes, against max_requests); a Propose
    of a request already open keeps it."""
    _, address = primary
    config = from_args(["--primary_address", address, "--strategies", "prompt_lookup"], {})
    client = GrpcPrimaryClient(address)
    servicer, pool, _ = build(config, client)
    try:
        opening = draft_pb2.ProposeRequest(request_id="r", prompt_token_ids=PROMPT, strategies=["prompt_lookup"])
        servicer.Propose(opening, GoneCaller())
        assert pool.num_requests == 0
        with _served(servicer) as stub:
            stub.Propose(opening)
        assert pool.num_requests == 1
        step = draft_pb2.ProposeRequest(request_id="r", new_token_ids=[282], strategies=["prompt_lookup"])
        servicer.Propose(step, GoneCaller())
        assert pool.num_requests == 1
    finally:
        pool.close()
        client.close()


def test_a_restarted_primary_is_re_attached_and_decoders_rebuilt(draft, primary):
    stub, pool, attacher = draft
    fake, _ = primary
    first = attacher.refresh()
    assert attacher.refresh() is first  # same instance: nothing to do
    stub.Propose(draft_pb2.ProposeRequest(request_id="r", prompt_token_ids=PROMPT, strategies=["early_exit"]))
    (old_decoder,) = pool._requests["r"].decoders.values()
    num_exports, fake.instance_id = fake.num_exports, "restarted"
    try:
        second = attacher.refresh()
        assert second.instance_id == "restarted" and fake.num_exports == num_exports + 1
        stub.Propose(draft_pb2.ProposeRequest(request_id="r", new_token_ids=[5], strategies=["early_exit"]))
        (new_decoder,) = pool._requests["r"].decoders.values()
        assert new_decoder is not old_decoder and new_decoder.num_tokens == len(PROMPT) + 1
        assert old_decoder.num_kv_bytes == 0  # the old weights' cache was released
    finally:
        fake.instance_id = first.instance_id


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda m: m.ClearField("memory"), "manifest.memory"),
        (lambda m: setattr(m.memory, "kind", common_pb2.HANDLE_KIND_UNSPECIFIED), "manifest.memory.kind"),
        (lambda m: setattr(m.memory, "offset", 64), "manifest.memory.offset"),
        (lambda m: setattr(m.memory, "segment_name", "specdec-weights-gone"), "manifest.memory.segment_name"),
        (lambda m: setattr(m.memory, "segment_name", "../etc/passwd"), "manifest.memory.segment_name"),
        (lambda m: setattr(m.memory, "num_bytes", m.memory.num_bytes + 64), "manifest.memory.num_bytes"),
        (lambda m: setattr(m.tensors[0], "offset", 3), "manifest.tensors.offset"),
        (lambda m: m.tensors[1].shape.append(2), "manifest.tensors.shape"),
        (lambda m: setattr(m.tensors[0], "dtype", "int4"), "manifest.tensors.dtype"),
        (lambda m: m.tensors.pop(), "manifest.tensors"),
        (lambda m: setattr(m, "model_config_json", "{not json"), "manifest.model_config_json"),
        (lambda m: setattr(m, "model_config_json", json.dumps({"hidden_size": 1})), "manifest.model_config_json"),
    ],
)
def test_attach_refuses_bad_manifests_naming_the_field(draft, primary, change, field):
    stub, _, attacher = draft
    manifest = primary[0].manifest_pb()
    change(manifest)
    code, details = _code_and_details(lambda: stub.Attach(draft_pb2.AttachRequest(manifest=manifest)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field + ":"), details
    assert attacher.attached is None


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda m: setattr(m.matrices[0], "layout", 99), "manifest.matrices.layout"),  # a newer primary's layout
        (lambda m: m.matrices[0].tensors.append("model.norm.weight"), "manifest.matrices.tensors"),
        (lambda m: m.matrices[0].tensors.__setitem__(0, "no.such.tensor"), "manifest.matrices.tensors"),
        (lambda m: m.matrices[0].shape.append(2), "manifest.matrices.shape"),
    ],
)
def test_attach_refuses_bad_matrix_layouts_naming_the_field(draft, primary, change, field):
    """The primary's layout records are checked before anything is mapped, as every other field."""
    stub, _, attacher = draft
    manifest = primary[0].manifest_pb()
    assert len(manifest.matrices) == len(primary[0].loaded.model.matrices)
    change(manifest)
    code, details = _code_and_details(lambda: stub.Attach(draft_pb2.AttachRequest(manifest=manifest)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field + ":"), details
    assert attacher.attached is None


def _transposed_projection(m: common_pb2.WeightManifest) -> None:
    """A projection's shape reversed: the same bytes (the manifest checks pass), a failing forward."""
    t = next(t for t in m.tensors if "k_proj" in t.name and len(t.shape) == 2 and t.shape[0] != t.shape[1])
    t.shape[:] = list(reversed(t.shape))


@pytest.mark.parametrize(
    "change, field, message",
    [
        (
            lambda m: setattr(m, "model_config_json", "{not json"),
            "manifest.model_config_json",
            "not a usable model config (Hugging Face config.json or ModelConfig fields)",
        ),
        (
            lambda m: setattr(m, "model_config_json", json.dumps({"hidden_size": 1})),
            "manifest.model_config_json",
            "not a usable model config (Hugging Face config.json or ModelConfig fields)",
        ),
        (_transposed_projection, "manifest.tensors", "the tensors do not fit the config (a one-token forward failed)"),
    ],
)
def test_attach_errors_name_the_field_not_python_s_exception_text(draft, primary, change, field, message):
    """What went wrong inside (a JSON decoder's, a constructor's, torch's own words) is the log's."""
    stub, _, attacher = draft
    manifest = primary[0].manifest_pb()
    change(manifest)
    code, details = _code_and_details(lambda: stub.Attach(draft_pb2.AttachRequest(manifest=manifest)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"{field}: {message}; the draft service's log has the details"
    assert attacher.attached is None


def test_attach_maps_only_the_segment_the_primary_exports(draft, primary, owner):
    """Another process's valid weight segment (same layout, same size) is refused before it is mapped."""
    stub, _, attacher = draft
    impostor = SHM_DIR / f"specdec-weights-{os.getpid()}-impostor"
    impostor.write_bytes(b"\0" * owner.shared.num_bytes)
    try:
        manifest = primary[0].manifest_pb()
        manifest.memory.segment_name = impostor.name
        code, details = _code_and_details(lambda: stub.Attach(draft_pb2.AttachRequest(manifest=manifest)))
    finally:
        impostor.unlink()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("manifest.memory.segment_name: not the memory the primary exports"), details
    assert attacher.attached is None


def test_attach_maps_a_good_manifest(draft, primary, owner):
    stub, _, attacher = draft
    r = stub.Attach(draft_pb2.AttachRequest(manifest=primary[0].manifest_pb()))
    assert r.mapped_bytes == owner.shared.num_bytes
    assert attacher.attached.instance_id == primary[0].instance_id
    code, details = _code_and_details(lambda: stub.Attach(draft_pb2.AttachRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("manifest:")


def test_attach_builds_the_primary_s_layouts_with_or_without_their_records(draft, primary, owner):
    """The pool's layers follow the layouts the primary recorded; a manifest without records (a
    primary that predates them) has the same layouts read from its tensor names."""
    stub, _, attacher = draft
    for is_recorded in (True, False):
        manifest = primary[0].manifest_pb()
        if not is_recorded:
            manifest.ClearField("matrices")
        stub.Attach(draft_pb2.AttachRequest(manifest=manifest))
        assert attacher.attached.manifest.matrices == (owner.shared.manifest.matrices if is_recorded else ())
        assert attacher.attached.model.matrices == owner.model.matrices


@pytest.mark.parametrize(
    "fields, code, field",
    [
        ({"prompt_token_ids": [], "new_token_ids": [1]}, grpc.StatusCode.NOT_FOUND, "request_id"),
        ({"strategies": ["medusa"]}, grpc.StatusCode.INVALID_ARGUMENT, "strategies"),
        (
            {"strategies": ["prompt_lookup"], "speculative_degree": 2},
            grpc.StatusCode.INVALID_ARGUMENT,
            "speculative_degree",
        ),
        ({"draft_length": 1000}, grpc.StatusCode.INVALID_ARGUMENT, "draft_length"),
        ({"max_nodes": 1000}, grpc.StatusCode.INVALID_ARGUMENT, "max_nodes"),
        ({"prompt_token_ids": [1, 49152]}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        # longer than the context the primary described (GetModelInfo's max_context_length)
        ({"prompt_token_ids": [1] * (MAX_CONTEXT + 1)}, grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"),
        ({"request_id": "x" * 129}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),  # the limit of every service
        # a caller's long string is quoted shortened: quoted whole, the status message passed the client's
        # metadata limit and the caller got an unrelated error in place of the field's
        ({"strategies": ["x" * (1 << 16)]}, grpc.StatusCode.INVALID_ARGUMENT, "strategies"),
        (
            {"features": common_pb2.Features(dtype="x" * (1 << 16), num_rows=1, hidden_size=4, data=bytes(8))},
            grpc.StatusCode.INVALID_ARGUMENT,
            "features.dtype",
        ),
        (
            {
                "features": common_pb2.Features(
                    dtype="float16",
                    num_rows=1,
                    hidden_size=4,
                    memory=common_pb2.MemoryHandle(
                        kind=common_pb2.HANDLE_KIND_SHARED_MEMORY, segment_name="x" * (1 << 16), num_bytes=8
                    ),
                )
            },
            grpc.StatusCode.INVALID_ARGUMENT,
            "features.memory.segment_name",
        ),
        ({"features": FEATURES, "feature_position": 0}, grpc.StatusCode.INVALID_ARGUMENT, "feature_position"),
        ({"features": FEATURES, "feature_position": len(PROMPT)}, grpc.StatusCode.INVALID_ARGUMENT, "feature_position"),
        (
            {"features": common_pb2.Features(dtype="float32", num_rows=1, hidden_size=4, data=bytes(16))},
            grpc.StatusCode.INVALID_ARGUMENT,
            "features.dtype",
        ),
        (
            {"features": common_pb2.Features(dtype="float16", num_rows=1, hidden_size=4, data=bytes(6))},
            grpc.StatusCode.INVALID_ARGUMENT,
            "features.data",
        ),
        (
            {
                "features": common_pb2.Features(
                    dtype="float16",
                    num_rows=1,
                    hidden_size=4,
                    memory=common_pb2.MemoryHandle(
                        kind=common_pb2.HANDLE_KIND_SHARED_MEMORY, segment_name="specdec-weights", num_bytes=8
                    ),
                )
            },
            grpc.StatusCode.INVALID_ARGUMENT,
            "features.memory.segment_name",
        ),
    ],
)
def test_propose_errors_name_the_field(draft, fields, code, field):
    stub, pool, attacher = draft
    attacher.refresh()  # the vocabulary comes from the primary
    request = draft_pb2.ProposeRequest(**{"request_id": "r", "prompt_token_ids": PROMPT, **fields})
    got_code, details = _code_and_details(lambda: stub.Propose(request))
    assert got_code == code and details.startswith(field + ":"), details
    assert pool.num_requests == 0


def _smaps_rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup counters in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        out[key.rstrip(":")] = int(value) * 1024
    return out


def _segment_smaps(pid: int, segment: str) -> dict[str, int]:
    """The segment's mappings in /proc/PID/smaps, counters summed, in bytes."""
    out: dict[str, int] = {}
    is_inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:  # a mapping's header line
            is_inside = line.endswith(str(SHM_DIR / segment))
        elif is_inside and head[0].endswith(":") and len(head) == 3 and head[2] == "kB":
            out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1]) * 1024
    return out


@pytest.mark.slow
@pytest.mark.e2e
def test_a_draft_process_maps_the_weights_without_a_private_copy(primary, owner, tmp_path):
    fake, primary_address = primary
    log_path = tmp_path / "draft.log"
    fake.is_down = True  # the primary is still loading when the draft pool starts
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "draft_svc",
                "--port",
                "0",
                "--primary_address",
                primary_address,
                "--strategies",
                "prompt_lookup,early_exit,layer_skip",
                "--num_threads",
                "1",
                "--attach_poll_s",
                "0.2",
                "--allow_unauthenticated",
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        port = _wait_for_port(log_path, process)
        wait_for_serving(f"127.0.0.1:{port}", timeout_s=30)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            # Without the primary: prompt lookup serves, the model-based decoders have nothing.
            stats = _propose(stub, "before")
            assert stats["prompt_lookup"].num_proposed == 4 and stats["early_exit"].num_proposed == 0
            before = _smaps_rollup(process.pid)
            fake.is_down = False
            stats = _propose_until_model_decoders_run(stub)
            after = _smaps_rollup(process.pid)
            segment = _segment_smaps(process.pid, owner.shared.manifest.segment_name)
        weight_bytes = owner.shared.num_bytes
        private_before = before["Private_Clean"] + before["Private_Dirty"]
        private = after["Private_Clean"] + after["Private_Dirty"]
        print(
            f"\nweights {weight_bytes / 2**20:.0f} MiB; draft process before attaching: Rss "
            f"{before['Rss'] / 2**20:.0f} MiB, USS {private_before / 2**20:.0f} MiB; after attaching and "
            f"drafting: Rss {after['Rss'] / 2**20:.0f} MiB, Pss {after['Pss'] / 2**20:.0f} MiB, USS "
            f"{private / 2**20:.0f} MiB; segment Rss {segment['Rss'] / 2**20:.0f} MiB, private "
            f"{(segment['Private_Clean'] + segment['Private_Dirty']) / 2**20:.0f} MiB; first propose ms {stats}"
        )
        # Every weight page is resident in the draft process (the attach-time forward touched all of
        # them), yet none is its own: they are the owner's pages.
        assert segment["Rss"] >= 0.95 * weight_bytes
        assert segment["Private_Clean"] == segment["Private_Dirty"] == 0
        assert after["Rss"] - before["Rss"] >= 0.95 * weight_bytes
        # What attaching and drafting added to the process's own memory (model objects, rotary tables,
        # decoders' KV caches, torch's scratch) is a few percent of one copy of the weights.
        assert private - private_before < 0.1 * weight_bytes
        assert after["Pss"] < after["Rss"] - 0.4 * weight_bytes  # shared with the owner: counted half
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0  # graceful stop
    finally:
        fake.is_down = False
        if process.poll() is None:
            process.kill()
            process.wait()


def _propose(stub, request_id: str) -> dict[str, common_pb2.DecoderStats]:
    r = stub.Propose(
        draft_pb2.ProposeRequest(
            request_id=request_id,
            prompt_token_ids=PROMPT * 8,
            draft_length=4,
            strategies=["early_exit", "layer_skip", "prompt_lookup"],
        )
    )
    return {s.name: s for s in r.decoder_stats}


def _wait_for_port(log_path: Path, process: subprocess.Popen, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text()[-3000:]
        for line in log_path.read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("event") == "serving":
                return json.loads(line)["port"]
        time.sleep(0.1)
    raise TimeoutError(f"the draft service did not start: {log_path.read_text()[-3000:]}")


def _propose_until_model_decoders_run(stub, timeout_s: float = 60.0) -> dict[str, float]:
    """Propose (a new request each time) until both model-based decoders drafted: they attached."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        stats = _propose(stub, f"r{attempt}")
        if stats["early_exit"].num_proposed and stats["layer_skip"].num_proposed:
            return {name: round(s.time_ms, 1) for name, s in stats.items()}
        time.sleep(0.2)
    raise TimeoutError("the model-based decoders never ran: the weights were not attached")


def test_pool_info_lists_the_strategies_it_was_started_with(draft):
    stub, _, _ = draft
    info = stub.GetPoolInfo(draft_pb2.GetPoolInfoRequest(), timeout=10)
    assert list(info.strategies) == ["prompt_lookup", "early_exit", "layer_skip"]


def test_propose_hands_features_inline_or_from_a_logits_slot_to_the_pool(draft, monkeypatch):
    stub, pool, attacher = draft
    seen: list[ProposeArgs] = []
    propose = pool.propose
    monkeypatch.setattr(pool, "propose", lambda args: seen.append(args) or propose(args))
    rows = torch.randn(3, 8)  # a verify's root + 2 nodes
    slots = LogitsSlots("primary-1")
    try:
        name, logits = slots.write("r", torch.randn(3, 50), "fp32", encode_features(rows))
        handle = pb.features_handle_to_pb(name, encode_features(rows), len(logits.data), "primary-1")
        accepted = pb.select_feature_rows(handle, [0, 2])  # root and node 1: the accepted path
        stub.Propose(draft_pb2.ProposeRequest(request_id="r", prompt_token_ids=PROMPT))
        stub.Propose(
            draft_pb2.ProposeRequest(request_id="r", new_token_ids=[30, 31], features=accepted, feature_position=10)
        )
        inline = pb.features_to_pb(encode_features(rows[:1]))
        stub.Propose(draft_pb2.ProposeRequest(request_id="r", new_token_ids=[32], features=inline, feature_position=12))
    finally:
        slots.release_all()
    assert seen[0].features is None
    assert seen[1].feature_position == 10 and np.array_equal(seen[1].features, rows.half().float().numpy()[[0, 2]])
    assert seen[2].feature_position == 12 and np.array_equal(seen[2].features, rows.half().float().numpy()[:1])
    stub.Release(draft_pb2.DraftServiceReleaseRequest(request_id="r"))


@pytest.mark.parametrize(
    ("response_format", "field"),
    [
        (common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_TEXT), "response_format.type"),
        (common_pb2.ResponseFormat(type=99), "response_format.type"),
        (
            common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_TEXT, json_schema="{}"),
            "response_format.json_schema",
        ),
        # a pool started without grammar strategies has no tokenizer to compile with
        (
            common_pb2.ResponseFormat(type=common_pb2.ResponseFormat.TYPE_JSON_SCHEMA, json_schema="{}"),
            "response_format",
        ),
    ],
)
def test_prepare_grammar_errors_name_the_field(draft, response_format, field):
    stub, pool, attacher = draft
    request = draft_pb2.PrepareGrammarRequest(response_format=response_format)
    code, details = _code_and_details(lambda: stub.PrepareGrammar(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":"), details
