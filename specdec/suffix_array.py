"""A suffix array over a token corpus, sorted backwards, and the longest-match query on it.

REST (He et al. 2024) retrieves drafts from a datastore with a suffix array: find the longest
suffix of the context that occurs in the corpus, then propose what most often followed it. The
array here sorts continuation positions by the tokens BEFORE them, read backwards:

    corpus tokens t[0..N), documents separated by SEPARATOR
    row i of `order` = a position p (t[p - 1] a real token), rows sorted by the key
        (t[p - 1], t[p - 2], ..., t[p - sort_depth]), SEPARATOR (or the corpus start) lowest,
        ties by p
    # E.g. t = [a b a b SEP], a < b: positions 1..4 have keys (a), (b a), (a b a), (b a b a);
    #   order = [1, 3, 2, 4]: keys a, a b a | b a, b a b a

Read backwards, the context's suffix of length d + 1 matches the rows of a sub-range of the
suffix of length d's rows: the longest match is found by narrowing one range, one token at a
time from the context's end, and stops at the first token that no row continues with ("longest
match first, backing off" to the last non-empty range). The continuations of the match are
t[p], t[p + 1], ... for the range's rows p.

Built by prefix doubling (Manber & Myers 1993), stopped at sort_depth: rank_2k(p) is the rank of
the pair (rank_k(p), rank_k(p - k)); log2(sort_depth) sorts of N int64 keys. Nothing deeper than
sort_depth is sorted: a range still wider than `max_occurrences` rows there is sampled.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from specdec.field_checks import require_at_least_one

SEPARATOR = -1  # written after each document; never equals a token id, so matches stop at document ends
GATHER_ROWS = 4096  # a range at most this wide is narrowed by one vectorised gather + searchsorted


def no_progress(num_done: int, num_total: int) -> None:
    """sort_positions' default progress callback: (sorting rounds done, rounds in all)."""


@dataclasses.dataclass(frozen=True, slots=True)
class QueryConfig:
    max_match_len: int = 32  # longest context suffix compared
    min_match_len: int = 2  # a shorter match proposes nothing (one token says little about the next)
    max_occurrences: int = 64  # rows voted on per match length; a wider range is sampled evenly

    def __post_init__(self) -> None:
        if not 1 <= self.min_match_len <= self.max_match_len:
            raise ValueError(
                f"need 1 <= min_match_len <= max_match_len, got {self.min_match_len}, {self.max_match_len}"
            )
        require_at_least_one(self, "max_occurrences")


def sort_positions(
    tokens: np.ndarray, sort_depth: int, progress: Callable[[int, int], None] = no_progress
) -> np.ndarray:
    """tokens [N] int32 (SEPARATOR after every document) -> order [R] int32, the positions p with a
    real token at p - 1, sorted by their backward key of sort_depth tokens, ties by p."""
    if sort_depth < 1:
        raise ValueError(f"sort_depth must be >= 1, got {sort_depth}")
    if tokens.size >= np.iinfo(np.int32).max:
        raise ValueError(f"a corpus holds at most {np.iinfo(np.int32).max - 1} tokens, got {tokens.size}")
    num_rounds = max(0, (sort_depth - 1).bit_length())  # depth 1, 2, 4, ... >= sort_depth
    # rank[p] for p in [0, N): the key of depth 1 is t[p - 1] shifted so that SEPARATOR (and the
    # corpus start, p = 0) rank 0, below every token.
    rank = np.zeros(tokens.size, dtype=np.int64)
    rank[1:] = tokens[:-1].astype(np.int64) - SEPARATOR
    depth = 1
    for done in range(num_rounds):
        progress(done, num_rounds + 1)
        behind = np.zeros_like(rank)  # rank_k(p - k), 0 before the corpus start
        behind[depth:] = rank[:-depth]
        key = rank * (int(rank.max()) + 1) + behind  # < 2**62 while N < 2**31
        _, rank = np.unique(key, return_inverse=True)  # dense ranks of the depth-2k keys
        rank = rank.reshape(-1).astype(np.int64)
        depth *= 2
    order = np.argsort(rank, kind="stable")  # ties keep position order
    progress(num_rounds, num_rounds + 1)
    is_row = np.zeros(tokens.size, dtype=bool)
    is_row[1:] = tokens[:-1] != SEPARATOR
    return order[is_row[order]].astype(np.int32)


