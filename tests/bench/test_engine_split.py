"""bench.engine_split: each verify-curve point's split by the native forward's timer, on the real
model at int4 (the native forward)."""

from __future__ import annotations

import pytest

from bench.engine_split import format_split, split_curve
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.model import native

pytestmark = pytest.mark.skipif(native.library() is None, reason=f"native kernels: {native.status()}")


@pytest.fixture(scope="module")
def int4_engine(default_model_dir) -> Engine:
    loaded = load_model(default_model_dir, "int4", max_positions=256, is_shared=False)
    assert loaded.model.native_stack is not None
    return Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), 256)


def test_each_point_is_one_forward_split_into_its_parts_and_the_timer_ends_off(int4_engine):
    lib = native.library()
    assert lib is not None
    curve = split_curve(int4_engine, 2, 32, (1, 4))
    assert set(curve) == {1, 4}
    for point in curve.values():
        assert point["num_forwards"] == 1  # a verify is one native forward over every layer
        assert point["products_ms"] > 0 and point["attention_ms"] > 0 and point["forward_rest_ms"] > 0
        inside = point["products_ms"] + point["attention_ms"] + point["forward_rest_ms"]
        assert inside + point["outside_ms"] == pytest.approx(point["ms"])
        assert point["outside_ms"] > 0  # the head's product runs outside the forward
    assert int4_engine.num_active_requests == 0
    assert native.forward_profile(lib).num_forwards == 0  # turned off and reset after the curve
    lines = format_split(curve)
    assert lines[0].split()[:2] == ["verify", "ms"] and lines[-1].split()[:2] == ["vs", "k=1"]
