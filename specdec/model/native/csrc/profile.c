/* The forward's timer: seconds of qgemm_forward spent in the products, in attention and in the rest
 * (norms, quantization, RoPE, the KV write, SiLU, residuals, and the waits between them), summed
 * over calls, so a benchmark can split a step's time without timing a different, unfused path.
 *
 * Off unless qgemm_set_profile(1) (the Python loader does so under SPECDEC_NATIVE_PROFILE=1): each
 * phase boundary then costs one predictable branch. On, the thread that runs the forward's serial
 * parts reads the clock at each boundary (after the barrier that ends a phase), so a phase's time
 * includes the wait for its slowest thread. Meant for one forward at a time, as the engine runs them. */
#include <time.h>

#include "impl.h"

int qgemm_is_profiling;

static int is_active;              /* inside a forward: marks outside one (qgemm_linear) do not count */
static double last_mark;
static double seconds[QGEMM_NUM_PARTS];
static int64_t num_forwards;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void qgemm_set_profile(int on) { qgemm_is_profiling = on != 0; }

int64_t qgemm_profile(double *out) {
    for (int i = 0; i < QGEMM_NUM_PARTS; ++i) out[i] = seconds[i];
    return num_forwards;
}

void qgemm_profile_reset(void) {
    memset(seconds, 0, sizeof seconds);
    num_forwards = 0;
}

void qgemm_profile_begin(void) {
    is_active = 1;
    last_mark = now();
}

void qgemm_profile_mark(int part) {
    if (!is_active) return;
    const double t = now();
    seconds[part] += t - last_mark;
    last_mark = t;
}

void qgemm_profile_end(void) {
    qgemm_profile_mark(QGEMM_PART_REST);
    is_active = 0;
    ++num_forwards;
}
