/* qgemm_forward: every layer of a forward in ONE parallel region.
 *
 * Why: per layer the forward ran about 11 OpenMP regions (the products, attention, and from 8 rows
 * each row-wise loop), and allocated and freed its buffers in every layer call: 330 fork/joins and
 * a few hundred mallocs a 30-layer step, and below 8 rows the row-wise work on one thread. Here the
 * buffers are allocated once per forward (forward_ws), each thread's scratch once (qscratch), and
 * the threads stay in one region from the first layer to the last: the products, attention and the
 * row-wise phases are orphaned worksharing loops (gemm.c, attention.c, ops.c) separated by barriers
 * where the next phase reads what other threads wrote (a row needs all its columns; attention needs
 * every row's keys in the cache). Row-wise work that reads the same row is one phase: RoPE and the
 * KV-cache write; the residual, RMSNorm and quantization; SiLU and quantization; and a layer's last
 * residual with the next layer's RMSNorm and quantization.
 *
 * Same bits as the single-layer calls (qgemm_layer_pre, the cache write, qgemm_attention,
 * qgemm_layer_post): every element gets the same operations in the same order, whichever thread
 * computes it (tests/specdec/model/test_native_forward.py). */
#include "impl.h"

enum { ACT_X, ACT_ATTN, ACT_N, ACT_G, NUM_ACTS };   /* the four quantized inputs of a layer's products */

/* A forward's buffers, allocated once before its region. */
typedef struct {
    float *h;                /* [T, C] RMSNorm(x): the q/k/v products' input */
    float *q, *k, *v;        /* [T, H, D], [T, Hkv, D] x2 */
    float *attn;             /* [T, H * D]; rows outside every span stay 0 */
    float *o;                /* [T, C] attn Wo, then h = x + attn Wo */
    float *n;                /* [T, C] RMSNorm(h) */
    float *g, *u;            /* [T, I] gate and up, then silu(gate) * up in g */
    float *d;                /* [T, C] the down product */
    qact acts[NUM_ACTS][2];  /* each input quantized per block [0] or per token [1], where a layer needs it */
    int64_t *row_span;       /* [T] the span of each row, -1 for none */
    att_seq *seqs;           /* [layers][spans]: per layer the fp32-cache spans first, then the fp16 ones */
    int64_t num_seqs[2];     /* spans per cache type */
    att_plan plans[2];
    qscratch *team;
} forward_ws;

/* the activation of input `which` as layer `ly` quantizes it */
static qact *act_of(forward_ws *ws, int which, const qlayer *ly) {
    const qweight *w = which == ACT_X ? ly->q : which == ACT_ATTN ? ly->o : which == ACT_N ? ly->gate : ly->down;
    return &ws->acts[which][w->kind == QW_Q8T];
}

static void ws_free(forward_ws *ws, int num_threads) {
    free(ws->h); free(ws->q); free(ws->k); free(ws->v); free(ws->attn); free(ws->o); free(ws->n);
    free(ws->g); free(ws->u); free(ws->d); free(ws->row_span); free(ws->seqs);
    for (int i = 0; i < NUM_ACTS; ++i) { qact_free(&ws->acts[i][0]); qact_free(&ws->acts[i][1]); }
    att_plan_free(&ws->plans[0]); att_plan_free(&ws->plans[1]);
    qscratch_team_free(ws->team, num_threads);
}

/* the quantized inputs some layer reads, per format; -1 when out of memory */
static int ws_alloc_acts(forward_ws *ws, int64_t T, const qlayer *layers, int64_t num_layers, const int64_t *K) {
    for (int which = 0; which < NUM_ACTS; ++which) {
        int is_needed[2] = {0, 0};
        for (int64_t l = 0; l < num_layers; ++l) is_needed[act_of(ws, which, layers + l) - ws->acts[which]] = 1;
        for (int per_token = 0; per_token < 2; ++per_token)
            if (is_needed[per_token] && qact_alloc(&ws->acts[which][per_token], T, K[which], per_token)) return -1;
    }
    return 0;
}

