"""The one-call native forward (`NativeStack`, csrc/ops.c's qgemm_forward) over several layers: a
row's bits do not depend on how many rows share the call, how many threads run it, whether the
products run on AMX tiles, or which instruction path the library was built for; it equals the
layer-by-layer calls; and its timer (csrc/profile.c) reports where a forward's time went."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import pytest
import torch

from specdec.model import native, quant
from specdec.model.config import ModelConfig
from specdec.model.llama import Block, RotaryEmbedding, SequenceSpan
from tests.specdec.model.tiny import tiny_config

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")


def _lib() -> ctypes.CDLL:
    lib = native.library()
    assert lib is not None
    return lib


NUM_LAYERS = 3
MAX_ROWS = 70  # past four 16-row tiles, with a tail
SHAPES = {  # module -> (n, k) for hidden 64, intermediate 96, 4 heads of 16 over 2 KV heads
    "self_attn.q_proj": (64, 64),
    "self_attn.k_proj": (32, 64),
    "self_attn.v_proj": (32, 64),
    "self_attn.o_proj": (64, 64),
    "mlp.gate_proj": (96, 64),
    "mlp.up_proj": (96, 64),
    "mlp.down_proj": (64, 96),
}


def config() -> ModelConfig:
    return tiny_config(num_hidden_layers=NUM_LAYERS, max_position_embeddings=128)


def layer_weights(layer_idx: int, per_token: bool) -> dict[str, torch.Tensor]:
    """Random weights of one layer: Q4_1 blocks, or int8 rows with activations per token."""
    g, p, out = torch.Generator().manual_seed(100 + layer_idx), f"model.layers.{layer_idx}.", {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) / 4
        if per_token:
            rows = quant.quantize_int8(p + name, w)
            weight, scale = rows[p + name + quant.INT8_WEIGHT], rows[p + name + quant.INT8_SCALE]
            out.update(quant.pack_int8(p + name, weight, scale, True))
        else:
            out.update(quant.pack_q4_1(p + name, *quant.quantize_q4_1(w)))
    out[p + "input_layernorm.weight"] = 1 + torch.rand(64, generator=g) / 10
    out[p + "post_attention_layernorm.weight"] = 1 + torch.rand(64, generator=g) / 10
    return out


@pytest.fixture(scope="module", params=["int4", "int8_token"])
def blocks(request) -> list[Block]:
    c = config()
    layers = [Block(c, layer_weights(i, request.param == "int8_token"), i) for i in range(NUM_LAYERS)]
    assert all(b.native is not None for b in layers)
    return layers


@pytest.fixture(scope="module")
def rope() -> RotaryEmbedding:
    return RotaryEmbedding(config(), 128, torch.float32)


@contextlib.contextmanager
def settings(num_threads: int, amx_min_rows: int | None = None) -> Iterator[None]:
    """torch's (and so the kernels') thread count and, unless None, the AMX tiles' row count (0: off)."""
    lib = _lib()
    threads, amx = torch.get_num_threads(), lib.qgemm_amx_min_rows()
    torch.set_num_threads(num_threads)
    if amx_min_rows is not None:
        lib.qgemm_set_amx(amx_min_rows)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        lib.qgemm_set_amx(amx)


def caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_LAYERS, 2, MAX_ROWS + 2, 16)  # [layers, Hkv, capacity, D]
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def causal_span(num_cached: int, num_rows: int, kc: torch.Tensor, vc: torch.Tensor) -> SequenceSpan:
    """num_rows new rows after num_cached, each attending the cache and the new rows up to itself."""
    keys = torch.arange(num_cached + num_rows)
    mask = keys[None, :] <= (num_cached + torch.arange(num_rows))[:, None]
    return SequenceSpan(0, num_rows, num_cached, kc, vc, mask)


def decode_one_by_one(stack, rope, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, tuple]:
    """Every row of x as a 1-row step after the rows before it: the reference outputs, and the caches."""
    kc, vc = caches(dtype)
    rows = [stack(x[t : t + 1], torch.tensor([t]), rope, [causal_span(t, 1, kc, vc)]) for t in range(len(x))]
    return torch.cat(rows), (kc, vc)


def hidden_rows(seed: int) -> torch.Tensor:
    return torch.randn(MAX_ROWS, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kv_dtype", native.KV_DTYPES)
def test_a_row_gets_its_1_row_bits_at_every_row_count_and_thread_count(blocks, rope, kv_dtype):
    """The last T rows of a sequence in one forward, for T = 1..70 on 1, 2 and 3 threads, give each
    row the bits its own 1-row step gives (tiles at their usual row counts), and rewrite the cache
    with the same bits."""
    stack = native.NativeStack(_lib(), blocks)
    x = hidden_rows(1)
    with settings(2):
        expected, (kc_ref, vc_ref) = decode_one_by_one(stack, rope, x, kv_dtype)
    for num_threads in (1, 2, 3):
        with settings(num_threads):
            kc, vc = kc_ref.clone(), vc_ref.clone()
            for num_rows in range(1, MAX_ROWS + 1):
                start = MAX_ROWS - num_rows
                out = stack(x[start:], torch.arange(start, MAX_ROWS), rope, [causal_span(start, num_rows, kc, vc)])
                assert torch.equal(out, expected[start:]), (num_threads, num_rows)
            assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), num_threads


