"""bench.stack: GenerationStats as the plain data bench.report aggregates (no stack started)."""

from __future__ import annotations

from bench.stack import stats_dict
from specdec.v1 import common_pb2, gateway_pb2


def test_stats_dict_carries_forward_time_decoders_and_the_controller_choices():
    pb = gateway_pb2.GenerationStats(
        num_generated_tokens=9,
        num_steps=4,
        num_proposed_tokens=12,
        num_accepted_tokens=5,
        stage_times=gateway_pb2.StageTimes(draft_ms=2.0, verify_ms=40.0, forward_ms=31.5, total_ms=50.0),
        decoders=[
            common_pb2.DecoderStats(
                name="grammar",
                num_proposed=6,
                num_accepted=4,
                time_ms=0.5,
                num_steps=3,
                num_tested_by_depth=[3, 2],
                num_accepted_by_depth=[2, 1],
            )
        ],
        num_steps_by_degree=[1, 0, 3],
        num_steps_by_draft_length=[1, 0, 0, 0, 3],
        num_probe_steps=1,
        task_type="structured",
    )
    d = stats_dict(pb)
    assert (d["num_steps"], d["num_proposed"], d["num_accepted"]) == (4, 12, 5)
    assert (d["stage_ms"]["verify"], d["stage_ms"]["forward"], d["stage_ms"]["total"]) == (40.0, 31.5, 50.0)
    assert d["decoders"] == {
        "grammar": {
            "num_proposed": 6,
            "num_accepted": 4,
            "time_ms": 0.5,
            "num_steps": 3,
            "num_tested_by_depth": [3, 2],
            "num_accepted_by_depth": [2, 1],
        }
    }
    assert d["num_steps_by_degree"] == [1, 0, 3] and d["num_steps_by_draft_length"] == [1, 0, 0, 0, 3]
    assert (d["num_probe_steps"], d["task_type"]) == (1, "structured")


def test_each_scenario_s_requests_are_a_tenant_of_its_own():
    """json with and without its schema ask the same prompts: as tenants apart, neither drafts from the
    other's outputs (the primary's learned answers, the draft pool's index of finished outputs)."""
    from types import SimpleNamespace

    from bench.prompts import BenchPrompt
    from bench.stack import run_request
    from specdec.request_id import check_request_id, tenant_of

    sent = []

    class Stub:
        def Generate(self, req, timeout):
            sent.append(req.request_id)
            return gateway_pb2.GenerateResponse(text="{}", token_ids=[1])

    prompt = BenchPrompt("bfcl-" + "x" * 200, "json", "Call it", None, {"type": "object"}, False)
    sut = SimpleNamespace(stub=Stub())
    for scenario in ("json", "json_noschema", "json"):
        run_request(sut, prompt, scenario, "speculative", 8, scenario == "json", None)
    assert [tenant_of(r) for r in sent] == ["json", "json_noschema", "json"]
    assert len(set(sent)) == 3 and all(check_request_id(r) == r for r in sent)  # unique, and valid ids
