"""End to end with the adaptive controller: greedy output (at the default precision) equals speculation off,
whatever the controller chose per step, and the choices are reported (response stats per decoder and rank; the
per-step choices in the stored stats, next to the controller state the gateway writes every step).

One stack for the module (tests/e2e/conftest.py).
"""

from __future__ import annotations

import pytest

from gateway.loop import RUN_ANSWERS_STATS
from specdec.state_store import open_state_store
from specdec.strategies import DEFAULT_STRATEGIES
from specdec.v1 import gateway_pb2

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 48
PROMPTS = {  # request id prefix -> (chat message, task type the controller should infer)
    "code": (
        "Rename the variable `x` to `total` in this function and show the whole function:\n"
        "```python\ndef add_all(items):\n    x = 0\n    for item in items:\n        x += item\n"
        "    return x\n```",
        "code",
    ),
    "prose": ("Write a short story about a lighthouse keeper and a storm.", "creative"),
}


def generate(stub, request_id: str, content: str, speculation: gateway_pb2.SpeculationConfig):
    req = gateway_pb2.GenerateRequest(request_id=request_id, max_new_tokens=MAX_NEW_TOKENS, speculation=speculation)
    req.chat.messages.add(role="user", content=content)
    return stub.Generate(req, timeout=300)


def test_adaptive_greedy_output_equals_speculation_off_and_reports_its_choices(gateway_stub, redis_server):
    store = open_state_store(redis_server.url)
    try:
        for name, (content, task_type) in PROMPTS.items():
            off = generate(gateway_stub, f"{name}-off", content, gateway_pb2.SpeculationConfig(is_enabled=False))
            adaptive = generate(
                gateway_stub,
                f"{name}-adaptive",
                content,
                gateway_pb2.SpeculationConfig(is_enabled=True, is_adaptive=True),
            )
            assert len(off.token_ids) > 0
            assert list(adaptive.token_ids) == list(off.token_ids), (name, adaptive.text, off.text)
            assert adaptive.text == off.text
            stats = adaptive.stats
            assert stats.num_generated_tokens == len(adaptive.token_ids)
            assert stats.num_steps <= off.stats.num_steps
            for d in stats.decoders:  # "prompt_lookup", "prompt_lookup#1", "prompt_lookup@run" ... within the bounds
                assert d.num_accepted <= d.num_proposed
                if d.name == RUN_ANSWERS_STATS:  # the runs' drafts from the model's own answers (the primary's)
                    continue
                decoder, _, rank = d.name.removesuffix("@run").partition("#")
                # the default set (specdec.strategies.DEFAULT_STRATEGIES: the feature drafter as the
                # pool offers it); which of them runs is the cost model's call on this machine's timings
                assert decoder in DEFAULT_STRATEGIES and int(rank or 0) < 4
                assert d.num_accepted <= d.num_proposed

            stored = store.load(f"{name}-adaptive")
            choices = stored.stats
            assert choices["task_type"] == task_type
            assert sum(choices["num_steps_by_draft_length"]) == stats.num_steps
            assert sum(choices["num_steps_by_degree"]) == stats.num_steps
            assert len(choices["num_steps_by_draft_length"]) <= 16 + 1  # the default bound
            assert stored.controller_state["num_steps"] == stats.num_steps
            assert stored.controller_state["task_type"] == task_type
            # Steps that speculated proposed something or found nothing to propose; plain ones only drafted
            # in their runs (prompt_lookup@run).
            if choices["num_steps_by_draft_length"][0] == stats.num_steps:
                in_runs = sum(d.num_proposed for d in stats.decoders if d.name.endswith("@run"))
                assert stats.num_proposed_tokens == in_runs
            off_choices = store.load(f"{name}-off").stats
            assert off_choices["num_steps_by_draft_length"] == [off.stats.num_steps]
            assert off_choices["task_type"] == "" and store.load(f"{name}-off").controller_state == {}
    finally:
        store.close()
