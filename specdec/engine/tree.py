"""Token-tree geometry for one verify pass: depths, the attention mask, positions.

A verify pass runs, for one request, `num_chain` committed-but-uncached tokens (the last
of them is the ROOT of the tree; normally num_chain == 1) followed by N draft nodes with
`parents[i]` in {-1} ∪ [0, i) (-1: child of the root).

    E.g. num_cached = 5, chain = [r] (row 0), nodes a b c d with parents [-1, 0, 0, -1]:

           r(pos 5) ── a(6) ── b(7)
                  │       └── c(7)
                  └── d(6)

    rows:   r   a   b   c   d         mask over [ctx(5) | r a b c d]
    r       1   .   .   .   .         every row sees the whole context,
    a       1   1   .   .   .         the chain causally, and in the tree
    b       1   1   1   .   .         only its ancestors and itself
    c       1   1   .   1   .
    d       1   .   .   .   1
"""

from __future__ import annotations

from typing import Sequence

import torch

ROOT = -1  # parents[i] of a node hanging off the root (the one definition of the project)


def chain_parents(num_nodes: int) -> tuple[int, ...]:
    """The parents of a chain of num_nodes drafts after the root: (ROOT, 0, 1, ..., num_nodes - 2)."""
    return tuple(range(ROOT, num_nodes - 1))


class TreeError(ValueError):
    """A malformed token tree; `field` is "token_ids" or "parents" (callers put their own prefix)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_tree(
    token_ids: Sequence[int], parents: Sequence[int], vocab_size: int | None = None, *, is_siblings_unique: bool = False
) -> None:
    """The token tree's invariants, checked in one place for every service: one parent per token;
    parents[i] is ROOT or an earlier node (parents precede children, so every node reaches the one
    root); tokens in [0, vocab_size) when given; with is_siblings_unique, no two children of a node
    carry the same token (a merged tree). TreeError naming the first offending entry."""
    if len(parents) != len(token_ids):
        raise TreeError("parents", f"parents has {len(parents)} entries, token_ids has {len(token_ids)}")
    children: set[tuple[int, int]] = set()
    for i, (token, parent) in enumerate(zip(token_ids, parents)):
        if not (parent == ROOT or 0 <= parent < i):
            raise TreeError("parents", f"parents[{i}] = {parent}: must be -1 or the index of an earlier node")
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise TreeError("token_ids", f"token_ids[{i}] = {token}: outside the vocabulary [0, {vocab_size})")
        if is_siblings_unique:
            if (parent, token) in children:
                raise TreeError("token_ids", f"token_ids[{i}] = {token}: repeats a sibling's token")
            children.add((parent, token))


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node; children of the root have depth 1."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == ROOT else depths[p] + 1)
    return depths


def ancestor_matrix(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p != ROOT:
            anc[i] |= anc[p]
    return anc


def verify_mask(num_cached: int, num_chain: int, parents: Sequence[int]) -> torch.Tensor | None:
    """[num_chain + N, num_cached + num_chain + N] bool (True = attend); None when every row sees all."""
    n = len(parents)
    rows = num_chain + n
    if rows == 1:
        return None  # a single new token attends to everything before it
    mask = torch.ones(rows, num_cached + rows, dtype=torch.bool)
    new = mask[:, num_cached:]  # [rows, rows] over the new tokens
    new[:num_chain, :num_chain] = torch.ones(num_chain, num_chain, dtype=torch.bool).tril()
    new[:num_chain, num_chain:] = False  # the chain never sees drafts
    if n:
        new[num_chain:, num_chain:] = ancestor_matrix(parents)  # drafts see the chain + ancestors
    return mask


def verify_position_ids(num_cached: int, num_chain: int, parents: Sequence[int]) -> list[int]:
    """[num_chain + N] positions: chain tokens sit at consecutive positions, nodes at root + depth.
    Python ints: a step joins every request's into one tensor. E.g. num_cached 5, chain of 1,
    parents [-1, 0, 0, -1] -> [5, 6, 7, 7, 6]."""
    root_pos = num_cached + num_chain - 1
    return [*range(num_cached, num_cached + num_chain), *(root_pos + d for d in node_depths(parents))]


def with_lookahead(
    token_ids: Sequence[int],
    parents: Sequence[int],
    lookahead_token_ids: Sequence[int],
    lookahead_parents: Sequence[int],
) -> tuple[list[int], list[int]]:
    """The draft tree followed by the lookahead tree as one tree: lookahead node j becomes node
    N + j, its parent shifted by N (ROOT stays ROOT). E.g. tree parents [-1, 0], lookahead parents
    [-1, 0, 1] -> [-1, 0, -1, 2, 3]."""
    n = len(token_ids)
    shifted = [p if p == ROOT else p + n for p in lookahead_parents]
    return [*token_ids, *lookahead_token_ids], [*parents, *shifted]


def is_path(parents: Sequence[int], nodes: Sequence[int]) -> bool:
    """True when `nodes` walks down from the root: each node's parent is the previous one."""
    expected_parent = ROOT
    for i in nodes:
        if not (0 <= i < len(parents)) or parents[i] != expected_parent:
            return False
        expected_parent = i
    return True


def row_paths(num_chain: int, parents: Sequence[int]) -> list[torch.Tensor]:
    """Per verify row, the new rows it sees in position order (int64 [depth]): the chain causally,
    then a node's ancestors and itself. E.g. chain [r], parents [-1, 0, 0, -1] (rows r a b c d):
    r -> [0], a -> [0 1], b -> [0 1 2], c -> [0 1 3], d -> [0 4]."""
    mask = verify_mask(0, num_chain, parents)
    if mask is None:
        return [torch.zeros(1, dtype=torch.int64)]
    return [row.nonzero().squeeze(1) for row in mask]
