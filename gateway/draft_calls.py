"""A request's calls to the draft pool (DraftCalls), and what the pool has heard of the request.

The pool is optional: a request drafts while it answers and goes on by the primary alone while it is
down or hung (gateway.dependencies, shared by the gateway's requests; gateway.call_deadlines bounds
each call). A Propose carries what was committed since the previous one, so the pool's copy of the
request stays in step without calls of its own; a pool that lost the request (restarted) answers
NOT_FOUND and hears the whole context again; after a failure, or a move to another node, the next
Propose opens the request afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.backends import EMPTY_TREE, Backends, DraftTree
from gateway.call_deadlines import CallDeadlines
from gateway.dependencies import DEFAULT_RETRY_S, DependencyState
from gateway.output import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from specdec.candidates import decoders_for
from specdec.errors import DeadlineExceeded, NotFound, ResourceExhausted, Unavailable
from specdec.grammar import ResponseFormat
from specdec.propose_args import ProposeArgs

# Releases sent while the pool is marked down, not awaited (DraftCalls.release): kept until they end.
_RELEASES_IN_FLIGHT: set[asyncio.Task] = set()


class DraftCalls:
    """One request's Propose, PrepareGrammar and Release calls. `generated` is the request's output,
    the loop's own list (read, never changed here); `remaining_s` the request's time left (None: no
    deadline)."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        generated: list[int],
        backends: Backends,
        state: DependencyState,
        call_deadlines: CallDeadlines,
        remaining_s: Callable[[], float | None],
    ) -> None:
        self.request_id, self.prompt_ids, self.generated = request_id, prompt_ids, generated
        self.backends, self.state, self.call_deadlines = backends, state, call_deadlines
        self.remaining_s = remaining_s
        self.is_open = False  # the pool holds the request (its last Propose answered)
        self.was_proposed = False  # a Propose was sent: the pool may hold the request, whatever it answered
        self.synced = 0  # generated tokens the pool has heard
        self.pending_lookahead_argmax: tuple[int, ...] = ()  # the primary's argmaxes at the last lookahead rows
        # The latest step's features of committed tokens, for the next Propose: (features, the
        # position of the token row 0 predicts); None: none (steps between leave a gap there).
        self.pending_features: tuple[Any, int] | None = None
        # A pool that holds as many requests as it may (RESOURCE_EXHAUSTED) is asked to open this one
        # again no sooner than this (time.monotonic()); until then it runs without drafts.
        self.refused_until = 0.0

    def move_to(self, backends: Backends, state: DependencyState) -> None:
        """Go on with another node's pool (a failover): it opens the request afresh."""
        self.backends, self.state = backends, state
        self.is_open, self.pending_lookahead_argmax, self.pending_features = False, (), None

    def prepare_grammar(self, response_format: ResponseFormat) -> asyncio.Future | None:
        """The pool's compile of the response format begun (best effort: a Propose compiles what it
        does not find, and reports a bad schema itself); None while the pool is down."""
        if not self.state.is_up:
            return None
        return asyncio.ensure_future(self._prepared_grammar(response_format))

    async def _prepared_grammar(self, response_format: ResponseFormat) -> None:
        with contextlib.suppress(Exception):  # down, hung or refusing: the first Propose will say
            await self.call_deadlines.call(
                "draft.PrepareGrammar", self.backends.prepare_grammar(response_format), self.remaining_s()
            )

    async def propose(
        self,
        sources: Sequence[tuple[str, int]],
        length: int,
        max_nodes: int,
        *,
        response_format: ResponseFormat | None,
        continuation_length: int,
        prediction_ids: tuple[int, ...] = (),
    ) -> DraftTree:
        """The candidates of `sources` (decoder, rank), `length` tokens each and `max_nodes` in all,
        as a tree; EMPTY_TREE while the pool is down or hung. The pool first hears the tokens
        committed since its previous call (all of them, with the prompt, the response format and the
        prediction, when the call opens the request)."""
        prompt, new = ((), self.generated[self.synced :]) if self.is_open else (self.prompt_ids, self.generated)
        if not self.is_open and time.monotonic() < self.refused_until:  # the pool is full: not yet
            return EMPTY_TREE
        if not self.state.should_call():  # down: no drafts; the primary alone still progresses
            self.is_open = False
            return EMPTY_TREE
        features = self.pending_features
        self.was_proposed = True
        args = self._args(prompt, new, sources, length, max_nodes, response_format, continuation_length, prediction_ids)
        try:
            tree = await self.call_deadlines.call("draft.Propose", self.backends.propose(args), self.remaining_s())
        except NotFound:  # the pool restarted: resend the context
            self.is_open = False
            self.pending_features = features  # they describe committed tokens, which the reopened request has
            if prompt:
                return EMPTY_TREE
            return await self.propose(
                sources,
                length,
                max_nodes,
                response_format=response_format,
                continuation_length=continuation_length,
                prediction_ids=prediction_ids,
            )
        except ResourceExhausted:
            # The pool holds as many requests as it may: it is up, and only this request goes on by the
            # primary alone for a while. The pool is optional: a full one must not fail the request.
            self.is_open = False
            self.refused_until = time.monotonic() + DEFAULT_RETRY_S
            return EMPTY_TREE
        except (Unavailable, DeadlineExceeded) as e:  # down or hung; logged once by the state, not at every step
            self.state.failed(str(e))
            self.is_open = False
            return EMPTY_TREE
        self.state.succeeded()
        self.is_open = True
        self.synced = len(self.generated)
        return tree

    def _args(
        self,
        prompt: Sequence[int],
        new: Sequence[int],
        sources: Sequence[tuple[str, int]],
        length: int,
        max_nodes: int,
        response_format: ResponseFormat | None,
        continuation_length: int,
        prediction_ids: tuple[int, ...],
    ) -> ProposeArgs:
        """The call's arguments, with the lookahead argmaxes and features pending for it (taken: a
        call carries them once); an opening call (a prompt) carries the response format and the
        prediction instead of argmaxes, which belong to the rows of the pool's previous proposal."""
        strategies = decoders_for(sources)
        lookahead_argmax, self.pending_lookahead_argmax = self.pending_lookahead_argmax, ()
        features, self.pending_features = self.pending_features, None
        return ProposeArgs(
            self.request_id,
            tuple(prompt),
            tuple(new),
            strategies,
            len(strategies),
            length,
            max_nodes,
            response_format if prompt else None,
            () if prompt else lookahead_argmax,
            continuation_length=continuation_length,
            features=None if features is None else features[0],
            feature_position=0 if features is None else features[1],
            prediction_token_ids=prediction_ids if prompt else (),
        )

    async def release(self, finish: str) -> None:
        """The pool forgets the request; a finished one's unseen output goes with it (the pool's
        suffix index learns from served answers). While the pool is marked down (one slow call marks
        it so for every request) the Release still goes, in the background: the request's end does not
        wait for a pool that may not answer, and a pool that does drops the request now rather than
        after its --request_ttl_s."""
        is_finished = finish in (FINISH_EOS, FINISH_LENGTH, FINISH_STOP)
        # the output the pool has not seen: its last steps were often the primary's own
        unseen = self.generated[self.synced :] if is_finished and self.is_open else []
        if self.state.is_up:
            await self._release(is_finished, unseen)
        elif self.was_proposed:
            task = asyncio.ensure_future(self._release(is_finished, unseen))
            _RELEASES_IN_FLIGHT.add(task)
            task.add_done_callback(_RELEASES_IN_FLIGHT.discard)

    async def _release(self, is_finished: bool, unseen: Sequence[int]) -> None:
        try:
            await self.call_deadlines.call(
                "draft.Release", self.backends.release_draft(self.request_id, is_finished, tuple(unseen))
            )
        except DeadlineExceeded as e:
            self.state.failed(str(e))
        except Exception:  # noqa: BLE001 - already gone (restarted) or never opened
            pass
