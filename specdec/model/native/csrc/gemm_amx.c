/* The 4-bit products on AMX int8 tiles (Intel Sapphire Rapids and later), beside the AVX-512 path.
 *
 * Same arithmetic, same bits (gemm.h): the tile multiply only computes each block's integer dot
 * products S, which are exact in any order; the rescale of every block is the AVX-512 path's, in
 * the same order. What changes is who computes S: TDPBSUD multiplies a tile of 16 activation rows
 * x one block (16 x 32 signed bytes, read straight from the quantized activation: xq's rows are the
 * A tile's rows) by the block's weights for 16 output columns (8 rows of 16 columns x 4 unsigned
 * bytes: the nibbles q in 0..15, unpacked once per call and group), giving S for 16 rows x 16
 * columns in one instruction where vpdpbusd needs 8 per row. Each block's 16 x 16 sums go through a
 * small ring of buffers (tile store, then vector loads two blocks later, so the loads never wait
 * on the store) into the rescale, while the next blocks' tiles multiply on alternating tile
 * registers (tiles are not renamed).
 *
 * (The 8-bit rows per token, QW_Q8T, are the exception: below.)
 *
 * What it gains is bounded: the rescale (a multiply and two FMAs per row, block and 16 columns) is
 * the AVX-512 path's own work, and a block's tile store costs about what 16 rows' vpdpbusd do. So
 * it pays only from a tile's worth of rows (gemm.c takes it from qgemm_set_amx's row count) and
 * only for the 4-bit layout: the 8-bit rows, whose AVX-512 step is one vpdpbusd per 4 inputs, ran
 * slower on tiles at every row count measured (docs/benchmarks.md, "AMX products"), so they stay
 * on AVX-512 and this loop refuses them.
 *
 * Tile state is per thread and torch's oneDNN may use tiles on the same OpenMP threads: each thread
 * loads this configuration before its first tile product of a parallel region (again only when the
 * other configuration, the per-token one, was loaded since) and releases the tiles at the region's
 * end (qscratch_release). The process
 * must have been granted the tile data state (ARCH_REQ_XCOMP_PERM, by the Python loader) before
 * any of this runs: qgemm_set_amx refuses to turn the path on otherwise.
 */
#include "gemm.h"

#if QGEMM_AMX
#include <sys/syscall.h>
#include <immintrin.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define XFEATURE_XTILEDATA 18
#define RING 4                 /* blocks' sums in flight */
_Static_assert(RING * 256 <= QGEMM_TILE_SUMS, "the ring lives in a thread's tile_sums");

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette_id, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tmm0, tmm1: sums C [16 rows x 16 int32]; tmm2, tmm3: activations A [16 rows x 32 bytes];
 * tmm4, tmm5: weights B [8 rows x 64 bytes]. Static: the whole 64 bytes are read by ldtilecfg. */
static const tile_config CONFIG = {
    .palette_id = 1,
    .colsb = {64, 64, QK, QK, 64, 64},
    .rows = {QGEMM_SLAB, QGEMM_SLAB, QGEMM_SLAB, QGEMM_SLAB, QK / 4, QK / 4},
};

int qgemm_amx_granted(void) {
    unsigned long bits = 0;
    return syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && (bits & (1ul << XFEATURE_XTILEDATA));
}

/* Block g's sums of slab rows [t0, t0 + 16) into ring slot g % RING: zero C, load A and B,
 * multiply, store; even blocks on tiles 0/2/4, odd ones on 1/3/5 (indices must be constants). */
#define TILE_BLOCK(ct, at, bt)                                     \
    do {                                                           \
        _tile_zero(ct);                                            \
        _tile_loadd(at, a->xq + t0 * K + g * QK, K);               \
        _tile_loadd(bt, b + g * 512, 64);                          \
        _tile_dpbsud(ct, at, bt);                                  \
        _tile_stored(ct, ring + (g % RING) * 256, 64);             \
    } while (0)

/* b: block g's B tile at b + g * 512 (4-bit: unpacked nibbles) */
ALWAYS_INLINE void tile_block(const qact *a, int64_t t0, int64_t K, const uint8_t *b, int32_t *ring, int64_t g) {
    if (g & 1) TILE_BLOCK(1, 3, 5);
    else TILE_BLOCK(0, 2, 4);
}

/* the nibbles of one group's block (256 bytes) -> its B tile [8][64]: vector j's low nibbles are
 * weights 4j..4j+3 of each column (row j), its high nibbles weights 4j+16..4j+19 (row j + 4) */
