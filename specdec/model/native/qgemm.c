/* Weight-only 4-bit and 8-bit matrix products for the CPU, in the style of llama.cpp's Q4_1 x Q8_1.
 *
 * Activations are quantized per row in blocks of 32 (q8 block: int8 x[j] * dx, dx = max|x| / 127,
 * and sx = dx * sum x[j] for the 4-bit minimum term); then every block's product is an exact
 * integer dot product, scaled once:
 *
 *   4-bit (a GGUF Q4_1 block's values: fp16 d, fp16 m, 32 nibbles; w = q * d + m):
 *       y[t, n] = sum_g  d[n,g] dx[t,g] * (q . xq)  +  m[n,g] * sx[t,g]
 *   8-bit rows (int8 w[n, k] with one fp32 scale per row):
 *       y[t, n] = scale[n] * sum_g dx[t,g] * (w . xq)
 *
 * The weights are stored interleaved by 16 output columns (see "the products" below) so that one
 * vector lane is one output: every path sums each block's whole integer dot product, then scales
 * and accumulates blocks in order in fp32. Every output element is therefore computed alone, in the
 * same order whatever the number of rows T in the call (batch invariance: a k-row verify and 1-row
 * decoding agree bit for bit) and whatever the instruction set (AVX-512, AVX2 with or without VNNI,
 * portable: the products give the same bits on every machine).
 * Threads: OpenMP, sharing the process's runtime (torch's libgomp is loaded first and has the
 * same soname), over units of output columns handed out dynamically: the service's other processes
 * share these cores, and with a static split every parallel region waits for the thread that lost
 * its core; dynamically the thread that runs takes the rest. The split never changes an element's
 * arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
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

#define QK 32            /* weights per block */

/* the instruction path the products run on, for logs and benchmark headers */
const char *qgemm_isa(void) {
#if QGEMM_AVX512
    return "AVX512+VNNI";
#elif QGEMM_AVX2 && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
    return "AVX2+VNNI";
#elif QGEMM_AVX2
    return "AVX2";
#else
    return "portable";
#endif
}

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

/* x [T, K] fp32 -> xq int8 [T, K], dx [T, K/32], sx [T, K/32], and (unless NULL) xs [T, K/32], each
 * block's integer sum. The AVX2 path computes the same values (max is exact in any order; cvtps
 * rounds to nearest even as lrintf does by default). */
static void quantize_rows(const float *x, int64_t T, int64_t K, int8_t *xq, float *dx, float *sx, int32_t *xs) {
    const int64_t G = K / QK;
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t g = 0; g < G; ++g) {
            const float *b = x + t * K + g * QK;
            int8_t *q = xq + t * K + g * QK;
#if QGEMM_AVX2
            const __m256 sign = _mm256_set1_ps(-0.f);
            __m256 v[4];
            for (int u = 0; u < 4; ++u) v[u] = _mm256_loadu_ps(b + 8 * u);
            const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float amax = _mm_cvtss_f32(h);
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            const __m256 ids = _mm256_set1_ps(id);
            __m256i r[4];
            for (int u = 0; u < 4; ++u) r[u] = _mm256_cvtps_epi32(_mm256_mul_ps(v[u], ids));
            /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
            const __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
            const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                           _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)q, p8);
            const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            const int sum = _mm_cvtsi128_si32(s4);
#else
            float amax = 0.f;
            for (int j = 0; j < QK; ++j) amax = fmaxf(amax, fabsf(b[j]));
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            int sum = 0;
            for (int j = 0; j < QK; ++j) { q[j] = (int8_t)lrintf(b[j] * id); sum += q[j]; }
#endif
            dx[t * G + g] = d;
            sx[t * G + g] = d * (float)sum;
            if (xs) xs[t * G + g] = sum;
        }
    }
}

void qgemm_quantize_rows(const float *x, int64_t T, int64_t K, int8_t *xq, float *dx, float *sx) {
    quantize_rows(x, T, K, xq, dx, sx, NULL);
}

#include <stdlib.h>

/* ---- the products: weights interleaved by 16 output columns ----
 *
 * Layouts (packed once at load, `specdec/model/native/__init__.py`; nv = ceil(n / 16) groups of 16
 * output columns, the last one padded with zero weights; G = k / 32 blocks):
 *   4-bit: nibbles [nv][G][4][64]: vector j of block g holds, for each column c of the group, the
 *          4 weights 4j..4j+3 of the block in the low nibbles of bytes 4c..4c+3 and the weights
 *          4j+16..4j+19 in their high nibbles; d, m fp16 [nv][G][16] (the file's own, unrounded).
 *   8-bit: uint8 [nv][k/4][16][4]: for each 4 inputs, the 16 columns' 4 weights side by side,
 *          each stored as w + 128 (w ^ 0x80); scale fp32 [nv * 16].
 * One 32-bit lane of a vector is one output column, so a dot-product instruction (vpdpbusd, or
 * maddubs + madd) adds 4 products to each of 16 (8) columns' integer sums, against 4 activation
 * bytes broadcast. After a block's 8 steps the lane holds the block's whole integer dot product S,
 * and every path, whatever its width, then does per output element, blocks in order:
 *     4-bit: acc = fma(d * dx, (float)S, acc); acc = fma(m, sx, acc)      out = acc
 *     8-bit: acc = fma(dx, (float)S, acc)                                  out = scale * acc
 * So AVX-512, AVX2 (with or without VNNI) and the portable loops give the same bits, and a row's
 * result does not depend on the other rows of the call. The 8-bit AVX-512 path multiplies the
 * stored w + 128 (vpdpbusd's unsigned operand) by x and starts each block's sum at -128 * sum(x),
 * which takes the 128 * sum(x) back out exactly; the AVX2 path multiplies |w| by x with w's sign
 * (maddubs pairs stay below 2 * 127 * 127, no saturation).
 * Registers hold a tile of R rows x C vectors of columns; a thread takes a unit of columns (groups
 * of 16, unit_groups) and walks all rows through it, so the unit's weights stay in L1/L2.
 */
#define NV 16
#if QGEMM_AVX512
#define UNIT 4
#elif QGEMM_AVX2
#define UNIT 1
#else
#define UNIT 4
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { QW_Q4 = 4, QW_Q8 = 8 };

typedef struct {
    int32_t kind;            /* QW_Q4 or QW_Q8, layouts above */
    int32_t pad;
    const void *w;           /* QW_Q4: nibbles [nv][G][256]; QW_Q8: w + 128 [nv][k/4][16][4] */
    const float *scale;      /* QW_Q8: [nv * 16] */
    const float *bias;       /* [n] or NULL */
    int64_t n, k;
    const uint16_t *d, *m;   /* QW_Q4: fp16 [nv][G][16] */
} qweight;

typedef struct {             /* an activation [T, k] quantized once for every product that reads it */
    int8_t *xq;              /* [T, k] */
    int32_t *xs;             /* [T, k/32] sum of each block's xq (the 8-bit AVX-512 path's, else NULL) */
    float *dx, *sx;          /* [T, k/32] */
} qact;

static int qact_init(qact *a, const float *x, int64_t T, int64_t K) {
    const int64_t G = K / QK;
    a->xq = malloc((size_t)(T * K) + 64); a->dx = malloc(sizeof(float) * (size_t)(T * G) + 64);
    a->sx = malloc(sizeof(float) * (size_t)(T * G) + 64); a->xs = NULL;
    if (!a->xq || !a->dx || !a->sx) return -1;
#if QGEMM_AVX512
    a->xs = malloc(sizeof(int32_t) * (size_t)(T * G) + 64);
    if (!a->xs) return -1;
#endif
    quantize_rows(x, T, K, a->xq, a->dx, a->sx, a->xs);
    return 0;
}

static void qact_free(qact *a) { free(a->xq); free(a->xs); free(a->dx); free(a->sx); }

