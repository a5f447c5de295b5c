/* Attention of a span's new rows over its KV cache: qgemm_attention for one sequence, and
 * attend_seqs_for, which qgemm_forward runs for every span of a step at once inside its region. */
#include "impl.h"

typedef float v8 __attribute__((vector_size(32)));

static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

static inline float hsum_v8(v8 acc) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
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

/* exp of every element of s[0, m) in place, lane by lane the same operations whatever m or the
 * element's position (so a row's probabilities do not depend on how many keys share the call). */
static void exp_shifted(float *s, int64_t m, float shift) {
    int64_t i = 0;
#if QGEMM_AVX2
    const __m256 sh = _mm256_set1_ps(shift);
#if QGEMM_AVX512
    const __m512 sh16 = _mm512_set1_ps(shift);
    for (; i + 16 <= m; i += 16) _mm512_storeu_ps(s + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), sh16)));
#endif
    for (; i + 8 <= m; i += 8) _mm256_storeu_ps(s + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh)));
    if (i < m) {                             /* the tail through the same lanes */
        float t[8];
        for (int j = 0; j < 8; ++j) t[j] = i + j < m ? s[i + j] : shift;
        _mm256_storeu_ps(t, exp8(_mm256_sub_ps(_mm256_loadu_ps(t), sh)));
        for (int j = 0; i + j < m; ++j) s[i + j] = t[j];
    }
#else
    for (; i < m; ++i) s[i] = exp1(s[i] - shift);
#endif
}

/* Attention as small tiled products over a KV head's rows.
 *
 * The queries that read one KV head (every row of the call times the heads of its group) are taken
 * in chunks; a chunk's scores against a block of key rows are computed while those rows sit in L1,
 * two queries by four keys at a time (three by four without AVX-512, a GQA group of three heads;
 * four by four with AVX-512's 32 registers; with AVX-512 and a wide chunk, sixteen keys in the lanes
 * of a zmm: scores_block_lanes), and its softmax-weighted value sums likewise (three queries by 32
 * columns without AVX-512, four by 64 with it), so a key or value row is read from memory, and an
 * fp16 one widened, once per chunk (and tile) instead of once per (row, head). The softmax reads the mask
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

/* a . (row i of the cache) for D not a multiple of 8: eight lane sums over D in order, then hsum_v8,
 * then the rest one by one, every product fused into its sum (FMA8, fmaf) as the tiles' are; with
 * `acc += a * k` and `s += a * k` the compiler chose whether to fuse, and builds for different
 * instruction sets (the portable one never fuses) gave different scores */
static inline float dot_kv(const float *a, const void *base, int64_t row, int64_t D, int half) {
    v8 acc = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) acc = FMA8(acc, ld8(a + i), ldkv8(base, row + i, half));
    float s = hsum_v8(acc);
    for (; i < D; ++i) s = fmaf(a[i], ldkv(base, row + i, half), s);
    return s;
}


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

/* s[j .. j + 7] for one query (a chunk's odd one out): the same per-key arithmetic as scores_2x4,
 * eight keys at a time, since one query's four accumulators would each wait out the FMA latency per
 * element where eight keep the FMA units busy (the third head of a group of three) */
static inline void scores_1x8(const float *q0, const void *K, int half, int64_t D, int64_t j, int64_t jn,
                              float scale, float *s0) {
    int64_t k[8];
    for (int t = 0; t < 8; ++t) k[t] = (j + t < jn ? j + t : jn - 1) * D;  /* past jn: the last key again */
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    for (int64_t e = 0; e < D; e += 8) {
        const v8 u = ld8(q0 + e);
        a0 = FMA8(a0, u, ldkv8(K, k[0] + e, half)); a1 = FMA8(a1, u, ldkv8(K, k[1] + e, half));
        a2 = FMA8(a2, u, ldkv8(K, k[2] + e, half)); a3 = FMA8(a3, u, ldkv8(K, k[3] + e, half));
        a4 = FMA8(a4, u, ldkv8(K, k[4] + e, half)); a5 = FMA8(a5, u, ldkv8(K, k[5] + e, half));
        a6 = FMA8(a6, u, ldkv8(K, k[6] + e, half)); a7 = FMA8(a7, u, ldkv8(K, k[7] + e, half));
    }
    float g[8];
    hsum_8x(a0, a1, a2, a3, a4, a5, a6, a7, g, g + 4);  /* hsum_v8 of each, its own order of additions */
    for (int t = 0; t < 8 && j + t < jn; ++t) s0[j + t] = g[t] * scale;
}

