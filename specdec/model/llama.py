"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral), read top to bottom.

    x = embed(tokens)
    for each layer:  x = x + Attention(RMSNorm(x));  x = x + MLP(RMSNorm(x))
    logits = lm_head(RMSNorm(x))

The forward pass works on a *flattened* batch: the new tokens of every sequence in the
batch are concatenated into one [T] vector, so every linear layer runs once over all of
them (the weights are read once per step, whatever the number of sequences), and only
attention is split per sequence, each against its own KV cache. A token tree is one
sequence whose new tokens carry an explicit attention mask and positions by depth.

Weights are plain tensors handed in by name (Hugging Face names), never copied: they may
live in shared memory mapped from another process (`specdec.weights`). Each matrix's layout comes
with them (`layout.ModelWeights`, decided once at conversion): the layers are built from it, and
an int8 embedding serves both the lookup and the tied lm_head. The activation dtype is the final
norm's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from specdec.model import native
from specdec.model.config import ModelConfig
from specdec.model.layout import INT8_ROW_LAYOUTS, MatrixLayout, ModelWeights, WeightLayout, model_weights
from specdec.model.linear import NO_PADDING, Linear
from specdec.model.quant import Int8Embedding

Tensor = torch.Tensor
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


class LayerCache(Protocol):
    """What attention does with a KV cache: read and write `cache[layer_idx, :, rows]`. A tensor
    [num_layers, num_kv_heads, capacity, head_dim], or a view that maps layer ids onto fewer stored
    layers (draft_svc's self-draft slots)."""

    def __getitem__(self, key: tuple[Any, ...]) -> Tensor: ...
    def __setitem__(self, key: tuple[Any, ...], value: Tensor) -> None: ...


@dataclasses.dataclass(slots=True)
class SequenceSpan:
    """The part of a flattened batch that belongs to one sequence.

    Rows [start, start + num_tokens) of the batch are this sequence's new tokens. Their
    keys/values are written to `k_cache`/`v_cache` rows [num_cached, num_cached + num_tokens),
    and they attend to cache rows [0, num_cached + num_tokens) under `mask`.
    """

    start: int
    num_tokens: int
    num_cached: int
    k_cache: LayerCache  # [num_layers, num_kv_heads, capacity, head_dim]
    v_cache: LayerCache  # [num_layers, num_kv_heads, capacity, head_dim]
    mask: Tensor | None  # [num_tokens, num_cached + num_tokens] bool, True = attend; None = attend to all
    # Set: the last len(row_paths) rows attend one by one, each to the cache and exactly the new
    # rows row_paths[i] (int64 [d], in position order): the call a 1-row decode of that token makes
    # once its path is committed. The rows before them (a chain) attend together, causally.
    row_paths: Sequence[Tensor] | None = None


