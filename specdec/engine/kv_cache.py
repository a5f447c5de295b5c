"""The KV cache the engine owns: one slot per active request, with byte accounting.

A slot is a contiguous [num_layers, num_kv_heads, capacity, head_dim] pair of tensors whose
rows 0..num_cached-1 hold the committed context in order (row index == position). A verify
pass appends rows for the chain and the tree after them; `commit` keeps the chain and the
accepted path (moving the path's rows down so that they follow the chain) and forgets the
rest, which is the rollback. Capacity grows in whole blocks, so appends are amortised.

`num_bytes` is the sum of every slot's allocation; `release` returns it to zero. A
`max_bytes` budget turns an allocation that would exceed it into `KVBudgetExceeded`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from specdec.model.config import ModelConfig

BLOCK_TOKENS = 64  # capacity grows in multiples of this many rows
GROWTH_FACTOR = 1.5  # and at least by this factor, to keep re-allocations rare


class KVBudgetExceeded(Exception):
    pass


@dataclasses.dataclass(slots=True)
class KVSlot:
    k: torch.Tensor  # [num_layers, num_kv_heads, capacity, head_dim]
    v: torch.Tensor  # [num_layers, num_kv_heads, capacity, head_dim]
    num_cached: int = 0  # rows that hold committed context

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class KVCache:
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", max_bytes: int | None = None
    ) -> None:
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.bytes_per_token = (
            2
            * config.num_hidden_layers
            * config.num_key_value_heads
            * config.head_dim
            * torch.empty(0, dtype=dtype).element_size()
        )

    def _alloc(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        shape = (c.num_hidden_layers, c.num_key_value_heads, capacity, c.head_dim)
        return (
            torch.empty(shape, dtype=self.dtype, device=self.device),
            torch.empty(shape, dtype=self.dtype, device=self.device),
        )

    def _round_capacity(self, num_rows: int) -> int:
        return math.ceil(num_rows / BLOCK_TOKENS) * BLOCK_TOKENS

    def _check_room(self, extra_bytes: int) -> None:
        if self.max_bytes is not None and self.num_bytes + extra_bytes > self.max_bytes:
            raise KVBudgetExceeded(
                f"KV cache needs {extra_bytes} more bytes; {self.num_bytes} of {self.max_bytes} are in use"
            )

    def bytes_for_rows(self, num_rows: int) -> int:
        """What `allocate(num_rows)` charges."""
        return self._round_capacity(max(num_rows, 1)) * self.bytes_per_token

    def growth_bytes(self, slot: KVSlot, num_rows: int) -> int:
        """What `reserve(slot, num_rows)` charges."""
        if num_rows <= slot.capacity:
            return 0
        return (
            self._round_capacity(max(num_rows, int(slot.capacity * GROWTH_FACTOR))) - slot.capacity
        ) * self.bytes_per_token

    @property
    def free_bytes(self) -> int | None:
        """Bytes left under max_bytes; None without a budget."""
        return None if self.max_bytes is None else self.max_bytes - self.num_bytes

    def allocate(self, num_rows: int) -> KVSlot:
        capacity = self._round_capacity(max(num_rows, 1))
        self._check_room(capacity * self.bytes_per_token)
        slot = KVSlot(*self._alloc(capacity))
        self.num_bytes += capacity * self.bytes_per_token  # charged once held: an allocation that raised holds nothing
        return slot

    def reserve(self, slot: KVSlot, num_rows: int) -> None:
        """Make room for `num_rows` rows in total (context + the rows about to be appended)."""
        if num_rows <= slot.capacity:
            return
        capacity = self._round_capacity(max(num_rows, int(slot.capacity * GROWTH_FACTOR)))
        extra_bytes = (capacity - slot.capacity) * self.bytes_per_token
        self._check_room(extra_bytes)
        k, v = self._alloc(capacity)
        self.num_bytes += extra_bytes  # charged once held, as in `allocate`
        k[:, :, : slot.num_cached] = slot.k[:, :, : slot.num_cached]
        v[:, :, : slot.num_cached] = slot.v[:, :, : slot.num_cached]
        slot.k, slot.v = k, v

    def commit(self, slot: KVSlot, num_chain: int, accepted_nodes: Sequence[int]) -> None:
        """Keep the chain rows and the accepted tree path; everything after is rolled back.

        E.g. num_cached = 5, chain of 1 (row 5), nodes at rows 6.. and accepted_nodes = [0, 2]:
        rows 6 (node 0) and 8 (node 2) move to rows 6 and 7; num_cached becomes 5 + 1 + 2 = 8.
        """
        base = slot.num_cached + num_chain  # row of node 0
        if accepted_nodes:
            src = torch.tensor(accepted_nodes, device=slot.k.device) + base
            if not torch.equal(src, torch.arange(base, base + len(accepted_nodes), device=src.device)):
                # index_select copies first, so overlapping source/destination rows are safe
                slot.k[:, :, base : base + len(accepted_nodes)] = slot.k.index_select(2, src)
                slot.v[:, :, base : base + len(accepted_nodes)] = slot.v.index_select(2, src)
        slot.num_cached = base + len(accepted_nodes)

    def release(self, slot: KVSlot) -> int:
        freed = slot.capacity * self.bytes_per_token
        self.num_bytes -= freed
        slot.k = slot.v = torch.empty(0)
        return freed