#if !QGEMM_AVX512
/* scores_2x4 for three queries sharing each key load (a KV head's group of three heads at one row):
 * twelve accumulators, each key row converted once for three queries instead of twice (a pair and
 * a lone query); the same per-key arithmetic, so the same bits */
static inline void scores_3x4(const float *const *qs, const void *K, int half, int64_t D, int64_t j, int64_t jn,
                              float scale, float *const *ss) {
    const int64_t k0 = j * D, k1 = (j + 1 < jn ? j + 1 : jn - 1) * D;
    const int64_t k2 = (j + 2 < jn ? j + 2 : jn - 1) * D, k3 = (j + 3 < jn ? j + 3 : jn - 1) * D;
    const float *q0 = qs[0], *q1 = qs[1], *q2 = qs[2];
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    v8 c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
    for (int64_t e = 0; e < D; e += 8) {
        const v8 x0 = ldkv8(K, k0 + e, half), x1 = ldkv8(K, k1 + e, half);
        const v8 x2 = ldkv8(K, k2 + e, half), x3 = ldkv8(K, k3 + e, half);
        const v8 u = ld8(q0 + e), w = ld8(q1 + e), z = ld8(q2 + e);
        a0 = FMA8(a0, u, x0); a1 = FMA8(a1, u, x1); a2 = FMA8(a2, u, x2); a3 = FMA8(a3, u, x3);
        b0 = FMA8(b0, w, x0); b1 = FMA8(b1, w, x1); b2 = FMA8(b2, w, x2); b3 = FMA8(b3, w, x3);
        c0 = FMA8(c0, z, x0); c1 = FMA8(c1, z, x1); c2 = FMA8(c2, z, x2); c3 = FMA8(c3, z, x3);
    }
    finish_2x4(a0, a1, a2, a3, b0, b1, b2, b3, j, jn, scale, ss[0], ss[1]);
    finish_2x4(c0, c1, c2, c3, c0, c1, c2, c3, j, jn, scale, ss[2], ss[2]);  /* the third alone */
}
#endif

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

#if !QGEMM_AVX512
/* vsum_2x4 for three queries sharing each value row: twelve accumulators, each value row converted
 * once for three queries; per element the same FMA chain, so the same bits */
static inline void vsum_3x4(const float *const *ps, const void *V, int half, int64_t D, int64_t j0, int64_t j1,
                            int64_t c, float *const *os) {
    v8 a[4], b[4], d[4];
    for (int u = 0; u < 4; ++u) {
        a[u] = ld8(os[0] + c + 8 * u); b[u] = ld8(os[1] + c + 8 * u); d[u] = ld8(os[2] + c + 8 * u);
    }
    for (int64_t j = j0; j < j1; ++j) {
        const float x = ps[0][j], y = ps[1][j], z = ps[2][j];
        const v8 px = {x, x, x, x, x, x, x, x}, py = {y, y, y, y, y, y, y, y}, pz = {z, z, z, z, z, z, z, z};
        for (int u = 0; u < 4; ++u) {
            const v8 vv = ldkv8(V, j * D + c + 8 * u, half);
            a[u] = FMA8(a[u], px, vv); b[u] = FMA8(b[u], py, vv); d[u] = FMA8(d[u], pz, vv);
        }
    }
    for (int u = 0; u < 4; ++u) {
        st8(os[0] + c + 8 * u, a[u]); st8(os[1] + c + 8 * u, b[u]); st8(os[2] + c + 8 * u, d[u]);
    }
}
#endif

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

/* Chunks of at least this many queries take their scores with keys in lanes; 0: never (and always
 * 0 without AVX-512). Process-wide, set at load; the bits are the same either way. */