ALWAYS_INLINE void unpack_q4_block(const uint8_t *nib, uint8_t *b) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512((const void *)(nib + j * 64));
        _mm512_storeu_si512((void *)(b + j * 64), _mm512_and_si512(v, low));
        _mm512_storeu_si512((void *)(b + (j + 4) * 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

/* rows [t0, t0 + R) of group v (R <= 16); b: the group's B tiles, block g at b + g * 512 */
ALWAYS_INLINE void q4_slab(const qweight *w, const qact *a, int64_t t0, int64_t v, const int R, const uint8_t *b,
                           int32_t *ring, float *out) {
    const int64_t K = w->k, G = K / QK, N = w->n;
    __m512 facc[QGEMM_SLAB];
    for (int r = 0; r < R; ++r) facc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G && g < 2; ++g) tile_block(a, t0, K, b, ring, g);
    for (int64_t g = 0; g < G; ++g) {
        if (g + 2 < G) tile_block(a, t0, K, b, ring, g + 2);
        const int32_t *S = ring + (g % RING) * 256;
        const int64_t s = (v * G + g) * NV;
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->d + s)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->m + s)));
        for (int r = 0; r < R; ++r) {
            const int64_t tg = (t0 + r) * G + g;
            const __m512 sc = _mm512_mul_ps(dv, _mm512_set1_ps(a->dx[tg]));
            facc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_load_si512(S + r * 16)), facc[r]);
            facc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a->sx[tg]), facc[r]);
        }
    }
    for (int r = 0; r < R; ++r) store16(out + (t0 + r) * N + v * NV, facc[r], (int)(N - v * NV));
}

/* group v of a 4-bit w for all T rows: its B tiles once, then whole slabs of 16 and the rest */
static void group_unit(const qweight *w, const qact *a, int64_t T, int64_t v, uint8_t *b, int32_t *ring, float *out) {
    const int64_t G = w->k / QK;
    for (int64_t g = 0; g < G; ++g) unpack_q4_block((const uint8_t *)w->w + (v * G + g) * 256, b + g * 512);
    int64_t t0 = 0;
    for (; t0 + QGEMM_SLAB <= T; t0 += QGEMM_SLAB) q4_slab(w, a, t0, v, QGEMM_SLAB, b, ring, out);
    if (t0 < T) q4_slab(w, a, t0, v, (int)(T - t0), b, ring, out);
}

/* ---- 8-bit rows per token: sums that stay in the tiles ----
 *
 * With one activation scale per row (qgemm.h, QW_Q8T) nothing is rescaled between blocks, so the
 * tiles accumulate a whole row's products: per 64 inputs, TDPBSUD multiplies the 16 x 64 halves h
 * (then l) of a slab of 16 rows by the B tile of a group's 16 columns x 64 inputs, which is the
 * 8-bit layout as stored (16 rows of 16 columns x 4 bytes, w + 128); two groups share each A tile.
 * At the end the four sums tiles are stored once and rescaled as the vector path does.
 *
 * Measured (docs/benchmarks.md, "AMX products"): a tile multiply alone runs at its 16 cycles, but in
 * the model a product's first slab costs several times that per multiply: software prefetch of the B
 * tiles (0-16 chunks ahead) and staging a unit's weights with vector loads changed nothing. */
static const tile_config CONFIG_TOKEN = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {QGEMM_SLAB, QGEMM_SLAB, QGEMM_SLAB, QGEMM_SLAB, QGEMM_SLAB, QGEMM_SLAB, 16, 16},
};
#define TOKEN_CHUNK 64         /* inputs per tile multiply */

/* rows [t0, t0 + R) of groups v, v + 1 (two: `pair`) of a QW_Q8T w; sums: 4 x 256 int32. The two
 * groups share each chunk's A tiles (tiles 4, 5), each has its B tile (6, 7) and two sums (0-3). */
