"""Weights shared through CUDA IPC (skipped without a CUDA device): another process opens the
primary's one allocation from the manifest's handle, sees the same bytes without a copy, and the
model built on them gives the owner's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import config_to_json
from specdec.model.llama import Transformer
from specdec.weights.shared import KIND_CUDA_IPC, SharedWeights, manifest_to_dict
from tests.specdec.model.test_layout import tiny_config, tiny_state_dict
from tests.specdec.weights.test_shared import mixed_dtype_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

HERE = Path(__file__).parent
REPO = Path(__file__).parents[3]
TOKENS = [1, 5, 9, 12]
TREE = ([3, 7, 7, 30], [-1, 0, -1, 2])  # token_ids, parents


def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def child(script: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE / script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()
    )


def test_a_peer_opens_the_same_device_memory_and_sees_the_owner_s_writes():
    weights = mixed_dtype_weights(1000)
    shared = SharedWeights.create(weights, device="cuda")
    assert shared.manifest.kind == KIND_CUDA_IPC and len(shared.manifest.cuda_ipc_handle) == 64
    assert all(t.is_cuda for t in shared.tensors.values())
    proc = child("attach_cuda_child.py")
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(manifest_to_dict(shared.manifest)) + "\n")
    proc.stdin.flush()
    first = json.loads(proc.stdout.readline())
    expected = {n: int(t.reshape(-1).view(torch.uint8).to(torch.int64).sum()) for n, t in weights.items()}
    assert first == {"checksums": expected, "devices": ["cuda:0"]}
    shared.tensors["d"].view(torch.uint8)[0] = 77  # the owner writes; the peer must see it
    torch.cuda.synchronize()
    proc.stdin.write("d\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"first_byte": 77}
    assert proc.wait(timeout=60) == 0


def test_the_model_on_a_peer_s_mapping_computes_the_owner_s_logits(tmp_path):
    config = tiny_config()
    shared = SharedWeights.create(tiny_state_dict(config), device="cuda")
    owner = Transformer(config, shared.model_weights(), 64)
    engine = Engine(owner, KVCache(config, owner.kv_dtype, device="cuda"), 64)
    engine.open("owner", TOKENS)
    expected = engine.verify("owner", *TREE).float().cpu()
    request = {
        "manifest": manifest_to_dict(shared.manifest),
        "config": config_to_json(config),
        "token_ids": TOKENS,
        "tree_token_ids": TREE[0],
        "tree_parents": TREE[1],
        "logits_path": str(tmp_path / "logits.f32"),
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "attach_cuda_model_child.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = torch.from_file(request["logits_path"], size=expected.numel(), dtype=torch.float32).view(expected.shape)
    assert torch.equal(got, expected)
