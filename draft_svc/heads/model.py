"""The feature drafter: one decoder layer over the primary's own features (EAGLE, Li et al. 2024).

At a committed token x_{t+1} the primary's last row before it left a feature f_t (its final norm's
output, the lm_head's input). The drafter reads the pair and predicts the primary's NEXT feature:

    u_t      = fc([f_t ; embed(x_{t+1})])                      2C -> C, the drafter's own
    h_t      = layer(u_t | u_<t)                               one decoder layer of the primary's shape
                                                               (its attention over the request's
                                                               draft-side KV of earlier u)
    f^_{t+1} = final_norm(h_t)                                 the primary's final norm (shared)
    logits   = f^_{t+1} @ head[vocab].T                        the primary's lm_head rows of the
                                                               drafter's vocabulary (its N most frequent
                                                               tokens, FR-Spec): N x C, not V x C

Drafting deeper feeds the drafter its own prediction: u = fc([f^_{t+1} ; embed(d_1)]) -> f^_{t+2} -> d_2 ...

The embedding, final norm and lm_head rows are the primary's (`SharedParts`, read from the attached
model); only fc and the layer are the drafter's (`FeatureDrafter`), a few MB. Training
(draft_svc/heads/train.py) and the pool's strategy (draft_svc/strategies/feature.py) run the same
code: `FeatureDrafter.layer` over rows with an explicit boolean mask.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from specdec.model.config import ModelConfig


# The fields a drafter's config copies from its primary's ModelConfig (the rest are the drafter's own)
PRIMARY_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "vocab_size",
)


MAX_WINDOW = 1 << 14  # a drafter's window: its KV rows per request (trained drafters use 512)


@dataclasses.dataclass(frozen=True, slots=True)
class DrafterConfig:
    """The drafter's shape: the primary's layer shape, its vocabulary size and its KV window."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the primary's
    draft_vocab_size: int  # N: rows of the drafter's head
    max_window: int = 512  # features the drafter attends to (older ones slide out)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in (0, {self.vocab_size}], got {self.draft_vocab_size}")
        if not 2 <= self.max_window <= MAX_WINDOW:  # each request's keys and values hold max_window rows
            raise ValueError(f"max_window must be in [2, {MAX_WINDOW}], got {self.max_window}")

    @classmethod
    def for_model(cls, config: ModelConfig, draft_vocab_size: int, max_window: int = 512) -> DrafterConfig:
        primary = {name: getattr(config, name) for name in PRIMARY_FIELDS}
        return cls(**primary, draft_vocab_size=draft_vocab_size, max_window=max_window)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("the drafter config must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise ValueError(f"unknown drafter config fields {unknown}")
        return cls(**fields)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


class Rotary:
    """RoPE (rotate-half layout, as the primary's) for absolute positions, tables grown on demand."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self._cos = self._sin = torch.empty(0, head_dim)

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.covering(int(positions.max()) + 1 if positions.numel() else 0)
        return cos[positions], sin[positions]

    def covering(self, need: int) -> tuple[Tensor, Tensor]:
        """The whole tables [P, D] with P >= need (grown to a power of two when short)."""
        if need > self._cos.shape[0]:
            size = 1 << max(10, math.ceil(math.log2(need)))
            freqs = torch.outer(torch.arange(size, dtype=torch.float32), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [..., T, H, D] rotated by tables [..., T, 1, D] (`tables`, unsqueezed): one lookup for q and k."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class FeatureDrafter(nn.Module):
    """fc + one decoder layer: the drafter's own weights (trained; everything else is the primary's)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        c, h, kv, d, i = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.intermediate_size,
        )
        self.config = config
        self.fc = nn.Linear(2 * c, c, bias=True)
        self.input_norm = nn.Parameter(torch.ones(c))
        self.q_proj = nn.Linear(c, h * d, bias=False)
        self.k_proj = nn.Linear(c, kv * d, bias=False)
        self.v_proj = nn.Linear(c, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, c, bias=False)
        self.post_norm = nn.Parameter(torch.ones(c))
        self.gate_proj = nn.Linear(c, i, bias=False)
        self.up_proj = nn.Linear(c, i, bias=False)
        self.down_proj = nn.Linear(i, c, bias=False)
        self.rotary = Rotary(d, config.rope_theta)
        # Serving (`for_serving`): q|k|v and gate|up as one product each, the same rows side by side
        self.qkv: nn.Module | None = None
        self.gate_up: nn.Module | None = None
        self.native_layer: NativeLayer | None = None  # the whole layer in one native call (serving)

    def inputs(self, features: Tensor, token_embeddings: Tensor) -> Tensor:
        """u = fc([f ; embed(x)]) for rows [..., C] of each."""
        return self.fc(torch.cat((features, token_embeddings), dim=-1))

    def keys_values(self, u: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(q [..., T, H, D] rotated, k [..., T, Hkv, D] rotated, v [..., T, Hkv, D]) of inputs u [..., T, C]."""
        cfg = self.config
        x = rms_norm(u, self.input_norm, cfg.rms_norm_eps).to(u.dtype)
        shape = u.shape[:-1]
        if self.qkv is not None:
            sizes = [cfg.num_attention_heads * cfg.head_dim, *[cfg.num_key_value_heads * cfg.head_dim] * 2]
            q, k, v = self.qkv(x).split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(*shape, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(*shape, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(*shape, cfg.num_key_value_heads, cfg.head_dim)
        cos, sin = self.rotary.tables(positions)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin), v

    def finish(self, u: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """The layer's output h [..., T, C] for inputs u [..., T, C] and their queries q, over `keys` /
        `values` [..., S, Hkv, D] with mask [..., T, S] (True = attend; None: every key, drafting only)."""
        cfg = self.config
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        if q.dim() == 3:  # drafting: a few rows, each against the window; no copies of the keys
            attn = _attend_rows(q, keys, values, mask, group)
        else:
            qh = q.transpose(-3, -2)  # [..., H, T, D]
            assert mask is not None, "a batch of sequences needs its mask"
            kh = keys.transpose(-3, -2).repeat_interleave(group, dim=-3)  # [..., H, S, D]
            vh = values.transpose(-3, -2).repeat_interleave(group, dim=-3)
            attn = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask.unsqueeze(-3))
        attn = attn.transpose(-3, -2).reshape(*u.shape[:-1], cfg.num_attention_heads * cfg.head_dim)
        h = u + self.o_proj(attn)
        x = rms_norm(h, self.post_norm, cfg.rms_norm_eps).to(h.dtype)
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(cfg.intermediate_size, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return h + self.down_proj(F.silu(gate) * up)


def unrolled(
    drafter: FeatureDrafter,
    shared: SharedParts,
    features: Tensor,
    token_embeddings: Tensor,
    positions: Tensor,
    valid: Tensor,
    depth: int,
) -> list[Tensor]:
    """The drafter over whole sequences, `depth` draft steps deep (training; also the reference the
    incremental strategy is tested against). Returns per pass d = 1..depth the predicted features
    f^ [B, T, C]: pass d at index t is the drafter's d-th draft step from the committed context that
    ends at token t: its input is the primary's feature f_t (d = 1) or pass d-1's prediction at
    t-1 (d > 1), beside embed(x_{t+1}); it attends to the true inputs u_j of j <= t-d+1 and to its own
    chain's inputs of passes 2..d (at t-d+2 .. t), as drafting a chain of depth d sees them.

    features, token_embeddings [B, T, C]: row t holds f_t and embed(x_{t+1}); positions [B, T]
    x_{t+1}'s position; valid [B, T] bool (padding False). Pass d's rows t < d-1 have no input.
    """
    B, T, _ = features.shape
    idx = torch.arange(T)
    base = idx[None, :] <= idx[:, None]  # [T(query), T(key)]: causal
    pad = valid[:, None, :]  # [B, 1, T] keys that exist
    keys: list[Tensor] = []
    values: list[Tensor] = []
    out: list[Tensor] = []
    prev: Tensor | None = None
    for d in range(1, depth + 1):
        f_in = features if prev is None else torch.cat((torch.zeros_like(prev[:, :1]), prev[:, :-1]), dim=1)
        u = drafter.inputs(f_in, token_embeddings)
        q, k, v = drafter.keys_values(u, positions)
        keys.append(k)
        values.append(v)
        # pass-1 keys j <= t-d+1; pass-e keys (e = 2..d) at exactly t-(d-e)
        masks = [(idx[None, :] <= idx[:, None] - (d - 1)) if d > 1 else base]
        masks += [idx[None, :] == idx[:, None] - (d - e) for e in range(2, d + 1)]
        mask = torch.cat(masks, dim=1)[None] & torch.cat([pad] * d, dim=2)  # [B, T, d*T]
        mask = mask | ~mask.any(-1, keepdim=True)  # rows with nothing to attend (no input): any finite output
        h = drafter.finish(u, q, torch.cat(keys, dim=1), torch.cat(values, dim=1), mask)
        prev = shared.features(h)
        out.append(prev)
    return out


def _attend_rows(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, group: int) -> Tensor:
    """Attention of rows q [T, H, D] over keys/values [S, Hkv, D] under mask [T, S] (None: all) ->
    [H, T, D]: each key head's `group` query heads in one product (query head h reads key head h // group)."""
    t, h, d = q.shape
    kv = keys.shape[1]
    qg = q.view(t, kv, group, d).permute(1, 0, 2, 3).reshape(kv, t * group, d)  # rows t*group + j
    scores = torch.bmm(qg, keys.permute(1, 2, 0)) * d**-0.5  # [Hkv, T*group, S]
    if mask is not None:
        scores.masked_fill_(~mask.repeat_interleave(group, dim=0), float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), values.permute(1, 0, 2))  # [Hkv, T*group, D]
    return out.view(kv, t, group, d).permute(0, 2, 1, 3).reshape(h, t, d)


