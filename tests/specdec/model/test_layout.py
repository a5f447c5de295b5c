"""Weight layouts: chosen once per matrix at conversion, recorded with the weights, read by the layers."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from specdec.model import native, quant
from specdec.model.config import ModelConfig
from specdec.model.layout import MatrixLayout, ModelWeights, WeightLayout, count_layouts, why_not_native
from specdec.model.linear import Linear
from specdec.model.options import QUANTIZED_PRECISIONS
from specdec.model.llama import Transformer
from specdec.model.precision import choose_layout, convert_weights
from tests.specdec.model import tiny

L = WeightLayout
LIB = object()  # stands for a built native library: choose_layout only asks whether there is one
UP = "model.layers.0.mlp.up_proj.weight"
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"


@pytest.mark.parametrize(
    "name, shape, precision, lib, expected",
    [
        (UP, (64, 32), "fp32", LIB, L.DENSE),
        (UP, (64, 32), "fp8_e4m3", None, L.FP8),
        (EMBED, (64, 32), "fp8_e4m3", None, L.DENSE),  # embeddings stay in the compute dtype
        (UP, (64, 32), "int4", LIB, L.NATIVE_INT4),
        (UP, (64, 32), "int4", None, L.TORCH_INT4),
        (UP, (40, 32), "int4", LIB, L.TORCH_INT4),  # 40 outputs: not whole groups of 16
        (EMBED, (64, 32), "int4", LIB, L.NATIVE_INT8),  # int4 serves the embedding as int8 rows
        (UP, (64, 32), "int8", LIB, L.NATIVE_INT8),
        (UP, (64, 40), "int8", LIB, L.TORCH_INT8),  # 40 inputs: not whole blocks of 32
        (EMBED, (64, 32), "int8", None, L.TORCH_INT8),
        (UP, (64, 32), quant.INT8_TOKEN, LIB, L.NATIVE_INT8_TOKEN),
        (NORM, (32,), "int4", LIB, None),  # not a matrix
        ("model.layers.0.self_attn.q_proj.bias", (64,), "int8", LIB, None),
    ],
)
def test_choose_layout_picks_native_where_it_fits_and_says_why_not(name, shape, precision, lib, expected):
    layout, reason = choose_layout(name, shape, precision, lib)
    assert layout is expected
    assert bool(reason) == (expected in (L.TORCH_INT4, L.TORCH_INT8) and precision in QUANTIZED_PRECISIONS)


def test_why_not_native_names_the_library_or_the_shape():
    with native.disabled():
        assert "native kernels unavailable" in why_not_native((64, 32), None)
    assert "shape (40, 32)" in why_not_native((40, 32), LIB)
    assert why_not_native((64, 32), LIB) == ""


def test_int8_token_refuses_a_shape_the_native_layout_cannot_hold():
    with pytest.raises(ValueError, match=r"int8_token cannot pack model.layers.0.mlp.up_proj \(40, 32\)"):
        choose_layout(UP, (40, 32), quant.INT8_TOKEN, LIB)


def tiny_config() -> ModelConfig:
    return tiny.tiny_config(num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6)


def tiny_state_dict(config: ModelConfig) -> dict[str, torch.Tensor]:
    g, c, i = torch.Generator().manual_seed(7), config.hidden_size, config.intermediate_size
    p = "model.layers.0."
    shapes = {
        EMBED: (config.vocab_size, c),
        p + "self_attn.q_proj.weight": (c, c),
        p + "self_attn.k_proj.weight": (32, c),
        p + "self_attn.v_proj.weight": (32, c),
        p + "self_attn.o_proj.weight": (c, c),
        p + "mlp.gate_proj.weight": (i, c),
        p + "mlp.up_proj.weight": (i, c),
        p + "mlp.down_proj.weight": (c, i),
    }
    weights = {name: torch.randn(*shape, generator=g) / 8 for name, shape in shapes.items()}
    norms = (p + "input_layernorm.weight", p + "post_attention_layernorm.weight", NORM)
    return weights | {name: torch.ones(c) for name in norms}


PRECISIONS = ("fp32", "bf16", "fp8_e4m3", "int8", "int4", quant.INT8_TOKEN)


# int8_token has no torch-kernel form: it is served natively or refused
CASES = [(p, True) for p in PRECISIONS] + [(p, False) for p in PRECISIONS if p != quant.INT8_TOKEN]


@pytest.mark.parametrize("precision, is_native", CASES)
def test_every_matrix_is_recorded_once_and_the_names_agree(precision, is_native):
    """convert_weights records a layout for each of the 8 matrices (none for norms); reading the
    layouts back from the tensor names, as for an owner without records, gives the same records."""
    if is_native and native.library() is None:
        pytest.skip(f"native kernels: {native.status()}")
    config = tiny_config()
    with native.disabled() if not is_native else contextlib.nullcontext():
        weights = convert_weights(tiny_state_dict(config), config, precision)
    assert len(weights.matrices) == 8 and NORM in weights
    assert all(set(m.tensors) <= set(weights) for m in weights.matrices.values())
    assert ModelWeights.from_names(dict(weights)).matrices == weights.matrices
    assert all(
        m.layout.is_native == (is_native and precision in QUANTIZED_PRECISIONS) for m in weights.matrices.values()
    )


def test_a_fallback_is_logged_with_its_reason(caplog):
    config = tiny_config()
    state = tiny_state_dict(config) | {"model.layers.0.mlp.down_proj.weight": torch.randn(64, 96)}
    with native.disabled(), caplog.at_level(logging.WARNING, logger="specdec.model.precision"):
        weights = convert_weights(state, config, "int8")
    assert count_layouts(weights.matrices.values()) == {"torch_int8": 8}
    assert "8 matrices use torch's packed kernels" in caplog.text and "native kernels unavailable" in caplog.text


def test_the_layers_read_the_record_not_the_tensor_names():
    """A record naming tensors without any layout suffix builds the same layer as the suffixed names."""
    config = tiny_config()
    weights = convert_weights(tiny_state_dict(config), config, "int8")
    up = weights.matrix("model.layers.0.mlp.up_proj")
    assert up is not None
    renamed = {f"blob{i}": weights[name] for i, name in enumerate(up.tensors)}
    record = MatrixLayout("model.layers.0.mlp.up_proj", up.layout, up.shape, tuple(renamed))
    layer = Linear.from_weights(ModelWeights(renamed, [record]), record.module)
    x = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(8))
    assert torch.equal(layer(x), Linear.from_weights(weights, record.module)(x))


@pytest.mark.parametrize("precision", ["fp32", "int4", "int8"])
def test_a_model_over_recorded_and_name_read_layouts_gives_the_same_logits(precision):
    config = tiny_config()
    weights = convert_weights(tiny_state_dict(config), config, precision)
    ids, positions = torch.tensor([3, 9, 27]), torch.arange(3)

    def logits(model: Transformer) -> torch.Tensor:
        from specdec.engine.kv_cache import KVCache
        from specdec.model.llama import SequenceSpan

        slot = KVCache(config, model.kv_dtype).allocate(3)
        return model.forward(ids, positions, [SequenceSpan(0, 3, 0, slot.k, slot.v, None)])

    recorded, by_name = Transformer(config, weights, 64), Transformer(config, dict(weights), 64)
    assert recorded.matrices == by_name.matrices
    assert torch.equal(logits(recorded), logits(by_name))


def test_a_record_whose_tensors_are_missing_is_refused():
    record = MatrixLayout.of("model.layers.0.mlp.up_proj", L.TORCH_INT8, (64, 32))
    with pytest.raises(KeyError, match="weight_int8"):
        ModelWeights({}, [record])
