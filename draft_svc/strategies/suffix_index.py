"""Suffix index: propose what followed the current context in earlier outputs, across requests of
one tenant.

SuffixDecoding (Oliaro et al. 2024) keeps earlier outputs in a suffix tree, finds the longest
suffix of the current context that occurs there, and proposes the most frequent continuation
below that match. Here the same rule runs over a cheaper structure:

- One ring buffer of int32 tokens holding whole documents (finished outputs, optionally prompts),
  each followed by a SEPARATOR, bounded by `max_total_tokens`. Inserting a document evicts the
  oldest whole documents that the ring write would overwrite: nothing is deleted from the index,
  stale entries are recognised by position (< window start) and skipped (the zlib sliding window).
- For a few n-gram sizes (`ngram_sizes`, e.g. 2, 4, 8), hash chains as in LZ77: `heads[level,
  bucket]` is the most recent continuation start c of an n-gram hashing to the bucket, `prevs[level,
  c % capacity]` the previous one. Positions are absolute int64, so chains never wrap.
- Query: the largest n whose hashed suffix has live occurrences gives up to `max_occurrences` most
  recent positions; exact backward comparison (up to `max_match_len` tokens) removes hash collisions
  and keeps only the occurrences with the longest match (the paper's "longest suffix"); then the
  continuation follows, token by token, the most frequent next token among the occurrences that
  still agree (ties: the most recent occurrence). Rank r starts from the r-th most frequent first token.

Why not a suffix tree or automaton: in Python each node is a dict (~200 B), O(total tokens * depth)
nodes for a depth-limited suffix tree, and deleting an evicted document is O(len * depth). Here:
memory 4 B/token (ring) + 8 B * (capacity + num_buckets) per n-gram size, all numpy; insert
O(m log m) vectorised for a document of m tokens; eviction O(1); query O(sum(ngram_sizes) +
K * (max_match_len + max_tokens)) vectorised, K = max_occurrences, independent of index size.
Thread-safe: one lock around insert and query (a query takes tens of microseconds).

Documents belong to a tenant (the `tenant/` of the request ids behind a gateway with API keys, ""
without), and a query matches its own tenant's only: how often a request's drafts are accepted must
not tell one tenant what another's outputs were (the primary's prefix cache is per tenant for the
same reason). One ring serves every tenant; each position records its document's tenant.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import ClassVar, Protocol

import numpy as np

from draft_svc.strategies.base import Candidate, append_tokens, new_context, validate_propose_args
from specdec.field_checks import require_at_least_one
from specdec.suffix_array import SEPARATOR, most_frequent_paths

NO_POSITION = -1  # end of a hash chain (below every window start)
_NO_TOKEN = -2  # pads a context shorter than max_match_len; equals neither a token nor SEPARATOR
_HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # Fibonacci hashing (Knuth)
_MASK64 = (1 << 64) - 1
_MAX_TOKEN_ID = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True, slots=True)
class SuffixIndexConfig:
    max_total_tokens: int = 1 << 18  # ring capacity, separators included
    ngram_sizes: tuple[int, ...] = (2, 4, 8)  # hashed match sizes; the exact match length is measured after
    max_match_len: int = 32  # longest context suffix compared
    max_occurrences: int = 32  # most recent occurrences voted on per query

    def __post_init__(self) -> None:
        if self.max_total_tokens < 2:
            raise ValueError(f"max_total_tokens must be >= 2, got {self.max_total_tokens}")
        if not self.ngram_sizes or list(self.ngram_sizes) != sorted(set(self.ngram_sizes)) or self.ngram_sizes[0] < 1:
            raise ValueError(f"ngram_sizes must be positive, ascending and distinct, got {self.ngram_sizes}")
        if self.max_match_len < self.ngram_sizes[-1]:
            raise ValueError(
                f"max_match_len ({self.max_match_len}) must be >= the largest ngram size ({self.ngram_sizes[-1]})"
            )
        require_at_least_one(self, "max_occurrences")


def _buckets(windows: np.ndarray, bucket_bits: int) -> np.ndarray:
    """windows [R, n] int -> [R] int64 bucket ids: a polynomial hash mod 2**64, then Fibonacci hashing."""
    powers = np.uint64(_HASH_MULTIPLIER) ** np.arange(windows.shape[1] - 1, -1, -1, dtype=np.uint64)  # [n]
    with np.errstate(over="ignore"):
        h = (windows.astype(np.uint64) * powers).sum(axis=1, dtype=np.uint64)  # [R], wraps mod 2**64
        h = (h + np.uint64(windows.shape[1])) * np.uint64(_HASH_MULTIPLIER)
    return (h >> np.uint64(64 - bucket_bits)).astype(np.int64)


def _bucket(tokens: Sequence[int], bucket_bits: int) -> int:
    """_buckets for one n-gram in plain integers: a query hashes one row, where numpy's overhead dominates."""
    h = 0
    for token in tokens:
        h = (h * _HASH_MULTIPLIER + token) & _MASK64
    return (((h + len(tokens)) * _HASH_MULTIPLIER) & _MASK64) >> (64 - bucket_bits)