/* every layer's attention batch: span rows' queries and outputs, layer l's caches, per cache type */
static int ws_plan_attention(forward_ws *ws, int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t num_layers,
                             const qspan *spans, int64_t num_spans, int num_threads) {
    for (int64_t t = 0; t < T; ++t) ws->row_span[t] = -1;
    for (int64_t l = 0; l < num_layers; ++l) {
        att_seq *seqs = ws->seqs + l * num_spans;
        int64_t num_seqs = 0;
        for (int half = 0; half < 2; ++half) {
            for (int64_t si = 0; si < num_spans; ++si) {
                const qspan *s = spans + si;
                if ((int)s->half != half) continue;
                const size_t offset = (size_t)(l * s->layer_stride) * (half ? sizeof(uint16_t) : sizeof(float));
                seqs[num_seqs++] = (att_seq){ws->q + s->start * H * D, ws->attn + s->start * H * D, s->n,
                                             s->num_cached + s->n, s->capacity, (char *)s->k_cache + offset,
                                             (char *)s->v_cache + offset, s->mask};
                if (l == 0) {
                    for (int64_t r = 0; r < s->n; ++r) ws->row_span[s->start + r] = si;
                    ++ws->num_seqs[half];
                }
            }
        }
    }
    for (int half = 0; half < 2; ++half)
        if (att_plan_init(&ws->plans[half], ws->seqs + (half ? ws->num_seqs[0] : 0), ws->num_seqs[half], H, Hkv,
                          num_threads))
            return -1;
    return 0;
}

static int ws_alloc(forward_ws *ws, int64_t T, int64_t C, const qlayer *layers, int64_t num_layers, int64_t H,
                    int64_t Hkv, int64_t D, const qspan *spans, int64_t num_spans, int num_threads) {
    const int64_t I = layers[0].gate->n, K[NUM_ACTS] = {C, H * D, C, I};
#define FLOATS(n) malloc(sizeof(float) * (size_t)(n))
    ws->h = FLOATS(T * C); ws->q = FLOATS(T * H * D); ws->k = FLOATS(T * Hkv * D); ws->v = FLOATS(T * Hkv * D);
    ws->attn = calloc((size_t)(T * H * D), sizeof(float));
    ws->o = FLOATS(T * C); ws->n = FLOATS(T * C); ws->g = FLOATS(T * I); ws->u = FLOATS(T * I); ws->d = FLOATS(T * C);
#undef FLOATS
    ws->row_span = malloc(sizeof(int64_t) * (size_t)(T ? T : 1));
    ws->seqs = malloc(sizeof(att_seq) * (size_t)(num_layers * num_spans + 1));
    if (!ws->h || !ws->q || !ws->k || !ws->v || !ws->attn || !ws->o || !ws->n || !ws->g || !ws->u || !ws->d ||
        !ws->row_span || !ws->seqs || ws_alloc_acts(ws, T, layers, num_layers, K) ||
        ws_plan_attention(ws, T, H, Hkv, D, num_layers, spans, num_spans, num_threads))
        return -1;
    int64_t max_k = 0;
    for (int i = 0; i < NUM_ACTS; ++i) max_k = K[i] > max_k ? K[i] : max_k;
    const att_plan *p = ws->plans;
    ws->team = qscratch_team(num_threads, (qscratch_size){max_k, p[0].chunk > p[1].chunk ? p[0].chunk : p[1].chunk,
                                                          p[0].max_L > p[1].max_L ? p[0].max_L : p[1].max_L, D});
    return ws->team ? 0 : -1;
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

/* row t's new keys and values into layer l's cache of its span (if any) */
static void store_row(const forward_ws *ws, const qspan *spans, int64_t l, int64_t t, int64_t Hkv, int64_t D) {
    if (ws->row_span[t] < 0) return;
    const qspan *s = spans + ws->row_span[t];
    const size_t elem = s->half ? sizeof(uint16_t) : sizeof(float);
    char *kc = (char *)s->k_cache + (size_t)(l * s->layer_stride) * elem;
    char *vc = (char *)s->v_cache + (size_t)(l * s->layer_stride) * elem;
    const int64_t r = t - s->start;
    for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t src = (t * Hkv + h) * D, dst = (h * s->capacity + s->num_cached + r) * D;
        store_kv(kc + dst * elem, ws->k + src, D, (int)s->half);
        store_kv(vc + dst * elem, ws->v + src, D, (int)s->half);
    }
}

/* Layer l on every thread of the region: x [T, C] in place. On entry ws->h and layer l's ACT_X
 * activation hold RMSNorm(x); on exit x is the layer's output and, but after the last layer, h and
 * layer l + 1's ACT_X hold its RMSNorm. Each phase ends at a barrier (its worksharing loop's). */
