"""Adaptive speculation control: which draft decoders, how long a draft, or no speculation at all.

Replaces the reference article's sketch `adjust_speculative_degree(task_type, current_acceptance)`, a
table (structured -> many candidates, creative -> few), with a cost model. That name stays as the
one-shot public entry; `AdaptiveController` is the per-request loop around the same optimiser.

Terms (Leviathan et al. 2023): alpha, the per-token acceptance (the chance the primary accepts a draft
token given that it accepted all earlier ones); gamma, the draft_length. One chain gains, bonus included,
    E[accepted length] = 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma+1)) / (1 - alpha).
Several candidates (a token tree, SpecInfer): depth j is reached when some candidate's first j tokens are
all accepted. Treating candidates as independent,
    E[accepted length] = 1 + sum_{j=1..gamma} (1 - prod_s (1 - reach_s(j))),
    reach_s(j) = c_s * alpha_s^j * [j <= f_s * gamma]
with c_s the chance decoder s proposes anything (coverage) and f_s the part of gamma it fills. Independence
understates mutually exclusive candidates (distinct first tokens give a0 + a1, not a0 + a1 - a0*a1) and
overstates correlated ones; node counts ignore merged prefixes (an upper bound on verify cost).

Step costs come from gateway/cost_model.py, in units of one 1-token primary forward:
    speedup     = E[accepted length] * plain step cost / speculative step cost
For each gamma on a grid, decoders are added greedily while the speedup grows and their nodes stay within
max_tree_nodes, so one whose gain does not pay for its draft and verify cost is left out; the best gamma
wins. Ranks of one decoder share its draft cost and the verify rows it adds beside its candidates
(lookahead's window, `extra_rows`).

A tree decoder (specdec.strategies.TREE_STRATEGIES: the feature drafter, EAGLE-2) grows one token tree
per Propose and returns its root-to-leaf paths, best leaf first, as its ranks 0, 1, ...; the request's
controller tracks up to speculative_degree of them (gateway/loop.py). It enters this model unchanged:
    draft cost  its measured Propose, fixed + per_token * gamma (per depth: one batched drafter call
                each; GetPoolInfo.draft_costs -> gateway/cost_model.py), paid once however many ranks
    nodes       sum over its planned ranks of c_r * f_r * gamma: the node budget the pool hands it is
                (ranks planned) * gamma (SpeculationPlan.max_tree_nodes bounds the whole tree), and a
                rank's path shares its prefix with better ranks, so this bounds its verify rows from above
    acceptance  per rank, from the rank's own outcome (its path's nodes and accepted prefix), as for
                any decoder; acceptance by depth is alpha_r^j, whose estimate is the geometric
                model's maximum likelihood over the depths each step tested
    prior       the drafter's own validation acceptance (its file's top-1 agreement by depth, averaged;
                GetPoolInfo.acceptance_priors -> ControllerConfig.decoder_prior_acceptance) instead of
                the task type's: with the task prior a drafter that costs a tenth of a forward per
                depth loses to the free model-free drafts and is too dear to probe, so it would never
                be tried
A rank r > 0 adds the depths its leaf reaches beyond the better paths' shared prefix; independence
counts its shared depths twice and its sibling of the accepted node not at all, the two errors of
the tree formula above. So the cost model, not a default, decides per step whether the drafter runs
and how many leaves it gets: a rank joins while its gain pays for its rows.

Estimates per request and per (decoder, rank), as discounted Beta counts: a step that accepted a of p
proposed tokens adds a successes and one failure when a < p (the geometric model's maximum likelihood:
tokens after the first rejection were never tested). Counts start at a task-type prior (a trained
drafter's own validation acceptance instead where the draft pool reports one) worth
`prior_strength` trials and are discounted by decay^(steps since the last observation) before each new
observation, so the prior fades like any old evidence and a probe after a long pause dominates.

Load: the primary batches every running request's rows into one engine step, so under load a draft
row is not nearly free: it lengthens a step that R other rows share. With R the rows the primary's
steps carry besides this request's (VerifyResponse.num_step_rows less its own: Verified.other_step_rows,
smoothed), the plan
maximises the throughput of the whole step, counting the others' rows as a token each:
    speedup     = (R + E[accepted length]) / (R + 1) * (verify(R + 1) + plain overhead)
                  / (speculative overhead + drafts + verify(R + 1 + nodes + extra rows))
At R = 0 this is the formula above. Where the verify curve grows about linearly (many rows on a CPU)
a draft row costs about as much as another request's whole token, so speculation turns itself off
under load and back on when the load goes.

Hysteresis and probing: speculation turns off when the best plan's expected speedup < off_below, and on
again only at >= on_above. While off, every probe_interval steps a short draft re-measures acceptance,
and each probe that leaves it off doubles the wait for the next (up to max_probe_backoff times the
interval; text the drafts keep missing, JSON without a schema, stops paying for probes that fail);
while on, a decoder left out for probe_interval steps rides along for one step. Until the next probe
every plan is plain, so the gateway decodes that stretch in runs of tokens (plain_steps_ahead). Only
decoders cheap enough that probing costs < max_probe_overhead of throughput are probed: a
model-based drafter that the cost model dropped stays dropped for the request. Under load the probe
interval stretches (probe_interval()): every request probes, and a probe's rows lengthen the step
the others share.
"""

from __future__ import annotations

