"""The KV cache's byte accounting on a tiny config: what an allocation charges, a failed one does not."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.kv_cache import KVCache
from tests.specdec.model.tiny import tiny_config


def test_an_allocation_the_allocator_refuses_charges_nothing(monkeypatch):
    """A slot or a growth whose tensors cannot be allocated (a device out of memory) leaves num_bytes as
    it was: the bytes were never held, and a charge kept would shrink the budget for good."""
    kv = KVCache(tiny_config(), torch.float32, max_bytes=1 << 30)
    slot = kv.allocate(10)
    held = kv.num_bytes

    def out_of_memory(capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise torch.OutOfMemoryError(f"no room for {capacity} rows")

    monkeypatch.setattr(kv, "_alloc", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        kv.allocate(10)
    with pytest.raises(torch.OutOfMemoryError):
        kv.reserve(slot, slot.capacity + 1)
    assert kv.num_bytes == held and slot.num_bytes == held
    kv.release(slot)
    assert kv.num_bytes == 0
