/* The quantized products: one worksharing loop over units of output columns, run by the threads of
 * the caller's parallel region (qmatmul_many_for), each unit computed by the one product path this
 * build runs on (gemm.h describes the paths' contract).
 *
 * Threads: OpenMP, sharing the process's runtime (torch's libgomp is loaded first and has the
 * same soname), over units of output columns handed out dynamically: the service's other processes
 * share these cores, and with a static split every parallel region waits for the thread that lost
 * its core; dynamically the thread that runs takes the rest. The split never changes an element's
 * arithmetic.
 */
#include <omp.h>

#include "gemm.h"

/* ---- the fallback map: the widest path this build enables ----
 *
 *   AMX-TILE + AMX-INT8 (with AVX-512 + VNNI)        gemm_amx.c       4-bit products from
 *                                                                     qgemm_set_amx's row count, once
 *                                                                     the OS grants the tiles; the
 *                                                                     rest: the AVX-512 path
 *   AVX-512 F/BW/DQ + VNNI (with AVX2, FMA, F16C)    gemm_avx512.c    "AVX512+VNNI"
 *   AVX2 + FMA + F16C, and AVX-VNNI or AVX-512 VL    gemm_avx2.c      "AVX2+VNNI"
 *   AVX2 + FMA + F16C                                gemm_avx2.c      "AVX2"
 *   anything else                                    gemm_generic.c   "portable"
 *
 * A new path (see gemm.h) takes its line here, above the paths it supersedes.
 */
#if QGEMM_AVX512
#define product_unit qgemm_product_unit_avx512
#define unit_groups qgemm_unit_groups_avx512
#define QGEMM_PATH "AVX512+VNNI"
#elif QGEMM_AVX2
#define product_unit qgemm_product_unit_avx2
#define unit_groups qgemm_unit_groups_avx2
#define QGEMM_PATH (QGEMM_DP8_VNNI ? "AVX2+VNNI" : "AVX2")
#else
#define product_unit qgemm_product_unit_generic
#define unit_groups qgemm_unit_groups_generic
#define QGEMM_PATH "portable"
#endif

/* the instruction path the products run on, for logs and benchmark headers */
const char *qgemm_isa(void) { return QGEMM_PATH; }

#define groups_of qgemm_groups_of

/* Calls of at least this many rows run on AMX tiles; 0: never (not built, not granted, or off).
 * Process-wide, as the tile permission is; set once at load (qgemm_set_amx). */
static int64_t amx_min_rows;

/* Per-token 8-bit products (QW_Q8T) keep their sums in the tiles, so they pay on tiles from fewer
 * rows than the 4-bit ones: from min(qgemm_set_amx's count, this) rows (docs/benchmarks.md, "AMX
 * products"). */
#define AMX_TOKEN_MIN_ROWS 8
static int64_t amx_token_min_rows;

int64_t qgemm_set_amx(int64_t min_rows) {
#if QGEMM_AMX
    amx_min_rows = min_rows > 0 && qgemm_amx_granted() ? min_rows : 0;
#else
    (void)min_rows;
#endif
    amx_token_min_rows = amx_min_rows < AMX_TOKEN_MIN_ROWS ? amx_min_rows : AMX_TOKEN_MIN_ROWS;
    return amx_min_rows;
}

int64_t qgemm_amx_min_rows(void) { return amx_min_rows; }

int64_t qgemm_amx_token_min_rows(void) { return amx_token_min_rows; }

/* whether a call of T rows of this kind of activation runs on AMX tiles */
static int on_amx(int64_t T, int per_token) {
    const int64_t from = per_token ? amx_token_min_rows : amx_min_rows;
    return from && T >= from;
}

int64_t qgemm_act_rows(int64_t T, int per_token) {
    return on_amx(T, per_token) ? (T + QGEMM_SLAB - 1) / QGEMM_SLAB * QGEMM_SLAB : T;
}

int qgemm_amx_built(void) { return QGEMM_AMX; }


/* outs[i] [T, ws[i].n] = a @ ws[i]^T (+ bias) for `count` products of one activation, in ONE
 * worksharing loop over all their units of columns (one barrier instead of `count`); every
 * element is computed as by the single product, and each unit adds its columns' bias. */
void qmatmul_many_for(const qact *a, int64_t T, const qweight *const *ws, float *const *outs, int count,
                      qscratch *team) {
#if QGEMM_AMX
    if (on_amx(T, a->per_token) && qgemm_amx_takes(ws, count)) {
        qgemm_matmul_many_amx_for(a, T, ws, outs, count, qscratch_mine(team));
        return;
    }
#else
    (void)team;
#endif
    int64_t num_groups = 0, total = 0;
    for (int i = 0; i < count; ++i) num_groups += groups_of(ws[i]);
    const int64_t unit = unit_groups(num_groups, omp_get_num_threads());
    for (int i = 0; i < count; ++i) total += (groups_of(ws[i]) + unit - 1) / unit;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < total; ++u) {
        int i = 0;
        int64_t k = u;
        while (k >= (groups_of(ws[i]) + unit - 1) / unit) k -= (groups_of(ws[i++]) + unit - 1) / unit;
        const qweight *w = ws[i];
        const int64_t nv = groups_of(w), v0 = k * unit, c = nv - v0 < unit ? nv - v0 : unit;
        product_unit(w, a, T, v0, (int)c, outs[i]);
        qgemm_add_bias(w, T, v0, c, outs[i]);
    }
}

/* out [T, w.n] = x [T, w.k] @ w^T (+ bias): the rows quantized, then the product, in one region */
int qgemm_linear(const float *x, int64_t T, const qweight *w, float *out, int num_threads) {
    qact a;
    qscratch *team = qscratch_team(num_threads, qscratch_for_products(w->k));
    if (!team || qact_alloc(&a, T, w->k, w->kind == QW_Q8T)) {
        if (team) qact_free(&a);
        qscratch_team_free(team, num_threads);
        return -1;
    }
    #pragma omp parallel num_threads(num_threads)
    {
        qact_quantize_rows_for(&a, x, T, w->k);
        qmatmul_many_for(&a, T, &w, &out, 1, team);
        qscratch_release(qscratch_mine(team));
    }
    qact_free(&a);
    qscratch_team_free(team, num_threads);
    return 0;
}