import collections
import math
import dataclasses
import functools
import re
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.cost_model import CostModel
from specdec.candidates import CandidateOutcome
from specdec.field_checks import require_at_least_one
from specdec.task_type import TaskType
from specdec.controller_defaults import (
    PRIOR_ACCEPTANCE_CODE,
    PRIOR_ACCEPTANCE_CREATIVE,
    PRIOR_ACCEPTANCE_PREDICTION,
    PRIOR_ACCEPTANCE_STRUCTURED,
)
from specdec.speculation_bounds import (
    DRAFT_LENGTH_CHOICES,
    MAX_ADAPTIVE_SPECULATIVE_DEGREE,
    MAX_REQUEST_TREE_NODES,
    check_speculation_bounds,
)
from specdec.strategies import PREDICTION_STRATEGY

if TYPE_CHECKING:  # the memory builds on this module's DecoderEstimate
    from gateway.acceptance_memory import AcceptanceMemory

STATE_VERSION = 1
_TINY = 1e-9  # discounted counts below this carry no evidence: fall back to the prior
# Optimisation results an AdaptiveController remembers (inputs -> choice), least recently used out.
MAX_REMEMBERED_CHOICES = 4096
NEVER_DRAFTS = 1 << 30  # plain_steps_ahead when speculation is off for good (no decoder cheap enough to probe)


# Code fences, a line that starts like code in common languages, or a line that ends like a C statement.
_CODE_PATTERN = re.compile(
    r"```|^[ \t]*(?:def|class|import|from[ \t]+[\w.]+[ \t]+import|async[ \t]+def|function|fn|func|"
    r"public|private|#include|package|const|let|var|SELECT|CREATE[ \t]+TABLE)\b|[;{][ \t]*$",
    re.MULTILINE,
)


def infer_task_type(prompt_text: str, has_schema: bool) -> TaskType:
    """structured when a schema / JSON mode constrains the output, code when the prompt looks like code."""
    if has_schema:
        return TaskType.STRUCTURED
    return TaskType.CODE if _CODE_PATTERN.search(prompt_text) else TaskType.CREATIVE


