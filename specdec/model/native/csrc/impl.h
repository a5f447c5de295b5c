/* Internal to the library (not part of qgemm.h): instruction-set detection, the layout constants,
 * scalar helpers every file shares, the quantized activation, and the calls between files.
 *
 * Instruction sets are chosen at compile time (the library is built with -march=native for the
 * machine at hand; variants with -mno-... build the narrower paths): QGEMM_AVX512 and QGEMM_AVX2
 * say which x86 paths this build enables. The functions declared here for other files are
 * QGEMM_HIDDEN, left out of the shared library's exports: only qgemm.h's are the interface.
 */
#ifndef QGEMM_IMPL_H
#define QGEMM_IMPL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qgemm.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QGEMM_AVX2 1
#else
#define QGEMM_AVX2 0
#endif

/* 512-bit products where the CPU has AVX-512 with VNNI: two blocks per instruction */
#if QGEMM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define QGEMM_AVX512 1
#else
#define QGEMM_AVX512 0
#endif

/* AMX int8 tiles beside the AVX-512 path (gemm_amx.c), where the compiler targets them */
#if QGEMM_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define QGEMM_AMX 1
#else
#define QGEMM_AMX 0
#endif
#define QGEMM_SLAB 16    /* activation rows per AMX tile: qact pads xq to whole slabs (zero rows) */

/* for (int64_t t = 0; t < T; ++t) body, the rows split over the threads of the enclosing parallel
 * region (an orphaned worksharing loop: every thread of the team must reach it; outside a region
 * the calling thread runs every row). Ends with a barrier: the rows are whole after it. Each row's
 * arithmetic is its own, so the split never changes a bit. */
#define QGEMM_FOR_ROWS(t, T, body)                                                        \
    do {                                                                                  \
        _Pragma("omp for schedule(static)")                                               \
        for (int64_t t = 0; t < (T); ++t) { body }                                        \
    } while (0)

/* The same over blocks of up to QGEMM_NORM_ROWS rows, rows [t0, t0 + n) per block: the rows'
 * RMSNorm sums run side by side (qgemm_rmsnorm), and a few rows still spread over every thread. */
#define QGEMM_NORM_ROWS 8
#define QGEMM_FOR_ROW_BLOCKS(t0, n, T, body)                                              \
    do {                                                                                  \
        const int64_t block_ = qgemm_row_block(T);                                        \
        _Pragma("omp for schedule(static)")                                               \
        for (int64_t t0 = 0; t0 < (T); t0 += block_) {                                    \
            const int64_t n = (T) - t0 < block_ ? (T) - t0 : block_;                      \
            body                                                                          \
        }                                                                                 \
    } while (0)

/* AVX2 tiles with a 256-bit VNNI dot product (AVX-VNNI, or AVX-512 VNNI's VL forms) */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define QGEMM_DP8_VNNI 1
#else
#define QGEMM_DP8_VNNI 0
#endif

#define QK 32            /* weights per block */
#define NV 16            /* output columns interleaved per group in the packed layouts (gemm.h) */

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define QGEMM_HIDDEN __attribute__((visibility("hidden")))   /* shared between files, not exported */

/* IEEE half -> fp32, exact (F16C where the build has AVX2) */
static inline float fp16_to_fp32(uint16_t h) {
#if QGEMM_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {                                   /* subnormal: normalise */
            exp = 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            mant &= 0x3FF;
            bits = sign | ((exp + 112) << 23) | (mant << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7F800000 | (mant << 13); }
    else { bits = sign | ((exp + 112) << 23) | (mant << 13); }
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

/* round to nearest even, as torch's .half() */
static inline uint16_t fp32_to_fp16(float f) {
#if QGEMM_AVX2
    return _cvtss_sh(f, 0);
#else
    uint32_t x; memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u);   /* inf, nan */
    if (a >= 0x477FF000u) return sign | 0x7C00u;                                      /* >= 65520: inf */
    if (a < 0x38800000u) {                                   /* below 2^-14: a subnormal half or 0 */
        float v; memcpy(&v, &a, 4);
        return sign | (uint16_t)lrintf(v * 16777216.f);      /* exact scaling by 2^24, then RNE */
    }
    uint32_t h = (a >> 13) - (112u << 10);                   /* rebias 127 -> 15, keep 10 bits */
    const uint32_t rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  /* a carry rounds into the exponent */
    return sign | (uint16_t)h;
#endif
}

