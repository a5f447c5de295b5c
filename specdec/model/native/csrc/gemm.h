/* The product paths' contract: the packed weight layouts every path reads, the arithmetic every
 * path does (so all give the same bits), and what an instruction-set file defines for gemm.c.
 *
 * Layouts (packed once at load, `specdec/model/native/__init__.py`; nv = ceil(n / 16) groups of 16
 * output columns, the last one padded with zero weights; G = k / 32 blocks):
 *   4-bit: nibbles [nv][G][4][64]: vector j of block g holds, for each column c of the group, the
 *          4 weights 4j..4j+3 of the block in the low nibbles of bytes 4c..4c+3 and the weights
 *          4j+16..4j+19 in their high nibbles; d, m fp16 [nv][G][16] (the file's own, unrounded).
 *   8-bit: uint8 [nv][k/4][16][4]: for each 4 inputs, the 16 columns' 4 weights side by side,
 *          each stored as w + 128 (w ^ 0x80); scale fp32 [nv * 16].
 * One 32-bit lane of a vector is one output column, so a dot-product instruction (vpdpbusd, or
 * maddubs + madd) adds 4 products to each of 16 (8) columns' integer sums, against 4 activation
 * bytes broadcast. After a block's 8 steps the lane holds the block's whole integer dot product S,
 * and every path, whatever its width, then does per output element, blocks in order:
 *     4-bit: acc = fma(d * dx, (float)S, acc); acc = fma(m, sx, acc)      out = acc
 *     8-bit: acc = fma(dx, (float)S, acc)                                  out = scale * acc
 * The 8-bit rows per token (QW_Q8T) have no blocks: the integer sums H = w . h and L = w . l run over
 * the whole row (|H|, |L| < 2^25: no overflow), then out = scale * (dx * fma(128, (float)H, (float)L)).
 * So AVX-512, AVX2 (with or without VNNI) and the portable loops give the same bits, and a row's
 * result does not depend on the other rows of the call. The 8-bit AVX-512 path multiplies the
 * stored w + 128 (vpdpbusd's unsigned operand) by x and starts each block's sum at -128 * sum(x),
 * which takes the 128 * sum(x) back out exactly; the AVX2 path multiplies |w| by x with w's sign
 * (maddubs pairs stay below 2 * 127 * 127, no saturation).
 * Registers hold a tile of R rows x C vectors of columns; a thread takes a unit of columns (groups
 * of 16, the path's unit_groups) and walks all rows through it, so the unit's weights stay in L1/L2.
 *
 * ---- adding an instruction set ----
 *
 * A path lives in a file of its own, gemm_<isa>.c, whose whole body sits under `#if` of the macro
 * that enables it (impl.h detects the ISA from the compiler's predefined macros), so the file
 * compiles to nothing elsewhere. It defines the two functions below, with its tile functions
 * ALWAYS_INLINE in the same file and called through TILES with compile-time R and C (the loops
 * must unroll around registers; a tile called out of line is several times slower):
 *
 *   qgemm_product_unit_<isa>(w, a, T, v0, C, out)
 *       groups [v0, v0 + C) of w's output columns (the last group may be partial: w->n), for all
 *       T rows of a, into out [T, w->n]; C <= what qgemm_unit_groups_<isa> returned.
 *   qgemm_unit_groups_<isa>(num_groups, num_threads)
 *       how many groups a thread takes at a time, given the groups of one parallel loop.
 *
 * then declares them below and takes its place in the fallback map at the top of gemm.c. If it
 * reads each block's integer activation sum, QGEMM_ACT_SUMS (impl.h) must include it. Every path
 * must reproduce the per-element arithmetic above exactly: tests compare every variant's bits
 * with the portable build's.
 */
#ifndef QGEMM_GEMM_H
#define QGEMM_GEMM_H

#include "impl.h"

/* groups [v0, v0 + C) of `w` for all T rows, ROWS rows at a time, then 2, then 1 (C and R
 * compile-time at each call); in scope: w, a, T, v0, out */
#define TILES(fn, C, ROWS)                                                          \
    do {                                                                            \
        int64_t t = 0;                                                              \
        for (; t + ROWS <= T; t += ROWS) fn(w, a, t, v0, ROWS, C, out, w->n);       \
        if (ROWS > 2 && t + 2 <= T) { fn(w, a, t, v0, 2, C, out, w->n); t += 2; }   \
        for (; t < T; ++t) fn(w, a, t, v0, 1, C, out, w->n);                        \
    } while (0)

