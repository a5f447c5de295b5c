"""The acceptance rule: which path of a verified token tree is kept, plus one primary token.

Terms (one speculative step, tree of N draft nodes, target logits [N+1, V], row 0 = the root):
  accepted tokens   draft tokens on the kept root-to-node path; `accepted_nodes` lists their
                    node indices in order (possibly empty).
  bonus token       one token drawn from the primary at the row of the last accepted node (row 0
                    when none was accepted). When the walk ends at a leaf it is a plain sample
                    (argmax in greedy mode) of that row; when it ends because every child was
                    rejected it is the correction (recovered) token: a sample from the residual
                    distribution that makes the step exact.
  accepted length   len(accepted_nodes) + 1 tokens committed per step.

Modes (specdec.acceptance_mode; the caller decides which, this module applies it):
  greedy     Accept the child whose token is the primary's argmax (lossless for temperature 0).
  sample     Two exact rules, chosen by what the drafts are.
             Deterministic drafts (prompt lookup, suffix index, grammar, lookahead: no draft
             probabilities, which is every tree the services send): the per-position walk. The
             token at position p of the request's generated tokens (the root row's is the step's
             `position`; a node's row is one past its parent's) is drawn from the target at that
             row with the uniform of stream (seed, p), exactly the draw a plain decode makes there
             (specdec.sampling.make_generator), and the child holding that token is accepted; the
             walk ends at the first row without such a child, and that row's draw is the bonus.
             The step commits what sequential sampling commits, so it is lossless, and a seed gives
             the same text with any drafts, any plan, or speculation off. A child x is accepted
             with probability p(x) (siblings: the sum of theirs), as rejection sampling accepts a
             point mass: nothing is lost in accepted length.
             Drafts drawn from distributions (draft_probs given; the library's, not the services'):
             recursive rejection sampling (Leviathan et al. 2023, "Fast Inference from
             Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating LLM
             Decoding with Speculative Sampling"), extended to trees as in SpecInfer (Miao et al.
             2024), SpecTr (Sun et al. 2023) and RSD (Jeon et al. 2024). At a node with target p
             and children x_1..x_k (index order) drawn from q_1..q_k:
               accept x_j with probability min(1, p(x_j) / q_j(x_j));
               on reject  p <- normalize(max(p - q_j, 0)) and try x_{j+1};
               all rejected -> correction token ~ p.
             q_j is renormalised without the tokens of earlier siblings: the merge dedups
             siblings, so x_j can only be a token not already offered (sampling without
             replacement, as in RSD). A deterministic draft (n-gram, suffix: no draft probs) is
             the point mass q_j = onehot(x_j): accept with probability p(x_j), on reject zero
             p(x_j) and renormalise. Lossless: the committed tokens are distributed exactly as
             the primary's (after temperature / top-k / top-p).
  threshold  Opt-in and LOSSY: accept a child x when p(x) >= acceptance_threshold * max(p) at
             that row (p after the sampling params; the temperature-1 softmax when temperature
             is 0), the most likely qualifying child first. Trades exactness for accepted
             length on near-ties. Threshold 0 means off (greedy or sample).

Inputs are validated (ValueError naming the field); argmax is computed once for all rows, entropy
and probabilities only for the rows the walk visits (depth + 1 of the N + 1).

A grammar mask (`allowed`, a specdec.grammar.TokenBitmask of the N + 1 rows) gives every token it
forbids probability 0, exactly as if its logits were MASKED_LOGIT: the masked argmax, the masked
row of a visited row, a bit test for a child's token. The logits themselves stay unmasked.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable, Sequence

import torch

from specdec.acceptance_mode import THRESHOLD_OFF, AcceptanceMode, check_mode
from specdec.engine.tree import check_tree
from specdec.grammar.bitmask import TokenBitmask
from specdec.grammar.mask import MASKED_LOGIT
from specdec.sampling import SamplingParams, logits_to_probs, make_generator, sample
from validator_svc.entropy import row_entropy

ROOT_ROW = 0  # logits row of the root; node i's row is i + 1

Children = tuple[tuple[int, ...], ...]  # children[row]: node indices in index order


@dataclasses.dataclass(frozen=True, slots=True)
class ValidationResult:
    accepted_nodes: tuple[int, ...]
    bonus_token: int
    accepted_entropies: tuple[float, ...]  # primary entropy (nats) at each row where a child was accepted
    rejected_entropies: tuple[float, ...]  # ... at the row where the walk stopped with children present

    @property
    def accepted_length(self) -> int:
        return len(self.accepted_nodes) + 1


def validate_tree(
    token_ids: Sequence[int] | torch.Tensor,
    parents: Sequence[int] | torch.Tensor,
    target_logits: torch.Tensor,
    params: SamplingParams,
    mode: AcceptanceMode,
    *,
    acceptance_threshold: float = THRESHOLD_OFF,
    draft_probs: torch.Tensor | None = None,
    argmax_ids: Sequence[int] | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    position: int = 0,
    allowed: TokenBitmask | None = None,
) -> ValidationResult:
    """Apply `mode` (decided by the caller: specdec.acceptance_mode). The token drawn d levels below
    the root comes from make_generator(params.seed, position + d), or from `generator` when given
    (then every draw of the step does)."""
    check_mode(mode, params, acceptance_threshold)
    if mode == AcceptanceMode.GREEDY:
        return greedy_accept(token_ids, parents, target_logits, argmax_ids=argmax_ids, allowed=allowed)
    draws = positional_draws(params.seed, position) if generator is None else generator
    if mode == AcceptanceMode.SAMPLE:
        if draft_probs is None:
            return positional_sample_accept(token_ids, parents, target_logits, params, draws, allowed=allowed)
        return rejection_sample_accept(
            token_ids, parents, target_logits, params, _draw(draws, 0), draft_probs=draft_probs, allowed=allowed
        )
    return threshold_accept(
        token_ids,
        parents,
        target_logits,
        params,
        acceptance_threshold,
        draws,
        argmax_ids=argmax_ids,
        allowed=allowed,
    )


# The random stream of each draw of a step: a function of the draw's depth below the root, or one
# generator for every draw (a caller's own stream).
Draws = Callable[[int], torch.Generator] | torch.Generator | None


def positional_draws(seed: int | None, position: int) -> Callable[[int], torch.Generator]:
    """The stream of the token `depth` levels below a step's root: that of its position."""
    return lambda depth: make_generator(seed, position + depth)


