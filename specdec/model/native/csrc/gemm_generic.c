/* The portable reference products: the per-element arithmetic of gemm.h in plain C, column by
 * column. The path of builds without a vector path, and compiled on every build. */
#include "gemm.h"

#define UNIT 4           /* groups of 16 columns a thread takes at a time */
#define TILE_ROWS 1

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

/* per token: the two halves' integer dot products over the whole row, one rescale (qgemm.h) */
static void q8t_tile(const qweight *w, const qact *a, int64_t t0, int64_t v0, const int R, const int C, float *out,
                     int64_t N) {
    const int64_t K = w->k;
    const uint8_t *wp = (const uint8_t *)w->w;
    for (int r = 0; r < R; ++r)
        for (int64_t n = v0 * NV; n < (v0 + C) * NV && n < N; ++n) {
            const int64_t v = n / NV, c = n % NV;
            const int8_t *h = a->xq + (t0 + r) * K, *l = a->xl + (t0 + r) * K;
            int32_t H = 0, L = 0;
            for (int64_t i = 0; i < K; ++i) {
                const int32_t wi = (int8_t)(wp[((v * (K / 4) + i / 4) * NV + c) * 4 + i % 4] ^ 0x80);
                H += wi * h[i];
                L += wi * l[i];
            }
            out[(t0 + r) * N + n] = w->scale[n] * (a->dx[t0 + r] * fmaf(128.f, (float)H, (float)L));
        }
}

void qgemm_product_unit_generic(const qweight *w, const qact *a, int64_t T, int64_t v0, int C, float *out) {
    if (w->kind == QW_Q4) {
        switch (C) {
            case 1: TILES(q4_tile, 1, TILE_ROWS); break;
            case 2: TILES(q4_tile, 2, TILE_ROWS); break;
            case 3: TILES(q4_tile, 3, TILE_ROWS); break;
            default: TILES(q4_tile, UNIT, TILE_ROWS); break;
        }
    } else if (w->kind == QW_Q8T) {
        switch (C) {
            case 1: TILES(q8t_tile, 1, TILE_ROWS); break;
            case 2: TILES(q8t_tile, 2, TILE_ROWS); break;
            case 3: TILES(q8t_tile, 3, TILE_ROWS); break;
            default: TILES(q8t_tile, UNIT, TILE_ROWS); break;
        }
    } else {
        switch (C) {
            case 1: TILES(q8_tile, 1, TILE_ROWS); break;
            case 2: TILES(q8_tile, 2, TILE_ROWS); break;
            case 3: TILES(q8_tile, 3, TILE_ROWS); break;
            default: TILES(q8_tile, UNIT, TILE_ROWS); break;
        }
    }
}

int64_t qgemm_unit_groups_generic(int64_t num_groups, int num_threads) {
    (void)num_groups, (void)num_threads;
    return UNIT;
}