static int att_lanes_min_queries;

int qgemm_set_att_lanes(int min_queries) {
#if QGEMM_AVX512
    att_lanes_min_queries = min_queries > 0 ? min_queries : 0;
#else
    (void)min_queries;
#endif
    return att_lanes_min_queries;
}

int qgemm_att_lanes(void) { return att_lanes_min_queries; }

#if QGEMM_AVX512
/* Keys in lanes: a wide chunk's scores sixteen keys per zmm. A key block is transposed once (kt[e]
 * holds dimension e of sixteen keys), then each query's score of the sixteen keys is eight FMA
 * chains over D, one per lane l of the lone dot (dimensions l, l + 8, ...), added in hsum_v8's order
 * ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) and scaled: the operations of the lone dot for
 * every key, so the same bits, without a horizontal sum per key. Worth its transposes from a few
 * queries a chunk on some cores and at no chunk size on others (one key load per two queries' FMAs,
 * a 512-bit shuffle network per block), so whether it runs is measured per machine and set at load
 * (qgemm_set_att_lanes); D a multiple of 16, at most ATT_LANES_MAX_D. */
#define ATT_LANES_MAX_D 256

/* r[i][e] -> r[e][i] for a 16 x 16 block of floats */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* kt [D][16] = keys [j, j + n) of K as fp32, transposed (n <= 16; lanes past n repeat key j) */
static void transpose_keys(const void *K, int half, int64_t D, int64_t j, int n, float *kt) {
    for (int64_t e0 = 0; e0 < D; e0 += 16) {
        __m512 r[16];
        for (int t = 0; t < 16; ++t) {
            const int64_t at = (j + (t < n ? t : 0)) * D + e0;
            r[t] = half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)K + at)))
                        : _mm512_loadu_ps((const float *)K + at);
        }
        transpose16(r);
        for (int e = 0; e < 16; ++e) _mm512_store_ps(kt + (e0 + e) * 16, r[e]);
    }
}

/* s_r[j .. j + 16) (the lanes of `valid`) for R queries q_r against kt */
ALWAYS_INLINE void scores_lanes(const float *const *q, const float *kt, int64_t D, float scale, float *const *s,
                                int64_t j, __mmask16 valid, const int R) {
    __m512 p[2][8];
    for (int r = 0; r < R; ++r)
        for (int l = 0; l < 8; ++l) p[r][l] = _mm512_setzero_ps();
    for (int64_t e = 0; e < D; e += 8)
        for (int l = 0; l < 8; ++l) {
            const __m512 k = _mm512_load_ps(kt + (e + l) * 16);
            for (int r = 0; r < R; ++r) p[r][l] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][e + l]), k, p[r][l]);
        }
    for (int r = 0; r < R; ++r) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(p[r][0], p[r][4]), _mm512_add_ps(p[r][1], p[r][5])),
                                         _mm512_add_ps(_mm512_add_ps(p[r][2], p[r][6]), _mm512_add_ps(p[r][3], p[r][7])));
        _mm512_mask_storeu_ps(s[r] + j, valid, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
    }
}

/* every query's scores against keys [j0, j1), sixteen keys at a time */
static void scores_block_lanes(const float *const *qs, int nq, const void *K, int half, int64_t D, int64_t j0,
                               int64_t j1, float scale, float *s, int64_t L) {
    float kt[ATT_LANES_MAX_D * 16] __attribute__((aligned(64)));
    for (int64_t j = j0; j < j1; j += 16) {
        const int n = (int)(j1 - j < 16 ? j1 - j : 16);
        transpose_keys(K, half, D, j, n, kt);
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        int i = 0;
        for (; i + 2 <= nq; i += 2) {
            float *const ss[2] = {s + (int64_t)i * L, s + (int64_t)(i + 1) * L};
            scores_lanes(qs + i, kt, D, scale, ss, j, valid, 2);
        }
        if (i < nq) {
            float *const ss[1] = {s + (int64_t)i * L};
            scores_lanes(qs + i, kt, D, scale, ss, j, valid, 1);
        }
    }
}
#endif

