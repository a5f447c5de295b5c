"""The draft pool with the prediction decoder: the prediction arrives once, with the first Propose,
and drafts follow the output as it grows; requests without one get an empty candidate."""

from __future__ import annotations

import pytest

from draft_svc.pool import DraftPool, PoolConfig
from specdec.propose_args import ProposeArgs
from draft_svc.strategies import model_free_registry, prediction_registry
from draft_svc.strategies.base import DecoderRegistry
from specdec.errors import InvalidArgument

VOCAB = 100
PROMPT = (1, 2, 3)


class Models:
    def current_model(self):
        return None

    def vocab_size(self) -> int | None:
        return VOCAB

    def max_context_length(self) -> int | None:
        return None


@pytest.fixture
def pool() -> DraftPool:
    config = PoolConfig(strategies=("prompt_lookup", "prediction"), default_strategies=("prompt_lookup",))
    return DraftPool(config, model_free_registry(), DecoderRegistry(), Models(), prediction_based=prediction_registry())


def candidate_tokens(proposal, decoder: str) -> tuple[int, ...]:
    """The tokens of `decoder`'s chain in the tree (each decoder proposes one chain here)."""
    bit = 1 << proposal.tree.decoders.index(decoder)
    return tuple(t for t, s in zip(proposal.tree.token_ids, proposal.tree.node_sources) if s & bit)


def test_the_prediction_drafts_from_the_first_propose_and_follows_the_output(pool):
    prediction = (40, 41, 42, 43, 44, 45, 46, 47)
    args = ProposeArgs("r", prompt_token_ids=PROMPT, strategies=("prediction",), draft_length=4)
    first = pool.propose(ProposeArgs(**{**_fields(args), "prediction_token_ids": prediction}))
    assert first.tree.token_ids == (40, 41, 42, 43)
    # the primary accepted 40, 41 and wrote 50 instead of 42; then the prediction resumes at 43
    second = pool.propose(ProposeArgs("r", new_token_ids=(40, 41, 50, 43), strategies=("prediction",), draft_length=4))
    assert second.tree.token_ids == (44, 45, 46, 47)


def test_a_model_free_rank_zero_prediction_returns_its_continuation_past_the_draft(pool):
    prediction = tuple(range(40, 60))
    proposal = pool.propose(
        ProposeArgs(
            "r",
            prompt_token_ids=PROMPT,
            strategies=("prediction",),
            draft_length=4,
            continuation_length=8,
            prediction_token_ids=prediction,
        )
    )
    assert proposal.tree.token_ids == (40, 41, 42, 43)
    assert [(c.leaf, c.token_ids, c.decoder) for c in proposal.continuations] == [
        (3, tuple(range(44, 52)), "prediction")
    ]


def test_a_request_without_a_prediction_gets_an_empty_prediction_candidate(pool):
    proposal = pool.propose(
        ProposeArgs("r", prompt_token_ids=(5, 6, 5), strategies=("prompt_lookup", "prediction"), draft_length=2)
    )
    assert proposal.tree.decoders == ("prompt_lookup", "prediction")
    assert candidate_tokens(proposal, "prediction") == ()
    assert candidate_tokens(proposal, "prompt_lookup") == (6, 5)


def test_a_reopened_request_catches_up_on_the_committed_output(pool):
    prediction = (40, 41, 42, 43, 44)
    proposal = pool.propose(
        ProposeArgs(
            "r",
            prompt_token_ids=PROMPT,
            new_token_ids=(40, 41),
            strategies=("prediction",),
            draft_length=8,
            prediction_token_ids=prediction,
        )
    )
    assert proposal.tree.token_ids == (42, 43, 44)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prediction_token_ids": (1, VOCAB)}, "outside the vocabulary"),
        ({"prediction_token_ids": (1, -1)}, "outside the vocabulary"),
        ({"prompt_token_ids": (), "prediction_token_ids": (1,)}, "first Propose"),
    ],
)
def test_bad_predictions_are_refused_naming_the_field(pool, change, message):
    pool.propose(ProposeArgs("open", prompt_token_ids=PROMPT, strategies=("prediction",)))
    args = {**_fields(ProposeArgs("open", prompt_token_ids=PROMPT, strategies=("prediction",))), **change}
    with pytest.raises(InvalidArgument, match=message) as e:
        pool.propose(ProposeArgs(**args))
    assert e.value.field == "prediction_token_ids"


def test_a_prediction_longer_than_the_context_bound_is_refused():
    config = PoolConfig(strategies=("prediction",), default_strategies=("prediction",), max_context_tokens=8)
    pool = DraftPool(config, model_free_registry(), DecoderRegistry(), Models(), prediction_based=prediction_registry())
    with pytest.raises(InvalidArgument, match="longer than 8 tokens"):
        pool.propose(ProposeArgs("r", prompt_token_ids=PROMPT, prediction_token_ids=tuple(range(9))))


def _fields(args: ProposeArgs) -> dict:
    return {name: getattr(args, name) for name in ProposeArgs.__dataclass_fields__}
