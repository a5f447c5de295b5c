"""Which node a new request goes to: prefix affinity on a consistent-hash ring, bounded by load.

Affinity. The key of a request is a hash of its prompt's first `num_key_blocks` blocks of
`block_tokens` tokens, the primary's prefix-cache blocks (specdec.engine.prefix_cache): requests
that share a system prompt or a conversation's opening share a key, so they land on the node
whose prefix cache holds those blocks (as SGLang's cache-aware router and llm-d do). A prompt
shorter than one block is keyed by all of it.

    prompt   [s s s s | s s s s | s s u u | u u]   block_tokens 4, num_key_blocks 2
    key      hash(s s s s s s s s)                  the first two full blocks only

The ring (Karger et al. 1997) places `num_virtual` points per node, so that adding or removing
a node moves only ~1/N of the keys and the keys spread evenly. A key's node is the first point
clockwise from the key; the nodes after it, in the order their points come, are its fallbacks.

Load bound. A node over its limits (KV bytes, active requests or queued engine calls, as its
primary's GetStats reports them, plus the requests this gateway sent it since) sheds the
request to the next node on the ring, in the spirit of consistent hashing with bounded loads
(Mirrokni et al. 2018): a hot prefix spills to the same second node each time, which then
caches it too. When every healthy node is over its limits the request goes to its first
healthy node, where the primary's own admission decides (queue or RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence


DEFAULT_NUM_VIRTUAL = 128  # points per node: spread within a few percent for 2..64 nodes
DEFAULT_NUM_KEY_BLOCKS = 4  # 64 tokens at 16-token blocks: a chat template's system prompt and more


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_key(token_ids: Sequence[int], block_tokens: int, num_key_blocks: int, scope: str = "") -> int:
    """The routing key of a prompt: a hash of its first num_key_blocks full blocks (all of it when
    shorter than one block) in its prefix-cache scope (the tenant: tenants share no cached rows)."""
    if block_tokens < 1 or num_key_blocks < 1:
        raise ValueError(f"block_tokens and num_key_blocks must be >= 1, got {block_tokens}, {num_key_blocks}")
    num_full = min(num_key_blocks, len(token_ids) // block_tokens) * block_tokens
    keyed = token_ids[:num_full] if num_full else token_ids
    packed = b"".join(int(t).to_bytes(4, "little", signed=True) for t in keyed)
    return _hash64(scope.encode() + b"\0" + packed)


class HashRing:
    """A consistent-hash ring of node ids with num_virtual points each (immutable: a new set of
    nodes is a new ring, built in O(N * num_virtual * log))."""

    def __init__(self, node_ids: Iterable[str], num_virtual: int = DEFAULT_NUM_VIRTUAL) -> None:
        if num_virtual < 1:
            raise ValueError(f"num_virtual must be >= 1, got {num_virtual}")
        self.node_ids = tuple(sorted(set(node_ids)))
        points = sorted((_hash64(f"{n}#{i}".encode()), n) for n in self.node_ids for i in range(num_virtual))
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]

    def walk(self, key: int) -> Iterator[str]:
        """Every node once, in ring order from the first point at or after key."""
        if not self._owners:
            return
        start = bisect.bisect_left(self._hashes, key)
        seen: set[str] = set()
        for i in range(len(self._owners)):
            node = self._owners[(start + i) % len(self._owners)]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.node_ids):
                    return


@dataclasses.dataclass(frozen=True, slots=True)
class NodeLoad:
    """A node's load as its primary last reported it (GetStats), plus the requests this gateway
    routed to it since that report."""

    kv_bytes: int = 0
    max_kv_bytes: int = 0  # 0: unknown (no report yet): never over the KV limit
    num_active_requests: int = 0
    queue_depth: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class LoadLimits:
    """Beyond any of these a node sheds new requests to the next on the ring (0: no such limit)."""

    max_kv_fraction: float = 0.9
    max_active_requests: int = 0
    max_queue_depth: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.max_kv_fraction <= 1.0:
            raise ValueError(f"max_kv_fraction must be in (0, 1], got {self.max_kv_fraction}")
        if self.max_active_requests < 0 or self.max_queue_depth < 0:
            raise ValueError("max_active_requests and max_queue_depth must be >= 0 (0: no limit)")

    def is_over(self, load: NodeLoad) -> bool:
        if load.max_kv_bytes and load.kv_bytes >= self.max_kv_fraction * load.max_kv_bytes:
            return True
        if self.max_active_requests and load.num_active_requests >= self.max_active_requests:
            return True
        return bool(self.max_queue_depth and load.queue_depth >= self.max_queue_depth)


def choose_node(
    ring: HashRing,
    key: int,
    healthy: Iterable[str],
    loads: Mapping[str, NodeLoad],
    limits: LoadLimits,
    exclude: Iterable[str] = (),
) -> str | None:
    """The node for a request with this key: the first healthy node on the ring from key that is
    not over its limits; the first healthy one when all are; None when no node is healthy.
    `exclude`: nodes not to use (the node a request is failing over from)."""
    usable = set(healthy) - set(exclude)
    first = None
    for node in ring.walk(key):
        if node not in usable:
            continue
        if not limits.is_over(loads.get(node, NodeLoad())):
            return node
        first = first or node
    return first
