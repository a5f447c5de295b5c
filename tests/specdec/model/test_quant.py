"""Packed int4/int8 layers: the kernels' dequantization, round-to-nearest bounds, and start-up errors."""

from __future__ import annotations

import pytest
import torch

from specdec.model import native, quant
from specdec.model.config import ModelConfig
from specdec.model.precision import convert_weights
from tests.specdec.model import tiny


def int4_layer(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> quant.Int4Linear:
    t = quant.pack_int4("w", q, scale, zero)
    return quant.Int4Linear(t["w" + quant.INT4_WEIGHT], t["w" + quant.INT4_SCALES_ZEROS])


def dequantized(layer, in_features: int) -> torch.Tensor:
    """The weight [N, K] a layer multiplies by, read back through an identity input."""
    return layer(torch.eye(in_features, dtype=torch.bfloat16)).t().float()


def test_int4_kernel_computes_q_minus_8_times_scale_plus_zero():
    torch.manual_seed(0)
    q = torch.randint(0, 16, (48, 64), dtype=torch.uint8)
    scale, zero = torch.rand(48, 2).bfloat16() / 50, (torch.rand(48, 2) - 0.5).bfloat16()
    expected = (q.float().view(48, 2, 32) - 8) * scale.float()[..., None] + zero.float()[..., None]
    got = dequantized(int4_layer(q, scale, zero), 64)
    assert torch.equal(got, expected.view(48, 64).bfloat16().float())  # exact up to the bf16 output


def test_int4_round_to_nearest_is_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(32, 96)
    q, scale, zero = quant.quantize_int4(w)
    assert q.max() <= 15 and q.dtype == torch.uint8 and scale.shape == (32, 3)
    w_hat = (q.float().view(32, 3, 32) - 8) * scale.float()[..., None] + zero.float()[..., None]
    # half a step, plus the group's range lost to bf16 rounding of scale and zero
    bound = scale.float()[..., None] * 0.5 + 2**-8 * (8 * scale.float() + zero.float().abs())[..., None] + 1e-6
    assert ((w_hat - w.view(32, 3, 32)).abs() <= bound).all()


def test_int8_per_channel_round_trip_and_kernel():
    torch.manual_seed(2)
    w, x = torch.randn(40, 64), torch.randn(3, 64)
    t = quant.quantize_int8("w", w)
    q, scale = t["w" + quant.INT8_WEIGHT], t["w" + quant.INT8_SCALE]
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (40,)
    w_hat = q.float() * scale.float()[:, None]
    assert ((w_hat - w).abs() <= scale.float()[:, None] * 0.5 + 1e-6).all()
    layer = quant.Int8Linear(q, scale)
    torch.testing.assert_close(layer(x), x @ w_hat.t(), atol=0.1, rtol=0.02)  # bf16 activations
    embedding = quant.Int8Embedding(q, scale, torch.float32)
    assert torch.equal(embedding(torch.tensor([3, 0])), w_hat[[3, 0]])


@pytest.mark.parametrize(
    "make",
    [
        lambda: int4_layer(
            torch.randint(0, 16, (64, 32), dtype=torch.uint8),
            torch.ones(64, 1).bfloat16(),
            torch.zeros(64, 1).bfloat16(),
        ),
        lambda: quant.Int8Linear(torch.ones(64, 32, dtype=torch.int8), torch.ones(64).bfloat16()),
    ],
)
def test_a_row_gets_the_same_bits_whatever_the_row_count(make):
    torch.manual_seed(3)
    layer, x = make(), torch.randn(16, 32)
    full = layer(x)
    assert all(torch.equal(layer(x[i : i + 1]), full[i : i + 1]) for i in range(16))
    assert layer(x[:0]).shape == (0, 64)


def tiny_config(hidden_size: int) -> ModelConfig:
    """One head as wide as the model, so that `hidden_size` alone sets every matrix's K."""
    return tiny.tiny_config(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=hidden_size,
        rms_norm_eps=1e-6,
    )


def test_int4_names_the_matrix_it_cannot_pack():
    weights = {"model.layers.0.mlp.down_proj.weight": torch.randn(48, 40)}  # K = 40: not a multiple of 32
    with pytest.raises(ValueError, match=r"down_proj.weight \(48, 40\).*multiple of 32.*'int8'"):
        convert_weights(weights, tiny_config(48), "int4")


def test_missing_kernel_and_cuda_are_refused_at_start_up(monkeypatch):
    with pytest.raises(ValueError, match="CPU kernels only.*'fp32'"):
        convert_weights({}, tiny_config(32), "int8", device="cuda")
    monkeypatch.setattr(native, "_library", None)  # torch's kernels are the ones needed
    monkeypatch.setattr(native, "_status", "disabled by the test")
    monkeypatch.setitem(quant._KERNELS, "int8", ("_weight_int8pack_mm_not_in_this_build",))
    with pytest.raises(ValueError, match="_weight_int8pack_mm_not_in_this_build.*'bf16'"):
        convert_weights({}, tiny_config(32), "int8")


@pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")
def test_int8_token_packs_every_matrix_and_the_embedding_as_per_token_rows():
    """int8_token: the int8 rows of the int8 precision under a name of their own, so every layer built
    from the tensors (the primary's, or the draft pool's over the mapped segment) multiplies per token."""
    g = torch.Generator().manual_seed(5)
    weights = {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 64, generator=g),
        "model.norm.weight": torch.ones(32),
    }
    out = convert_weights(weights, tiny_config(32), quant.INT8_TOKEN)
    assert set(out) == {
        "model.embed_tokens" + quant.INT8_TOKEN_COLUMNS,
        "model.embed_tokens" + quant.INT8_SCALE,
        "model.layers.0.mlp.down_proj" + quant.INT8_TOKEN_COLUMNS,
        "model.layers.0.mlp.down_proj" + quant.INT8_SCALE,
        "model.norm.weight",
    }
    layer = quant.quantized_linear(out, "model.layers.0.mlp.down_proj")
    assert isinstance(layer, native.QuantLinear) and layer.qweight.kind == native.KIND_Q8T
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(layer(x), x @ weights["model.layers.0.mlp.down_proj.weight"].t(), rtol=0.02, atol=0.2)


def test_int8_token_needs_the_native_kernels_and_a_packable_shape(monkeypatch):
    if native.library() is not None:
        with pytest.raises(ValueError, match=r"int8_token cannot pack model.layers.0.mlp.down_proj \(40, 64\)"):
            convert_weights({"model.layers.0.mlp.down_proj.weight": torch.randn(40, 64)}, tiny_config(32), "int8_token")
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_status", "disabled by the test")
    with pytest.raises(ValueError, match="int8_token runs on the native kernels only.*disabled by the test.*'fp32'"):
        convert_weights({}, tiny_config(32), "int8_token")