def block_starts(tokens: np.ndarray, order: np.ndarray, vocab_size: int) -> np.ndarray:
    """[vocab_size + 1] int64: rows [starts[v], starts[v + 1]) of `order` end with token v (depth 1)."""
    last = tokens[order.astype(np.int64) - 1]  # [R], ascending
    return np.searchsorted(last, np.arange(vocab_size + 1), side="left").astype(np.int64)


class SuffixArray:
    """Read-only queries over (tokens, order, block_starts), numpy arrays or memory maps of them."""

    def __init__(
        self,
        tokens: np.ndarray,
        order: np.ndarray,
        starts: np.ndarray,
        sort_depth: int,
        config: QueryConfig | None = None,
    ) -> None:
        assert tokens.ndim == order.ndim == starts.ndim == 1
        # Plain ndarray views of memory maps: np.memmap's own indexing costs microseconds per lookup.
        self.tokens, self.order, self.starts = np.asarray(tokens), np.asarray(order), np.asarray(starts)
        self.sort_depth = sort_depth
        self.config = config or QueryConfig()
        self.vocab_size = starts.size - 1

    @property
    def max_match_len(self) -> int:
        return self.config.max_match_len

    def query(
        self, context_ids: Sequence[int], max_tokens: int, max_candidates: int = 1
    ) -> tuple[tuple[int, ...], ...]:
        """Continuations of the context's longest matched suffix, best first; () when nothing matches.

        Rank r starts with the r-th most frequent next token after the longest match; when that match
        has fewer distinct next tokens than max_candidates, the next shorter match fills the rest."""
        if max_tokens < 0 or max_candidates < 1:
            raise ValueError(f"need max_tokens >= 0 and max_candidates >= 1, got {max_tokens}, {max_candidates}")
        if max_tokens == 0:
            return ()
        paths: list[tuple[int, ...]] = []
        for starts in self.occurrences(context_ids):
            continuations = self.continuations(starts, max_tokens)
            firsts = {path[0] for path in paths}
            paths += [p for p in most_frequent_paths(continuations, max_candidates) if p[0] not in firsts]
            if len(paths) >= max_candidates:
                break
        return tuple(paths[:max_candidates])

    def continuations(self, starts: np.ndarray, max_tokens: int) -> np.ndarray:
        """starts [K] -> [K, max_tokens] int64: the tokens from each start on, SEPARATOR past the corpus end."""
        ahead = starts[:, None] + np.arange(max_tokens)  # [K, T]
        continuations = np.full(ahead.shape, SEPARATOR, dtype=np.int64)
        is_inside = ahead < self.tokens.size
        continuations[is_inside] = self.tokens[ahead[is_inside]]
        return continuations

    def occurrences(self, context_ids: Sequence[int]) -> Iterator[np.ndarray]:
        """Continuation starts [K] int64 per match length, longest first, down to min_match_len; each at
        most max_occurrences (evenly sampled from a wider range)."""
        suffix = [int(t) for t in context_ids[-self.config.max_match_len :]]
        if len(suffix) < self.config.min_match_len or not 0 <= suffix[-1] < self.vocab_size:
            return
        ranges = [(int(self.starts[suffix[-1]]), int(self.starts[suffix[-1] + 1]))]  # depth 1
        if ranges[0][0] == ranges[0][1]:
            return
        # Narrow while the range is wide and sorted: rows of ranges[d - 1] are sorted by t[p - 1 - d].
        while (
            len(ranges) < len(suffix)
            and len(ranges) < self.sort_depth
            and ranges[-1][1] - ranges[-1][0] > self.config.max_occurrences
        ):
            narrowed = self._narrow(*ranges[-1], len(ranges), suffix[-1 - len(ranges)])
            if narrowed[0] == narrowed[1]:
                break
            ranges.append(narrowed)
        # The last range's rows (sampled when wide): exact match lengths, then each length's rows.
        lo, hi = ranges[-1]
        rows = (
            np.arange(lo, hi)
            if hi - lo <= self.config.max_occurrences
            else lo + np.arange(self.config.max_occurrences) * (hi - lo) // self.config.max_occurrences
        )
        starts = self.order[rows].astype(np.int64)  # [K]
        lengths = self._match_lengths(starts, suffix)  # [K], >= len(ranges)
        for length in range(int(lengths.max()), self.config.min_match_len - 1, -1):
            if length >= len(ranges):
                if (lengths == length).any():
                    yield starts[lengths >= length]
            else:  # shorter than the narrowed depth: the recorded range, sampled
                lo, hi = ranges[length - 1]
                rows = (
                    np.arange(lo, hi)
                    if hi - lo <= self.config.max_occurrences
                    else lo + np.arange(self.config.max_occurrences) * (hi - lo) // self.config.max_occurrences
                )
                yield self.order[rows].astype(np.int64)

    def _key(self, row: int, depth: int) -> int:
        """The token `depth` places before row's t[p - 1]; SEPARATOR before the corpus start."""
        at = int(self.order[row]) - 1 - depth
        return int(self.tokens[at]) if at >= 0 else SEPARATOR

    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """The sub-range of rows [lo, hi) whose token at `depth` is `token` (rows are sorted by it)."""
        if hi - lo > GATHER_ROWS:  # a scalar lookup per bisection step, not a gather of the whole range

            def key(row: int) -> int:
                return self._key(row, depth)

            return (
                bisect.bisect_left(range(hi), token, lo, hi, key=key),
                bisect.bisect_right(range(hi), token, lo, hi, key=key),
            )
        at = self.order[lo:hi].astype(np.int64) - 1 - depth  # [R]
        keys = np.where(at >= 0, self.tokens[np.maximum(at, 0)], SEPARATOR)  # [R], ascending
        return lo + int(np.searchsorted(keys, token, "left")), lo + int(np.searchsorted(keys, token, "right"))

    def _match_lengths(self, starts: np.ndarray, suffix: list[int]) -> np.ndarray:
        """starts [K] -> [K] how many context tokens, from the last backwards, precede each start."""
        reversed_suffix = np.array(suffix[::-1], dtype=np.int64)  # [M]
        behind = starts[:, None] - 1 - np.arange(reversed_suffix.size)  # [K, M]
        is_equal = (self.tokens[np.maximum(behind, 0)] == reversed_suffix) & (behind >= 0)
        return np.cumprod(is_equal, axis=1).sum(axis=1)