def _draw(draws: Draws, depth: int) -> torch.Generator | None:
    return draws(depth) if callable(draws) else draws


def positional_sample_accept(
    token_ids,
    parents,
    target_logits: torch.Tensor,
    params: SamplingParams,
    draws: Draws,
    *,
    allowed: TokenBitmask | None = None,
) -> ValidationResult:
    """The per-position walk over a tree of deterministic drafts (module doc): at each row one draw
    from the target (one uniform, specdec.sampling.sample) on the stream of its depth; the child
    holding the drawn token is accepted, else the draw is the bonus token."""
    ids, children, entropies = _check_inputs(token_ids, parents, target_logits, allowed)
    row_probs = _RowProbs(target_logits, params, allowed)
    drawn: list[int] = []  # drawn[d]: the token drawn d levels below the root

    def choose(row: int) -> int | None:
        drawn.append(int(sample(row_probs[row][None], _draw(draws, len(drawn)))[0]))
        return next((j for j in children[row] if ids[j] == drawn[-1]), None)

    accepted, stop_row = _walk(children, choose)
    return walk_result(children, accepted, stop_row, drawn[-1], entropies)


def greedy_accept(
    token_ids, parents, target_logits: torch.Tensor, *, argmax_ids=None, allowed: TokenBitmask | None = None
) -> ValidationResult:
    """argmax_ids [N+1], when given (computed by the primary from fp32), overrides the logits' argmax."""
    ids, children, entropies = _check_inputs(token_ids, parents, target_logits, allowed)
    argmax = check_argmax_ids(argmax_ids, *target_logits.shape) or tuple(_argmax(target_logits, allowed).tolist())
    return greedy_walk(children, ids, argmax, entropies)


def greedy_walk(
    children: Children,
    token_ids: Sequence[int],
    argmax_ids: Sequence[int],
    row_entropies: Sequence[float] | _RowEntropies,
) -> ValidationResult:
    """The greedy rule on precomputed per-row argmax [N+1] (shared with the CUDA path)."""

    def choose(row: int) -> int | None:
        return next((j for j in children[row] if token_ids[j] == argmax_ids[row]), None)

    accepted, stop_row = _walk(children, choose)
    return walk_result(children, accepted, stop_row, argmax_ids[stop_row], row_entropies)


