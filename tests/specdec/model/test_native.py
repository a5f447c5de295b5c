"""The native 4-bit/8-bit kernels: block layout, products against a float64 reference of the same
quantization, batch invariance, the fused layer against the layer's own code, and the fallback."""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Iterator

import pytest
import torch

from specdec.model import native, quant
from specdec.model.config import ModelConfig
from specdec.model.llama import Block, RotaryEmbedding, SequenceSpan
from tests.specdec.model.tiny import tiny_config

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")


def q8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels multiply by: x [T, K] -> (int values [T, K], block scale dx [T, K/32]) in float64."""
    t, k = x.shape
    blocks = x.double().view(t, k // 32, 32)
    dx = (blocks.float().abs().amax(-1) / 127).double()
    inv = torch.where(dx > 0, 127 / blocks.float().abs().amax(-1).double(), torch.zeros_like(dx))
    xq = torch.round(blocks.float().double() * inv.float().double()[..., None])
    return xq.view(t, k), dx


def q4_layer(n: int, k: int, seed: int) -> tuple[native.QuantLinear, torch.Tensor]:
    """A random 4-bit layer and its weights [N, K] in float64."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    q, d, m = quant.quantize_q4_1(w)
    dense = (q.double().view(n, k // 32, 32) * d.double()[..., None] + m.double()[..., None]).view(n, k)
    return native.QuantLinear.from_q4_1(native.library(), q, d, m), dense


def test_pack_q4_1_interleaves_16_columns_and_unpacks_to_the_same_values():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    d, m = torch.rand(32, 2, generator=g).half(), -torch.rand(32, 2, generator=g).half()
    nibbles, dp, mp = native.pack_q4_1(q, d, m)
    assert nibbles.shape == (2, 2, 256) and dp.shape == mp.shape == (2, 2, 16)
    # group 1 (columns 16..31), block 1 (inputs 32..63), vector j = 2, column c = 5, byte b = 3:
    # low nibble = input 32 + 4j + b, high nibble = input 32 + 4j + 16 + b, of output column 21
    byte = int(nibbles[1, 1, 2 * 64 + 5 * 4 + 3])
    assert byte & 0x0F == q[21, 32 + 8 + 3] and byte >> 4 == q[21, 32 + 8 + 16 + 3]
    assert dp[1, 1, 5] == d[21, 1] and mp[1, 1, 5] == m[21, 1]
    back = native.unpack_q4_1(nibbles, dp, mp)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, d, m)))


def test_pack_int8_interleaves_16_columns_biased_by_128():
    w = torch.randint(-127, 128, (32, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    cols = native.pack_int8(w)
    assert cols.shape == (2, 16, 16, 4) and cols.dtype == torch.uint8
    assert cols[1, 9, 5].tolist() == [int(v) + 128 for v in w[21, 36:40]]  # group 1, inputs 36..39, row 21
    rows = torch.tensor([21, 0, 31, 21])
    assert torch.equal(native.int8_rows(cols, rows), w[rows])


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_q4_product_is_the_blocks_times_the_quantized_activations(rows):
    layer, dense = q4_layer(80, 96, seed=2)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(3))
    xq, dx = q8_activations(x)
    # sum_g d dx (q . xq) + m dx sum(xq)  ==  (xq * dx) @ W^T, in float64; only fp32 summation order differs
    expected = (xq.view(rows, 3, 32) * dx[..., None]).view(rows, 96) @ dense.t()
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-5)


