"""What steps cost on this gateway as they run: the cost model's overheads, measured.

The adaptive controller weighs a speculative step against plain decoding with a cost model
(gateway/cost_model.py) in units of one 1-row forward. Its overheads outside model compute (RPCs,
logits transfer, the draft service's round trip, the state store, Python) were settings: 1 ms a plain
step, 4 ms a speculative one. They are not constants. A plain run of 8 tokens pays one Decode round
trip for all of them (~0.1 ms a token); a speculative step pays a Propose and a Verify round trip
every step; a busy machine pays more for both. On a 4 ms int4 forward a setting off by a millisecond
is a quarter of a token a step: the controller then speculates where plain decoding is faster.

So the gateway measures them from every step its requests run, whatever the request:
    plain overhead       = (wall - forward) / tokens        per token of a plain run (one Decode)
    speculative overhead = wall - forward - model drafting  per speculative step
    one-row forward      = forward / verify_curve(rows)     what the curve's unit costs now
where wall is the request loop's time from one step's start to the next (the step's own RPCs and the
previous step's write or check that it waited on), forward the primary's forward passes of the step
(StageTimes.forward_ms), and model drafting the model-based decoders' own time (priced apart by the
pool's measured draft costs). Each is an exponentially weighted mean over the gateway's recent steps
(`half_life_steps`), used once it has `min_steps` samples; until then the settings stand.

A request whose client waits for the whole answer takes its runs several engine steps a message
(gateway.decode_run), so its plain tokens pay the loop's work a message, not a token: its plain
overhead is measured apart from that of requests that stream (`is_batched`), each a sample per token.

Likewise a speculative step of a request whose acceptance rule samples (or takes a threshold) waits
for the validator's decision before it commits, where a greedy step goes on with the primary's
argmaxes and has the validator confirm them beside the next step (gateway.step_validation): its
overhead is measured apart (`waits_for_validator`): one mean of both priced a sampled request's steps,
probes included, about a forward too cheap (docs/benchmarks.md, "Per-step overheads").

The controller reads them as a cost model through `cost_model()`, on a grid of about 5 % (`BUCKET`),
so that a request's remembered choices are recomputed only when a cost moved, not at every step.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import structlog

from gateway.cost_model import CostModel

BUCKET = 1.05  # costs are kept on a geometric grid of this ratio (see module docstring)
LOG_CHANGE = 1.25  # a measured cost is logged when it moved by this factor since it was last logged
_MIN_MS = 1e-3  # a cost below a microsecond is taken as this (log grid; nothing measurable is free)


@dataclasses.dataclass(frozen=True, slots=True)
class StepCostConfig:
    half_life_steps: float = 64.0  # a sample's weight halves after this many later samples of its kind
    min_steps: int = 8  # samples of a kind before its measured mean replaces the setting

    def __post_init__(self) -> None:
        if not self.half_life_steps > 0:
            raise ValueError(f"half_life_steps must be > 0, got {self.half_life_steps}")
        if self.min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {self.min_steps}")


@dataclasses.dataclass(slots=True)
class _Mean:
    """An exponentially weighted mean with the number of samples it has seen."""

    value: float = 0.0
    num_samples: int = 0

    def add(self, sample: float, weight: float) -> None:
        self.num_samples += 1
        # the first sample is the mean; later ones move it by max(weight, 1 / n) (an average at the start)
        rate = max(weight, 1.0 / self.num_samples)
        self.value += rate * (sample - self.value)

    def add_each(self, sample: float, weight: float, count: int) -> None:
        """`sample` as `count` samples (a message's tokens, each at the message's cost per token)."""
        for _ in range(count):
            self.add(sample, weight)


def _on_grid(value_ms: float) -> float:
    """value_ms rounded to the nearest power of BUCKET, e.g. 1.0 -> 1.0, 1.03 -> 1.05, 0.0 -> 0.001."""
    exponent = round(math.log(max(value_ms, _MIN_MS)) / math.log(BUCKET))
    return BUCKET**exponent


def _rounded(value_ms: float | None) -> float | None:
    return None if value_ms is None else round(value_ms, 3)


@dataclasses.dataclass(frozen=True, slots=True)
class MeasuredOverheads:
    """The measured figures, in ms, on the grid; None where there are not enough samples yet."""

    plain_ms: float | None  # per token of a plain run
    speculative_ms: float | None  # per speculative step
    one_row_ms: float | None  # the verify curve's unit, as it runs now


class StepCosts:
    """The gateway's running measurements (one per gateway, shared by its requests; thread-safe)."""

    def __init__(self, config: StepCostConfig | None = None) -> None:
        self.config = config or StepCostConfig()
        self._weight = 1.0 - 0.5 ** (1.0 / self.config.half_life_steps)
        # plain overhead per kind of run: a message a step (False) or several (True, is_batched)
        self._plain = {False: _Mean(), True: _Mean()}
        # speculative overhead per kind of step: greedy (False) or waiting for the validator (True)
        self._speculative = {False: _Mean(), True: _Mean()}
        self._one_row = _Mean()
        self._logged: dict[tuple[bool, bool], MeasuredOverheads] = {}
        self._lock = threading.Lock()
        self._log = structlog.get_logger("gateway.step_costs")

    def observe_plain(
        self, wall_ms: float, forward_ms: float, num_tokens: int, curve: CostModel, is_batched: bool = False
    ) -> None:
        """num_tokens plain tokens (a run's message of that many steps) that took wall_ms, forward_ms of
        it in the primary, of a request whose runs send several steps a message when `is_batched`."""
        if num_tokens < 1 or not wall_ms >= 0.0 or not forward_ms >= 0.0:
            return  # nothing decoded (a failed call) or not a time: no evidence
        with self._lock:
            self._plain[is_batched].add_each(max(0.0, wall_ms - forward_ms) / num_tokens, self._weight, num_tokens)
            if forward_ms > 0.0:
                self._one_row.add_each(forward_ms / num_tokens / float(curve.verify(1)), self._weight, num_tokens)

    def observe_speculative(
        self,
        wall_ms: float,
        forward_ms: float,
        model_draft_ms: float,
        num_rows: int,
        curve: CostModel,
        waits_for_validator: bool = False,
    ) -> None:
        """A speculative step: wall_ms in all, forward_ms of a forward over num_rows rows (root, tree,
        lookahead and forced chain), model_draft_ms of model-based drafting; of a request whose steps
        wait for the validator's decision when `waits_for_validator` (a sampling or threshold rule)."""
        if num_rows < 1 or not wall_ms >= 0.0 or not forward_ms >= 0.0 or not model_draft_ms >= 0.0:
            return
        with self._lock:
            overhead = max(0.0, wall_ms - forward_ms - model_draft_ms)
            self._speculative[waits_for_validator].add(overhead, self._weight)
            if forward_ms > 0.0:
                self._one_row.add(forward_ms / float(curve.verify(num_rows)), self._weight)

    def overheads(self, is_batched: bool = False, waits_for_validator: bool = False) -> MeasuredOverheads:
        """The figures for a request whose runs send several steps a message (`is_batched`) or one,
        and whose speculative steps wait for the validator's decision (`waits_for_validator`) or not."""
        kind = (is_batched, waits_for_validator)
        with self._lock:
            measured = MeasuredOverheads(
                *(
                    _on_grid(m.value) if m.num_samples >= self.config.min_steps else None
                    for m in (self._plain[is_batched], self._speculative[waits_for_validator], self._one_row)
                )
            )
            logged = self._logged.get(kind)
            is_news = logged is None or any(
                (new is None) != (old is None) or (new and old and max(new / old, old / new) >= LOG_CHANGE)
                for new, old in zip(dataclasses.astuple(measured), dataclasses.astuple(logged))
            )
            if is_news:
                self._logged[kind] = measured
        if is_news and measured != MeasuredOverheads(None, None, None):
            self._log.info(
                "step costs measured",
                is_batched=is_batched,
                waits_for_validator=waits_for_validator,
                plain_overhead_ms=_rounded(measured.plain_ms),
                speculative_overhead_ms=_rounded(measured.speculative_ms),
                one_row_forward_ms=_rounded(measured.one_row_ms),
            )
        return measured

    def cost_model(self, base: CostModel, one_row_ms: float, measured: MeasuredOverheads | None = None) -> CostModel:
        """`base` with its overheads replaced by the measured ones (`measured`, else overheads() now)
        where there are enough samples. `one_row_ms`: the 1-row forward the base model's units stand
        for (the primary's start-up measurement), used until the running one is measured.

        # E.g. plain 0.12 ms a token, speculative 2.1 ms a step, forward unit now 4.2 ms:
        #   plain_overhead 0.029, speculative_overhead 0.5 (units of one forward)
        """
        measured = measured or self.overheads()  # (a caller with batched runs passes its own)
        unit = measured.one_row_ms or one_row_ms
        if unit <= 0.0:
            return base
        return dataclasses.replace(
            base,
            plain_overhead=base.plain_overhead if measured.plain_ms is None else measured.plain_ms / unit,
            speculative_overhead=(
                base.speculative_overhead if measured.speculative_ms is None else measured.speculative_ms / unit
            ),
        )
