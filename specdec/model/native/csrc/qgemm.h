/* qgemm: weight-only 4-bit and 8-bit matrix products for the CPU, and the dense parts of a decoder
 * layer around them. The public interface: every struct and function the Python side
 * (`specdec/model/native/__init__.py`, through ctypes) reaches, by name.
 *
 * Activations are quantized per row in blocks of 32 (q8 block: int8 x[j] * dx, dx = max|x| / 127,
 * and sx = dx * sum x[j] for the 4-bit minimum term); then every block's product is an exact
 * integer dot product, scaled once:
 *
 *   4-bit (a GGUF Q4_1 block's values: fp16 d, fp16 m, 32 nibbles; w = q * d + m):
 *       y[t, n] = sum_g  d[n,g] dx[t,g] * (q . xq)  +  m[n,g] * sx[t,g]
 *   8-bit rows (int8 w[n, k] with one fp32 scale per row):
 *       y[t, n] = scale[n] * sum_g dx[t,g] * (w . xq)
 *   8-bit rows per token (QW_Q8T: the same weights; the activation row t quantized whole, one scale
 *   dx[t], each value an integer q in [-16383, 16383] held as q = 128 h + l, h and l int8):
 *       y[t, n] = scale[n] * (dx[t] * fma(128, (float)(w . h), (float)(w . l)))
 *   Its dot products run over the whole row with no rescale between blocks, so a tile multiply
 *   (AMX) keeps its sums in the tile from the first input to the last.
 *
 * Every output element is computed alone, blocks in order in fp32, so it is the same whatever the
 * number of rows T in the call (batch invariance: a k-row verify and 1-row decoding agree bit for
 * bit) and whatever the instruction set the products run on (gemm.c: the same bits on every path).
 *
 * Sources (one library, built from every .c here):
 *   qgemm.h          this interface
 *   impl.h           internal: ISA detection, constants, fp16 <-> fp32, exp8, qact, internal calls
 *   quants.c         activation quantization (qgemm_quantize_rows, qact_init)
 *   gemm.h           the product paths' contract: what an instruction-set file defines
 *   gemm.c           the product loop, the dispatch to one path (its fallback map), qgemm_linear
 *   gemm_generic.c   the portable reference products
 *   gemm_avx512.c    AVX-512 + VNNI products (empty unless that ISA is enabled)
 *   gemm_avx2.c      AVX2 products, with or without VNNI (empty unless AVX2 is the path)
 *   gemm_amx.c       AMX int8 tile products beside the AVX-512 ones (empty unless AMX is enabled)
 *   ops.c            rmsnorm, rope, silu_mul, the row-wise phases, layer_pre, layer_post
 *   forward.c        qgemm_forward: every layer in one parallel region
 *   scratch.c        each thread's scratch for a parallel region
 *   attention.c      attention of a span's new rows over its KV cache
 *   logits.c         argmax rows (masked too), e4m3 encoding, byte histograms
 *   profile.c        the forward's timer: products, attention, the rest
 *   abi.c            qgemm_abi: the structs' layout, checked against the ctypes mirror at load
 */
#ifndef QGEMM_H
#define QGEMM_H

#include <stdint.h>

/* ---- structs (mirrored field for field by ctypes: QWeight, QLayer, QSpan; see qgemm_abi) ---- */

enum { QW_Q4 = 4, QW_Q8 = 8, QW_Q8T = 9 };   /* QW_Q8T: QW_Q8's weights, activations per token */

/* One quantized matrix [n, k] in the packed layouts (gemm.h), by pointer. */
typedef struct {
    int32_t kind;            /* QW_Q4, QW_Q8 or QW_Q8T */
    int32_t pad;
    const void *w;           /* QW_Q4: nibbles [nv][G][256]; QW_Q8(T): w + 128 [nv][k/4][16][4] */
    const float *scale;      /* QW_Q8(T): [nv * 16] */
    const float *bias;       /* [n] or NULL */
    int64_t n, k;
    const uint16_t *d, *m;   /* QW_Q4: fp16 [nv][G][16] */
} qweight;

