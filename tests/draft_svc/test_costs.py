"""The draft pool's measured draft costs (draft_svc/costs.py): the line fit on hand-computed points,
a measure of a feature decoder through its public methods, and GetPoolInfo reporting them for the
strategies it offers now."""

from __future__ import annotations

import functools
import types

import pytest
import structlog.testing
import torch

from draft_svc.__main__ import _measure_cost
from draft_svc.costs import DraftCosts, MeasuredCost, fit_cost, measure_propose_ms
from draft_svc.pool import DraftPool, PoolConfig
from draft_svc.priors import validation_acceptance
from draft_svc.server import DraftServicer
from draft_svc.strategies import DecoderRegistry, model_free_registry
from draft_svc.strategies.feature import FeatureDecoder, FeatureTreeConfig
from specdec.v1 import draft_pb2
from tests.draft_svc.tiny_drafter import TINY, tiny_parts


def test_a_line_through_exact_points_is_found():
    cost = fit_cost({1: 3.0, 2: 5.0, 3: 7.0, 6: 13.0})  # 1 + 2 d
    assert (cost.fixed_ms, cost.per_token_ms) == (pytest.approx(1.0), pytest.approx(2.0))
    assert cost.at(4) == pytest.approx(9.0)
    assert dict(cost.depth_ms) == {1: 3.0, 2: 5.0, 3: 7.0, 6: 13.0}


def test_noise_never_makes_a_cost_negative():
    flat = fit_cost({1: 4.0, 2: 3.0, 3: 3.5})  # falls: no per-depth part, the mean
    assert (flat.fixed_ms, flat.per_token_ms) == (pytest.approx(3.5), 0.0)
    steep = fit_cost({1: 1.0, 2: 4.0, 3: 7.0})  # 3 d - 2: through the origin, sum(d ms) / sum(d^2)
    assert steep.fixed_ms == 0.0 and steep.per_token_ms == pytest.approx((1 + 8 + 21) / 14)
    assert fit_cost({4: 2.5}) == MeasuredCost(2.5, 0.0, ((4, 2.5),))
    with pytest.raises(ValueError):
        fit_cost({})
    with pytest.raises(ValueError):
        MeasuredCost(-1.0, 0.0)


def test_a_feature_decoder_is_measured_at_every_depth_and_released():
    decoder = FeatureDecoder(*tiny_parts(), FeatureTreeConfig(top_k=2, beam=2))
    ms = measure_propose_ms(decoder, TINY.vocab_size, TINY.hidden_size, depths=(1, 2, 3), repeats=1, context_tokens=16)
    assert set(ms) == {1, 2, 3} and all(t > 0 for t in ms.values())
    assert decoder.num_kv_bytes == 0 and not decoder.is_current  # released: the synthetic request is gone


def test_a_decoder_that_proposes_nothing_would_be_measured_cheap_so_it_must_be_current():
    """The synthetic request gives the decoder features for every context token: it is current, so
    every measured propose grew a tree (a decoder without features returns () in microseconds)."""
    decoder = FeatureDecoder(*tiny_parts())
    seen = []
    propose = decoder.propose

    def recording(*args, **kwargs):
        seen.append(decoder.is_current)
        out = propose(*args, **kwargs)
        assert out  # a tree, not nothing
        return out

    decoder.propose = recording  # type: ignore[method-assign]
    measure_propose_ms(decoder, TINY.vocab_size, TINY.hidden_size, depths=(2,), repeats=1, context_tokens=8)
    assert seen == [True, True]


def test_a_failed_measure_is_logged_and_leaves_no_cost():
    costs = DraftCosts()
    costs.set("feature", MeasuredCost(1.0, 1.0))

    def broken():
        raise RuntimeError("boom")

    with structlog.testing.capture_logs() as logs:
        _measure_cost(costs, "feature", broken, types.SimpleNamespace(vocab_size=50, hidden_size=32))
    assert costs.items() == () and logs[0]["event"] == "draft_cost_not_measured"
    create = functools.partial(FeatureDecoder, *tiny_parts())
    _measure_cost(costs, "feature", create, types.SimpleNamespace(vocab_size=50, hidden_size=32))
    ((name, cost),) = costs.items()
    assert name == "feature" and cost.per_token_ms >= 0 and len(cost.depth_ms) == 6


