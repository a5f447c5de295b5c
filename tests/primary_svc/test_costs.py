"""primary_svc.costs: the verify curve the gateway's controller prices drafts by."""

from __future__ import annotations

from primary_svc.costs import fastest_per_size
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache


def test_sizes_are_measured_in_turn_and_the_fastest_run_of_each_counts(fp32_model):
    """A warm-up run of each size, then round after round over the sizes (a slow stretch of the machine
    slows every size alike, not the ratio between them); each size's fastest measured run counts, and
    the probe request is gone after."""
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, fp32_model.model.kv_dtype), 256)
    calls: list[int] = []
    slow_stretch = {4, 5}  # the 4th and 5th runs (sizes 1 and 2 of the first round) are slowed

    def measure(k: int) -> float:
        calls.append(k)
        return k + (100.0 if len(calls) in slow_stretch else 0.0)

    fastest = fastest_per_size(engine, "probe", (1, 2, 4), 2, 16, measure, lambda ms: ms)
    assert calls == [1, 2, 4] + [1, 2, 4] * 2
    assert fastest == {1: 1.0, 2: 2.0, 4: 4.0}  # the slowed runs each had a second, fast one
    assert engine.num_active_requests == 0
