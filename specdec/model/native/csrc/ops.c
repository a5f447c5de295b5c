/* The dense parts of a decoder layer around its products: rmsnorm, rope, silu_mul, the row-wise
 * phases between products (orphaned loops over rows, run inside a caller's parallel region), and
 * the single-layer calls qgemm_layer_pre (before attention) and qgemm_layer_post (after it), each
 * one parallel region over those pieces. forward.c runs every layer on the same pieces.
 *
 * Why fused: between its products a forward runs hundreds of small tensor ops, whose dispatch
 * through torch cost more than the products themselves on a 2-core CPU. Every output is
 * computed row by row in a fixed order, so a row's result does not depend on how many rows share
 * the step. */
#include "impl.h"

#include <omp.h>

/* ss[i] = the sum over j = 0, 1, ... of x_i[j] * x_i[j], each square rounded before it is added (no
 * FMA contraction, on any compiler: the arithmetic of the one-row loop this replaced, as compiled),
 * for the QGEMM_NORM_ROWS rows of x [QGEMM_NORM_ROWS, C]. The rows' addition chains are independent,
 * so they run side by side: a row's chain alone waits on each addition's latency. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void sum_squares_block(const float *x, int64_t C, float *ss) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    float s[QGEMM_NORM_ROWS] = {0};
    for (int64_t j = 0; j < C; ++j)
        for (int i = 0; i < QGEMM_NORM_ROWS; ++i) s[i] += x[i * C + j] * x[i * C + j];
    for (int i = 0; i < QGEMM_NORM_ROWS; ++i) ss[i] = s[i];
}

/* the same sum for one row */
static float sum_squares_row(const float *r, int64_t C) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    float ss = 0.f;
    for (int64_t j = 0; j < C; ++j) ss += r[j] * r[j];
    return ss;
}
#pragma GCC pop_options

/* out = x * rsqrt(mean(x^2) + eps) * weight, per row, whole blocks of rows side by side */
void qgemm_rmsnorm(const float *x, int64_t T, int64_t C, const float *weight, float eps, float *out) {
    float ss[QGEMM_NORM_ROWS];
    for (int64_t t0 = 0; t0 < T; t0 += QGEMM_NORM_ROWS) {
        const int64_t n = T - t0 < QGEMM_NORM_ROWS ? T - t0 : QGEMM_NORM_ROWS;
        if (n == QGEMM_NORM_ROWS) sum_squares_block(x + t0 * C, C, ss);
        else for (int64_t i = 0; i < n; ++i) ss[i] = sum_squares_row(x + (t0 + i) * C, C);
        for (int64_t i = 0; i < n; ++i) {
            const float *r = x + (t0 + i) * C;
            float *o = out + (t0 + i) * C;
            const float inv = 1.f / sqrtf(ss[i] / (float)C + eps);
            for (int64_t j = 0; j < C; ++j) o[j] = weight[j] * (r[j] * inv);
        }
    }
}

int64_t qgemm_row_block(int64_t T) {
    const int64_t threads = omp_get_num_threads(), per_thread = (T + threads - 1) / threads;
    return per_thread < 1 ? 1 : per_thread > QGEMM_NORM_ROWS ? QGEMM_NORM_ROWS : per_thread;
}

/* rotate-half RoPE in place on x [T, heads, D] with tables cos/sin [P, D]. Each output is one product
 * fused into the other (fmaf): what the vector builds' compiler made of a * c - b * s, written out so
 * that the portable build, which has no FMA to contract into, computes the same bits. */
