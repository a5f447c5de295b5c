/* The dense parts of a decoder layer around its products, and a whole forward's layers in one
 * call: rmsnorm, rope, silu_mul; qgemm_layer_pre (before attention), qgemm_layer_post (after it),
 * qgemm_forward (every layer: pre, the KV-cache write, attention, post).
 *
 * Why fused: on a 2-core AVX2 CPU an int4 step through torch's packed kernels cost ~30 ms, of which
 * ~10 ms were the matmuls and the rest ~500 small tensor ops and their dispatch. Every output is
 * computed row by row in a fixed order, so a row's result does not depend on how many rows share
 * the step. */
#include "impl.h"

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

/* g[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u, eight at a time through exp8 (a tail through the
 * same lanes), so every element gets the same arithmetic wherever it falls. */
static void silu_mul(float *g, const float *u, int64_t n) {
    int64_t j = 0;
#if QGEMM_AVX2
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
#if QGEMM_AVX512
    for (; j + 16 <= n; j += 16) {     /* the same lane operations on sixteen lanes (exp16) */
        const __m512 x = _mm512_loadu_ps(g + j);
        const __m512 e = exp16(_mm512_xor_ps(x, _mm512_set1_ps(-0.f)));
        _mm512_storeu_ps(g + j, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)), _mm512_loadu_ps(u + j)));
    }
#endif
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

/* Before attention: h = RMSNorm(x); q = RoPE(h Wq), k = RoPE(h Wk), v = h Wv.
 * x [T, C]; q [T, H, D], k/v [T, Hkv, D]. */
int qgemm_layer_pre(const float *x, int64_t T, int64_t C, const float *norm_w, float eps,
                    const qweight *wq, const qweight *wk, const qweight *wv, int64_t heads, int64_t kv_heads,
                    int64_t D, const float *cos_t, const float *sin_t, const int64_t *positions,
                    float *q, float *k, float *v, int num_threads) {
    float *h = malloc(sizeof(float) * (size_t)(T * C));
    qact a = {0};
    int rc = -1;
    if (!h || qact_alloc(&a, T, C, wq->kind == QW_Q8T)) goto done;
    /* row by row (each row's arithmetic alone, whatever thread runs it): norm, then quantize */
    QGEMM_FOR_ROWS(t, T, {
        qgemm_rmsnorm(x + t * C, 1, C, norm_w, eps, h + t * C);
        qact_quantize_row(&a, h + t * C, t, C);
    });
    const qweight *const qkv[3] = {wq, wk, wv};
    float *const qkv_out[3] = {q, k, v};
    qmatmul_many(&a, T, qkv, qkv_out, 3, num_threads);
    QGEMM_FOR_ROWS(t, T, {
        rope(q + t * heads * D, 1, heads, D, cos_t, sin_t, positions + t);
        rope(k + t * kv_heads * D, 1, kv_heads, D, cos_t, sin_t, positions + t);
    });
    rc = 0;
done:
    qact_free(&a); free(h);
    return rc;
}

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
    if (!o || !n || !g || !u || qact_init(&a, attn, T, wo->k, wo->kind == QW_Q8T, num_threads) ||
        qact_alloc(&b, T, C, wgate->kind == QW_Q8T) || qact_alloc(&c, T, I, wdown->kind == QW_Q8T))
        goto done;
    qmatmul(&a, T, wo, o, num_threads);
    /* the parts between the products row by row, rows in parallel (each row's arithmetic alone) */
    QGEMM_FOR_ROWS(t, T, {
        for (int64_t j = t * C; j < (t + 1) * C; ++j) o[j] += x[j];                   /* h */
        qgemm_rmsnorm(o + t * C, 1, C, norm_w, eps, n + t * C);
        qact_quantize_row(&b, n + t * C, t, C);
    });
    const qweight *const gate_up[2] = {wgate, wup};
    float *const gate_up_out[2] = {g, u};
    qmatmul_many(&b, T, gate_up, gate_up_out, 2, num_threads);
    QGEMM_FOR_ROWS(t, T, {
        silu_mul(g + t * I, u + t * I, I);
        qact_quantize_row(&c, g + t * I, t, I);
    });
    qmatmul(&c, T, wdown, out, num_threads);
    QGEMM_FOR_ROWS(t, T, {
        for (int64_t j = t * C; j < (t + 1) * C; ++j) out[j] += o[j];
    });
    rc = 0;
done:
    qact_free(&a); qact_free(&b); qact_free(&c);
    free(o); free(n); free(g); free(u);
    return rc;
}

/* dst[0 .. D) = src as the cache's type (fp16: rounded to nearest even, as torch's .half()) */
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
    if (qgemm_is_profiling) qgemm_profile_begin();
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
                QGEMM_FOR_ROWS(r, s->n, {
                    for (int64_t h = 0; h < Hkv; ++h) {
                        const int64_t src = ((s->start + r) * Hkv + h) * D;
                        const int64_t dst = (h * s->capacity + s->num_cached + r) * D;
                        store_kv(kc + dst * elem, k + src, D, half);
                        store_kv(vc + dst * elem, v + src, D, half);
                    }
                });
                seqs[num_seqs++] = (att_seq){q + s->start * H * D, attn + s->start * H * D, s->n, s->num_cached + s->n,
                                             s->capacity, kc, vc, s->mask};
            }
            if (qgemm_is_profiling) qgemm_profile_mark(QGEMM_PART_REST);
            if (num_seqs) rc = attend_seqs(seqs, num_seqs, H, Hkv, D, half, num_threads);
            if (qgemm_is_profiling) qgemm_profile_mark(QGEMM_PART_ATTENTION);
        }
        if (!rc)
            rc = qgemm_layer_post(x, attn, T, C, ly->o, ly->norm2, ly->eps2, ly->gate, ly->up, ly->down, out,
                                  num_threads);
        if (!rc) memcpy(x, out, sizeof(float) * (size_t)(T * C));
    }
    if (qgemm_is_profiling) qgemm_profile_end();
    free(q); free(k); free(v); free(attn); free(out); free(seqs);
    return rc;
}
