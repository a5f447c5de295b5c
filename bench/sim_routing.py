"""Routing of new requests to nodes in the scale-out simulation: prefix affinity by consistent
hashing with bounded loads, or uniform random (the baseline that affinity must beat).

Affinity: each node owns num_virtual_nodes points of a 64-bit ring; a request's key (its system
prompt's id: the prefix that the node may hold cached) hashes to a point, and the request goes to the
first node clockwise whose load stays within load_bound x the mean after taking it (Mirrokni,
Thorup, Zadimoghaddam 2018, "Consistent Hashing with Bounded Loads"), or within min_cap: at light
load a bound relative to a mean of one or two requests would scatter a prefix for no gain, so a node
sheds only past both (as SGLang's router balances only past an absolute imbalance). E.g. 3 nodes,
loads [5, 1, 0], load_bound 1.25, min_cap 4: the cap is max(ceil(1.25 x (6 + 1) / 3), 4) = 4, so a
key whose first node is node 0 goes to the next distinct node on its walk that holds fewer than 4.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

import numpy as np


def ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class AffinityRouter:
    def __init__(self, num_nodes: int, num_virtual_nodes: int, load_bound: float, min_cap: int = 1) -> None:
        points = sorted((ring_hash(f"node-{n}-{v}"), n) for n in range(num_nodes) for v in range(num_virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]
        self._num_nodes = num_nodes
        self._load_bound, self._min_cap = load_bound, min_cap
        self._walks: dict[int, list[int]] = {}

    def walk(self, key: int) -> list[int]:
        """Every node once, in ring order from the key's point (cached: keys repeat)."""
        walk = self._walks.get(key)
        if walk is None:
            start = bisect.bisect_left(self._hashes, ring_hash(f"prefix-{key}"))
            seen: dict[int, None] = {}
            for i in range(len(self._owners)):
                seen.setdefault(self._owners[(start + i) % len(self._owners)], None)
                if len(seen) == self._num_nodes:
                    break
            walk = self._walks[key] = list(seen)
        return walk

    def route(self, key: int, loads: Sequence[int]) -> int:
        cap = max(math.ceil(self._load_bound * (sum(loads) + 1) / self._num_nodes), self._min_cap)
        walk = self.walk(key)
        for node in walk:
            if loads[node] + 1 <= cap:
                return node
        return walk[0]  # unreachable: the cap is above the mean, so some node is under it


class RandomRouter:
    def __init__(self, num_nodes: int, rng: np.random.Generator) -> None:
        self._num_nodes = num_nodes
        self._rng = rng

    def route(self, key: int, loads: Sequence[int]) -> int:
        return int(self._rng.integers(self._num_nodes))
