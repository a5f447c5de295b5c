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

/* x [K] fp32 -> per token (impl.h): h, l int8 [K], sums[0..1] the sums of h and l, *dx the scale.
 * q = rint(x * (QT_MAX / max|x|)) on every path (cvtps rounds to nearest even as lrintf does), so
 * the AVX-512 loop and the portable one give the same values. */
static void quantize_row_token(const float *x, int64_t K, int8_t *h, int8_t *l, int32_t *sums, float *dx) {
    int64_t j = 0;
    float amax = 0.f;
#if QGEMM_AVX512
    __m512 m = _mm512_setzero_ps();
    for (; j + 16 <= K; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
    amax = _mm512_reduce_max_ps(m);
#endif
    for (; j < K; ++j) amax = fmaxf(amax, fabsf(x[j]));
    const float id = amax > 0.f ? (float)QT_MAX / amax : 0.f;
    int32_t sh = 0, sl = 0;
    j = 0;
#if QGEMM_AVX512
    const __m512 ids = _mm512_set1_ps(id);
    const __m512i lim = _mm512_set1_epi32(QT_MAX), low7 = _mm512_set1_epi32(127);
    __m512i vh = _mm512_setzero_si512(), vl = _mm512_setzero_si512();
    for (; j + 16 <= K; j += 16) {
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), ids));
        q = _mm512_max_epi32(_mm512_min_epi32(q, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        const __m512i hi = _mm512_srai_epi32(q, 7), lo = _mm512_and_si512(q, low7);
        _mm_storeu_si128((__m128i *)(h + j), _mm512_cvtepi32_epi8(hi));
        _mm_storeu_si128((__m128i *)(l + j), _mm512_cvtepi32_epi8(lo));
        vh = _mm512_add_epi32(vh, hi);
        vl = _mm512_add_epi32(vl, lo);
    }
    sh = _mm512_reduce_add_epi32(vh);
    sl = _mm512_reduce_add_epi32(vl);
#endif
    for (; j < K; ++j) {
        long q = lrintf(x[j] * id);
        q = q > QT_MAX ? QT_MAX : q < -QT_MAX ? -QT_MAX : q;
        const int32_t hi = (int32_t)(q >> 7), lo = (int32_t)(q & 127);
        h[j] = (int8_t)hi; l[j] = (int8_t)lo;
        sh += hi; sl += lo;
    }
    sums[0] = sh; sums[1] = sl;
    *dx = amax / (float)QT_MAX;
}

int qact_alloc(qact *a, int64_t T, int64_t K, int per_token) {
    const int64_t G = K / QK, padded = qgemm_act_rows(T, per_token);
    memset(a, 0, sizeof *a);
    a->per_token = per_token;
    a->xq = malloc((size_t)(padded * K) + 64);
    if (!a->xq) return -1;
    memset(a->xq + T * K, 0, (size_t)((padded - T) * K));
    if (per_token) {
        a->xl = malloc((size_t)(padded * K) + 64);
        a->xs = malloc(sizeof(int32_t) * (size_t)(2 * T) + 64);
        a->dx = malloc(sizeof(float) * (size_t)T + 64);
        if (!a->xl || !a->xs || !a->dx) return -1;
        memset(a->xl + T * K, 0, (size_t)((padded - T) * K));
        return 0;
    }
    a->dx = malloc(sizeof(float) * (size_t)(T * G) + 64);
    a->sx = malloc(sizeof(float) * (size_t)(T * G) + 64);
    if (!a->dx || !a->sx) return -1;
#if QGEMM_ACT_SUMS
    a->xs = malloc(sizeof(int32_t) * (size_t)(T * G) + 64);
    if (!a->xs) return -1;
#endif
    return 0;
}

void qact_quantize_row(qact *a, const float *x, int64_t t, int64_t K) {
    if (a->per_token) {
        quantize_row_token(x, K, a->xq + t * K, a->xl + t * K, a->xs + 2 * t, a->dx + t);
        return;
    }
    const int64_t G = K / QK;
    quantize_rows(x, 1, K, a->xq + t * K, a->dx + t * G, a->sx + t * G, a->xs ? a->xs + t * G : NULL);
}

void qact_quantize_rows_for(qact *a, const float *x, int64_t T, int64_t K) {
    QGEMM_FOR_ROWS(t, T, qact_quantize_row(a, x + t * K, t, K););
}

void qact_free(qact *a) { free(a->xq); free(a->xl); free(a->xs); free(a->dx); free(a->sx); }
