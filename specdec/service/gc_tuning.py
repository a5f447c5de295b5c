"""The cyclic garbage collector of a serving process, set for a long-lived heap and per-step garbage.

A service builds most of its long-lived objects at start-up (the model's modules, tensors and
descriptors, the tokenizer's tables, the generated protobuf classes, gRPC's and structlog's
machinery). CPython's collector walks every tracked object of a generation at each of its
collections, so each full collection walks that whole start-up heap again, and while it runs it
holds the GIL: the engine thread, the RPC threads and the event loop all stop. `gc.freeze()` moves
what exists into a permanent generation no collection visits.

Serving then allocates mostly short-lived containers (a message, a step's lists, a result tuple)
that reference counting frees at once; the collector's young generation is triggered by net
container allocations (700 by default), dozens of times a second under load, and each young
collection also ages survivors towards the older generations. A higher first threshold makes them
rarer; cycles are still collected, a little later.
"""

from __future__ import annotations

import gc

# Net container allocations between two young collections (CPython's default: 700).
GEN0_THRESHOLD = 20_000


def freeze_startup_heap(gen0_threshold: int = GEN0_THRESHOLD) -> None:
    """Collect once, move every object that survived start-up out of the collector's reach, and
    make young collections rarer. Call it when start-up is over, before serving."""
    if gen0_threshold < 1:
        raise ValueError(f"gen0_threshold must be >= 1, got {gen0_threshold}")
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