typedef struct {             /* one decoder layer: its norms and seven products */
    const float *norm1, *norm2;
    float eps1, eps2;
    const qweight *q, *k, *v, *o, *gate, *up, *down;
} qlayer;

typedef struct {             /* rows [start, start + n) of the batch: one sequence's new tokens */
    int64_t start, n, num_cached;
    void *k_cache, *v_cache;     /* layer l at + l * layer_stride elements: [Hkv, capacity, D] */
    int64_t layer_stride, capacity;
    const uint8_t *mask;         /* [n, num_cached + n] (1 = attend) or NULL: all */
    int64_t half;                /* the caches hold fp16 (else fp32) */
} qspan;

/* ---- abi.c ---- */

/* The layout of qweight, qlayer and qspan as this compiler laid them out: qgemm_abi_names() is a
 * space-separated list of names ("qweight", "qweight.kind", ..., "qspan.half"), and qgemm_abi
 * writes, for each name in turn, two values: (0, sizeof) for a struct, (offsetof, sizeof) for a
 * field. It writes the first `cap` values to out and returns how many there are. */
const char *qgemm_abi_names(void);
int64_t qgemm_abi(int64_t *out, int64_t cap);

/* ---- quants.c ---- */

/* x [T, K] fp32 -> xq int8 [T, K], dx [T, K/32], sx [T, K/32]: the activations as the products
 * read them (per block of 32, round to nearest even). */
void qgemm_quantize_rows(const float *x, int64_t T, int64_t K, int8_t *xq, float *dx, float *sx);

/* ---- gemm.c ---- */

/* The instruction path the products run on: "AVX512+VNNI", "AVX2+VNNI", "AVX2" or "portable". */
const char *qgemm_isa(void);

/* Whether this build has the AMX path (gemm_amx.c): the compiler targets AMX-TILE and AMX-INT8. */
int qgemm_amx_built(void);

/* Products of at least min_rows rows run on AMX tiles (the same bits), fewer on qgemm_isa()'s path;
 * min_rows <= 0 turns AMX off. The process must have been granted the tile data state first
 * (arch_prctl ARCH_REQ_XCOMP_PERM): without it, or without the path, AMX stays off. Returns the
 * row count now in effect, 0 for off. Process-wide: call it before any product runs. */
int64_t qgemm_set_amx(int64_t min_rows);

/* The row count from which products run on AMX tiles; 0: they never do. */
int64_t qgemm_amx_min_rows(void);

/* The same for per-token 8-bit products (QW_Q8T), whose tiles pay from fewer rows. */
int64_t qgemm_amx_token_min_rows(void);

/* out [T, w.n] = x [T, w.k] @ w^T (+ bias). Returns -1 when out of memory, else 0. */
int qgemm_linear(const float *x, int64_t T, const qweight *w, float *out, int num_threads);

/* ---- ops.c, forward.c ---- */

/* out = x * rsqrt(mean(x^2) + eps) * weight, per row; x, out [T, C] */
void qgemm_rmsnorm(const float *x, int64_t T, int64_t C, const float *weight, float eps, float *out);

/* Before attention: h = RMSNorm(x); q = RoPE(h Wq), k = RoPE(h Wk), v = h Wv.
 * x [T, C]; q [T, H, D], k/v [T, Hkv, D]; cos_t/sin_t [P, D]. Returns -1 when out of memory. */
int qgemm_layer_pre(const float *x, int64_t T, int64_t C, const float *norm_w, float eps,
                    const qweight *wq, const qweight *wk, const qweight *wv, int64_t heads, int64_t kv_heads,
                    int64_t D, const float *cos_t, const float *sin_t, const int64_t *positions,
                    float *q, float *k, float *v, int num_threads);

/* After attention: h = x + attn Wo; out = h + Wdown(silu(Wgate n) * Wup n), n = RMSNorm(h).
 * x, out [T, C]; attn [T, H*D]. Returns -1 when out of memory. */
