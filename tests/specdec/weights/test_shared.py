"""Shared weights: another process maps the primary's segment, sees the same bytes without a
copy, and the model built on them gives identical logits."""

from __future__ import annotations

import dataclasses
import errno
import gc
import json
import os
import stat
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import config_to_json, load_model
from specdec.weights import shared as shared_module
from specdec.weights.shared import (
    KIND_CUDA_IPC,
    SHM_DIR,
    HandleError,
    SharedWeights,
    TensorDescriptor,
    WeightManifest,
    attach,
    cleanup_stale_segments,
    manifest_from_dict,
    manifest_to_dict,
)

CHILD = Path(__file__).with_name("attach_child.py")
REPO = Path(__file__).parents[3]
TOKENS = [1, 504, 3458, 282, 260, 2114]


@pytest.fixture(scope="module")
def shared_model(default_model_dir):
    loaded = load_model(default_model_dir, "fp32", max_positions=256, is_shared=True)
    yield loaded
    loaded.shared.unlink()


@pytest.fixture(scope="module")
def shared_int4_model(default_model_dir):
    loaded = load_model(default_model_dir, "int4", max_positions=256, is_shared=True)
    yield loaded
    loaded.shared.unlink()


@pytest.mark.parametrize("model_fixture", ["shared_model", "shared_int4_model"])
def test_child_process_maps_the_same_pages_and_computes_the_same_logits(model_fixture, request, tmp_path):
    shared_model = request.getfixturevalue(model_fixture)  # int4: packed uint8/int8 tensors, same layers
    manifest = shared_model.shared.manifest
    request = {
        "manifest": manifest_to_dict(manifest),
        "config": config_to_json(shared_model.config),
        "token_ids": TOKENS,
        "tree_token_ids": [700, 701, 702],
        "tree_parents": [-1, 0, -1],
        "logits_path": str(tmp_path / "logits.f32"),
    }
    out = subprocess.run(
        [sys.executable, str(CHILD)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["is_mapped"], "a tensor of the child's model does not point into the shared segment"
    # The child touched every weight page, yet owns none privately: they are the owner's pages.
    assert report["smaps"]["Rss"] * 1024 >= 0.9 * manifest.total_bytes
    assert report["smaps"]["Private_Dirty"] == 0 and report["smaps"].get("Anonymous", 0) == 0
    own = sum(float(t.float().sum()) for t in shared_model.shared.tensors.values())
    assert report["checksum"] == own

    engine = Engine(shared_model.model, KVCache(shared_model.config, shared_model.model.kv_dtype), 256)
    engine.open("owner", TOKENS)
    expected = engine.verify("owner", [700, 701, 702], [-1, 0, -1])
    got = torch.from_numpy(np.fromfile(tmp_path / "logits.f32", dtype=np.float32)).view_as(expected)
    assert torch.equal(got, expected)


def test_owner_runs_on_the_segment_itself(shared_model):
    # No private copy in the owner either: the model's tensors are views of the segment.
    base = shared_model.shared.tensors["model.embed_tokens.weight"]
    assert shared_model.model.embed_tokens.data_ptr() == base.data_ptr()
    assert shared_model.weight_bytes <= shared_model.shared.num_bytes


def test_bad_manifests_are_refused(shared_model):
    m = shared_model.shared.manifest
    cases = {
        "segment_name": dataclasses.replace(m, segment_name="specdec-weights-no-such-segment"),
        "total_bytes": dataclasses.replace(m, total_bytes=m.total_bytes + 64),
        "tensors.offset": dataclasses.replace(m, tensors=(dataclasses.replace(m.tensors[0], offset=m.total_bytes),)),
        "tensors.shape": dataclasses.replace(m, tensors=(dataclasses.replace(m.tensors[0], shape=(3, 3)),)),
        "tensors.dtype": dataclasses.replace(m, tensors=(dataclasses.replace(m.tensors[0], dtype="int4"),)),
        "kind": dataclasses.replace(m, kind="rdma"),
        "cuda_ipc_handle": dataclasses.replace(m, kind="cuda_ipc", cuda_ipc_handle=b"short"),
    }
    for field, bad in cases.items():
        with pytest.raises(HandleError) as e:
            attach(bad)
        assert e.value.field == field
    with pytest.raises(HandleError, match="segment_name"):
        attach(dataclasses.replace(m, segment_name="../../etc/passwd"))


def test_the_manifest_carries_the_layout_of_every_matrix(shared_int4_model):
    """The peer builds its layers from the owner's records; a manifest without them (an owner that
    predates them) has the same layouts read from its tensor names."""
    m, owner = shared_int4_model.shared.manifest, shared_int4_model.model
    assert {x.module: x for x in m.matrices} == owner.matrices
    assert len(owner.matrices) == 1 + 7 * shared_int4_model.config.num_hidden_layers  # tied head: the embedding
    assert attach(m).matrices == owner.matrices
    assert attach(dataclasses.replace(m, matrices=())).matrices == owner.matrices
    assert manifest_from_dict(json.loads(json.dumps(manifest_to_dict(m)))) == m


def test_bad_matrix_records_are_refused(shared_int4_model):
    m = shared_int4_model.shared.manifest
    x = m.matrices[1]
    cases = [
        ("matrices.tensors", dataclasses.replace(x, tensors=x.tensors[:1])),
        ("matrices.tensors", dataclasses.replace(x, tensors=tuple("not." + t for t in x.tensors))),
        ("matrices.shape", dataclasses.replace(x, shape=(0, x.shape[1]))),
    ]
    for field, bad in cases:
        with pytest.raises(HandleError) as e:
            attach(dataclasses.replace(m, matrices=(bad,)))
        assert e.value.field == field


def test_stale_segments_of_dead_owners_are_cleaned(tmp_path):
    dead = SHM_DIR / "specdec-weights-999999999-deadbeef"
    dead.write_bytes(b"x" * 64)
    assert dead.name in cleanup_stale_segments()
    assert not dead.exists()


def test_a_segment_left_by_an_earlier_process_of_the_same_pid_is_cleaned():
    """A restarted container's primary has its predecessor's pid: the segment a killed predecessor left
    is stale (written before this process started), while this process's own live segment is kept."""
    live = SharedWeights.create({"a": torch.arange(4, dtype=torch.float32)})
    left = SHM_DIR / f"specdec-weights-{os.getpid()}-{'0' * 32}"
    left.write_bytes(b"x" * 64)
    long_ago = time.time() - 30 * 24 * 3600  # before this process started
    os.utime(left, (long_ago, long_ago))
    try:
        assert left.name in cleanup_stale_segments()
        assert not left.exists() and (SHM_DIR / live.manifest.segment_name).exists()
    finally:
        left.unlink(missing_ok=True)
        live.unlink()


def test_a_dev_shm_too_small_for_the_weights_is_an_error_not_a_crash(monkeypatch):
    """The segment's memory is reserved when it is made: a /dev/shm short of it (a container's 64 MB
    default) is an OSError that says so and leaves no file, not a SIGBUS in the copy that follows."""
    made = []

    def no_room(fd, offset, length):
        made.append(os.readlink(f"/proc/self/fd/{fd}"))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(OSError) as e:
        SharedWeights.create({"a": torch.arange(1024, dtype=torch.float32)})
    assert e.value.errno == errno.ENOSPC and "4096-byte weight segment" in str(e.value) and "shm_size" in str(e.value)
    assert len(made) == 1 and not Path(made[0]).exists()


def mixed_dtype_weights(num_floats: int) -> dict[str, torch.Tensor]:
    """A tensor of each weight dtype (`a`: `num_floats` float32 values, then bf16, fp8, int8), for a
    segment's round trip; sizes that are no multiple of 64 bytes make the segment pad its offsets."""
    return {
        "a": torch.arange(num_floats, dtype=torch.float32),
        "b": torch.ones(3, 5, dtype=torch.bfloat16),
        "c": torch.full((7,), 0.5).to(torch.float8_e4m3fn),
        "d": torch.arange(-3, 3, dtype=torch.int8),
    }


def test_a_segment_of_mixed_dtypes_round_trips():
    weights = mixed_dtype_weights(10) | {"e": torch.arange(6, dtype=torch.uint8).view(2, 3)}
    shared = SharedWeights.create(weights)
    try:
        views = attach(shared.manifest)
        for name, t in weights.items():
            assert views[name].dtype == t.dtype and torch.equal(views[name].float(), t.float())
        assert all(d.offset % 64 == 0 for d in shared.manifest.tensors)
    finally:
        shared.unlink()


def test_a_segment_is_its_owner_s_alone_under_an_unguessable_name():
    """0600 whatever the umask, and 128 random bits in the name (after "specdec-weights-<pid>-")."""
    old_umask = os.umask(0o022)
    try:
        shared = SharedWeights.create({"a": torch.arange(4, dtype=torch.float32)})
    finally:
        os.umask(old_umask)
    try:
        name = shared.manifest.segment_name
        assert stat.S_IMODE((SHM_DIR / name).stat().st_mode) == 0o600
        random_part = name.removeprefix(f"specdec-weights-{os.getpid()}-")
        assert len(random_part) == 32 and int(random_part, 16) >= 0  # 16 bytes, hex
    finally:
        shared.unlink()


def test_an_offered_cuda_manifest_maps_only_the_exported_device_and_size(monkeypatch):
    """An opened CUDA IPC handle has no size to check: the mapping extends as far as the manifest's
    total_bytes says. The owner's own handle offered with a larger total_bytes (or another device) is
    refused before the handle is opened. (The CUDA runtime is stood in for: no GPU here.)"""
    opened = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        shared_module,
        "_cuda_open_exported",
        lambda m: opened.append(m) or torch.zeros(m.total_bytes, dtype=torch.uint8),
    )
    tensors = (TensorDescriptor("a", "float32", (16,), 0, 64),)
    announced = WeightManifest(KIND_CUDA_IPC, "", bytes(range(64)), 0, 64, "owner", tensors)
    cases = {
        "total_bytes": dataclasses.replace(
            announced, total_bytes=1 << 30, tensors=(TensorDescriptor("a", "float32", (1 << 28,), 0, 1 << 30),)
        ),
        "device_index": dataclasses.replace(announced, device_index=1),
    }
    for field, offered in cases.items():
        with pytest.raises(HandleError) as e:
            attach(offered, announced)
        assert e.value.field == field
    assert not opened
    assert attach(announced, announced)["a"].shape == (16,) and len(opened) == 1


def fake_cupy_ipc(monkeypatch) -> list[str]:
    """Installs a stand-in for the CuPy calls that open and close a CUDA IPC handle (no GPU here): the
    mapping is host memory, held as CuPy holds it (array -> memory pointer -> memory -> its owner),
    and exported to torch through DLPack as CuPy does. Returns the log of opens and closes."""
    events: list[str] = []

    class Mapped(np.ndarray):
        memptr: object = None

    def ndarray(shape, dtype, memptr):
        array = np.zeros(shape, dtype=dtype).view(Mapped)
        array.memptr = memptr
        return array

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    runtime = types.SimpleNamespace(
        CUDARuntimeError=type("CUDARuntimeError", (RuntimeError,), {}),
        cudaIpcMemLazyEnablePeerAccess=1,
        ipcOpenMemHandle=lambda handle, flags: events.append("open") or 0x1000,
        ipcCloseMemHandle=lambda ptr: events.append("close"),
    )
    cuda = types.SimpleNamespace(
        Device=Device,
        runtime=runtime,
        UnownedMemory=lambda ptr, size, owner, device_id: types.SimpleNamespace(ptr=ptr, size=size, owner=owner),
        MemoryPointer=lambda mem, offset: types.SimpleNamespace(mem=mem, offset=offset),
    )
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, ndarray=ndarray, uint8=np.uint8))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return events


def test_a_cuda_ipc_mapping_is_closed_once_its_last_view_is_freed(monkeypatch):
    """Every open of a handle must be closed: a draft pool re-attaching to a restarted primary kept
    each earlier mapping for good. The mapping lives exactly as long as a view of it does."""
    events = fake_cupy_ipc(monkeypatch)
    tensors = (TensorDescriptor("a", "float32", (16,), 0, 64), TensorDescriptor("b", "int8", (64,), 64, 64))
    weights = attach(WeightManifest(KIND_CUDA_IPC, "", bytes(range(64)), 0, 128, "owner", tensors))
    view = weights["b"]
    del weights
    gc.collect()
    assert events == ["open"]  # a view is still in use
    del view
    gc.collect()
    assert events == ["open", "close"]