/* exp on a vector of fp32 lanes, the same IEEE operations in every lane, whatever the width (so
 * attention's softmax and silu_mul give the same bits on 8 and 16 lanes): Cephes' expf polynomial,
 * |error| <= 2 ulp on [-87, 88]. One definition per width: P is the intrinsics' prefix (_mm256,
 * _mm512), V and VI the float and integer vectors, FLOOR rounds toward -inf, AS_FLOAT reinterprets
 * an integer vector's bits. */
#define QGEMM_DEFINE_EXP(name, P, V, VI, FLOOR, AS_FLOAT)                                          \
    static inline V name(V x) {                                                                    \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.33654f)), P##_set1_ps(88.37626f));            \
        const V fx = FLOOR(P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), P##_set1_ps(.5f)));   \
        V r = P##_fnmadd_ps(fx, P##_set1_ps(0.693359375f), x);                                     \
        r = P##_fnmadd_ps(fx, P##_set1_ps(-2.12194440e-4f), r);                                    \
        V y = P##_set1_ps(1.9875691500e-4f);                                                       \
        y = P##_fmadd_ps(y, r, P##_set1_ps(1.3981999507e-3f));                                     \
        y = P##_fmadd_ps(y, r, P##_set1_ps(8.3334519073e-3f));                                     \
        y = P##_fmadd_ps(y, r, P##_set1_ps(4.1665795894e-2f));                                     \
        y = P##_fmadd_ps(y, r, P##_set1_ps(1.6666665459e-1f));                                     \
        y = P##_fmadd_ps(y, r, P##_set1_ps(5.0000001201e-1f));                                     \
        y = P##_add_ps(P##_fmadd_ps(y, P##_mul_ps(r, r), r), P##_set1_ps(1.f));                    \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvttps_epi32(fx), P##_set1_epi32(127)), 23); \
        return P##_mul_ps(y, AS_FLOAT(e));                                                         \
    }

#if QGEMM_AVX2
QGEMM_DEFINE_EXP(exp8, _mm256, __m256, __m256i, _mm256_floor_ps, _mm256_castsi256_ps)
#endif