int qgemm_layer_post(const float *x, const float *attn, int64_t T, int64_t C, const qweight *wo,
                     const float *norm_w, float eps, const qweight *wgate, const qweight *wup,
                     const qweight *wdown, float *out, int num_threads);

/* x [T, C] in place: every layer of `layers` in turn, each exactly as qgemm_layer_pre, the cache
 * write, qgemm_attention per span and qgemm_layer_post do it one call at a time (same bits), in
 * one parallel region (forward.c). Returns -1 when out of memory. */
int qgemm_forward(float *x, int64_t T, int64_t C, const qlayer *layers, int64_t num_layers, int64_t H,
                  int64_t Hkv, int64_t D, const float *cos_t, const float *sin_t, const int64_t *positions,
                  const qspan *spans, int64_t num_spans, int num_threads);

/* ---- attention.c ---- */

/* Chunks of at least min_queries queries of one KV head take their scores with sixteen keys in a
 * vector's lanes (the same bits as the other paths); min_queries <= 0: never. Only the AVX-512 build
 * has that path: elsewhere it stays off. Returns the count now in effect, 0 for off. Process-wide:
 * call it before any attention runs. */
int qgemm_set_att_lanes(int min_queries);

/* The query count from which chunks take keys in lanes; 0: they never do. */
int qgemm_att_lanes(void);

/* out [n, H, D]: row r, head h attends the cache rows j < L of kv head h / (H / Hkv) with mask[r, j]
 * (uint8 [n, L]; NULL: every row attends all of them), softmax in fp32. The caches [Hkv, capacity,
 * D] are fp32, or fp16 with `half`. Returns -1 when out of memory. */
int qgemm_attention(const float *q, int64_t n, int64_t H, int64_t Hkv, int64_t D, const void *k_cache,
                    const void *v_cache, int half, int64_t capacity, int64_t L, const uint8_t *mask,
                    float *out, int num_threads);

/* ---- logits.c: logits post-processing (specdec/logits_codec.py, validator_svc/fp8_stats.py) ---- */

/* argmax [R]: the index of the first maximum of each row of x [R, V], as torch.argmax chooses it;
 * -1 for a row holding a NaN. */
void qgemm_argmax_rows(const float *x, int64_t R, int64_t V, int64_t *argmax);

/* argmax [R] of each row among the positions it allows (bit j % 32 of words[r * W + j / 32]), the
 * lowest id on ties; -1 for a row whose allowed positions hold a NaN, -2 for a row allowing none. */
void qgemm_argmax_rows_masked(const float *x, int64_t R, int64_t V, const uint32_t *words, int64_t W,
                              int64_t *argmax);

/* Logits x [R, V] -> e4m3fn codes [R, V] of (x - rowmax) / scale and scales [R]. Returns -1 at the
 * first row that is not finite, else 0. */
int qgemm_encode_e4m3(const float *x, int64_t R, int64_t V, float zero_scale, uint8_t *codes, float *scales);

/* counts [R, 256]: how often each byte occurs in each row of codes [R, V]. */
void qgemm_byte_histograms(const uint8_t *codes, int64_t R, int64_t V, uint32_t *counts);

/* The same counts over the positions row r allows: bit j % 32 of words[r * W + j / 32]. */
void qgemm_byte_histograms_masked(const uint8_t *codes, int64_t R, int64_t V, const uint32_t *words, int64_t W,
                                  uint32_t *counts);

/* ---- profile.c ---- */

/* The forward's timer on (1) or off (0, the default): seconds of every qgemm_forward spent in the
 * products, in attention and in the rest, summed until qgemm_profile_reset. */
void qgemm_set_profile(int on);

/* out[0..3) = seconds in products, attention, the rest, summed over the forwards since the last
 * reset; returns how many forwards that was. */
int64_t qgemm_profile(double *out);

void qgemm_profile_reset(void);

#endif