@dataclasses.dataclass(slots=True)
class SharedParts:
    """What the drafter reads of the primary: its embedding lookup, final norm and head rows."""

    embed: Any  # token ids [T] -> rows [T, C] (the primary's `Transformer.embed`)
    final_norm: Tensor  # [C]
    head: Tensor  # [N, C] fp32: the primary's lm_head rows of the drafter's vocabulary
    vocab: Tensor  # [N] int64: primary token id of each head row
    eps: float
    head_product: Any = None  # serving: rows [R, C] -> [R, N] by the native kernels (`for_serving`)
    vocab_ids: tuple[int, ...] = dataclasses.field(init=False)  # `vocab` as ints, for drafts' paths

    def __post_init__(self) -> None:
        self.vocab_ids = tuple(self.vocab.tolist())

    def features(self, h: Tensor) -> Tensor:
        """The predicted feature f^ = final_norm(h)."""
        return rms_norm(h, self.final_norm, self.eps)

    def logits(self, features: Tensor) -> Tensor:
        """[..., N] logits over the drafter's vocabulary."""
        if self.head_product is not None:
            return self.head_product(features.reshape(-1, features.shape[-1])).view(*features.shape[:-1], -1)
        return features @ self.head.T


def shared_parts(model: Any, vocab: Tensor, eps: float) -> SharedParts:
    """SharedParts of a primary `Transformer` (tied or untied lm_head: the head rows are the
    lm_head's, dequantized once: N x C fp32, e.g. 8k x 576 = 18 MB)."""
    vocab = vocab.to(torch.int64)
    with torch.inference_mode():
        if model.config.tie_word_embeddings:
            head = model.embed(vocab).float()
        else:
            head = _head_rows(model, vocab)
    return SharedParts(model.embed, model.norm.weight.detach().float(), head.clone(), vocab, eps)


