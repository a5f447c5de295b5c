"""Automatic prefix caching: KV rows of prompt prefixes already computed, reused by later requests.

Requests often begin alike: a chat template's system prompt, few-shot examples, a multi-turn
history. The engine keeps the KV rows of prompts it prefilled, cut into blocks of `block_tokens`
tokens, so that a new prompt starting with the same tokens copies those rows into its slot and
prefills only the rest (vLLM's automatic prefix caching, SGLang's radix cache).

Keys: block i of a prompt is keyed by (id of block i-1's entry, block i's token ids), block 0 by
(the request's scope, its token ids). Every entry gets a fresh id when it is created and ids are
never reused, so a key names exactly one token prefix in one scope: two prompts reach the same entry
only when their scopes and all their tokens up to its end are equal. No hash can collide (the dict
compares the token tuples), so the cache never hands a prompt rows of other tokens.

    prompt  [a b c d | e f g h | i j]     block_tokens 4, scope "acme"
    entries ("acme", (a,b,c,d)) -> id 1,  (1, (e,f,g,h)) -> id 2,  and with `with_tail` (2, (i,j)) -> id 3

Token granularity: the rows of a prefix depend on its tokens only, so a lookup takes, after the
whole blocks it matches, the first rows of the cached entry after them that begin like the rest of
the prompt: a block the prompt diverges inside, or a tail (the last, partial block of a prompt,
stored with `with_tail`). A prompt sent again reuses every row of it, not its whole blocks only; a
prompt that diverges at token 100 reuses 100 rows, not 96 (SGLang's radix cache is token-grained
too; vLLM's blocks are not). Whether a caller may reuse rows at any count is the engine's rule.

Scope: the engine passes the request's tenant (specdec.request_id.tenant_of). A hit is visible to
its client (fewer prompt tokens computed, `num_cached_prompt_tokens`, a shorter time to first
token), so a shared cache would tell one tenant which prompts another sent; tenants never share
(vLLM's cache_salt). Without API keys there is one trust domain: an id without "/" is in scope "",
and a "/" in a client's own id only narrows what the id shares (tenant_of).

Eviction: least recently used first, under a byte budget of its own (`max_bytes`), apart from the
per-request KV budget (specdec.engine.kv_cache): the cache holds copies, so releasing a request
never touches it and evicting a block never touches a request. A lookup or insert touches its
blocks from the last to the first, so a block is always more recent than its descendants: the
least recently used block is a leaf, and eviction never strands a reachable block's children.

Which rows may be reused bit for bit is the engine's rule (specdec.engine.engine, "Prefix
caching"); this module only stores and finds them.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Iterator, Sequence

import torch

DEFAULT_BLOCK_TOKENS = 16  # as vLLM: fine enough that a chat template's ~25-token system prompt reuses a block
DEFAULT_MAX_BYTES = 256 << 20

BlockKey = tuple[int | str, tuple[int, ...]]  # (parent entry id, or the scope for a first block; its token ids)


@dataclasses.dataclass(slots=True, eq=False)
class CachedBlock:
    block_id: int
    key: BlockKey
    parent: BlockKey | None  # None: a first block
    k: torch.Tensor  # [num_layers, num_kv_heads, tokens, head_dim] (block_tokens but a tail), the slot's dtype
    v: torch.Tensor
    num_children: int = 0  # entries whose parent this is (eviction takes leaves only)

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclasses.dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counts since start (the service exports them as Prometheus counters)."""

    num_queries: int = 0  # prompts looked up
    num_hits: int = 0  # of which reused at least one token
    num_query_tokens: int = 0  # prompt tokens that could have come from the cache
    num_reused_tokens: int = 0  # prompt tokens that did
    num_evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.max_bytes, self.block_tokens = max_bytes, block_tokens
        self.num_bytes = 0
        self.stats = PrefixCacheStats()
        self._blocks: collections.OrderedDict[BlockKey, CachedBlock] = collections.OrderedDict()  # LRU first
        # entries by parent (entry id, or scope for first blocks) and first token: a lookup's candidates
        self._children: dict[int | str, dict[int, set[BlockKey]]] = {}
        self._ids = itertools.count(1)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def _keys(self, token_ids: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """Each full block's token ids, in order."""
        b = self.block_tokens
        for start in range(0, len(token_ids) - b + 1, b):
            yield tuple(token_ids[start : start + b])

    def match(self, token_ids: Sequence[int], scope: str = "") -> tuple[list[CachedBlock], int]:
        """(entries, n): the longest prefix of token_ids cached in `scope`, token for token: n tokens,
        whose rows are the first n of the entries' rows in order (whole blocks, then the first rows of
        one more entry: a block or tail beginning like the rest). Touched as used."""
        found, parent_id = self._match_blocks(token_ids, scope)
        start = len(found) * self.block_tokens
        best, num_best = None, 0
        if start < len(token_ids):
            for key in self._children.get(parent_id, {}).get(token_ids[start], ()):
                tokens, n = key[1], 1
                while n < len(tokens) and start + n < len(token_ids) and tokens[n] == token_ids[start + n]:
                    n += 1
                if n > num_best:
                    best, num_best = self._blocks[key], n
        if best is not None:
            found.append(best)
        self._touch(found)
        return found, start + num_best

    def _match_blocks(self, token_ids: Sequence[int], scope: str) -> tuple[list[CachedBlock], int | str]:
        """The whole blocks of the longest cached prefix, and the id their next entry would hang off."""
        found: list[CachedBlock] = []
        parent_id: int | str = scope
        for tokens in self._keys(token_ids):
            block = self._blocks.get((parent_id, tokens))
            if block is None:
                break
            found.append(block)
            parent_id = block.block_id
        return found, parent_id

    def copy_prefix(self, blocks: Sequence[CachedBlock], num_tokens: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the first num_tokens rows the blocks hold into k/v (a slot's, rows in position order)."""
        b = self.block_tokens
        assert num_tokens <= len(blocks) * b, "the blocks hold the rows copied"
        for i, block in enumerate(blocks[: -(-num_tokens // b)]):
            n = min(b, num_tokens - i * b)
            k[:, :, i * b : i * b + n] = block.k[:, :, :n]
            v[:, :, i * b : i * b + n] = block.v[:, :, :n]

    def record_query(self, num_query_tokens: int, num_reused_tokens: int) -> None:
        """Count one prompt's lookup: how many of its tokens could have been reused, how many were."""
        self.stats.num_queries += 1
        self.stats.num_hits += num_reused_tokens > 0
        self.stats.num_query_tokens += num_query_tokens
        self.stats.num_reused_tokens += num_reused_tokens

    def insert(
        self, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor, scope: str = "", with_tail: bool = False
    ) -> int:
        """Store, in `scope`, the full blocks of token_ids whose rows are k/v[:, :, :len(token_ids)] (a slot's
        [num_layers, num_kv_heads, capacity, head_dim]), and with `with_tail` the partial block after
        them as a tail entry; entries already cached are only touched. Stops at the first entry that
        does not fit the budget. Returns the entries now cached."""
        b = self.block_tokens
        pieces = list(self._keys(token_ids))
        if with_tail and len(token_ids) % b:
            pieces.append(tuple(token_ids[len(pieces) * b :]))
        chain: list[CachedBlock] = []
        for i, tokens in enumerate(pieces):
            parent = chain[-1].key if chain else None
            parent_id = chain[-1].block_id if chain else scope
            key: BlockKey = (parent_id, tokens)
            block = self._blocks.get(key)
            if block is None:
                rows = slice(i * b, i * b + len(tokens))
                num_bytes = 2 * k[:, :, rows].numel() * k.element_size()
                if not self._make_room(num_bytes, protected=len(chain)):
                    break
                block = CachedBlock(next(self._ids), key, parent, k[:, :, rows].clone(), v[:, :, rows].clone())
                self._blocks[key] = block
                self._children.setdefault(parent_id, {}).setdefault(tokens[0], set()).add(key)
                self.num_bytes += num_bytes
                if parent is not None:
                    self._blocks[parent].num_children += 1
            else:
                self._blocks.move_to_end(key)  # the chain stays at the recent end while room is made
            chain.append(block)
        self._touch(chain)
        return len(chain)

    def _make_room(self, num_bytes: int, protected: int) -> bool:
        """Evict least recently used blocks until num_bytes more fit. The `protected` blocks at the
        recent end (the chain being inserted) are never evicted: False when only they are left."""
        while self.num_bytes + num_bytes > self.max_bytes:
            if len(self._blocks) <= protected:
                return False
            key, block = self._blocks.popitem(last=False)
            assert block.num_children == 0, "the least recently used block is a leaf"
            by_token = self._children[key[0]]
            by_token[key[1][0]].discard(key)
            if not by_token[key[1][0]]:
                del by_token[key[1][0]]
                if not by_token:
                    del self._children[key[0]]
            if block.parent is not None:
                self._blocks[block.parent].num_children -= 1
            self.num_bytes -= block.num_bytes
            self.stats.num_evicted_blocks += 1
        return True

    def _touch(self, chain: list[CachedBlock]) -> None:
        """Make the chain the most recent blocks, its first block last: parents outlive children."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)