static void rope(float *x, int64_t T, int64_t heads, int64_t D, const float *cos_t, const float *sin_t,
                 const int64_t *positions) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; ++t) {
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        for (int64_t h = 0; h < heads; ++h) {
            float *v = x + (t * heads + h) * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = fmaf(a, c[i], -(b * s[i]));
                v[i + half] = fmaf(b, c[i + half], a * s[i + half]);
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
    for (; j < n; ++j) g[j] = g[j] / (1.f + exp1(-g[j])) * u[j];
#endif
}

void rope_row(float *q, float *k, int64_t t, int64_t H, int64_t Hkv, int64_t D, const float *cos_t,
              const float *sin_t, const int64_t *positions) {
    rope(q + t * H * D, 1, H, D, cos_t, sin_t, positions + t);
    rope(k + t * Hkv * D, 1, Hkv, D, cos_t, sin_t, positions + t);
}

void rows_norm_quantize(const float *x, int64_t T, int64_t C, const float *norm_w, float eps, float *h, qact *a) {
    QGEMM_FOR_ROW_BLOCKS(t0, num_rows, T, {
        qgemm_rmsnorm(x + t0 * C, num_rows, C, norm_w, eps, h + t0 * C);
        for (int64_t t = t0; t < t0 + num_rows; ++t) qact_quantize_row(a, h + t * C, t, C);
    });
}

void rows_residual_norm_quantize(float *o, const float *x, int64_t T, int64_t C, const float *norm_w, float eps,
                                 float *n, qact *a) {
    QGEMM_FOR_ROW_BLOCKS(t0, num_rows, T, {
        for (int64_t j = t0 * C; j < (t0 + num_rows) * C; ++j) o[j] += x[j];
        qgemm_rmsnorm(o + t0 * C, num_rows, C, norm_w, eps, n + t0 * C);
        for (int64_t t = t0; t < t0 + num_rows; ++t) qact_quantize_row(a, n + t * C, t, C);
    });
}

void rows_silu_quantize(float *g, const float *u, int64_t T, int64_t I, qact *a) {
    QGEMM_FOR_ROWS(t, T, {
        silu_mul(g + t * I, u + t * I, I);
        qact_quantize_row(a, g + t * I, t, I);
    });
}

/* Before attention: h = RMSNorm(x); q = RoPE(h Wq), k = RoPE(h Wk), v = h Wv, in one parallel region
 * (qgemm_forward's pieces, one call). x [T, C]; q [T, H, D], k/v [T, Hkv, D]. */
int qgemm_layer_pre(const float *x, int64_t T, int64_t C, const float *norm_w, float eps,
                    const qweight *wq, const qweight *wk, const qweight *wv, int64_t heads, int64_t kv_heads,
                    int64_t D, const float *cos_t, const float *sin_t, const int64_t *positions,
                    float *q, float *k, float *v, int num_threads) {
    float *h = malloc(sizeof(float) * (size_t)(T * C));
    qscratch *team = qscratch_team(num_threads, qscratch_for_products(C));
    qact a = {0};
    int rc = -1;
    if (!h || !team || qact_alloc(&a, T, C, wq->kind == QW_Q8T)) goto done;
    const qweight *const qkv[3] = {wq, wk, wv};
    float *const qkv_out[3] = {q, k, v};
    #pragma omp parallel num_threads(num_threads)
    {
        rows_norm_quantize(x, T, C, norm_w, eps, h, &a);
        qmatmul_many_for(&a, T, qkv, qkv_out, 3, team);
        QGEMM_FOR_ROWS(t, T, rope_row(q, k, t, heads, kv_heads, D, cos_t, sin_t, positions););
        qscratch_release(qscratch_mine(team));
    }
    rc = 0;
done:
    qact_free(&a); free(h);
    qscratch_team_free(team, num_threads);
    return rc;
}

/* After attention: h = x + attn Wo; out = h + Wdown(silu(Wgate n) * Wup n), n = RMSNorm(h), in one
 * parallel region. x, out [T, C]; attn [T, H*D]. */
int qgemm_layer_post(const float *x, const float *attn, int64_t T, int64_t C, const qweight *wo,
                     const float *norm_w, float eps, const qweight *wgate, const qweight *wup,
                     const qweight *wdown, float *out, int num_threads) {
    const int64_t I = wgate->n;
    float *o = malloc(sizeof(float) * (size_t)(T * C)), *n = malloc(sizeof(float) * (size_t)(T * C));
    float *g = malloc(sizeof(float) * (size_t)(T * I)), *u = malloc(sizeof(float) * (size_t)(T * I));
    const int64_t max_k = wo->k > I ? wo->k : I;
    qscratch *team = qscratch_team(num_threads, qscratch_for_products(max_k > C ? max_k : C));
    qact a = {0}, b = {0}, c = {0};
    int rc = -1;
    if (!o || !n || !g || !u || !team || qact_alloc(&a, T, wo->k, wo->kind == QW_Q8T) ||
        qact_alloc(&b, T, C, wgate->kind == QW_Q8T) || qact_alloc(&c, T, I, wdown->kind == QW_Q8T))
        goto done;
    const qweight *const gate_up[2] = {wgate, wup};
    float *const gate_up_out[2] = {g, u};
    #pragma omp parallel num_threads(num_threads)
    {
        qact_quantize_rows_for(&a, attn, T, wo->k);
        qmatmul_many_for(&a, T, &wo, &o, 1, team);
        rows_residual_norm_quantize(o, x, T, C, norm_w, eps, n, &b);               /* h = x + attn Wo */
        qmatmul_many_for(&b, T, gate_up, gate_up_out, 2, team);
        rows_silu_quantize(g, u, T, I, &c);
        qmatmul_many_for(&c, T, &wdown, &out, 1, team);
        QGEMM_FOR_ROWS(t, T, {
            for (int64_t j = t * C; j < (t + 1) * C; ++j) out[j] += o[j];
        });
        qscratch_release(qscratch_mine(team));
    }
    rc = 0;
done:
    qact_free(&a); qact_free(&b); qact_free(&c);
    free(o); free(n); free(g); free(u);
    qscratch_team_free(team, num_threads);
    return rc;
}
