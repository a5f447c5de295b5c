import gc

import pytest

from specdec.service.gc_tuning import freeze_startup_heap


@pytest.fixture
def restored_gc():
    """The collector as the test found it: thresholds set back, frozen objects unfrozen."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_startup_heap_is_frozen_and_young_collections_rarer(restored_gc):
    class Node:
        pass

    survivor = Node()  # alive at start-up: frozen, never collected again
    survivor.self = survivor
    before = gc.get_threshold()
    freeze_startup_heap(12_345)
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (12_345, before[1], before[2])
    assert not any(o is survivor for o in gc.get_objects())  # the permanent generation is not tracked


def test_cycles_made_while_serving_are_still_collected(restored_gc):
    freeze_startup_heap(100)

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle
    del cycle
    assert gc.collect() >= 1


def test_threshold_must_be_positive(restored_gc):
    with pytest.raises(ValueError, match="gen0_threshold"):
        freeze_startup_heap(0)