def threshold_walk(
    children: Children,
    node_scores: Sequence[float],
    is_qualified: Sequence[bool],
) -> tuple[tuple[int, ...], int]:
    """Walk taking, at each row, the qualifying child with the highest score (lowest index on ties).

    Returns (accepted_nodes, stop_row). Shared by the reference and the CUDA path.
    """

    def choose(row: int) -> int | None:
        best = None
        for j in children[row]:
            if is_qualified[j] and (best is None or node_scores[j] > node_scores[best]):
                best = j
        return best

    return _walk(children, choose)


def threshold_greedy_qualified(
    child_logits: Sequence[float], parent_row_max: Sequence[float], acceptance_threshold: float
) -> list[bool]:
    """Temperature 0: p(x) >= t * max(p) under softmax(logits)  <=>  x_logit - row_max >= log t.

    Compared in float64 on the exact decoded float32 values, so the CPU and CUDA paths agree bit for bit.
    """
    log_threshold = math.log(acceptance_threshold)
    return [float(x) - float(m) >= log_threshold for x, m in zip(child_logits, parent_row_max)]


def threshold_accept(
    token_ids,
    parents,
    target_logits: torch.Tensor,
    params: SamplingParams,
    acceptance_threshold: float,
    draws: Draws,
    *,
    argmax_ids=None,
    allowed: TokenBitmask | None = None,
) -> ValidationResult:
    """At temperature > 0 the bonus token is drawn on the stream of its depth (`draws`)."""
    check_mode(AcceptanceMode.THRESHOLD, params, acceptance_threshold)
    ids, children, entropies = _check_inputs(token_ids, parents, target_logits, allowed)
    argmax = check_argmax_ids(argmax_ids, *target_logits.shape)
    if params.is_greedy:
        parent_rows = torch.tensor([int(p) + 1 for p in parents], dtype=torch.int64)  # [N]
        child_ids = torch.tensor(ids, dtype=torch.int64)  # [N]
        child_logits = target_logits[parent_rows, child_ids]  # [N]
        row_argmax = _argmax(target_logits, allowed)  # [N+1]
        row_max = target_logits.gather(1, row_argmax[:, None])[:, 0][parent_rows]  # [N], masked max
        if allowed is not None and len(ids):
            is_allowed = torch.from_numpy(allowed.is_allowed(parent_rows.numpy(), child_ids.numpy()))
            child_logits = torch.where(is_allowed, child_logits, MASKED_LOGIT)
        child_logits_list = child_logits.tolist()
        qualified = threshold_greedy_qualified(child_logits_list, row_max.tolist(), acceptance_threshold)
        accepted, stop_row = threshold_walk(children, child_logits_list, qualified)
        bonus = argmax[stop_row] if argmax else int(row_argmax[stop_row])
        return walk_result(children, accepted, stop_row, bonus, entropies)
    row_probs = _RowProbs(target_logits, params, allowed)

    def choose(row: int) -> int | None:
        if not children[row]:
            return None
        probs = row_probs[row]  # [V]
        child_probs = probs[torch.tensor([ids[j] for j in children[row]])].tolist()  # [num children]
        floor = acceptance_threshold * float(probs.max())
        best = max(range(len(child_probs)), key=lambda k: (child_probs[k], -k))  # most likely, lowest index
        return children[row][best] if child_probs[best] >= floor else None

    accepted, stop_row = _walk(children, choose)
    bonus = int(sample(row_probs[stop_row][None], _draw(draws, len(accepted)))[0])
    return walk_result(children, accepted, stop_row, bonus, entropies)


class _RowProbs:
    """logits_to_probs of a row, computed when the walk first visits it: the walk touches depth + 1
    of the N + 1 rows, and top-k / top-p cost a sort of V per row."""

    def __init__(
        self, target_logits: torch.Tensor, params: SamplingParams, allowed: TokenBitmask | None = None
    ) -> None:
        self._logits, self._params, self._allowed = target_logits, params, allowed
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, row: int) -> torch.Tensor:
        if row not in self._rows:
            logits = (
                self._logits[row : row + 1] if self._allowed is None else self._allowed.masked_rows(self._logits, [row])
            )  # [1, V]
            self._rows[row] = logits_to_probs(logits, self._params)[0]  # [V]
        return self._rows[row]