static inline int32_t ld4(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* columns [16 v, 16 v + 16) of out, the first `cols` of them (16 but in the last group) */
#if QGEMM_AVX512
ALWAYS_INLINE void store16(float *out, __m512 v, int cols) {
    if (cols >= NV) _mm512_storeu_ps(out, v);
    else _mm512_mask_storeu_ps(out, (__mmask16)((1u << cols) - 1), v);
}

/* rows [0, R) of xq x groups v0..v0+C-1 of a 4-bit matrix */
ALWAYS_INLINE void q4_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C,
                           float *out, int64_t N) {
    const int64_t K = w->k, G = K / QK;
    const uint8_t *nib = (const uint8_t *)w->w;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 facc[2][4];
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) facc[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m512i iacc[2][4];
        for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) iacc[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
            __m512i lo[4], hi[4];
            for (int c = 0; c < C; ++c) {
                const __m512i v = _mm512_loadu_si512((const void *)(nib + ((v0 + c) * G + g) * 256 + j * 64));
                lo[c] = _mm512_and_si512(v, low);
                hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; ++r) {
                const int8_t *x = a->xq + (t0 + r) * K + g * QK + 4 * j;
                const __m512i xl = _mm512_set1_epi32(ld4(x)), xh = _mm512_set1_epi32(ld4(x + 16));
                for (int c = 0; c < C; ++c) {
                    iacc[r][c] = _mm512_dpbusd_epi32(iacc[r][c], lo[c], xl);
                    iacc[r][c] = _mm512_dpbusd_epi32(iacc[r][c], hi[c], xh);
                }
            }
        }
        for (int c = 0; c < C; ++c) {
            const int64_t s = ((v0 + c) * G + g) * NV;
            const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->d + s)));
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->m + s)));
            for (int r = 0; r < R; ++r) {
                const int64_t tg = (t0 + r) * G + g;
                const __m512 sc = _mm512_mul_ps(dv, _mm512_set1_ps(a->dx[tg]));
                facc[r][c] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(iacc[r][c]), facc[r][c]);
                facc[r][c] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a->sx[tg]), facc[r][c]);
            }
        }
    }
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r)
            store16(out + (t0 + r) * N + (v0 + c) * NV, facc[r][c], (int)(N - (v0 + c) * NV));
}

ALWAYS_INLINE void q8_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C,
                           float *out, int64_t N) {
    const int64_t K = w->k, G = K / QK;
    const uint8_t *wp = (const uint8_t *)w->w;
    __m512 facc[2][4];
    for (int r = 0; r < R; ++r) for (int c = 0; c < C; ++c) facc[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m512i iacc[2][4];
        for (int r = 0; r < R; ++r) {
            const __m512i init = _mm512_set1_epi32(-128 * a->xs[(t0 + r) * G + g]);
            for (int c = 0; c < C; ++c) iacc[r][c] = init;
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            __m512i wv[4];
            for (int c = 0; c < C; ++c)
                wv[c] = _mm512_loadu_si512((const void *)(wp + (((v0 + c) * (K / 4) + g * 8 + j) * NV) * 4));
            for (int r = 0; r < R; ++r) {
                const __m512i xb = _mm512_set1_epi32(ld4(a->xq + (t0 + r) * K + g * QK + 4 * j));
                for (int c = 0; c < C; ++c) iacc[r][c] = _mm512_dpbusd_epi32(iacc[r][c], wv[c], xb);
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m512 s = _mm512_set1_ps(a->dx[(t0 + r) * G + g]);
            for (int c = 0; c < C; ++c) facc[r][c] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(iacc[r][c]), facc[r][c]);
        }
    }
    for (int c = 0; c < C; ++c) {
        const __m512 sc = _mm512_loadu_ps(w->scale + (v0 + c) * NV);
        for (int r = 0; r < R; ++r)
            store16(out + (t0 + r) * N + (v0 + c) * NV, _mm512_mul_ps(sc, facc[r][c]), (int)(N - (v0 + c) * NV));
    }
}
#define TILE_ROWS 2

#elif QGEMM_AVX2
/* 8 columns per ymm: a group of 16 is two vectors (h = 0, 1), bytes 32h.. of each 64-byte line */
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define QGEMM_DP8_VNNI 1
#else
#define QGEMM_DP8_VNNI 0
#endif
/* Without VNNI the 4-bit tile sums a block in 16 bits (below) and takes 4 rows at a time: the
 * weights' unpacking (and, shift, and) is shared by twice the rows, and with the loop over the
 * block's 4 steps kept rolled the accumulators stay in registers. Measured on a Zen 3 EPYC (AVX2
 * only, one thread, [T, 576] x [1536, 576] and [T, 1536] x [576, 1536]): 0.82-0.85 ms against
 * 1.16-1.18 ms at T = 32, 0.26 against 0.28-0.34 ms at T = 8; the same bits. */
#if QGEMM_DP8_VNNI
#define Q4_TILE_ROWS 2
#else
#define Q4_TILE_ROWS 4
#endif
static inline __m256i dp8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

ALWAYS_INLINE void store8(float *out, __m256 v, int cols) {
    if (cols >= 8) { _mm256_storeu_ps(out, v); return; }
    float tmp[8];
    _mm256_storeu_ps(tmp, v);
    for (int i = 0; i < cols; ++i) out[i] = tmp[i];
}

/* C is the number of 16-column groups (1 here: product_unit walks a unit group by group) */
ALWAYS_INLINE void q4_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C,
                           float *out, int64_t N) {
    (void)C;
    const int64_t K = w->k, G = K / QK;
    const uint8_t *nib = (const uint8_t *)w->w;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 facc[Q4_TILE_ROWS][2];
    for (int r = 0; r < R; ++r) for (int h = 0; h < 2; ++h) facc[r][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m256i iacc[Q4_TILE_ROWS][2];
        for (int r = 0; r < R; ++r) for (int h = 0; h < 2; ++h) iacc[r][h] = _mm256_setzero_si256();
        /* Without VNNI a dot product is maddubs + madd + add. A 4-bit weight times an activation
         * (|x| <= 127) pairs to at most 2 * 15 * 127 = 3810, and a block adds 8 such pairs per
         * 16-bit slot (4 steps, low and high nibbles): <= 30480, inside int16. So the block's pairs
         * add up in 16 bits (sacc) and widen once (madd) at its end: half the multiplies, the same
         * sums. The loop stays rolled there: unrolled, the 4-row tile's accumulators spill. */
#if !QGEMM_DP8_VNNI
        __m256i sacc[Q4_TILE_ROWS][2];
        for (int r = 0; r < R; ++r) for (int h = 0; h < 2; ++h) sacc[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 1
#else
#pragma GCC unroll 4
#endif
        for (int j = 0; j < 4; ++j) {
            __m256i lo[2], hi[2];
            for (int h = 0; h < 2; ++h) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(nib + (v0 * G + g) * 256 + j * 64 + h * 32));
                lo[h] = _mm256_and_si256(v, low);
                hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < R; ++r) {
                const int8_t *x = a->xq + (t0 + r) * K + g * QK + 4 * j;
                const __m256i xl = _mm256_set1_epi32(ld4(x)), xh = _mm256_set1_epi32(ld4(x + 16));
                for (int h = 0; h < 2; ++h)
#if QGEMM_DP8_VNNI
                    iacc[r][h] = dp8(dp8(iacc[r][h], lo[h], xl), hi[h], xh);
#else
                    sacc[r][h] = _mm256_add_epi16(sacc[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                                               _mm256_maddubs_epi16(hi[h], xh)));
#endif
            }
        }
#if !QGEMM_DP8_VNNI
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) iacc[r][h] = _mm256_madd_epi16(sacc[r][h], _mm256_set1_epi16(1));
#endif
        for (int h = 0; h < 2; ++h) {
            const int64_t s = (v0 * G + g) * NV + h * 8;
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->d + s)));
            const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->m + s)));
            for (int r = 0; r < R; ++r) {
                const int64_t tg = (t0 + r) * G + g;
                const __m256 sc = _mm256_mul_ps(dv, _mm256_set1_ps(a->dx[tg]));
                facc[r][h] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(iacc[r][h]), facc[r][h]);
                facc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a->sx[tg]), facc[r][h]);
            }
        }
    }
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) store8(out + (t0 + r) * N + v0 * NV + h * 8, facc[r][h], (int)(N - v0 * NV - h * 8));
}

ALWAYS_INLINE void q8_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C,
                           float *out, int64_t N) {
    (void)C;
    const int64_t K = w->k, G = K / QK;
    const int8_t *wp = (const int8_t *)w->w;
    __m256 facc[2][2];
    for (int r = 0; r < R; ++r) for (int h = 0; h < 2; ++h) facc[r][h] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        __m256i iacc[2][2];
        for (int r = 0; r < R; ++r) for (int h = 0; h < 2; ++h) iacc[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            __m256i wv[2], wabs[2];
            for (int h = 0; h < 2; ++h) {
                wv[h] = _mm256_xor_si256(   /* stored w + 128 -> w */
                    _mm256_loadu_si256((const __m256i *)(wp + ((v0 * (K / 4) + g * 8 + j) * NV) * 4 + h * 32)),
                    _mm256_set1_epi8((char)0x80));
                wabs[h] = _mm256_sign_epi8(wv[h], wv[h]);
            }
            for (int r = 0; r < R; ++r) {
                const __m256i xb = _mm256_set1_epi32(ld4(a->xq + (t0 + r) * K + g * QK + 4 * j));
                for (int h = 0; h < 2; ++h) iacc[r][h] = dp8(iacc[r][h], wabs[h], _mm256_sign_epi8(xb, wv[h]));
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m256 s = _mm256_set1_ps(a->dx[(t0 + r) * G + g]);
            for (int h = 0; h < 2; ++h) facc[r][h] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(iacc[r][h]), facc[r][h]);
        }
    }
    for (int h = 0; h < 2; ++h) {
        const __m256 sc = _mm256_loadu_ps(w->scale + v0 * NV + h * 8);
        for (int r = 0; r < R; ++r)
            store8(out + (t0 + r) * N + v0 * NV + h * 8, _mm256_mul_ps(sc, facc[r][h]), (int)(N - v0 * NV - h * 8));
    }
}
#define TILE_ROWS 2

