"""What the gateway's requests have learned about each draft decoder: the next request's prior.

A request's controller starts from a prior acceptance per decoder (the task type's: structured 0.8,
code 0.6, creative 0.3; or a trained drafter's own validation figure) worth two tested tokens, and
learns its own within a few steps. A short request spends a large part of its steps learning: 16
tokens of JSON without a schema drafted at a prior of 0.3 where prompt lookup accepts 6 % lose
three or four steps to drafts that never pay before the controller turns them off. Every request
of the same task type on the same gateway has already measured that.

So the gateway keeps, per (task type, decoder, rank), the evidence of every speculative step its
requests ran, in the same discounted counts as a request's own estimate (gateway.controller.
DecoderEstimate, its record() uncapped), discounted by
`decay` per observation of that key so that the newest few hundred steps dominate. Once a key has
`min_tested` tested tokens, a new request's estimate of that decoder starts from its acceptance,
coverage and fill instead of the fixed prior (still worth only `prior_strength` trials: the
request's own steps take over as quickly as before). Probes count like any step: they are what
keeps the memory current for a decoder that every request has turned off.
"""

from __future__ import annotations

import dataclasses
import math
import threading

from gateway.controller import DecoderEstimate
from specdec.strategies import PREDICTION_STRATEGY
from specdec.task_type import TaskType

# Decoders whose acceptance belongs to the request, not to the decoder: the prediction decoder drafts
# the request's own predicted output, right for one request and wrong for the next. The memory
# neither learns from them nor gives them a prior.
REQUEST_SPECIFIC_DECODERS = frozenset({PREDICTION_STRATEGY})

# (task type, decoder, rank): one estimate the memory keeps
MemoryKey = tuple[TaskType, str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class AcceptanceMemoryConfig:
    half_life_steps: float = 256.0  # a step's evidence weighs half after this many later steps of its key
    min_tested: float = 8.0  # tested draft tokens before the memory replaces the fixed prior
    max_keys: int = 1024  # (task type, decoder, rank) entries at most (decoders x ranks x task types)

    def __post_init__(self) -> None:
        if not self.half_life_steps > 0:
            raise ValueError(f"half_life_steps must be > 0, got {self.half_life_steps}")
        if not self.min_tested > 0:
            raise ValueError(f"min_tested must be > 0, got {self.min_tested}")
        if self.max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {self.max_keys}")


@dataclasses.dataclass(frozen=True, slots=True)
class LearnedPrior:
    """A decoder's acceptance, coverage and fill as the gateway's requests measured them."""

    acceptance: float  # alpha: accepted / tested draft tokens
    coverage: float  # steps it proposed anything / steps it was asked
    fill: float  # mean proposed / requested tokens on the steps it proposed


class AcceptanceMemory:
    """One per gateway, shared by its requests' controllers (thread-safe)."""

    def __init__(self, config: AcceptanceMemoryConfig | None = None) -> None:
        self.config = config or AcceptanceMemoryConfig()
        self._decay = 0.5 ** (1.0 / self.config.half_life_steps)
        self._counts: dict[MemoryKey, DecoderEstimate] = {}
        self._lock = threading.Lock()

    def record(
        self, task_type: TaskType, decoder: str, rank: int, num_proposed: int, num_accepted: int, num_requested: int
    ) -> None:
        """One speculative step's outcome for (decoder, rank): num_accepted of num_proposed draft
        tokens (0 proposed: it was asked and had nothing), num_requested the tokens the step
        asked of each candidate."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"need 0 <= num_accepted <= num_proposed, got {num_accepted}, {num_proposed}")
        if decoder in REQUEST_SPECIFIC_DECODERS:
            return
        key = (task_type, decoder, rank)
        with self._lock:
            counts = self._counts.get(key)
            if counts is None:
                if len(self._counts) >= self.config.max_keys:
                    return  # a bounded table: new decoder names past the bound are not remembered
                counts = self._counts[key] = DecoderEstimate(decoder, rank, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
            # the request's own bookkeeping, uncapped: the decay alone bounds what the memory holds
            counts.record(self._decay, num_proposed, num_accepted, num_requested, math.inf)

    def prior(self, task_type: TaskType, decoder: str, rank: int) -> LearnedPrior | None:
        """What the requests measured of (decoder, rank) on this task type, or None before min_tested
        tested tokens (always None for REQUEST_SPECIFIC_DECODERS)."""
        if decoder in REQUEST_SPECIFIC_DECODERS:
            return None
        with self._lock:
            c = self._counts.get((task_type, decoder, rank))
            if c is None or c.tested < self.config.min_tested:
                return None
            return LearnedPrior(acceptance=c.acceptance, coverage=c.coverage, fill=c.fill)
