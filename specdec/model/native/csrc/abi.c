/* The public structs' layout as this compiler laid them out, for the ctypes mirrors to check
 * themselves against at load (specdec/model/native/__init__.py): a field added, moved or retyped on
 * one side only would otherwise read the wrong bytes without a word.
 *
 * One list per struct names its fields; both exports below are generated from it, so a name and its
 * numbers cannot drift apart. A field added to a struct in qgemm.h belongs in its list here. */
#include <stddef.h>

#include "impl.h"

#define QWEIGHT_FIELDS(X) \
    X(qweight, kind) X(qweight, pad) X(qweight, w) X(qweight, scale) X(qweight, bias) X(qweight, n) \
    X(qweight, k) X(qweight, d) X(qweight, m)
#define QLAYER_FIELDS(X) \
    X(qlayer, norm1) X(qlayer, norm2) X(qlayer, eps1) X(qlayer, eps2) X(qlayer, q) X(qlayer, k) \
    X(qlayer, v) X(qlayer, o) X(qlayer, gate) X(qlayer, up) X(qlayer, down)
#define QSPAN_FIELDS(X) \
    X(qspan, start) X(qspan, n) X(qspan, num_cached) X(qspan, k_cache) X(qspan, v_cache) \
    X(qspan, layer_stride) X(qspan, capacity) X(qspan, mask) X(qspan, half)

#define NAME(type, field) " " #type "." #field
#define LAYOUT(type, field) offsetof(type, field), sizeof(((type *)0)->field),

static const char names[] = "qweight" QWEIGHT_FIELDS(NAME) " qlayer" QLAYER_FIELDS(NAME)
                            " qspan" QSPAN_FIELDS(NAME);

const char *qgemm_abi_names(void) { return names; }

int64_t qgemm_abi(int64_t *out, int64_t cap) {
    const int64_t layout[] = {
        0, sizeof(qweight), QWEIGHT_FIELDS(LAYOUT)
        0, sizeof(qlayer), QLAYER_FIELDS(LAYOUT)
        0, sizeof(qspan), QSPAN_FIELDS(LAYOUT)
    };
    const int64_t count = (int64_t)(sizeof layout / sizeof layout[0]);
    for (int64_t i = 0; i < count && i < cap; ++i) out[i] = layout[i];
    return count;
}
