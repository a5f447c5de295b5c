"""Per-row statistics of verify logits: a CuPy RawKernel on GPU, a torch reference on CPU.

For every row r of the primary's logits [R = N+1, V], straight from the wire encoding (fp32,
bf16, or fp8_e4m3 with a per-row scale; see specdec/logits_codec.py), compute
  row_max[r], log_normalizer[r] (log-sum-exp), entropy[r] (nats), argmax_ids[r] (lowest index
  on ties) and, for each tree node j whose parent row is r, child_logits[j] and child_probs[j]
  (temperature-1 softmax probability of token_ids[j]).
Under a grammar mask (the packed TokenMask words, one bit a token) a forbidden token counts as
MASKED_LOGIT (-inf): every statistic above is that of the masked row, as in acceptance.py.
That is everything greedy validation and temperature-0 threshold validation need, so the GPU
path never materialises decoded logits. Sampled modes need whole distributions after top-k/top-p
and run the host reference in acceptance.py.

The greedy path walk runs on the host: it is at most N integer comparisons over the argmax row
that must come back to the host anyway (with the entropies, for the response); a second kernel
would add a launch and a synchronisation (~10 us) to save ~1 us of Python.

The kernel is one block per row; each thread folds its strided slice of the row into an online
state (m, argmax, s = sum e^(x-m), t = sum e^(x-m)(x-m)), then warp shuffles and one shared-memory
pass combine the states. entropy = log s - t/s, lse = m + log s: the formulas of
entropy.row_entropy, in one pass instead of two (results agree to float32 rounding; max, argmax
and child logits are exact, so greedy decisions agree bit for bit).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import torch

from specdec.acceptance_mode import THRESHOLD_OFF, check_threshold
from specdec.grammar.bitmask import TokenBitmask
from specdec.logits_codec import FORMAT_BF16, FORMAT_FP8_E4M3, FORMAT_FP32, ITEMSIZE, EncodedLogits, decode_logits
from validator_svc.acceptance import (
    Children,
    ValidationResult,
    build_children,
    check_argmax_ids,
    greedy_walk,
    threshold_greedy_qualified,
    threshold_walk,
    walk_result,
)
from validator_svc.entropy import row_entropy

FORMAT_CODES = {FORMAT_FP32: 0, FORMAT_BF16: 1, FORMAT_FP8_E4M3: 2}  # `fmt` argument of the kernel
THREADS_PER_BLOCK = 256  # 8 warps; the reduction assumes a multiple of 32, at most 1024
KERNEL_NAME = "row_stats"

ROW_STATS_SOURCE = r"""
#define NEG_INF (-__int_as_float(0x7f800000))
// e4m3fn byte: s eeee mmm, bias 7. e > 0: (-1)^s 2^(e-7) (1 + m/8) = (-1)^s (8 + m) 2^(e-10);
// e == 0: (-1)^s 2^-6 (m/8) = (-1)^s m 2^-9; s 1111 111 is NaN (no infinities).
__device__ __forceinline__ float decode_e4m3(unsigned int b) {
    const unsigned int e = (b >> 3) & 0xFu, m = b & 0x7u;
    float v;
    if (e == 0xFu && m == 0x7u) {
        v = __int_as_float(0x7fc00000);
    } else if (e == 0u) {
        v = ldexpf((float)m, -9);
    } else {
        v = ldexpf((float)(8u + m), (int)e - 10);
    }
    return (b & 0x80u) ? -v : v;
}

// fmt: 0 fp32, 1 bf16 (upper half of the fp32 bits), 2 fp8_e4m3 (times the row scale).
__device__ __forceinline__ float load_logit(const unsigned char* row, int fmt, long long i, float scale) {
    if (fmt == 0) return reinterpret_cast<const float*>(row)[i];
    if (fmt == 1) return __uint_as_float(((unsigned int)reinterpret_cast<const unsigned short*>(row)[i]) << 16);
    return decode_e4m3(row[i]) * scale;
}