class _RowEntropies:
    """row_entropy of the rows a result reports (the parent rows of the accepted nodes and the stop
    row), computed for those rows only, once the walk is done; masked rows as the walk saw them."""

    def __init__(self, target_logits: torch.Tensor, allowed: TokenBitmask | None = None) -> None:
        self._logits, self._allowed = target_logits, allowed

    def take(self, rows: list[int]) -> list[float]:
        logits = self._logits[rows] if self._allowed is None else self._allowed.masked_rows(self._logits, rows)
        return row_entropy(logits).tolist()  # [len(rows)]


def _argmax(target_logits: torch.Tensor, allowed: TokenBitmask | None) -> torch.Tensor:
    """int64 [N+1]: each row's argmax, among the allowed tokens when masked."""
    return torch.argmax(target_logits, dim=-1) if allowed is None else allowed.argmax(target_logits)


def rejection_sample_accept(
    token_ids,
    parents,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    *,
    draft_probs: torch.Tensor | None = None,
    allowed: TokenBitmask | None = None,
) -> ValidationResult:
    """Recursive rejection sampling over the tree. draft_probs [N, V]: row j is the distribution node j
    was drawn from (rows are renormalised); a one-hot row, or draft_probs None for all nodes, is a
    deterministic draft. Consumes one uniform per child tried and one for the final sample.
    """
    ids, children, entropies = _check_inputs(token_ids, parents, target_logits, allowed)
    _check_draft_probs(draft_probs, ids, target_logits.shape[1])
    row_probs = _RowProbs(target_logits, params, allowed)
    accepted: list[int] = []
    row = ROOT_ROW
    while True:
        p = row_probs[row].to(torch.float64)  # [V], the target at this row, then its residuals
        offered: list[int] = []  # tokens of the siblings rejected so far
        for j in children[row]:
            x = ids[j]
            q = None if draft_probs is None else _proposal(draft_probs[j], offered)  # [V] or point mass
            q_x = 1.0 if q is None else float(q[x])
            accept_prob = min(1.0, float(p[x]) / q_x)
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < accept_prob:
                accepted.append(j)
                row = j + 1
                break
            p = _residual(p, q, x)
            offered.append(x)
        else:  # a leaf, or every child rejected: draw the bonus / correction token from p
            bonus = int(sample(p[None], generator)[0])
            return walk_result(children, tuple(accepted), row, bonus, entropies)


def _proposal(draft_row: torch.Tensor, offered: list[int]) -> torch.Tensor | None:
    """q_j renormalised without earlier siblings' tokens; None for a point mass (deterministic draft)."""
    q = draft_row.to(torch.float64)  # [V]
    if int((q > 0).sum()) == 1:
        return None
    if offered:
        q = q.clone()
        q[offered] = 0.0
    return q / q.sum()


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """normalize(max(p - q, 0)); a point mass at x just removes x from p."""
    if q is None:
        residual = p.clone()
        residual[x] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)  # [V]
    total = float(residual.sum())
    # total == 0 only when p <= q everywhere, i.e. p == q and x was accepted with probability 1;
    # rounding can still reject, and then p itself is the exact residual.
    return residual / total if total > 0.0 else p


def _walk(children: Children, choose: Callable[[int], int | None]) -> tuple[tuple[int, ...], int]:
    accepted: list[int] = []
    row = ROOT_ROW
    while (node := choose(row)) is not None:
        accepted.append(node)
        row = node + 1
    return tuple(accepted), row


def walk_result(
    children: Children,
    accepted: Sequence[int],
    stop_row: int,
    bonus: int,
    row_entropies: Sequence[float] | _RowEntropies,
) -> ValidationResult:
    """Entropies: each accepted node's parent row; the stop row when it offered children."""
    rows = ([ROOT_ROW] + [j + 1 for j in accepted[:-1]])[: len(accepted)] + ([stop_row] if children[stop_row] else [])
    entropies = (
        row_entropies.take(rows)
        if isinstance(row_entropies, _RowEntropies)
        else [float(row_entropies[r]) for r in rows]
    )
    return ValidationResult(
        accepted_nodes=tuple(accepted),
        bonus_token=int(bonus),
        accepted_entropies=tuple(entropies[: len(accepted)]),
        rejected_entropies=tuple(entropies[len(accepted) :]),
    )