def test_tiles_on_from_one_row_or_off_give_the_same_bits(blocks, rope):
    """The products on AMX tiles from one row, or never, leave every row's bits as they are."""
    stack = native.NativeStack(_lib(), blocks)
    x = hidden_rows(2)
    outs = []
    for amx_min_rows in (1, 0):
        with settings(2, amx_min_rows):
            kc, vc = caches(torch.float16)
            outs.append([stack(x[:t], torch.arange(t), rope, [causal_span(0, t, kc, vc)]) for t in (1, 5, 16, 33, 70)])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_several_spans_in_one_forward_get_the_bits_of_each_alone(blocks, rope):
    """Three sequences (one row, a 20-row chain, a 41-row chain) in one forward: each span's rows get
    the bits of a forward of that span alone."""
    stack = native.NativeStack(_lib(), blocks)
    x = hidden_rows(3)
    sizes, starts = (1, 20, 41), (0, 1, 21)
    cache_sets = [caches(torch.float16) for _ in sizes]
    spans = [
        SequenceSpan(s, n, 0, kc, vc, causal_span(0, n, kc, vc).mask)
        for s, n, (kc, vc) in zip(starts, sizes, cache_sets)
    ]
    positions = torch.cat([torch.arange(n) for n in sizes])
    with settings(2):
        together = stack(x[:62], positions, rope, spans)
        for s, n in zip(starts, sizes):
            kc, vc = caches(torch.float16)
            alone = stack(x[s : s + n], torch.arange(n), rope, [causal_span(0, n, kc, vc)])
            assert torch.equal(together[s : s + n], alone), n


def test_the_one_call_forward_equals_the_layer_by_layer_calls(blocks, rope):
    """qgemm_forward against each layer's own calls (qgemm_layer_pre, the cache write, qgemm_attention,
    qgemm_layer_post), at row counts below, at and past the row-parallel and tile thresholds."""
    stack = native.NativeStack(_lib(), blocks)
    x = hidden_rows(4)
    for num_rows in (1, 3, 8, 17, 64):
        with settings(2):
            kc, vc = caches(torch.float32)
            one_call = stack(x[:num_rows], torch.arange(num_rows), rope, [causal_span(0, num_rows, kc, vc)])
            kc2, vc2 = caches(torch.float32)
            h = x[:num_rows]
            for block in blocks:
                h = block(h, torch.arange(num_rows), rope, [causal_span(0, num_rows, kc2, vc2)])
        assert torch.equal(one_call, h), num_rows
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), num_rows


_NARROWER_BUILDS = {
    "AVX2": ("-mno-avx512f", "-mno-avxvnni"),
    "portable": ("-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f", "-mno-avxvnni"),
}


@pytest.mark.parametrize("path", list(_NARROWER_BUILDS))
def test_a_narrower_build_runs_the_forward_to_the_same_bits(blocks, rope, path):
    """The library built for AVX2 alone (no AVX-512, no AMX), or with no vector path at all, runs the
    same forward to the same bits: RoPE's fused products and the softmax's and SiLU's exp polynomial
    are the same operations in every build."""
    if path == "AVX2" and "avx2" not in native._cpu_flags().split():
        pytest.skip("the CPU has no AVX2")
    other = native.variant(_NARROWER_BUILDS[path])
    assert other.qgemm_isa().decode() == path
    x = hidden_rows(5)
    with settings(2):
        outs = []
        for lib in (_lib(), other):
            kc, vc = caches(torch.float16)
            outs.append(native.NativeStack(lib, blocks)(x[:37], torch.arange(37), rope, [causal_span(0, 37, kc, vc)]))
    assert torch.equal(*outs)


def test_the_timer_splits_a_forward_and_changes_no_bits(blocks, rope):
    """Off, the timer sums nothing; on, each forward counts once with its products, attention and
    rest, and the outputs are the bits of a forward without it."""
    lib = _lib()
    stack = native.NativeStack(lib, blocks)
    x = hidden_rows(6)[:24]

    def forward() -> torch.Tensor:
        kc, vc = caches(torch.float16)
        return stack(x, torch.arange(24), rope, [causal_span(0, 24, kc, vc)])

    native.set_profile(lib, False)
    plain = forward()
    assert native.forward_profile(lib) == native.ForwardProfile(0, 0.0, 0.0, 0.0)
    native.set_profile(lib, True)
    try:
        timed = [forward(), forward()]
        p = native.forward_profile(lib, reset=True)
        assert p.num_forwards == 2
        assert p.products_s > 0 and p.attention_s > 0 and p.rest_s > 0
        assert native.forward_profile(lib).num_forwards == 0  # reset
    finally:
        native.set_profile(lib, False)
    assert all(torch.equal(t, plain) for t in timed)
