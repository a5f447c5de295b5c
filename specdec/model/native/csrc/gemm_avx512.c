/* The products on AVX-512 with VNNI: one zmm is a group of 16 output columns, vpdpbusd adds two
 * blocks' 4-weight steps per instruction; a tile is up to 2 rows x 4 groups (TILE_ROWS x UNIT).
 * Compiled to nothing unless this build enables AVX-512 F/BW/DQ + VNNI (impl.h: QGEMM_AVX512). */
#include "gemm.h"

#if QGEMM_AVX512

#define UNIT 4           /* groups of 16 columns a tile holds, and a thread takes at a time */
#define TILE_ROWS 2

/* gemm.h's 4-bit step for one block g of 16 columns, S their integer sums, tg = t * G + g for
 * activation row t: acc = fma(d * dx[tg], S, acc), then acc = fma(m, sx[tg], acc) */
ALWAYS_INLINE __m512 q4_block16(__m512 acc, __m512 d, __m512 m, __m512i S, const qact *a, int64_t tg) {
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a->dx[tg])), _mm512_cvtepi32_ps(S), acc);
    return _mm512_fmadd_ps(m, _mm512_set1_ps(a->sx[tg]), acc);
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
            for (int r = 0; r < R; ++r)
                facc[r][c] = q4_block16(facc[r][c], dv, mv, iacc[r][c], a, (t0 + r) * G + g);
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

/* per token: two vpdpbusd per 4 inputs (the halves h and l against w + 128), each sum started at
 * -128 * the half's row sum, so it ends at the exact w . h (w . l); one rescale at the end */
ALWAYS_INLINE void q8t_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C,
                            float *out, int64_t N) {
    const int64_t K = w->k;
    const uint8_t *wp = (const uint8_t *)w->w;
    __m512i hacc[2][4], lacc[2][4];
    for (int r = 0; r < R; ++r) {
        const __m512i hi = _mm512_set1_epi32(-128 * a->xs[2 * (t0 + r)]);
        const __m512i lo = _mm512_set1_epi32(-128 * a->xs[2 * (t0 + r) + 1]);
        for (int c = 0; c < C; ++c) hacc[r][c] = hi, lacc[r][c] = lo;
    }
#pragma GCC unroll 4
    for (int64_t j = 0; j < K / 4; ++j) {
        __m512i wv[4];
        for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512((const void *)(wp + (((v0 + c) * (K / 4) + j) * NV) * 4));
        for (int r = 0; r < R; ++r) {
            const __m512i hb = _mm512_set1_epi32(ld4(a->xq + (t0 + r) * K + 4 * j));
            const __m512i lb = _mm512_set1_epi32(ld4(a->xl + (t0 + r) * K + 4 * j));
            for (int c = 0; c < C; ++c) {
                hacc[r][c] = _mm512_dpbusd_epi32(hacc[r][c], wv[c], hb);
                lacc[r][c] = _mm512_dpbusd_epi32(lacc[r][c], wv[c], lb);
            }
        }
    }
    const __m512 k128 = _mm512_set1_ps(128.f);
    for (int c = 0; c < C; ++c) {
        const __m512 sc = _mm512_loadu_ps(w->scale + (v0 + c) * NV);
        for (int r = 0; r < R; ++r) {
            const __m512 q = _mm512_fmadd_ps(k128, _mm512_cvtepi32_ps(hacc[r][c]), _mm512_cvtepi32_ps(lacc[r][c]));
            const __m512 y = _mm512_mul_ps(sc, _mm512_mul_ps(_mm512_set1_ps(a->dx[t0 + r]), q));
            store16(out + (t0 + r) * N + (v0 + c) * NV, y, (int)(N - (v0 + c) * NV));
        }
    }
}

void qgemm_product_unit_avx512(const qweight *w, const qact *a, int64_t T, int64_t v0, int C, float *out) {
    TILES_BY_KIND(q4_tile, q8_tile, q8t_tile, UNIT, TILE_ROWS);
}

/* the tiles hold UNIT groups at once: a thread's unit is one tile's columns */
int64_t qgemm_unit_groups_avx512(int64_t num_groups, int num_threads) {
    (void)num_groups, (void)num_threads;
    return UNIT;
}

#endif