/* A product unit's whole body for a path whose tiles hold up to UNIT (4) groups: the tile of w's
 * kind, with C (1, 2, 3 or UNIT groups, in scope) a compile-time constant at each call */
#define TILES_BY_KIND(q4_tile, q8_tile, q8t_tile, UNIT, ROWS)                       \
    do {                                                                            \
        if (w->kind == QW_Q4) TILES_UP_TO(q4_tile, UNIT, ROWS);                     \
        else if (w->kind == QW_Q8T) TILES_UP_TO(q8t_tile, UNIT, ROWS);              \
        else TILES_UP_TO(q8_tile, UNIT, ROWS);                                      \
    } while (0)
#define TILES_UP_TO(fn, UNIT, ROWS)                                                 \
    do {                                                                            \
        switch (C) {                                                                \
            case 1: TILES(fn, 1, ROWS); break;                                      \
            case 2: TILES(fn, 2, ROWS); break;                                      \
            case 3: TILES(fn, 3, ROWS); break;                                      \
            default: TILES(fn, UNIT, ROWS); break;                                  \
        }                                                                           \
    } while (0)

static inline int64_t qgemm_groups_of(const qweight *w) { return (w->n + NV - 1) / NV; }

/* the bias of w over groups [v0, v0 + C) of every row of out [T, w.n], once those columns' products
 * are done: the one addition per element the product ends with, whoever computed the unit */
static inline void qgemm_add_bias(const qweight *w, int64_t T, int64_t v0, int64_t C, float *out) {
    if (!w->bias) return;
    const int64_t c1 = (v0 + C) * NV < w->n ? (v0 + C) * NV : w->n;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = v0 * NV; j < c1; ++j) out[t * w->n + j] += w->bias[j];
}

#if QGEMM_AVX512
/* columns [16 v, 16 v + 16) of out, the first `cols` of them (16 but in the last group) */
ALWAYS_INLINE void store16(float *out, __m512 v, int cols) {
    if (cols >= NV) _mm512_storeu_ps(out, v);
    else _mm512_mask_storeu_ps(out, (__mmask16)((1u << cols) - 1), v);
}
#endif

/* gemm_generic.c: the portable reference, compiled on every build */
QGEMM_HIDDEN void qgemm_product_unit_generic(const qweight *w, const qact *a, int64_t T, int64_t v0, int C,
                                             float *out);
QGEMM_HIDDEN int64_t qgemm_unit_groups_generic(int64_t num_groups, int num_threads);

#if QGEMM_AVX512   /* gemm_avx512.c */
QGEMM_HIDDEN void qgemm_product_unit_avx512(const qweight *w, const qact *a, int64_t T, int64_t v0, int C,
                                            float *out);
QGEMM_HIDDEN int64_t qgemm_unit_groups_avx512(int64_t num_groups, int num_threads);
#endif

#if QGEMM_AMX   /* gemm_amx.c: not a product_unit, a whole worksharing loop (tile config per thread) */
/* whether the tile loop takes these products: all 4-bit, or all per-token 8-bit of whole 64-input
 * chunks (the per-block 8-bit rows stay on AVX-512) */
QGEMM_HIDDEN int qgemm_amx_takes(const qweight *const *ws, int count);
/* qmatmul_many_for on AMX tiles, for products qgemm_amx_takes; `mine`: the calling thread's scratch,
 * whose tile configuration it loads if another is loaded (qscratch_release at the region's end) */
QGEMM_HIDDEN void qgemm_matmul_many_amx_for(const qact *a, int64_t T, const qweight *const *ws, float *const *outs,
                                            int count, qscratch *mine);
/* whether this process was granted the tile data state (ARCH_REQ_XCOMP_PERM) */
QGEMM_HIDDEN int qgemm_amx_granted(void);
#endif

#if QGEMM_AVX2 && !QGEMM_AVX512   /* gemm_avx2.c */
QGEMM_HIDDEN void qgemm_product_unit_avx2(const qweight *w, const qact *a, int64_t T, int64_t v0, int C,
                                          float *out);
QGEMM_HIDDEN int64_t qgemm_unit_groups_avx2(int64_t num_groups, int num_threads);
#endif

#endif
