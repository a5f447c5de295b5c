/* Each thread's scratch for one parallel region (impl.h, qscratch): allocated before the region,
 * one per thread it may run, so that nothing inside a region allocates, fails or frees, and a
 * whole forward's region reuses the same buffers in every layer. */
#include <omp.h>

#include "impl.h"

static void scratch_free(qscratch *s) {
    free(s->tile_b); free(s->tile_sums); free(s->att_s); free(s->att_keys); free(s->att_tmp); free(s->att_vf);
}

static int scratch_alloc(qscratch *s, qscratch_size size) {
    memset(s, 0, sizeof *s);
    /* 64-byte aligned: tile stores and 512-bit loads */
    s->tile_b = aligned_alloc(64, (size_t)((size.max_k / QK > 1 ? size.max_k / QK : 1) * 512));
    s->tile_sums = aligned_alloc(64, QGEMM_TILE_SUMS * sizeof(int32_t));
    if (!s->tile_b || !s->tile_sums) return -1;
    if (size.att_chunk == 0) return 0;
    s->att_s = malloc(sizeof(float) * (size_t)(size.att_chunk * size.att_max_L));
    s->att_keys = malloc(sizeof(int64_t) * (size_t)size.att_max_L);
    s->att_tmp = malloc(sizeof(float) * (size_t)size.att_max_L);
    s->att_vf = malloc(sizeof(float) * (size_t)(ATT_KEY_BLOCK * size.D));
    return s->att_s && s->att_keys && s->att_tmp && s->att_vf ? 0 : -1;
}

qscratch *qscratch_team(int num_threads, qscratch_size size) {
    const int n = num_threads > 0 ? num_threads : 1;
    qscratch *team = calloc((size_t)n, sizeof(qscratch));
    if (!team) return NULL;
    for (int i = 0; i < n; ++i) {
        if (scratch_alloc(team + i, size)) {
            qscratch_team_free(team, i + 1);
            return NULL;
        }
    }
    return team;
}

void qscratch_team_free(qscratch *team, int num_threads) {
    if (!team) return;
    for (int i = 0; i < (num_threads > 0 ? num_threads : 1); ++i) scratch_free(team + i);
    free(team);
}

qscratch *qscratch_mine(qscratch *team) { return team + omp_get_thread_num(); }

void qscratch_release(qscratch *s) {
#if QGEMM_AMX
    if (s->tile_config) _tile_release();
#endif
    s->tile_config = NULL;
}
