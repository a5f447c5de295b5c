/* Logits post-processing on the primary's engine thread (specdec/logits_codec.py) and the
 * validator's fp8 row statistics (validator_svc/fp8_stats.py): argmax rows (over a grammar mask's
 * allowed tokens too), e4m3 encoding, byte histograms. */
#include "impl.h"

/* Each row's maximum and minimum, and whether it holds a NaN (max/min comparisons skip NaNs). */
static void row_max_min(const float *x, int64_t V, float *mx, float *mn, int *has_nan) {
    int64_t i = 0;
    float hi = -INFINITY, lo = INFINITY;
    int nan = 0;
#if QGEMM_AVX2
    __m256 vhi = _mm256_set1_ps(-INFINITY), vlo = _mm256_set1_ps(INFINITY), vnan = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        vhi = _mm256_max_ps(vhi, v);
        vlo = _mm256_min_ps(vlo, v);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float h[8], l[8];
    _mm256_storeu_ps(h, vhi); _mm256_storeu_ps(l, vlo);
    for (int j = 0; j < 8; ++j) { hi = h[j] > hi ? h[j] : hi; lo = l[j] < lo ? l[j] : lo; }
    nan = _mm256_movemask_ps(vnan) != 0;
#endif
    for (; i < V; ++i) {
        const float v = x[i];
        if (v != v) nan = 1;
        hi = v > hi ? v : hi;
        lo = v < lo ? v : lo;
    }
    *mx = hi; *mn = lo; *has_nan = nan;
}

/* The index of the first element of x [V] equal to m (present: it is the row's maximum). */
static int64_t first_equal(const float *x, int64_t V, float m) {
    int64_t i = 0;
#if QGEMM_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    for (; i + 8 <= V; i += 8) {
        const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
        if (bits) return i + __builtin_ctz((unsigned)bits);
    }
#endif
    for (; i < V; ++i)
        if (x[i] == m) return i;
    return -1;
}

/* argmax [R]: the index of the first maximum of each row of x [R, V], as torch.argmax chooses it;
 * -1 for a row holding a NaN (torch would pick the NaN: the caller asks torch for that row). */
void qgemm_argmax_rows(const float *x, int64_t R, int64_t V, int64_t *argmax) {
    for (int64_t r = 0; r < R; ++r) {
        float mx, mn; int nan;
        row_max_min(x + r * V, V, &mx, &mn, &nan);
        argmax[r] = nan ? -1 : first_equal(x + r * V, V, mx);
    }
}

/* The first maximum of row [V] over the positions mask [W] allows (bit j % 32 of mask[j / 32], bits
 * at or past V ignored), ascending: the lowest id among equal maxima, as torch.argmax of the allowed
 * tokens gathered in order picks it. -1 when an allowed position holds a NaN (torch would pick it:
 * the caller asks torch), -2 when the row allows nothing. A whole word of allowed positions is read
 * as a block: its maximum first, its first position of that maximum only when it beats the best. */
static int64_t masked_first_max(const float *row, int64_t V, const uint32_t *mask, int64_t W) {
    float best = -INFINITY;
    int64_t best_id = -2;
    for (int64_t w = 0; w < W && w * 32 < V; ++w) {
        uint32_t bits = mask[w];
        const int64_t base = w * 32;
        if (base + 32 > V) bits &= (UINT32_C(1) << (V - base)) - 1u;  /* a partial last word */
        if (bits == 0xFFFFFFFFu) {
            float mx, mn; int nan;
            row_max_min(row + base, 32, &mx, &mn, &nan);
            if (nan) return -1;
            if (best_id < 0 || mx > best) { best = mx; best_id = base + first_equal(row + base, 32, mx); }
            continue;
        }
        for (; bits; bits &= bits - 1u) {
            const int64_t i = base + __builtin_ctz(bits);
            const float v = row[i];
            if (v != v) return -1;
            if (best_id < 0 || v > best) { best = v; best_id = i; }
        }
    }
    return best_id;
}

/* argmax [R] of each row of x [R, V] among the positions row r allows (words [R, W], the grammar
 * mask's wire layout): the row's own first maximum when allowed (one bit test), else the allowed
 * positions' first maximum. -1 for a row whose allowed positions hold a NaN, -2 for a row that
 * allows nothing: the caller takes those rows itself. */
void qgemm_argmax_rows_masked(const float *x, int64_t R, int64_t V, const uint32_t *words, int64_t W,
                              int64_t *argmax) {
    for (int64_t r = 0; r < R; ++r) {
        const float *row = x + r * V;
        const uint32_t *mask = words + r * W;
        float mx, mn; int nan;
        row_max_min(row, V, &mx, &mn, &nan);
        if (!nan) {
            const int64_t a = first_equal(row, V, mx);
            if (a / 32 < W && (mask[a / 32] >> (a % 32)) & 1u) { argmax[r] = a; continue; }
        }
        argmax[r] = masked_first_max(row, V, mask, W);
    }
}

/* float -> e4m3fn byte for |f| <= 448 (the caller clamps): round to nearest even, exactly as
 * c10's fp8e4m3fn_from_fp32_value, which torch's .to(torch.float8_e4m3fn) uses. Branch-free, so
 * the loop below vectorizes. */
