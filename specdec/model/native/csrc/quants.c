/* Activation quantization: a float row in blocks of 32 -> int8 values and per-block scales, what
 * every product path multiplies the packed weights by (qgemm.h gives the formulas). */
#include "impl.h"


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

int qact_alloc(qact *a, int64_t T, int64_t K) {
    const int64_t G = K / QK, padded = qgemm_act_rows(T);
    a->xq = malloc((size_t)(padded * K) + 64); a->dx = malloc(sizeof(float) * (size_t)(T * G) + 64);
    a->sx = malloc(sizeof(float) * (size_t)(T * G) + 64); a->xs = NULL;
    if (!a->xq || !a->dx || !a->sx) return -1;
#if QGEMM_ACT_SUMS
    a->xs = malloc(sizeof(int32_t) * (size_t)(T * G) + 64);
    if (!a->xs) return -1;
#endif
    memset(a->xq + T * K, 0, (size_t)((padded - T) * K));
    return 0;
}

void qact_quantize_row(qact *a, const float *x, int64_t t, int64_t K) {
    const int64_t G = K / QK;
    quantize_rows(x, 1, K, a->xq + t * K, a->dx + t * G, a->sx + t * G, a->xs ? a->xs + t * G : NULL);
}

int qact_init(qact *a, const float *x, int64_t T, int64_t K, int num_threads) {
    if (qact_alloc(a, T, K)) return -1;
    QGEMM_FOR_ROWS(t, T, qact_quantize_row(a, x + t * K, t, K););
    return 0;
}

void qact_free(qact *a) { free(a->xq); free(a->xs); free(a->dx); free(a->sx); }
