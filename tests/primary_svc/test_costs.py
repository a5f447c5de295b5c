"""primary_svc.costs: the verify curve the gateway's controller prices drafts by."""

from __future__ import annotations

from primary_svc.costs import fastest_per_size
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache


def test_sizes_are_measured_in_turn_and_the_fastest_run_of_each_counts(fp32_model):
    """A warm-up run of each size, then round after round over the sizes (a slow stretch of the machine
    slows every size alike, not the ratio between them), each size twice with the second run counted
    (a run right after another size's is not the one decoding sees); each size's fastest counted run
    counts, and the probe request is gone after."""
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, fp32_model.model.kv_dtype), 256)
    calls: list[int] = []
    slow_stretch = {5, 7}  # the counted runs of sizes 1 and 2 in the first round are slowed

    def measure(k: int) -> float:
        after_other_size = len(calls) > 0 and calls[-1] != k
        calls.append(k)
        return k + (100.0 if len(calls) in slow_stretch else 0.0) + (50.0 if after_other_size else 0.0)

    fastest = fastest_per_size(engine, "probe", (1, 2, 4), 2, 16, measure, lambda ms: ms)
    assert calls == [1, 2, 4] + [1, 1, 2, 2, 4, 4] * 2
    assert fastest == {1: 1.0, 2: 2.0, 4: 4.0}  # never a run after another size; the slowed ones had a second round
    assert engine.num_active_requests == 0