ALWAYS_INLINE void q8t_slab(const qweight *w, const qact *a, int64_t t0, int64_t v, const int pair, const int R,
                            int32_t *sums, float *out) {
    const int64_t K = w->k, N = w->n;
    const uint8_t *b0 = (const uint8_t *)w->w + v * (K / 4) * 64, *b1 = b0 + (K / 4) * 64;
    _tile_zero(0); _tile_zero(1);
    if (pair) { _tile_zero(2); _tile_zero(3); }
    for (int64_t i = 0; i < K; i += TOKEN_CHUNK) {
        _tile_loadd(4, a->xq + t0 * K + i, K);
        _tile_loadd(5, a->xl + t0 * K + i, K);
        _tile_loadd(6, b0 + i * 16, 64);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 5, 6);
        if (pair) {
            _tile_loadd(7, b1 + i * 16, 64);
            _tile_dpbsud(2, 4, 7);
            _tile_dpbsud(3, 5, 7);
        }
    }
    _tile_stored(0, sums, 64); _tile_stored(1, sums + 256, 64);
    if (pair) { _tile_stored(2, sums + 512, 64); _tile_stored(3, sums + 768, 64); }
    const __m512 k128 = _mm512_set1_ps(128.f);
    for (int c = 0; c <= pair; ++c) {
        const __m512 sc = _mm512_loadu_ps(w->scale + (v + c) * NV);
        const int32_t *H = sums + c * 512, *L = H + 256;
        for (int r = 0; r < R; ++r) {
            const int64_t t = t0 + r;
            const __m512i h = _mm512_sub_epi32(_mm512_load_si512(H + r * 16), _mm512_set1_epi32(128 * a->xs[2 * t]));
            const __m512i l = _mm512_sub_epi32(_mm512_load_si512(L + r * 16), _mm512_set1_epi32(128 * a->xs[2 * t + 1]));
            const __m512 q = _mm512_fmadd_ps(k128, _mm512_cvtepi32_ps(h), _mm512_cvtepi32_ps(l));
            const __m512 y = _mm512_mul_ps(sc, _mm512_mul_ps(_mm512_set1_ps(a->dx[t]), q));
            store16(out + t * N + (v + c) * NV, y, (int)(N - (v + c) * NV));
        }
    }
}

/* groups v (and v + 1 with `pair`) of a QW_Q8T w for all T rows, a slab of 16 at a time */
static void q8t_unit(const qweight *w, const qact *a, int64_t T, int64_t v, int pair, int32_t *sums, float *out) {
    for (int64_t t0 = 0; t0 < T; t0 += QGEMM_SLAB) {
        const int R = (int)(T - t0 < QGEMM_SLAB ? T - t0 : QGEMM_SLAB);
        if (pair) q8t_slab(w, a, t0, v, 1, R, sums, out);
        else q8t_slab(w, a, t0, v, 0, R, sums, out);
    }
}

/* this thread's tiles configured as `config` (ldtilecfg zeroes the tiles, so only on a change) */
static void use_config(qscratch *mine, const tile_config *config) {
    if (mine->tile_config == config) return;
    _tile_loadconfig(config);
    mine->tile_config = config;
}

int qgemm_amx_takes(const qweight *const *ws, int count) {
    if (!count) return 0;
    const int kind = ws[0]->kind;
    for (int i = 0; i < count; ++i) {
        if (ws[i]->kind != kind || (kind != QW_Q4 && kind != QW_Q8T)) return 0;
        if (kind == QW_Q8T && ws[i]->k % TOKEN_CHUNK) return 0;
    }
    return 1;
}

/* QW_Q8T products on tiles: units of two groups (the last of a product may be one) */
static void matmul_many_token_for(const qact *a, int64_t T, const qweight *const *ws, float *const *outs, int count,
                                  qscratch *mine) {
    int64_t total = 0;
    for (int i = 0; i < count; ++i) total += (qgemm_groups_of(ws[i]) + 1) / 2;
    use_config(mine, &CONFIG_TOKEN);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < total; ++u) {
        int i = 0;
        int64_t p = u;
        while (p >= (qgemm_groups_of(ws[i]) + 1) / 2) p -= (qgemm_groups_of(ws[i++]) + 1) / 2;
        const int64_t v = 2 * p;
        const int pair = v + 1 < qgemm_groups_of(ws[i]);
        q8t_unit(ws[i], a, T, v, pair, mine->tile_sums, outs[i]);
        qgemm_add_bias(ws[i], T, v, 1 + pair, outs[i]);
    }
}

void qgemm_matmul_many_amx_for(const qact *a, int64_t T, const qweight *const *ws, float *const *outs, int count,
                               qscratch *mine) {
    if (ws[0]->kind == QW_Q8T) {
        matmul_many_token_for(a, T, ws, outs, count, mine);
        return;
    }
    int64_t total = 0;
    for (int i = 0; i < count; ++i) total += qgemm_groups_of(ws[i]);
    use_config(mine, &CONFIG);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < total; ++u) {
        int i = 0;
        int64_t v = u;
        while (v >= qgemm_groups_of(ws[i])) v -= qgemm_groups_of(ws[i++]);
        group_unit(ws[i], a, T, v, mine->tile_b, mine->tile_sums, outs[i]);
        qgemm_add_bias(ws[i], T, v, 1, outs[i]);
    }
}
#endif
