"""The raw Q4 blocks of a GGUF file: unpacked exactly, kept by the converter, served as is by int4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specdec.engine.loading import load_model
from specdec.model import native, quant
from specdec.model.gguf_blocks import Q4_BLOCKS_FILE, load_q4_blocks, unpack_q4_blocks
from specdec.model.loader import load_state_dict

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def recompose(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    n = q.shape[0]
    return (q.reshape(n, -1, 32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]).reshape(n, -1)


@pytest.mark.parametrize("tensor_type", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_unpacked_blocks_recompose_to_what_gguf_dequantizes(tensor_type):
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    data = quantize(w, tensor_type)  # [6, 3 * block bytes] uint8
    q, d, m = unpack_q4_blocks(data, tensor_type)
    assert q.shape == (6, 96) and q.max() <= 15 and d.shape == m.shape == (6, 3) and d.dtype == np.float16
    np.testing.assert_array_equal(recompose(q, d, m), dequantize(data, tensor_type))


def test_the_converter_keeps_every_q4_matrix_with_hf_row_order(default_model_dir):
    assert (default_model_dir / Q4_BLOCKS_FILE).is_file()
    blocks, state = load_q4_blocks(default_model_dir), load_state_dict(default_model_dir)
    assert len(blocks) == 7 * 30  # every block matrix of SmolLM2-135M
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ):
        q, d, m = (t.numpy() for t in blocks[name])
        np.testing.assert_array_equal(recompose(q, d, m), state[name].numpy(), err_msg=name)


@pytest.fixture(scope="module")
def int4_model(default_model_dir):
    return load_model(default_model_dir, "int4", max_positions=64, is_shared=False)


@pytest.fixture
def torch_int4_model(default_model_dir, monkeypatch):
    """int4 on torch's packed kernels: what serves where the native kernels cannot be built."""
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_status", "disabled by the test")
    return load_model(default_model_dir, "int4", max_positions=64, is_shared=False)


def file_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The file's Q4 blocks re-assembled as GGUF lays out Q4_1: fp16 d, fp16 m, 16 nibble bytes."""
    n, k = q.shape
    g = q.view(n, k // 32, 32)
    nibbles = g[..., :16] | (g[..., 16:] << 4)
    return torch.cat((d.view(torch.uint8).view(n, -1, 2), m.view(torch.uint8).view(n, -1, 2), nibbles), -1).view(n, -1)


@pytest.mark.parametrize("layer, matrix", [(0, "q_proj"), (3, "k_proj"), (11, "o_proj"), (29, "down_proj")])
def test_served_int4_weights_are_the_files_blocks_byte_for_byte(default_model_dir, int4_model, layer, matrix):
    if native.library() is None:
        pytest.skip(f"native kernels: {native.status()}")
    module = "self_attn" if matrix in MATRICES[:4] else "mlp"
    q, d, m = load_q4_blocks(default_model_dir)[f"model.layers.{layer}.{module}.{matrix}.weight"]
    linear = getattr(getattr(int4_model.model.layers[layer], module), matrix)
    assert isinstance(linear, native.QuantLinear) and linear.q4 is not None
    # the kernels' layout interleaves 16 output columns (`native.pack_q4_1`); undone, the file's blocks
    assert torch.equal(file_blocks(*native.unpack_q4_1(*linear.q4)), file_blocks(q, d, m))


@pytest.mark.parametrize("layer, matrix", [(0, "q_proj"), (29, "down_proj")])
def test_torch_served_int4_weights_are_the_files_blocks(default_model_dir, torch_int4_model, layer, matrix):
    module = "self_attn" if matrix in MATRICES[:4] else "mlp"
    name = f"model.layers.{layer}.{module}.{matrix}.weight"
    q, d, m = load_q4_blocks(default_model_dir)[name]
    linear = getattr(getattr(torch_int4_model.model.layers[layer], module), matrix)
    assert isinstance(linear, quant.Int4Linear)
    k = q.shape[1]
    served = linear(torch.eye(k, dtype=torch.bfloat16)).t().float()  # [N, K], rounded to bf16 on output
    # the kernel's format: scale = bf16(d), zero = bf16(m + 8d)
    scale, zero = d.bfloat16().float(), (m.float() + 8 * d.float()).bfloat16().float()
    expected = (q.float().view(-1, k // 32, 32) - 8) * scale[..., None] + zero[..., None]
    assert torch.equal(served, expected.view(-1, k).bfloat16().float())
    # against the file's float weights: the bf16 rounding of scale and zero, then of the output
    file_w = torch.from_numpy(recompose(q.numpy(), d.numpy(), m.numpy()))
    bound = 2**-8 * (8 * d.float().abs() + (m.float() + 8 * d.float()).abs())[..., None].expand(-1, -1, 32)
    assert ((served - file_w).abs() <= bound.reshape(-1, k) + 2**-8 * served.abs()).all()


def test_int4_memory_is_within_1_2x_the_gguf_file(default_gguf_path, int4_model):
    assert int4_model.weight_bytes <= 1.2 * default_gguf_path.stat().st_size
    model = int4_model.model  # one 8-bit copy serves the lookup and the lm_head
    assert model.embed_tokens.element_size() == 1
    if isinstance(model.lm_head, native.QuantLinear):
        assert model.lm_head.int8 is not None and model.lm_head.int8[0].data_ptr() == model.embed_tokens.data_ptr()