def build_children(
    token_ids: Sequence[int] | torch.Tensor, parents: Sequence[int] | torch.Tensor, vocab_size: int
) -> tuple[tuple[int, ...], Children]:
    """Validate a tree and index it by logits row: children[0] = the root's, children[i + 1] = node i's.

    E.g. token_ids [7, 8, 9], parents [-1, 0, -1] -> children ((0, 2), (1,), (), ()).
    """
    ids = _as_ints(token_ids, "token_ids")
    parent_ids = _as_ints(parents, "parents")
    check_tree(ids, parent_ids, vocab_size, is_siblings_unique=True)  # the merge must have deduplicated
    children: list[list[int]] = [[] for _ in range(len(ids) + 1)]
    for i, parent in enumerate(parent_ids):
        children[parent + 1].append(i)
    return ids, tuple(tuple(c) for c in children)


def _as_ints(values: Sequence[int] | torch.Tensor, name: str) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {tuple(values.shape)} {values.dtype}")
        return tuple(values.tolist())
    result = tuple(values)
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in result):
        raise ValueError(f"{name} must hold ints")
    return tuple(int(v) for v in result)


def _check_inputs(
    token_ids,
    parents,
    target_logits: torch.Tensor,
    allowed: TokenBitmask | None = None,
) -> tuple[tuple[int, ...], Children, _RowEntropies]:
    """(token ids, children by row, row entropies on demand) of a valid tree and logits."""
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2 or target_logits.dtype != torch.float32:
        raise ValueError("target_logits must be a 2-D float32 tensor [N+1, V]")
    ids, children = build_children(token_ids, parents, target_logits.shape[1])
    if target_logits.shape[0] != len(ids) + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, expected num_nodes + 1 = {len(ids) + 1}")
    if allowed is not None and allowed.num_rows != target_logits.shape[0]:
        raise ValueError(f"allowed has {allowed.num_rows} rows, expected num_nodes + 1 = {target_logits.shape[0]}")
    # A row max is NaN when the row holds a NaN (amax propagates it), +inf with a +inf, -inf when no
    # logit is finite: one reduction, then a check of [R]. A -inf logit alone is fine.
    bad_rows = (~torch.isfinite(target_logits.amax(dim=-1))).nonzero()
    if bad_rows.numel():
        raise ValueError(f"target_logits row {int(bad_rows[0])} holds NaN or +inf, or no finite logit")
    if allowed is not None:
        # The same under the grammar mask: a row whose allowed tokens all have a -inf logit leaves no
        # token to choose (a NaN distribution; the kernel's and fp8 statistics refuse it as a -inf max).
        masked_max = target_logits.gather(1, allowed.argmax(target_logits)[:, None])[:, 0]  # [R]
        bad_rows = (masked_max == -math.inf).nonzero()
        if bad_rows.numel():
            raise ValueError(
                f"target_logits row {int(bad_rows[0])} has no finite logit among the tokens allowed_tokens allows"
            )
    return ids, children, _RowEntropies(target_logits, allowed)


def check_argmax_ids(argmax_ids, num_rows: int, vocab_size: int) -> tuple[int, ...]:
    """The validated ids, () when absent."""
    if argmax_ids is None:
        return ()
    argmax = _as_ints(argmax_ids, "argmax_ids")
    if len(argmax) != num_rows:
        raise ValueError(f"argmax_ids has {len(argmax)} entries, expected num_nodes + 1 = {num_rows}")
    if any(not 0 <= a < vocab_size for a in argmax):
        raise ValueError(f"argmax_ids must lie in [0, {vocab_size})")
    return argmax


def _check_draft_probs(draft_probs: torch.Tensor | None, ids: Sequence[int], vocab_size: int) -> None:
    if draft_probs is None:
        return
    if not isinstance(draft_probs, torch.Tensor) or not draft_probs.dtype.is_floating_point:
        raise ValueError("draft_probs must be a floating-point tensor [N, V]")
    if tuple(draft_probs.shape) != (len(ids), vocab_size):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected {(len(ids), vocab_size)}")
    # Reductions instead of elementwise masks over [N, V]: a NaN or inf anywhere makes its row sum
    # non-finite (no negative entries once the minimum is >= 0).
    if len(ids) and not (bool(torch.isfinite(draft_probs.sum(dim=-1)).all()) and float(draft_probs.amin()) >= 0.0):
        raise ValueError("draft_probs must be finite and >= 0")
    own_probs = draft_probs[torch.arange(len(ids)), torch.tensor(ids, dtype=torch.int64)]  # [N]
    bad_nodes = (own_probs <= 0).nonzero()
    if bad_nodes.numel():
        raise ValueError(f"draft_probs[{int(bad_nodes[0])}] gives zero probability to the node's own token")