class SuffixIndex:
    """Shared, bounded index over earlier documents; see the module docstring."""

    def __init__(self, config: SuffixIndexConfig | None = None) -> None:
        self._config = config or SuffixIndexConfig()
        capacity = self._config.max_total_tokens
        self._bucket_bits = max(1, (capacity - 1).bit_length())  # >= capacity buckets: load factor <= 1
        num_levels = len(self._config.ngram_sizes)
        self._ring = np.full(capacity, SEPARATOR, dtype=np.int32)
        self._heads = np.full((num_levels, 1 << self._bucket_bits), NO_POSITION, dtype=np.int64)
        self._prevs = np.full((num_levels, capacity), NO_POSITION, dtype=np.int64)
        self._doc_starts: collections.deque[int] = collections.deque()  # absolute starts, oldest first
        self._doc_tenants: collections.deque[str] = collections.deque()  # their tenants, oldest first
        self._owners = np.zeros(capacity, dtype=np.int32)  # the tenant code of each ring position's document
        # Only the tenants with a document held: tenants are whatever precedes a "/" in a request id, so
        # a code kept for every tenant ever seen would grow without bound. A freed code is safe to hand
        # out again: its positions all lie before the window start, where queries never read owners.
        self._tenant_codes: dict[str, int] = {}
        self._num_tenant_docs: dict[str, int] = {}
        self._free_codes: list[int] = []
        self._write_pos = 0  # absolute position of the next write
        self._lock = threading.Lock()

    @property
    def config(self) -> SuffixIndexConfig:
        return self._config

    @property
    def max_match_len(self) -> int:
        return self._config.max_match_len

    @property
    def num_documents(self) -> int:
        return len(self._doc_starts)

    @property
    def num_tenants(self) -> int:
        """Tenants with a document held."""
        return len(self._tenant_codes)

    @property
    def num_tokens(self) -> int:
        """Tokens held, separators included."""
        with self._lock:
            return self._write_pos - self._window_start()

    def _window_start(self) -> int:
        return self._doc_starts[0] if self._doc_starts else self._write_pos

    def insert(self, doc_tokens: Sequence[int], tenant: str = "") -> None:
        """Add one document of `tenant`. One longer than the ring keeps its first max_total_tokens - 1
        tokens."""
        tokens = np.asarray(doc_tokens, dtype=np.int64).reshape(-1)[: self._config.max_total_tokens - 1]
        if tokens.size == 0:
            return
        if tokens.min() < 0 or tokens.max() > _MAX_TOKEN_ID:
            raise ValueError(f"doc_tokens must lie in [0, {_MAX_TOKEN_ID}]")
        capacity = self._config.max_total_tokens
        with self._lock:
            start = self._write_pos
            end = start + tokens.size  # the separator's position
            # Whole documents starting before end + 1 - capacity would be partly overwritten: evict them.
            while self._doc_starts and self._doc_starts[0] < end + 1 - capacity:
                self._doc_starts.popleft()
                self._forget_document_of(self._doc_tenants.popleft())
            written = np.arange(start, end + 1) % capacity
            self._ring[written] = np.append(tokens, SEPARATOR)
            self._owners[written] = self._code_of(tenant)
            for level, n in enumerate(self._config.ngram_sizes):
                if tokens.size > n:
                    self._link(level, n, tokens, start)
            self._doc_starts.append(start)
            self._doc_tenants.append(tenant)
            self._write_pos = end + 1

    def _code_of(self, tenant: str) -> int:
        """The tenant's code, counting one more document of it."""
        self._num_tenant_docs[tenant] = self._num_tenant_docs.get(tenant, 0) + 1
        code = self._tenant_codes.get(tenant)
        if code is None:
            code = self._tenant_codes[tenant] = self._free_codes.pop() if self._free_codes else len(self._tenant_codes)
        return code

    def _forget_document_of(self, tenant: str) -> None:
        """One document of the tenant evicted; its code is freed with its last one."""
        self._num_tenant_docs[tenant] -= 1
        if not self._num_tenant_docs[tenant]:
            del self._num_tenant_docs[tenant]
            self._free_codes.append(self._tenant_codes.pop(tenant))

    def _link(self, level: int, n: int, tokens: np.ndarray, start: int) -> None:
        """Push every n-gram of the document that has a next token onto its bucket's chain."""
        windows = np.lib.stride_tricks.sliding_window_view(tokens, n)[: tokens.size - n]  # [m - n, n]
        buckets = _buckets(windows, self._bucket_bits)  # [m - n]
        starts = start + n + np.arange(tokens.size - n, dtype=np.int64)  # [m - n] continuation starts
        # Chain order inside the document: sort by (bucket, position); each entry links to the previous
        # one of its bucket, the first to the bucket's old head; the last becomes the new head.
        # E.g. buckets [7 3 7] at starts [10 11 12] -> prev[12] = 10, prev[10] = head[7], head[7] = 12.
        order = np.lexsort((starts, buckets))
        sorted_buckets, sorted_starts = buckets[order], starts[order]
        is_first = np.ones(order.size, dtype=bool)
        is_first[1:] = sorted_buckets[1:] != sorted_buckets[:-1]
        prev = np.empty_like(sorted_starts)
        prev[1:] = sorted_starts[:-1]
        prev[is_first] = self._heads[level, sorted_buckets[is_first]]
        self._prevs[level, sorted_starts % self._config.max_total_tokens] = prev
        is_last = np.append(is_first[1:], True)
        self._heads[level, sorted_buckets[is_last]] = sorted_starts[is_last]

    def query(
        self, context_ids: Sequence[int], max_tokens: int, max_candidates: int = 1, tenant: str = ""
    ) -> tuple[tuple[int, ...], ...]:
        """Continuations of the context's suffix in `tenant`'s documents, best first; () when nothing
        matches."""
        validate_propose_args(max_tokens, max_candidates)
        match_len = self._config.max_match_len
        suffix = np.asarray(context_ids[-match_len:], dtype=np.int64)
        if max_tokens == 0 or suffix.size == 0:
            return ()
        reversed_suffix = np.full(match_len, _NO_TOKEN, dtype=np.int64)  # [M], last context token first
        reversed_suffix[: suffix.size] = suffix[::-1]
        with self._lock:
            code = self._tenant_codes.get(tenant)
            if code is None:  # nothing of this tenant's yet
                return ()
            starts = self._longest_matches(suffix, reversed_suffix, code)
            if starts.size == 0:
                return ()
            ahead = starts[:, None] + np.arange(max_tokens)  # [K, T] absolute positions
            continuations = self._ring[ahead % self._config.max_total_tokens].astype(np.int64)  # [K, T]
            continuations[ahead >= self._write_pos] = SEPARATOR
        return most_frequent_paths(continuations, max_candidates)

    def _longest_matches(self, suffix: np.ndarray, reversed_suffix: np.ndarray, tenant_code: int) -> np.ndarray:
        """Continuation starts [K] of the occurrences with the longest exact match in the documents
        of the tenant, most recent first."""
        capacity, window_start = self._config.max_total_tokens, self._window_start()
        for level in reversed(range(len(self._config.ngram_sizes))):
            n = self._config.ngram_sizes[level]
            if suffix.size < n:
                continue
            found: list[int] = []
            pos = int(self._heads[level, _bucket(suffix[-n:].tolist(), self._bucket_bits)])
            # A chain mixes n-grams of one bucket; allow some collisions before giving up on this size.
            for _ in range(4 * self._config.max_occurrences):
                if pos < window_start or len(found) == self._config.max_occurrences:
                    break
                if self._owners[pos % capacity] == tenant_code:
                    found.append(pos)
                pos = int(self._prevs[level, pos % capacity])
            if not found:
                continue
            starts = np.array(found, dtype=np.int64)  # [K]
            behind = starts[:, None] - 1 - np.arange(reversed_suffix.size)  # [K, M] positions, backwards
            is_equal = (self._ring[behind % capacity] == reversed_suffix) & (behind >= window_start)  # [K, M]
            lengths = np.cumprod(is_equal, axis=1).sum(axis=1)  # [K] exact match lengths
            if lengths.max() >= n:  # below n: only hash collisions
                return starts[lengths == lengths.max()]
        return np.empty(0, dtype=np.int64)