#else
/* portable: the same arithmetic element by element */
static void q4_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C, float *out,
                    int64_t N) {
    const int64_t K = w->k, G = K / QK;
    const uint8_t *nib = (const uint8_t *)w->w;
    for (int r = 0; r < R; ++r)
        for (int64_t n = v0 * NV; n < (v0 + C) * NV && n < N; ++n) {
            const int64_t v = n / NV, c = n % NV;
            float acc = 0.f;
            for (int64_t g = 0; g < G; ++g) {
                const uint8_t *blk = nib + (v * G + g) * 256;
                const int8_t *x = a->xq + (t0 + r) * K + g * QK;
                int32_t s = 0;
                for (int j = 0; j < 4; ++j)
                    for (int b = 0; b < 4; ++b) {
                        const uint8_t byte = blk[j * 64 + c * 4 + b];
                        s += (byte & 0x0F) * x[4 * j + b] + (byte >> 4) * x[4 * j + 16 + b];
                    }
                const int64_t tg = (t0 + r) * G + g;
                acc = fmaf(fp16_to_fp32(w->d[(v * G + g) * NV + c]) * a->dx[tg], (float)s, acc);
                acc = fmaf(fp16_to_fp32(w->m[(v * G + g) * NV + c]), a->sx[tg], acc);
            }
            out[(t0 + r) * N + n] = acc;
        }
}

static void q8_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C, float *out,
                    int64_t N) {
    const int64_t K = w->k, G = K / QK;
    const uint8_t *wp = (const uint8_t *)w->w;
    for (int r = 0; r < R; ++r)
        for (int64_t n = v0 * NV; n < (v0 + C) * NV && n < N; ++n) {
            const int64_t v = n / NV, c = n % NV;
            float acc = 0.f;
            for (int64_t g = 0; g < G; ++g) {
                const int8_t *x = a->xq + (t0 + r) * K + g * QK;
                int32_t s = 0;
                for (int j = 0; j < 8; ++j)
                    for (int b = 0; b < 4; ++b)
                        s += (int8_t)(wp[((v * (K / 4) + g * 8 + j) * NV + c) * 4 + b] ^ 0x80) * x[4 * j + b];
                acc = fmaf(a->dx[(t0 + r) * G + g], (float)s, acc);
            }
            out[(t0 + r) * N + n] = w->scale[n] * acc;
        }
}
#define TILE_ROWS 1
#endif
#ifndef Q4_TILE_ROWS
#define Q4_TILE_ROWS TILE_ROWS
#endif

/* groups [v0, v0 + C) of `w` for all T rows, ROWS rows at a time, then 2, then 1 (C and R
 * compile-time at each call) */
#define TILES(fn, C, ROWS)                                                          \
    do {                                                                            \
        int64_t t = 0;                                                              \
        for (; t + ROWS <= T; t += ROWS) fn(w, a, t, v0, ROWS, C, out, w->n);       \
        if (ROWS > 2 && t + 2 <= T) { fn(w, a, t, v0, 2, C, out, w->n); t += 2; }   \
        for (; t < T; ++t) fn(w, a, t, v0, 1, C, out, w->n);                        \
    } while (0)

static void product_unit(const qweight *w, const qact *a, int64_t T, int64_t v0, int C, float *out) {
#if QGEMM_AVX2 && !QGEMM_AVX512
    for (const int64_t end = v0 + C; v0 < end; ++v0) {  /* the AVX2 tiles hold one group: one after another */
        if (w->kind == QW_Q4) TILES(q4_tile, 1, Q4_TILE_ROWS);
        else TILES(q8_tile, 1, TILE_ROWS);
    }
    return;
#endif
    if (w->kind == QW_Q4) {
        switch (C) {
            case 1: TILES(q4_tile, 1, Q4_TILE_ROWS); break;
#if UNIT > 1
            case 2: TILES(q4_tile, 2, Q4_TILE_ROWS); break;
            case 3: TILES(q4_tile, 3, Q4_TILE_ROWS); break;
            default: TILES(q4_tile, UNIT, Q4_TILE_ROWS); break;
#endif
        }
    } else {
        switch (C) {
            case 1: TILES(q8_tile, 1, TILE_ROWS); break;
#if UNIT > 1
            case 2: TILES(q8_tile, 2, TILE_ROWS); break;
            case 3: TILES(q8_tile, 3, TILE_ROWS); break;
            default: TILES(q8_tile, UNIT, TILE_ROWS); break;
#endif
        }
    }
}

static inline int64_t groups_of(const qweight *w) { return (w->n + NV - 1) / NV; }

/* Groups of 16 columns a thread takes at a time. The AVX-512 and portable tiles hold UNIT groups at
 * once. The AVX2 tiles hold one, so there a unit is a run of consecutive groups, whose weights are
 * contiguous: long runs let the hardware prefetcher stream them (a product of one row is bound by
 * memory bandwidth), and about four runs per thread still balance the threads. Measured on a Zen 3
 * EPYC (AVX2 only, 2 threads, 40 MB of 4-bit layer weights, one row): 5.74 ms a pass with one group
 * a unit, 4.67 ms with four; two rows 7.24 -> 5.22 ms; 32 rows unchanged. Which thread computes a
 * group never changes its bits. */
#define MAX_RUN 8
static int64_t unit_groups(int64_t num_groups, int num_threads) {
#if QGEMM_AVX2 && !QGEMM_AVX512
    const int64_t run = num_groups / (4 * (int64_t)(num_threads > 1 ? num_threads : 1));
    return run < 1 ? 1 : run > MAX_RUN ? MAX_RUN : run;
#else
    (void)num_groups, (void)num_threads;
    return UNIT;
#endif
}

/* outs[i] [T, ws[i].n] = a @ ws[i]^T (+ bias) for `count` products of one activation, in ONE
 * parallel loop over all their units of columns (one fork/join instead of `count`); every element
 * is computed as by the single product. */
static void qmatmul_many(const qact *a, int64_t T, const qweight *const *ws, float *const *outs, int count,
                         int num_threads) {
    int64_t num_groups = 0, total = 0;
    for (int i = 0; i < count; ++i) num_groups += groups_of(ws[i]);
    const int64_t unit = unit_groups(num_groups, num_threads);
    for (int i = 0; i < count; ++i) total += (groups_of(ws[i]) + unit - 1) / unit;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t u = 0; u < total; ++u) {
        int i = 0;
        int64_t k = u;
        while (k >= (groups_of(ws[i]) + unit - 1) / unit) k -= (groups_of(ws[i++]) + unit - 1) / unit;
        const qweight *w = ws[i];
        const int64_t nv = groups_of(w), v0 = k * unit;
        product_unit(w, a, T, v0, (int)(nv - v0 < unit ? nv - v0 : unit), outs[i]);
    }
    for (int i = 0; i < count; ++i)
        if (ws[i]->bias)
            for (int64_t t = 0; t < T; ++t)
                for (int64_t j = 0; j < ws[i]->n; ++j) outs[i][t * ws[i]->n + j] += ws[i]->bias[j];
}

/* out [T, w.n] = a @ w^T (+ bias) */
static void qmatmul(const qact *a, int64_t T, const qweight *w, float *out, int num_threads) {
    qmatmul_many(a, T, &w, &out, 1, num_threads);
}

/* out = x * rsqrt(mean(x^2) + eps) * weight, per row */
void qgemm_rmsnorm(const float *x, int64_t T, int64_t C, const float *weight, float eps, float *out) {
    for (int64_t t = 0; t < T; ++t) {
        const float *r = x + t * C;
        float ss = 0.f;
        for (int64_t j = 0; j < C; ++j) ss += r[j] * r[j];
        const float inv = 1.f / sqrtf(ss / (float)C + eps);
        for (int64_t j = 0; j < C; ++j) out[t * C + j] = weight[j] * (r[j] * inv);
    }
}