#if QGEMM_AVX512
static inline __m512 floor16(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
QGEMM_DEFINE_EXP(exp16, _mm512, __m512, __m512i, floor16, _mm512_castsi512_ps)
#endif

/* The same exp on one float, operation for operation (fmaf where the lanes fuse, truncation to int
 * as cvttps, the same clamps: max/min return the bound for a NaN as the vector forms do), for the
 * portable build's softmax and SiLU: without it they took libm's expf and the portable build's
 * attention and forward differed in the last bits from the vector builds'. */
static inline float exp1(float x) {
    x = fminf(fmaxf(x, -87.33654f), 88.37626f);
    const float fx = floorf(fmaf(x, 1.44269504088896341f, .5f));
    float r = fmaf(-fx, 0.693359375f, x);
    r = fmaf(-fx, -2.12194440e-4f, r);
    float y = 1.9875691500e-4f;
    y = fmaf(y, r, 1.3981999507e-3f);
    y = fmaf(y, r, 8.3334519073e-3f);
    y = fmaf(y, r, 4.1665795894e-2f);
    y = fmaf(y, r, 1.6666665459e-1f);
    y = fmaf(y, r, 5.0000001201e-1f);
    const float r2 = r * r;
    y = fmaf(y, r2, r) + 1.f;
    const uint32_t e = (uint32_t)((int32_t)fx + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return y * scale;
}

static inline int32_t ld4(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* ---- profile.c: the forward's timer (qgemm_set_profile) ---- */

enum { QGEMM_PART_PRODUCTS, QGEMM_PART_ATTENTION, QGEMM_PART_REST, QGEMM_NUM_PARTS };

/* whether the timer is on: read before every call below, so that off costs a branch */
QGEMM_HIDDEN extern int qgemm_is_profiling;
/* a forward starts: the clock from here */
QGEMM_HIDDEN void qgemm_profile_begin(void);
/* the time since the last mark (or the start) was spent in `part`; nothing outside a forward */
QGEMM_HIDDEN void qgemm_profile_mark(int part);
/* a forward ends: the time since the last mark is the rest's */
QGEMM_HIDDEN void qgemm_profile_end(void);

/* ---- scratch.c: each thread's scratch for one parallel region ----
 *
 * Allocated before the region, one per thread the region may run (so nothing inside a region
 * allocates or can fail), and handed to the orphaned loops below by omp_get_thread_num(). */
typedef struct {
    uint8_t *tile_b;         /* AMX 4-bit: a column group's B tiles, max_k / 32 blocks of 512 bytes */
    int32_t *tile_sums;      /* AMX: QGEMM_TILE_SUMS int32 (a ring of 16 x 16 sums, or a slab's sums) */
    const void *tile_config; /* the AMX tile configuration this thread has loaded; NULL: none */
    float *att_s;            /* attention: a chunk's scores [chunk, max_L] */
    int64_t *att_keys;       /* [max_L] */
    float *att_tmp;          /* [max_L] */
    float *att_vf;           /* a value block widened to fp32 [ATT_KEY_BLOCK, D] */
} qscratch;
#define QGEMM_TILE_SUMS (4 * 256)

/* What a region's scratch must hold: the widest product input (tile_b) and attention's chunk. */
typedef struct {
    int64_t max_k, att_chunk, att_max_L, D;
} qscratch_size;

/* num_threads scratches of `size` (att_chunk 0: none for attention); NULL when out of memory */
QGEMM_HIDDEN qscratch *qscratch_team(int num_threads, qscratch_size size);
/* after the region: frees every scratch (the threads released their tiles at the region's end) */
QGEMM_HIDDEN void qscratch_team_free(qscratch *team, int num_threads);
/* this thread's scratch in the region */
QGEMM_HIDDEN qscratch *qscratch_mine(qscratch *team);
/* at the end of a region, on every thread: releases the tiles if this thread loaded them */
QGEMM_HIDDEN void qscratch_release(qscratch *s);

/* ---- quants.c: an activation [T, k] quantized once for every product that reads it ---- */

/* The 8-bit AVX-512 product reads each block's integer sum (xs); the other paths do not. */
#define QGEMM_ACT_SUMS QGEMM_AVX512

/* Per token (QW_Q8T, qgemm.h): a row's values as integers q = rint(x / dx) in [-QT_MAX, QT_MAX], one
 * scale dx per row, each q held as two int8 halves: h = q >> 7 in [-128, 127] and l = q - 128 h in
 * [0, 127], so that q = 128 h + l and every product is two exact int8 dot products. */
#define QT_MAX 16383

typedef struct {
    int8_t *xq;              /* [T, k], then zero rows to qgemm_act_rows (an AMX tile load reads 16);
                                per token: the high halves h */
    int8_t *xl;              /* per token: the low halves l, [T, k] padded as xq; else NULL */
    int32_t *xs;             /* [T, k/32] sum of each block's xq (with QGEMM_ACT_SUMS, else NULL);
                                per token: [T][2] the sums of h and of l over the row */
    float *dx, *sx;          /* [T, k/32]; per token: dx [T], sx NULL */
    int per_token;
} qact;

/* gemm.c: the rows a qact of T rows holds, T or (when its products run on AMX tiles) T rounded up to
 * whole slabs */
QGEMM_HIDDEN int64_t qgemm_act_rows(int64_t T, int per_token);
/* a's buffers for T rows of K, quantized per block of 32 or (per_token) per row (xq's slab padding, if
 * any, zeroed); -1 when out of memory (qact_free then releases what was allocated) */
QGEMM_HIDDEN int qact_alloc(qact *a, int64_t T, int64_t K, int per_token);
/* row t of a = x [K] quantized: each row alone, so rows can be quantized in any order or thread */
QGEMM_HIDDEN void qact_quantize_row(qact *a, const float *x, int64_t t, int64_t K);
/* rows [0, T) of a = x [T, K] quantized, rows over the enclosing region's threads (QGEMM_FOR_ROWS) */
QGEMM_HIDDEN void qact_quantize_rows_for(qact *a, const float *x, int64_t T, int64_t K);
QGEMM_HIDDEN void qact_free(qact *a);

/* ---- gemm.c ---- */

/* outs[i] [T, ws[i].n] = a @ ws[i]^T (+ bias) for `count` products of one activation: ONE
 * worksharing loop over all their units of columns, orphaned (every thread of the enclosing region
 * calls it, with its scratch), ending with a barrier. Every element is computed as by the single
 * product, whatever thread computes it. */
QGEMM_HIDDEN void qmatmul_many_for(const qact *a, int64_t T, const qweight *const *ws, float *const *outs,
                                   int count, qscratch *team);

/* the scratch qmatmul_many_for's products of inputs up to max_k need */
static inline qscratch_size qscratch_for_products(int64_t max_k) { return (qscratch_size){max_k, 0, 0, 0}; }

/* ---- attention.c ---- */

#define ATT_KEY_BLOCK 64     /* key rows per block: 16 KB of fp32 keys at D = 64, within L1 */
#define ATT_MAX_CHUNK 48     /* queries per work item */

/* One batch of attention: `num_spans` sequences, each of n rows (queries [n, H, D] at q, outputs at
 * out) over its own cache (kv head h at + h * capacity * D elements) of L rows under its mask. */
typedef struct {
    const float *q;
    float *out;
    int64_t n, L, capacity;
    const void *k, *v;
    const uint8_t *mask;     /* [n, L] (1 = attend) or NULL: all */
} att_seq;

/* How a batch of sequences' queries split into work items: `chunk` queries of one KV head at most
 * per item, first_item[i] the first item of sequence i (first_item[num_seqs]: their number). The
 * split depends only on the sequences' row counts, never on a query's bits. */
typedef struct {
    int64_t chunk, max_L;
    int64_t *first_item;     /* [num_seqs + 1] */
} att_plan;

/* the plan for `seqs`, chunks small enough for two per thread; -1 when out of memory */
QGEMM_HIDDEN int att_plan_init(att_plan *p, const att_seq *seqs, int64_t num_seqs, int64_t H, int64_t Hkv,
                               int num_threads);
QGEMM_HIDDEN void att_plan_free(att_plan *p);

/* Every sequence's attention: one orphaned worksharing loop over the plan's items, WITHOUT a barrier
 * at its end (the caller's next barrier makes the outputs whole). */
QGEMM_HIDDEN void attend_seqs_for(const att_seq *seqs, int64_t num_seqs, const att_plan *p, int64_t H, int64_t Hkv,
                                  int64_t D, int half, qscratch *team);

/* ---- ops.c: the row-wise parts of a layer, each an orphaned loop over rows (QGEMM_FOR_ROWS) ---- */

/* rows per block of QGEMM_FOR_ROW_BLOCKS in the enclosing region: T over its threads, at most
 * QGEMM_NORM_ROWS */
QGEMM_HIDDEN int64_t qgemm_row_block(int64_t T);
/* h = RMSNorm(x), then quantized into a; x, h [T, C] */
QGEMM_HIDDEN void rows_norm_quantize(const float *x, int64_t T, int64_t C, const float *norm_w, float eps, float *h,
                                     qact *a);
/* rotate-half RoPE of every row's q [T, H, D] and k [T, Hkv, D] heads at their positions */
QGEMM_HIDDEN void rope_row(float *q, float *k, int64_t t, int64_t H, int64_t Hkv, int64_t D, const float *cos_t,
                           const float *sin_t, const int64_t *positions);
/* h = x + o in place of o, n = RMSNorm(h), quantized into a; [T, C] */
QGEMM_HIDDEN void rows_residual_norm_quantize(float *o, const float *x, int64_t T, int64_t C, const float *norm_w,
                                              float eps, float *n, qact *a);
/* g = silu(g) * u, quantized into a; [T, I] */
QGEMM_HIDDEN void rows_silu_quantize(float *g, const float *u, int64_t T, int64_t I, qact *a);

/* ---- forward-wide timing marks (profile.c), by the master thread after a barrier ---- */
#define QGEMM_PHASE_END(part)                                     \
    do {                                                          \
        if (qgemm_is_profiling) {                                 \
            _Pragma("omp master")                                 \
            qgemm_profile_mark(part);                             \
        }                                                         \
    } while (0)

#endif
