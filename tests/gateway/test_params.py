"""SpeculationConfig -> SpeculationParams: is_adaptive and what degree / draft length mean with it."""
from __future__ import annotations

from gateway.config import Limits, SpeculationDefaults
from gateway.params import params_from_pb
from specdec.v1 import common_pb2, gateway_pb2

DEFAULTS = SpeculationDefaults(speculative_degree=1, draft_length=8, max_adaptive_degree=4,
                               max_adaptive_draft_length=16)


def speculation(defaults: SpeculationDefaults = DEFAULTS, **fields):
    req = gateway_pb2.GenerateRequest(prompt="hi", speculation=gateway_pb2.SpeculationConfig(**fields))
    return params_from_pb(req, Limits(), defaults).speculation


def test_adaptive_by_default_with_the_adaptive_bounds_when_the_request_sets_none():
    spec = speculation()
    assert spec.is_adaptive and (spec.speculative_degree, spec.draft_length) == (4, 16)


def test_the_requests_degree_and_draft_length_are_the_bounds_when_adaptive():
    spec = speculation(speculative_degree=2, draft_length=5)
    assert spec.is_adaptive and (spec.speculative_degree, spec.draft_length) == (2, 5)


def test_not_adaptive_keeps_the_fixed_settings_and_their_defaults():
    assert (speculation(is_adaptive=False).speculative_degree, speculation(is_adaptive=False).draft_length) == (1, 8)
    spec = speculation(is_adaptive=False, speculative_degree=3, draft_length=6)
    assert not spec.is_adaptive and (spec.speculative_degree, spec.draft_length) == (3, 6)
    off_by_flag = SpeculationDefaults(is_adaptive=False)
    assert not speculation(off_by_flag).is_adaptive and speculation(off_by_flag, is_adaptive=True).is_adaptive


def test_task_type_given_or_left_to_inference():
    assert speculation().task_type == ""
    assert speculation(task_type=common_pb2.TASK_TYPE_CODE).task_type == "code"