/* rotate-half RoPE in place on x [T, heads, D] with tables cos/sin [P, D] */
static void rope(float *x, int64_t T, int64_t heads, int64_t D, const float *cos_t, const float *sin_t,
                 const int64_t *positions) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        for (int64_t h = 0; h < heads; ++h) {
            float *v = x + (t * heads + h) * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out [T, w.n] = x [T, w.k] @ w^T (+ bias) */
int qgemm_linear(const float *x, int64_t T, const qweight *w, float *out, int num_threads) {
    qact a;
    if (qact_init(&a, x, T, w->k)) { qact_free(&a); return -1; }
    qmatmul(&a, T, w, out, num_threads);
    qact_free(&a);
    return 0;
}

/* Before attention: h = RMSNorm(x); q = RoPE(h Wq), k = RoPE(h Wk), v = h Wv.
 * x [T, C]; q [T, H, D], k/v [T, Hkv, D]. */
int qgemm_layer_pre(const float *x, int64_t T, int64_t C, const float *norm_w, float eps,
                    const qweight *wq, const qweight *wk, const qweight *wv, int64_t heads, int64_t kv_heads,
                    int64_t D, const float *cos_t, const float *sin_t, const int64_t *positions,
                    float *q, float *k, float *v, int num_threads) {
    float *h = malloc(sizeof(float) * (size_t)(T * C));
    qact a = {0};
    int rc = -1;
    if (!h) goto done;
    qgemm_rmsnorm(x, T, C, norm_w, eps, h);
    if (qact_init(&a, h, T, C)) goto done;
    const qweight *const qkv[3] = {wq, wk, wv};
    float *const qkv_out[3] = {q, k, v};
    qmatmul_many(&a, T, qkv, qkv_out, 3, num_threads);
    rope(q, T, heads, D, cos_t, sin_t, positions);
    rope(k, T, kv_heads, D, cos_t, sin_t, positions);
    rc = 0;
done:
    qact_free(&a); free(h);
    return rc;
}

static void silu_mul(float *g, const float *u, int64_t n);

/* After attention: h = x + attn Wo; out = h + Wdown(silu(Wgate n) * Wup n), n = RMSNorm(h).
 * x, out [T, C]; attn [T, H*D]. */
int qgemm_layer_post(const float *x, const float *attn, int64_t T, int64_t C, const qweight *wo,
                     const float *norm_w, float eps, const qweight *wgate, const qweight *wup,
                     const qweight *wdown, float *out, int num_threads) {
    const int64_t I = wgate->n;
    float *o = malloc(sizeof(float) * (size_t)(T * C)), *n = malloc(sizeof(float) * (size_t)(T * C));
    float *g = malloc(sizeof(float) * (size_t)(T * I)), *u = malloc(sizeof(float) * (size_t)(T * I));
    qact a = {0}, b = {0}, c = {0};
    int rc = -1;
    if (!o || !n || !g || !u) goto done;
    if (qact_init(&a, attn, T, wo->k)) goto done;
    qmatmul(&a, T, wo, o, num_threads);
    for (int64_t j = 0; j < T * C; ++j) o[j] += x[j];                     /* h */
    qgemm_rmsnorm(o, T, C, norm_w, eps, n);
    if (qact_init(&b, n, T, C)) goto done;
    const qweight *const gate_up[2] = {wgate, wup};
    float *const gate_up_out[2] = {g, u};
    qmatmul_many(&b, T, gate_up, gate_up_out, 2, num_threads);
    silu_mul(g, u, T * I);
    if (qact_init(&c, g, T, I)) goto done;
    qmatmul(&c, T, wdown, out, num_threads);
    for (int64_t j = 0; j < T * C; ++j) out[j] += o[j];
    rc = 0;
done:
    qact_free(&a); qact_free(&b); qact_free(&c);
    free(o); free(n); free(g); free(u);
    return rc;
}

/* ---- attention of a span's new rows over its KV cache ---- */

typedef float v8 __attribute__((vector_size(32)));

static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float hsum_v8(v8 acc) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static inline float dot_f32(const float *a, const float *b, int64_t D) {
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) acc += ld8(a + i) * ld8(b + i);
    float s = hsum_v8(acc);
    for (; i < D; ++i) s += a[i] * b[i];
    return s;
}

/* The KV cache holds fp32 or fp16 (IEEE half, rounded to nearest even on write) values: element i
 * of a cache row as fp32. fp16 halves the bytes attention reads, which bound it on the CPU. */
static inline v8 ldh8(const uint16_t *p) {
#if QGEMM_AVX2
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    v8 r; memcpy(&r, &x, sizeof r); return r;
#else
    v8 r;
    for (int i = 0; i < 8; ++i) r[i] = fp16_to_fp32(p[i]);
    return r;
#endif
}

static inline v8 ldkv8(const void *base, int64_t i, int half) {
    return half ? ldh8((const uint16_t *)base + i) : ld8((const float *)base + i);
}

static inline float ldkv(const void *base, int64_t i, int half) {
    return half ? fp16_to_fp32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline uint16_t fp32_to_fp16(float f) {   /* round to nearest even, as torch's .half() */
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

/* dst[0 .. D) = src as the cache's type */
static inline void store_kv(void *dst, const float *src, int64_t D, int half) {
    if (!half) { memcpy(dst, src, sizeof(float) * (size_t)D); return; }
    uint16_t *h = dst;
    int64_t i = 0;
#if QGEMM_AVX2
    for (; i + 8 <= D; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < D; ++i) h[i] = fp32_to_fp16(src[i]);
}

/* a . (row i of the cache), as dot_f32 computes it */
static inline float dot_kv(const float *a, const void *base, int64_t row, int64_t D, int half) {
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) acc += ld8(a + i) * ldkv8(base, row + i, half);
    float s = hsum_v8(acc);
    for (; i < D; ++i) s += a[i] * ldkv(base, row + i, half);
    return s;
}

/* exp of every element of s[0, m) in place, lane by lane the same operations whatever m or the
 * element's position (so a row's probabilities do not depend on how many keys share the call). */
#if QGEMM_AVX2
static inline __m256 exp8(__m256 x) {        /* Cephes' expf polynomial: |error| <= 2 ulp on [-87, 88] */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
    const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(.5f)));
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

static void exp_shifted(float *s, int64_t m, float shift) {
    int64_t i = 0;
#if QGEMM_AVX2
    const __m256 sh = _mm256_set1_ps(shift);
    for (; i + 8 <= m; i += 8) _mm256_storeu_ps(s + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh)));
    if (i < m) {                             /* the tail through the same lanes */
        float t[8];
        for (int j = 0; j < 8; ++j) t[j] = i + j < m ? s[i + j] : shift;
        _mm256_storeu_ps(t, exp8(_mm256_sub_ps(_mm256_loadu_ps(t), sh)));
        for (int j = 0; i + j < m; ++j) s[i + j] = t[j];
    }
#else
    for (; i < m; ++i) s[i] = expf(s[i] - shift);
#endif
}

/* g[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u, eight at a time through exp8 (a tail through the
 * same lanes), so every element gets the same arithmetic wherever it falls. */
static void silu_mul(float *g, const float *u, int64_t n) {
    int64_t j = 0;
#if QGEMM_AVX2
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(g + j);
        const __m256 e = exp8(_mm256_xor_ps(x, sign));
        _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + j)));
    }
    if (j < n) {
        float t[8] = {0}, w[8] = {0};
        for (int i = 0; j + i < n; ++i) { t[i] = g[j + i]; w[i] = u[j + i]; }
        const __m256 x = _mm256_loadu_ps(t);
        const __m256 e = exp8(_mm256_xor_ps(x, sign));
        _mm256_storeu_ps(t, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(w)));
        for (int i = 0; j + i < n; ++i) g[j + i] = t[i];
    }
#else
    for (; j < n; ++j) g[j] = g[j] / (1.f + expf(-g[j])) * u[j];
#endif
}

/* Attention as small tiled products over a KV head's rows.
 *
 * The queries that read one KV head (every row of the call times the heads of its group) are taken
 * in chunks; a chunk's scores against a block of key rows are computed while those rows sit in L1,
 * two queries by four keys at a time (four by four with AVX-512's 32 registers), and its
 * softmax-weighted value sums likewise (four queries by 64 columns with AVX-512), so a key or value
 * row is read from memory once per chunk instead of once per (row, head). The softmax reads the mask
 * only past a row's all-visible prefix and sums with sixteen partial sums (softmax_row, sum16).
 *
 * Exactness: every (query, key) score is the same arithmetic as a lone dot of the two (eight lane
 * sums over D in order, then hsum_v8), whatever the tile it falls in. A key the row may not see gets
 * probability exactly 0; its FMA into a value sum adds an exact zero, which leaves a finite sum's bits
 * unchanged (the sum never holds -0: it starts at +0 and x + (-x) rounds to +0), so a row's output is
 * that of a call over its visible keys alone, in cache order: a tree row equals the 1-row step that
 * reads the same keys once committed, whatever the other rows of the call. */

/* acc + x * y rounded once, whatever the compiler would contract: pair and lone paths must agree */
#if QGEMM_AVX2
#define FMA8(acc, x, y) ((v8)_mm256_fmadd_ps((__m256)(x), (__m256)(y), (__m256)(acc)))
#else
static inline v8 fma8(v8 acc, v8 x, v8 y) {
    for (int i = 0; i < 8; ++i) acc[i] = fmaf(x[i], y[i], acc[i]);
    return acc;
}
#define FMA8(acc, x, y) fma8(acc, x, y)
#endif

#define ATT_KEY_BLOCK 64     /* key rows per block: 16 KB of fp32 keys at D = 64, within L1 */
#define ATT_MAX_CHUNK 48     /* queries per work item */