// Grammar mask row, packed: bit k of word w allows token 32 w + k (the TokenMask wire layout).
__device__ __forceinline__ bool is_allowed(const unsigned int* mask_row, long long i) {
    return (mask_row[i >> 5] >> (i & 31)) & 1u;
}

struct RowState {
    float m;   // running max
    int idx;   // index of the first maximum seen
    float s;   // sum of e^(x - m)
    float t;   // sum of e^(x - m) (x - m)
};

// Combine two partial states. A side with s == 0 saw no finite logit and adds nothing; NaN and
// +inf logits make s or t NaN, which the host rejects.
__device__ __forceinline__ RowState combine(RowState a, RowState b) {
    const bool take_b = (b.m > a.m) || (b.m == a.m && b.idx < a.idx);
    RowState r;
    r.m = take_b ? b.m : a.m;
    r.idx = take_b ? b.idx : a.idx;
    r.s = 0.0f;
    r.t = 0.0f;
    if (!(a.s == 0.0f)) { const float d = a.m - r.m, e = expf(d); r.s += e * a.s; r.t += e * (a.t + a.s * d); }
    if (!(b.s == 0.0f)) { const float d = b.m - r.m, e = expf(d); r.s += e * b.s; r.t += e * (b.t + b.s * d); }
    return r;
}

__device__ __forceinline__ RowState shuffle_xor(RowState a, int lane_mask) {
    RowState r;
    r.m = __shfl_xor_sync(0xffffffffu, a.m, lane_mask);
    r.idx = __shfl_xor_sync(0xffffffffu, a.idx, lane_mask);
    r.s = __shfl_xor_sync(0xffffffffu, a.s, lane_mask);
    r.t = __shfl_xor_sync(0xffffffffu, a.t, lane_mask);
    return r;
}

__device__ __forceinline__ RowState warp_reduce(RowState a) {
    for (int lane_mask = 16; lane_mask > 0; lane_mask >>= 1) a = combine(a, shuffle_xor(a, lane_mask));
    return a;
}

