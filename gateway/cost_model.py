"""What a speculative step costs: the primary's verify curve, each draft decoder's cost, and the
per-step overhead outside model compute, all in units of one 1-token primary forward.

Step cost (verify(1) = 1):
    plain       = verify(1) + plain_overhead
    speculative = speculative_overhead + sum_{decoders used} draft_cost(gamma) + verify(1 + nodes + extra rows)
verify(k) is measured by the primary at startup (GetModelInfo.verify_costs, keyed by rows: the
pending root plus k - 1 draft nodes). On a CPU without AVX512, fp32 rows 2..16 cost 1.6-1.9x one row,
so a tree must gain ~0.8 tokens a step before it pays; in bf16 (docs/architecture.md, Measurements) 8 rows cost 1.18x.
The overheads are given in ms (RPCs, logits transfer, Redis) and divided by the measured 1-row
forward, so the same settings mean little on a slow CPU forward and a lot on a fast GPU one.
Draft costs default to specdec.strategies' estimates; a model-based decoder the draft pool measured
when the primary's weights attached (GetPoolInfo.draft_costs, draft_svc/costs.py: fixed + per-token
ms, per depth for a tree decoder) is priced by that, divided by the same 1-row forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from specdec.controller_defaults import PLAIN_OVERHEAD_MS, SPECULATIVE_OVERHEAD_MS
from specdec.strategies import STRATEGIES, DraftCost

# SmolLM2-135M bf16, one KV-cached forward of k tokens after 256 tokens of context, in ms (docs/architecture.md).
SMOLLM2_BF16_VERIFY_MS: tuple[tuple[int, float], ...] = (
    (1, 26.8),
    (2, 26.4),
    (4, 28.3),
    (8, 31.7),
    (16, 37.7),
    (32, 46.7),
    (64, 72.3),
)


# Each strategy's default cost, from the one list of strategies.
DEFAULT_DRAFT_COSTS: tuple[tuple[str, DraftCost], ...] = tuple((s.name, s.cost) for s in STRATEGIES)


@dataclasses.dataclass(frozen=True, slots=True)
class CostModel:
    verify_curve: tuple[tuple[int, float], ...]  # (num_tokens, cost relative to 1 token), from num_tokens 1
    draft_costs: tuple[tuple[str, DraftCost], ...] = ()  # (decoder, cost); every decoder a request may use
    plain_overhead: float = 0.0  # per plain step outside model compute (RPC, Redis)
    speculative_overhead: float = 0.0  # per speculative step: propose + validate RPCs, tree building
    _curve: tuple[np.ndarray, np.ndarray] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = [k for k, _ in self.verify_curve]
        if not sizes or sizes[0] != 1 or sizes != sorted(set(sizes)):
            raise ValueError(f"verify_curve must start at num_tokens 1 and ascend, got sizes {sizes}")
        if any(cost <= 0 for _, cost in self.verify_curve):
            raise ValueError("verify_curve costs must be positive")
        if self.plain_overhead < 0 or self.speculative_overhead < 0:
            raise ValueError("plain_overhead and speculative_overhead must be >= 0")
        names = [name for name, _ in self.draft_costs]
        if len(names) != len(set(names)):
            raise ValueError(f"draft_costs names a decoder twice: {names}")
        object.__setattr__(
            self,
            "_curve",
            (
                np.array(sizes, dtype=np.float64),  # [P] num_tokens
                np.array([c for _, c in self.verify_curve], dtype=np.float64),
            ),
        )

    @classmethod
    def from_verify_ms(
        cls,
        verify_ms: Iterable[tuple[int, float]],
        draft_costs: Mapping[str, DraftCost] | None = None,
        *,
        plain_overhead: float = 0.0,
        speculative_overhead: float = 0.0,
    ) -> CostModel:
        """A measured curve in ms, normalised by its 1-token entry."""
        points = sorted(verify_ms)
        if not points or points[0][0] != 1:
            raise ValueError("verify_ms must include num_tokens 1")
        return cls(
            verify_curve=tuple((k, ms / points[0][1]) for k, ms in points),
            draft_costs=tuple(sorted((draft_costs or {}).items())),
            plain_overhead=plain_overhead,
            speculative_overhead=speculative_overhead,
        )

    @property
    def plain_step(self) -> float:
        return float(self.verify(1)) + self.plain_overhead

    def verify(self, num_tokens: Any) -> Any:
        """Piecewise-linear in num_tokens (a number or an array); past the last point the last
        segment's slope continues."""
        if isinstance(num_tokens, (int, float)):  # every step asks for one: spare numpy's per-call cost
            return self._verify_one(float(num_tokens))
        sizes, costs = self._curve
        num_tokens = np.asarray(num_tokens, dtype=np.float64)
        inside = np.interp(num_tokens, sizes, costs)
        if sizes.size == 1 or not num_tokens.max(initial=0.0) > sizes[-1]:
            return inside  # (the planner's arrays seldom pass the curve's last point)
        slope = (costs[-1] - costs[-2]) / (sizes[-1] - sizes[-2])
        return np.where(num_tokens > sizes[-1], costs[-1] + slope * (num_tokens - sizes[-1]), inside)

    def _verify_one(self, x: float) -> float:
        """verify() of one number, in np.interp's arithmetic (the same float, without numpy's per-call
        cost: every step asks for one)."""
        points = self.verify_curve
        if x <= points[0][0] or len(points) == 1:
            return float(points[0][1])
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x < x1:
                return (y1 - y0) / (x1 - x0) * (x - x0) + y0
        (x0, y0), (x1, y1) = points[-2], points[-1]
        return float(y1) if x == x1 else y1 + (y1 - y0) / (x1 - x0) * (x - x1)

    def draft(self, decoder: str, num_tokens: int) -> float:
        """One decoder's Propose drafting num_tokens tokens per candidate."""
        return self._draft_cost(decoder).at(num_tokens)

    def extra_rows(self, decoder: str) -> int:
        """Verify rows the decoder adds to a step it takes part in, beyond its candidates' nodes."""
        return self._draft_cost(decoder).extra_rows

    def _draft_cost(self, decoder: str) -> DraftCost:
        for name, cost in self.draft_costs:
            if name == decoder:
                return cost
        raise ValueError(f"decoder {decoder!r} has no draft cost in the cost model")


