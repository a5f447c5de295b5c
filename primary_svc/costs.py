"""Measure what a verify of k nodes costs on this machine, for the gateway's cost model."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from specdec.engine.engine import Engine

COST_NODE_COUNTS = (1, 2, 4, 8, 16, 32)
COST_CONTEXT_TOKENS = 128
_REQUEST_ID = "__verify_cost_probe__"

_T = TypeVar("_T")


def verify_chain(engine: Engine, request_id: str, num_nodes: int) -> float:
    """One verify of `num_nodes` rows (the pending row + a chain of num_nodes - 1 drafts), in ms; then
    a token is committed, so that the next verify starts from the same pending row."""
    drafts = [(2000 + j) % engine.vocab_size for j in range(num_nodes - 1)]
    start = time.perf_counter()
    engine.verify(request_id, drafts, [-1] + list(range(num_nodes - 2)) if drafts else [])
    ms = (time.perf_counter() - start) * 1000
    engine.commit(request_id, (), (7,))
    return ms


def probe_context_tokens(node_counts: Sequence[int], repeats: int, context_tokens: int) -> int:
    """The context an engine must hold for fastest_per_size: the probe's context, then the one token
    each verify commits (a warm-up, one run per size, and two per size and round), and the largest
    tree's rows. E.g. sizes (1, 2, 4, 8, 16), 2 repeats, 64 tokens: 64 + 1 + 5 + 20 + 16 = 106."""
    return context_tokens + 1 + len(node_counts) * (1 + 2 * repeats) + max(node_counts)


def fastest_per_size(
    engine: Engine,
    request_id: str,
    node_counts: Sequence[int],
    repeats: int,
    context_tokens: int,
    measure: Callable[[int], _T],
    ms_of: Callable[[_T], float],
) -> dict[int, _T]:
    """For each k of node_counts the fastest (by ms_of) of `repeats` measure(k), run on a probe request
    `request_id` of context_tokens tokens of context, prefilled and warmed up first, released after.

    The minimum, not the median: on a shared machine noise only ever adds time, and the
    controller needs the ratio between sizes, which a noisy sample distorts most. The sizes are
    measured in turn, round after round, so that a noisy stretch slows every size alike instead of
    the sizes measured during it (which would change the ratios the controller prices drafts by).
    Within a round each size runs twice and its second run counts, after a run of its own size, as
    decoding runs it: a one-row verify right after a 32-row one measured 6-10 % slower (the larger
    step's rows and logits had displaced its working set), which made every extra row look about half
    as dear as it is (2 rows 1.09x one instead of 1.17-1.20x, 8 rows 2.29x instead of 2.49-2.66x,
    int4 on the 2-vCPU EPYC: docs/benchmarks.md, "Engine step and verify curve", EPYC, 2026-12-06).
    """
    needed = probe_context_tokens(node_counts, repeats, context_tokens)
    if needed > engine.max_context:
        raise ValueError(
            f"measuring {len(node_counts)} sizes x {repeats} repeats needs a max_context of {needed}, "
            f"the engine holds {engine.max_context}"
        )
    vocab = engine.vocab_size
    engine.open(request_id, [i % vocab for i in range(1000, 1000 + context_tokens)])
    try:
        engine.prefill(request_id)
        engine.verify(request_id, (), ())  # warm-up
        engine.commit(request_id, (), (7,))
        for k in node_counts:  # the first run of a shape warms its kernels up
            measure(k)
        samples: dict[int, list[_T]] = {k: [] for k in node_counts}
        for _ in range(repeats):
            for k in node_counts:
                measure(k)  # the run before the counted one: the same size
                samples[k].append(measure(k))
        return {k: min(runs, key=ms_of) for k, runs in samples.items()}
    finally:
        engine.release(request_id)


def measure_verify_costs(
    engine: Engine,
    repeats: int = 3,
    node_counts: tuple[int, ...] = COST_NODE_COUNTS,
    context_tokens: int = COST_CONTEXT_TOKENS,
) -> dict[int, float]:
    """Fastest of `repeats` verifies of k rows (root + k-1 chained drafts) after a short context, in ms."""
    return fastest_per_size(
        engine,
        _REQUEST_ID,
        node_counts,
        repeats,
        context_tokens,
        lambda k: verify_chain(engine, _REQUEST_ID, k),
        lambda ms: ms,
    )
