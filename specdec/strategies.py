"""The draft strategies: their names, and what the services beside the draft pool know of each.

The draft pool implements them (draft_svc/strategies/, one decoder class and one `register` call
each; tests/draft_svc/test_strategies.py checks that the pool's decoders and this list name the same
strategies); the gateway accepts a request's strategies from this list and prices them with its
costs; the launcher and compose pass names from it. Adding a strategy is one entry here plus its
decoder in the pool.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from specdec.controller_defaults import LOOKAHEAD_ROWS

# What a strategy runs on, which decides what the pool needs before it can offer it.
MODEL_FREE = "model_free"  # the request's own tokens or a shared index: nothing from the primary
GRAMMAR = "grammar"  # the model's tokenizer and a compiled response_format: constrained requests only
MODEL = "model"  # the primary's weights, attached zero-copy
PREDICTION = "prediction"  # the request's predicted output (GenerateRequest.prediction): such requests only
KINDS = (MODEL_FREE, GRAMMAR, MODEL, PREDICTION)


@dataclasses.dataclass(frozen=True, slots=True)
class DraftCost:
    """A decoder's cost per step, in 1-token primary forwards (prompt lookup ~0; early exit ~0.6-0.9 a token),
    and the rows it adds to the verify beside its candidates' nodes (lookahead's Jacobi window),
    priced by the verify curve with the tree's."""

    fixed: float = 0.0
    per_token: float = 0.0
    extra_rows: int = 0

    def __post_init__(self) -> None:
        if self.fixed < 0 or self.per_token < 0 or self.extra_rows < 0:
            raise ValueError(
                f"draft costs must be >= 0, got fixed={self.fixed}, per_token={self.per_token}, "
                f"extra_rows={self.extra_rows}"
            )

    def at(self, num_tokens: int) -> float:
        """The cost of a Propose drafting num_tokens tokens per candidate."""
        return self.fixed + self.per_token * num_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    kind: str  # one of KINDS
    cost: DraftCost  # the gateway's default estimate (gateway/cost_model.py), before anything is measured

    def __post_init__(self) -> None:
        if not self.name or "," in self.name:
            raise ValueError(f"a strategy name must be non-empty without commas, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")


# Costs: model-free decoders take microseconds (~0.1 ms of a ~40 ms CPU step); the corpus decoder's
# longest-match search over a 2M-token memory-mapped suffix array ~0.3-0.4 ms (a few binary
# searches and a vote; specdec/suffix_array.py); grammar-forced drafts a jump-forward
# query and a re-tokenization per spelling (its ranks), plus a packed mask row per tree node in the
# gateway (~0.2 ms in all; a rank's extra nodes are priced by the verify curve like any candidate's);
# self-drafting over the shared weights costs 0.6-0.9 of a full step per drafted token without
# fine-tuning (docs/architecture.md, Measurements); lookahead's n-gram pool lookup costs
# microseconds, its Jacobi window LOOKAHEAD_ROWS verify rows (draft_svc/strategies/lookahead.py).
# The feature drafter (EAGLE-style: a learned decoder layer over the primary's own last hidden
# states, draft_svc/heads/): a request naming it has the primary return its features with each
# Prefill and Verify, and the gateway forwards them to the pool with the next Propose
# (specdec/features.py).
FEATURE_STRATEGY = "feature"
PROMPT_LOOKUP_STRATEGY = "prompt_lookup"
STRATEGIES: tuple[Strategy, ...] = (
    Strategy(PROMPT_LOOKUP_STRATEGY, MODEL_FREE, DraftCost(fixed=0.002)),
    Strategy("suffix_index", MODEL_FREE, DraftCost(fixed=0.004)),
    # needs the model's tokenizer and a corpus index (built on first use, draft_svc/corpus/)
    Strategy("corpus", MODEL_FREE, DraftCost(fixed=0.01)),
    Strategy("lookahead", MODEL_FREE, DraftCost(fixed=0.002, extra_rows=LOOKAHEAD_ROWS)),
    Strategy("grammar", GRAMMAR, DraftCost(fixed=0.005)),
    Strategy("early_exit", MODEL, DraftCost(per_token=0.75)),
    Strategy("layer_skip", MODEL, DraftCost(per_token=0.85)),
    # EAGLE-2 trees from a trained feature drafter (draft_svc/strategies/feature.py): one small layer
    # and the N-row head per depth; offered only where its file loads for the attached model
    Strategy(FEATURE_STRATEGY, MODEL, DraftCost(per_token=0.05)),
    # Predicted Outputs: the request's own prediction aligned to the output (draft_svc/strategies/
    # prediction.py), a dict lookup per committed token; the gateway adds it to every request that
    # carries a prediction
    Strategy("prediction", PREDICTION, DraftCost(fixed=0.002)),
)
NAMES = tuple(s.name for s in STRATEGIES)
GRAMMAR_STRATEGY = "grammar"  # grammar-forced drafts; the gateway adds them to constrained requests
PREDICTION_STRATEGY = "prediction"  # drafts from the request's prediction; the gateway adds it to such requests
CORPUS_STRATEGY = "corpus"
# The cheap model-free strategies that need no index built: what every pool offers by default, and
# its defaults for a Propose that names none.
MODEL_FREE_DEFAULTS = ("prompt_lookup", "suffix_index")
# A request that names no strategy (the gateway's --strategies): those, and the feature drafter where
# the pool offers it (its file loaded for the attached model: the gateway keeps the strategies of
# DEFAULTS_WHEN_OFFERED only when GetPoolInfo lists them, gateway/params.py default_strategies). The
# cost model, priced with the drafter's measured cost, decides per request and step whether it runs.
DEFAULT_STRATEGIES = MODEL_FREE_DEFAULTS + (FEATURE_STRATEGY,)
# Offered by the pool beside those without being a default: lookahead costs nothing until a request
# (or the gateway's default set) names it.
LOOKAHEAD_STRATEGY = "lookahead"
FEATURE_STRATEGIES = frozenset({FEATURE_STRATEGY})  # the strategies that read the primary's features
# Decoders that grow one token tree per Propose and return its root-to-leaf paths as ranks 0, 1, ...:
# any number of ranks for the price of one propose (the node budget grows, the drafter calls do not);
# the adaptive controller may plan up to the request's degree of them (gateway/loop.py).
TREE_STRATEGIES = FEATURE_STRATEGIES
DEFAULTS_WHEN_OFFERED = FEATURE_STRATEGIES  # defaults only where a pool offers them (see DEFAULT_STRATEGIES)
# Strategies whose Propose the pool measures once the primary's weights attach (draft_svc/costs.py,
# GetPoolInfo.draft_costs); the gateway's cost model prices them by that.
MEASURED_STRATEGIES = FEATURE_STRATEGIES


def consumes_features(names: Iterable[str]) -> bool:
    """Whether any of `names` reads the primary's features (the primary then computes them)."""
    return not FEATURE_STRATEGIES.isdisjoint(names)


def names_of(kind: str) -> tuple[str, ...]:
    return tuple(s.name for s in STRATEGIES if s.kind == kind)


def check_names(names: Iterable[str]) -> None:
    """ValueError naming every strategy that is not in STRATEGIES."""
    if unknown := sorted(set(names) - set(NAMES)):
        raise ValueError(f"unknown strategies {unknown}; known: {NAMES}")
