"""Per-request statistics: tokens, steps, acceptance, time per stage, per decoder, by entropy bin.

Kept as plain data so the gateway can write them to the state store (with one step in an interval,
gateway.request_record) and any gateway can serve them (GetRequest) or resume from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specdec.entropy_bins import DEFAULT_ENTROPY_BIN_EDGES
from specdec.state_store import RequestState
from specdec.v1 import common_pb2, gateway_pb2

STAGES = ("draft", "verify", "validate", "commit", "state", "other")


@dataclasses.dataclass(slots=True)
class RequestStats:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_proposed: int = 0  # draft tokens sent to verify
    num_accepted: int = 0  # draft tokens accepted
    # steps that verified drafts: speculative ones, and a run's steps that drafted (a run's message
    # of several steps counts each); the metrics' accepted length is per such step
    num_draft_steps: int = 0
    num_forced_tokens: int = 0  # tokens the grammar allowed alone, committed without a draft (in num_generated_tokens)
    # 1 where a stop token (eos, a stop_token_id) ended the output: its step committed it, the output
    # leaves it out; a step that decodes only the end still gained a token (mean_accepted_length)
    num_end_tokens: int = 0
    stage_ms: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    total_ms: float = 0.0
    forward_ms: float = 0.0  # of stage "verify": the primary's forward passes themselves
    decoders: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # name -> [proposed, accepted, ms]
    # decoder (all its ranks) -> [speculative steps it ran, [tested by depth], [accepted by depth]]
    # (specdec.candidates.DepthOutcome; on its rank-0 row of GenerationStats.decoders)
    decoder_depths: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    entropy_proposed: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(DEFAULT_ENTROPY_BIN_EDGES) - 1))
    entropy_accepted: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(DEFAULT_ENTROPY_BIN_EDGES) - 1))
    # What each step ran (the adaptive controller's choices, or the fixed settings): index = draft_length
    # and = candidates per step; index 0 counts the steps that did not speculate.
    num_steps_by_draft_length: list[int] = dataclasses.field(default_factory=list)
    num_steps_by_degree: list[int] = dataclasses.field(default_factory=list)
    num_probe_steps: int = 0  # steps whose drafts re-measured acceptance rather than paid
    task_type: str = ""  # the controller's task type ("" when not adaptive)
    num_validator_fallback_steps: int = 0  # steps run while the validator could not be reached
    queue_ms: float = 0.0  # waited in the gateway's admission queue before it started (not in total_ms)
    num_cached_prompt_tokens: int = 0  # prompt tokens the primary took from its prefix cache
    num_accepted_prediction_tokens: int = 0  # the prediction decoder's draft tokens the primary accepted
    num_rejected_prediction_tokens: int = 0  # the prediction's tokens the output has not used (so far)
    num_runs_ended_at_repeat: int = 0  # streamed plain runs ended where the output came to repeat earlier text

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens the steps committed, the output's and its end token, per step."""
        return (self.num_generated_tokens + self.num_end_tokens) / self.num_steps if self.num_steps else 0.0

    def add_decoder(self, name: str, num_proposed: int, num_accepted: int, ms: float) -> None:
        row = self.decoders.setdefault(name, [0, 0, 0.0])
        row[0] += num_proposed
        row[1] += num_accepted
        row[2] += ms

    def add_depths(self, decoder: str, num_tested: int, num_accepted: int) -> None:
        """One step of a decoder that ran: the walk tested it at depths 1..num_tested and went on
        through its nodes at depths 1..num_accepted."""
        row = self.decoder_depths.setdefault(decoder, [0, [], []])
        row[0] += 1
        for counts, n in ((row[1], num_tested), (row[2], num_accepted)):
            counts.extend([0] * (n - len(counts)))
            for d in range(n):
                counts[d] += 1

    def add_plan(self, draft_length: int, speculative_degree: int, is_probe: bool, num_steps: int = 1) -> None:
        """Count the choice of `num_steps` steps; draft_length 0 (or degree 0) is a step without speculation."""
        if draft_length == 0 or speculative_degree == 0:
            draft_length = speculative_degree = 0
        for counts, index in (
            (self.num_steps_by_draft_length, draft_length),
            (self.num_steps_by_degree, speculative_degree),
        ):
            counts.extend([0] * (index + 1 - len(counts)))
            counts[index] += num_steps
        self.num_probe_steps += is_probe * num_steps

    def add_entropies(self, accepted: list[float], rejected: list[float]) -> None:
        edges = DEFAULT_ENTROPY_BIN_EDGES
        for values, is_accepted in ((accepted, True), (rejected, False)):
            for h in values:
                b = next(i for i in range(len(edges) - 1) if h < edges[i + 1] or i == len(edges) - 2)
                self.entropy_proposed[b] += 1
                self.entropy_accepted[b] += is_accepted

    def to_dict(self) -> dict[str, Any]:
        # what dataclasses.asdict gives, built directly: this runs every step of every request (the
        # state store's write), and asdict's generic deep copy was ~4 % of the gateway's loop at 32 clients
        return {name: _copied(getattr(self, name)) for name in _STATS_FIELDS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestStats":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known}) if d else cls()

    @classmethod
    def of_record(cls, state: RequestState) -> "RequestStats":
        """The stats a stored request holds, its token counts made whole: the store takes the stats
        with one step in an interval (gateway.request_record), so the record's tokens may go on past
        them; those are counted as generated in plain steps of one token."""
        stats = cls.from_dict(state.stats)
        stats.num_prompt_tokens = stats.num_prompt_tokens or len(state.prompt_token_ids)
        if (unstated := len(state.token_ids) - stats.num_generated_tokens) > 0:
            stats.num_generated_tokens += unstated
            stats.num_steps += unstated
        return stats

    def to_pb(self) -> gateway_pb2.GenerationStats:
        edges = DEFAULT_ENTROPY_BIN_EDGES
        other = max(0.0, self.total_ms - sum(v for k, v in self.stage_ms.items() if k != "other"))
        return gateway_pb2.GenerationStats(
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            num_proposed_tokens=self.num_proposed,
            num_accepted_tokens=self.num_accepted,
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            stage_times=gateway_pb2.StageTimes(
                draft_ms=self.stage_ms["draft"],
                verify_ms=self.stage_ms["verify"],
                validate_ms=self.stage_ms["validate"],
                commit_ms=self.stage_ms["commit"],
                state_ms=self.stage_ms["state"],
                other_ms=other,
                total_ms=self.total_ms,
                forward_ms=self.forward_ms,
            ),
            tokens_per_second=self.num_generated_tokens / (self.total_ms / 1000) if self.total_ms else 0.0,
            decoders=[
                common_pb2.DecoderStats(
                    name=n,
                    num_proposed=int(r[0]),
                    num_accepted=int(r[1]),
                    time_ms=r[2],
                    num_steps=self.decoder_depths.get(n, _NO_DEPTHS)[0],
                    num_tested_by_depth=self.decoder_depths.get(n, _NO_DEPTHS)[1],
                    num_accepted_by_depth=self.decoder_depths.get(n, _NO_DEPTHS)[2],
                )
                for n, r in sorted(self.decoders.items())
            ],
            entropy_bins=[
                gateway_pb2.EntropyBin(
                    lower=edges[i],
                    upper=edges[i + 1],
                    num_proposed=self.entropy_proposed[i],
                    num_accepted=self.entropy_accepted[i],
                )
                for i in range(len(edges) - 1)
            ],
            num_steps_by_draft_length=self.num_steps_by_draft_length,
            num_steps_by_degree=self.num_steps_by_degree,
            num_probe_steps=self.num_probe_steps,
            task_type=self.task_type,
            num_validator_fallback_steps=self.num_validator_fallback_steps,
            queue_ms=self.queue_ms,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            num_forced_tokens=self.num_forced_tokens,
            num_accepted_prediction_tokens=self.num_accepted_prediction_tokens,
            num_rejected_prediction_tokens=self.num_rejected_prediction_tokens,
            num_runs_ended_at_repeat=self.num_runs_ended_at_repeat,
        )


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(RequestStats))
_NO_DEPTHS: list[Any] = [0, [], []]  # a rank r > 0 row, or stats stored before depths were counted


def _copied(value: Any) -> Any:
    """A field's value with its lists and dicts copied, nested ones too (numbers and strings as they
    are): a decoder_depths row holds its counts by depth as lists, which the next step adds to while
    the snapshot still waits for the validator's check before it is written (gateway.loop)."""
    if isinstance(value, list):
        return [_copied(v) for v in value] if any(isinstance(v, (list, dict)) for v in value) else list(value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value