def _head_rows(model: Any, vocab: Tensor) -> Tensor:
    """Rows of an untied lm_head: its product with the identity, a chunk of columns at a time."""
    c = model.config.hidden_size
    rows = []
    for start in range(0, c, 64):
        eye = torch.zeros(min(64, c - start), c, dtype=model.dtype)
        eye[torch.arange(eye.shape[0]), torch.arange(start, start + eye.shape[0])] = 1
        rows.append(model.lm_head(eye).float()[:, vocab])  # [64, N]
    return torch.cat(rows).T.contiguous()


def _int8_rows(lib: Any, weight: Tensor, bias: Tensor | None) -> Any:
    """weight [N, K] as the native kernels' int8 rows, one fp32 scale a row (`native.QuantLinear`)."""
    from specdec.model import native

    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return native.QuantLinear.from_int8(lib, q, scale, None if bias is None else bias.detach())


class _NativeProduct(nn.Module):
    """A drafter product by the native int8 kernels (specdec/model/native): int8 rows, one fp32 scale
    a row, the activations quantized per block of 32 inside the call."""

    def __init__(self, lib: Any, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.product = _int8_rows(lib, weight, bias)
        self.out_features = weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)


# the C struct qlayer's product fields -> the drafter's linear layers
_LAYER_PRODUCTS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