#if QGEMM_AVX2
/* hsum_v8 of eight vectors at once in one register, each with hsum_v8's own order of additions:
 * lanes (a0 a2 b0 b2 a1 a3 b1 b3) */
static inline __m256 hsum_8x_vec(v8 a0, v8 a1, v8 a2, v8 a3, v8 b0, v8 b1, v8 b2, v8 b3) {
    __m256 x[8];
    const v8 in[8] = {a0, a1, a2, a3, b0, b1, b2, b3};
    memcpy(x, in, sizeof x);
    /* lanes i and i + 4 added: (e0+e4, e1+e5, e2+e6, e3+e7) of two vectors per register */
    const __m256 t0 = _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
    const __m256 t1 = _mm256_add_ps(_mm256_permute2f128_ps(x[2], x[3], 0x20), _mm256_permute2f128_ps(x[2], x[3], 0x31));
    const __m256 t2 = _mm256_add_ps(_mm256_permute2f128_ps(x[4], x[5], 0x20), _mm256_permute2f128_ps(x[4], x[5], 0x31));
    const __m256 t3 = _mm256_add_ps(_mm256_permute2f128_ps(x[6], x[7], 0x20), _mm256_permute2f128_ps(x[6], x[7], 0x31));
    /* then (e0+e4)+(e1+e5) and (e2+e6)+(e3+e7), then their sum */
    return _mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
}
#endif

/* hsum_v8 of eight vectors at once, each with hsum_v8's own order of additions (same bits):
 * ga[t] = hsum_v8(a_t), gb[t] = hsum_v8(b_t) */
static inline void hsum_8x(v8 a0, v8 a1, v8 a2, v8 a3, v8 b0, v8 b1, v8 b2, v8 b3, float *ga, float *gb) {
#if QGEMM_AVX2
    const __m256 r = hsum_8x_vec(a0, a1, a2, a3, b0, b1, b2, b3);
    float f[8];
    _mm256_storeu_ps(f, r);
    ga[0] = f[0]; ga[2] = f[1]; gb[0] = f[2]; gb[2] = f[3];
    ga[1] = f[4]; ga[3] = f[5]; gb[1] = f[6]; gb[3] = f[7];
#else
    ga[0] = hsum_v8(a0); ga[1] = hsum_v8(a1); ga[2] = hsum_v8(a2); ga[3] = hsum_v8(a3);
    gb[0] = hsum_v8(b0); gb[1] = hsum_v8(b1); gb[2] = hsum_v8(b2); gb[3] = hsum_v8(b3);
#endif
}

static inline void finish_2x4(v8 a0, v8 a1, v8 a2, v8 a3, v8 b0, v8 b1, v8 b2, v8 b3, int64_t j, int64_t jn,
                              float scale, float *s0, float *s1);

/* s[i][j] for queries i0, i1 (i1 may repeat i0) and keys j .. j + 3 (repeating the last one past jn) */
static inline void scores_2x4(const float *q0, const float *q1, const void *K, int half, int64_t D, int64_t j,
                              int64_t jn, float scale, float *s0, float *s1) {
    const int64_t k0 = j * D, k1 = (j + 1 < jn ? j + 1 : jn - 1) * D;
    const int64_t k2 = (j + 2 < jn ? j + 2 : jn - 1) * D, k3 = (j + 3 < jn ? j + 3 : jn - 1) * D;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    for (int64_t e = 0; e < D; e += 8) {
        const v8 x0 = ldkv8(K, k0 + e, half), x1 = ldkv8(K, k1 + e, half);
        const v8 x2 = ldkv8(K, k2 + e, half), x3 = ldkv8(K, k3 + e, half);
        const v8 u = ld8(q0 + e), w = ld8(q1 + e);
        a0 = FMA8(a0, u, x0); a1 = FMA8(a1, u, x1); a2 = FMA8(a2, u, x2); a3 = FMA8(a3, u, x3);
        b0 = FMA8(b0, w, x0); b1 = FMA8(b1, w, x1); b2 = FMA8(b2, w, x2); b3 = FMA8(b3, w, x3);
    }
    finish_2x4(a0, a1, a2, a3, b0, b1, b2, b3, j, jn, scale, s0, s1);
}

/* s0/s1[j .. j + 3] = scale * the hsum_v8 of a_t / b_t (keys past jn dropped) */
static inline void finish_2x4(v8 a0, v8 a1, v8 a2, v8 a3, v8 b0, v8 b1, v8 b2, v8 b3, int64_t j, int64_t jn,
                              float scale, float *s0, float *s1) {
#if QGEMM_AVX2
    if (j + 4 <= jn) {                       /* hsum_8x's sums, scaled and stored as two vectors */
        const __m256 r = hsum_8x_vec(a0, a1, a2, a3, b0, b1, b2, b3);  /* a0 a2 b0 b2 a1 a3 b1 b3 */
        const __m256 g = _mm256_mul_ps(_mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                                       _mm256_set1_ps(scale));
        _mm_storeu_ps(s0 + j, _mm256_castps256_ps128(g));
        _mm_storeu_ps(s1 + j, _mm256_extractf128_ps(g, 1));
        return;
    }
#endif
    float ga[4], gb[4];
    hsum_8x(a0, a1, a2, a3, b0, b1, b2, b3, ga, gb);
    for (int t = 0; t < 4 && j + t < jn; ++t) { s0[j + t] = ga[t] * scale; s1[j + t] = gb[t] * scale; }
}

/* s[j .. j + 3] for one query (a chunk's odd one out): the same per-key arithmetic as scores_2x4 */
static inline void scores_1x4(const float *q0, const void *K, int half, int64_t D, int64_t j, int64_t jn,
                              float scale, float *s0) {
    const int64_t k0 = j * D, k1 = (j + 1 < jn ? j + 1 : jn - 1) * D;
    const int64_t k2 = (j + 2 < jn ? j + 2 : jn - 1) * D, k3 = (j + 3 < jn ? j + 3 : jn - 1) * D;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t e = 0; e < D; e += 8) {
        const v8 u = ld8(q0 + e);
        a0 = FMA8(a0, u, ldkv8(K, k0 + e, half)); a1 = FMA8(a1, u, ldkv8(K, k1 + e, half));
        a2 = FMA8(a2, u, ldkv8(K, k2 + e, half)); a3 = FMA8(a3, u, ldkv8(K, k3 + e, half));
    }
    const float ga[4] = {hsum_v8(a0), hsum_v8(a1), hsum_v8(a2), hsum_v8(a3)};
    for (int t = 0; t < 4 && j + t < jn; ++t) s0[j + t] = ga[t] * scale;
}

#if QGEMM_AVX512
/* scores_2x4 for four queries sharing each key load (sixteen accumulators: AVX-512's 32 registers) */
static inline void scores_4x4(const float *const *qs, const void *K, int half, int64_t D, int64_t j, int64_t jn,
                              float scale, float *const *ss) {
    const int64_t k0 = j * D, k1 = (j + 1 < jn ? j + 1 : jn - 1) * D;
    const int64_t k2 = (j + 2 < jn ? j + 2 : jn - 1) * D, k3 = (j + 3 < jn ? j + 3 : jn - 1) * D;
    v8 a[4][4];
    for (int r = 0; r < 4; ++r) for (int t = 0; t < 4; ++t) a[r][t] = (v8){0};
    for (int64_t e = 0; e < D; e += 8) {
        const v8 x[4] = {ldkv8(K, k0 + e, half), ldkv8(K, k1 + e, half), ldkv8(K, k2 + e, half), ldkv8(K, k3 + e, half)};
        for (int r = 0; r < 4; ++r) {
            const v8 u = ld8(qs[r] + e);
            for (int t = 0; t < 4; ++t) a[r][t] = FMA8(a[r][t], u, x[t]);
        }
    }
    finish_2x4(a[0][0], a[0][1], a[0][2], a[0][3], a[1][0], a[1][1], a[1][2], a[1][3], j, jn, scale, ss[0], ss[1]);
    finish_2x4(a[2][0], a[2][1], a[2][2], a[2][3], a[3][0], a[3][1], a[3][2], a[3][3], j, jn, scale, ss[2], ss[3]);
}
#endif

/* o[c .. c + 8 * NV) += sum_{j in [j0, j1)} p[j] * V[j][c ..], j ascending (one query) */
#define VSUM_1xN(NV)                                                                                  \
    static inline void vsum_1x##NV(const float *p, const void *V, int half, int64_t D, int64_t j0,    \
                                   int64_t j1, int64_t c, float *o) {                                 \
        v8 a[NV];                                                                                     \
        for (int u = 0; u < NV; ++u) a[u] = ld8(o + c + 8 * u);                                       \
        for (int64_t j = j0; j < j1; ++j) {                                                          \
            const float x = p[j];                                                                     \
            const v8 px = {x, x, x, x, x, x, x, x};                                                   \
            for (int u = 0; u < NV; ++u) a[u] = FMA8(a[u], px, ldkv8(V, j * D + c + 8 * u, half));    \
        }                                                                                             \
        for (int u = 0; u < NV; ++u) st8(o + c + 8 * u, a[u]);                                       \
    }