/* One chunk: queries qs[0 .. nq) (rows rs[i] of the call) over the KV head's rows K, V, keys j < L
 * under mask rows (NULL: all visible); outputs os[i]. s: nq * L floats; keys, tmp: L each. */
static void attend_chunk(const float *const *qs, const int64_t *rs, float *const *os, int nq, int64_t D,
                         const void *K, const void *V, int half, int64_t L, const uint8_t *mask, float scale,
                         float *s, int64_t *keys, float *tmp, float *vf) {
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
        if (D % 16 == 0 && D <= ATT_LANES_MAX_D && att_lanes_min_queries && nq >= att_lanes_min_queries) {
            scores_block_lanes(qs, nq, K, half, D, j0, j1, scale, s, L);
            continue;
        }
        for (; is_vector && i + 4 <= nq; i += 4) {
            float *const ss[4] = {s + (int64_t)i * L, s + (int64_t)(i + 1) * L, s + (int64_t)(i + 2) * L,
                                  s + (int64_t)(i + 3) * L};
            for (int64_t j = j0; j < j1; j += 4) scores_4x4(qs + i, K, half, D, j, j1, scale, ss);
        }
#endif
#if !QGEMM_AVX512
        for (; is_vector && i + 3 <= nq; i += 3) {
            float *const ss[3] = {s + (int64_t)i * L, s + (int64_t)(i + 1) * L, s + (int64_t)(i + 2) * L};
            for (int64_t j = j0; j < j1; j += 4) scores_3x4(qs + i, K, half, D, j, j1, scale, ss);
        }
#endif
        for (; i < nq; i += 2) {
            const int i1 = i + 1 < nq ? i + 1 : i;
            float *s0 = s + (int64_t)i * L, *s1 = s + (int64_t)i1 * L;
            if (is_vector && i1 == i)
                for (int64_t j = j0; j < j1; j += 8) scores_1x8(qs[i], K, half, D, j, j1, scale, s0);
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
        /* fp16 values for many queries: the block's rows widened once (exactly) into vf, not once per
         * four queries; then every group of four reads them as fp32 (the same values, the same bits) */
        const int is_widened = half && D % 64 == 0 && nq >= 8;
        if (is_widened)
            for (int64_t e = 0; e < (j1 - j0) * D; e += 16)
                _mm512_storeu_ps(vf + e, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)V + j0 * D + e))));
        for (; i + 4 <= nq && D % 64 == 0; i += 4) {     /* four queries share each value row */
            const float *ps[4] = {s + (int64_t)i * L, s + (int64_t)(i + 1) * L, s + (int64_t)(i + 2) * L,
                                  s + (int64_t)(i + 3) * L};
            if (is_widened) {
                const float *pw[4] = {ps[0] + j0, ps[1] + j0, ps[2] + j0, ps[3] + j0};
                for (int64_t c = 0; c < D; c += 64) vsum_z(pw, vf, 0, D, 0, j1 - j0, c, os + i, 4);
            } else {
                for (int64_t c = 0; c < D; c += 64)
                    if (half) vsum_z(ps, V, 1, D, j0, j1, c, os + i, 4);
                    else vsum_z(ps, V, 0, D, j0, j1, c, os + i, 4);
            }
        }