def most_frequent_paths(continuations: np.ndarray, max_candidates: int) -> tuple[tuple[int, ...], ...]:
    """continuations [K, T], rows most recent first, SEPARATOR past a document's end.

    Rank r follows the r-th most frequent first token, then at each depth the most frequent next
    token among the rows that agree so far. E.g. rows [a b], [a c], [a c], [d e] -> ([a c], [d e]).
    """
    num_tokens = continuations.shape[1]
    paths: list[tuple[int, ...]] = []
    for first in ranked_tokens(continuations[:, 0])[:max_candidates]:
        rows = continuations[continuations[:, 0] == first]  # [R, T], R >= 1
        path, depth = [int(first)], 1
        while depth < num_tokens:
            # Where all rows agree, the vote is unanimous: take that stretch in one step.
            is_agreed = (rows[:, depth:] == rows[0, depth:]).all(axis=0)  # [T - depth]
            stretch = rows[0, depth : depth + (is_agreed.size if is_agreed.all() else int(is_agreed.argmin()))]
            is_end = stretch == SEPARATOR
            if is_end.any():
                path.extend(stretch[: int(is_end.argmax())].tolist())
                break
            path.extend(stretch.tolist())
            depth += stretch.size
            if depth == num_tokens:
                break
            ranked = ranked_tokens(rows[:, depth])
            if ranked.size == 0:
                break
            path.append(int(ranked[0]))
            rows = rows[rows[:, depth] == ranked[0]]
            depth += 1
        paths.append(tuple(path))
    return tuple(paths)


def ranked_tokens(column: np.ndarray) -> np.ndarray:
    """Distinct tokens of a column (SEPARATOR excluded), most frequent first, ties to the earliest row."""
    column = column[column != SEPARATOR]
    if column.size == 0:
        return column
    values, first_rows, counts = np.unique(column, return_index=True, return_counts=True)
    return values[np.lexsort((first_rows, -counts))]
