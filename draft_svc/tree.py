"""Merge the candidates of one speculative step into a token tree (SpecInfer, Miao et al. 2024).

Conventions (shared with primary_svc and validator_svc): nodes 0..N-1 in topological order;
`parents[i]` is ROOT (-1) for a child of the root (the request's pending last token), else
an index below i; the root has depth 0, its children depth 1; children of one parent carry
distinct tokens. Bit i of `node_sources[j]` says candidate i's chain passes through node j.

Merge: candidates are inserted best first into a trie keyed by (parent, token), so a shared prefix
is stored once and duplicate candidates collapse. Node order is candidate-major: candidate 0's chain,
then the nodes candidate 1 adds, and so on; a parent is always created before its children.

    # E.g. candidates [a b c], [a b d], [e] -> tokens [a b c d e], parents [-1 0 1 1 -1],
    #      depths [1 2 3 3 1], node_sources [0b011 0b011 0b001 0b010 0b100]

Node budget (max_nodes), truncation policy: candidate 0's chain is kept whole first (it is the
controller's best guess, and a chain's value lies in its depth); the remaining budget goes to the
other candidates breadth-first (all their depth-1 nodes in rank order, then depth 2, ...), because a
node at depth d is accepted with probability ~alpha^d: shallow alternatives are worth more than
deep ones. The kept set is closed under ancestors and keeps the candidate-major order.

    # E.g. the candidates above with max_nodes=4 -> [a b c] whole, then depth 1: [e] (a is shared);
    #      then depth 3: budget gone before d -> tokens [a b c e], parents [-1 0 1 -1]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from draft_svc.strategies.base import Candidate
from specdec.engine.tree import ROOT, check_tree


@dataclasses.dataclass(frozen=True, slots=True)
class TokenTree:
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    node_sources: tuple[int, ...]  # bitmask over candidates: bit i = candidate i proposed this node
    decoders: tuple[str, ...]  # decoders[i]: candidate i's decoder name; its rank: specdec.candidates

    def __post_init__(self) -> None:
        num_nodes = len(self.token_ids)
        if not len(self.parents) == len(self.depths) == len(self.node_sources) == num_nodes:
            raise ValueError("token_ids, parents, depths and node_sources must have one entry per node")
        check_tree(self.token_ids, self.parents, is_siblings_unique=True)
        for i, (parent, depth) in enumerate(zip(self.parents, self.depths)):
            if depth != (1 if parent == ROOT else self.depths[parent] + 1):
                raise ValueError(f"depths[{i}]={depth} disagrees with its parent")

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)


def build_token_tree(candidates: Sequence[Candidate], max_nodes: int) -> TokenTree:
    """Candidates best first -> merged tree of at most max_nodes nodes (see the module docstring)."""
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    token_ids: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    sources: list[int] = []
    paths: list[list[int]] = []  # paths[i]: candidate i's nodes, root to leaf
    for i, candidate in enumerate(candidates):
        parent, path = ROOT, []
        for depth, token in enumerate(candidate.token_ids, start=1):
            node = child_of.get((parent, token))
            if node is None:
                node = child_of[parent, token] = len(token_ids)
                token_ids.append(token)
                parents.append(parent)
                depths.append(depth)
                sources.append(0)
            sources[node] |= 1 << i
            path.append(node)
            parent = node
        paths.append(path)

    if len(token_ids) > max_nodes:
        # Ascending old index keeps the candidate-major (hence topological) order.
        order = sorted(_within_budget(paths, max_nodes))
        new_index = {old: new for new, old in enumerate(order)}
        new_index[ROOT] = ROOT
        token_ids = [token_ids[old] for old in order]
        parents = [new_index[parents[old]] for old in order]
        depths = [depths[old] for old in order]
        sources = [sources[old] for old in order]

    return TokenTree(
        token_ids=tuple(token_ids),
        parents=tuple(parents),
        depths=tuple(depths),
        node_sources=tuple(sources),
        decoders=tuple(c.decoder for c in candidates),
    )


def _within_budget(paths: list[list[int]], max_nodes: int) -> set[int]:
    kept = set(paths[0][:max_nodes]) if paths else set()
    max_depth = max((len(path) for path in paths), default=0)
    for depth in range(max_depth):
        for path in paths[1:]:
            if depth < len(path) and path[depth] not in kept:
                if len(kept) == max_nodes:
                    return kept
                kept.add(path[depth])
    return kept