class RMSNorm:
    def __init__(self, weight: Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: Tensor) -> Tensor:
        # Normalise in fp32 as the reference implementation does, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding:
    """RoPE tables for every position up to `max_positions`, rotate-half layout (HF)."""

    def __init__(
        self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        inv_freq = _scale_inv_freq(inv_freq, config.rope_scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        # x: [T, heads, D], positions: [T]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def _scale_inv_freq(inv_freq: Tensor, rope_scaling: Mapping | None) -> Tensor:
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling.get("low_freq_factor", 1.0)
    high_freq_factor = rope_scaling.get("high_freq_factor", 4.0)
    old_len = rope_scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class Attention:
    def __init__(
        self, config: ModelConfig, w: Mapping[str, Tensor], prefix: str, layer_idx: int, min_gemm_rows: int = NO_PADDING
    ) -> None:
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = Linear.from_weights(w, prefix + "q_proj", min_gemm_rows)
        self.k_proj = Linear.from_weights(w, prefix + "k_proj", min_gemm_rows)
        self.v_proj = Linear.from_weights(w, prefix + "v_proj", min_gemm_rows)
        self.o_proj = Linear.from_weights(w, prefix + "o_proj", min_gemm_rows)
        # set by `native.NativeLayer`: (q, k_cache, v_cache, end, mask) -> out, replacing SDPA
        self.native_attend: Callable[..., Tensor] | None = None

    def __call__(self, x: Tensor, positions: Tensor, rope: RotaryEmbedding, spans: Sequence[SequenceSpan]) -> Tensor:
        T = x.shape[0]
        q = rope(self.q_proj(x).view(T, self.num_heads, self.head_dim), positions)  # [T, H, D]
        k = rope(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim), positions)  # [T, Hkv, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        return self.o_proj(self.attend(q, k, v, spans).view(T, self.num_heads * self.head_dim))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, spans: Sequence[SequenceSpan]) -> Tensor:
        """Write each span's keys/values into its cache, attend to it: out [T, H, D].

        q: [T, H, D], k, v: [T, Hkv, D]. Rows outside every span (a compiled step's padding)
        write no cache rows and come out zero.
        """
        out = torch.zeros_like(q)
        for s in spans:
            rows = slice(s.start, s.start + s.num_tokens)
            self._write_cache(s, k[rows], v[rows])
            if s.row_paths is None:
                out[rows] = self._attend(q[rows], s, s.num_cached + s.num_tokens, s.mask)
            else:
                out[rows] = self._attend_row_by_row(q[rows], k[rows], v[rows], s)
        return out

    def _write_cache(self, s: SequenceSpan, k: Tensor, v: Tensor) -> None:
        # k, v: [n, Hkv, D] -> cache rows [num_cached, num_cached + n) of this layer
        end = s.num_cached + k.shape[0]
        s.k_cache[self.layer_idx, :, s.num_cached : end] = k.transpose(0, 1)
        s.v_cache[self.layer_idx, :, s.num_cached : end] = v.transpose(0, 1)

    def _attend(self, q: Tensor, s: SequenceSpan, end: int, mask: Tensor | None) -> Tensor:
        # q: [n, H, D] against cache rows [0, end) -> [n, H, D]
        if self.native_attend is not None:
            # (layer, :, :) keys: the cache may be a view by layer id (the draft pool's compact layers)
            return self.native_attend(q, s.k_cache[self.layer_idx, :, :], s.v_cache[self.layer_idx, :, :], end, mask)
        keys = s.k_cache[self.layer_idx, :, :end]  # [Hkv, L, D]
        values = s.v_cache[self.layer_idx, :, :end]  # [Hkv, L, D]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o[0].transpose(0, 1)  # [n, H, D]

    def _attend_row_by_row(self, q: Tensor, k: Tensor, v: Tensor, s: SequenceSpan) -> Tensor:
        """Row r alone, its visible new rows moved right after the cache (where commit will put
        them), unmasked: E.g. node c of [r a b c] with path [r a c] reads cache rows [ctx | r a c].
        The cache holds the new rows in verify order on entry, so a path that is a prefix of them
        (every row of a chain) reads them where they are, without a copy."""
        assert s.row_paths is not None  # the caller's condition
        out = torch.empty_like(q)  # [n, H, D]
        first = s.num_tokens - len(s.row_paths)
        if first:
            mask = None if s.mask is None else s.mask[:first, : s.num_cached + first]
            out[:first] = self._attend(q[:first], s, s.num_cached + first, mask)
        is_in_order = True  # cache rows after num_cached = verify order
        for r, path in enumerate(s.row_paths, start=first):
            is_prefix = int(path[-1]) == len(path) - 1
            if not (is_prefix and is_in_order):
                self._write_cache(s, k[path], v[path])  # rows past the path may now be stale
                is_in_order = False
            out[r] = self._attend(q[r : r + 1], s, s.num_cached + len(path), None)[0]
        if not is_in_order:
            self._write_cache(s, k, v)  # back in verify order, as commit expects
        return out


class MLP:
    def __init__(self, w: Mapping[str, Tensor], prefix: str, min_gemm_rows: int = NO_PADDING) -> None:
        self.gate_proj = Linear.from_weights(w, prefix + "gate_proj", min_gemm_rows)
        self.up_proj = Linear.from_weights(w, prefix + "up_proj", min_gemm_rows)
        self.down_proj = Linear.from_weights(w, prefix + "down_proj", min_gemm_rows)

    def __call__(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block:
    def __init__(
        self, config: ModelConfig, w: Mapping[str, Tensor], layer_idx: int, min_gemm_rows: int = NO_PADDING
    ) -> None:
        p = f"model.layers.{layer_idx}."
        w = model_weights(w)
        self.input_layernorm = RMSNorm(w[p + "input_layernorm.weight"], config.rms_norm_eps)
        self.self_attn = Attention(config, w, p + "self_attn.", layer_idx, min_gemm_rows)
        self.post_attention_layernorm = RMSNorm(w[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        self.mlp = MLP(w, p + "mlp.", min_gemm_rows)
        # All seven products in native layouts and an fp32 stream on the CPU: the dense parts run as
        # two native calls
        norm = self.input_layernorm.weight
        is_native = all(_layout(w, m).is_native for m in product_modules(layer_idx)) and norm.dtype == torch.float32
        lib = native.library() if is_native and norm.device.type == "cpu" else None  # built: the products hold it
        assert lib is None or native.NativeLayer.supports(self)
        self.native = native.NativeLayer(lib, self) if lib is not None else None

    def __call__(self, x: Tensor, positions: Tensor, rope: RotaryEmbedding, spans: Sequence[SequenceSpan]) -> Tensor:
        if self.native is not None:
            return self.native(x, positions, rope, spans)
        h = x + self.self_attn(self.input_layernorm(x), positions, rope, spans)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer:
    """The model over named weight tensors (HF names) and their matrices' layouts
    (`layout.ModelWeights`, from `precision.convert_weights` or a peer's manifest); a plain mapping
    of tensors has its layouts read from the names."""

    def __init__(
        self, config: ModelConfig, weights: Mapping[str, Tensor], max_positions: int, min_gemm_rows: int = NO_PADDING
    ) -> None:
        self.config = config
        weights = model_weights(weights)
        self.matrices: Mapping[str, MatrixLayout] = weights.matrices  # module -> its layout, as the layers read it
        self.dtype = weights["model.norm.weight"].dtype  # activations (and the KV cache: see kv_dtype)
        self.embed, self.embed_tokens = _embedding(weights, self.dtype)  # embed_tokens: [V, C], float or int8
        self.layers = [Block(config, weights, i, min_gemm_rows) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(weights["model.norm.weight"], config.rms_norm_eps)
        head = "lm_head" if weights.matrix("lm_head") is not None else "model.embed_tokens"  # untied or tied
        self.lm_head = Linear.from_weights(weights, head, min_gemm_rows)
        self.device = self.embed_tokens.device
        # Packed int4/int8 kernels give a row the same bits whatever the row count (measured, see quant.py)
        products = [m for i in range(config.num_hidden_layers) for m in product_modules(i)]
        self.is_batch_invariant = all(_layout(weights, m).is_packed for m in [head, *products])
        # Native attention computes each row alone over its keys in cache order, skipping masked ones:
        # a masked multi-row call gives every row the bits of its 1-row call (`native.attend`).
        self.is_attention_row_exact = all(b.self_attn.native_attend is not None for b in self.layers)
        # The KV cache's dtype: fp16 where attention runs natively (`native.KV_DTYPES`), halving what a
        # step reads; otherwise the activations' dtype, which SDPA needs.
        self.kv_dtype = torch.float16 if self.is_attention_row_exact else self.dtype
        # Every layer native: a whole forward's layers in one native call where the spans allow it
        is_stack = self.is_attention_row_exact and all(b.native for b in self.layers)
        lib = native.library() if is_stack else None
        self.native_stack = native.NativeStack(lib, self.layers) if lib is not None else None
        self.rope = RotaryEmbedding(config, max_positions, self.dtype, self.device)
        self.max_positions = max_positions
        # An optional faster full forward (`specdec.model.compiled.CompiledStep`): called with the
        # forward's arguments, it returns the logits, or None to leave the step to the eager code.
        self.fast_path: Callable[..., Tensor | None] | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        spans: Sequence[SequenceSpan],
        logits_rows: Tensor | None = None,
        num_layers: int | None = None,
        layer_ids: Sequence[int] | None = None,
        features_out: list[Tensor] | None = None,
    ) -> Tensor:
        """Run the new tokens of every span; return fp32 logits [R, V] at `logits_rows` (all rows if None).

        `num_layers` (early exit) or `layer_ids` (layer skipping) run a subset of the layers over
        the same weights: the draft pool's self-drafting strategies. The caches of skipped layers
        are left untouched.

        `features_out`, when given, receives the same rows' features: the last layer's hidden
        states after the final norm [R, C] (the lm_head's input, in the activations' dtype), what
        the feature drafter (draft_svc/heads) reads. The compiled fast path does not expose them,
        so a forward that asks for features runs eagerly.
        """
        if input_ids.device != self.device:  # host-built index tensors -> the weights' device
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            logits_rows = None if logits_rows is None else logits_rows.to(self.device)
            for s in spans:
                s.mask = None if s.mask is None else s.mask.to(self.device)
        if self.fast_path is not None and num_layers is None and layer_ids is None and features_out is None:
            logits = self.fast_path(input_ids, positions, spans, logits_rows)
            if logits is not None:
                return logits
        x = self.embed(input_ids)  # [T, C]
        if self.native_stack is not None and num_layers is None and layer_ids is None and self.native_stack.fits(spans):
            x = self.native_stack(x, positions, self.rope, spans)
        else:
            chosen = range(num_layers or len(self.layers)) if layer_ids is None else layer_ids
            for i in chosen:
                x = self.layers[i](x, positions, self.rope, spans)
        if logits_rows is not None:
            x = x[logits_rows]  # [R, C]: only rows whose logits are needed
        features = self.norm(x)
        if features_out is not None:
            features_out.append(features)
        return self.lm_head(features).float()  # [R, V]


def product_modules(layer_idx: int) -> list[str]:
    """The modules of a decoder layer's seven products: E.g. 0 -> ["model.layers.0.self_attn.q_proj", ...]."""
    p = f"model.layers.{layer_idx}."
    return [p + "self_attn." + n for n in _ATTN] + [p + "mlp." + n for n in _MLP]


def _layout(weights: ModelWeights, module: str) -> WeightLayout:
    matrix = weights.matrix(module)
    if matrix is None:
        raise KeyError(module + ".weight")
    return matrix.layout


def _embedding(weights: ModelWeights, dtype: torch.dtype) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """(lookup: token ids [T] -> rows [T, C] in `dtype`, the matrix [V, C] it reads)."""
    matrix = weights.matrix("model.embed_tokens")
    if matrix is None:
        raise KeyError("model.embed_tokens.weight")
    if matrix.layout in INT8_ROW_LAYOUTS:
        rows, scale = (weights[name] for name in matrix.tensors)
        embedding = Int8Embedding(rows, scale, dtype, matrix.layout)
        return embedding, embedding.weight
    if matrix.layout is not WeightLayout.DENSE:
        raise ValueError(f"model.embed_tokens: a {matrix.layout.value} matrix cannot serve a lookup")
    table = weights[matrix.tensors[0]]
    return table.__getitem__, table
