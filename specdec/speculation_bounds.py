"""The bounds of one step's speculation, declared once for every service.

Three layers, each inside the one before it:

    structural   what any service accepts of a step (the primary's verify, the draft pool's Propose):
                 MAX_DRAFT_LENGTH (tree depth), MAX_CANDIDATES, MAX_TREE_NODES
    request      what one request may ask for at the edge (the gateway's params, the HTTP front):
                 half the depth and a quarter of the tree keep a step within the measured verify
                 curve (64 rows, gateway/cost_model.py)
    adaptive     what the adaptive controller chooses among when a request leaves it free: its
                 draft-length menu (DRAFT_LENGTH_CHOICES), also the precision autotune's horizon

A request's value is validated once, at the edge, with INVALID_ARGUMENT / HTTP 400 naming the field;
the configurations of the services are checked against these at start-up (check_speculation_bounds),
and the code inside asserts.
"""

from __future__ import annotations

# Structural: what any service accepts of one step.
MAX_TREE_NODES = 256  # nodes of a verified tree: the primary's verify rows of one request, bounded
MAX_DRAFT_LENGTH = 64  # tokens of one candidate: the depth of the tree
MAX_CANDIDATES = 32  # candidates of one step: node_sources is a uint32 bitmask over them
MAX_LOOKAHEAD_NODES = 64  # a Jacobi window of W positions x (N - 1) levels (draft_svc/strategies/lookahead.py)

# Request: what one request may ask for.
MAX_REQUEST_DRAFT_LENGTH = MAX_DRAFT_LENGTH // 2
MAX_REQUEST_SPECULATIVE_DEGREE = 8
MAX_REQUEST_TREE_NODES = MAX_TREE_NODES // 4

# Defaults of a request that sets neither (and of a Propose that leaves draft_length 0).
DEFAULT_DRAFT_LENGTH = 8
DEFAULT_SPECULATIVE_DEGREE = 1

# Adaptive: the controller's draft lengths, and the degree it goes up to by default.
DRAFT_LENGTH_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16)
MAX_ADAPTIVE_DRAFT_LENGTH = max(DRAFT_LENGTH_CHOICES)
MAX_ADAPTIVE_SPECULATIVE_DEGREE = 4

assert 1 <= DEFAULT_DRAFT_LENGTH <= MAX_ADAPTIVE_DRAFT_LENGTH <= MAX_REQUEST_DRAFT_LENGTH <= MAX_DRAFT_LENGTH
assert 1 <= DEFAULT_SPECULATIVE_DEGREE <= MAX_ADAPTIVE_SPECULATIVE_DEGREE <= MAX_REQUEST_SPECULATIVE_DEGREE
assert MAX_REQUEST_SPECULATIVE_DEGREE <= MAX_CANDIDATES and MAX_REQUEST_TREE_NODES <= MAX_TREE_NODES


def check_speculation_bounds(max_speculative_degree: int, max_draft_length: int, max_tree_nodes: int) -> None:
    """A service's limits on a step lie within the structural bounds (ValueError naming the limit)."""
    for name, value, bound in (
        ("max_speculative_degree", max_speculative_degree, MAX_CANDIDATES),
        ("max_draft_length", max_draft_length, MAX_DRAFT_LENGTH),
        ("max_tree_nodes", max_tree_nodes, MAX_TREE_NODES),
    ):
        if not 1 <= value <= bound:
            raise ValueError(f"{name} must be in [1, {bound}], got {value}")


def range_error(value: int, low: int, high: int) -> str | None:
    """The message of a request value outside [low, high] (the same words at every edge), else None."""
    return None if low <= value <= high else f"must be in [{low}, {high}], got {value}"