class NoModel:
    def current_model(self):
        return None

    def vocab_size(self):
        return 50

    def max_context_length(self):
        return None


def pool_info(refused: set[str], costs: DraftCosts) -> draft_pb2.GetPoolInfoResponse:
    based = DecoderRegistry()
    based.register("feature", lambda model: None)
    pool = DraftPool(
        PoolConfig(strategies=("prompt_lookup", "feature"), default_strategies=("prompt_lookup",)),
        model_free_registry(),
        based,
        NoModel(),
        refusal=lambda name: "trained for another model" if name in refused else None,
    )
    servicer = DraftServicer(pool, attacher=None, costs=costs)  # type: ignore[arg-type]
    return servicer.GetPoolInfo(draft_pb2.GetPoolInfoRequest(), None)


def test_pool_info_carries_the_measured_costs_of_the_strategies_it_offers_now():
    costs = DraftCosts()
    assert list(pool_info(set(), costs).draft_costs) == []  # not attached yet: nothing measured
    costs.set("feature", MeasuredCost(0.5, 1.25))
    info = pool_info(set(), costs)
    assert list(info.strategies) == ["prompt_lookup", "feature"]
    assert [(c.strategy, c.fixed_ms, c.per_token_ms) for c in info.draft_costs] == [("feature", 0.5, 1.25)]
    refused = pool_info({"feature"}, costs)  # e.g. new weights its file was not trained for
    assert list(refused.strategies) == ["prompt_lookup"] and list(refused.draft_costs) == []


def test_the_service_measures_the_feature_drafter_when_weights_attach_and_reports_it(tmp_path, fake_primary):
    from draft_svc.__main__ import build
    from draft_svc.config import DraftConfig
    from draft_svc.heads import file as drafter_file
    from specdec.model.fingerprint import model_fingerprint
    from specdec.service.server import ServerConfig

    model = fake_primary(TINY)
    path = tmp_path / "drafter.safetensors"
    drafter, _ = tiny_parts()
    fingerprint = model_fingerprint(model.config, model.norm.weight)
    training = {"validation": {"top1_by_depth": [0.7, 0.55, 0.4], "rows": 100}}
    drafter_file.save(path, drafter, torch.arange(TINY.draft_vocab_size), fingerprint, training)
    config = DraftConfig(
        server=ServerConfig(),
        pool=PoolConfig(strategies=("prompt_lookup", "feature"), default_strategies=("prompt_lookup",)),
        feature_drafter=path,
    )
    servicer, pool, attacher = build(config, client=None)
    assert list(servicer.GetPoolInfo(draft_pb2.GetPoolInfoRequest(), None).draft_costs) == []
    attacher._check_model(model)  # what attach() runs before the new weights serve
    info = servicer.GetPoolInfo(draft_pb2.GetPoolInfoRequest(), None)
    assert list(info.strategies) == ["prompt_lookup", "feature"]
    (cost,) = info.draft_costs
    assert cost.strategy == "feature" and cost.fixed_ms >= 0 and cost.per_token_ms >= 0
    assert cost.fixed_ms + cost.per_token_ms > 0
    (prior,) = info.acceptance_priors  # what the file's validation measured, from the start
    assert prior.strategy == "feature" and list(prior.acceptance_by_depth) == pytest.approx([0.7, 0.55, 0.4])
    pool.close()


def test_a_files_validation_acceptance_is_read_when_well_formed():
    assert validation_acceptance({"validation": {"top1_by_depth": [0.8, 0.6]}}) == (0.8, 0.6)
    malformed = (
        {},
        {"validation": {}},
        {"validation": {"top1_by_depth": [1.2]}},
        {"validation": {"top1_by_depth": ["x"]}},
        [0.8],
        {"validation": [0.8]},
        {"validation": {"top1_by_depth": "1"}},
        {"validation": {"top1_by_depth": 0.8}},
    )
    for training in malformed:
        assert validation_acceptance(training) == ()
