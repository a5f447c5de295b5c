"""bench.overhead: the share of time outside model compute and the time per step by stage."""

from __future__ import annotations

import pytest

from bench.overhead import outside_fraction, stage_ms_per_step


def stats(total: float, verify: float, forward: float, steps: int = 5, decoders: dict | None = None) -> dict:
    return {
        "num_steps": steps,
        "decoders": decoders or {},
        "stage_ms": {
            "draft": 10.0,
            "verify": verify,
            "forward": forward,
            "validate": 2.0,
            "commit": 1.0,
            "state": 3.0,
            "other": 4.0,
            "total": total,
        },
    }


def test_outside_fraction_leaves_out_forward_and_model_based_drafting_only():
    # 200 ms total; 100 forward (verify's other 20 ms is RPC: outside); early_exit (both instances) 20 ms is
    # model compute, prompt lookup 10 ms is not.
    s1 = stats(100.0, 60.0, 50.0, decoders={"early_exit": {"time_ms": 15.0}, "prompt_lookup": {"time_ms": 10.0}})
    s2 = stats(100.0, 60.0, 50.0, decoders={"early_exit#1": {"time_ms": 5.0}})
    assert outside_fraction([s1, s2]) == pytest.approx((200 - 100 - 20) / 200)
    assert outside_fraction([stats(0.0, 0.0, 0.0)]) is None


def test_stage_ms_per_step_splits_verify():
    s1 = stats(100.0, 60.0, 50.0, decoders={"layer_skip": {"time_ms": 6.0}})
    s2 = stats(80.0, 40.0, 30.0)
    out = stage_ms_per_step([s1, s2])  # 10 steps
    assert out == pytest.approx(
        {
            "draft": 2.0,
            "draft_model": 0.6,
            "forward": 8.0,
            "verify_minus_forward": 2.0,
            "validate": 0.4,
            "commit": 0.2,
            "state": 0.6,
            "other": 0.8,
            "total": 18.0,
        }
    )
    assert stage_ms_per_step([stats(1.0, 1.0, 1.0, steps=0)]) is None