class NativeLayer:
    """The drafter's decoder layer in ONE native call (`qgemm_forward` over one layer, the call the
    primary's forward makes for its 30): RMSNorm, q/k/v, RoPE, the new rows' keys and values written
    to the request's cache, attention under a mask, o, RMSNorm, the MLP and both residuals. In torch
    the same layer is ~40 small ops, whose overhead was most of a draft depth (0.64 ms a depth on a
    Zen 4 core, its products 0.19 ms of it). Its products are int8 rows like `_NativeProduct`'s."""

    def __init__(self, lib: Any, drafter: FeatureDrafter) -> None:
        from specdec.model import native

        self._native, self._lib, cfg = native, lib, drafter.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self._rotary = drafter.rotary
        self._norm1 = drafter.input_norm.detach().float().contiguous()
        self._norm2 = drafter.post_norm.detach().float().contiguous()
        self._products = {
            key: _int8_rows(lib, getattr(drafter, name).weight, None) for key, name in _LAYER_PRODUCTS.items()
        }
        self._layer = native.QLayer()
        self._layer.norm1, self._layer.norm2 = self._norm1.data_ptr(), self._norm2.data_ptr()
        self._layer.eps1 = self._layer.eps2 = cfg.rms_norm_eps
        for key, product in self._products.items():
            setattr(self._layer, key, ctypes.pointer(product.qweight))

    @staticmethod
    def fits(drafter: FeatureDrafter, lib: Any) -> bool:
        from specdec.model.layout import why_not_native

        return all(not why_not_native(tuple(getattr(drafter, n).weight.shape), lib) for n in _LAYER_PRODUCTS.values())

    def __call__(
        self, u: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor, num_cached: int, mask: Tensor | None
    ) -> Tensor:
        """The layer's output h [T, C] for inputs u [T, C] at `positions` [T]. k_cache / v_cache
        [Hkv, capacity, D] fp32 views whose rows 0.. are the attended ones: the T new rows' keys and
        values are written at rows num_cached.. and row t attends rows [0, num_cached + T) under mask
        [T, num_cached + T] (True = attend; None: all)."""
        assert k_cache.dtype == v_cache.dtype == torch.float32 and k_cache.stride() == v_cache.stride()
        assert k_cache.stride(2) == 1 and k_cache.stride(1) == self.head_dim
        x = u.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # the call writes it in place
        positions = positions.to(torch.int64).contiguous()
        cos, sin = self._rotary.covering(int(positions.max()) + 1)
        span = self._native.QSpan()
        span.start, span.n, span.num_cached = 0, x.shape[0], num_cached
        span.k_cache, span.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        span.layer_stride, span.capacity, span.half = 0, k_cache.stride(0) // self.head_dim, 0
        mask_bytes = None if mask is None else mask.contiguous().view(torch.uint8)
        span.mask = None if mask_bytes is None else mask_bytes.data_ptr()
        status = self._lib.qgemm_forward(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            ctypes.byref(self._layer),
            1,
            self.heads,
            self.kv_heads,
            self.head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            positions.data_ptr(),
            ctypes.byref(span),
            1,
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("native drafter layer: out of memory")
        return x


PRODUCTS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_PRODUCTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def for_serving(drafter: FeatureDrafter, shared: SharedParts, lib: Any) -> tuple[FeatureDrafter, SharedParts]:
    """The drafter with its products (and the head's) on the native int8 kernels where the CPU has
    them (`lib`: `specdec.model.native.library()`): a draft step reads ~9 MB of weights instead of
    ~36 MB of fp32 (4.2M parameters + an 8k x 576 head), and its layer is one native call
    (`NativeLayer`; the products below still serve a long feed's keys and values and its last row).
    Drafts need not be exact (the primary verifies them); a test bounds how far they move."""
    from specdec.model.layout import why_not_native

    if lib is None:
        return drafter, shared
    if NativeLayer.fits(drafter, lib):  # from the fp32 weights, before the products below replace them
        drafter.native_layer = NativeLayer(lib, drafter)
    # the native int8 layout takes whole groups of outputs and blocks of inputs; other shapes (e.g. a
    # test's tiny drafter) stay in torch, by the rule every matrix of the primary follows.
    # q|k|v and gate|up as one product each: the same int8 rows and per-row scales side by side (the
    # same outputs), one call instead of three and two
    fused: set[str] = set()
    for name, parts in FUSED_PRODUCTS.items():
        weight = torch.cat([getattr(drafter, part).weight for part in parts])
        if not why_not_native(tuple(weight.shape), lib):
            setattr(drafter, name, _NativeProduct(lib, weight, None))
            fused.update(parts)
    for name in PRODUCTS:
        linear = getattr(drafter, name)
        if name not in fused and not why_not_native(tuple(linear.weight.shape), lib):
            setattr(drafter, name, _NativeProduct(lib, linear.weight, linear.bias))
    if why_not_native(tuple(shared.head.shape), lib):
        return drafter, shared
    return drafter, dataclasses.replace(shared, head_product=_NativeProduct(lib, shared.head, None))


def state_of(drafter: FeatureDrafter) -> Mapping[str, Tensor]:
    return {k: v.detach() for k, v in drafter.state_dict().items()}