VSUM_1xN(8)
VSUM_1xN(1)
#undef VSUM_1xN

/* o0/o1[c .. c + 8 * NV) += sum_{j in [j0, j1)} p0/p1[j] * V[j][c ..], j ascending */
#define VSUM_2xN(NV)                                                                                  \
    static inline void vsum_2x##NV(const float *p0, const float *p1, const void *V, int half,        \
                                   int64_t D, int64_t j0, int64_t j1, int64_t c, float *o0,            \
                                   float *o1) {                                                        \
        v8 a[NV], b[NV];                                                                              \
        for (int u = 0; u < NV; ++u) { a[u] = ld8(o0 + c + 8 * u); b[u] = ld8(o1 + c + 8 * u); }     \
        for (int64_t j = j0; j < j1; ++j) {                                                          \
            const float x = p0[j], y = p1[j];                                                         \
            const v8 px = {x, x, x, x, x, x, x, x}, py = {y, y, y, y, y, y, y, y};                   \
            for (int u = 0; u < NV; ++u) {                                                           \
                const v8 vv = ldkv8(V, j * D + c + 8 * u, half);                                      \
                a[u] = FMA8(a[u], px, vv); b[u] = FMA8(b[u], py, vv);                                 \
            }                                                                                         \
        }                                                                                             \
        for (int u = 0; u < NV; ++u) { st8(o0 + c + 8 * u, a[u]); st8(o1 + c + 8 * u, b[u]); }       \
    }
VSUM_2xN(4)
VSUM_2xN(1)
#undef VSUM_2xN

/* The sum of x[0 .. m) as sixteen partial sums (element t into partial t % 16, in order, the tail
 * padded with exact zeros), then partials l and l + 8 added and the eight reduced as hsum_v8: the
 * same bits on every path, a vector's work instead of a chain of m dependent additions. */
static float sum16(const float *x, int64_t m) {
    int64_t t = 0;
#if QGEMM_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; t + 16 <= m; t += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + t));
    if (t < m) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps((__mmask16)((1u << (m - t)) - 1), x + t));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    v8 r; memcpy(&r, &h, sizeof r);
    return hsum_v8(r);
#else
    v8 a = {0}, b = {0};
    for (; t + 16 <= m; t += 16) { a += ld8(x + t); b += ld8(x + t + 8); }
    if (t < m) {
        float pad[16] = {0};
        memcpy(pad, x + t, sizeof(float) * (size_t)(m - t));
        a += ld8(pad); b += ld8(pad + 8);
    }
    return hsum_v8(a + b);
#endif
}

/* Softmax of one query's scores s[0 .. jn) over the keys its mask row shows (NULL: all), in place:
 * invisible keys get exactly 0, visible ones exp(s - max), and the return is 1 / the sum over the
 * visible keys in cache order (sum16). The visible keys' sequence decides every bit, not where they
 * sit: a tree row gets its committed row's probabilities. The mask is read per key only past its
 * all-visible prefix (the cached context): the tree rows. keys, tmp: jn each. */
static float softmax_row(float *s, const uint8_t *mr, int64_t jn, int64_t *keys, float *tmp) {
    int64_t z = jn;
    if (mr) {
        const uint8_t *hole = memchr(mr, 0, (size_t)jn);
        if (hole) z = hole - mr;
    }
    float mx = -INFINITY;
    int64_t j = 0;
#if QGEMM_AVX512
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= z; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
    mx = _mm512_reduce_max_ps(mv);
#endif
    for (; j < z; ++j) mx = s[j] > mx ? s[j] : mx;
    int64_t m = 0;                           /* the visible keys past the prefix, compacted */
    for (j = z; j < jn; ++j)
        if (mr[j]) { keys[m] = j; tmp[z + m] = s[j]; mx = s[j] > mx ? s[j] : mx; ++m; }
    if (z + m == 0) {                        /* no key to see: all 0 */
        for (j = 0; j < jn; ++j) s[j] = 0.f;
        return 0.f;
    }
    exp_shifted(s, z, mx);
    exp_shifted(tmp + z, m, mx);
    for (j = z; j < jn; ++j) s[j] = 0.f;
    for (int64_t t = 0; t < m; ++t) s[keys[t]] = tmp[z + t];
    float sum;
    if (m == 0) sum = sum16(s, z);
    else {
        memcpy(tmp, s, sizeof(float) * (size_t)z);
        sum = sum16(tmp, z + m);
    }
    return sum > 0.f ? 1.f / sum : 0.f;
}

#if QGEMM_AVX512
/* o[r][c .. c + 64) += sum_{j in [j0, j1)} p[r][j] * V[j][c ..], j ascending, for R queries sharing
 * each value row: per element the FMA chain of vsum_1xN (same bits), sixteen lanes at a time */
ALWAYS_INLINE void vsum_z(const float *const *p, const void *V, const int half, int64_t D, int64_t j0, int64_t j1,
                          int64_t c, float *const *o, const int R) {
    __m512 a[4][4];
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < 4; ++u) a[r][u] = _mm512_loadu_ps(o[r] + c + 16 * u);
    for (int64_t j = j0; j < j1; ++j) {
        __m512 vv[4];
        for (int u = 0; u < 4; ++u)
            vv[u] = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)V + j * D + c + 16 * u)))
                         : _mm512_loadu_ps((const float *)V + j * D + c + 16 * u);
        for (int r = 0; r < R; ++r) {
            const __m512 px = _mm512_set1_ps(p[r][j]);
            for (int u = 0; u < 4; ++u) a[r][u] = _mm512_fmadd_ps(px, vv[u], a[r][u]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < 4; ++u) _mm512_storeu_ps(o[r] + c + 16 * u, a[r][u]);
}
#endif

/* One chunk: queries qs[0 .. nq) (rows rs[i] of the call) over the KV head's rows K, V, keys j < L
 * under mask rows (NULL: all visible); outputs os[i]. s: nq * L floats; keys, tmp: L each. */
static void attend_chunk(const float *const *qs, const int64_t *rs, float *const *os, int nq, int64_t D,
                         const void *K, const void *V, int half, int64_t L, const uint8_t *mask, float scale,
                         float *s, int64_t *keys, float *tmp) {
    /* keys past every row's last visible one are never read (a causal prefill's upper triangle) */
    int64_t jn = 0;
    for (int i = 0; i < nq; ++i) {
        int64_t last = L;
        if (mask) for (last = L; last > 0 && !mask[rs[i] * L + last - 1]; --last) {}
        if (last > jn) jn = last;
    }
    const int is_vector = D % 8 == 0;
    for (int64_t j0 = 0; j0 < jn; j0 += ATT_KEY_BLOCK) {
        const int64_t j1 = j0 + ATT_KEY_BLOCK < jn ? j0 + ATT_KEY_BLOCK : jn;
        int i = 0;
#if QGEMM_AVX512
        for (; is_vector && i + 4 <= nq; i += 4) {
            float *const ss[4] = {s + (int64_t)i * L, s + (int64_t)(i + 1) * L, s + (int64_t)(i + 2) * L,
                                  s + (int64_t)(i + 3) * L};
            for (int64_t j = j0; j < j1; j += 4) scores_4x4(qs + i, K, half, D, j, j1, scale, ss);
        }
#endif
        for (; i < nq; i += 2) {
            const int i1 = i + 1 < nq ? i + 1 : i;
            float *s0 = s + (int64_t)i * L, *s1 = s + (int64_t)i1 * L;
            if (is_vector && i1 == i)
                for (int64_t j = j0; j < j1; j += 4) scores_1x4(qs[i], K, half, D, j, j1, scale, s0);
            else if (is_vector)
                for (int64_t j = j0; j < j1; j += 4) scores_2x4(qs[i], qs[i1], K, half, D, j, j1, scale, s0, s1);
            else
                for (int64_t j = j0; j < j1; ++j) {
                    s0[j] = dot_kv(qs[i], K, j * D, D, half) * scale;
                    s1[j] = dot_kv(qs[i1], K, j * D, D, half) * scale;
                }
        }
    }
    float inv[ATT_MAX_CHUNK];
    for (int i = 0; i < nq; ++i) inv[i] = softmax_row(s + (int64_t)i * L, mask ? mask + rs[i] * L : NULL, jn, keys, tmp);
    for (int i = 0; i < nq; ++i)
        for (int64_t e = 0; e < D; ++e) os[i][e] = 0.f;
    for (int64_t j0 = 0; j0 < jn; j0 += ATT_KEY_BLOCK) {
        const int64_t j1 = j0 + ATT_KEY_BLOCK < jn ? j0 + ATT_KEY_BLOCK : jn;
        int i = 0;
#if QGEMM_AVX512
        for (; i + 4 <= nq && D % 64 == 0; i += 4) {     /* four queries share each value row */
            const float *ps[4] = {s + (int64_t)i * L, s + (int64_t)(i + 1) * L, s + (int64_t)(i + 2) * L,
                                  s + (int64_t)(i + 3) * L};
            for (int64_t c = 0; c < D; c += 64)
                if (half) vsum_z(ps, V, 1, D, j0, j1, c, os + i, 4);
                else vsum_z(ps, V, 0, D, j0, j1, c, os + i, 4);
        }
#endif
        for (; i < nq; i += 2) {
            const int i1 = i + 1 < nq ? i + 1 : i;
            const float *p0 = s + (int64_t)i * L, *p1 = s + (int64_t)i1 * L;
            int64_t c = 0;
            if (i1 == i) {                            /* a lone last query */
                for (; c + 64 <= D; c += 64) vsum_1x8(p0, V, half, D, j0, j1, c, os[i]);
                for (; c + 8 <= D; c += 8) vsum_1x1(p0, V, half, D, j0, j1, c, os[i]);
            } else {
                for (; c + 32 <= D; c += 32) vsum_2x4(p0, p1, V, half, D, j0, j1, c, os[i], os[i1]);
                for (; c + 8 <= D; c += 8) vsum_2x1(p0, p1, V, half, D, j0, j1, c, os[i], os[i1]);
            }
            for (; c < D; ++c)
                for (int64_t j = j0; j < j1; ++j) {
                    const float v = ldkv(V, j * D + c, half);
                    os[i][c] = fmaf(p0[j], v, os[i][c]);
                    if (i1 != i) os[i1][c] = fmaf(p1[j], v, os[i1][c]);
                }
        }
    }
    for (int i = 0; i < nq; ++i)
        for (int64_t e = 0; e < D; ++e) os[i][e] *= inv[i];
}