#endif
#if !QGEMM_AVX512
        for (; i + 3 <= nq && D % 32 == 0; i += 3) {     /* three queries share each value row */
            const float *const ps[3] = {s + (int64_t)i * L, s + (int64_t)(i + 1) * L, s + (int64_t)(i + 2) * L};
            for (int64_t c = 0; c < D; c += 32) vsum_3x4(ps, V, half, D, j0, j1, c, os + i);
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

/* Every sequence's queries, split into work items of at most `chunk` queries of one KV head (KV head
 * major within a sequence: L2 reuse), in ONE worksharing loop over all sequences' items: a step of
 * many one-row decodes shares one loop a layer, not one per sequence. A query's bits do not depend
 * on the chunk it falls in (attend_chunk's paired and lone paths compute each query alike). */
int att_plan_init(att_plan *p, const att_seq *seqs, int64_t num_seqs, int64_t H, int64_t Hkv, int num_threads) {
    const int64_t group = H / Hkv;
    int64_t total = 0;
    p->max_L = 1;
    for (int64_t i = 0; i < num_seqs; ++i) {
        total += seqs[i].n * H;
        if (seqs[i].L > p->max_L) p->max_L = seqs[i].L;
    }
    /* chunks small enough for two per thread, at most ATT_MAX_CHUNK queries */
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    int64_t chunk = (total + 4 * threads - 1) / (4 * threads);
    p->chunk = chunk < 1 ? 1 : chunk > ATT_MAX_CHUNK ? ATT_MAX_CHUNK : chunk;
#if !QGEMM_AVX512
    /* Without AVX-512 a chunk takes a KV head's whole group at once (three queries share each key and
     * value row's conversion), even where that leaves fewer items than two per thread: with the
     * three-query tiles a one-row step's attention after 2,048 tokens of fp16 cache took a median
     * 3.21 ms against 4.28 on the 2-core AVX2 EPYC. With AVX-512's wider tiles the smaller chunks
     * measured faster (docs/benchmarks.md, "Engine step and verify curve"). */
    if (p->chunk < group) p->chunk = group > ATT_MAX_CHUNK ? ATT_MAX_CHUNK : group;
#endif
    p->first_item = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (!p->first_item) return -1;
    p->first_item[0] = 0;
    for (int64_t i = 0; i < num_seqs; ++i)
        p->first_item[i + 1] = p->first_item[i] + Hkv * ((seqs[i].n * group + p->chunk - 1) / p->chunk);
    return 0;
}

void att_plan_free(att_plan *p) { free(p->first_item); p->first_item = NULL; }

void attend_seqs_for(const att_seq *seqs, int64_t num_seqs, const att_plan *p, int64_t H, int64_t Hkv, int64_t D,
                     int half, qscratch *team) {
    const int64_t group = H / Hkv, chunk = p->chunk, num_items = p->first_item[num_seqs];
    const float scale = 1.f / sqrtf((float)D);
    const size_t elem = half ? sizeof(uint16_t) : sizeof(float);
    qscratch *mine = qscratch_mine(team);
    int64_t si = 0;   /* items come in ascending order per thread: the sequence search moves forward */
    #pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < num_items; ++item) {
        if (item < p->first_item[si]) si = 0;
        while (item >= p->first_item[si + 1]) ++si;
        const att_seq *a = seqs + si;
        const int64_t per_kv = a->n * group, chunks_per_kv = (per_kv + chunk - 1) / chunk;
        const int64_t local = item - p->first_item[si], kvh = local / chunks_per_kv;
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
                     (const char *)a->v + kvh * a->capacity * D * elem, half, a->L, a->mask, scale, mine->att_s,
                     mine->att_keys, mine->att_tmp, mine->att_vf);
    }
}

/* out [n, H, D]: row r, head h attends the cache rows j < L of kv head h / (H / Hkv) with mask[r, j]
 * (uint8 [n, L]; NULL: every row attends all of them), softmax in fp32; see attend_chunk. The caches
 * are fp32, or fp16 with `half`. */
int qgemm_attention(const float *q, int64_t n, int64_t H, int64_t Hkv, int64_t D, const void *k_cache,
                    const void *v_cache, int half, int64_t capacity, int64_t L, const uint8_t *mask,
                    float *out, int num_threads) {
    const att_seq seq = {q, out, n, L, capacity, k_cache, v_cache, mask};
    att_plan plan;
    if (att_plan_init(&plan, &seq, 1, H, Hkv, num_threads)) return -1;
    qscratch *team = qscratch_team(num_threads, (qscratch_size){0, plan.chunk, plan.max_L, D});
    if (team) {
        #pragma omp parallel num_threads(num_threads)
        attend_seqs_for(&seq, 1, &plan, H, Hkv, D, half, team);
    }
    qscratch_team_free(team, num_threads);
    att_plan_free(&plan);
    return team ? 0 : -1;
}