class ContinuationIndex(Protocol):
    """What a SuffixDecoder reads: a SuffixIndex here, draft_svc.corpus's suffix array for "corpus"."""

    @property
    def max_match_len(self) -> int: ...

    def query(
        self, context_ids: Sequence[int], max_tokens: int, max_candidates: int = 1
    ) -> tuple[tuple[int, ...], ...]: ...


class SuffixDecoder:
    """Per-request view of a shared index: keeps only the context tail that matching reads. With a
    `tenant` (the pool gives one to the suffix index's decoders) it drafts from that tenant's
    documents only; without, from all (the corpus: text every machine has)."""

    name: ClassVar[str] = "suffix_index"

    def __init__(self, index: ContinuationIndex, tenant: str | None = None) -> None:
        self._index, self._tenant = index, tenant
        self._max_match_len = index.max_match_len
        self._tail = new_context()

    def extend(self, token_ids: Sequence[int]) -> None:
        append_tokens(self._tail, token_ids)
        if len(self._tail) > 2 * self._max_match_len:  # trim in batches: amortised O(1) per token
            del self._tail[: len(self._tail) - self._max_match_len]

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        tail = self._tail[-self._max_match_len :]
        if self._tenant is None:
            continuations = self._index.query(tail, max_tokens, max_candidates)
        else:
            assert isinstance(self._index, SuffixIndex), "only the suffix index keeps tenants apart"
            continuations = self._index.query(tail, max_tokens, max_candidates, tenant=self._tenant)
        return tuple(Candidate(self.name, tokens, rank=rank) for rank, tokens in enumerate(continuations))