/* One batch of attention: `num_spans` sequences, each of n rows (queries [n, H, D] at q, outputs at
 * out) over its own cache (kv head h at + h * capacity * D elements) of L rows under its mask. */
typedef struct {
    const float *q;
    float *out;
    int64_t n, L, capacity;
    const void *k, *v;
    const uint8_t *mask;     /* [n, L] (1 = attend) or NULL: all */
} att_seq;

/* Every sequence's queries, split into work items of at most `chunk` queries of one KV head (KV head
 * major within a sequence: L2 reuse), in ONE parallel loop over all sequences' items: a step of many
 * one-row decodes pays one fork/join a layer, not one per sequence. A query's bits do not depend on
 * the chunk it falls in (attend_chunk's paired and lone paths compute each query alike). */
static int attend_seqs(const att_seq *seqs, int64_t num_seqs, int64_t H, int64_t Hkv, int64_t D, int half,
                       int num_threads) {
    const int64_t group = H / Hkv;
    int64_t total = 0, max_L = 1;
    for (int64_t i = 0; i < num_seqs; ++i) {
        total += seqs[i].n * H;
        if (seqs[i].L > max_L) max_L = seqs[i].L;
    }
    /* chunks small enough for two per thread, at most ATT_MAX_CHUNK queries */
    int64_t chunk = (total + 4 * num_threads - 1) / (4 * (int64_t)num_threads);
    chunk = chunk < 1 ? 1 : chunk > ATT_MAX_CHUNK ? ATT_MAX_CHUNK : chunk;
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!first_item) return -1;
    first_item[0] = 0;
    for (int64_t i = 0; i < num_seqs; ++i)
        first_item[i + 1] = first_item[i] + Hkv * ((seqs[i].n * group + chunk - 1) / chunk);
    const int64_t num_items = first_item[num_seqs];
    const float scale = 1.f / sqrtf((float)D);
    const size_t elem = half ? sizeof(uint16_t) : sizeof(float);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *s = malloc(sizeof(float) * (size_t)(chunk * max_L));
        int64_t *keys = malloc(sizeof(int64_t) * (size_t)max_L);
        float *tmp = malloc(sizeof(float) * (size_t)max_L);
        failed = !s || !keys || !tmp;
        int64_t si = 0;   /* items come in ascending order per thread: the sequence search moves forward */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; ++item) {
            if (!s || !keys || !tmp) continue;
            if (item < first_item[si]) si = 0;
            while (item >= first_item[si + 1]) ++si;
            const att_seq *a = seqs + si;
            const int64_t per_kv = a->n * group, chunks_per_kv = (per_kv + chunk - 1) / chunk;
            const int64_t local = item - first_item[si], kvh = local / chunks_per_kv;
            const int64_t first = local % chunks_per_kv * chunk;
            const int nq = (int)(first + chunk <= per_kv ? chunk : per_kv - first);
            const float *qs[ATT_MAX_CHUNK];
            float *os[ATT_MAX_CHUNK];
            int64_t rs[ATT_MAX_CHUNK];
            for (int i = 0; i < nq; ++i) {
                const int64_t r = (first + i) / group, h = kvh * group + (first + i) % group;
                rs[i] = r; qs[i] = a->q + (r * H + h) * D; os[i] = a->out + (r * H + h) * D;
            }
            attend_chunk(qs, rs, os, nq, D, (const char *)a->k + kvh * a->capacity * D * elem,
                         (const char *)a->v + kvh * a->capacity * D * elem, half, a->L, a->mask, scale, s, keys, tmp);
        }
        free(s); free(keys); free(tmp);
    }
    free(first_item);
    return failed ? -1 : 0;
}

/* out [n, H, D]: row r, head h attends the cache rows j < L of kv head h / (H / Hkv) with mask[r, j]
 * (uint8 [n, L]; NULL: every row attends all of them), softmax in fp32; see attend_chunk. The caches
 * are fp32, or fp16 with `half`. */
int qgemm_attention(const float *q, int64_t n, int64_t H, int64_t Hkv, int64_t D, const void *k_cache,
                    const void *v_cache, int half, int64_t capacity, int64_t L, const uint8_t *mask,
                    float *out, int num_threads) {
    const att_seq seq = {q, out, n, L, capacity, k_cache, v_cache, mask};
    return attend_seqs(&seq, 1, H, Hkv, D, half, num_threads);
}

/* ---- a whole forward's decoder layers in one call ---- */

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

/* x [T, C] in place: every layer of `layers` in turn, each exactly as qgemm_layer_pre, the cache
 * write, qgemm_attention per span and qgemm_layer_post do it one call at a time (same bits). */
int qgemm_forward(float *x, int64_t T, int64_t C, const qlayer *layers, int64_t num_layers, int64_t H,
                  int64_t Hkv, int64_t D, const float *cos_t, const float *sin_t, const int64_t *positions,
                  const qspan *spans, int64_t num_spans, int num_threads) {
    float *q = malloc(sizeof(float) * (size_t)(T * H * D)), *k = malloc(sizeof(float) * (size_t)(T * Hkv * D));
    float *v = malloc(sizeof(float) * (size_t)(T * Hkv * D));
    float *attn = calloc((size_t)(T * H * D), sizeof(float));   /* rows outside every span stay 0 */
    float *out = malloc(sizeof(float) * (size_t)(T * C));
    att_seq *seqs = malloc(sizeof(att_seq) * (size_t)(num_spans ? num_spans : 1));
    int rc = (q && k && v && attn && out && seqs) ? 0 : -1;
    for (int64_t l = 0; l < num_layers && !rc; ++l) {
        const qlayer *ly = layers + l;
        rc = qgemm_layer_pre(x, T, C, ly->norm1, ly->eps1, ly->q, ly->k, ly->v, H, Hkv, D, cos_t, sin_t,
                             positions, q, k, v, num_threads);
        /* each span's new rows into its cache, then every span's attention in one parallel loop
         * (spans of fp32 and of fp16 caches, should a batch mix them, in one loop each) */
        for (int half = 0; half < 2 && !rc; ++half) {
            int64_t num_seqs = 0;
            for (int64_t si = 0; si < num_spans; ++si) {
                const qspan *s = spans + si;
                if ((int)s->half != half) continue;
                const size_t elem = half ? sizeof(uint16_t) : sizeof(float);
                char *kc = (char *)s->k_cache + l * s->layer_stride * elem, *vc = (char *)s->v_cache + l * s->layer_stride * elem;
                for (int64_t r = 0; r < s->n; ++r)
                    for (int64_t h = 0; h < Hkv; ++h) {
                        const int64_t src = ((s->start + r) * Hkv + h) * D, dst = (h * s->capacity + s->num_cached + r) * D;
                        store_kv(kc + dst * elem, k + src, D, half);
                        store_kv(vc + dst * elem, v + src, D, half);
                    }
                seqs[num_seqs++] = (att_seq){q + s->start * H * D, attn + s->start * H * D, s->n, s->num_cached + s->n,
                                             s->capacity, kc, vc, s->mask};
            }
            if (num_seqs) rc = attend_seqs(seqs, num_seqs, H, Hkv, D, half, num_threads);
        }
        if (!rc)
            rc = qgemm_layer_post(x, attn, T, C, ly->o, ly->norm2, ly->eps2, ly->gate, ly->up, ly->down, out,
                                  num_threads);
        if (!rc) memcpy(x, out, sizeof(float) * (size_t)(T * C));
    }
    free(q); free(k); free(v); free(attn); free(out); free(seqs);
    return rc;
}