static inline uint8_t e4m3_from_fp32(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    float a; memcpy(&a, &b, 4);
    const float denorm = a + 16384.0f;                              /* 2^14: below 2^-6 the sum rounds to the code */
    uint32_t db; memcpy(&db, &denorm, 4);
    const uint32_t sub = db - (UINT32_C(141) << 23);
    const uint32_t nrm = (b + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
    const uint32_t code = b < (UINT32_C(121) << 23) ? sub : nrm;
    return (uint8_t)(code | (sign >> 24));
}

/* Logits x [R, V] -> e4m3fn codes [R, V] of (x - rowmax) / scale and scales [R], scale =
 * (rowmax - rowmin) / 448 (zero_scale where that is not > 0): the arithmetic of
 * specdec.logits_codec.encode_logits (max |x - rowmax| is rowmax - rowmin, rounded the same) in
 * one pass per row for the extremes and one to encode. Returns -1, having encoded nothing
 * further, at the first row that is not finite (a NaN or an infinity): the caller refuses it. */
int qgemm_encode_e4m3(const float *x, int64_t R, int64_t V, float zero_scale, uint8_t *codes, float *scales) {
    for (int64_t r = 0; r < R; ++r) {
        const float *row = x + r * V;
        float mx, mn; int nan;
        row_max_min(row, V, &mx, &mn, &nan);
        if (nan || !isfinite(mx) || !isfinite(mn)) return -1;
        float scale = (mx - mn) / 448.0f;
        if (!(scale > 0.0f)) scale = zero_scale;
        if (!isfinite(scale)) return -1;
        scales[r] = scale;
        uint8_t *out = codes + r * V;
        int64_t i = 0;
#if QGEMM_AVX2
        const __m256 vmx = _mm256_set1_ps(mx), vscale = _mm256_set1_ps(scale);
        const __m256 lo = _mm256_set1_ps(-448.0f), hi = _mm256_set1_ps(448.0f), two14 = _mm256_set1_ps(16384.0f);
        const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u), one = _mm256_set1_epi32(1);
        const __m256i denorm_bits = _mm256_set1_epi32(141 << 23), min_normal = _mm256_set1_epi32(121 << 23);
        const __m256i bias = _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFFu));
        for (; i + 8 <= V; i += 8) {              /* e4m3_from_fp32 on 8 lanes */
            __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmx), vscale);
            v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
            __m256i b = _mm256_castps_si256(v);
            const __m256i sign = _mm256_and_si256(b, sign_bit);
            b = _mm256_xor_si256(b, sign);
            const __m256i sub = _mm256_sub_epi32(
                _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(b), two14)), denorm_bits);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 20), one);
            const __m256i nrm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, bias), odd), 20);
            __m256i code = _mm256_blendv_epi8(nrm, sub, _mm256_cmpgt_epi32(min_normal, b));
            code = _mm256_or_si256(code, _mm256_srli_epi32(sign, 24));
            const __m256i w16 = _mm256_packus_epi32(code, code);     /* lanes hold 0..255 */
            const __m256i w8 = _mm256_packus_epi16(w16, w16);
            const int32_t low4 = _mm_cvtsi128_si32(_mm256_castsi256_si128(w8));
            const int32_t high4 = _mm_cvtsi128_si32(_mm256_extracti128_si256(w8, 1));
            memcpy(out + i, &low4, 4);
            memcpy(out + i + 4, &high4, 4);
        }
#endif
        for (; i < V; ++i) {
            float v = (row[i] - mx) / scale;
            v = v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v);
            out[i] = e4m3_from_fp32(v);
        }
    }
    return 0;
}

/* counts [R, 256]: how often each byte occurs in each row of codes [R, V] (the validator's row
 * statistics of fp8 logits: a row's 256 distinct values and their counts decide its max, its
 * log-sum-exp and its entropy). Four partial histograms so repeated bytes do not serialise. */
void qgemm_byte_histograms(const uint8_t *codes, int64_t R, int64_t V, uint32_t *counts) {
    for (int64_t r = 0; r < R; ++r) {
        const uint8_t *row = codes + r * V;
        uint32_t h[4][256];
        memset(h, 0, sizeof h);
        int64_t i = 0;
        for (; i + 4 <= V; i += 4) {
            ++h[0][row[i]]; ++h[1][row[i + 1]]; ++h[2][row[i + 2]]; ++h[3][row[i + 3]];
        }
        for (; i < V; ++i) ++h[0][row[i]];
        for (int c = 0; c < 256; ++c) counts[r * 256 + c] = h[0][c] + h[1][c] + h[2][c] + h[3][c];
    }
}

/* The same counts over the allowed positions only: row r allows position j when bit j % 32 of
 * words[r * W + j / 32] is set (the grammar mask's wire layout, int32 words, bit 0 first). */
void qgemm_byte_histograms_masked(const uint8_t *codes, int64_t R, int64_t V, const uint32_t *words, int64_t W,
                                  uint32_t *counts) {
    for (int64_t r = 0; r < R; ++r) {
        const uint8_t *row = codes + r * V;
        const uint32_t *mask = words + r * W;
        uint32_t h[4][256];
        memset(h, 0, sizeof h);
        for (int64_t w = 0; w < W && w * 32 < V; ++w) {
            uint32_t bits = mask[w];
            const int64_t base = w * 32;
            if (base + 32 > V) bits &= (UINT32_C(1) << (V - base)) - 1u;  /* a partial last word */
            if (bits == 0xFFFFFFFFu) {
                for (int k = 0; k < 32; k += 4) {
                    ++h[0][row[base + k]]; ++h[1][row[base + k + 1]]; ++h[2][row[base + k + 2]]; ++h[3][row[base + k + 3]];
                }
            } else {
                while (bits) {
                    ++h[0][row[base + __builtin_ctz(bits)]];
                    bits &= bits - 1u;
                }
            }
        }
        for (int c = 0; c < 256; ++c) counts[r * 256 + c] = h[0][c] + h[1][c] + h[2][c] + h[3][c];
    }
}
