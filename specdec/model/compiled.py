"""A compiled decode/verify step: the dense parts of each layer as inductor graphs, per row bucket.

A step of T <= max(buckets) rows runs as B = the smallest bucket >= T rows; rows T..B-1 are
padding (token 0 at position 0) that belongs to no span, so they write no KV rows and their
outputs are dropped. Every op outside attention works row by row, so the real rows' results
do not depend on what the padding holds (the bucket size may still change how a GEMM rounds).

Attention (the KV write and SDPA over a context that grows every step) is not a static-shape
graph; it stays eager between three compiled regions:

    pre:   RMSNorm -> q/k/v projections -> RoPE                            [B, C] -> q, k, v
    post:  o_proj -> + residual -> RMSNorm -> MLP -> + residual            [B, H, D] -> [B, C]
    head:  final RMSNorm -> lm_head -> fp32                                [R, C] -> [R, V]

The regions take the layer objects as arguments, so dynamo lifts their weight tensors into graph
inputs: all layers share ONE graph per region and bucket (guards check the objects' types, not
their identity), and any `Linear` that is a plain callable over tensors compiles the same way.

Compiling happens on dummy inputs (`compile_bucket`, normally from a background thread) and a
bucket is used only once its three graphs exist; the forward path runs the regions in dynamo's
run-only mode, so a guard miss falls back to eager instead of compiling on the serving thread,
and the serving thread never waits for a compile.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from specdec.model.llama import Block, RotaryEmbedding, SequenceSpan, Transformer

Tensor = torch.Tensor

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
PAD_TOKEN_ID = 0  # any valid token: padded rows are computed and thrown away
PAD_POSITION = 0


@dataclasses.dataclass(frozen=True, slots=True)
class CompileSettings:
    buckets: tuple[int, ...] = ROW_BUCKETS
    mode: str = "default"

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive row counts, got {self.buckets}")
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"mode must be one of {COMPILE_MODES}, got {self.mode!r}")


def configure_inductor_cache(cache_dir: Path) -> None:
    """Keep inductor's compiled artifacts (FX graph cache) in `cache_dir`, so a restart reuses them."""
    import torch._dynamo  # seconds to import; only a compiled step needs it
    import torch._inductor.config

    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)  # inductor reads its cache root from here
    torch._inductor.config.fx_graph_cache = True
    # One graph per region and bucket, with room for a second dtype (tests load fp32 and bf16).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


# --- the regions (module-level functions: one code object, so one dynamo cache, per region) ---


