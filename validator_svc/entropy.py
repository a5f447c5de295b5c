"""The primary's output entropy per row, and acceptance counted by entropy bin.

The reference article's claim is that draft acceptance stays >= 75 % while the primary's
entropy is < 2.8 nats: low-entropy positions (JSON punctuation, code boilerplate) are where
drafts pay off. `EntropyAcceptanceStats` measures that claim on live traffic.

Entropy is always the temperature-1 softmax of the raw logits, whatever the request's sampling
parameters, so that figures from greedy and sampled requests share one scale:
  m = max_i x_i,  s = sum_i e^(x_i - m),  t = sum_i e^(x_i - m) (x_i - m)
  H = -sum_i p_i log p_i = log s - t / s      (nats; -inf logits contribute 0)
The CUDA kernel in kernel.py computes the same three sums in one pass.

A decision event is a row of the walk where the tree offered at least one child: it counts as
proposed once, and as accepted when one of the children was accepted. Rows below a rejection
are never reached and are not counted.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Iterable

import torch

from specdec.entropy_bins import DEFAULT_ENTROPY_BIN_EDGES

_INF_TEXT = "inf"  # JSON has no infinity; the last edge is written as this string


def row_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of softmax(logits) per row: logits [R, V] fp32 -> [R] fp32."""
    assert logits.dim() == 2, f"logits must be [R, V], got {tuple(logits.shape)}"
    row_max = logits.amax(dim=-1, keepdim=True)  # [R, 1]
    shifted = logits - row_max  # [R, V], <= 0, -inf for masked tokens
    weights = torch.exp(shifted)  # [R, V]
    total = weights.sum(dim=-1)  # [R]
    # Clamping -inf to the lowest float keeps 0 * (x - m) at 0 for masked tokens (0 * -inf is NaN);
    # NaN still propagates. A clamp is ~10x cheaper than a torch.where over [R, V].
    finite_shifted = shifted.clamp(min=torch.finfo(torch.float32).min)  # [R, V]
    weighted = (weights * finite_shifted).sum(dim=-1)  # [R]
    return torch.log(total) - weighted / total


@dataclasses.dataclass(frozen=True, slots=True)
class EntropyAcceptanceStats:
    bin_edges: tuple[float, ...] = DEFAULT_ENTROPY_BIN_EDGES
    num_proposed: tuple[int, ...] = ()  # per bin; () means all zero
    num_accepted: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        edges = tuple(float(e) for e in self.bin_edges)
        if len(edges) < 2 or any(not (a < b) for a, b in zip(edges, edges[1:])) or math.isnan(edges[0]):
            raise ValueError(f"bin_edges must be at least two increasing numbers, got {self.bin_edges!r}")
        num_bins = len(edges) - 1
        object.__setattr__(self, "bin_edges", edges)
        for name in ("num_proposed", "num_accepted"):
            counts = tuple(getattr(self, name)) or (0,) * num_bins
            if len(counts) != num_bins or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
                raise ValueError(f"{name} must hold {num_bins} counts >= 0, got {getattr(self, name)!r}")
            object.__setattr__(self, name, counts)
        if any(a > p for a, p in zip(self.num_accepted, self.num_proposed)):
            raise ValueError("num_accepted must not exceed num_proposed in any bin")

    @property
    def num_bins(self) -> int:
        return len(self.bin_edges) - 1

    def bin_index(self, entropy: float) -> int:
        """The bin holding `entropy`; values outside the edges go to the first or last bin."""
        index = bisect.bisect_right(self.bin_edges, entropy) - 1
        return min(max(index, 0), self.num_bins - 1)

    def record(
        self, accepted_entropies: Iterable[float], rejected_entropies: Iterable[float]
    ) -> EntropyAcceptanceStats:
        """A copy with one step's decisions added (ValidationResult's two entropy tuples)."""
        proposed, accepted = list(self.num_proposed), list(self.num_accepted)
        for entropy in accepted_entropies:
            index = self.bin_index(entropy)
            proposed[index] += 1
            accepted[index] += 1
        for entropy in rejected_entropies:
            proposed[self.bin_index(entropy)] += 1
        return EntropyAcceptanceStats(self.bin_edges, tuple(proposed), tuple(accepted))

    def merge(self, other: EntropyAcceptanceStats) -> EntropyAcceptanceStats:
        if other.bin_edges != self.bin_edges:
            raise ValueError(f"bin_edges differ: {self.bin_edges} vs {other.bin_edges}")
        return EntropyAcceptanceStats(
            self.bin_edges,
            tuple(a + b for a, b in zip(self.num_proposed, other.num_proposed)),
            tuple(a + b for a, b in zip(self.num_accepted, other.num_accepted)),
        )

    def acceptance_rates(self) -> tuple[float | None, ...]:
        """num_accepted / num_proposed per bin; None for an empty bin."""
        return tuple(a / p if p else None for a, p in zip(self.num_accepted, self.num_proposed))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-safe dict (the infinite last edge becomes the string "inf")."""
        return {
            "bin_edges": [_INF_TEXT if math.isinf(e) else e for e in self.bin_edges],
            "num_proposed": list(self.num_proposed),
            "num_accepted": list(self.num_accepted),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EntropyAcceptanceStats:
        try:
            edges = tuple(math.inf if e == _INF_TEXT else float(e) for e in data["bin_edges"])
            return cls(edges, tuple(data["num_proposed"]), tuple(data["num_accepted"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not an EntropyAcceptanceStats dict: {error!r}") from error
