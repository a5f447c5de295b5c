/* The portable reference products: the per-element arithmetic of gemm.h in plain C, column by
 * column. The path of builds without a vector path, and compiled on every build. */
#include "gemm.h"

#define UNIT 4           /* groups of 16 columns a thread takes at a time */
#define TILE_ROWS 1

/* Each output element alone, as gemm.h's arithmetic states it: out[t, n] for row t and column n. */

ALWAYS_INLINE float q4_element(const qweight *w, const qact *a, int64_t t, int64_t n) {
    const int64_t K = w->k, G = K / QK, v = n / NV, c = n % NV;
    const uint8_t *nib = (const uint8_t *)w->w;
    float acc = 0.f;
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t *blk = nib + (v * G + g) * 256;
        const int8_t *x = a->xq + t * K + g * QK;
        int32_t s = 0;
        for (int j = 0; j < 4; ++j)
            for (int b = 0; b < 4; ++b) {
                const uint8_t byte = blk[j * 64 + c * 4 + b];
                s += (byte & 0x0F) * x[4 * j + b] + (byte >> 4) * x[4 * j + 16 + b];
            }
        acc = fmaf(fp16_to_fp32(w->d[(v * G + g) * NV + c]) * a->dx[t * G + g], (float)s, acc);
        acc = fmaf(fp16_to_fp32(w->m[(v * G + g) * NV + c]), a->sx[t * G + g], acc);
    }
    return acc;
}

ALWAYS_INLINE float q8_element(const qweight *w, const qact *a, int64_t t, int64_t n) {
    const int64_t K = w->k, G = K / QK, v = n / NV, c = n % NV;
    const uint8_t *wp = (const uint8_t *)w->w;
    float acc = 0.f;
    for (int64_t g = 0; g < G; ++g) {
        const int8_t *x = a->xq + t * K + g * QK;
        int32_t s = 0;
        for (int j = 0; j < 8; ++j)
            for (int b = 0; b < 4; ++b)
                s += (int8_t)(wp[((v * (K / 4) + g * 8 + j) * NV + c) * 4 + b] ^ 0x80) * x[4 * j + b];
        acc = fmaf(a->dx[t * G + g], (float)s, acc);
    }
    return w->scale[n] * acc;
}

/* per token: the two halves' integer dot products over the whole row, one rescale (qgemm.h) */
ALWAYS_INLINE float q8t_element(const qweight *w, const qact *a, int64_t t, int64_t n) {
    const int64_t K = w->k, v = n / NV, c = n % NV;
    const uint8_t *wp = (const uint8_t *)w->w;
    const int8_t *h = a->xq + t * K, *l = a->xl + t * K;
    int32_t H = 0, L = 0;
    for (int64_t i = 0; i < K; ++i) {
        const int32_t wi = (int8_t)(wp[((v * (K / 4) + i / 4) * NV + c) * 4 + i % 4] ^ 0x80);
        H += wi * h[i];
        L += wi * l[i];
    }
    return w->scale[n] * (a->dx[t] * fmaf(128.f, (float)H, (float)L));
}

/* a tile in TILES' signature: rows [t0, t0 + R) x the columns of groups [v0, v0 + C), element by
 * element (the last group may be partial: n < N) */
#define ELEMENT_TILE(name, element)                                                                 \
    static void name(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C, \
                     float *out, int64_t N) {                                                        \
        for (int r = 0; r < R; ++r)                                                                 \
            for (int64_t n = v0 * NV; n < (v0 + C) * NV && n < N; ++n)                              \
                out[(t0 + r) * N + n] = element(w, a, t0 + r, n);                                   \
    }
ELEMENT_TILE(q4_tile, q4_element)
ELEMENT_TILE(q8_tile, q8_element)
ELEMENT_TILE(q8t_tile, q8t_element)

void qgemm_product_unit_generic(const qweight *w, const qact *a, int64_t T, int64_t v0, int C, float *out) {
    TILES_BY_KIND(q4_tile, q8_tile, q8t_tile, UNIT, TILE_ROWS);
}

int64_t qgemm_unit_groups_generic(int64_t num_groups, int num_threads) {
    (void)num_groups, (void)num_threads;
    return UNIT;
}