def q8_layer(n: int, k: int, seed: int, bias: torch.Tensor | None = None) -> tuple[native.QuantLinear, torch.Tensor]:
    t = quant.quantize_int8("w", torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    w, scale = t["w" + quant.INT8_WEIGHT], t["w" + quant.INT8_SCALE]
    return native.QuantLinear.from_int8(native.library(), w, scale, bias), w.double() * scale.double()[:, None]


# an even and an odd number of blocks (the AVX-512 path takes blocks in pairs), up to and past a pass of rows
@pytest.mark.parametrize("rows,k", [(5, 64), (11, 96)])
def test_q8_product_is_the_rows_times_the_quantized_activations(rows, k):
    layer, dense = q8_layer(48, k, seed=4, bias=torch.ones(48))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
    xq, dx = q8_activations(x)
    expected = (xq.view(rows, k // 32, 32) * dx[..., None]).view(rows, k) @ dense.t() + 1
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("k", [64, 96])
def test_a_row_gets_the_same_bits_whatever_the_row_count(kind, k):
    layer, _ = q4_layer(64, k, seed=6) if kind == "q4" else q8_layer(64, k, seed=6)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(7))
    full = layer(x)
    assert all(torch.equal(layer(x[i : i + 1]), full[i : i + 1]) for i in range(19))
    assert all(torch.equal(layer(x[i : i + 5]), full[i : i + 5]) for i in range(15))
    assert all(torch.equal(layer(x[i : i + 9]), full[i : i + 9]) for i in range(11))
    assert layer(x[:0]).shape == (0, 64)


def block_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    g, p, out = torch.Generator().manual_seed(8), "model.layers.0.", {}
    c, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    shapes = {
        "self_attn.q_proj": (c, c),
        "self_attn.k_proj": (kv, c),
        "self_attn.v_proj": (kv, c),
        "self_attn.o_proj": (c, c),
        "mlp.gate_proj": (i, c),
        "mlp.up_proj": (i, c),
        "mlp.down_proj": (c, i),
    }
    for name, shape in shapes.items():
        q, d, m = quant.quantize_q4_1(torch.randn(*shape, generator=g) / 4)
        out.update(quant.pack_q4_1(p + name, q, d, m))
    out[p + "input_layernorm.weight"] = 1 + torch.rand(c, generator=g) / 10
    out[p + "post_attention_layernorm.weight"] = 1 + torch.rand(c, generator=g) / 10
    return out


def test_the_fused_layer_computes_what_the_layer_code_does():
    config = tiny_config()
    block, rope = Block(config, block_weights(config), 0), RotaryEmbedding(config, 64, torch.float32)
    assert block.native is not None
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(9))
    positions = torch.arange(3, 9)

    def run(use_native: bool) -> torch.Tensor:
        kc = torch.zeros(1, 2, 16, 16)
        span = SequenceSpan(0, 6, 3, kc, torch.zeros_like(kc), torch.ones(6, 9, dtype=torch.bool).tril(3))
        saved = block.native
        block.native = saved if use_native else None  # the same QuantLinears, called one by one
        try:
            return block(x, positions, rope, [span])
        finally:
            block.native = saved

    # one RMSNorm summation order differs; everything else is the same products of the same values
    torch.testing.assert_close(run(True), run(False), atol=2e-3, rtol=2e-3)


def test_without_the_library_int4_falls_back_to_torchs_kernels(monkeypatch):
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_status", "disabled by the test")
    config = tiny_config()
    from specdec.model.precision import convert_weights

    weights = convert_weights({"model.layers.0.mlp.up_proj.weight": torch.randn(96, 64)}, config, "int4")
    assert set(weights) == {
        "model.layers.0.mlp.up_proj" + quant.INT4_WEIGHT,
        "model.layers.0.mlp.up_proj" + quant.INT4_SCALES_ZEROS,
    }
    assert native.status() == "unavailable: disabled by the test"


def test_the_ctypes_mirrors_match_the_structs_as_compiled():
    assert native.abi_mismatch(native.library()) is None


class _QSpanWithInt32Half(ctypes.Structure):
    """QSpan with its last field 4 bytes instead of 8: the struct's size stays 72 (padding)."""

    _fields_ = [(name, ctypes.c_int32 if name == "half" else kind) for name, kind in native.QSpan._fields_]


class _QWeightWithBiasAndScaleSwapped(ctypes.Structure):
    """QWeight with two fields of one type in each other's place: every size and offset as in C."""

    _fields_ = [
        (("scale" if name == "bias" else "bias" if name == "scale" else name), kind)
        for name, kind in native.QWeight._fields_
    ]


@pytest.mark.parametrize(
    "attr, mirror, what",
    [
        ("QSpan", _QSpanWithInt32Half, "qspan.half is at offset 64 size 8 in C, offset 64 size 4"),
        ("QWeight", _QWeightWithBiasAndScaleSwapped, "qweight.bias is at offset 24 size 8 in C, offset 16 size 8"),
    ],
)
def test_a_ctypes_mirror_that_differs_from_the_c_struct_refuses_the_library(monkeypatch, caplog, attr, mirror, what):
    """The mirrors are checked field by field at load (`qgemm_abi`): a wrong field is named, the
    library is not used and int4/int8 fall back to torch's kernels."""
    assert ctypes.sizeof(mirror) == ctypes.sizeof(getattr(native, attr))
    monkeypatch.setattr(native, attr, mirror)
    assert what in (native.abi_mismatch(native.library()) or "")
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_status", None)
    with caplog.at_level(logging.ERROR, logger=native.__name__):
        assert native.library() is None
    assert native.status().startswith("unavailable: ctypes mirror differs from csrc/qgemm.h")
    assert what in native.status() and what in caplog.text
    with pytest.raises(native.AbiMismatch, match=what):
        native.variant(())


@pytest.mark.parametrize("kv_dtype", native.KV_DTYPES)
def test_attention_matches_sdpa_and_a_tree_row_equals_its_committed_decode(kv_dtype):
    g = torch.Generator().manual_seed(10)
    heads, kv_heads, dim, cached, capacity = 6, 2, 16, 5, 12
    k_cache = torch.randn(kv_heads, capacity, dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(kv_heads, capacity, dim, generator=g).to(kv_dtype)
    q = torch.randn(4, heads, dim, generator=g)
    # a tree over 4 new rows: r0 <- r1, r0 <- r2 <- r3 (cache rows 5..8)
    parents = [-1, 0, 0, 2]
    mask = torch.zeros(4, cached + 4, dtype=torch.bool)
    mask[:, :cached] = True
    for r, parent in enumerate(parents):
        mask[r, cached + r] = True
        while parent >= 0:
            mask[r, cached + parent], parent = True, parents[parent]
    got = native.attend(native.library(), q, k_cache, v_cache, cached + 4, mask)
    expected = torch.nn.functional.scaled_dot_product_attention(  # over the cache's values, in fp32
        q.transpose(0, 1)[None],
        k_cache[:, : cached + 4].float()[None],
        v_cache[:, : cached + 4].float()[None],
        attn_mask=mask,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # row 3 after its path r0, r2, r3 is committed to cache rows 5, 6, 7: the same bits
    k2, v2 = k_cache.clone(), v_cache.clone()
    for dst, src in enumerate((0, 2, 3)):
        k2[:, cached + dst], v2[:, cached + dst] = k_cache[:, cached + src], v_cache[:, cached + src]
    alone = native.attend(native.library(), q[3:4], k2, v2, cached + 3, None)
    assert torch.equal(alone[0], got[3])


@pytest.mark.parametrize("kv_dtype", native.KV_DTYPES)
@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (4, 2), (5, 5)])
def test_queries_of_a_kv_head_get_the_bits_of_each_head_alone(heads, kv_heads, dim, kv_dtype):
    """The kernel tiles the queries of a KV head (every row times the heads of its group) two, three or
    four at a time over blocks of keys; every head's output equals a call with that head alone,
    whatever its partners in the tile (other heads, other rows with other masks, or none)."""
    g = torch.Generator().manual_seed(11)
    capacity, end, rows = 140, 137, 3
    k_cache = torch.randn(kv_heads, capacity, dim, generator=g).to(kv_dtype)
    v_cache = torch.randn(kv_heads, capacity, dim, generator=g).to(kv_dtype)
    q = torch.randn(rows, heads, dim, generator=g)
    mask = torch.rand(rows, end, generator=g) < 0.7
    mask[:, 0] = True
    lib = native.library()
    for m in (None, mask):
        together = native.attend(lib, q, k_cache, v_cache, end, m)
        group = heads // kv_heads
        for h in range(heads):
            kv = h // group
            alone = native.attend(
                lib, q[:, h : h + 1], k_cache[kv : kv + 1].contiguous(), v_cache[kv : kv + 1].contiguous(), end, m
            )
            assert torch.equal(together[:, h], alone[:, 0])


def test_activations_quantize_per_block_to_nearest_even_exactly():
    """Per block of 32: dx = max|x| / 127 and x * (127 / max|x|) rounded half to even, in fp32, bit for
    bit (the vector path must agree with this definition, ties and all-zero blocks included)."""
    g = torch.Generator().manual_seed(12)
    t, k = 6, 256
    x = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 10
    x[0, :32] = 0.0
    x[1, :32] = torch.arange(32) - 15.5
    x[2] = (torch.arange(k) % 255 - 127) * 0.5  # products landing on .5: ties go to even
    xq = torch.empty(t, k, dtype=torch.int8)
    dx, sx = torch.empty(t, k // 32), torch.empty(t, k // 32)
    native.library().qgemm_quantize_rows(x.data_ptr(), t, k, xq.data_ptr(), dx.data_ptr(), sx.data_ptr())
    amax = x.view(t, k // 32, 32).abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    expected = torch.round(x.view(t, k // 32, 32) * inv[..., None])
    assert torch.equal(xq.view(t, k // 32, 32).float(), expected)
    assert torch.equal(dx, amax / 127)
    assert torch.equal(sx, dx * expected.sum(-1))


def test_an_fp16_cache_gives_the_attention_of_its_values_in_fp32():
    """fp16 caches are read as their exact fp32 values: the same bits as an fp32 cache holding them."""
    g = torch.Generator().manual_seed(13)
    k16 = (torch.randn(3, 50, 64, generator=g) * 30).half()
    v16 = (torch.randn(3, 50, 64, generator=g) * 30).half()
    q = torch.randn(2, 9, 64, generator=g)
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[0, 47] = False
    lib = native.library()
    assert torch.equal(
        native.attend(lib, q, k16, v16, 48, mask), native.attend(lib, q, k16.float(), v16.float(), 48, mask)
    )


def _cpu_has(flag: str) -> bool:
    return flag in native._cpu_flags().split()


@contextlib.contextmanager
def _set_within(get: Callable[[], int], set_: Callable[[int], object], value: int) -> Iterator[None]:
    """set_(value) for the block, then back to what get() gave before it."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def _num_threads(n: int) -> contextlib.AbstractContextManager[None]:
    return _set_within(torch.get_num_threads, torch.set_num_threads, n)


# each instruction path this CPU can run, built from the same source beside the default build
_PATHS = [("portable", ("-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx512f", "-mno-avxvnni"))]
if _cpu_has("avx2"):
    _PATHS.append(("AVX2", ("-mno-avx512f", "-mno-avxvnni")))
if _cpu_has("avx_vnni"):
    _PATHS.append(("AVX2+VNNI", ("-mno-avx512f",)))


@pytest.mark.parametrize("path, flags", _PATHS, ids=[p for p, _ in _PATHS])
def test_every_instruction_path_gives_the_same_bits(path, flags):
    """The products sum each block's integer dot product whole and accumulate blocks in one fp32
    order on every path, so the portable, AVX2 and AVX-512 builds agree bit for bit."""
    other = native.variant(flags)
    assert other.qgemm_isa().decode() == path
    g = torch.Generator().manual_seed(11)
    q, d, m = quant.quantize_q4_1(torch.randn(96, 160, generator=g))
    t = quant.quantize_int8("w", torch.randn(96, 160, generator=g))
    w, scale = t["w" + quant.INT8_WEIGHT], t["w" + quant.INT8_SCALE]
    for rows in (1, 3, 6, 8, 11):
        x = torch.randn(rows, 160, generator=g)
        here, there = (
            (native.QuantLinear.from_q4_1(lib, q, d, m), native.QuantLinear.from_int8(lib, w, scale))
            for lib in (native.library(), other)
        )
        assert all(torch.equal(a(x), b(x)) for a, b in zip(here, there)), (path, rows)
    # 63 groups of 16 columns: the AVX2 build walks them in runs of several, the last run shorter
    q, d, m = quant.quantize_q4_1(torch.randn(1008, 64, generator=g))
    t = quant.quantize_int8("w", torch.randn(1008, 64, generator=g))
    w, scale = t["w" + quant.INT8_WEIGHT], t["w" + quant.INT8_SCALE]
    for threads in (1, 2, 3):
        with _num_threads(threads):
            x = torch.randn(5, 64, generator=g)
            here, there = (
                (native.QuantLinear.from_q4_1(lib, q, d, m), native.QuantLinear.from_int8(lib, w, scale))
                for lib in (native.library(), other)
            )
            assert all(torch.equal(a(x), b(x)) for a, b in zip(here, there)), (path, threads)


@pytest.mark.parametrize("path, flags", [p for p in _PATHS if p[0] != "portable"], ids=lambda p: str(p))
def test_4bit_blocks_at_their_extremes_sum_exactly_on_every_vector_path(path, flags):
    """Without VNNI a 4-bit block's products add up in 16-bit lanes: all weights 15 against
    activations that all quantize to +127 (or -127) is the largest sum a lane can reach (30480), and
    must come out as the portable build's 32-bit sums; every row count a tile splits into (4, 2, 1)."""
    other, portable = native.variant(flags), native.variant(_PATHS[0][1])
    q = torch.full((48, 96), 15, dtype=torch.uint8)
    q[1::2] = 14  # odd columns one below, so a lane's halves differ
    d = torch.full((48, 3), 0.01, dtype=torch.float16)
    m = torch.full((48, 3), -0.02, dtype=torch.float16)
    for rows in (1, 2, 3, 4, 5, 6, 7, 9):
        x = torch.ones(rows, 96)
        x[1::2] = -1.0
        here, there = (native.QuantLinear.from_q4_1(lib, q, d, m)(x) for lib in (other, portable))
        assert torch.equal(here, there), (path, rows)


@pytest.mark.parametrize("path, flags", _PATHS, ids=[p for p, _ in _PATHS])
def test_attention_gives_the_same_bits_on_every_instruction_path(path, flags):
    """Attention's paths share one arithmetic: each score is eight lane sums over D then hsum_v8,
    the softmax sum sixteen partial sums of the same exp polynomial, each output element one FMA
    chain over the keys; AVX-512 only widens the tiles (four queries per key load, sixteen columns
    per value FMA), and the portable build runs the same operations one float at a time."""
    other = native.variant(flags)
    g = torch.Generator().manual_seed(14)
    for kv_dtype in native.KV_DTYPES:
        k_cache = torch.randn(3, 300, 64, generator=g).to(kv_dtype)
        v_cache = torch.randn(3, 300, 64, generator=g).to(kv_dtype)
        for rows, end in ((1, 157), (5, 260), (21, 299)):
            q = torch.randn(rows, 9, 64, generator=g)
            mask = torch.rand(rows, end, generator=g) < 0.8
            mask[:, :100] = True
            for m in (None, mask):
                there = native.attend(other, q, k_cache, v_cache, end, m)
                for lanes in (0, 1):  # the AVX-512 build's keys in lanes (from one query) or not
                    with _att_lanes_from(lanes):
                        here = native.attend(native.library(), q, k_cache, v_cache, end, m)
                    assert torch.equal(here, there), (path, kv_dtype, rows, m is None, lanes)


@pytest.mark.parametrize("path, flags", _PATHS, ids=[p for p, _ in _PATHS])
@pytest.mark.parametrize("dim", [12, 20])
def test_attention_of_heads_not_a_multiple_of_8_gives_the_same_bits_on_every_instruction_path(dim, path, flags):
    """A head dimension the tiles do not take (not a multiple of 8) scores each key with one lone dot
    whose every product is fused into its sum, as the tiles' are, so every build gives the same bits
    there too (the compiler's own contraction of a * k into the sums differed from build to build)."""
    other = native.variant(flags)
    g = torch.Generator().manual_seed(16)
    for kv_dtype in native.KV_DTYPES:
        k_cache = torch.randn(2, 100, dim, generator=g).to(kv_dtype)
        v_cache = torch.randn(2, 100, dim, generator=g).to(kv_dtype)
        for rows, end in ((1, 40), (5, 90)):
            q = torch.randn(rows, 6, dim, generator=g)
            mask = torch.rand(rows, end, generator=g) < 0.8
            for m in (None, mask):
                here = native.attend(native.library(), q, k_cache, v_cache, end, m)
                assert torch.equal(here, native.attend(other, q, k_cache, v_cache, end, m)), (kv_dtype, rows)


def _att_lanes_from(min_queries: int) -> contextlib.AbstractContextManager[None]:
    """Attention's keys in lanes from chunks of `min_queries` queries (0: never) within the block."""
    lib = native.library()
    return _set_within(lib.qgemm_att_lanes, lib.qgemm_set_att_lanes, min_queries)


@pytest.mark.skipif("AVX512" not in native.library().qgemm_isa().decode(), reason="keys in lanes: AVX-512 builds only")
def test_keys_in_lanes_give_the_bits_of_the_tiles_at_every_chunk_size():
    """Whether a chunk takes its scores with keys in lanes is chosen per machine (choose_att_lanes),
    so both must give the same bits: every row count around the chunk sizes, 1-3 threads, tree masks."""
    g = torch.Generator().manual_seed(15)
    k_cache = torch.randn(3, 200, 64, generator=g).half()
    v_cache = torch.randn(3, 200, 64, generator=g).half()
    for threads in (1, 2, 3):
        with _num_threads(threads):
            for rows in (1, 2, 3, 5, 6, 7, 8, 13, 16, 33):
                end = 120 + rows
                q = torch.randn(rows, 9, 64, generator=g)
                mask = torch.ones(rows, end, dtype=torch.bool)
                mask[:, 120:] = torch.rand(rows, rows, generator=g) < 0.5
                mask[:, 120:] |= torch.eye(rows, dtype=torch.bool)
                outs = []
                for lanes in (1, 6, 0):
                    with _att_lanes_from(lanes):
                        outs.append(native.attend(native.library(), q, k_cache, v_cache, end, mask))
                assert all(torch.equal(outs[0], o) for o in outs[1:]), (threads, rows)


def test_the_attention_path_is_measured_once_and_cached(tmp_path, monkeypatch):
    """choose_att_lanes measures on first load of a build, writes its choice beside the library and
    reads it back after; the environment's count overrides both, and a count that does not parse is
    an error naming the variable."""
    lib = native.library()
    if "AVX512" not in lib.qgemm_isa().decode():
        with _att_lanes_from(0):
            assert native.choose_att_lanes(lib) == "" and lib.qgemm_att_lanes() == 0
        return
    monkeypatch.delenv(native.ATT_LANES_SWITCH, raising=False)
    fake = tmp_path / "qgemm-test.so"
    monkeypatch.setattr(lib, "_name", str(fake))
    with _att_lanes_from(lib.qgemm_att_lanes()):
        monkeypatch.setattr(native, "_time_att_paths", lambda lib: (1.0, 2.0))  # lanes twice as fast
        assert "from 6 queries (measured" in native.choose_att_lanes(lib)
        assert lib.qgemm_att_lanes() == 6 and fake.with_suffix(".att-lanes").read_text() == "6"
        monkeypatch.setattr(native, "_time_att_paths", lambda lib: (1.0, 1.0))  # not measured again
        assert native.choose_att_lanes(lib).endswith("from 6 queries (measured before)")
        fake.with_suffix(".att-lanes").unlink()
        assert "never (measured" in native.choose_att_lanes(lib) and lib.qgemm_att_lanes() == 0
        monkeypatch.setenv(native.ATT_LANES_SWITCH, "9")
        assert native.choose_att_lanes(lib).endswith(f"from 9 queries by {native.ATT_LANES_SWITCH}")
        assert lib.qgemm_att_lanes() == 9
        monkeypatch.setenv(native.ATT_LANES_SWITCH, "many")
        with pytest.raises(ValueError, match=native.ATT_LANES_SWITCH):
            native.choose_att_lanes(lib)
        assert lib.qgemm_att_lanes() == 9  # a refused value changes nothing


def test_a_refused_lanes_count_fails_every_load_alike(monkeypatch):
    """A SPECDEC_NATIVE_ATT_LANES that does not parse refuses the library on every call, not on the
    first alone (a later call must not get a library set up on the default path)."""
    lib = native.library()
    if "AVX512" not in lib.qgemm_isa().decode():
        pytest.skip("keys in lanes: AVX-512 builds only")
    with _att_lanes_from(lib.qgemm_att_lanes()):
        monkeypatch.setenv(native.ATT_LANES_SWITCH, "many")
        monkeypatch.setattr(native, "_library", None)
        monkeypatch.setattr(native, "_status", None)
        monkeypatch.setattr(native, "_load", lambda cc: lib)
        for _ in range(2):
            with pytest.raises(ValueError, match=native.ATT_LANES_SWITCH):
                native.library()
            assert native._library is None


def _amx_unavailable() -> str | None:
    """Why this machine cannot test the AMX products, or None."""
    lib = native.library()
    if not lib.qgemm_amx_built():
        return "this build has no AMX path (the CPU lacks amx_tile/amx_int8, or the compiler does)"
    if lib.qgemm_amx_min_rows() == 0:
        return f"AMX tiles are off here: {native.status()}"
    return None


needs_amx = pytest.mark.skipif(_amx_unavailable() is not None, reason=str(_amx_unavailable()))


def _amx_from(rows: int) -> contextlib.AbstractContextManager[None]:
    """The tiles on for products of at least `rows` rows (0: off) within the block."""
    lib = native.library()
    return _set_within(lib.qgemm_amx_min_rows, lib.qgemm_set_amx, rows)


def _tiles_and_vectors(compute: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """compute() with the tiles on from one row, then with them off: (tiles, vectors)."""
    with _amx_from(1):
        tiles = compute()
    with _amx_from(0):
        vectors = compute()
    return tiles, vectors


def _assert_tiles_give_the_bits_of_vectors(layer, k: int, g: torch.Generator, row_counts: tuple[int, ...]) -> None:
    """The layer's product of random rows [rows, k] on 1, 2 and 3 threads, for each row count: the
    tiles give the bits of the vector path."""
    for threads in (1, 2, 3):
        with _num_threads(threads):
            for rows in row_counts:
                x = torch.randn(rows, k, generator=g) * 4
                tiles, vectors = _tiles_and_vectors(lambda: layer(x))
                assert torch.equal(tiles, vectors), (k, threads, rows)


def _new_sequence(block: Block, rope: RotaryEmbedding, h: torch.Tensor) -> torch.Tensor:
    """The decoder layer over h [T, C] (T <= 48) as a new sequence at position 0, in a KV cache of its own."""
    kc = torch.zeros(1, 2, 48, 16)
    spans = [SequenceSpan(0, len(h), 0, kc, torch.zeros_like(kc), None)]
    return block(h, torch.arange(len(h)), rope, spans)


@needs_amx
@pytest.mark.parametrize("k", [160, 576, 1536])
def test_amx_products_give_the_bits_of_the_avx512_path(k):
    """The tiles compute each block's integer sums, exact in any order, and the rescale is the
    AVX-512 path's: every row count, odd ones, tails and 16-row boundaries included, gives the same
    bits with the tiles as without (an odd block count exercises the alternating tile sets)."""
    lib = native.library()
    g = torch.Generator().manual_seed(21)
    q, d, m = quant.quantize_q4_1(torch.randn(96, k, generator=g))
    layer = native.QuantLinear.from_q4_1(lib, q, d, m, bias=torch.randn(96, generator=g))
    _assert_tiles_give_the_bits_of_vectors(layer, k, g, (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 47, 63, 64))


@needs_amx
def test_8bit_products_and_a_whole_4bit_layer_give_the_same_bits_with_the_tiles_on():
    """With the tiles on from one row, 8-bit products (which the tile loop hands back to AVX-512) and a
    4-bit decoder layer over 40 rows (tiles for its products) give the bits they give with the tiles off."""
    lib = native.library()
    g = torch.Generator().manual_seed(22)
    t = quant.quantize_int8("w", torch.randn(64, 128, generator=g))
    rows8 = native.QuantLinear.from_int8(lib, t["w" + quant.INT8_WEIGHT], t["w" + quant.INT8_SCALE])
    x = torch.randn(40, 128, generator=g)
    with _amx_from(1):
        tiles = rows8(x)
    assert torch.equal(tiles, rows8(x))
    config = tiny_config()
    block, rope = Block(config, block_weights(config), 0), RotaryEmbedding(config, 64, torch.float32)
    assert block.native is not None
    h = torch.randn(40, 64, generator=g)
    assert torch.equal(*_tiles_and_vectors(lambda: _new_sequence(block, rope, h)))


def test_a_refused_tile_permission_leaves_the_products_on_avx512(monkeypatch, caplog):
    """Where the OS refuses the tile data state (or SPECDEC_NATIVE_AMX=0), AMX stays off, the status
    and the log say why, and the products are those of the vector path, bit for bit."""
    lib = native.library()
    g = torch.Generator().manual_seed(23)
    q, d, m = quant.quantize_q4_1(torch.randn(64, 96, generator=g))
    layer = native.QuantLinear.from_q4_1(lib, q, d, m)
    x = torch.randn(33, 96, generator=g)
    before = lib.qgemm_amx_min_rows()
    with _amx_from(0):
        expected = layer(x)
    try:
        monkeypatch.setattr(native, "request_tile_data", lambda: "refused by the test")
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            why = native.enable_amx(lib)
        assert lib.qgemm_amx_min_rows() == 0
        assert torch.equal(layer(x), expected)
        if lib.qgemm_amx_built():
            assert why == "AMX unavailable: refused by the test" and "refused by the test" in caplog.text
        else:
            assert why == ""  # nothing to refuse: the build has no tiles
        monkeypatch.setenv(native.AMX_SWITCH, "0")
        assert native.enable_amx(lib) == ("AMX off by SPECDEC_NATIVE_AMX=0" if lib.qgemm_amx_built() else "")
        assert lib.qgemm_amx_min_rows() == 0
    finally:
        lib.qgemm_set_amx(before)


# ---- 8-bit rows with activations per token (QW_Q8T, the int8_token precision) ----


def token_layer(lib, n: int, k: int, seed: int, bias: torch.Tensor | None = None) -> tuple[native.QuantLinear, ...]:
    """The same int8 rows as a per-token and as a per-block layer on `lib`, and the rows [N, K] in float64."""
    t = quant.quantize_int8("w", torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    w, scale = t["w" + quant.INT8_WEIGHT], t["w" + quant.INT8_SCALE]
    return (
        native.QuantLinear.from_int8(lib, w, scale, bias, per_token=True),
        native.QuantLinear.from_int8(lib, w, scale, bias),
        w.double() * scale.float().double()[:, None],
    )


def token_activations(x: torch.Tensor) -> torch.Tensor:
    """What a per-token product multiplies by, in float64: each row's integers q = rint(x * 16383 / max|x|)
    (as the kernels round: fp32 product, nearest even) times max|x| / 16383."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 16383) / amax, torch.zeros_like(amax))  # fp32 division
    q = torch.round(x * inv).clamp(-16383, 16383)
    return q.double() * (amax / 16383).double()


@pytest.mark.parametrize("rows,k", [(1, 64), (5, 96), (19, 576)])
def test_a_per_token_product_is_the_rows_times_each_rows_15_bit_integers(rows, k):
    layer, _, dense = token_layer(native.library(), 48, k, seed=31, bias=torch.ones(48))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(32)) * 3
    x[0, 5] = 40.0  # an outlier sets its row's scale, not its block's
    expected = token_activations(x) @ dense.t() + 1
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer(torch.zeros(2, k)), torch.ones(2, 48))  # an all-zero row: scale 0, no NaN


def test_per_token_activations_keep_a_row_with_an_outlier_closer_than_blocks_of_32_do():
    """The reason for the precision: one 15-bit scale per row against one 8-bit scale per 32 values."""
    token, block, dense = token_layer(native.library(), 64, 576, seed=33)
    g = torch.Generator().manual_seed(34)
    x = torch.randn(8, 576, generator=g)
    x[:, ::97] *= 30  # activation outliers, as some channels of a real model carry
    exact = x.double() @ dense.t()
    assert (token(x).double() - exact).abs().mean() < (block(x).double() - exact).abs().mean()


@pytest.mark.parametrize("k", [64, 96, 576])
def test_a_per_token_row_gets_the_same_bits_whatever_the_row_count(k):
    layer, _, _ = token_layer(native.library(), 64, k, seed=35)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(36))
    full = layer(x)
    for width in (1, 5, 9, 16, 17, 33):
        assert all(torch.equal(layer(x[i : i + width]), full[i : i + width]) for i in range(0, 40 - width, 3)), width


@pytest.mark.parametrize("path, flags", _PATHS, ids=[p for p, _ in _PATHS])
def test_per_token_products_give_the_same_bits_on_every_instruction_path(path, flags):
    """Two exact integer sums per element and one rescale in a fixed order: the portable loops, the AVX2
    build and AVX-512 agree bit for bit."""
    other = native.variant(flags)
    g = torch.Generator().manual_seed(37)
    for n, k in ((96, 160), (1008, 64)):
        here, there = (token_layer(lib, n, k, seed=38)[0] for lib in (native.library(), other))
        for threads in (1, 2, 3):
            with _num_threads(threads):
                for rows in (1, 2, 3, 6, 11):
                    x = torch.randn(rows, k, generator=g) * 2
                    assert torch.equal(here(x), there(x)), (path, n, k, threads, rows)


@pytest.mark.parametrize("path, flags", _PATHS, ids=[p for p, _ in _PATHS])
def test_per_token_products_at_the_byte_extremes_give_the_portable_bits(path, flags):
    """Weights of -128, -127 and 127, and rows whose largest magnitude is negative (a high byte of
    -128) or positive (127 / 127): the vector paths' byte products, where a sign trick on -128 or a
    saturating pair would go wrong, keep the portable loops' exact sums."""
    other, lib = native.variant(flags), native.library()
    g = torch.Generator().manual_seed(43)
    n, k = 48, 256
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16)
    w[:, :32] = torch.tensor([-128, -127, 127, -128] * 8)  # every row's first 32 weights at the edges
    w[:4] = torch.tensor([-128, 127])[torch.randint(0, 2, (4, k), generator=g)]  # whole rows of them
    w = w.to(torch.int8)
    scale = torch.rand(n, generator=g).to(torch.bfloat16) + 0.5
    here, there = (native.QuantLinear.from_int8(m, w, scale, per_token=True) for m in (lib, other))
    x = torch.randn(6, k, generator=g)
    x[0] = -x[0].abs()  # all negative: many high bytes near -128
    x[1, 7] = -100.0  # one negative outlier sets the row's scale: -16383 -> h = -128, l = 1
    x[2, :32] = torch.tensor([-1.0, 1.0] * 16)  # the edges again on the activation side
    x[3] = torch.where(torch.arange(k) % 2 == 0, -1.0, 1.0)  # every value at +-amax
    assert torch.equal(here(x), there(x)), path


@needs_amx
@pytest.mark.parametrize("k", [160, 576, 1536])
def test_per_token_products_on_amx_tiles_give_the_bits_of_the_avx512_path(k):
    """The tiles keep a whole row's two integer sums (k = 160 is no multiple of the tiles' 64 inputs
    and stays on AVX-512); every row count, odd ones, tails and 16-row boundaries, with an odd number of
    column groups (the last tile unit holds one)."""
    lib = native.library()
    g = torch.Generator().manual_seed(39)
    layer = token_layer(lib, 112, k, seed=40, bias=torch.randn(112, generator=g))[0]
    _assert_tiles_give_the_bits_of_vectors(layer, k, g, (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 47, 63, 64))


def token_block_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """`block_weights`'s layer as int8 rows per token (the int8_token precision's tensors)."""
    g, out = torch.Generator().manual_seed(41), {}
    for name, tensor in block_weights(config).items():
        if name.endswith(quant.Q4_1_NIBBLES):
            module = name.removesuffix(quant.Q4_1_NIBBLES)
            n, k = tensor.shape[0] * native.COLUMNS, tensor.shape[1] * native.QK
            rows = quant.quantize_int8(module, torch.randn(n, k, generator=g) / 4)
            out.update(quant.pack_int8(module, rows[module + quant.INT8_WEIGHT], rows[module + quant.INT8_SCALE], True))
        elif not name.endswith((quant.Q4_1_D, quant.Q4_1_M)):
            out[name] = tensor
    return out


def test_a_per_token_layer_runs_fused_and_gives_the_same_bits_with_the_tiles_on_or_off():
    """A decoder layer of per-token products runs as one native call, and 40 rows (tiles for its
    products where the CPU has them) give the bits of the vector path; row 3 alone gets its own bits."""
    config = tiny_config()
    block, rope = Block(config, token_block_weights(config), 0), RotaryEmbedding(config, 64, torch.float32)
    assert block.native is not None and block.self_attn.q_proj.qweight.kind == native.KIND_Q8T
    h = torch.randn(40, 64, generator=torch.Generator().manual_seed(42))
    assert torch.equal(*_tiles_and_vectors(lambda: _new_sequence(block, rope, h)))