// grid = (R,), block = (THREADS_PER_BLOCK,), one block per row.
extern "C" __global__ void row_stats(
        const unsigned char* data,     // [R, V] elements of fmt, row-major (4, 2 or 1 bytes each)
        const float* row_scales,       // [R] fp8 scale per row (unused for fp32 / bf16)
        const int* child_offsets,      // [R + 1] CSR: row r's children are entries [offsets[r], offsets[r+1])
        const int* child_nodes,        // [N] node index of each CSR entry
        const int* child_tokens,       // [N] token id of each CSR entry
        const unsigned int* allowed_words,  // [R, num_words] packed grammar mask (unread when num_words == 0)
        const int num_words,           // ceil(V / 32) with a mask, 0 without
        const int fmt,
        const int vocab_size,
        const int itemsize,
        float* out_max,                // [R]
        float* out_lse,                // [R]
        float* out_entropy,            // [R]
        int* out_argmax,               // [R]
        float* out_child_logits,       // [N], by node index
        float* out_child_probs) {      // [N], by node index
    __shared__ RowState warp_states[32];
    __shared__ float row_lse;
    const int r = blockIdx.x;
    const unsigned char* row = data + (long long)r * vocab_size * itemsize;
    const float scale = fmt == 2 ? row_scales[r] : 1.0f;
    // A forbidden token is read as -inf (MASKED_LOGIT): probability exactly 0, as in the reference.
    const unsigned int* mask_row = num_words ? allowed_words + (long long)r * num_words : nullptr;

    RowState st;
    st.m = NEG_INF;  // -inf
    st.idx = 0x7fffffff;
    st.s = 0.0f;
    st.t = 0.0f;
    for (int i = threadIdx.x; i < vocab_size; i += blockDim.x) {  // ascending: ties keep the first index
        if (mask_row && !is_allowed(mask_row, i)) continue;  // forbidden by the grammar: probability 0
        const float x = load_logit(row, fmt, i, scale);
        if (x == NEG_INF) continue;  // a masked token: probability 0
        if (x > st.m) {
            if (st.s > 0.0f) { const float d = st.m - x, e = expf(d); st.t = e * (st.t + st.s * d); st.s *= e; }
            st.s += 1.0f;
            st.m = x;
            st.idx = i;
        } else {  // also NaN, which poisons s and t
            const float d = x - st.m, e = expf(d);
            st.s += e;
            st.t += e * d;
        }
    }
    st = warp_reduce(st);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
    if (lane == 0) warp_states[warp] = st;
    __syncthreads();
    if (warp == 0) {
        RowState w;
        if (lane < num_warps) {
            w = warp_states[lane];
        } else {
            w.m = NEG_INF; w.idx = 0x7fffffff; w.s = 0.0f; w.t = 0.0f;
        }
        w = warp_reduce(w);
        if (lane == 0) {
            const float log_s = logf(w.s);
            out_max[r] = w.m;
            out_lse[r] = w.m + log_s;
            out_entropy[r] = log_s - w.t / w.s;
            out_argmax[r] = w.idx;
            row_lse = w.m + log_s;
        }
    }
    __syncthreads();
    for (int k = child_offsets[r] + threadIdx.x; k < child_offsets[r + 1]; k += blockDim.x) {
        const int token = child_tokens[k];
        const float x = (mask_row && !is_allowed(mask_row, token)) ? NEG_INF : load_logit(row, fmt, token, scale);
        out_child_logits[child_nodes[k]] = x;
        out_child_probs[child_nodes[k]] = expf(x - row_lse);
    }
}
"""


@dataclasses.dataclass(frozen=True, slots=True)
class RowStats:
    vocab_size: int
    row_max: torch.Tensor  # [R] fp32
    log_normalizer: torch.Tensor  # [R] fp32, log-sum-exp
    entropy: torch.Tensor  # [R] fp32, nats
    argmax_ids: torch.Tensor  # [R] int64
    child_logits: torch.Tensor  # [N] fp32, node j's logit at its parent's row
    child_probs: torch.Tensor  # [N] fp32, softmax probability of the same

    def check_finite(self) -> None:
        """NaN / +inf logits or rows without a finite logit surface here (the kernel does not raise)."""
        for name in ("row_max", "log_normalizer", "entropy"):
            bad = (~torch.isfinite(getattr(self, name))).nonzero()
            if bad.numel():
                raise ValueError(f"target_logits row {int(bad[0])} is not a valid distribution ({name} not finite)")


def row_stats_reference(
    logits: torch.Tensor, token_ids: Sequence[int], parents: Sequence[int], allowed: TokenBitmask | None = None
) -> RowStats:
    """Torch CPU reference of the kernel on decoded logits [R, V] fp32, under the grammar mask when given."""
    ids, _ = build_children(token_ids, parents, logits.shape[1])
    if allowed is not None:
        assert allowed.num_rows == logits.shape[0], "one mask row per logits row"
        logits = allowed.masked_rows(logits, list(range(logits.shape[0])))  # [R, V], MASKED_LOGIT where forbidden
    parent_rows = torch.tensor([int(p) + 1 for p in parents], dtype=torch.int64)  # [N]
    row_max = logits.amax(dim=-1)  # [R]
    lse = torch.logsumexp(logits, dim=-1)  # [R]
    child_logits = logits[parent_rows, torch.tensor(ids, dtype=torch.int64)]  # [N]
    return RowStats(
        logits.shape[1],
        row_max,
        lse,
        row_entropy(logits),
        torch.argmax(logits, dim=-1),
        child_logits,
        torch.exp(child_logits - lse[parent_rows]),
    )


def row_stats_cpu(
    encoded: EncodedLogits, token_ids: Sequence[int], parents: Sequence[int], allowed: TokenBitmask | None = None
) -> RowStats:
    return row_stats_reference(decode_logits(encoded), token_ids, parents, allowed)


class CudaRowStats:
    """The kernel, compiled on first call (import and construction need no GPU)."""

    def __init__(self, threads_per_block: int = THREADS_PER_BLOCK) -> None:
        if threads_per_block % 32 or not 32 <= threads_per_block <= 1024:
            raise ValueError(f"threads_per_block must be a multiple of 32 in [32, 1024], got {threads_per_block}")
        self.threads_per_block = threads_per_block
        self._function: Any = None

    def compile(self) -> None:
        """Compile now (NVRTC, ~0.1-1 s) rather than on the first request."""
        self._compiled()

    def _compiled(self) -> Any:
        if self._function is None:
            import cupy  # deferred: importing this module must not need CUDA

            self._function = cupy.RawModule(code=ROW_STATS_SOURCE).get_function(KERNEL_NAME)
        return self._function

    def __call__(
        self,
        encoded: EncodedLogits,
        token_ids: Sequence[int],
        parents: Sequence[int],
        allowed: TokenBitmask | None = None,
    ) -> RowStats:
        """Rows received inline: one host-to-device copy of the encoded bytes, no host decode."""
        import cupy

        data = cupy.asarray(np.frombuffer(encoded.data, dtype=np.uint8))  # [R * V * itemsize]
        return self.on_device(
            data, encoded.format, encoded.num_rows, encoded.vocab_size, encoded.row_scales, token_ids, parents, allowed
        )

    def on_device(
        self,
        data: Any,
        fmt: str,
        num_rows: int,
        vocab_size: int,
        row_scales: Sequence[float] | None,
        token_ids: Sequence[int],
        parents: Sequence[int],
        allowed: TokenBitmask | None = None,
    ) -> RowStats:
        """Rows already in device memory (a CuPy uint8 array, e.g. mapped from a CUDA IPC handle).
        The grammar mask travels packed (W = ceil(V / 32) words a row) and the kernel tests its bits."""
        import cupy

        assert data.dtype == cupy.uint8 and data.size == num_rows * vocab_size * ITEMSIZE[fmt], "encoded rows"
        assert allowed is None or (allowed.num_rows, allowed.vocab_size) == (num_rows, vocab_size), "mask shape"
        num_nodes, device_offsets, device_nodes, device_tokens = _device_tree(token_ids, parents, vocab_size)
        if num_rows != num_nodes + 1:  # row r reads offsets[r + 1] of N + 2: a further row reads past them
            raise ValueError(f"target_logits has {num_rows} rows, expected num_nodes + 1 = {num_nodes + 1}")
        scales = row_scales if row_scales is not None else (1.0,) * num_rows
        device_scales = cupy.asarray(np.asarray(scales, dtype=np.float32))  # [R]
        device_words, num_words = _device_mask(allowed)
        out_max, out_lse, out_entropy = (cupy.empty(num_rows, dtype=cupy.float32) for _ in range(3))
        out_argmax = cupy.empty(num_rows, dtype=cupy.int32)
        out_child_logits, out_child_probs = (cupy.empty(num_nodes + 1, dtype=cupy.float32) for _ in range(2))
        self._compiled()(
            (num_rows,),
            (self.threads_per_block,),
            (
                data,
                device_scales,
                device_offsets,
                device_nodes,
                device_tokens,
                device_words,
                np.int32(num_words),
                np.int32(FORMAT_CODES[fmt]),
                np.int32(vocab_size),
                np.int32(ITEMSIZE[fmt]),
                out_max,
                out_lse,
                out_entropy,
                out_argmax,
                out_child_logits,
                out_child_probs,
            ),
        )
        return RowStats(
            vocab_size,
            _host(out_max, num_rows),
            _host(out_lse, num_rows),
            _host(out_entropy, num_rows),
            _host(out_argmax, num_rows).to(torch.int64),
            _host(out_child_logits, num_nodes),
            _host(out_child_probs, num_nodes),
        )


def _device_tree(token_ids: Sequence[int], parents: Sequence[int], vocab_size: int) -> tuple[int, Any, Any, Any]:
    """The tree's children in CSR form on the device: (N, offsets [N+2], nodes [N+1], tokens [N+1]).
    One padding slot keeps the node arrays non-empty when N == 0."""
    import cupy

    _, children = build_children(token_ids, parents, vocab_size)
    offsets, nodes, tokens = _csr(children, token_ids)
    device_offsets, device_nodes, device_tokens = (
        cupy.asarray(np.asarray(a, dtype=np.int32)) for a in (offsets, nodes + [0], tokens + [0])
    )
    return len(nodes), device_offsets, device_nodes, device_tokens


def _device_mask(allowed: TokenBitmask | None) -> tuple[Any, int]:
    """The grammar mask's words on the device [R, W] and W; one unread word stands in for no mask.
    The words' bits as they are (int32 -> uint32 is a view)."""
    import cupy

    words = np.zeros((1, 1), dtype=np.uint32) if allowed is None else allowed.words.view(np.uint32)
    return cupy.asarray(np.ascontiguousarray(words)), 0 if allowed is None else words.shape[1]