/* ---- logits post-processing on the primary's engine thread (specdec/logits_codec.py) ---- */

/* Each row's maximum and minimum, and whether it holds a NaN (max/min comparisons skip NaNs). */
static void row_max_min(const float *x, int64_t V, float *mx, float *mn, int *has_nan) {
    int64_t i = 0;
    float hi = -INFINITY, lo = INFINITY;
    int nan = 0;
#if QGEMM_AVX2
    __m256 vhi = _mm256_set1_ps(-INFINITY), vlo = _mm256_set1_ps(INFINITY), vnan = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vhi = _mm256_max_ps(vhi, v);
        vlo = _mm256_min_ps(vlo, v);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float h[8], l[8];
    _mm256_storeu_ps(h, vhi); _mm256_storeu_ps(l, vlo);
    for (int j = 0; j < 8; ++j) { hi = h[j] > hi ? h[j] : hi; lo = l[j] < lo ? l[j] : lo; }
    nan = _mm256_movemask_ps(vnan) != 0;
#endif
    for (; i < V; ++i) {
        const float v = x[i];
        if (v != v) nan = 1;
        hi = v > hi ? v : hi;
        lo = v < lo ? v : lo;
    }
    *mx = hi; *mn = lo; *has_nan = nan;
}

/* The index of the first element of x [V] equal to m (present: it is the row's maximum). */
static int64_t first_equal(const float *x, int64_t V, float m) {
    int64_t i = 0;
#if QGEMM_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= V; i += 8) {
        const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
        if (bits) return i + __builtin_ctz((unsigned)bits);
    }
#endif
    for (; i < V; ++i)
        if (x[i] == m) return i;
    return -1;
}

/* argmax [R]: the index of the first maximum of each row of x [R, V], as torch.argmax chooses it;
 * -1 for a row holding a NaN (torch would pick the NaN: the caller asks torch for that row). */
void qgemm_argmax_rows(const float *x, int64_t R, int64_t V, int64_t *argmax) {
    for (int64_t r = 0; r < R; ++r) {
        float mx, mn; int nan;
        row_max_min(x + r * V, V, &mx, &mn, &nan);
        argmax[r] = nan ? -1 : first_equal(x + r * V, V, mx);
    }
}

/* float -> e4m3fn byte for |f| <= 448 (the caller clamps): round to nearest even, exactly as
 * c10's fp8e4m3fn_from_fp32_value, which torch's .to(torch.float8_e4m3fn) uses. Branch-free, so
 * the loop below vectorizes. */
static inline uint8_t e4m3_from_fp32(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    float a; memcpy(&a, &b, 4);
    const float denorm = a + 16384.0f;                              /* 2^14: below 2^-6 the sum rounds to the code */
    uint32_t db; memcpy(&db, &denorm, 4);
    const uint32_t sub = db - (UINT32_C(141) << 23);
    const uint32_t nrm = (b + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
    const uint32_t code = b < (UINT32_C(121) << 23) ? sub : nrm;
    return (uint8_t)(code | (sign >> 24));
}

/* Logits x [R, V] -> e4m3fn codes [R, V] of (x - rowmax) / scale and scales [R], scale =
 * (rowmax - rowmin) / 448 (zero_scale where that is not > 0): the arithmetic of
 * specdec.logits_codec.encode_logits (max |x - rowmax| is rowmax - rowmin, rounded the same) in
 * one pass per row for the extremes and one to encode. Returns -1, having encoded nothing
 * further, at the first row that is not finite (a NaN or an infinity): the caller refuses it. */
int qgemm_encode_e4m3(const float *x, int64_t R, int64_t V, float zero_scale, uint8_t *codes, float *scales) {
    for (int64_t r = 0; r < R; ++r) {
        const float *row = x + r * V;
        float mx, mn; int nan;
        row_max_min(row, V, &mx, &mn, &nan);
        if (nan || !isfinite(mx) || !isfinite(mn)) return -1;
        float scale = (mx - mn) / 448.0f;
        if (!(scale > 0.0f)) scale = zero_scale;
        if (!isfinite(scale)) return -1;
        scales[r] = scale;
        uint8_t *out = codes + r * V;
        int64_t i = 0;
#if QGEMM_AVX2
        const __m256 vmx = _mm256_set1_ps(mx), vscale = _mm256_set1_ps(scale);
        const __m256 lo = _mm256_set1_ps(-448.0f), hi = _mm256_set1_ps(448.0f), two14 = _mm256_set1_ps(16384.0f);
        const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u), one = _mm256_set1_epi32(1);
        const __m256i denorm_bits = _mm256_set1_epi32(141 << 23), min_normal = _mm256_set1_epi32(121 << 23);
        const __m256i bias = _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu));
        for (; i + 8 <= V; i += 8) {              /* e4m3_from_fp32 on 8 lanes */
            __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmx), vscale);
            v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
            __m256i b = _mm256_castps_si256(v);
            const __m256i sign = _mm256_and_si256(b, sign_bit);
            b = _mm256_xor_si256(b, sign);
            const __m256i sub = _mm256_sub_epi32(
                _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(b), two14)), denorm_bits);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 20), one);
            const __m256i nrm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, bias), odd), 20);
            __m256i code = _mm256_blendv_epi8(nrm, sub, _mm256_cmpgt_epi32(min_normal, b));
            code = _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
            const __m256i w16 = _mm256_packus_epi32(code, code);     /* lanes hold 0..255 */
            const __m256i w8 = _mm256_packus_epi16(w16, w16);
            const int32_t low4 = _mm_cvtsi128_si32(_mm256_castsi256_si128(w8));
            const int32_t high4 = _mm_cvtsi128_si32(_mm256_extracti128_si256(w8, 1));
            memcpy(out + i, &low4, 4);
            memcpy(out + i + 4, &high4, 4);
        }
#endif
        for (; i < V; ++i) {
            float v = (row[i] - mx) / scale;
            v = v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v);
            out[i] = e4m3_from_fp32(v);
        }
    }
    return 0;
}

/* counts [R, 256]: how often each byte occurs in each row of codes [R, V] (the validator's row
 * statistics of fp8 logits: a row's 256 distinct values and their counts decide its max, its
 * log-sum-exp and its entropy). Four partial histograms so repeated bytes do not serialise. */
void qgemm_byte_histograms(const uint8_t *codes, int64_t R, int64_t V, uint32_t *counts) {
    for (int64_t r = 0; r < R; ++r) {
        const uint8_t *row = codes + r * V;
        uint32_t h[4][256];
        memset(h, 0, sizeof h);
        int64_t i = 0;
        for (; i + 4 <= V; i += 4) {
            ++h[0][row[i]]; ++h[1][row[i + 1]]; ++h[2][row[i + 2]]; ++h[3][row[i + 3]];
        }
        for (; i < V; ++i) ++h[0][row[i]];
        for (int c = 0; c < 256; ++c) counts[r * 256 + c] = h[0][c] + h[1][c] + h[2][c] + h[3][c];
    }
}

/* The same counts over the allowed positions only: row r allows position j when bit j % 32 of
 * words[r * W + j / 32] is set (the grammar mask's wire layout, int32 words, bit 0 first). */
void qgemm_byte_histograms_masked(const uint8_t *codes, int64_t R, int64_t V, const uint32_t *words, int64_t W,
                                  uint32_t *counts) {
    for (int64_t r = 0; r < R; ++r) {
        const uint8_t *row = codes + r * V;
        const uint32_t *mask = words + r * W;
        uint32_t h[4][256];
        memset(h, 0, sizeof h);
        for (int64_t w = 0; w < W && w * 32 < V; ++w) {
            uint32_t bits = mask[w];
            const int64_t base = w * 32;
            if (base + 32 > V) bits &= (UINT32_C(1) << (V - base)) - 1u;  /* a partial last word */
            if (bits == 0xFFFFFFFFu) {
                for (int k = 0; k < 32; k += 4) {
                    ++h[0][row[base + k]]; ++h[1][row[base + k + 1]]; ++h[2][row[base + k + 2]]; ++h[3][row[base + k + 3]];
                }
            } else {
                while (bits) {
                    ++h[0][row[base + __builtin_ctz(bits)]];
                    bits &= bits - 1u;
                }
            }
        }
        for (int c = 0; c < 256; ++c) counts[r * 256 + c] = h[0][c] + h[1][c] + h[2][c] + h[3][c];
    }
}