def _pre_attention(block: Block, rope: RotaryEmbedding, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # x: [B, C], positions: [B] -> q [B, H, D], k, v [B, Hkv, D]
    attn, B = block.self_attn, x.shape[0]
    h = block.input_layernorm(x)
    q = rope(attn.q_proj(h).view(B, attn.num_heads, attn.head_dim), positions)
    k = rope(attn.k_proj(h).view(B, attn.num_kv_heads, attn.head_dim), positions)
    v = attn.v_proj(h).view(B, attn.num_kv_heads, attn.head_dim)
    return q, k, v


def _post_attention(block: Block, x: Tensor, attn_out: Tensor) -> Tensor:
    # x: [B, C], attn_out: [B, H, D] -> [B, C]
    h = x + block.self_attn.o_proj(attn_out.view(x.shape[0], -1))
    return h + block.mlp(block.post_attention_layernorm(h))


def _head(model: Transformer, x: Tensor) -> Tensor:
    # x: [R, C] -> fp32 logits [R, V]
    return model.lm_head(model.norm(x)).float()


def _layers(model: Transformer, x: Tensor, positions: Tensor, spans: Sequence[SequenceSpan]) -> Tensor:
    # x: [B, C] -> [B, C]. Run under dynamo's run-only mode, the region calls below find their
    # compiled graphs; one mode switch per step costs less than one per region call.
    for block in model.layers:
        q, k, v = _pre_attention(block, model.rope, x, positions)
        x = _post_attention(block, x, block.self_attn.attend(q, k, v, spans))  # spans: rows < T only
    return x


def _pad_rows(t: Tensor, num_rows: int, value: int | float) -> Tensor:
    # Always a new tensor, even without padding: made under inference_mode like compile_bucket's dummy
    # inputs, so it passes the graphs' guards (an engine-built tensor is not an inference tensor).
    padded = t.new_full((num_rows, *t.shape[1:]), value)
    padded[: t.shape[0]] = t
    return padded


class CompiledStep:
    """`Transformer.fast_path`: the forward of <= max(buckets) rows through compiled regions.

    Install with `model.fast_path = CompiledStep(model, settings)`; until `compile_bucket`
    has run for a bucket, steps of that size return None (the eager forward runs them).
    """

    def __init__(self, model: Transformer, settings: CompileSettings = CompileSettings()) -> None:
        if any(block.native is not None for block in model.layers):
            raise ValueError(
                "the compiled step runs torch-served precisions; this model's layers already run "
                "as native calls (specdec.model.native), which torch.compile cannot trace"
            )
        self.model, self.settings = model, settings
        self._ready: frozenset[int] = frozenset()  # replaced whole, so readers need no lock
        self._compile_lock = threading.Lock()
        # Built by the first compile_bucket, not here: importing dynamo and inductor takes seconds
        # (~16 s on a busy 2-core machine) and belongs on the compiling thread, not at start-up.
        self._compiling: tuple | None = None
        self._run_layers: Callable[..., Tensor] | None = None
        self._run_head: Callable[..., Tensor] | None = None

    def _build_wrappers(self) -> None:
        import torch._dynamo

        mode = None if self.settings.mode == "default" else self.settings.mode
        compile_ = lambda fn: torch.compile(fn, dynamic=False, mode=mode)  # noqa: E731
        self._compiling = (compile_(_pre_attention), compile_(_post_attention), compile_(_head))
        self._run_layers, self._run_head = torch._dynamo.run(_layers), torch._dynamo.run(_head)

    @property
    def ready_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._ready))

    def bucket_for(self, num_rows: int) -> int | None:
        return next((b for b in self.settings.buckets if b >= num_rows), None)

    def compile_bucket(self, num_rows: int) -> float:
        """Compile (or load from inductor's cache) the three regions for `num_rows`; seconds taken.

        Runs them on dummy inputs with the real weights of layer 0; no KV cache is touched.
        """
        assert num_rows in self.settings.buckets
        start = time.perf_counter()
        with self._compile_lock, torch.inference_mode():  # the serving thread's forward runs under it too
            if self._compiling is None:
                self._build_wrappers()
            assert self._compiling is not None
            m, (pre, post, head) = self.model, self._compiling
            x = torch.zeros(num_rows, m.config.hidden_size, dtype=m.dtype, device=m.device)
            positions = torch.full((num_rows,), PAD_POSITION, dtype=torch.int64, device=m.device)
            q, _, _ = pre(m.layers[0], m.rope, x, positions)
            post(m.layers[0], x, torch.zeros_like(q))
            head(m, x)
        self._ready = self._ready | {num_rows}
        return time.perf_counter() - start

    def __call__(
        self, input_ids: Tensor, positions: Tensor, spans: Sequence[SequenceSpan], logits_rows: Tensor | None
    ) -> Tensor | None:
        T = input_ids.shape[0]
        B = self.bucket_for(T)
        rows = torch.arange(T, device=input_ids.device) if logits_rows is None else logits_rows
        R = rows.shape[0]
        head_bucket = self.bucket_for(R)
        if B not in self._ready or (R and head_bucket not in self._ready):
            return None
        assert self._run_layers is not None and self._run_head is not None  # built before any bucket is ready
        m = self.model
        x = m.embed(_pad_rows(input_ids, B, PAD_TOKEN_ID))  # [B, C]
        x = self._run_layers(m, x, _pad_rows(positions, B, PAD_POSITION), spans)
        if R == 0:
            return torch.empty(0, m.config.vocab_size, device=x.device)
        assert head_bucket is not None  # R rows fit a ready bucket (checked above)
        return self._run_head(m, _pad_rows(x[rows], head_bucket, 0.0))[:R]  # [R, V] fp32
