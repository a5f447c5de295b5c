"""What a model-based draft decoder's Propose costs on this machine, measured once its weights attach.

The gateway's cost model prices a decoder per step as fixed + per_token * (tokens drafted), in units of
one 1-token primary forward (gateway/cost_model.py). A model-free decoder takes microseconds and a
default serves; a learned drafter's cost depends on the model's shape, the drafter's and the machine,
so the pool measures it when the primary's weights attach and the drafter binds, and GetPoolInfo
reports it in ms (the gateway divides by the primary's measured 1-token forward).

    measure_propose_ms(decoder)   a synthetic request of the model's shape: CONTEXT_TOKENS token ids
                                  and, for a decoder that reads the primary's features, random feature
                                  rows for them (costs do not depend on the values); then the fastest
                                  of `repeats` proposes at each depth of MEASURED_DEPTHS
    fit_cost({depth: ms})         least-squares line ms = fixed + per_token * depth, both >= 0

    # E.g. {1: 2.0, 2: 3.1, 3: 3.9, 4: 5.0} -> fixed 1.0 ms, per_token 0.98 ms

Only the decoder's public methods are called (extend, observe_features, propose, release), so the
measure is what a request's Propose pays inside the pool, without the RPC around it.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from draft_svc.strategies.base import DraftDecoder, reads_features

MEASURED_DEPTHS = (1, 2, 3, 4, 5, 6)
CONTEXT_TOKENS = 128  # the synthetic request's committed tokens (the primary's verify curve uses 128 too)
REPEATS = 3
# Ranked candidates asked per propose: the gateway's default adaptive degree. A tree decoder grows the
# same beam whatever it returns, so this sets only the node budget it ranks within.
NUM_CANDIDATES = 4
_FIRST_TOKEN_ID = 1000  # synthetic ids from here, modulo the vocabulary (as primary_svc/costs.py)


@dataclasses.dataclass(frozen=True, slots=True)
class MeasuredCost:
    """A Propose's measured time, fixed_ms + per_token_ms * num_tokens (tokens drafted per
    candidate), and the points it was fit to."""

    fixed_ms: float
    per_token_ms: float
    depth_ms: tuple[tuple[int, float], ...] = ()  # (tokens drafted, fastest ms)

    def __post_init__(self) -> None:
        if not (self.fixed_ms >= 0 and self.per_token_ms >= 0):
            raise ValueError(f"costs must be >= 0, got fixed_ms={self.fixed_ms}, per_token_ms={self.per_token_ms}")

    def at(self, num_tokens: int) -> float:
        return self.fixed_ms + self.per_token_ms * num_tokens


def fit_cost(depth_ms: Mapping[int, float]) -> MeasuredCost:
    """The least-squares line through {depth: ms}; a negative slope or intercept (noise) is clipped
    to 0 and the other refit, so that the line never prices a longer draft below a shorter one."""
    if not depth_ms:
        raise ValueError("fit_cost needs at least one point")
    depths = np.array(sorted(depth_ms), dtype=np.float64)  # [P]
    ms = np.array([depth_ms[int(d)] for d in depths], dtype=np.float64)  # [P]
    points = tuple((int(d), float(m)) for d, m in zip(depths, ms))
    if depths.size == 1:
        return MeasuredCost(float(ms[0]), 0.0, points)
    per_token, fixed = np.polyfit(depths, ms, 1)
    if per_token < 0:
        per_token, fixed = 0.0, float(ms.mean())
    elif fixed < 0:
        per_token, fixed = float((depths * ms).sum() / (depths * depths).sum()), 0.0  # through the origin
    return MeasuredCost(float(fixed), float(per_token), points)


def measure_propose_ms(
    decoder: DraftDecoder,
    vocab_size: int,
    hidden_size: int,
    depths: Sequence[int] = MEASURED_DEPTHS,
    repeats: int = REPEATS,
    context_tokens: int = CONTEXT_TOKENS,
    num_candidates: int = NUM_CANDIDATES,
) -> dict[int, float]:
    """Fastest of `repeats` proposes at each depth, in ms, after one warm-up each (a shape's first run
    warms its kernels up). The minimum: on a shared machine noise only adds time. The decoder is
    released afterwards; it must be a fresh one (its state is the synthetic request's)."""
    if repeats < 1 or context_tokens < 2:
        raise ValueError(f"need repeats >= 1 and context_tokens >= 2, got {repeats}, {context_tokens}")
    token_ids = [(_FIRST_TOKEN_ID + i) % vocab_size for i in range(context_tokens)]
    decoder.extend(token_ids)
    if reads_features(decoder):
        rng = np.random.default_rng(0)
        # rows predicting tokens 1..T-1: the state a request has after its prefill and verifies
        decoder.observe_features(1, rng.standard_normal((context_tokens - 1, hidden_size), dtype=np.float32))
    takes_max_nodes = getattr(decoder, "takes_max_nodes", False)
    try:
        out = {}
        for depth in depths:
            times = []
            for r in range(repeats + 1):
                started = time.perf_counter()
                if takes_max_nodes:
                    decoder.propose(depth, num_candidates, max_nodes=num_candidates * depth)  # type: ignore[call-arg]
                else:
                    decoder.propose(depth, num_candidates)
                if r:
                    times.append((time.perf_counter() - started) * 1e3)
            out[int(depth)] = min(times)
        return out
    finally:
        if hasattr(decoder, "release"):
            decoder.release()


class DraftCosts:
    """The pool's measured costs by strategy, written by the attach thread, read by GetPoolInfo."""

    def __init__(self) -> None:
        self._costs: dict[str, MeasuredCost] = {}
        self._lock = threading.Lock()

    def set(self, strategy: str, cost: MeasuredCost) -> None:
        with self._lock:
            self._costs[strategy] = cost

    def discard(self, strategy: str) -> None:
        with self._lock:
            self._costs.pop(strategy, None)

    def items(self) -> tuple[tuple[str, MeasuredCost], ...]:
        with self._lock:
            return tuple(sorted(self._costs.items()))