@dataclasses.dataclass(frozen=True, slots=True)
class CostSettings:
    """What the gateway knows about costs beyond the primary's measured verify curve."""

    plain_overhead_ms: float = PLAIN_OVERHEAD_MS  # per plain step (specdec.controller_defaults)
    speculative_overhead_ms: float = SPECULATIVE_OVERHEAD_MS  # per speculative step
    draft_costs: tuple[tuple[str, DraftCost], ...] = DEFAULT_DRAFT_COSTS

    def __post_init__(self) -> None:
        if self.plain_overhead_ms < 0 or self.speculative_overhead_ms < 0:
            raise ValueError("plain_overhead_ms and speculative_overhead_ms must be >= 0")
        names = [name for name, _ in self.draft_costs]
        if len(names) != len(set(names)):
            raise ValueError(f"draft_costs names a decoder twice: {names}")


def _verify_points(verify_costs_ms: Mapping[int, float]) -> list[tuple[int, float]]:
    """(rows, ms) ascending; the bf16 reference curve when the primary measured nothing (or not 1 row)."""
    points = sorted((int(k), float(ms)) for k, ms in verify_costs_ms.items() if ms > 0)
    return points if points and points[0][0] == 1 else list(SMOLLM2_BF16_VERIFY_MS)


def one_row_ms(verify_costs_ms: Mapping[int, float]) -> float:
    """The 1-row forward in ms that a cost model from these measurements counts in (cost_model_for)."""
    return _verify_points(verify_costs_ms)[0][1]


def cost_model_for(
    verify_costs_ms: Mapping[int, float],
    settings: CostSettings,
    draft_costs_ms: Mapping[str, tuple[float, float]] | None = None,
) -> CostModel:
    """The cost model of a primary that measured `verify_costs_ms` ({rows: ms}); a primary that
    measured nothing (or not 1 row) gets the bf16 reference curve's shape. `draft_costs_ms`: what
    the draft pool measured of its decoders' Propose (GetPoolInfo.draft_costs), decoder ->
    (fixed_ms, per_token_ms); each replaces that decoder's default cost, divided by the 1-row
    forward like the overheads (its extra_rows stay).

    # E.g. a 1-row forward of 25 ms, feature measured at (1.0, 2.5) ms -> DraftCost(0.04, 0.1)
    """
    points = _verify_points(verify_costs_ms)
    one_row_ms = points[0][1]
    draft_costs = dict(settings.draft_costs)
    for name, (fixed_ms, per_token_ms) in (draft_costs_ms or {}).items():
        default = draft_costs.get(name, DraftCost())
        draft_costs[name] = DraftCost(
            fixed=max(0.0, fixed_ms) / one_row_ms,
            per_token=max(0.0, per_token_ms) / one_row_ms,
            extra_rows=default.extra_rows,
        )
    return CostModel.from_verify_ms(
        points,
        draft_costs,
        plain_overhead=settings.plain_overhead_ms / one_row_ms,
        speculative_overhead=settings.speculative_overhead_ms / one_row_ms,
    )