static void layer(forward_ws *ws, float *x, int64_t T, int64_t C, const qlayer *layers, int64_t l,
                  int64_t num_layers, int64_t H, int64_t Hkv, int64_t D, const float *cos_t, const float *sin_t,
                  const int64_t *positions, const qspan *spans, int64_t num_spans) {
    const qlayer *ly = layers + l;
    const int64_t I = ly->gate->n;
    const qweight *const qkv[3] = {ly->q, ly->k, ly->v}, *const gate_up[2] = {ly->gate, ly->up};
    float *const qkv_out[3] = {ws->q, ws->k, ws->v}, *const gate_up_out[2] = {ws->g, ws->u};
    qmatmul_many_for(act_of(ws, ACT_X, ly), T, qkv, qkv_out, 3, ws->team);
    QGEMM_PHASE_END(QGEMM_PART_PRODUCTS);
    QGEMM_FOR_ROWS(t, T, {
        rope_row(ws->q, ws->k, t, H, Hkv, D, cos_t, sin_t, positions);
        store_row(ws, spans, l, t, Hkv, D);
    });
    QGEMM_PHASE_END(QGEMM_PART_REST);
    const att_seq *seqs = ws->seqs + l * num_spans;
    for (int half = 0; half < 2; ++half)       /* no barrier between the two: disjoint rows */
        if (ws->num_seqs[half])
            attend_seqs_for(seqs + (half ? ws->num_seqs[0] : 0), ws->num_seqs[half], &ws->plans[half], H, Hkv, D,
                            half, ws->team);
    _Pragma("omp barrier")
    QGEMM_PHASE_END(QGEMM_PART_ATTENTION);
    qact_quantize_rows_for(act_of(ws, ACT_ATTN, ly), ws->attn, T, H * D);
    QGEMM_PHASE_END(QGEMM_PART_REST);
    qmatmul_many_for(act_of(ws, ACT_ATTN, ly), T, &ly->o, &ws->o, 1, ws->team);
    QGEMM_PHASE_END(QGEMM_PART_PRODUCTS);
    rows_residual_norm_quantize(ws->o, x, T, C, ly->norm2, ly->eps2, ws->n, act_of(ws, ACT_N, ly));
    QGEMM_PHASE_END(QGEMM_PART_REST);
    qmatmul_many_for(act_of(ws, ACT_N, ly), T, gate_up, gate_up_out, 2, ws->team);
    QGEMM_PHASE_END(QGEMM_PART_PRODUCTS);
    rows_silu_quantize(ws->g, ws->u, T, I, act_of(ws, ACT_G, ly));
    QGEMM_PHASE_END(QGEMM_PART_REST);
    qmatmul_many_for(act_of(ws, ACT_G, ly), T, &ly->down, &ws->d, 1, ws->team);
    QGEMM_PHASE_END(QGEMM_PART_PRODUCTS);
    const qlayer *next = l + 1 < num_layers ? ly + 1 : NULL;
    QGEMM_FOR_ROW_BLOCKS(t0, num_rows, T, {
        for (int64_t j = t0 * C; j < (t0 + num_rows) * C; ++j) x[j] = ws->d[j] + ws->o[j];  /* h + Wdown(...) */
        if (next) {
            qgemm_rmsnorm(x + t0 * C, num_rows, C, next->norm1, next->eps1, ws->h + t0 * C);
            for (int64_t t = t0; t < t0 + num_rows; ++t) qact_quantize_row(act_of(ws, ACT_X, next), ws->h + t * C, t, C);
        }
    });
    QGEMM_PHASE_END(QGEMM_PART_REST);
}

/* x [T, C] in place: every layer of `layers` in turn, each exactly as qgemm_layer_pre, the cache
 * write, qgemm_attention per span and qgemm_layer_post do it one call at a time (same bits). */
int qgemm_forward(float *x, int64_t T, int64_t C, const qlayer *layers, int64_t num_layers, int64_t H,
                  int64_t Hkv, int64_t D, const float *cos_t, const float *sin_t, const int64_t *positions,
                  const qspan *spans, int64_t num_spans, int num_threads) {
    if (num_layers <= 0) return 0;
    if (qgemm_is_profiling) qgemm_profile_begin();
    forward_ws ws;
    memset(&ws, 0, sizeof ws);
    int rc = ws_alloc(&ws, T, C, layers, num_layers, H, Hkv, D, spans, num_spans, num_threads);
    if (!rc) {
        #pragma omp parallel num_threads(num_threads)
        {
            rows_norm_quantize(x, T, C, layers[0].norm1, layers[0].eps1, ws.h, act_of(&ws, ACT_X, layers));
            QGEMM_PHASE_END(QGEMM_PART_REST);
            for (int64_t l = 0; l < num_layers; ++l)
                layer(&ws, x, T, C, layers, l, num_layers, H, Hkv, D, cos_t, sin_t, positions, spans, num_spans);
            qscratch_release(qscratch_mine(ws.team));
        }
    }
    ws_free(&ws, num_threads);
    if (qgemm_is_profiling) qgemm_profile_end();
    return rc;
}
