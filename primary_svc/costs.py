"""Measure what a verify of k nodes costs on this machine, for the gateway's cost model."""

from __future__ import annotations

import time

from specdec.engine.engine import Engine

COST_NODE_COUNTS = (1, 2, 4, 8, 16, 32)
COST_CONTEXT_TOKENS = 128
_REQUEST_ID = "__verify_cost_probe__"


def measure_verify_costs(
    engine: Engine,
    repeats: int = 3,
    node_counts: tuple[int, ...] = COST_NODE_COUNTS,
    context_tokens: int = COST_CONTEXT_TOKENS,
) -> dict[int, float]:
    """Fastest of `repeats` verifies of k rows (root + k-1 chained drafts) after a short context, in ms.

    The minimum, not the median: on a shared machine noise only ever adds time, and the
    controller needs the ratio between sizes, which a noisy sample distorts most.
    """
    vocab = engine.vocab_size
    engine.open(_REQUEST_ID, [i % vocab for i in range(1000, 1000 + context_tokens)])
    try:
        engine.prefill(_REQUEST_ID)
        engine.verify(_REQUEST_ID, (), ())  # warm-up
        engine.commit(_REQUEST_ID, (), (7,))
        costs = {}
        for k in node_counts:
            times = []
            for r in range(repeats + 1):  # the first run of a shape warms its kernels up
                drafts = [(2000 + j) % vocab for j in range(k - 1)]
                start = time.perf_counter()
                engine.verify(_REQUEST_ID, drafts, [-1] + list(range(k - 2)) if drafts else [])
                if r:
                    times.append((time.perf_counter() - start) * 1000)
                engine.commit(_REQUEST_ID, (), (7,))
            costs[k] = min(times)
        return costs
    finally:
        engine.release(_REQUEST_ID)