@dataclasses.dataclass(frozen=True, slots=True)
class ControllerConfig:
    draft_length_choices: tuple[int, ...] = DRAFT_LENGTH_CHOICES
    max_speculative_degree: int = MAX_ADAPTIVE_SPECULATIVE_DEGREE
    max_tree_nodes: int = MAX_REQUEST_TREE_NODES
    # Task-type priors for alpha (specdec.controller_defaults); rank r gets decay^r of it.
    prior_acceptance_structured: float = PRIOR_ACCEPTANCE_STRUCTURED
    prior_acceptance_code: float = PRIOR_ACCEPTANCE_CODE
    prior_acceptance_creative: float = PRIOR_ACCEPTANCE_CREATIVE
    rank_prior_decay: float = 0.5
    # (decoder, alpha) replacing the task type's prior for that decoder: a trained drafter's own
    # validation acceptance (GetPoolInfo.acceptance_priors), a better first guess than drafts in general.
    # The prediction decoder's by default: a request's prediction is mostly right where it is aligned.
    decoder_prior_acceptance: tuple[tuple[str, float], ...] = ((PREDICTION_STRATEGY, PRIOR_ACCEPTANCE_PREDICTION),)
    prior_coverage: float = 0.5
    prior_strength: float = 2.0  # trials the prior is worth
    half_life_steps: float = 4.0  # evidence weight halves every this many steps
    max_evidence_tokens: float = 16.0  # tested draft tokens an alpha estimate remembers at most
    off_below: float = 1.0
    on_above: float = 1.05
    probe_interval: int = 16
    probe_draft_length: int = 4
    # A probe that leaves speculation off doubles the wait for the next one, up to this many times
    # probe_interval(); turning on starts over.
    max_probe_backoff: int = 4
    # Probing may cost at most this share of throughput: a decoder is probed only when its draft cost,
    # paid once per probe_interval steps, stays below it (prompt lookup yes, early exit at 0.6 a token no).
    max_probe_overhead: float = 0.02
    # Under load a probe's rows go into a step the other requests share, and every request probes:
    # the interval stretches so that the others' waiting on probe rows stays under this share of the
    # time (AdaptiveController.probe_interval; unloaded it stays probe_interval).
    max_shared_probe_overhead: float = 0.05
    load_smoothing: float = 0.5  # weight of the newest load report in ControllerState.other_rows

    def __post_init__(self) -> None:
        if not self.draft_length_choices or min(self.draft_length_choices) < 1:
            raise ValueError(f"draft_length_choices must be positive, got {self.draft_length_choices}")
        check_speculation_bounds(self.max_speculative_degree, max(self.draft_length_choices), self.max_tree_nodes)
        require_at_least_one(
            self,
            "max_speculative_degree",
            "max_tree_nodes",
            "probe_interval",
            "probe_draft_length",
            "max_probe_backoff",
        )
        for name in (
            "prior_acceptance_structured",
            "prior_acceptance_code",
            "prior_acceptance_creative",
            "rank_prior_decay",
            "prior_coverage",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")
        for decoder, alpha in self.decoder_prior_acceptance:
            if not 0.0 <= alpha <= 1.0:
                raise ValueError(f"decoder_prior_acceptance of {decoder!r} must lie in [0, 1], got {alpha}")
        if not 0.0 < self.max_shared_probe_overhead <= 1.0:
            raise ValueError(f"max_shared_probe_overhead must lie in (0, 1], got {self.max_shared_probe_overhead}")
        if self.prior_strength <= 0 or self.half_life_steps <= 0:
            raise ValueError("prior_strength and half_life_steps must be positive")
        if self.max_evidence_tokens < self.prior_strength:
            raise ValueError(
                f"max_evidence_tokens ({self.max_evidence_tokens}) must be >= prior_strength ({self.prior_strength})"
            )
        if not 0.0 < self.load_smoothing <= 1.0:
            raise ValueError(f"load_smoothing must lie in (0, 1], got {self.load_smoothing}")
        if not 0 < self.off_below <= self.on_above:
            raise ValueError(f"need 0 < off_below <= on_above, got {self.off_below}, {self.on_above}")

    @property
    def decay_per_step(self) -> float:
        return 0.5 ** (1.0 / self.half_life_steps)

    def prior_acceptance(self, task_type: TaskType, rank: int, decoder: str = "") -> float:
        base = dict(self.decoder_prior_acceptance).get(decoder)
        if base is None:
            base = {
                TaskType.STRUCTURED: self.prior_acceptance_structured,
                TaskType.CODE: self.prior_acceptance_code,
                TaskType.CREATIVE: self.prior_acceptance_creative,
            }[task_type]
        return base * self.rank_prior_decay**rank


@dataclasses.dataclass(slots=True)
class DecoderEstimate:
    """Discounted evidence about one (decoder, rank) of one request; every field a plain number."""

    decoder: str
    rank: int
    prior_acceptance: float
    accepted: float  # accepted draft tokens (+ prior pseudo-successes)
    tested: float  # accepted tokens + rejections (+ prior pseudo-trials)
    proposed_steps: float  # steps with a non-empty candidate
    asked_steps: float  # steps the decoder was asked
    filled: float  # sum over non-empty steps of proposed / requested tokens
    last_observed_step: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tested if self.tested > _TINY else self.prior_acceptance

    @property
    def coverage(self) -> float:
        return self.proposed_steps / self.asked_steps if self.asked_steps > _TINY else 0.0

    @property
    def fill(self) -> float:
        return self.filled / self.proposed_steps if self.proposed_steps > _TINY else 1.0

    def record(
        self, weight: float, num_proposed: int, num_accepted: int, num_requested: int, max_tested: float
    ) -> None:
        """Discount the old evidence by `weight`, add one step's, cap the token evidence at max_tested."""
        for name in ("accepted", "tested", "proposed_steps", "asked_steps", "filled"):
            setattr(self, name, getattr(self, name) * weight)
        self.asked_steps += 1.0
        if num_proposed > 0:
            self.proposed_steps += 1.0
            self.filled += min(1.0, num_proposed / max(1, num_requested))
            self.accepted += num_accepted
            self.tested += num_accepted + (1 if num_accepted < num_proposed else 0)
        if self.tested > max_tested:
            # Long accepted runs add many successes but a rejection adds one failure: without a cap a few
            # good steps would outweigh a run of bad ones for dozens of steps.
            scale = max_tested / self.tested
            self.accepted *= scale
            self.tested = max_tested


# (field, the type a stored value is coerced to) for rebuilding a DecoderEstimate from a plain dict
_ESTIMATE_FIELDS = tuple(
    (f, {"decoder": str, "rank": int, "last_observed_step": int}.get(f.name, float))
    for f in dataclasses.fields(DecoderEstimate)
)


@dataclasses.dataclass(slots=True)
class ControllerState:
    """Per-request controller state; `to_dict()` is what the gateway stores in Redis."""

    task_type: TaskType
    estimates: list[DecoderEstimate]
    num_steps: int = 0
    is_speculating: bool = True
    last_probe_step: int = 0
    other_rows: float = 0.0  # rows the primary's steps carry besides this request's, smoothed
    num_failed_probes: int = 0  # probes since speculation was last on (each doubles the next wait)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "task_type": self.task_type.value,
            "num_steps": self.num_steps,
            "is_speculating": self.is_speculating,
            "last_probe_step": self.last_probe_step,
            "other_rows": self.other_rows,
            "num_failed_probes": self.num_failed_probes,
            "estimates": [{f.name: getattr(e, f.name) for f, _ in _ESTIMATE_FIELDS} for e in self.estimates],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ControllerState:
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"controller state version must be {STATE_VERSION}, got {data.get('version')!r}")
        try:
            estimates = [
                DecoderEstimate(**{f.name: f_type(row[f.name]) for f, f_type in _ESTIMATE_FIELDS})
                for row in data["estimates"]
            ]
            return cls(
                task_type=TaskType(data["task_type"]),
                estimates=estimates,
                num_steps=int(data["num_steps"]),
                is_speculating=bool(data["is_speculating"]),
                last_probe_step=int(data["last_probe_step"]),
                other_rows=max(0.0, float(data.get("other_rows", 0.0))),  # absent: stored before it was kept
                num_failed_probes=max(0, int(data.get("num_failed_probes", 0))),  # likewise
            )
        except KeyError as e:
            raise ValueError(f"controller state lacks field {e.args[0]!r}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculationPlan:
    """What the next step drafts. No sources (or draft_length 0) means a plain, non-speculative step.

    The pool asks each decoder for `num_candidates(decoder)` candidates, keeps the listed ranks and
    orders the tree's candidates as `sources` lists them (best first)."""

    draft_length: int = 0
    sources: tuple[tuple[str, int], ...] = ()  # (decoder, rank), best first
    max_tree_nodes: int = 0  # node budget for build_token_tree
    expected_accepted_length: float = 1.0  # bonus token included
    # of the best speculative plan the model found, also when it lost (< 1) and this step is plain
    expected_speedup: float = 1.0
    is_probe: bool = False  # drafts chosen to re-measure acceptance, not because they pay

    @property
    def speculative_degree(self) -> int:
        return len(self.sources)

    @property
    def is_speculative(self) -> bool:
        return self.draft_length > 0 and bool(self.sources)

    def num_candidates(self, decoder: str) -> int:
        return 1 + max((rank for name, rank in self.sources if name == decoder), default=-1)


@dataclasses.dataclass(frozen=True, slots=True)
class _Choice:
    sources: tuple[int, ...]  # indices into the estimates, best first
    draft_length: int
    expected_accepted_length: float
    expected_speedup: float


def expected_accepted_length(alpha: float, gamma: int) -> float:
    """Leviathan et al. 2023, eq. 1: (1 - alpha^(gamma+1)) / (1 - alpha), bonus token included."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


LOAD_STEP_BELOW, LOAD_GRID_FROM, LOAD_GRID = 0.5, 8.0, 1.1  # the load a plan is made for, see load_bucket


def load_bucket(other_rows: float) -> float:
    """`other_rows` as the plan takes it: to the nearest half row below 8 rows, in 10 % steps above
    (0 stays 0, a whole count stays itself below 8)."""
    if not other_rows > 0.0:
        return 0.0
    if other_rows < LOAD_GRID_FROM:
        return round(other_rows / LOAD_STEP_BELOW) * LOAD_STEP_BELOW
    return LOAD_GRID_FROM * LOAD_GRID ** round(math.log(other_rows / LOAD_GRID_FROM) / math.log(LOAD_GRID))


@dataclasses.dataclass(frozen=True, slots=True)
class _DecoderArrays:
    """What each (decoder, rank) s of a request adds to a step's cost at each draft length g, and how
    the ranks chain: fixed for a cost model and the request's decoders, so made once for both."""

    draft: np.ndarray  # [G, S] its decoder's draft cost
    extra_rows: np.ndarray  # [S] its decoder's extra verify rows (lookahead's window)
    decoder_of: np.ndarray  # [S] index of its decoder among num_decoders
    prev_rank: np.ndarray  # [S] index of the same decoder's rank r - 1 (0 for rank 0: see is_first_rank)
    is_first_rank: np.ndarray  # [S] rank 0 (nothing to follow)
    num_decoders: int


@functools.lru_cache(maxsize=256)
def _decoder_arrays(
    cost_model: CostModel, keys: tuple[tuple[str, int], ...], gammas: tuple[int, ...]
) -> _DecoderArrays:
    """_DecoderArrays of the (decoder, rank)s `keys` under `cost_model` at the draft lengths `gammas`.
    Remembered: every plan of every request asks (the Python calls of the [G, S] costs were a
    quarter of a plan's time), and the inputs change only with the cost model."""
    decoder_names = sorted({decoder for decoder, _ in keys})
    key_index = {key: s for s, key in enumerate(keys)}
    prev_rank = np.array([key_index.get((decoder, rank - 1), -1) for decoder, rank in keys])
    arrays = _DecoderArrays(
        draft=np.array([[cost_model.draft(decoder, g) for decoder, _ in keys] for g in gammas], dtype=np.float64),
        extra_rows=np.array([float(cost_model.extra_rows(decoder)) for decoder, _ in keys]),
        decoder_of=np.array([decoder_names.index(decoder) for decoder, _ in keys]),
        prev_rank=np.maximum(prev_rank, 0),
        is_first_rank=prev_rank < 0,
        num_decoders=len(decoder_names),
    )
    for a in (arrays.draft, arrays.extra_rows, arrays.decoder_of, arrays.prev_rank, arrays.is_first_rank):
        a.flags.writeable = False  # shared by every caller
    return arrays


@functools.lru_cache(maxsize=8)
def _depths(num_depths: int) -> np.ndarray:
    depths = np.arange(num_depths, dtype=np.float64)
    depths.flags.writeable = False
    return depths


def _reach(
    estimates: list[DecoderEstimate], gammas: np.ndarray, known_coverage: Mapping[tuple[str, int], float]
) -> tuple[np.ndarray, np.ndarray]:
    """(reach [G, S, J]: the chance that s's candidate reaches depth j + 1 and is accepted there,
    nodes [G, S]: the nodes it is expected to add), at every draft length g (J = the longest)."""
    depth = _depths(int(gammas.max()))  # [J], depth j + 1
    alpha = np.array([e.acceptance for e in estimates])  # [S]
    coverage = np.array([known_coverage.get((e.decoder, e.rank), e.coverage) for e in estimates])  # [S]
    lengths = np.array([e.fill for e in estimates]) * gammas[:, None]  # [G, S] expected candidate lengths
    # reach[g, s, j] = c_s * alpha_s^(j+1) * [j + 1 <= f_s * gamma_g], the last partial token pro rata
    # (np.minimum(np.maximum(.)) is np.clip's arithmetic without its Python-level dispatch)
    reach = (coverage[:, None] * alpha[:, None] ** (depth + 1))[None] * np.minimum(
        np.maximum(lengths[:, :, None] - depth, 0.0), 1.0
    )  # [G, S, J]
    return reach, coverage * lengths


def _best_choice(
    estimates: list[DecoderEstimate],
    cost_model: CostModel,
    config: ControllerConfig,
    known_coverage: Mapping[tuple[str, int], float] | None = None,
    other_rows: float = 0.0,
) -> _Choice:
    """Greedy selection for every c.draft length at once (G lengths, S estimates, J = max length depths).

    For each length, add the estimate that raises the speedup most while it does (rank r of a decoder
    only after rank r - 1); then keep the best length. A length stops growing at the first round
    that does not improve it (its state no longer changes, so later rounds cannot either).
    `known_coverage` replaces the estimated coverage of the (decoder, rank)s it names for this step;
    `other_rows` is the load R of the module docstring.
    """
    if not (num_sources := len(estimates)):
        return _Choice((), 0, 1.0, 1.0)
    gammas = np.array(config.draft_length_choices, dtype=np.float64)  # [G]
    c = _decoder_arrays(cost_model, tuple((e.decoder, e.rank) for e in estimates), tuple(config.draft_length_choices))
    reach, nodes = _reach(estimates, gammas, known_coverage or {})
    unreached = 1.0 - reach  # [G, S, J]
    load = max(0.0, other_rows)
    plain_step = float(cost_model.verify(load + 1.0)) + cost_model.plain_overhead
    grid = np.arange(len(gammas))
    miss = np.ones((len(gammas), reach.shape[2]))  # [G, J] chance that no chosen candidate reaches depth j + 1
    chosen = np.zeros((len(gammas), num_sources), dtype=bool)  # [G, S]
    is_used = np.zeros((len(gammas), c.num_decoders), dtype=bool)  # [G, D] decoders already paid for
    num_nodes, draft_cost, num_extra = np.zeros(len(gammas)), np.zeros(len(gammas)), np.zeros(len(gammas))  # [G]
    speedup, accepted_length = np.zeros(len(gammas)), np.ones(len(gammas))  # [G]
    order: list[list[int]] = [[] for _ in gammas]
    for _ in range(min(config.max_speculative_degree, num_sources)):
        new_nodes = num_nodes[:, None] + nodes  # [G, S]
        # Only what the node budget holds: the pool cuts a larger tree to max_tree_nodes, so the depths
        # past the budget would be counted as gained while the verify never sees them.
        is_eligible = ~chosen & (c.is_first_rank | chosen[:, c.prev_rank]) & (new_nodes <= config.max_tree_nodes)
        new_miss = miss[:, None, :] * unreached  # [G, S, J]
        new_length = 1.0 + (1.0 - new_miss).sum(axis=2)  # [G, S], bonus token included
        is_paid = is_used[:, c.decoder_of]  # [G, S]
        new_draft = draft_cost[:, None] + np.where(is_paid, 0.0, c.draft)  # [G, S]
        new_extra = num_extra[:, None] + np.where(is_paid, 0.0, c.extra_rows)  # [G, S]
        step = cost_model.speculative_overhead + new_draft + cost_model.verify(load + 1.0 + new_nodes + new_extra)
        gain = (load + new_length) / (load + 1.0)  # [G, S]: the step's tokens against a plain step's
        new_speedup = np.where(is_eligible, gain * plain_step / step, -np.inf)  # [G, S]
        pick = new_speedup.argmax(axis=1)  # [G]
        is_better = new_speedup[grid, pick] > speedup  # [G]; a length whose best addition loses stops
        if not is_better.any():
            break
        rows, cols = grid[is_better], pick[is_better]
        chosen[rows, cols] = True
        is_used[rows, c.decoder_of[cols]] = True
        miss[rows] = new_miss[rows, cols]
        num_nodes[rows], draft_cost[rows] = new_nodes[rows, cols], new_draft[rows, cols]
        num_extra[rows] = new_extra[rows, cols]
        speedup[rows], accepted_length[rows] = new_speedup[rows, cols], new_length[rows, cols]
        for g, s in zip(rows.tolist(), cols.tolist()):
            order[g].append(s)
    g = int(speedup.argmax())  # the best speculative plan, even when it loses to plain decoding
    if not order[g]:
        return _Choice((), 0, 1.0, 1.0)
    return _Choice(tuple(order[g]), int(gammas[g]), float(accepted_length[g]), float(speedup[g]))


def _initial_estimates(
    task_type: TaskType,
    decoders: Mapping[str, int],
    config: ControllerConfig,
    memory: AcceptanceMemory | None = None,
) -> list[DecoderEstimate]:
    """Each (decoder, rank) at its prior, worth prior_strength trials: what the gateway's requests
    measured of it on this task type (gateway.acceptance_memory) where they have, else the fixed one."""
    estimates = []
    for decoder, num_ranks in decoders.items():
        if num_ranks < 1:
            raise ValueError(f"decoders[{decoder!r}] must be >= 1 candidates, got {num_ranks}")
        for rank in range(num_ranks):
            learned = None if memory is None else memory.prior(task_type, decoder, rank)
            prior = config.prior_acceptance(task_type, rank, decoder) if learned is None else learned.acceptance
            coverage = config.prior_coverage if learned is None else learned.coverage
            fill = 1.0 if learned is None else learned.fill
            proposed = config.prior_strength * coverage
            estimates.append(
                DecoderEstimate(
                    decoder=decoder,
                    rank=rank,
                    prior_acceptance=prior,
                    accepted=config.prior_strength * prior,
                    tested=config.prior_strength,
                    proposed_steps=proposed,
                    asked_steps=config.prior_strength,
                    filled=proposed * fill,
                )
            )
    return estimates


def _task_type(value: TaskType | str) -> TaskType:
    try:
        return TaskType(value)
    except ValueError:
        raise ValueError(f"task_type {value!r} is not one of {[t.value for t in TaskType]}") from None


def _plan_from(
    choice: _Choice, estimates: list[DecoderEstimate], config: ControllerConfig, extra: tuple[tuple[str, int], ...] = ()
) -> SpeculationPlan:
    sources = tuple((estimates[s].decoder, estimates[s].rank) for s in choice.sources) + extra
    return SpeculationPlan(
        draft_length=choice.draft_length,
        sources=sources,
        max_tree_nodes=min(config.max_tree_nodes, len(sources) * choice.draft_length),
        expected_accepted_length=choice.expected_accepted_length,
        expected_speedup=choice.expected_speedup,
        is_probe=bool(extra),
    )


def adjust_speculative_degree(
    task_type: TaskType | str,
    current_acceptance: float | Mapping[tuple[str, int], float] | None = None,
    *,
    decoders: Mapping[str, int],
    cost_model: CostModel,
    config: ControllerConfig | None = None,
) -> SpeculationPlan:
    """One-shot plan for a task type and the current alpha (one number for every rank-0 decoder, or
    per (decoder, rank); None: the task type's prior). Stateless: no hysteresis, no probing."""
    config = config or ControllerConfig()
    estimates = _initial_estimates(_task_type(task_type), decoders, config)
    if current_acceptance is not None:
        for e in estimates:
            alpha = (
                current_acceptance.get((e.decoder, e.rank), e.prior_acceptance)
                if isinstance(current_acceptance, Mapping)
                else current_acceptance * config.rank_prior_decay**e.rank
            )
            e.accepted = alpha * e.tested
    choice = _best_choice(estimates, cost_model, config)
    if not choice.sources or choice.expected_speedup < config.off_below:
        return SpeculationPlan(expected_speedup=choice.expected_speedup)
    return _plan_from(choice, estimates, config)


class AdaptiveController:
    """The per-request loop: plan() before each step, observe() after it; state lives in the caller."""

    def __init__(
        self,
        cost_model: CostModel,
        config: ControllerConfig | None = None,
        memory: AcceptanceMemory | None = None,
    ) -> None:
        self._cost_model = cost_model
        self._config = config or ControllerConfig()
        # The gateway's requests' evidence: new requests' priors, and where this one's steps go too.
        self._memory = memory
        # The last choices, by everything _best_choice reads (one controller serves every request of
        # a gateway): a plain step changes none of it, so a request that is not speculating, and
        # requests alike, do not pay the optimisation (~0.3-0.7 ms of numpy) every step.
        self._choices: collections.OrderedDict[tuple, _Choice] = collections.OrderedDict()
        self._choices_lock = threading.Lock()

    def _choice(self, state: ControllerState, known_coverage: Mapping[tuple[str, int], float]) -> _Choice:
        """_best_choice for the state, remembered for the MAX_REMEMBERED_CHOICES latest inputs. The
        load is taken on a grid (`load_bucket`): the smoothed row count moves every step under load,
        and keyed exactly, no step there found its choice remembered."""
        load = load_bucket(state.other_rows)
        key = (
            tuple((e.decoder, e.rank, e.acceptance, e.coverage, e.fill) for e in state.estimates),
            tuple(sorted(known_coverage.items())),
            load,
        )
        with self._choices_lock:
            choice = self._choices.get(key)
            if choice is not None:
                self._choices.move_to_end(key)
                return choice
        model = self._cost_model
        choice = _best_choice(state.estimates, model, self._config, known_coverage, load)
        with self._choices_lock:
            if model is not self._cost_model:  # replaced meanwhile: this choice is of the old model
                return choice
            self._choices[key] = choice
            while len(self._choices) > MAX_REMEMBERED_CHOICES:
                self._choices.popitem(last=False)
        return choice

    def new_state(self, task_type: TaskType | str, decoders: Mapping[str, int]) -> ControllerState:
        """decoders: name -> how many ranked candidates it can give per step (1 for most strategies)."""
        for decoder in decoders:
            self._cost_model.draft(decoder, 1)  # fail now, naming the decoder, not mid-request
        task = _task_type(task_type)
        return ControllerState(task_type=task, estimates=_initial_estimates(task, decoders, self._config, self._memory))

    @property
    def cost_model(self) -> CostModel:
        return self._cost_model

    def set_cost_model(self, cost_model: CostModel) -> None:
        """Plan with `cost_model` from now on (the gateway's measured overheads, gateway.step_costs);
        the remembered choices were made with the old one and are dropped."""
        if cost_model == self._cost_model:
            return
        with self._choices_lock:
            self._cost_model = cost_model
            self._choices.clear()

    def plan(
        self, state: ControllerState, known_coverage: Mapping[tuple[str, int], float] | None = None
    ) -> SpeculationPlan:
        """The next step's plan. `known_coverage`: (decoder, rank) -> the chance it proposes this
        step, where the caller knows better than the estimate. The gateway knows that grammar-forced
        drafts propose nothing inside free text (a string's contents, a number: coverage 0). A
        (decoder, rank) known silent is neither planned, probed nor counted as a miss, so its
        estimate describes the steps it can draft: a structured request drafts its forced text
        (keys, `": "`) whenever it comes, rather than averaging it with the free text between."""
        config, estimates = self._config, state.estimates
        known_coverage = known_coverage or {}
        silent = {key for key, coverage in known_coverage.items() if coverage <= 0.0}
        choice = self._choice(state, known_coverage)
        if state.is_speculating and (not choice.sources or choice.expected_speedup < config.off_below):
            state.is_speculating = False
            state.last_probe_step = state.num_steps
        elif not state.is_speculating and choice.sources and choice.expected_speedup >= config.on_above:
            state.is_speculating = True
            state.num_failed_probes = 0
        if state.is_speculating:
            # At the degree bound a ride-along takes the weakest source's place for that step.
            kept = choice.sources[: config.max_speculative_degree - 1]
            extra = self._stale_source(
                state, kept if len(kept) < len(choice.sources) else choice.sources, choice.draft_length, silent
            )
            if extra and len(kept) < len(choice.sources):
                choice = dataclasses.replace(choice, sources=kept)
            return _plan_from(choice, estimates, config, extra)
        if state.num_steps - state.last_probe_step < self._probe_wait(state):
            return SpeculationPlan(expected_speedup=choice.expected_speedup)
        sources = self._probe_sources(state, silent)
        if not sources:  # only expensive decoders: staying off is what the cost model chose
            return SpeculationPlan(expected_speedup=choice.expected_speedup)
        state.last_probe_step = state.num_steps
        state.num_failed_probes += 1  # until a plan turns speculation on
        gamma = config.probe_draft_length
        return SpeculationPlan(
            draft_length=gamma,
            sources=sources,
            max_tree_nodes=min(config.max_tree_nodes, len(sources) * gamma),
            expected_speedup=choice.expected_speedup,
            is_probe=True,
        )

    def would_draft(
        self, state: ControllerState, known_coverage: Mapping[tuple[str, int], float] | None = None
    ) -> bool:
        """Whether plan() would draft now with `known_coverage`, without planning (the state is left
        as it is): speculation is on, or the best choice turns it on. A probe due is not counted."""
        if state.is_speculating:
            return True
        choice = self._choice(state, known_coverage or {})
        return bool(choice.sources) and choice.expected_speedup >= self._config.on_above

    def would_draft_with(
        self, state: ControllerState, known_coverage: Mapping[tuple[str, int], float], decoders: Iterable[str]
    ) -> bool:
        """Whether plan() under `known_coverage` would draft with one of `decoders`: in the best choice
        while speculation is on (or the choice turns it on), or riding along; the state is left as it is."""
        choice = self._choice(state, known_coverage)
        if not choice.sources or not (state.is_speculating or choice.expected_speedup >= self._config.on_above):
            return False
        names = frozenset(decoders)
        if any(state.estimates[s].decoder in names for s in choice.sources):
            return True
        silent = {key for key, coverage in known_coverage.items() if coverage <= 0.0}
        kept = choice.sources[: self._config.max_speculative_degree - 1]
        riding = self._stale_source(
            state, kept if len(kept) < len(choice.sources) else choice.sources, choice.draft_length, silent
        )
        return any(decoder in names for decoder, _ in riding)

    def plain_steps_ahead(
        self, state: ControllerState, known_coverage: Mapping[tuple[str, int], float] | None = None
    ) -> int:
        """Plain steps that plan() will return from now on, this one included, if nothing new is
        observed meanwhile (the plans change with observations only): 0 while speculating, else the
        steps left before the next probe, at least 1; NEVER_DRAFTS when no probe will come. The
        gateway decodes that many tokens in one run without delaying a draft the controller wants."""
        if state.is_speculating:
            return 0
        silent = {key for key, coverage in (known_coverage or {}).items() if coverage <= 0.0}
        if not self._probe_sources(state, silent):
            return NEVER_DRAFTS
        return max(1, state.last_probe_step + self._probe_wait(state) - state.num_steps)

    def _probe_wait(self, state: ControllerState) -> int:
        """Steps from one probe to the next while off: probe_interval() doubled per failed probe, and
        never fewer than a probe's own cost asks for (_probe_spread)."""
        backoff = min(2 ** min(state.num_failed_probes, 30), self._config.max_probe_backoff)
        return max(self.probe_interval(state.other_rows) * backoff, self._probe_spread(state))

    def _probe_spread(self, state: ControllerState) -> int:
        """Steps a probe must be spread over so that a failed one costs its request at most
        max_probe_overhead of its time. A probe step costs speculative_overhead + its drafts + a
        verify over the root and its expected nodes (coverage x fill x gamma per decoder), where the
        plain step it replaces costs verify(1) + plain_overhead and gives the one token a failed
        probe gives too. E.g. speculative overhead 1.0 forward, 5 rows at 1.3, plain step 1.05:
        a probe loses 1.25 steps, at 2 % spread over 60 steps."""
        config, m = self._config, self._cost_model
        gamma = config.probe_draft_length
        probed = [e for e in state.estimates if e.rank == 0 and self._is_cheap_probe(e.decoder, gamma)]
        probed = probed[: config.max_speculative_degree]
        if not probed:
            return 0
        nodes = sum(e.coverage * e.fill * gamma for e in probed)
        rows = 1.0 + nodes + sum(m.extra_rows(e.decoder) for e in probed)
        drafts = sum(m.draft(e.decoder, gamma) for e in probed)
        loss = m.speculative_overhead + drafts + float(m.verify(rows)) - m.plain_step
        if loss <= 0.0:
            return 0
        return math.ceil(loss / (config.max_probe_overhead * m.plain_step))

    def _probe_sources(self, state: ControllerState, silent: set[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
        """What a probe drafts: every cheap decoder's first rank not known silent."""
        gamma = self._config.probe_draft_length
        return tuple(
            (e.decoder, 0)
            for e in state.estimates
            if e.rank == 0 and (e.decoder, 0) not in silent and self._is_cheap_probe(e.decoder, gamma)
        )[: self._config.max_speculative_degree]

    def probe_interval(self, other_rows: float) -> int:
        """Steps between probes while speculation is off, with `other_rows` of other requests in the
        primary's steps (R). A probe's gamma rows lengthen the step that R other requests share by
        d = verify(R + 1 + gamma) - verify(R + 1); with every request probing once every n steps a
        step carries (R + 1) / n probes on average, which make the others wait R d / (n verify(R + 1))
        of the time. n is the smallest interval that keeps this under max_shared_probe_overhead,
        never below probe_interval (what a probe costs its own request is _is_cheap_probe's bound):
        unloaded nothing changes; once every row costs another request's token, probes grow rare."""
        config, m = self._config, self._cost_model
        load = max(0.0, other_rows)
        step = float(m.verify(load + 1.0))
        extra = float(m.verify(load + 1.0 + config.probe_draft_length)) - step
        if load <= 0.0 or step <= 0.0 or extra <= 0.0:
            return config.probe_interval
        needed = load * extra / (config.max_shared_probe_overhead * step)
        return max(config.probe_interval, math.ceil(needed))

    def observe_load(self, state: ControllerState, other_rows: float) -> None:
        """Other requests' rows in the primary's step that ran this request's last pass: smoothed,
        the load the next plans weigh."""
        if not other_rows >= 0.0:  # negative or NaN: not a row count
            raise ValueError(f"other_rows must be >= 0, got {other_rows}")
        state.other_rows += self._config.load_smoothing * (float(other_rows) - state.other_rows)

    def _is_cheap_probe(self, decoder: str, draft_length: int) -> bool:
        m, rows = self._cost_model, 1 + draft_length
        extra_verify = float(m.verify(rows + m.extra_rows(decoder)) - m.verify(rows))
        amortised = (m.draft(decoder, draft_length) + extra_verify) / self._config.probe_interval
        return amortised <= self._config.max_probe_overhead

    def _stale_source(
        self,
        state: ControllerState,
        kept: tuple[int, ...],
        draft_length: int,
        silent: set[tuple[str, int]] | frozenset[tuple[str, int]] = frozenset(),
    ) -> tuple[tuple[str, int], ...]:
        """The cheap (decoder, rank) left out longest, when it has been out for probe_interval steps
        and can join `kept` (rank r only next to rank r - 1, so the pool's rank convention holds);
        never one of `silent`, known to propose nothing this step."""
        in_plan = {(state.estimates[s].decoder, state.estimates[s].rank) for s in kept}
        stale = [
            e
            for s, e in enumerate(state.estimates)
            if s not in kept
            and (e.decoder, e.rank) not in silent
            and (e.rank == 0 or (e.decoder, e.rank - 1) in in_plan)
            and state.num_steps - e.last_observed_step >= self._config.probe_interval
            and ((e.decoder, 0) in in_plan or self._is_cheap_probe(e.decoder, draft_length))
        ]
        if not stale:
            return ()
        oldest = min(stale, key=lambda e: e.last_observed_step)
        return ((oldest.decoder, oldest.rank),)

    def observe(
        self, state: ControllerState, plan: SpeculationPlan, outcomes: Iterable[CandidateOutcome], num_steps: int = 1
    ) -> None:
        """Record one finished step (or `num_steps` plain ones: a run's message). Planned sources
        without an outcome proposed nothing."""
        if not plan.is_speculative:
            state.num_steps += num_steps
            return
        by_key = {(e.decoder, e.rank): e for e in state.estimates}
        results = {key: (0, 0) for key in plan.sources}
        for outcome in outcomes:
            results[outcome.decoder, outcome.rank] = (outcome.num_proposed, outcome.num_accepted)
            if not 0 <= outcome.num_accepted <= outcome.num_proposed:
                raise ValueError(
                    f"outcome for {outcome.decoder!r}: need 0 <= num_accepted <= num_proposed, "
                    f"got {outcome.num_accepted}, {outcome.num_proposed}"
                )
        for decoder, rank in results:
            if (decoder, rank) not in by_key:
                raise ValueError(f"decoder {decoder!r} rank {rank} is not tracked by this request's controller")
        state.num_steps += 1  # only now: a rejected observation leaves the state untouched
        decay = self._config.decay_per_step
        for key, (num_proposed, num_accepted) in results.items():
            estimate = by_key[key]
            estimate.record(
                decay ** (state.num_steps - estimate.last_observed_step),
                num_proposed,
                num_accepted,
                plan.draft_length,
                self._config.max_evidence_tokens,
            )
            estimate.last_observed_step = state.num_steps
            if self._memory is not None:
                self._memory.record(
                    state.task_type, estimate.decoder, estimate.rank, num_proposed, num_accepted, plan.draft_length
                )
