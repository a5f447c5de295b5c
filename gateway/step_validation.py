"""A step's acceptance (StepValidator): which of the tree's nodes the step keeps, and its bonus token.

The validator service's Validate applies the request's acceptance rule (specdec.acceptance_mode:
greedy, sampling, or a lossy threshold) to the tree and the primary's rows. In greedy mode the rule
walks the primary's argmaxes, which the gateway has (greedy_validation): the loop goes on with that
decision at once, and the validator confirms it beside the next step (StepValidator.take_check); a
disagreement fails the request before the step is stored or streamed. While the validator cannot be
reached (down, or hung past its call deadline: gateway.call_deadlines), a greedy step stands on the
gateway's decision and a sampled one has none (the loop drops its tree); either is counted as a
fallback step.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine, Sequence
from typing import Any

from gateway.backends import Backends, DraftTree, Validation, Verified
from gateway.call_deadlines import CallDeadlines
from gateway.dependencies import DependencyState
from gateway.params import GenerationParams
from gateway.stats import RequestStats
from specdec.acceptance_mode import AcceptanceMode
from specdec.errors import DeadlineExceeded, Internal, Unavailable
from specdec.logprobs import TokenLogprob


def greedy_validation(tree: DraftTree, argmax_token_ids: Sequence[int]) -> Validation:
    """The greedy rule on the primary's argmaxes (row 0: the root, row i+1: node i): follow the
    child whose token is its parent's argmax, then the bonus is the last row's argmax.
    E.g. tree 0:a 1:b(parent 0) 2:c(parent 0), argmax rows [a, c, x, y] -> path [0, 2], bonus y."""
    accepted: list[int] = []
    node = -1
    while True:
        child = next(
            (
                i
                for i in range(tree.num_nodes)
                if tree.parents[i] == node and tree.token_ids[i] == argmax_token_ids[node + 1]
            ),
            None,
        )
        if child is None:
            return Validation(tuple(accepted), argmax_token_ids[node + 1], (), ())
        accepted.append(child)
        node = child


def path_logprobs(verified: Verified, v: Validation) -> list[TokenLogprob]:
    """The log probabilities of a step's tokens: each accepted node's token at its parent's row (the
    primary's), then the bonus token at the row where the path ends: the primary's value when it is
    that row's argmax (greedy), else the validator's (Validation.bonus_logprob, from the same fp32
    row), with the row's alternatives. E.g. accepted nodes (0, 2): [node 0, node 2, bonus at row 3]."""
    last_row = v.accepted_nodes[-1] + 1 if v.accepted_nodes else 0
    row = verified.row_logprobs[last_row]
    if row.token_id == v.bonus_token:
        bonus = row
    else:
        assert v.bonus_logprob is not None  # a drawn bonus token: the validator scored it
        bonus = TokenLogprob(v.bonus_token, v.bonus_logprob, row.top)
    return [verified.node_logprobs[i] for i in v.accepted_nodes] + [bonus]


class StepValidator:
    """One request's acceptance: its Validate calls, and the confirmation of the last greedy step,
    pending until the loop's commit takes it (take_check) or drops it (drop_check).

    `acceptance_mode` and `is_bonus_scored` are the loop's decisions for the request (the Verify's
    logits format follows them too); it counts in the loop's `stats`. `backends` and
    `validator_state` are the request's node's: the loop moves them to another after a failover
    (move_to)."""

    def __init__(
        self,
        request_id: str,
        params: GenerationParams,
        backends: Backends,
        validator_state: DependencyState,
        call_deadlines: CallDeadlines,
        stats: RequestStats,
        *,
        acceptance_mode: AcceptanceMode,
        is_bonus_scored: bool,
        deadline: float | None = None,
    ) -> None:
        self.request_id, self.params, self.stats = request_id, params, stats
        self.backends, self.validator_state, self.call_deadlines = backends, validator_state, call_deadlines
        self.acceptance_mode, self.is_bonus_scored, self.deadline = acceptance_mode, is_bonus_scored, deadline
        self.pending_check: Coroutine[Any, Any, None] | None = None  # the validator confirming the last greedy step

    def move_to(self, backends: Backends, validator_state: DependencyState) -> None:
        """Validate on another node's validator after a failover."""
        self.backends, self.validator_state = backends, validator_state

    async def decide(self, tree: DraftTree, verified: Verified, allowed, position: int) -> Validation | None:
        """The step's decision, or None (sampling and threshold modes need the validator, which cannot
        be reached). Greedy: the validator's rule walks the primary's argmaxes, which are here: the
        loop goes on with that decision and the validator confirms it beside the next step (_confirm).
        `position`: the index among the generated tokens of the step's first drawn token."""
        if self.acceptance_mode == AcceptanceMode.GREEDY:
            v = greedy_validation(tree, verified.argmax_token_ids)
            self.pending_check = self._confirm(tree, verified, allowed, v, position)
            return v
        return await self._call_validator(tree, verified, allowed, position)

    def take_check(self) -> Coroutine[Any, Any, None] | None:
        """The last greedy step's confirmation, for its commit to run before the step is stored."""
        check, self.pending_check = self.pending_check, None
        return check

    def drop_check(self) -> None:
        """A confirmation made by a step that never reaches its commit: closed unrun."""
        if self.pending_check is not None:
            self.pending_check.close()
            self.pending_check = None

    async def _call_validator(self, tree: DraftTree, verified, allowed, position: int) -> Validation | None:
        """Validate on the validator, or None while it cannot be reached (a fallback step, counted)."""
        if self.validator_state.should_call():
            try:
                v = await self.call_deadlines.call(
                    "validator.Validate",
                    self.backends.validate(
                        self.request_id,
                        self.acceptance_mode,
                        self.params.sampling,
                        self.params.speculation.acceptance_threshold,
                        position,
                        tree,
                        verified,
                        allowed,
                        **({"is_bonus_scored": True} if self.is_bonus_scored else {}),
                    ),
                    None if self.deadline is None else self.deadline - time.monotonic(),
                )
                self.validator_state.succeeded()
                return v
            except (Unavailable, DeadlineExceeded) as e:  # down or hung: the same for the request
                self.validator_state.failed(str(e))
        self.stats.num_validator_fallback_steps += 1
        return None

    async def _confirm(self, tree: DraftTree, verified, allowed, decided: Validation, position: int) -> None:
        """The validator's decision on a greedy step the loop already went on with: the same rule on the
        same argmaxes, so it agrees by construction; it adds the rows' entropies to the stats. A
        disagreement fails the request before the step is stored or streamed. While the validator
        cannot be reached the step stands as decided."""
        v = await self._call_validator(tree, verified, allowed, position)
        if v is None:
            return
        if (v.accepted_nodes, v.bonus_token) != (decided.accepted_nodes, decided.bonus_token):
            raise Internal(
                "validator",
                f"the validator's greedy decision {list(v.accepted_nodes)} + {v.bonus_token} differs from the "
                f"primary's argmaxes' {list(decided.accepted_nodes)} + {decided.bonus_token} at position {position}",
                dependency="validator",
            )
        self.stats.add_entropies(list(v.accepted_entropies), list(v.rejected_entropies))
