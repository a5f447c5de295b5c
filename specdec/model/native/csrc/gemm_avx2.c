/* The products on AVX2 (with FMA and F16C), with a 256-bit VNNI dot product where the CPU has one
 * (AVX-VNNI, or AVX-512 VNNI with VL on a build whose AVX-512 path is off): a group of 16 output
 * columns is two ymm, and a tile holds one group for up to 2 rows (4 for 4-bit without VNNI).
 * Compiled to nothing unless AVX2 is this build's path (impl.h: QGEMM_AVX2 && !QGEMM_AVX512). */
#include "gemm.h"

#if QGEMM_AVX2 && !QGEMM_AVX512

#define TILE_ROWS 2

/* 8 columns per ymm: a group of 16 is two vectors (h = 0, 1), bytes 32h.. of each 64-byte line.
 *
 * Without VNNI the 4-bit tile sums a block in 16 bits (below) and takes 4 rows at a time: the
 * weights' unpacking (and, shift, and) is shared by twice the rows, and with the loop over the
 * block's 4 steps kept rolled the accumulators stay in registers; the same bits either way
 * (measured: docs/benchmarks.md, "AVX2 without VNNI"). */
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

/* gemm.h's 4-bit step for one block g of 8 columns, S their integer sums, tg = t * G + g for
 * activation row t: acc = fma(d * dx[tg], S, acc), then acc = fma(m, sx[tg], acc) */
ALWAYS_INLINE __m256 q4_block8(__m256 acc, __m256 d, __m256 m, __m256i S, const qact *a, int64_t tg) {
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a->dx[tg])), _mm256_cvtepi32_ps(S), acc);
    return _mm256_fmadd_ps(m, _mm256_set1_ps(a->sx[tg]), acc);
}

/* C is the number of 16-column groups (1 here: the unit's groups are walked one by one) */
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
            for (int r = 0; r < R; ++r)
                facc[r][h] = q4_block8(facc[r][h], dv, mv, iacc[r][h], a, (t0 + r) * G + g);
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

/* The 8-bit rows per token (gemm.h: H = w . h and L = w . l over the whole row, then one rescale).
 * maddubs multiplies an unsigned byte by a signed one, so |w| (up to 128) takes the products and w's
 * sign goes to the activation byte: l (0..127) as it is, and h (-128..127) as 2 (h >> 1) + (h & 1),
 * whose parts negate without overflow (-128 would not). Every pair of products stays within
 * 2 * 128 * 127, inside int16, and widens to 32 bits at once (madd): the sums are exact, and the
 * rescale is the portable one's, so the bits are the same. Plain AVX2, with or without VNNI. */
ALWAYS_INLINE void q8t_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C,
                            float *out, int64_t N) {
    (void)C;
    const int64_t K = w->k;
    const int8_t *wp = (const int8_t *)w->w;
    const __m256i ones = _mm256_set1_epi16(1), twos = _mm256_set1_epi16(2);
    __m256i hacc[TILE_ROWS][2], lacc[TILE_ROWS][2];
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) hacc[r][h] = lacc[r][h] = _mm256_setzero_si256();
    for (int64_t j = 0; j < K / 4; ++j) {
        __m256i wv[2], wabs[2];
        for (int h = 0; h < 2; ++h) {
            wv[h] = _mm256_xor_si256(  /* stored w + 128 -> w */
                _mm256_loadu_si256((const __m256i *)(wp + ((v0 * (K / 4) + j) * NV) * 4 + h * 32)),
                _mm256_set1_epi8((char)0x80));
            wabs[h] = _mm256_sign_epi8(wv[h], wv[h]);  /* |w|; -128 stays 0x80, read as 128 */
        }
        for (int r = 0; r < R; ++r) {
            /* h's 4 bytes: arithmetic >> 1 of each (its sign bit kept), and the low bits */
            const uint32_t hb = (uint32_t)ld4(a->xq + (t0 + r) * K + 4 * j);
            const __m256i h1 = _mm256_set1_epi32((int32_t)(((hb >> 1) & 0x7F7F7F7Fu) | (hb & 0x80808080u)));
            const __m256i h0 = _mm256_set1_epi32((int32_t)(hb & 0x01010101u));
            const __m256i lb = _mm256_set1_epi32(ld4(a->xl + (t0 + r) * K + 4 * j));
            for (int h = 0; h < 2; ++h) {
                const __m256i p1 = _mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(h1, wv[h]));
                const __m256i p0 = _mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(h0, wv[h]));
                const __m256i pl = _mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(lb, wv[h]));
                hacc[r][h] = _mm256_add_epi32(
                    hacc[r][h], _mm256_add_epi32(_mm256_madd_epi16(p1, twos), _mm256_madd_epi16(p0, ones)));
                lacc[r][h] = _mm256_add_epi32(lacc[r][h], _mm256_madd_epi16(pl, ones));
            }
        }
    }
    const __m256 k128 = _mm256_set1_ps(128.f);
    for (int h = 0; h < 2; ++h) {
        const __m256 sc = _mm256_loadu_ps(w->scale + v0 * NV + h * 8);
        for (int r = 0; r < R; ++r) {
            const __m256 q = _mm256_fmadd_ps(k128, _mm256_cvtepi32_ps(hacc[r][h]), _mm256_cvtepi32_ps(lacc[r][h]));
            const __m256 y = _mm256_mul_ps(sc, _mm256_mul_ps(_mm256_set1_ps(a->dx[t0 + r]), q));
            store8(out + (t0 + r) * N + v0 * NV + h * 8, y, (int)(N - v0 * NV - h * 8));
        }
    }
}

void qgemm_product_unit_avx2(const qweight *w, const qact *a, int64_t T, int64_t v0, int C, float *out) {
    for (const int64_t end = v0 + C; v0 < end; ++v0) {  /* the tiles hold one group: one after another */
        if (w->kind == QW_Q4) TILES(q4_tile, 1, Q4_TILE_ROWS);
        else if (w->kind == QW_Q8T) TILES(q8t_tile, 1, TILE_ROWS);
        else TILES(q8_tile, 1, TILE_ROWS);
    }
}

/* Groups of 16 columns a thread takes at a time. The AVX-512 and portable tiles hold several groups
 * at once, and a unit is one tile's. These tiles hold one, so here a unit is a run of consecutive
 * groups, whose weights are contiguous: long runs let the hardware prefetcher stream them (a product of one row is bound by
 * memory bandwidth), and about four runs per thread still balance the threads (measured: the same
 * section). Which thread computes a group never changes its bits. */
#define MAX_RUN 8
int64_t qgemm_unit_groups_avx2(int64_t num_groups, int num_threads) {
    const int64_t run = num_groups / (4 * (int64_t)(num_threads > 1 ? num_threads : 1));
    return run < 1 ? 1 : run > MAX_RUN ? MAX_RUN : run;
}

#endif
