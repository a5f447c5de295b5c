"""specdec.speculation_bounds: every service's speculation limits come from one module."""

from __future__ import annotations

import pytest

from draft_svc.pool import PoolConfig
from gateway.config import Limits, SpeculationDefaults
from gateway.controller import ControllerConfig
from http_svc.errors import ApiError
from http_svc.openai_request import CHAT, parse_request
from specdec import speculation_bounds as bounds


def test_service_limits_must_lie_within_the_structural_bounds() -> None:
    bounds.check_speculation_bounds(bounds.MAX_CANDIDATES, bounds.MAX_DRAFT_LENGTH, bounds.MAX_TREE_NODES)
    bounds.check_speculation_bounds(1, 1, 1)
    for limits, name in (
        ((bounds.MAX_CANDIDATES + 1, 1, 1), "max_speculative_degree"),
        ((1, bounds.MAX_DRAFT_LENGTH + 1, 1), "max_draft_length"),
        ((1, 1, 0), "max_tree_nodes"),
    ):
        with pytest.raises(ValueError, match=name):
            bounds.check_speculation_bounds(*limits)


def test_the_services_defaults_are_the_modules() -> None:
    limits, defaults, pool = Limits(), SpeculationDefaults(), PoolConfig()
    assert (limits.max_draft_length, limits.max_speculative_degree, limits.max_tree_nodes) == (
        bounds.MAX_REQUEST_DRAFT_LENGTH,
        bounds.MAX_REQUEST_SPECULATIVE_DEGREE,
        bounds.MAX_REQUEST_TREE_NODES,
    )
    assert defaults.draft_length == pool.default_draft_length == bounds.DEFAULT_DRAFT_LENGTH
    assert defaults.max_adaptive_draft_length == max(ControllerConfig().draft_length_choices)
    assert (pool.max_draft_length, pool.max_tree_nodes) == (bounds.MAX_DRAFT_LENGTH, bounds.MAX_TREE_NODES)


def test_a_controller_beyond_the_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="max_draft_length"):
        ControllerConfig(draft_length_choices=(1, bounds.MAX_DRAFT_LENGTH + 1))


@pytest.mark.parametrize(
    ("name", "maximum"),
    [("draft_length", bounds.MAX_REQUEST_DRAFT_LENGTH), ("speculative_degree", bounds.MAX_REQUEST_SPECULATIVE_DEGREE)],
)
def test_the_http_edge_accepts_up_to_the_request_bound_and_names_the_field_beyond(name: str, maximum: int) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    parsed = parse_request({**body, name: maximum}, CHAT)
    assert getattr(parsed.requests[0].speculation, name) == maximum
    with pytest.raises(ApiError) as e:
        parse_request({**body, name: maximum + 1}, CHAT)
    assert e.value.status == 400 and e.value.param == name
    assert e.value.message == f"{name}: must be at most {maximum}, got {maximum + 1}"