def _csr(children: Children, token_ids: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """E.g. children ((0, 2), (1,), (), ()) -> offsets [0, 2, 3, 3, 3], nodes [0, 2, 1]."""
    offsets: list[int] = [0]
    nodes: list[int] = []
    for row_children in children:
        nodes.extend(row_children)
        offsets.append(len(nodes))
    return offsets, nodes, [int(token_ids[j]) for j in nodes]


def _host(array: Any, length: int) -> torch.Tensor:
    """The first `length` entries of a CuPy array, on the host."""
    import cupy

    return torch.from_numpy(cupy.asnumpy(array)[:length])


def cuda_device_count() -> int:
    """0 when CuPy, the driver or a device is missing."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CuPy raises its own runtime errors without a driver
        return 0


RowStatsFn = Callable[[EncodedLogits, Sequence[int], Sequence[int], TokenBitmask | None], RowStats]


def validate_from_stats(
    stats: RowStats,
    token_ids: Sequence[int],
    parents: Sequence[int],
    *,
    argmax_ids: Sequence[int] | None = None,
    acceptance_threshold: float = 0.0,
) -> ValidationResult:
    """Greedy (threshold 0) or temperature-0 threshold validation from row statistics.

    Equals acceptance.greedy_accept / threshold_accept(temperature 0) on the decoded logits.
    argmax_ids [N+1], when given (the primary's fp32 argmax), overrides stats.argmax_ids.
    """
    stats.check_finite()
    num_rows = stats.row_max.shape[0]
    ids, children = build_children(token_ids, parents, stats.vocab_size)
    if len(ids) + 1 != num_rows:
        raise ValueError(f"target_logits has {num_rows} rows, expected num_nodes + 1 = {len(ids) + 1}")
    argmax = check_argmax_ids(argmax_ids, num_rows, stats.vocab_size) or stats.argmax_ids.tolist()
    entropies = stats.entropy.tolist()
    if acceptance_threshold == THRESHOLD_OFF:
        return greedy_walk(children, ids, argmax, entropies)
    check_threshold(acceptance_threshold)
    parent_max = [float(stats.row_max[int(p) + 1]) for p in parents]
    child_logits = stats.child_logits.tolist()
    qualified = threshold_greedy_qualified(child_logits, parent_max, acceptance_threshold)
    accepted, stop_row = threshold_walk(children, child_logits, qualified)
    return walk_result(children, accepted, stop_row, argmax[stop_row], entropies)
