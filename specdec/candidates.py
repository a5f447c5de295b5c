"""The candidates of one speculative step, as the gateway and the draft pool both read them.

A step asks the draft pool for a list of decoder names, best first; the r-th occurrence of a name
is that decoder's rank r (its r-th best answer), and candidate i is bit i of every tree node's
`node_sources`:

    # E.g. (prompt_lookup, suffix_index, prompt_lookup)
    #   -> ((prompt_lookup, 0), (suffix_index, 0), (prompt_lookup, 1)): prompt lookup runs once
    #      for two answers, the suffix index once for one

After validation each candidate has an outcome, the controller's evidence about its (decoder, rank),
and a name in the request's stats: "prompt_lookup" for rank 0, "prompt_lookup#1" for rank 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specdec.engine.tree import ROOT

RANK_SEPARATOR = "#"


@dataclasses.dataclass(frozen=True, slots=True)
class CandidateOutcome:
    """What one candidate achieved in one step."""

    decoder: str
    rank: int
    num_proposed: int  # the candidate's tokens that made it into the tree
    num_accepted: int  # of those, on the accepted path (always a prefix of the candidate)


def ranked_sources(decoders: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """A candidate list -> (decoder, rank) per candidate: the r-th occurrence of a name is rank r."""
    seen: dict[str, int] = {}
    ranked = []
    for name in decoders:
        ranked.append((name, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return tuple(ranked)


def decoders_for(sources: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """(decoder, rank) per candidate -> the candidate list; the inverse of ranked_sources. Ranks of
    a decoder must appear in order 0, 1, 2, ... (ValueError otherwise)."""
    decoders = tuple(name for name, _ in sources)
    if ranked_sources(decoders) != tuple(sources):
        raise ValueError(f"sources must list each decoder's ranks in order from 0, got {list(sources)}")
    return decoders


def candidate_outcomes(
    decoders: Sequence[str], node_sources: Sequence[int], accepted_nodes: Sequence[int], parents: Sequence[int]
) -> list[CandidateOutcome]:
    """Map the accepted path back to each candidate: its nodes in the tree, and those accepted.

    A candidate is a root path, so its accepted tokens are the accepted nodes carrying its bit.

    # E.g. decoders (a, b), tree 0:x(a,b) 1:y(a) 2:z(b) with parents (-1, 0, 0), accepted [0, 2]
    #   -> a: 2 proposed, 1 accepted; b: 2 proposed, 2 accepted
    """
    expected_parent = ROOT
    for node in accepted_nodes:
        if not 0 <= node < len(parents) or parents[node] != expected_parent:
            raise ValueError(f"accepted_nodes {list(accepted_nodes)} is not a root path of the tree")
        expected_parent = node
    outcomes = []
    for i, (decoder, rank) in enumerate(ranked_sources(decoders)):
        bit = 1 << i
        outcomes.append(
            CandidateOutcome(
                decoder,
                rank,
                num_proposed=sum(1 for mask in node_sources if mask & bit),
                num_accepted=sum(1 for node in accepted_nodes if node_sources[node] & bit),
            )
        )
    return outcomes


@dataclasses.dataclass(frozen=True, slots=True)
class DepthOutcome:
    """What one decoder's subtree (all its ranks) achieved in one step. Its nodes are closed under
    ancestors (each candidate is a root path), so the walk tests it at depths 1..num_tested and
    goes on through its nodes at depths 1..num_accepted, num_accepted = num_tested or num_tested - 1:
    acceptance at depth d is (steps with num_accepted >= d) / (steps with num_tested >= d)."""

    decoder: str
    num_tested: int  # depths at which the accepted path reached a node where the decoder had a child
    num_accepted: int  # of those, the depths whose path node is the decoder's


def depth_outcomes(
    decoders: Sequence[str], node_sources: Sequence[int], accepted_nodes: Sequence[int], parents: Sequence[int]
) -> list[DepthOutcome]:
    """Per distinct decoder (first-use order), how deep the accepted path tested it and went on
    through its nodes.

    # E.g. decoders (a, b), tree 0:x(a,b) 1:y(a) 2:z(b) with parents (-1, 0, 0), accepted [0, 2]
    #   -> a: tested 2, accepted 1 (y rejected at depth 2); b: tested 2, accepted 2 (z a leaf)
    #   accepted [0] (y and z rejected) -> a: tested 2, accepted 1; b: tested 2, accepted 1
    #   accepted [] (x rejected) -> a: 1, 0; b: 1, 0
    """
    has_child: dict[int, int] = {}  # node (ROOT too) -> OR of its children's sources
    for node, parent in enumerate(parents):
        has_child[parent] = has_child.get(parent, 0) | node_sources[node]
    masks: dict[str, int] = {}
    for i, name in enumerate(decoders):
        masks[name] = masks.get(name, 0) | (1 << i)
    out = []
    for name, mask in masks.items():
        num_accepted = 0
        while num_accepted < len(accepted_nodes) and node_sources[accepted_nodes[num_accepted]] & mask:
            num_accepted += 1
        # the walk left its nodes (or stopped) after depth num_accepted: tested there if it had a child
        at = accepted_nodes[num_accepted - 1] if num_accepted else ROOT
        out.append(DepthOutcome(name, num_accepted + int(bool(has_child.get(at, 0) & mask)), num_accepted))
    return out


def stats_name(decoder: str, rank: int) -> str:
    """The name a candidate's figures are kept under: "prompt_lookup", "prompt_lookup#1", ..."""
    return decoder if rank == 0 else f"{decoder}{RANK_SEPARATOR}{rank}"


def decoder_of(name: str) -> str:
    """The decoder of a stats name: "early_exit#1" -> "early_exit"."""
    return name.split(RANK_SEPARATOR, 1)[0]
