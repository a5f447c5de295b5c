"""The request loop against fake services (no processes): plan -> Propose/Verify/Decode call sequence,
draft and primary synchronisation across plain and speculative steps, greedy exactness, state store.

The fakes check the protocol on every call and fail the request when it is broken:
- the primary: each Verify/Decode first commits the previous step; the committed tokens must be a
  root-to-node path of the previous tree plus the primary's own greedy token after it (after a plain
  step: no nodes, just the token Decode returned);
- the draft service: the context it has after each Propose (prompt + new_token_ids of every call)
  must equal prompt + everything committed so far.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import numpy as np
import pytest
import redis
import redis.asyncio
import structlog.testing
import torch

from prometheus_client import CollectorRegistry
from gateway.backends import Backends, Decoded, DraftTree, ModelInfo, Prefilled, Validation, Verified
from gateway.call_deadlines import CallDeadlines, DeadlineRule
from gateway.dependencies import DependencyState
from gateway.controller import ControllerConfig, ControllerState, SpeculationPlan
from gateway.loop import (
    CONTINUATION_TOKENS,
    RUN_ANSWERS_STATS,
    RUN_LOOKUP_STATS,
    RequestLoop,
    StepOutput,
)
from gateway.step_planner import bounded_config, cycled_strategies, fixed_plan
from gateway.step_validation import greedy_validation
from gateway.cost_model import CostSettings, cost_model_for
from gateway.node_pool import Node
from gateway.nodes import NodeAddress
from gateway.params import GenerationParams, SpeculationParams
from specdec.acceptance_mode import AcceptanceMode
from specdec.answers import AnswerIndex
from specdec.repeats import RepeatIndex, RunDrafts
from specdec.suffix_array import SEPARATOR
from gateway.metrics import GatewayMetrics
from gateway.server import _StepCounts
from gateway.step_costs import StepCostConfig, StepCosts
from gateway.stats import RequestStats
from specdec.candidates import ranked_sources
from specdec import pb
from specdec.errors import DeadlineExceeded, Internal, NotFound, ResourceExhausted, StateLost, Unavailable
from specdec.logprobs import LogprobsRequest
from specdec.propose_args import ProposeArgs
from specdec.sampling import SamplingParams
from specdec.state_store import RequestState, RequestStatus
from specdec.state_store import AsyncInMemoryStateStore
from specdec.state_store import AsyncRedisStateStore, RedisStateStore
from specdec.state_store.memory import InMemoryStateStore
from specdec.features import encode_features
from specdec.strategies import FEATURE_STRATEGY
from specdec.task_type import TaskType
from specdec.v1 import common_pb2

LOOKUP, SUFFIX = "prompt_lookup", "suffix_index"
EOS, WRONG = 49, 45  # the fake primary never emits either
PROMPT = [3, 7, 1, 4, 1, 5, 9, 2, 6]
# fp32 on a CPU without AVX512: 2..16 rows cost 1.6-1.9x one row (the gateway brief's figures)
FP32_VERIFY_MS = {1: 40.0, 2: 68.0, 4: 66.0, 8: 70.0, 16: 76.0, 32: 108.0}
MODEL = ModelInfo(
    vocab_size=50, eos_token_ids=(EOS,), max_context=4096, instance_id="fake", verify_costs_ms=FP32_VERIFY_MS
)


def primary_next(context: Sequence[int]) -> int:
    """The fake primary's greedy next token (never EOS, never WRONG)."""
    return (3 * context[-1] + context[-2] + len(context)) % 40 + 1


def _one_message(steps: Sequence[Decoded]) -> Decoded:
    """Streamed steps as the primary sends them in one message (primary_svc.server._stream_message)."""
    last = steps[-1]
    return dataclasses.replace(
        last,
        token_ids=tuple(t for s in steps for t in s.token_ids),
        num_drafted=sum(s.num_drafted for s in steps),
        num_draft_accepted=sum(s.num_draft_accepted for s in steps),
        num_answer_drafted=sum(s.num_answer_drafted for s in steps),
        num_answer_accepted=sum(s.num_answer_accepted for s in steps),
        num_steps=len(steps),
        num_drafting_steps=sum(1 for s in steps if s.num_drafted),
    )


def plain_decoding(prompt: Sequence[int], num_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(primary_next(context))
    return context[len(prompt) :]


class FakeTokenizer:
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{t}>" for t in token_ids)

    def apply_chat_template(self, messages) -> str:
        return "\n".join(m["content"] for m in messages)


@dataclasses.dataclass
class FakeBackends:
    """Primary, draft pool and greedy validator in one object, recording every call.

    Drafts: prompt_lookup is an oracle while `is_lookup_right(num_committed)` holds (its rank r > 0
    candidates diverge after r tokens), else proposes WRONG; suffix_index always proposes WRONG.
    Every proposal carries `lookahead_rows` (a chain off the root); the primary's "argmax" at lookahead
    row j is 1000 + j + the number of verifies so far (this one included)."""

    is_lookup_right: Callable[[int], bool] = lambda num_committed: True
    lose_draft_at_call: int = -1  # the draft service "restarts" before this Propose
    calls: list[tuple[str, dict]] = dataclasses.field(default_factory=list)
    truth: list[int] = dataclasses.field(default_factory=list)  # prompt + committed, per the fakes
    decided: list[int] = dataclasses.field(default_factory=list)  # the last verify's greedy commit, not yet in truth
    primary_context: list[int] = dataclasses.field(default_factory=list)
    last_tree: DraftTree | None = None  # None: nothing to commit yet (just prefilled)
    draft_context: list[int] | None = None
    lookahead_rows: tuple[int, ...] = ()
    other_rows: int = 0  # rows of other requests in each of the primary's steps (the load)
    is_continuing: bool = False  # prompt_lookup's rank 0 also returns its continuation past the draft
    stops_at_repeat: list[int] = dataclasses.field(default_factory=list)  # each run's stop_at_repeat_tokens
    lookup_draft_lengths: list[int] = dataclasses.field(default_factory=list)  # each run's lookup_draft_length
    steps_per_message: list[int] = dataclasses.field(default_factory=list)  # each run's steps_per_message
    stop_strings: list[tuple[str, ...]] = dataclasses.field(default_factory=list)  # each run's stop_strings
    run_messages: list[int] = dataclasses.field(default_factory=list)  # the engine steps of each message sent
    answers: AnswerIndex | None = None  # the model's own answers, which the primary's runs draft from too

    # --- primary ---
    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        self.calls.append(("prefill", {"num_tokens": len(token_ids), "num_prompt_tokens": num_prompt_tokens}))
        self.primary_context, self.last_tree = list(token_ids), None
        self.decided = []  # a dropped step (re-prefill): its tree is never committed
        if not self.truth:
            self.truth = list(token_ids)
        return Prefilled(time_ms=0.0, num_cached_prompt_tokens=0)

    def _commit(self, accepted_nodes: Sequence[int], committed: Sequence[int]) -> None:
        if self.last_tree is None:
            assert not accepted_nodes and not committed, "nothing to commit right after a prefill"
            return
        tree = self.last_tree
        for k, node in enumerate(accepted_nodes):
            assert tree.parents[node] == (accepted_nodes[k - 1] if k else -1), "accepted nodes are not a path"
        path = [tree.token_ids[n] for n in accepted_nodes]
        assert list(committed[:-1]) == path, (committed, path)
        assert committed[-1] == primary_next(self.primary_context + path), "the bonus token is not the primary's"
        self.primary_context += list(committed)

    def _rows(self, tree: DraftTree) -> list[int]:
        rows = [primary_next(self.primary_context)]
        for i in range(tree.num_nodes):
            path, node = [], i
            while node != -1:
                path.insert(0, tree.token_ids[node])
                node = tree.parents[node]
            rows.append(primary_next(self.primary_context + path))
        return rows

    @property
    def other_step_rows(self) -> int:
        """Backends.other_step_rows: other requests' rows in the last step the primary reported."""
        return self.other_rows

    async def verify(
        self, request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed=None
    ) -> Verified:
        assert allowed is None, "no grammar in these requests"
        self.calls.append(
            (
                "verify",
                {
                    "accepted_nodes": tuple(accepted_nodes),
                    "committed": list(committed_token_ids),
                    "num_nodes": tree.num_nodes,
                    "is_chain": tree.parents == tuple(range(-1, tree.num_nodes - 1)),
                    "num_lookahead": len(tree.lookahead_token_ids),
                    "position": len(self.truth) - len(PROMPT),  # tokens generated before this step's
                },
            )
        )
        self._settle()
        self._commit(accepted_nodes, committed_token_ids)
        self.last_tree = tree
        rows = self._rows(tree)
        accepted, bonus = self._greedy_path(tree, rows)
        self.decided = [tree.token_ids[i] for i in accepted] + [bonus]
        num_verifies = sum(1 for name, _ in self.calls if name == "verify")
        lookahead = tuple(1000 + j + num_verifies for j in range(len(tree.lookahead_token_ids)))
        return Verified(None, tuple(rows), 0.0, lookahead, self.other_rows)

    async def decode_stream(
        self,
        request_id,
        accepted_nodes,
        committed_token_ids,
        sampling,
        step,
        allowed=None,
        *,
        max_tokens=1,
        stop_token_ids=(),
        response_format=None,
        num_context_tokens=0,
        stop_at_repeat_tokens=0,
        lookup_draft_length=0,
        steps_per_message=1,
        stop_strings=(),
    ):
        """A run of plain steps as the primary streams it: a step's tokens a message as it decides them (after
        the run's first step, up to steps_per_message steps a message), every one but the run's last
        committed by the primary; the caller's context (before its commit) must be the primary's. With
        stop_at_repeat_tokens the run also ends where the context's tail repeats; with lookup_draft_length
        a step drafts the copy and keeps what plain decoding agrees with."""
        assert allowed is None and response_format is None, "no grammar in these requests"
        assert num_context_tokens == len(self.primary_context), "the caller does not know the primary's context"
        self.stops_at_repeat.append(stop_at_repeat_tokens)
        self.lookup_draft_lengths.append(lookup_draft_length)
        self.steps_per_message.append(steps_per_message)
        self.stop_strings.append(tuple(stop_strings))
        runs = self._run(
            accepted_nodes, committed_token_ids, max_tokens, stop_token_ids, stop_at_repeat_tokens, lookup_draft_length
        )
        held: list[Decoded] = []
        is_first = True
        for tokens, is_last, num_drafted, num_accepted, is_answer in runs:
            answer_counts = (num_drafted, num_accepted) if is_answer else (0, 0)
            counts = (num_drafted, num_accepted, *answer_counts)
            held.append(Decoded(tokens[-1], 0.0, self.other_rows, tokens, (), is_last, *counts))
            if is_first or is_last or len(held) >= steps_per_message:
                self.run_messages.append(len(held))
                yield _one_message(held)
                held, is_first = [], False

    def _run(
        self,
        accepted_nodes,
        committed_token_ids,
        max_tokens,
        stop_token_ids,
        stop_at_repeat_tokens=0,
        lookup_draft_length=0,
    ) -> Iterator[tuple[tuple[int, ...], bool, int, int, bool]]:
        """A run of plain steps, a (tokens, is_last, drafted, accepted, drafted from the answers) a step:
        the primary commits every token but the run's last; a step's drafts (RunDrafts) are kept while
        they are plain decoding's."""
        call = {
            "accepted_nodes": tuple(accepted_nodes),
            "committed": list(committed_token_ids),
            "max_tokens": max_tokens,
        }
        self.calls.append(("decode", call))
        self._settle()
        self._commit(accepted_nodes, committed_token_ids)
        self.last_tree = DraftTree((), (), (), (), {}, 0.0)
        call["num_tokens"] = 0
        repeats = RepeatIndex(self.primary_context, stop_at_repeat_tokens) if stop_at_repeat_tokens else None
        drafts = (
            RunDrafts(self.primary_context, lookup_draft_length, answers=self.answers) if lookup_draft_length else None
        )
        drafted: list[int] = []
        while True:
            decided: list[int] = []
            for token in drafted:  # a draft is kept while it is what plain decoding decides
                if primary_next(self.primary_context + decided) != token:
                    break
                decided.append(token)
            num_accepted = len(decided)
            decided.append(primary_next(self.primary_context + decided))
            if drafts is not None and drafted:
                drafts.observe(len(drafted), num_accepted)
            kept: list[int] = []
            is_last = False
            for token in decided:
                kept.append(token)
                self.truth.append(token)
                call["num_tokens"] += 1
                is_repeat = repeats is not None and (repeats.extend([token]) or repeats.tail_repeats())
                is_last = call["num_tokens"] >= max(1, max_tokens) or token in stop_token_ids or is_repeat
                if is_last:
                    break
            self.primary_context += kept[:-1] if is_last else kept
            is_answer = bool(drafted) and drafts is not None and drafts.is_answer_draft
            yield tuple(kept), is_last, len(drafted), min(len(kept), num_accepted), is_answer
            if is_last:
                return
            drafted = []
            if drafts is not None:
                drafts.extend(kept)
                drafted = drafts.draft(max(1, max_tokens) - call["num_tokens"] - 1)

    async def validate(
        self, request_id, mode, sampling, acceptance_threshold, position, tree, verified, allowed=None
    ) -> Validation:
        assert allowed is None, "no grammar in these requests"
        self.calls.append(("validate", {"position": position}))
        accepted, bonus = self._greedy_path(tree, verified.argmax_token_ids)
        return Validation(tuple(accepted), bonus, (), ())

    @staticmethod
    def _greedy_path(tree: DraftTree, rows: Sequence[int]) -> tuple[list[int], int]:
        """The fake validator's rule: follow the children that match each row's argmax."""
        accepted, node = [], -1
        while True:
            child = next(
                (i for i in range(tree.num_nodes) if tree.parents[i] == node and tree.token_ids[i] == rows[node + 1]),
                None,
            )
            if child is None:
                break
            accepted.append(child)
            node = child
        return accepted, rows[node + 1]

    def _settle(self) -> None:
        """The last verified step is committed by now (the loop moved on): into the truth."""
        self.truth += self.decided
        self.decided = []

    # --- draft ---
    async def propose(self, args: ProposeArgs) -> DraftTree:
        prompt_token_ids, new_token_ids, strategies = args.prompt_token_ids, args.new_token_ids, args.strategies
        speculative_degree, draft_length, max_nodes = args.speculative_degree, args.draft_length, args.max_nodes
        response_format, continuation_length = args.response_format, args.continuation_length
        lookahead_argmax_token_ids = args.lookahead_argmax_token_ids
        assert response_format is None, "no grammar in these requests"
        self._settle()
        num_call = sum(1 for name, _ in self.calls if name == "propose")
        self.calls.append(
            (
                "propose",
                {
                    "is_open": bool(prompt_token_ids),
                    "new": list(new_token_ids),
                    "strategies": tuple(strategies),
                    "draft_length": draft_length,
                    "max_nodes": max_nodes,
                    "lookahead_argmax": tuple(lookahead_argmax_token_ids),
                    "continuation_length": continuation_length,
                },
            )
        )
        if num_call == self.lose_draft_at_call:
            self.draft_context = None
        if prompt_token_ids:
            self.draft_context = list(prompt_token_ids) + list(new_token_ids)
        elif self.draft_context is None:
            raise NotFound("request_id", "no draft state")
        else:
            self.draft_context += list(new_token_ids)
        assert self.draft_context == self.truth, "the draft service missed committed tokens"
        assert speculative_degree == len(strategies)
        extra = continuation_length if self.is_continuing else 0
        candidates = [self._candidate(name, rank, draft_length + extra) for name, rank in ranked_sources(strategies)]
        rows = self.lookahead_rows
        parents = tuple(range(-1, len(rows) - 1))
        tree = merge([c[:draft_length] for c in candidates], tuple(strategies), max_nodes)
        continuations = []
        for (name, rank), candidate in zip(ranked_sources(strategies), candidates):
            if name == LOOKUP and rank == 0 and len(candidate) > draft_length:
                node = -1
                for token in candidate[:draft_length]:
                    node = next(
                        n for n in range(tree.num_nodes) if tree.parents[n] == node and tree.token_ids[n] == token
                    )
                continuations.append((node, name, tuple(candidate[draft_length:])))
        return dataclasses.replace(
            tree, lookahead_token_ids=rows, lookahead_parents=parents, continuations=tuple(continuations)
        )

    def _candidate(self, name: str, rank: int, draft_length: int) -> list[int]:
        if name != LOOKUP or not self.is_lookup_right(len(self.truth) - len(PROMPT)):
            return [WRONG] * draft_length
        context = list(self.truth)
        for _ in range(draft_length):
            context.append(primary_next(context) if len(context) - len(self.truth) < rank or rank == 0 else WRONG)
        return context[len(self.truth) :]

    async def release_primary(self, request_id: str) -> None:
        self.calls.append(("release_primary", {}))

    async def release_draft(self, request_id: str, is_finished: bool, new_token_ids=()) -> None:
        self.calls.append(("release_draft", {"is_finished": is_finished, "new_token_ids": tuple(new_token_ids)}))

    def forget_kv_lease(self, request_id: str) -> None:
        self.calls.append(("forget_kv_lease", {}))

    async def close(self) -> None:
        self.calls.append(("close", {}))

    def steps(self) -> list[str]:
        return [name for name, _ in self.calls if name in ("verify", "decode")]

    def num_steps(self) -> int:
        """Engine steps of this request: one a verify, one a token of a decode (a run is several)."""
        return sum(call.get("num_tokens", 1) for name, call in self.calls if name in ("verify", "decode"))


def merge(candidates: list[list[int]], strategies: tuple[str, ...], max_nodes: int) -> DraftTree:
    """Candidates merged by common prefix (node_sources bit i = candidate i), at most max_nodes nodes."""
    tokens, parents, sources = [], [], []
    for i, candidate in enumerate(candidates):
        node = -1
        for token in candidate:
            child = next((n for n in range(len(tokens)) if parents[n] == node and tokens[n] == token), None)
            if child is None:
                if len(tokens) == max_nodes:
                    break
                tokens.append(token)
                parents.append(node)
                sources.append(0)
                child = len(tokens) - 1
            sources[child] |= 1 << i
            node = child
    return DraftTree(tuple(tokens), tuple(parents), tuple(sources), strategies, dict.fromkeys(strategies, 0.5), 1.0)


def make_params(
    is_enabled=True,
    is_adaptive=True,
    degree=4,
    draft_length=16,
    max_new_tokens=60,
    strategies=(LOOKUP, SUFFIX),
    task_type=TaskType.CODE,
) -> GenerationParams:
    spec = SpeculationParams(is_enabled, degree, draft_length, 0.0, tuple(strategies), task_type, is_adaptive)
    return GenerationParams(" ".join(map(str, PROMPT)), None, max_new_tokens, (), SamplingParams(), spec)


def run(params: GenerationParams, backends: FakeBackends, store=None, **kwargs) -> RequestLoop:
    """make_loop(...) run to its end."""
    loop = make_loop(params, backends, store, **kwargs)
    asyncio.run(drain(loop))
    return loop


async def drain(loop: RequestLoop) -> None:
    async for _ in loop.run():
        pass


def make_loop(params: GenerationParams, backends: FakeBackends, store=None, request_id="r1", **kwargs) -> RequestLoop:
    """A loop over PROMPT, its request stored as RUNNING (in `store`, else a fresh in-memory one;
    the test reads it directly, the loop through its async face); kwargs as loop_over_prompt's. The
    fake's prompt lookup is right or wrong by fiat, not by repeats of the text: the gateway's repeat
    gate is off unless asked."""
    kwargs.setdefault("min_repeat_tokens", 0)
    store = InMemoryStateStore() if store is None else store
    if store.load(request_id) is None:
        store.create(request_id, {}, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    return loop_over_prompt(params, backends, AsyncInMemoryStateStore(store), request_id, **kwargs)


def loop_over_prompt(
    params: GenerationParams, backends, store, request_id="r1", model=MODEL, owner="test", tokenizer=None, **kwargs
) -> RequestLoop:
    """A RequestLoop over PROMPT on the async state store `store` (the request already stored), with
    the fakes' tokenizer (unless given), fp32 wire formats, a 1 s recovery timeout and trees of up to
    64 nodes."""
    return RequestLoop(
        request_id,
        params,
        PROMPT,
        backends,
        store,
        FakeTokenizer() if tokenizer is None else tokenizer,
        model,
        ("fp32", "fp32"),
        recovery_timeout_s=1.0,
        max_tree_nodes=64,
        cancel=threading.Event(),
        owner=owner,
        **kwargs,
    )


# --- pure helpers ---------------------------------------------------------------------------------


def test_fixed_plan_cycles_the_strategies_to_the_degree():
    spec = make_params(is_adaptive=False, degree=3, draft_length=5).speculation
    assert cycled_strategies(spec) == (LOOKUP, SUFFIX, LOOKUP)
    plan = fixed_plan(spec, max_tree_nodes=64)
    assert plan.sources == ((LOOKUP, 0), (SUFFIX, 0), (LOOKUP, 1))
    assert (plan.draft_length, plan.max_tree_nodes, plan.is_probe) == (5, 64, False)
    assert not fixed_plan(make_params(is_enabled=False).speculation, 64).is_speculative


@pytest.mark.parametrize(
    "strategies, degree, expected",
    [
        (("grammar", LOOKUP), 5, ("grammar", LOOKUP, "grammar", LOOKUP, LOOKUP)),  # two spellings at most
        (("grammar", LOOKUP, SUFFIX), 4, ("grammar", LOOKUP, SUFFIX, "grammar")),
        (("grammar",), 4, ("grammar", "grammar")),
        (("grammar",), 1, ("grammar",)),
    ],
)
def test_grammar_drafts_offer_at_most_two_ranked_spellings(strategies, degree, expected):
    spec = make_params(is_adaptive=False, degree=degree, strategies=strategies).speculation
    assert cycled_strategies(spec) == expected


def test_the_requests_degree_and_draft_length_bound_the_controller():
    config = bounded_config(ControllerConfig(), make_params(degree=2, draft_length=5).speculation, max_tree_nodes=32)
    assert config.draft_length_choices == (1, 2, 3, 4, 5)
    assert (config.max_speculative_degree, config.max_tree_nodes, config.probe_draft_length) == (2, 32, 4)
    config = bounded_config(ControllerConfig(), make_params(degree=8, draft_length=2).speculation, 64)
    assert config.draft_length_choices == (1, 2) and config.probe_draft_length == 2


def test_stats_count_the_steps_choices():
    stats = RequestStats()
    stats.add_plan(8, 2, False)
    stats.add_plan(0, 0, False)
    stats.add_plan(4, 1, True)
    stats.add_plan(8, 2, False)
    assert stats.num_steps_by_draft_length == [1, 0, 0, 0, 1, 0, 0, 0, 2]
    assert stats.num_steps_by_degree == [1, 1, 2]
    assert stats.num_probe_steps == 1
    assert RequestStats.from_dict(stats.to_dict()) == stats


def test_stats_count_acceptance_by_depth_on_the_decoders_rank_0_row():
    stats = RequestStats()
    stats.add_decoder("feature", 5, 2, 3.0)
    stats.add_decoder("feature#1", 3, 1, 0.0)
    stats.add_depths("feature", 3, 2)  # tested at depths 1..3, went on through 1..2
    stats.add_depths("feature", 1, 0)
    assert stats.decoder_depths == {"feature": [2, [2, 1, 1], [1, 1]]}
    assert RequestStats.from_dict(stats.to_dict()) == stats
    rows = {d.name: d for d in stats.to_pb().decoders}
    assert list(rows["feature"].num_tested_by_depth) == [2, 1, 1] and rows["feature"].num_steps == 2
    assert list(rows["feature"].num_accepted_by_depth) == [1, 1]
    assert list(rows["feature#1"].num_tested_by_depth) == [] and rows["feature#1"].num_steps == 0


def test_a_loops_acceptance_by_depth_adds_up_to_its_accepted_drafts():
    loop = run(make_params(is_adaptive=False, degree=2, draft_length=6), FakeBackends(is_lookup_right=lambda n: n % 3))
    depths = loop.stats.decoder_depths
    assert set(depths) == {LOOKUP, SUFFIX}
    accepted_by_rank = sum(r[1] for name, r in loop.stats.decoders.items() if name.startswith(LOOKUP))
    assert sum(depths[LOOKUP][2]) <= accepted_by_rank  # ranks share accepted prefixes, the subtree counts once
    assert sum(depths[LOOKUP][2]) + sum(depths[SUFFIX][2]) >= loop.stats.num_accepted
    assert all(t >= a for t, a in zip(depths[LOOKUP][1], depths[LOOKUP][2]))


# --- the loop -------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_enabled, is_adaptive", [(False, False), (True, False), (True, True)])
def test_greedy_output_equals_plain_decoding(is_enabled, is_adaptive):
    backends = FakeBackends(is_lookup_right=lambda n: n % 20 < 12)
    loop = run(make_params(is_enabled=is_enabled, is_adaptive=is_adaptive, degree=2, draft_length=6), backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    assert loop.outcome.finish_reason == "length"
    assert loop.outcome.text == "".join(f"<{t}>" for t in plain_decoding(PROMPT, 60))
    assert sum(loop.stats.num_steps_by_draft_length) == loop.stats.num_steps == backends.num_steps()
    # Committing (detokenizing, stop strings) and the store's writes are booked apart, both measured.
    times = loop.stats.to_pb().stage_times
    assert times.commit_ms == loop.stats.stage_ms["commit"] > 0 and times.state_ms > 0
    if not is_enabled:
        assert set(backends.steps()) == {"decode"} and loop.stats.num_steps_by_draft_length == [60]


@pytest.mark.parametrize("is_enabled", [False, True])
def test_runs_sent_several_steps_a_message_give_the_same_output_and_count_every_engine_step(is_enabled):
    """A client that waits for the whole answer takes a run's steps several a message (steps_per_message,
    the gateway's --unary_stream_interval): the output, the plans and the stats are those of a message a
    step (the stats count engine steps, not messages), with fewer loop steps to commit and store."""
    seen = {}
    for per_message in (1, 4):
        backends = FakeBackends(is_lookup_right=lambda n: n % 20 < 12)
        params = make_params(is_enabled=is_enabled, degree=2, draft_length=6, max_new_tokens=90)
        params = dataclasses.replace(params, stop=("<never>",))
        loop = run(params, backends, steps_per_message=per_message)
        assert loop.outcome.token_ids == plain_decoding(PROMPT, 90)
        assert set(backends.steps_per_message) == {per_message}
        # several steps a message: the primary sends one at once where a stop string completes
        assert set(backends.stop_strings) == {("<never>",) if per_message > 1 else ()}
        assert loop.stats.num_steps == backends.num_steps() == sum(loop.stats.num_steps_by_draft_length)
        # a step a token here (no run drafts): the messages carry every decoded token's step
        decoded = sum(call["num_tokens"] for name, call in backends.calls if name == "decode")
        assert sum(backends.run_messages) == decoded
        stats = loop.stats
        seen[per_message] = (stats.num_steps, stats.num_steps_by_draft_length, backends.steps(), backends.run_messages)
    assert seen[1][:3] == seen[4][:3]
    assert set(seen[1][3]) == {1} and max(seen[4][3]) == 4 and len(seen[4][3]) < len(seen[1][3])


def test_fixed_settings_are_honoured_every_step():
    backends = FakeBackends()
    loop = run(make_params(is_adaptive=False, degree=3, draft_length=5), backends)
    proposes = [c for name, c in backends.calls if name == "propose"]
    assert proposes and all(
        c["strategies"] == (LOOKUP, SUFFIX, LOOKUP) and c["draft_length"] == 5 and c["max_nodes"] == 64
        for c in proposes
    )
    assert set(backends.steps()) == {"verify"}
    assert loop.planner.controller is None and loop.stats.task_type == ""
    assert loop.stats.num_steps_by_draft_length[5] == loop.stats.num_steps
    # per decoder and rank; a decoder's time counted once (rank 0)
    assert set(loop.stats.decoders) == {LOOKUP, SUFFIX, f"{LOOKUP}#1"}
    assert loop.stats.decoders[LOOKUP][2] == pytest.approx(0.5 * len(proposes))
    assert loop.stats.decoders[f"{LOOKUP}#1"][2] == 0.0
    lookup, suffix = loop.stats.decoders[LOOKUP], loop.stats.decoders[SUFFIX]
    assert lookup[1] > 0 and suffix[1] == 0 and lookup[1] <= lookup[0]


@pytest.mark.parametrize("is_adaptive", [False, True])
def test_a_step_drafts_from_the_last_accepted_candidates_continuation_without_a_propose(is_adaptive):
    """When a step accepts prompt lookup's whole draft and the bonus token begins what it proposed
    past the draft, the next step drafts the rest without asking the draft service: far fewer
    Proposes than verifies, the draft service still hears every committed token (the fake checks),
    and the output is plain decoding's. The carried steps draft with prompt lookup alone."""
    backends = FakeBackends(is_continuing=True, is_lookup_right=lambda n: not 40 <= n < 60)
    loop = run(make_params(is_adaptive=is_adaptive, degree=2, draft_length=4, max_new_tokens=120), backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 120)
    proposes = [c for name, c in backends.calls if name == "propose"]
    verifies = [c for name, c in backends.calls if name == "verify"]
    assert all(c["continuation_length"] == max(CONTINUATION_TOKENS, c["draft_length"]) for c in proposes)
    assert len(proposes) < 0.7 * len(verifies)
    # 100 of the 120 tokens are lookup's to take; adaptive, it is off for a while after the wrong stretch
    assert loop.stats.decoders[LOOKUP][1] > 50
    assert loop.stats.num_steps == backends.num_steps()
    # a plain step drops the continuation (what it decoded is not what the draft continued with):
    # the speculative step after it asks the draft service
    names = [name for name, _ in backends.calls if name in ("propose", "verify", "decode")]
    after_plain = [names[i + 1 : i + 3] for i, name in enumerate(names[:-2]) if name == "decode"]
    assert all(nxt[0] != "verify" for nxt in after_plain)
    assert any(nxt[0] == "propose" for nxt in after_plain) == is_adaptive
    # without continuations every speculative step asks
    backends = FakeBackends(is_lookup_right=lambda n: not 40 <= n < 60)
    loop = run(make_params(is_adaptive=is_adaptive, degree=2, draft_length=4, max_new_tokens=120), backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 120)
    assert len([n for n, _ in backends.calls if n == "propose"]) == len([n for n, _ in backends.calls if n == "verify"])


def test_a_continuation_drafts_a_chain_of_its_decoder_once():
    """The carried draft: at most draft_length tokens as a chain proposed by the continuation's
    decoder alone (the plan narrowed to it), the rest kept as the chain's own continuation; a plan
    without that decoder asks the draft service; either way the continuation is used once."""
    loop = make_loop(make_params(is_adaptive=True, degree=1, draft_length=4), FakeBackends(is_continuing=True))
    loop.carry = (LOOKUP, (1, 2, 3))
    plan = SpeculationPlan(draft_length=2, sources=((LOOKUP, 0),), max_tree_nodes=2)
    narrowed, tree = loop._carried_draft(plan)
    assert tree.token_ids == (1, 2) and tree.parents == (-1, 0) and tree.continuations == ((1, LOOKUP, (3,)),)
    assert narrowed.sources == ((LOOKUP, 0),) and narrowed.draft_length == 2 and loop.carry is None
    loop.carry = (LOOKUP, (1, 2, 3))
    assert loop._carried_draft(SpeculationPlan(draft_length=2, sources=((SUFFIX, 0),))) is None  # not its decoder
    assert loop.carry is None  # used once either way


def test_adaptive_switches_between_plain_and_speculative_steps_without_losing_sync():
    # The oracle is right for 30 tokens, wrong for the next 40 (the controller turns speculation off
    # and probes), then right again (a probe turns it back on).
    backends = FakeBackends(is_lookup_right=lambda n: not 30 <= n < 70)
    loop = run(make_params(degree=4, draft_length=16, max_new_tokens=160), backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 160)
    steps = backends.steps()
    assert "verify" in steps and "decode" in steps
    assert any(a == "verify" and b == "decode" for a, b in zip(steps, steps[1:]))
    assert any(a == "decode" and b == "verify" for a, b in zip(steps, steps[1:]))
    # the step right after a plain one commits exactly the token Decode returned, no tree nodes
    primary = [(name, c) for name, c in backends.calls if name in ("verify", "decode")]
    for (before, _), (_, after) in zip(primary, primary[1:]):
        if before == "decode":
            assert after["accepted_nodes"] == () and len(after["committed"]) == 1
    # the draft service is told every committed token when it is used again after plain steps
    # (FakeBackends.propose checks the draft's context against everything committed, every call)
    proposes = [c for name, c in backends.calls if name == "propose"]
    assert max(len(c["new"]) for c in proposes) > 8  # a run of plain steps was caught up in one call
    assert all(len(c["strategies"]) <= 4 and c["draft_length"] <= 16 for c in proposes)  # the request's bounds
    stats = loop.stats
    assert stats.num_steps_by_draft_length[0] > 0  # speculation was off for a while
    assert sum(stats.num_steps_by_draft_length[1:]) > 0
    assert stats.num_probe_steps > 0
    assert stats.num_steps < 160 and stats.task_type == "code"
    assert loop.planner.controller_state.num_steps == stats.num_steps


def test_a_busy_primary_turns_speculation_off_and_an_idle_one_back_on():
    # A CPU-like curve, cheap extra rows at first and linear past 8: beside 60 other rows a draft row
    # costs as much as another request's token, so even an always-right oracle does not pay.
    linear = dataclasses.replace(MODEL, verify_costs_ms={1: 10.0, 2: 11.0, 4: 14.0, 8: 20.0, 16: 40.0, 64: 160.0})
    busy = FakeBackends(other_rows=60)
    loop = run(make_params(degree=1, draft_length=8, max_new_tokens=40), busy, model=linear)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 40)
    assert loop.planner.controller_state.other_rows == pytest.approx(60.0)  # the reports less the request's own rows
    assert loop.stats.num_steps_by_draft_length[0] > 0.8 * loop.stats.num_steps  # probes aside, plain
    idle = FakeBackends()
    loop = run(make_params(degree=1, draft_length=8, max_new_tokens=40), idle, model=linear)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 40)
    assert loop.stats.num_steps_by_draft_length[0] == 0 and loop.stats.num_steps < 40


def test_lookahead_rows_ride_in_the_verify_and_their_argmaxes_go_back_with_the_next_propose():
    backends = FakeBackends(is_lookup_right=lambda n: n % 3 != 0, lookahead_rows=(7, 8, 9))
    loop = run(make_params(is_adaptive=False, degree=1, draft_length=4, max_new_tokens=20), backends)
    committed = backends.truth + backends.decided  # the last step: decided, no later call settled it
    assert loop.outcome.token_ids == committed[len(PROMPT) :][: len(loop.outcome.token_ids)]
    proposes = [args for name, args in backends.calls if name == "propose"]
    assert proposes[0]["lookahead_argmax"] == ()  # the first proposal: no rows verified yet
    for k, args in enumerate(proposes[1:], start=1):  # verify k's argmaxes: 1000 + j + k
        assert args["lookahead_argmax"] == (1000 + k, 1001 + k, 1002 + k)


def test_the_draft_service_losing_the_request_gets_the_whole_context_again():
    backends = FakeBackends(lose_draft_at_call=3)
    loop = run(make_params(is_adaptive=False, degree=1, draft_length=4, max_new_tokens=40), backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 40)
    opens = [c for name, c in backends.calls if name == "propose" and c["is_open"]]
    assert len(opens) == 2 and len(opens[1]["new"]) > 0  # reopened with prompt + everything committed


def died_after_steps(params: GenerationParams, num_steps: int, **kwargs) -> tuple[RequestLoop, RequestState]:
    """A loop (its prompt lookup right for the first 40 tokens) that ran num_steps steps and then
    stopped, as its gateway died; the record it left."""
    store = InMemoryStateStore()
    loop = make_loop(params, FakeBackends(is_lookup_right=lambda n: n < 40), store, owner="gw-1", **kwargs)
    with asyncio.Runner() as runner:
        steps = loop.run()
        for _ in range(num_steps):
            runner.run(anext(steps))
        left = store.load("r1")
        runner.run(steps.aclose())  # closed inside its event loop, after the record it left was taken
        return loop, left


def test_controller_state_is_stored_and_restored_on_resume():
    store = InMemoryStateStore()
    params = make_params(degree=2, draft_length=8, max_new_tokens=80)
    whole = run(params, FakeBackends(is_lookup_right=lambda n: n < 40), store, request_id="whole")
    stored = store.load("whole")
    assert stored.controller_state == whole.planner.controller_state.to_dict()
    assert stored.stats["num_steps_by_draft_length"] == whole.stats.num_steps_by_draft_length

    # A gateway that died after 6 steps: a successor resumes from the stored tokens, stats and
    # controller state, and produces the same output.
    dead, state = died_after_steps(params, 6, stats_interval_s=0)
    assert (
        state.controller_state["num_steps"] == 6 and state.controller_state == dead.planner.controller_state.to_dict()
    )
    store = InMemoryStateStore()  # what the successor finds in Redis
    store.create("r1", {}, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    store.append_step("r1", state.token_ids, stats=state.stats, controller_state=state.controller_state)
    resumed = run(
        params,
        FakeBackends(is_lookup_right=lambda n: n < 40),
        store,
        generated=state.token_ids,
        stats=RequestStats.from_dict(state.stats),
        controller_state=state.controller_state,
    )
    assert resumed.planner.controller_state.num_steps == resumed.stats.num_steps > 6
    assert resumed.outcome.token_ids == plain_decoding(PROMPT, 80)
    assert resumed.planner.controller_state.estimates != ControllerState.from_dict(state.controller_state).estimates


def test_stats_go_to_the_store_once_an_interval_and_a_successor_counts_every_stored_token():
    """Tokens are stored with every step, the stats and controller state with the first step, one
    step an interval and the end: a successor of a gateway that died in between resumes from stats
    that lag the tokens, counted whole again (RequestStats.of_record), and ends as a whole run does."""
    params = make_params(degree=2, draft_length=8, max_new_tokens=80)
    store = InMemoryStateStore()
    whole = run(
        params, FakeBackends(is_lookup_right=lambda n: n < 40), store, request_id="whole", stats_interval_s=3600
    )
    stored = store.load("whole")  # the end carries the final stats, whatever the interval
    assert stored.stats == whole.stats.to_dict() and stored.controller_state == whole.planner.controller_state.to_dict()

    dead, state = died_after_steps(params, 6, stats_interval_s=3600)
    assert list(state.token_ids) == dead.generated  # every step's tokens
    assert state.stats["num_steps"] == state.controller_state["num_steps"] == 1  # the first step's
    assert state.stats["num_generated_tokens"] < len(state.token_ids)
    stats = RequestStats.of_record(state)
    assert stats.num_generated_tokens == len(state.token_ids) and stats.num_prompt_tokens == len(PROMPT)
    resumed = run(
        params,
        FakeBackends(is_lookup_right=lambda n: n < 40),
        generated=state.token_ids,
        stats=stats,
        controller_state=state.controller_state,
    )
    assert resumed.outcome.token_ids == plain_decoding(PROMPT, 80)
    assert resumed.stats.num_generated_tokens == 80


@pytest.mark.parametrize("ending", ["length", "stop"])
def test_a_resumed_output_that_had_already_ended_only_ends(ending):
    """A gateway that died after it stored a request's last step, before its end, leaves a record
    whose output is whole: the successor stores the end and computes nothing (it used to decode a
    token past max_new_tokens, or past the stop string)."""
    stored = plain_decoding(PROMPT, 6)
    text = "".join(f"<{t}>" for t in stored)
    stop = "".join(f"<{t}>" for t in stored[-2:])
    assert text.find(stop) == len(text) - len(stop)  # where the dead gateway's output stopped
    params = make_params(max_new_tokens=6 if ending == "length" else 40)
    params = dataclasses.replace(params, stop=(stop,) if ending == "stop" else ())
    backends = FakeBackends()
    loop = run(params, backends, generated=stored)
    assert loop.outcome.finish_reason == ending and loop.outcome.token_ids == stored
    assert loop.outcome.text == (text if ending == "length" else text[: -len(stop)])
    assert backends.steps() == []


def test_an_unreadable_stored_controller_state_starts_afresh():
    loop = run(make_params(max_new_tokens=10), FakeBackends(), controller_state={"version": 99})
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 10)
    assert isinstance(loop.planner.controller_state, ControllerState)


def test_task_type_is_inferred_when_the_request_gives_none():
    loop = run(make_params(task_type=None, max_new_tokens=5), FakeBackends())
    assert loop.stats.task_type == "creative"  # "3 7 1 4 ..." does not look like code


@dataclasses.dataclass
class BoundedPrimary(FakeBackends):
    """A primary that refuses a prompt without room to generate, a commit past its context and a tree
    deeper than its context has room for, as the real one does (Engine.check_open, commit, check_verify)."""

    max_context: int = MODEL.max_context

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        assert len(token_ids) < self.max_context, f"{len(token_ids)} tokens leave no room in {self.max_context}"
        return await super().prefill(request_id, token_ids, num_prompt_tokens)

    def _commit(self, accepted_nodes: Sequence[int], committed: Sequence[int]) -> None:
        super()._commit(accepted_nodes, committed)
        assert len(self.primary_context) <= self.max_context, f"a commit past max_context {self.max_context}"

    async def verify(
        self, request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed=None
    ) -> Verified:
        context = len(self.primary_context) + len(committed_token_ids)
        depth = max((len(tree_path(tree, i)) for i in range(tree.num_nodes)), default=0)
        assert context + depth <= self.max_context, f"context {context} + tree depth {depth} > {self.max_context}"
        assert context + tree.lookahead_depth <= self.max_context, "the lookahead rows reach past the context"
        return await super().verify(request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed)


def tree_path(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = tree.parents[node]
    return path


@pytest.mark.parametrize("is_adaptive", [False, True])
def test_the_end_of_the_context_clamps_the_tree_and_stops_like_plain_decoding(is_adaptive):
    """A prompt near max_context with max_new_tokens beyond it: the tree shrinks to the room left
    (it used to exceed it, and the request FAILED); the output is plain decoding's, ending LENGTH."""
    max_context = len(PROMPT) + 30
    backends = BoundedPrimary(max_context=max_context)
    model = dataclasses.replace(MODEL, max_context=max_context)
    store = InMemoryStateStore()
    params = make_params(is_adaptive=is_adaptive, degree=2, draft_length=16, max_new_tokens=200)
    loop = run(params, backends, store, model=model)
    assert loop.outcome.finish_reason == "length"
    assert loop.outcome.token_ids == plain_decoding(PROMPT, max_context - len(PROMPT))  # prompt + output
    assert store.load("r1").status == RequestStatus.FINISHED
    assert any(c["draft_length"] < 16 for name, c in backends.calls if name == "propose"), "the tree was clamped"


@pytest.mark.parametrize("is_enabled", [False, True])
def test_a_prompt_one_token_short_of_the_context_gets_its_one_token(is_enabled):
    """max_context bounds prompt + output (specdec.context_room), as the primary's engine does: a
    prompt of max_context - 1 tokens answers one token, ending LENGTH, plain or speculative."""
    max_context = len(PROMPT) + 1
    backends = BoundedPrimary(max_context=max_context)
    store = InMemoryStateStore()
    params = make_params(is_enabled=is_enabled, is_adaptive=False, degree=2, draft_length=4, max_new_tokens=50)
    loop = run(params, backends, store, model=dataclasses.replace(MODEL, max_context=max_context))
    assert loop.outcome.finish_reason == "length" and loop.outcome.token_ids == plain_decoding(PROMPT, 1)
    assert store.load("r1").status == RequestStatus.FINISHED


@pytest.mark.parametrize("is_adaptive", [False, True])
def test_a_step_drafts_no_more_than_the_request_can_still_use(is_adaptive):
    """A step of d drafts gives up to d + 1 tokens: with r tokens left to max_new_tokens it drafts at
    most r - 1, and a request with one token left takes it in a plain step (a one-token request asks
    the draft service nothing). The output is plain decoding's either way."""
    for max_new_tokens, expected in [(1, []), (2, [1]), (5, [4]), (20, [16, 2] if not is_adaptive else None)]:
        backends = FakeBackends()
        params = make_params(is_adaptive=is_adaptive, degree=1, draft_length=16, max_new_tokens=max_new_tokens)
        loop = run(params, backends)
        assert loop.outcome.token_ids == plain_decoding(PROMPT, max_new_tokens)
        if expected is not None:
            assert [c["draft_length"] for name, c in backends.calls if name == "propose"] == expected
        verifies = [c for name, c in backends.calls if name == "verify"]
        assert all(c["num_nodes"] <= max_new_tokens - c["position"] - 1 for c in verifies)


def test_a_finished_requests_release_brings_the_draft_pool_the_output_it_has_not_seen():
    """The pool indexes a finished output for later requests but sees only what Proposes carried:
    the tokens of steps after the last Propose (the primary's own, here the plain last token) go
    with the Release, so that it indexes the whole output; an unfinished request sends none."""
    backends = FakeBackends()
    loop = run(make_params(is_adaptive=False, degree=1, draft_length=16, max_new_tokens=20), backends)
    calls = backends.calls
    proposed = [c for name, c in calls if name == "propose"]
    seen = sum(len(c["new"]) for c in proposed)  # the output tokens the Proposes carried
    release = [c for name, c in calls if name == "release_draft"][-1]
    assert release["is_finished"] and release["new_token_ids"] == tuple(loop.outcome.token_ids[seen:])
    assert seen + len(release["new_token_ids"]) == len(loop.outcome.token_ids) == 20


def test_lookahead_rows_are_left_out_where_the_context_has_no_room_for_them():
    max_context = len(PROMPT) + 12
    backends = BoundedPrimary(
        max_context=max_context, is_lookup_right=lambda n: False, lookahead_rows=(7, 8, 9, 10, 11)
    )
    params = make_params(is_adaptive=False, degree=1, draft_length=2, max_new_tokens=200)
    loop = run(params, backends, model=dataclasses.replace(MODEL, max_context=max_context))
    assert loop.outcome.token_ids == plain_decoding(PROMPT, max_context - len(PROMPT))  # prompt + output
    num_lookahead = [c["num_lookahead"] for name, c in backends.calls if name == "verify"]
    assert num_lookahead[0] == 5 and num_lookahead[-1] == 0  # BoundedPrimary checked every step's depth


def test_a_stream_closed_by_its_consumer_is_cancelled_and_released():
    """A streaming client that goes away closes the loop's generator (GeneratorExit): the request is
    CANCELLED, not FAILED, and its KV slot and draft state are released."""
    backends, store = FakeBackends(), InMemoryStateStore()
    steps = make_loop(make_params(max_new_tokens=60), backends, store).run()
    with asyncio.Runner() as runner:
        assert runner.run(anext(steps)).token_ids
        runner.run(steps.aclose())
    state = store.load("r1")
    assert (state.status, state.finish_reason, state.error) == (RequestStatus.CANCELLED, "cancelled", "")
    assert [name for name, _ in backends.calls][-2:] == ["release_primary", "release_draft"]


@dataclasses.dataclass
class FlakyValidator(FakeBackends):
    """A validator that cannot be reached while is_down(number of its call) holds."""

    is_down: Callable[[int], bool] = lambda num_call: False
    num_validate_calls: int = 0

    async def validate(
        self, request_id, mode, sampling, acceptance_threshold, step, tree, verified, allowed=None
    ) -> Validation:
        self.num_validate_calls += 1
        if self.is_down(self.num_validate_calls):
            raise Unavailable("validator", "UNAVAILABLE: connection refused")
        return await super().validate(request_id, mode, sampling, acceptance_threshold, step, tree, verified, allowed)


def run_with_validator(params: GenerationParams, backends: FakeBackends, retry_s: float) -> RequestLoop:
    store = InMemoryStateStore()
    loop = run(params, backends, store, validator_state=DependencyState("validator", retry_s=retry_s))
    assert store.load("r1").status == RequestStatus.FINISHED
    return loop


def test_greedy_requests_stay_exact_and_speculative_while_the_validator_is_down():
    """Down for its calls 3..9 (each step probes it: retry_s 0): those steps accept in the gateway
    from the primary's argmaxes; the output is plain decoding's; validation returns to the validator."""
    backends = FlakyValidator(is_down=lambda n: 3 <= n <= 9)
    loop = run_with_validator(
        make_params(is_adaptive=False, degree=2, draft_length=6, max_new_tokens=80), backends, retry_s=0.0
    )
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 80)
    assert loop.stats.num_validator_fallback_steps == 7
    assert set(backends.steps()) == {"verify"} and backends.num_validate_calls > 9, "back to the validator"
    assert loop.stats.to_pb().num_validator_fallback_steps == 7


@dataclasses.dataclass
class HungDependencies(FakeBackends):
    """A validator and a draft pool whose calls never answer while is_*_hung(number of the call)
    holds: a stopped process holds its connections, so nothing is refused."""

    is_validator_hung: Callable[[int], bool] = lambda num_call: False
    is_draft_hung: Callable[[int], bool] = lambda num_call: False
    is_primary_hung: Callable[[int], bool] = lambda num_call: False
    num_validate_calls: int = 0
    num_propose_calls: int = 0
    num_verify_calls: int = 0
    num_abandoned_verifies: int = 0  # hung verifies the loop gave up on (cancelled)

    async def verify(self, *args, **kwargs) -> Verified:
        self.num_verify_calls += 1
        if self.is_primary_hung(self.num_verify_calls):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.num_abandoned_verifies += 1
                raise
        return await super().verify(*args, **kwargs)

    async def validate(self, *args, **kwargs) -> Validation:
        self.num_validate_calls += 1
        if self.is_validator_hung(self.num_validate_calls):
            await asyncio.Event().wait()
        return await super().validate(*args, **kwargs)

    async def propose(self, *args, **kwargs) -> DraftTree:
        self.num_propose_calls += 1
        if self.is_draft_hung(self.num_propose_calls):
            await asyncio.Event().wait()
        return await super().propose(*args, **kwargs)


def run_with_hangs(params: GenerationParams, backends: HungDependencies) -> RequestLoop:
    """Deadlines of 0.05 s (the fakes answer at once), each step a probe (retry_s 0); a loop that
    waits on a hung call fails the test in 10 s instead of hanging it."""
    store = InMemoryStateStore()
    loop = make_loop(
        params,
        backends,
        store,
        validator_state=DependencyState("validator", retry_s=0.0),
        draft_state=DependencyState("draft", retry_s=0.0),
        call_deadlines=CallDeadlines(DeadlineRule(floor_s=0.05, min_samples=1, max_s=60.0)),
    )
    asyncio.run(asyncio.wait_for(drain(loop), 10.0))
    assert store.load("r1").status == RequestStatus.FINISHED
    return loop


def test_a_hung_validator_is_treated_as_a_down_one():
    """Its calls 3..9 never answer: each fails at its 0.05 s deadline (before: at --rpc_timeout_s,
    failing the request), the step stands as the primary's argmaxes decided; output unchanged."""
    backends = HungDependencies(is_validator_hung=lambda n: 3 <= n <= 9)
    params = make_params(is_adaptive=False, degree=2, draft_length=6, max_new_tokens=80)
    loop = run_with_hangs(params, backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 80)
    assert loop.stats.num_validator_fallback_steps == 7
    assert backends.num_validate_calls > 9, "back to the validator"


def test_a_hung_draft_pool_leaves_the_primarys_own_steps():
    """Its Proposes 2..5 never answer: those steps verify the root alone; output unchanged, drafts
    come back."""
    backends = HungDependencies(is_draft_hung=lambda n: 2 <= n <= 5)
    params = make_params(is_adaptive=False, degree=2, draft_length=6, max_new_tokens=80)
    loop = run_with_hangs(params, backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 80)
    assert backends.num_propose_calls > 5 and loop.stats.num_accepted > 0


def test_a_hung_primary_ends_the_request_at_its_deadline():
    """Nothing replaces the primary: its call is not cut short by the latency rule, but it ends at the
    request's deadline (before: at --rpc_timeout_s, long past it), DEADLINE_EXCEEDED naming the
    primary (for the log; the client is told of its request), recorded as the deadline's end."""
    backends = HungDependencies(is_primary_hung=lambda n: n >= 3)
    store = InMemoryStateStore()
    deadline = time.monotonic() + 0.5
    loop = make_loop(
        make_params(is_adaptive=False, degree=2, draft_length=6, max_new_tokens=80),
        backends,
        store,
        deadline=deadline,
    )
    # The fake's hung verify never answers and has no timeout of its own: only the request's deadline
    # can end it (the 10 s guard fails a loop that waits for it instead of hanging the suite).
    with pytest.raises(DeadlineExceeded) as e:
        asyncio.run(asyncio.wait_for(drain(loop), 10.0))
    assert time.monotonic() >= deadline  # not given up before the deadline
    assert backends.num_verify_calls == 3 and backends.num_abandoned_verifies == 1  # the hung one, cancelled
    assert e.value.dependency == "primary"
    state = store.load("r1")
    assert state.status == RequestStatus.CANCELLED and state.finish_reason == "deadline"


def test_sampling_requests_run_plain_steps_while_the_validator_is_down():
    """Only the validator samples against a tree: the failed step's tree is dropped (re-prefill) and
    later steps are the primary's own plain steps until the validator answers a probe again."""
    backends = FlakyValidator(is_down=lambda n: True)
    params = dataclasses.replace(
        make_params(is_adaptive=False, degree=2, draft_length=6, max_new_tokens=30),
        sampling=SamplingParams(temperature=0.7, seed=1),
    )
    loop = run_with_validator(params, backends, retry_s=3600.0)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 30)  # the fake primary ignores temperature
    assert backends.num_validate_calls == 1 and [n for n, _ in backends.calls].count("prefill") == 2
    assert backends.steps()[0] == "verify" and set(backends.steps()[1:]) == {"decode"}
    # every step that would have drafted: all but the last, whose own token ends the request
    assert loop.stats.num_validator_fallback_steps == loop.stats.num_steps - 1


@dataclasses.dataclass
class CachingFlakyValidator(FlakyValidator):
    """A FlakyValidator whose primary finds the whole prompt in its prefix cache after the first prefill."""

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        is_first = not self.truth
        prefilled = await super().prefill(request_id, token_ids, num_prompt_tokens)
        return dataclasses.replace(prefilled, num_cached_prompt_tokens=0 if is_first else num_prompt_tokens)


def test_a_dropped_steps_re_prefill_is_a_recovery_not_the_requests_own_prefill():
    """The re-prefill that drops a tree no validator decided leaves the request's own prefill's
    figures (it used to count as the request's own: the prompt then looked cached)."""
    backends = CachingFlakyValidator(is_down=lambda n: True)
    params = dataclasses.replace(
        make_params(is_adaptive=False, degree=2, draft_length=6, max_new_tokens=30),
        sampling=SamplingParams(temperature=0.7, seed=1),
    )
    loop = run_with_validator(params, backends, retry_s=3600.0)
    assert [n for n, _ in backends.calls].count("prefill") == 2
    assert loop.stats.num_cached_prompt_tokens == 0


@dataclasses.dataclass
class CachingPrimary(FakeBackends):
    """A primary that finds the whole prompt in its prefix cache at every prefill."""

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        prefilled = await super().prefill(request_id, token_ids, num_prompt_tokens)
        return dataclasses.replace(prefilled, num_cached_prompt_tokens=num_prompt_tokens)


def test_a_resumed_requests_prefill_keeps_its_first_gateways_cached_prompt_figure():
    """A successor gateway's prefill of a resumed request (its prompt and stored output) is a recovery:
    the prompt's figure stays the one its first gateway stored (it was overwritten with the re-prefill's
    cache hit, the prompt then looked cached to its client); a request resumed before any output is
    prefilled as its own."""
    generated = plain_decoding(PROMPT, 10)
    store = InMemoryStateStore()
    store.create("r1", {}, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    store.append_step("r1", generated)
    stats = RequestStats(num_prompt_tokens=len(PROMPT), num_generated_tokens=10, num_steps=10)
    params = make_params(is_enabled=False, max_new_tokens=30)
    loop = run(params, CachingPrimary(), store, generated=generated, stats=stats)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 30) and loop.stats.num_cached_prompt_tokens == 0
    fresh = run(params, CachingPrimary(), request_id="r2")
    assert fresh.stats.num_cached_prompt_tokens == len(PROMPT)


@pytest.mark.parametrize(
    ("sampling", "has_logprobs", "num_generated", "is_speculative"),
    [
        (SamplingParams(temperature=0.7, seed=1, frequency_penalty=0.5), True, 0, False),
        (SamplingParams(temperature=0.7, seed=1, logit_bias=((3, 5.0),)), True, 0, False),
        (SamplingParams(temperature=0.7, seed=1, min_tokens=4), True, 3, False),  # min_tokens still ahead
        (SamplingParams(temperature=0.7, seed=1, min_tokens=4), True, 4, True),  # reached: rows are raw again
        (SamplingParams(temperature=0.7, seed=1, frequency_penalty=0.5), False, 0, True),  # nothing to score
        (SamplingParams(temperature=0.7, seed=1), True, 0, True),  # raw rows: the validator scores them
        (SamplingParams(frequency_penalty=0.5), True, 0, True),  # greedy: the primary scores its own argmax
    ],
)
@pytest.mark.parametrize("acceptance_threshold", [0.0, 0.5])  # sample or greedy mode; threshold mode
def test_a_sampled_request_scoring_its_tokens_on_processed_rows_takes_plain_steps(
    sampling, has_logprobs, num_generated, is_speculative, acceptance_threshold
):
    """The validator scores the token it draws on the row it was sent, which is the processed one when
    the primary applies penalties, logit_bias or min_tokens: e.g. frequency_penalty 0.5 on a token
    seen once turns a row [0, ln 3] (p = 1/4, 3/4) into [0, ln 3 - 0.5], and the drawn token 1 would
    be scored ln(3 e^-0.5 / (1 + 3 e^-0.5)) = -0.44 instead of its raw ln(3/4) = -0.29, which a plain
    step (speculation off) gives. Such steps are plain, so the values are the same either way."""
    params = make_params(is_adaptive=False, degree=2, draft_length=4, max_new_tokens=30)
    params = dataclasses.replace(
        params,
        sampling=sampling,
        speculation=dataclasses.replace(params.speculation, acceptance_threshold=acceptance_threshold),
        logprobs=LogprobsRequest(num_top=2) if has_logprobs else None,
    )
    loop = make_loop(params, FakeBackends())
    assert (loop.acceptance_mode == AcceptanceMode.THRESHOLD) == (acceptance_threshold > 0)
    loop.generated.extend(plain_decoding(PROMPT, num_generated))
    assert loop.planner.plan().is_speculative == is_speculative


def test_a_dependency_is_probed_once_per_retry_period_and_each_transition_logged_once():
    now = [0.0]
    changes = []
    state = DependencyState("validator", retry_s=2.0, clock=lambda: now[0], on_change=changes.append)
    assert state.should_call()
    state.failed("refused")
    state.failed("refused")
    assert not state.is_up and not state.should_call() and not state.is_retry_due()
    now[0] = 2.5
    assert state.is_retry_due() and state.should_call() and not state.should_call(), "one probe per period"
    state.succeeded()
    state.succeeded()
    assert state.is_up and changes == [False, True]


def test_greedy_validation_follows_the_primarys_argmaxes():
    # tree 0:a 1:b(parent 0) 2:c(parent 0); argmax rows [a, c, x, y] -> path [0, 2], bonus y
    a, b, c, x, y = 11, 12, 13, 14, 15
    tree = DraftTree((a, b, c), (-1, 0, 0), (1, 1, 1), (LOOKUP,), {}, 0.0)
    assert greedy_validation(tree, (a, c, x, y)) == Validation((0, 2), y, (), ())
    assert greedy_validation(tree, (b, c, x, y)) == Validation((), b, (), ())
    assert greedy_validation(DraftTree((), (), (), (), {}, 0.0), (x,)) == Validation((), x, (), ())


@dataclasses.dataclass
class DyingPrimary(FakeBackends):
    """A node whose primary cannot be reached from its `dies_at_verify`-th Verify on."""

    dies_at_verify: int = 2
    num_verifies: int = 0

    async def verify(self, *args, **kwargs) -> Verified:
        self.num_verifies += 1
        if self.num_verifies >= self.dies_at_verify:
            raise Unavailable("primary", "UNAVAILABLE: connection refused")
        return await super().verify(*args, **kwargs)


def test_after_a_failover_steps_are_validated_by_the_new_nodes_validator():
    dying, other = DyingPrimary(), FakeBackends()
    backends = cast(Backends, other)  # the fake stands in for node b's services
    node = Node(NodeAddress("b:1", "b:2", "b:3"), backends, DependencyState("draft"), DependencyState("validator"))

    async def failover(node_id: str, error: str) -> Node | None:
        return node

    loop = run(make_params(is_adaptive=False, max_new_tokens=60), dying, failover=failover)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    assert loop.node_id == "b:1"
    assert loop.validation.backends is other and loop.validation.validator_state is node.validator_state
    assert any(name == "validate" for name, _ in other.calls)


def test_a_request_that_failed_over_leaves_no_lease_behind_on_the_node_it_left():
    """The old node's backends keep the request's lease while it runs (a failover back prefills with
    it); at its end they drop it: kept, every request that ever failed over would stay in the
    gateway's memory for good. The node it ends on releases it as usual."""
    dying, other = DyingPrimary(), FakeBackends()
    node = Node(
        NodeAddress("b:1", "b:2", "b:3"), cast(Backends, other), DependencyState("draft"), DependencyState("validator")
    )

    async def failover(node_id: str, error: str) -> Node | None:
        return node

    loop = run(make_params(is_adaptive=False, max_new_tokens=20), dying, failover=failover)
    assert loop.node_id == "b:1"
    assert [name for name, _ in dying.calls].count("forget_kv_lease") == 1
    assert "forget_kv_lease" not in [name for name, _ in other.calls]
    assert [name for name, _ in other.calls][-2:] == ["release_primary", "release_draft"]


def test_a_request_holds_its_nodes_and_a_node_no_longer_listed_closes_with_its_last_request():
    """With --nodes, a node whose address left the DNS records is forgotten by the pool, its backends left
    open for the requests still on it: the request holds its node, and the node it fails over to, until
    its end; a node no longer listed then closes its connections, a listed one keeps them."""
    dying, other = DyingPrimary(), FakeBackends()
    first = Node(
        NodeAddress("a:1", "a:2", "a:3"), cast(Backends, dying), DependencyState("draft"), DependencyState("validator")
    )
    second = Node(
        NodeAddress("b:1", "b:2", "b:3"), cast(Backends, other), DependencyState("draft"), DependencyState("validator")
    )

    async def failover(node_id: str, error: str) -> Node | None:
        return second

    loop = make_loop(make_params(is_adaptive=False, max_new_tokens=20), dying, node=first, failover=failover)
    assert first.num_holders == 1
    first.is_listed = False  # what NodePool.resolve does when its address goes
    asyncio.run(drain(loop))
    assert loop.node_id == "b:1"
    assert first.num_holders == second.num_holders == 0
    assert [name for name, _ in dying.calls][-1] == "close"
    assert "close" not in [name for name, _ in other.calls]


@dataclasses.dataclass
class FullDraftPool(FakeBackends):
    """A draft pool that holds as many requests as it may: it refuses to open another (RESOURCE_EXHAUSTED,
    as the draft service answers past its max_requests)."""

    async def propose(self, args: ProposeArgs) -> DraftTree:
        self.calls.append(("propose", {"is_open": bool(args.prompt_token_ids)}))
        error = ResourceExhausted("request_id", "the draft pool holds 4096 requests")
        error.dependency = "draft"  # as Backends reports a service's status
        raise error


def test_a_full_draft_pool_leaves_the_request_running_without_drafts():
    """The pool is optional: a request it has no room for goes on by the primary alone, its output
    unchanged, and the pool (up, only full) is not asked again at every step; before, the refusal
    failed the request RESOURCE_EXHAUSTED."""
    backends = FullDraftPool()
    loop = run(make_params(is_adaptive=False, max_new_tokens=30), backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 30) and loop.outcome.finish_reason == "length"
    proposes = [args for name, args in backends.calls if name == "propose"]
    assert proposes and all(p["is_open"] for p in proposes) and len(proposes) < backends.num_steps()
    assert loop.draft.state.is_up


class BlippingStore(InMemoryStateStore):
    """A state store that does not answer the writes numbered in `failing`; with is_applying_first,
    a failing write is applied and then its reply is lost (the ambiguous case)."""

    def __init__(self, failing: set[int], is_applying_first: bool = False) -> None:
        super().__init__()
        self.failing, self.is_applying_first, self.num_writes = failing, is_applying_first, 0

    def append_step(self, request_id, token_ids=(), **kwargs):
        self.num_writes += 1
        if self.num_writes in self.failing:
            if self.is_applying_first:
                super().append_step(request_id, token_ids, **kwargs)
            raise Unavailable("state_store", "redis: Connection refused")
        return super().append_step(request_id, token_ids, **kwargs)


@pytest.mark.parametrize("is_applying_first", [False, True])
def test_state_store_blips_are_retried_within_the_request(is_applying_first):
    store = BlippingStore(failing={2, 3, 4, 7}, is_applying_first=is_applying_first)
    loop = run(make_params(is_adaptive=False, degree=1, draft_length=4, max_new_tokens=40), FakeBackends(), store)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 40) and loop.outcome.finish_reason == "length"
    state = store.load("r1")
    assert state.status == RequestStatus.FINISHED and list(state.token_ids) == loop.outcome.token_ids


def test_a_state_store_that_stays_down_fails_the_request_after_the_bounded_retries():
    store = BlippingStore(failing=set(range(3, 10_000)))
    loop = make_loop(make_params(max_new_tokens=40), FakeBackends(), store, max_state_retry_s=0.5)
    with pytest.raises(Unavailable, match="state_store"):
        asyncio.run(drain(loop))
    assert 3 < store.num_writes < 12, "retried, with backoff, then gave up"


class RefusingStore(InMemoryStateStore):
    """Another gateway cancels the request just before the loop's write number `at` lands."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.num_writes = at, 0

    def append_step(self, request_id, token_ids=(), **kwargs):
        self.num_writes += 1
        if self.num_writes == self.at:
            self.set_status(request_id, RequestStatus.CANCELLED, finish_reason="cancelled")
        return super().append_step(request_id, token_ids, **kwargs)


def test_plain_steps_decode_runs_of_tokens_in_one_call():
    """Greedy without a grammar, a plain step asks the primary for a run (DecodeRequest.max_tokens):
    with speculation off the whole request, its first token included (the run streams: that token
    reaches the client after the run's first step); with decode_run_max, runs of at most that many.
    The output is plain decoding's and every token counts as a step."""
    num_tokens = 60
    truth = plain_decoding(PROMPT, num_tokens)
    for run_max, runs in ((None, [60]), (25, [25, 25, 10])):
        backends = FakeBackends()
        loop = run(make_params(is_enabled=False, max_new_tokens=num_tokens), backends, decode_run_max=run_max)
        assert loop.outcome.token_ids == truth and loop.outcome.finish_reason == "length"
        decodes = [call for name, call in backends.calls if name == "decode"]
        assert [c["max_tokens"] for c in decodes] == runs
        assert loop.stats.num_steps == num_tokens == sum(loop.stats.num_steps_by_draft_length)
    # each call commits the previous run's last token, the one the primary left pending
    assert [c["committed"] for c in decodes] == [[], [truth[24]], [truth[49]]]


def test_a_run_ends_at_an_end_of_sequence_token():
    truth = plain_decoding(PROMPT, 60)
    model = dataclasses.replace(MODEL, eos_token_ids=(truth[10],))
    backends = FakeBackends()
    loop = run(make_params(is_enabled=False, max_new_tokens=60), backends, model=model)
    assert loop.outcome.token_ids == truth[: truth.index(truth[10])] and loop.outcome.finish_reason == "eos"
    decodes = [call for name, call in backends.calls if name == "decode"]
    # the primary stopped the run at it
    assert decodes[-1]["num_tokens"] == truth.index(truth[10]) + 1 < decodes[-1]["max_tokens"]
    # every step committed a token, the last one the end, which the output leaves out: a token a step
    assert loop.stats.num_steps == len(loop.outcome.token_ids) + 1 and loop.stats.num_end_tokens == 1
    assert loop.stats.mean_accepted_length == 1.0


def test_a_stop_string_before_an_end_token_in_the_same_step_leaves_the_end_uncounted():
    """A step accepts a stop string's token and, after it, an end-of-sequence token: the output stops
    at the stop string, as plain decoding does, which never decodes that end token; so it is not
    counted among the steps' tokens (mean_accepted_length) either."""
    truth = plain_decoding(PROMPT, 60)
    last = next(i for i in range(8, 60) if truth[i] not in truth[:i] and truth[i + 1] not in truth[: i + 1])
    model = dataclasses.replace(MODEL, eos_token_ids=(truth[last + 1],))
    loops = {}
    for is_enabled in (False, True):
        params = make_params(is_enabled=is_enabled, is_adaptive=False, degree=1, draft_length=16, max_new_tokens=60)
        params = dataclasses.replace(params, stop=(f"<{truth[last]}>",))
        loops[is_enabled] = loop = run(params, FakeBackends(), model=model)
        assert loop.outcome.token_ids == truth[: last + 1] and loop.outcome.finish_reason == "stop"
    assert loops[True].stats.num_steps < loops[False].stats.num_steps  # its tokens came in fewer steps
    assert loops[True].stats.num_end_tokens == loops[False].stats.num_end_tokens == 0


class CutShortTokenizer(FakeTokenizer):
    """Every token is the text "a" but `partial`, the first byte of "é", which nothing completes."""

    def __init__(self, partial: int) -> None:
        self.partial = partial

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        pieces = ["é".encode()[:1] if t == self.partial else b"a" for t in token_ids]
        return b"".join(pieces).decode("utf-8", errors="replace")


def test_a_stop_token_after_a_character_cut_short_ends_the_text_as_an_end_of_sequence_token_does():
    """The output's last token begins a character that the end token leaves unfinished: its text
    keeps what the detokenizer held back (U+FFFD) whichever end token it is, as GetRequest's and a
    follower's decode of the stored tokens do (a stop token's used to drop it)."""
    truth = plain_decoding(PROMPT, 60)
    end = next(i for i in range(4, 60) if truth[i] not in truth[:i] and truth[i - 1] not in truth[: i - 1])
    tokenizer = CutShortTokenizer(partial=truth[end - 1])
    texts = {}
    for finish in ("eos", "stop"):
        params = make_params(is_enabled=False, max_new_tokens=60)
        model = MODEL
        if finish == "eos":
            model = dataclasses.replace(MODEL, eos_token_ids=(truth[end],))
        else:
            params = dataclasses.replace(params, stop_token_ids=(truth[end],))
        loop = run(params, FakeBackends(), model=model, tokenizer=tokenizer)
        assert loop.outcome.finish_reason == finish and loop.outcome.token_ids == truth[:end]
        texts[finish] = loop.outcome.text
    assert texts["eos"] == texts["stop"] == tokenizer.decode(truth[:end])


def test_with_adaptive_speculation_a_run_never_moves_a_draft():
    """A plain step decodes the controller's plain steps ahead (until its next probe) in one run:
    every speculative step comes at the same token as when each plain token is a step of its own, the
    output is plain decoding's, and the runs take far fewer calls."""
    seen = {}
    for run_max in (1, None):
        backends = FakeBackends(is_lookup_right=lambda n: 30 <= n < 45 or n >= 150)
        params = make_params(is_enabled=True, is_adaptive=True, degree=2, draft_length=6, max_new_tokens=240)
        loop = run(params, backends, decode_run_max=run_max)
        assert loop.outcome.token_ids == plain_decoding(PROMPT, 240)
        assert loop.stats.num_steps == backends.num_steps()
        decodes = [call for name, call in backends.calls if name == "decode"]
        verified_at = [call["position"] for name, call in backends.calls if name == "verify"]
        seen[run_max] = verified_at, len(decodes), max(call["max_tokens"] for call in decodes)
    (at_one, calls_one, _), (at_runs, calls_runs, longest) = seen[1], seen[None]
    assert at_runs == at_one and sum(p >= 150 for p in at_one) > 5  # speculating again once drafts match
    assert calls_runs < calls_one / 2 and longest > 1


def test_a_step_the_store_refuses_never_reaches_the_output():
    """The write of step 5 is refused (cancelled elsewhere): the request ends CANCELLED with exactly
    the stored tokens, in its outcome's token ids, text and stats alike, and its resources are released."""
    store, backends = RefusingStore(at=5), FakeBackends()
    loop = make_loop(make_params(is_enabled=False, max_new_tokens=40), backends, store)

    async def collect() -> list[StepOutput]:
        return [out async for out in loop.run()]

    outputs = asyncio.run(collect())
    stored = store.load("r1")
    # a write per engine step of the streamed runs: the first four tokens, the refused fifth never out
    assert stored.status == RequestStatus.CANCELLED and len(stored.token_ids) == 4
    assert loop.outcome.finish_reason == "cancelled" and loop.outcome.token_ids == list(stored.token_ids)
    assert [t for out in outputs for t in out.token_ids] == list(stored.token_ids)
    assert loop.outcome.text == "".join(f"<{t}>" for t in stored.token_ids)
    assert loop.outcome.stats.num_generated_tokens == 4
    assert [name for name, _ in backends.calls][-2:] == ["release_primary", "release_draft"]


@dataclasses.dataclass
class MeetingReleases(FakeBackends):
    """Each release waits (1 s at most) until the other one has begun: only releases made at once end."""

    begun: set = dataclasses.field(default_factory=set)

    async def _meet(self, name: str) -> None:
        self.begun.add(name)
        async with asyncio.timeout(1.0):
            while len(self.begun) < 2:
                await asyncio.sleep(0.001)
        self.calls.append((name, {}))

    async def release_primary(self, request_id: str) -> None:
        await self._meet("release_primary")

    async def release_draft(self, request_id: str, is_finished: bool, new_token_ids=()) -> None:
        await self._meet("release_draft")


def test_the_services_release_a_finished_request_at_once():
    """The primary's and the draft pool's releases overlap: neither waits for the other's round trip
    before the client hears of the end (a release that waited would time out here)."""
    backends = MeetingReleases()
    loop = make_loop(make_params(max_new_tokens=8), backends, InMemoryStateStore())
    asyncio.run(drain(loop))
    assert loop.outcome.finish_reason == "length"
    assert sorted(name for name, _ in backends.calls[-2:]) == ["release_draft", "release_primary"]


class SlowStore(AsyncInMemoryStateStore):
    """Each step's write takes `write_s` and says in `events` when it starts and lands."""

    def __init__(self, events: list[str], write_s: float) -> None:
        super().__init__(InMemoryStateStore())
        self.events, self.write_s = events, write_s

    async def append_step(self, request_id, token_ids=(), **kwargs):
        self.events.append("write")
        await asyncio.sleep(self.write_s)
        result = self.sync.append_step(request_id, token_ids, **kwargs)
        self.events.append("stored")
        return result


@dataclasses.dataclass
class TimedBackends(FakeBackends):
    """FakeBackends whose Decode takes `decode_s` and says in `events` when it starts."""

    events: list[str] = dataclasses.field(default_factory=list)
    decode_s: float = 0.0

    async def decode_stream(self, *args, **kwargs):
        self.events.append("decode")
        await asyncio.sleep(self.decode_s)
        async for decoded in super().decode_stream(*args, **kwargs):
            yield decoded


def test_the_next_step_runs_while_the_last_one_is_written_and_only_stored_tokens_go_out():
    """The store's round trip is off the step's path: step k+1's Decode starts before step k's write
    lands, yet every output reaches the consumer only once the store holds its tokens; the output
    and the stored tokens are plain decoding's."""
    events: list[str] = []
    backends = TimedBackends(events=events, decode_s=0.01)
    store = SlowStore(events, write_s=0.005)
    store.sync.create("r1", {}, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    params = make_params(is_enabled=False, max_new_tokens=12)
    loop = loop_over_prompt(params, backends, store, decode_run_max=1)  # a token a step: 12 steps, 12 writes
    seen: list[int] = []

    async def consume() -> None:
        async for out in loop.run():
            seen.extend(out.token_ids)
            assert list(store.sync.load("r1").token_ids) == seen, "an output went out before it was stored"

    asyncio.run(consume())
    assert seen == plain_decoding(PROMPT, 12) == loop.outcome.token_ids
    assert list(store.sync.load("r1").token_ids) == seen
    # 12 steps' writes, then the final status's; every step but the last has the next step's Decode
    # start before its write lands (the write itself starts after that Decode: its RPC goes out first)
    stored = [i for i, e in enumerate(events) if e == "stored"]
    assert len(stored) == 13 and events.count("decode") == 12
    for k, landed in enumerate(stored[:11], start=1):
        assert events[:landed].count("decode") >= k + 1, events


def test_a_greedy_step_is_confirmed_by_the_validator_beside_the_next_step():
    """Greedy: the loop goes on with the decision the primary's argmaxes give (the validator's own
    rule) and the next step's Propose goes out before this step's Validate; every speculative step is
    still validated, and the output is plain decoding's."""
    backends = FlakyValidator()
    loop = run_with_validator(
        make_params(is_adaptive=False, degree=2, draft_length=6, max_new_tokens=60), backends, retry_s=0.0
    )
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    names = [name for name, _ in backends.calls if name in ("propose", "verify", "validate")]
    assert backends.num_validate_calls == names.count("verify") == loop.stats.num_steps
    # propose(1) verify(1) propose(2) validate(1) verify(2) propose(3) validate(2) ...
    for k in range(1, loop.stats.num_steps):
        nth_validate = [i for i, n in enumerate(names) if n == "validate"][k - 1]
        assert names[:nth_validate].count("propose") == k + 1, names[:12]
    assert loop.stats.num_validator_fallback_steps == 0


@dataclasses.dataclass
class DisagreeingValidator(FlakyValidator):
    """A validator whose call number `at` answers another path than the argmaxes' (a broken one)."""

    at: int = 3

    async def validate(self, request_id, mode, sampling, acceptance_threshold, step, tree, verified, allowed=None):
        v = await super().validate(request_id, mode, sampling, acceptance_threshold, step, tree, verified, allowed)
        return dataclasses.replace(v, bonus_token=WRONG) if self.num_validate_calls == self.at else v


def test_a_validator_that_disagrees_fails_the_request_before_the_step_is_stored_or_streamed():
    backends, store = DisagreeingValidator(at=3), InMemoryStateStore()
    loop = make_loop(make_params(is_adaptive=False, degree=2, draft_length=6, max_new_tokens=60), backends, store)
    seen: list[int] = []

    async def consume() -> None:
        async for out in loop.run():
            seen.extend(out.token_ids)

    with pytest.raises(Internal, match="validator"):
        asyncio.run(consume())
    state = store.load("r1")
    assert state.status == RequestStatus.FAILED and "validator" in state.error
    assert list(state.token_ids) == seen == plain_decoding(PROMPT, len(seen)), "steps 1 and 2 only"
    assert loop.stats.num_steps >= 3 and len(seen) < loop.stats.num_generated_tokens
    assert [name for name, _ in backends.calls][-2:] == ["release_primary", "release_draft"]


@dataclasses.dataclass
class LeasingPrimary(FakeBackends):
    """Grants "lease-1", "lease-2", ... on each prefill; loses the request once, at verify `lose_at`."""

    lose_at: int = -1
    num_verifies: int = 0
    num_prefills: int = 0

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        await super().prefill(request_id, token_ids, num_prompt_tokens)
        self.num_prefills += 1
        return Prefilled(time_ms=0.0, num_cached_prompt_tokens=0, kv_lease=f"lease-{self.num_prefills}")

    async def verify(self, request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed=None):  # noqa: ANN001
        self.num_verifies += 1
        if self.num_verifies == self.lose_at:
            raise NotFound("request_id", "no active request")
        return await super().verify(request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed)


@dataclasses.dataclass
class RestartedOnOtherWeights(LeasingPrimary):
    """A primary that loses the request at its lose_at-th Verify; its first and later Prefills report
    `formats` as the weights they served."""

    formats: tuple[str, str] = ("int4", "int8")

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        prefilled = await super().prefill(request_id, token_ids, num_prompt_tokens)
        return dataclasses.replace(prefilled, precision=self.formats[min(self.num_prefills, 2) - 1])


@pytest.mark.parametrize("formats", [("int4", "int8"), ("int4", "int4")])
def test_a_re_prefill_on_other_weights_is_logged_as_an_error(formats):
    """The primary reports the weight format it serves with each Prefill: a recovery that lands on
    another one goes on (the output then parts from an undisturbed run's), logged as an error naming
    both; one on the same weights logs nothing of the kind."""
    backends = RestartedOnOtherWeights(lose_at=3, formats=formats)
    with structlog.testing.capture_logs() as logs:
        loop = run(make_params(is_adaptive=False, degree=1, draft_length=4, max_new_tokens=20), backends)
    assert backends.num_prefills == 2 and len(loop.outcome.token_ids) == 20
    errors = [e for e in logs if e["log_level"] == "error" and "other weights" in e["event"]]
    if formats[0] == formats[1]:
        assert not errors
    else:
        assert len(errors) == 1 and (errors[0]["was"], errors[0]["now"]) == formats


def test_the_primary_s_lease_is_stored_with_the_next_step_for_a_successor_gateway():
    """A successor gateway re-prefills the live slot with the stored lease: the first prefill's,
    then a recovery's new one."""
    store = InMemoryStateStore()
    params = make_params(is_adaptive=False, degree=1, draft_length=4, max_new_tokens=40)
    dead = make_loop(params, LeasingPrimary(), store, owner="gw-1")
    with asyncio.Runner() as runner:
        steps = dead.run()
        runner.run(anext(steps))
        assert store.load("r1").kv_lease == "lease-1"
        runner.run(steps.aclose())
    store = InMemoryStateStore()
    backends = LeasingPrimary(lose_at=3)
    loop = run(params, backends, store)
    assert backends.num_prefills == 2 and store.load("r1").kv_lease == "lease-2"
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 40)


# --- a state store that lost its data (a Redis restarted without persistence) --------------------


@dataclasses.dataclass
class FlushingPrimary(LeasingPrimary):
    """A LeasingPrimary whose Verify number `flush_at` first empties the Redis behind the store
    (FLUSHALL, as a restart without persistence leaves it); with is_refusing the server then refuses
    every write (maxmemory 1: OOM)."""

    redis_client: redis.Redis | None = None
    flush_at: int = -1
    is_refusing: bool = False
    cancel_at: int = -1  # instead: another gateway cancels the request (its record stays, ended)

    async def verify(self, request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed=None):  # noqa: ANN001
        assert self.redis_client is not None
        if self.num_verifies + 1 == self.cancel_at:
            other_gateway = RedisStateStore.from_url(redis_url(self.redis_client))
            other_gateway.set_status(request_id, RequestStatus.CANCELLED, finish_reason="cancelled")
            other_gateway.close()
        if self.num_verifies + 1 == self.flush_at:
            self.redis_client.flushall()
            if self.is_refusing:
                self.redis_client.config_set("maxmemory", 1)
        return await super().verify(request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed)


STORED_PARAMS = {"prompt": " ".join(map(str, PROMPT)), "max_new_tokens": 40}


def redis_url(client: redis.Redis) -> str:
    """The URL of the unix socket client talks to (the redis_client fixture's)."""
    return f"unix://{client.connection_pool.connection_kwargs['path']}"


def run_on_redis(socket_path: str, params: GenerationParams, backends: FakeBackends) -> RequestLoop:
    """A loop over PROMPT on a real Redis (stored as RUNNING first, with STORED_PARAMS), run to its end."""
    sync_store = RedisStateStore.from_url(f"unix://{socket_path}")
    sync_store.create("r1", STORED_PARAMS, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    sync_store.close()

    async def go() -> RequestLoop:
        store = AsyncRedisStateStore(redis.asyncio.Redis(unix_socket_path=socket_path))
        loop = loop_over_prompt(
            params, backends, store, owner="gw-1", stored_params=STORED_PARAMS, max_state_retry_s=0.5
        )
        try:
            await drain(loop)
        finally:
            await store.close()
        return loop

    return asyncio.run(go())


def load_from_redis(client: redis.Redis, request_id: str) -> RequestState | None:
    store = RedisStateStore.from_url(redis_url(client))
    try:
        return store.load(request_id)
    finally:
        store.close()


def test_a_store_that_lost_the_record_mid_request_gets_it_back_whole(redis_server, redis_client):
    """FLUSHALL in the middle of a greedy request: the gateway writes the whole state back from its
    memory, the request finishes with the tokens of an undisturbed run, and the stored record is
    complete (before: the request ended NOT_FOUND "no stored request" about its own id)."""
    params = make_params(is_adaptive=False, degree=1, draft_length=4, max_new_tokens=40)
    undisturbed = run_on_redis(redis_server.socket_path, params, LeasingPrimary())
    redis_client.flushall()
    loop = run_on_redis(redis_server.socket_path, params, FlushingPrimary(redis_client=redis_client, flush_at=4))
    assert loop.outcome.token_ids == undisturbed.outcome.token_ids == plain_decoding(PROMPT, 40)
    assert loop.outcome.finish_reason == "length"
    state = load_from_redis(redis_client, "r1")
    assert state is not None and state.status == RequestStatus.FINISHED and state.finish_reason == "length"
    assert list(state.token_ids) == loop.outcome.token_ids and list(state.prompt_token_ids) == PROMPT
    assert state.params == STORED_PARAMS and state.kv_lease == "lease-1"
    assert state.stats["num_generated_tokens"] == 40 and state.stats["num_steps"] == loop.stats.num_steps


def test_a_store_that_lost_the_record_and_refuses_it_back_ends_the_request_unavailable(redis_server, redis_client):
    """The store lost the record and refuses to store it again: UNAVAILABLE naming the lost state,
    never NOT_FOUND about the client's own live request."""
    params = make_params(is_adaptive=False, degree=1, draft_length=4, max_new_tokens=40)
    backends = FlushingPrimary(redis_client=redis_client, flush_at=4, is_refusing=True)
    try:
        with pytest.raises(StateLost, match="stored state of request 'r1' was lost") as failed:
            run_on_redis(redis_server.socket_path, params, backends)
    finally:
        redis_client.config_set("maxmemory", 0)
    assert failed.value.status_name == "UNAVAILABLE" and "maxmemory" in str(failed.value)
    assert [name for name, _ in backends.calls][-2:] == ["release_primary", "release_draft"]


def test_a_request_ended_elsewhere_still_stops_and_is_not_written_back(redis_server, redis_client):
    """The record is there but ended (cancelled by another gateway): the step is refused and the
    request stops cancelled with the stored tokens, as before; nothing is re-created."""
    params = make_params(is_adaptive=False, degree=1, draft_length=4, max_new_tokens=40)
    loop = run_on_redis(redis_server.socket_path, params, FlushingPrimary(redis_client=redis_client, cancel_at=4))
    state = load_from_redis(redis_client, "r1")
    assert loop.outcome.finish_reason == "cancelled" and state is not None
    assert state.status == RequestStatus.CANCELLED and list(state.token_ids) == loop.outcome.token_ids
    assert 0 < len(loop.outcome.token_ids) < 40


@dataclasses.dataclass
class FeatureBackends(FakeBackends):
    """FakeBackends whose primary returns features when asked: row r of a step is (the position of the
    token it predicts, r), so a Propose shows which rows the loop forwarded and how it aligned them."""

    num_feature_calls: int = 0
    last_accepted: tuple[int, ...] = ()  # the last verify's greedy path

    @staticmethod
    def _features(rows: list[tuple[int, int]]) -> common_pb2.Features:
        return pb.features_to_pb(encode_features(torch.tensor(rows, dtype=torch.float32)))

    async def prefill(self, request_id, token_ids, num_prompt_tokens=0, *, return_features=False) -> Prefilled:
        prefilled = await super().prefill(request_id, token_ids, num_prompt_tokens)
        self.num_feature_calls += return_features
        # its one row: the last prefilled token's, predicting the pending one (the last)
        features = self._features([(len(token_ids) - 1, 0)]) if return_features else None
        return dataclasses.replace(prefilled, features=features)

    async def verify(
        self,
        request_id,
        accepted_nodes,
        committed_token_ids,
        tree,
        logits_format,
        allowed=None,
        *,
        return_features=False,
    ) -> Verified:
        verified = await super().verify(request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed)
        self.num_feature_calls += return_features
        self.last_accepted = tuple(self._greedy_path(tree, verified.argmax_token_ids)[0])
        pending = len(self.primary_context)  # the root row predicts the token after the committed ones
        depths = [0]
        for parent in tree.parents:
            depths.append(depths[parent + 1] + 1)
        features = self._features([(pending + depths[r], r) for r in range(tree.num_nodes + 1)])
        return dataclasses.replace(verified, features=features if return_features else None)

    async def propose(self, args: ProposeArgs) -> DraftTree:
        tree = await super().propose(args)
        rows = None if args.features is None else pb.features_from_pb(args.features).astype(int).tolist()
        self.calls[-1][1].update(features=rows, feature_position=args.feature_position, accepted=self.last_accepted)
        return tree


@pytest.mark.parametrize("is_continuing", [False, True])
def test_a_feature_strategy_gets_the_latest_steps_rows_of_its_committed_tokens_with_their_position(is_continuing):
    backends = FeatureBackends(is_lookup_right=lambda n: n % 4 != 0, is_continuing=is_continuing)
    params = make_params(is_adaptive=False, degree=2, draft_length=4, strategies=(LOOKUP, FEATURE_STRATEGY))
    loop = run(params, backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)  # greedy output unchanged
    proposes = [args for name, args in backends.calls if name == "propose"]
    verifies = [args for name, args in backends.calls if name == "verify"]
    assert backends.num_feature_calls == 1 + len(verifies)  # the prefill and every verify asked
    first = proposes[0]
    assert first["features"] == [[len(PROMPT) - 1, 0]] and first["feature_position"] == len(PROMPT) - 1
    num_carried = 0
    for p in proposes[1:]:
        # The root row and the accepted nodes' rows, in path order; row i predicts position + i.
        assert [row for _, row in p["features"]] == [0, *(n + 1 for n in p["accepted"])]
        assert [pos for pos, _ in p["features"]] == list(
            range(p["feature_position"], p["feature_position"] + len(p["features"]))
        )
        # the rows predict the newest committed tokens; a step drafted from a continuation leaves a gap before them
        num_carried += len(p["new"]) > len(p["features"])
        assert p["feature_position"] + len(p["features"]) == len(PROMPT) + sum(
            len(q["new"]) for q in proposes[1 : proposes.index(p) + 1]
        )
    assert (num_carried > 0) == is_continuing


@dataclasses.dataclass
class GappyFeatureBackends(FeatureBackends):
    """FeatureBackends whose primary brings features from every third verify only."""

    num_verifies: int = 0

    async def verify(self, *args, **kwargs) -> Verified:
        verified = await super().verify(*args, **kwargs)
        self.num_verifies += 1
        has_features = self.num_verifies % 3 == 1
        self.calls[-1][1].update(has_features=has_features)
        return verified if has_features else dataclasses.replace(verified, features=None)


def test_a_propose_after_a_step_without_features_gets_none_rather_than_an_older_steps():
    """Features describe the latest step's rows (on one machine: a logits slot, which the verifies after
    the next one rewrite): after a verify that brought none, the next Propose carries none, even where
    carried drafts ran verifies with no Propose between them."""
    backends = GappyFeatureBackends(is_lookup_right=lambda n: n % 4 != 0, is_continuing=True)
    params = make_params(is_adaptive=False, degree=2, draft_length=4, strategies=(LOOKUP, FEATURE_STRATEGY))
    loop = run(params, backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    last_verify, num_checked = None, 0
    for name, args in backends.calls:
        if name == "verify":
            last_verify = args
        elif name == "propose" and last_verify is not None:
            assert (args["features"] is not None) == last_verify["has_features"]
            num_checked += not last_verify["has_features"]
    assert num_checked > 0


@dataclasses.dataclass
class CurrentFeatureBackends(GappyFeatureBackends):
    """GappyFeatureBackends whose pool has a feature drafter as the real one: it drafts from the features
    of the last committed token, so it proposes (here the primary's own tokens) only where the Propose
    brings the features of the latest step (or the prefill's, opening the request), and nothing else."""

    is_feature_current: bool = False

    async def propose(self, args: ProposeArgs) -> DraftTree:
        self.is_feature_current = args.features is not None
        return await super().propose(args)

    async def verify(self, *args, **kwargs) -> Verified:
        verified = await super().verify(*args, **kwargs)
        self.calls[-1][1].update(asked_features=kwargs.get("return_features", False))
        return verified

    def _candidate(self, name: str, rank: int, draft_length: int) -> list[int]:
        if name != FEATURE_STRATEGY:
            return super()._candidate(name, rank, draft_length)
        if not self.is_feature_current or rank > 0:
            return []
        context = list(self.truth)
        for _ in range(draft_length):
            context.append(primary_next(context))
        return context[len(self.truth) :]


def test_a_step_whose_feature_reader_had_no_features_is_not_counted_against_it():
    """After a verify that brought no features the feature drafter has nothing to propose: a step
    that plans it asks for them (for the next step) and is not a miss to the controller. Here the
    drafter is right and cheap, and only every third verify brings features: the controller keeps
    drafting with it, its coverage counted over the steps it could draft."""
    backends = CurrentFeatureBackends(is_lookup_right=lambda n: False)
    cheap = cost_model_for(FP32_VERIFY_MS, CostSettings(), {FEATURE_STRATEGY: (0.0, 0.01)})
    params = make_params(degree=2, draft_length=4, strategies=(LOOKUP, FEATURE_STRATEGY))
    loop = run(params, backends, cost_model=cheap)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    with_feature = [
        args for name, args in backends.calls if name == "propose" and FEATURE_STRATEGY in args["strategies"]
    ]
    assert len(with_feature) >= 8 and sum(p["features"] is None for p in with_feature) >= 3
    # without current features it drafts only alone: a step that brings them (a refresh)
    assert all(p["features"] is not None or p["strategies"] == (FEATURE_STRATEGY,) for p in with_feature)
    assert loop.planner.controller_state is not None
    (estimate,) = [e for e in loop.planner.controller_state.estimates if (e.decoder, e.rank) == (FEATURE_STRATEGY, 0)]
    assert estimate.coverage > 0.9 and estimate.acceptance > 0.9


def test_a_feature_reader_without_current_features_is_known_silent():
    loop = make_loop(make_params(degree=2, strategies=(LOOKUP, FEATURE_STRATEGY)), FakeBackends())
    readers = {(e.decoder, e.rank) for e in loop.planner.controller_state.estimates if e.decoder == FEATURE_STRATEGY}
    loop.planner.are_features_current = False
    assert readers and {key: 0.0 for key in readers}.items() <= loop.planner.known_coverage().items()
    loop.planner.are_features_current = True
    assert readers.isdisjoint(loop.planner.known_coverage())


def test_a_step_that_drafts_without_the_feature_reader_asks_for_its_features_where_the_controller_wants_it():
    """Prompt lookup right and drafting every step, the feature drafter right and cheap, features from
    every third verify only: after a verify that brought none, the next step drafts with prompt lookup
    alone and asks for features, so that the step after drafts with both."""
    backends = CurrentFeatureBackends(is_lookup_right=lambda n: True)
    cheap = cost_model_for(FP32_VERIFY_MS, CostSettings(), {FEATURE_STRATEGY: (0.0, 0.01)})
    loop = run(make_params(degree=2, draft_length=4, strategies=(LOOKUP, FEATURE_STRATEGY)), backends, cost_model=cheap)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    steps, propose = [], None
    for name, args in backends.calls:
        if name == "propose":
            propose = args
        elif name == "verify" and propose is not None:
            steps.append((propose["strategies"], propose["features"] is not None, args["asked_features"]))
            propose = None
    assert all(has_features for strategies, has_features, _ in steps if FEATURE_STRATEGY in strategies)
    assert any(asked and FEATURE_STRATEGY not in strategies for strategies, _, asked in steps)
    assert sum(FEATURE_STRATEGY in strategies for strategies, _, _ in steps) >= 3


def test_without_a_feature_strategy_no_call_asks_for_features():
    backends = FeatureBackends()
    run(make_params(is_adaptive=False, degree=2, draft_length=4), backends)
    assert backends.num_feature_calls == 0
    assert all(args["features"] is None for name, args in backends.calls if name == "propose")


def test_an_adaptive_request_tracks_a_tree_decoder_at_every_rank_up_to_its_degree():
    params = make_params(degree=4, strategies=(LOOKUP, SUFFIX, FEATURE_STRATEGY))
    loop = make_loop(params, FakeBackends())
    assert loop.planner.controller_state is not None
    ranks = collections.Counter(e.decoder for e in loop.planner.controller_state.estimates)
    assert ranks == {LOOKUP: 2, SUFFIX: 1, FEATURE_STRATEGY: 4}  # cycled, and the tree's leaves
    assert loop.planner.fixed_plan.sources == ((LOOKUP, 0), (SUFFIX, 0), (FEATURE_STRATEGY, 0), (LOOKUP, 1))


def test_prompt_lookup_is_asked_only_where_the_contexts_tail_repeats():
    """With the repeat gate on, an adaptive request plans prompt lookup only at positions whose last
    3 tokens occurred earlier (specdec.repeats); the fake's output rarely repeats, so it drafts far
    less often than without the gate, and the output is plain decoding's either way."""
    expected = plain_decoding(PROMPT, 60)
    context = RepeatIndex(PROMPT)
    num_repeats = 0
    for token in expected:
        num_repeats += context.tail_repeats()
        context.extend([token])
    gated, ungated = FakeBackends(), FakeBackends()
    for backends, min_repeat in ((gated, 3), (ungated, 0)):
        params = make_params(degree=1, draft_length=4, strategies=(LOOKUP,))
        loop = run(params, backends, min_repeat_tokens=min_repeat)
        assert loop.outcome.token_ids == expected
    num_gated = sum(name == "propose" for name, _ in gated.calls)
    num_ungated = sum(name == "propose" for name, _ in ungated.calls)
    assert num_gated <= num_repeats < num_ungated


def test_a_run_ends_where_the_output_comes_to_repeat_earlier_text(monkeypatch):
    """A streamed run is opened while prompt lookup has nothing to draft (the tail repeats nothing), so
    the controller cannot see a copy coming. Where it would draft at a repeat, the run asks the primary
    to end where the output comes to repeat earlier text (stop_at_repeat_tokens), and the next step
    drafts the copy. Here the output cycles, breaks off into new text, and cycles again: after the
    break the controller (which saw prompt lookup's drafts accepted) turns speculation off, and the
    run it opens ends where the cycle resumes. Output is plain decoding's."""

    monkeypatch.setattr(sys.modules[__name__], "primary_next", cycling_with_a_break)
    expected = plain_decoding(PROMPT, 80)
    backends = FakeBackends()
    params = make_params(degree=1, draft_length=4, strategies=(LOOKUP,), max_new_tokens=80)
    loop = run(params, backends, min_repeat_tokens=3, is_run_drafting=False)
    assert loop.outcome.token_ids == expected
    assert 3 in backends.stops_at_repeat and set(backends.lookup_draft_lengths) == {0}
    assert 1 <= loop.stats.num_runs_ended_at_repeat == loop.stats.to_pb().num_runs_ended_at_repeat
    assert loop.stats.num_accepted >= 20  # both cycles drafted, not decoded a token a step


def test_runs_go_on_through_repeats_once_prompt_lookup_failed_there(monkeypatch):
    """The same cycling output, but prompt lookup's drafts are wrong: the run opened when a probe is due
    ends at a repeat and its probe fails; then the controller would not draft there and the probes back
    off, so the next run goes on through the repeats (each end would cost a round trip for nothing)."""
    monkeypatch.setattr(sys.modules[__name__], "primary_next", cycling_with_a_break)
    backends = FakeBackends(is_lookup_right=lambda n: False)
    params = make_params(degree=1, draft_length=4, strategies=(LOOKUP,), max_new_tokens=80)
    loop = run(params, backends, min_repeat_tokens=3, is_run_drafting=False)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 80)
    assert loop.stats.num_proposed > 0 and loop.stats.num_accepted == 0
    assert backends.stops_at_repeat.count(3) == loop.stats.num_runs_ended_at_repeat == 1
    assert backends.stops_at_repeat[-1] == 0


def test_runs_draft_the_copies_they_meet_in_the_primary(monkeypatch):
    """With run drafting on (the default), a greedy run asks the primary to draft its copies itself
    (lookup_draft_length = the request's draft_length) instead of ending at a repeat: the cycles are
    drafted inside the runs, counted under prompt_lookup@run, and the output is plain decoding's."""
    monkeypatch.setattr(sys.modules[__name__], "primary_next", cycling_with_a_break)
    backends = FakeBackends()
    params = make_params(degree=1, draft_length=4, strategies=(LOOKUP,), max_new_tokens=80)
    loop = run(params, backends, min_repeat_tokens=3)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 80)
    assert 4 in backends.lookup_draft_lengths and set(backends.stops_at_repeat) == {0}
    proposed, accepted, _ = loop.stats.decoders[RUN_LOOKUP_STATS]
    assert accepted >= 20 and proposed >= accepted
    assert loop.stats.num_accepted >= accepted and loop.stats.num_steps < 80 - 20


def test_a_run_s_drafts_from_the_model_s_answers_count_apart_from_its_copies(monkeypatch):
    """Where the run's tail repeats nothing (the break in the cycles), the primary drafts from the
    model's answers (here: the break's own text): GenerationStats counts those under answers@run,
    the copies under prompt_lookup@run, and the output is plain decoding's."""
    monkeypatch.setattr(sys.modules[__name__], "primary_next", cycling_with_a_break)
    plain = plain_decoding(PROMPT, 80)
    break_text = np.array([*plain[26:50], SEPARATOR], dtype=np.int32)  # the break: output positions 30-44
    backends = FakeBackends(answers=AnswerIndex(break_text, vocab_size=max(plain) + 1))
    loop = run(
        make_params(degree=1, draft_length=4, strategies=(LOOKUP,), max_new_tokens=80), backends, min_repeat_tokens=3
    )
    assert loop.outcome.token_ids == plain
    copied, copies_kept, _ = loop.stats.decoders[RUN_LOOKUP_STATS]
    answered, answers_kept, _ = loop.stats.decoders[RUN_ANSWERS_STATS]
    assert answers_kept > 0 and answered >= answers_kept and copies_kept > 0
    assert loop.stats.num_proposed == copied + answered and loop.stats.num_accepted >= copies_kept + answers_kept


@pytest.mark.parametrize(
    "changes",
    [
        {"sampling": SamplingParams(temperature=0.0, frequency_penalty=0.5)},
        {"speculation": None},
    ],
)
def test_runs_draft_nothing_with_penalties_or_without_prompt_lookup(monkeypatch, changes):
    monkeypatch.setattr(sys.modules[__name__], "primary_next", cycling_with_a_break)
    backends = FakeBackends()
    params = make_params(degree=1, draft_length=4, strategies=(LOOKUP,), max_new_tokens=40)
    if changes.get("speculation", 0) is None:
        params = make_params(degree=1, draft_length=4, strategies=(SUFFIX,), max_new_tokens=40)
    else:
        params = dataclasses.replace(params, **changes)
    loop = run(params, backends, min_repeat_tokens=3)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 40)
    assert set(backends.lookup_draft_lengths) <= {0} and RUN_LOOKUP_STATS not in loop.stats.decoders


def test_a_runs_steps_that_drafted_count_one_accepted_length_each_however_many_a_message(monkeypatch):
    """A client that waits for the whole answer takes a run's steps several a message: a message
    whose steps drafted their copies counted as one step that verified drafts, its accepted drafts
    summed into one accepted length (8 steps keeping 2 drafts each: one step of 17, not 8 of 3), so
    specdec_spec_decode_accepted_length's mean, the tokens per verify of drafts, came out several
    times too high. Each drafting step counts, as with a message a step."""
    monkeypatch.setattr(sys.modules[__name__], "primary_next", cycling_with_a_break)
    seen = {}
    for per_message in (1, 8):
        backends = FakeBackends()
        params = make_params(degree=1, draft_length=4, strategies=(LOOKUP,), max_new_tokens=80)
        loop = make_loop(params, backends, min_repeat_tokens=3, steps_per_message=per_message)
        registry = CollectorRegistry()
        metrics = GatewayMetrics(registry)

        async def measured() -> None:  # as GenerationServicer._measured observes a request's steps
            counts = _StepCounts.of(loop.stats)
            async for _ in loop.run():
                counts = counts.observe_into(metrics, loop.stats)
            counts.observe_into(metrics, loop.stats)

        asyncio.run(measured())
        assert loop.outcome.token_ids == plain_decoding(PROMPT, 80)
        value = registry.get_sample_value
        seen[per_message] = (
            loop.stats.num_draft_steps,
            value("specdec_spec_decode_num_drafts_total"),
            value("specdec_spec_decode_accepted_length_count"),
            value("specdec_spec_decode_accepted_length_sum"),
        )
        num_draft_steps = loop.stats.num_draft_steps
        assert num_draft_steps > 10 and max(backends.run_messages) == per_message
        assert seen[per_message][1:3] == (num_draft_steps, num_draft_steps)
        assert seen[per_message][3] == pytest.approx(loop.stats.num_accepted + num_draft_steps)
    assert seen[1] == pytest.approx(seen[8])


def cycling_with_a_break(context: Sequence[int]) -> int:
    """A fake primary whose output cycles 1..9, breaks off into other text at output positions 30-44,
    and cycles again: its 3-token tails repeat earlier text everywhere but in and just after the break."""
    is_break = 30 <= len(context) - len(PROMPT) < 45
    return (3 * context[-1] + context[-2] + len(context)) % 40 + 1 if is_break else context[-1] % 9 + 1


def test_the_gateways_step_costs_hear_every_undisturbed_step():
    """Speculative steps of one request and plain runs of another (the fake's forwards take no time,
    so the 1-row forward stays unmeasured)."""
    costs = StepCosts(StepCostConfig(min_steps=1))
    run(make_params(degree=2, draft_length=4, max_new_tokens=40), FakeBackends(), step_costs=costs)
    assert costs.overheads().speculative_ms is not None and costs.overheads().plain_ms is None
    run(make_params(is_enabled=False, max_new_tokens=40), FakeBackends(), step_costs=costs)
    assert costs.overheads().plain_ms is not None and costs.overheads().one_row_ms is None


def test_a_sampled_requests_speculative_steps_are_measured_apart_from_greedy_ones():
    """A sampled step waits for the validator's decision before it commits, a greedy one does not: each
    kind of request reads, and adds to, its own speculative overhead (gateway.step_costs)."""
    costs = StepCosts(StepCostConfig(min_steps=1))
    sampled = dataclasses.replace(
        make_params(is_adaptive=False, degree=2, draft_length=4, max_new_tokens=30),
        sampling=SamplingParams(temperature=0.7, seed=1),
    )
    loop = run(sampled, FakeBackends(), step_costs=costs)
    assert loop.stats.num_proposed > 0 and loop.planner.waits_for_validator
    assert costs.overheads(waits_for_validator=True).speculative_ms is not None
    assert costs.overheads().speculative_ms is None  # no greedy step yet
    loop = run(
        make_params(is_adaptive=False, degree=2, draft_length=4, max_new_tokens=30), FakeBackends(), step_costs=costs
    )
    assert not loop.planner.waits_for_validator and costs.overheads().speculative_ms is not None


def test_an_adaptive_request_asks_for_features_only_on_steps_that_draft_with_them():
    """The controller leaves the feature drafter out of steps where it does not pay (here: priced at
    five forwards a token); those verifies run without features, off the eager path."""
    backends = FeatureBackends(is_lookup_right=lambda n: True)
    dear = cost_model_for(
        FP32_VERIFY_MS,
        CostSettings(),
        {FEATURE_STRATEGY: (0.0, 200.0)},
    )
    params = make_params(degree=2, draft_length=4, strategies=(LOOKUP, FEATURE_STRATEGY))
    loop = run(params, backends, cost_model=dear)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    verifies = [args for name, args in backends.calls if name == "verify"]
    assert verifies and backends.num_feature_calls == 1  # the prefill's, then none


class ForgettingStore(InMemoryStateStore):
    """Before the loop's write number `at` lands, the store loses the last `lost` tokens it had
    acknowledged, as a Redis replica promoted after its master died can (replication is asynchronous)."""

    def __init__(self, at: int, lost: int) -> None:
        super().__init__()
        self.at, self.lost, self.num_writes = at, lost, 0

    def append_step(self, request_id, token_ids=(), **kwargs):
        self.num_writes += 1
        if self.num_writes == self.at:
            entry = self._entries[request_id]
            del entry.tokens[len(entry.tokens) - 4 * self.lost :]  # int32 per token
        return super().append_step(request_id, token_ids, **kwargs)


def test_steps_a_store_failover_lost_are_written_back_from_memory():
    """The record loses its last acknowledged token before write 6: the loop's next write is refused
    (the count moved back), the lost token goes back from memory with the step, and the request
    finishes whole (before: it ended CANCELLED at the refused step)."""
    store = ForgettingStore(at=6, lost=1)
    loop = run(make_params(is_enabled=False, max_new_tokens=40), FakeBackends(), store)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 40) and loop.outcome.finish_reason == "length"
    state = store.load("r1")
    assert state.status == RequestStatus.FINISHED and list(state.token_ids) == loop.outcome.token_ids


@dataclasses.dataclass
class SlowPrefill(FakeBackends):
    """A prefill that answers only once the request's first Propose has arrived (or after 2 s), as a
    prefill's round trip outlasts a Propose's; records which came first. `hung_propose`: the first
    Propose never answers (until cancelled, which it records); `failing_prefill`: the prefill then
    fails; `cancel`: the prefill cancels the request before it answers."""

    hung_propose: bool = False
    failing_prefill: bool = False
    cancel: threading.Event | None = None
    order: list[str] = dataclasses.field(default_factory=list)
    proposed: asyncio.Event | None = None
    was_propose_cancelled: bool = False

    def __post_init__(self) -> None:
        self.truth = list(PROMPT)  # what the prefill would make it: the first Propose may arrive before

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        self.proposed = self.proposed or asyncio.Event()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self.proposed.wait()
        self.order.append("prefill answered")
        if self.cancel is not None:
            self.cancel.set()
        if self.failing_prefill:
            raise Internal("primary", "the primary failed")
        return await super().prefill(request_id, token_ids, num_prompt_tokens)

    async def propose(self, args: ProposeArgs) -> DraftTree:
        self.order.append("propose sent")
        self.proposed = self.proposed or asyncio.Event()
        self.proposed.set()
        if self.hung_propose and args.prompt_token_ids:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.was_propose_cancelled = True
                raise
        return await super().propose(args)


def test_the_first_steps_propose_goes_out_beside_the_prefill():
    """A request whose first step drafts sends that step's Propose while its prefill is under way (the
    draft service needs only the prompt), not after the prefill's answer; the output stays exact."""
    backends = SlowPrefill()
    loop = run(make_params(is_adaptive=False, degree=2, draft_length=4), backends)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    assert backends.order[:2] == ["propose sent", "prefill answered"]
    names = [name for name, _ in backends.calls]
    assert names[:3] == ["propose", "prefill", "verify"]  # the step verifies the early proposal, no second Propose
    assert loop.stats.num_steps_by_degree[2] > 0


@pytest.mark.parametrize("ending", ["cancelled", "failed"])
def test_a_request_that_ends_at_its_prefill_stops_its_first_propose(ending):
    """Cancelled while its prefill is under way, or its prefill failing, the request's early Propose is
    stopped, not left running, and both services are told to release the request."""
    backends = SlowPrefill(hung_propose=True, failing_prefill=ending == "failed")
    store = InMemoryStateStore()
    loop = make_loop(make_params(is_adaptive=False, degree=2, draft_length=4), backends, store)
    backends.cancel = loop.cancel if ending == "cancelled" else None
    with contextlib.suppress(Internal):
        asyncio.run(drain(loop))
    assert backends.was_propose_cancelled
    assert store.load("r1").status == (RequestStatus.CANCELLED if ending == "cancelled" else RequestStatus.FAILED)
    assert {"release_primary", "release_draft"} <= {name for name, _ in backends.calls}


@dataclasses.dataclass
class QueuedPrefill(FakeBackends):
    """A prefill that waits at the primary (for KV room) until its call is cancelled, or 10 s."""

    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    was_prefill_cancelled: bool = False

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        self.started.set()
        try:
            await asyncio.sleep(10.0)
        except asyncio.CancelledError:
            self.was_prefill_cancelled = True
            raise
        return await super().prefill(request_id, token_ids, num_prompt_tokens)


def test_a_request_cancelled_while_its_prefill_waits_ends_then_and_ends_the_prefill():
    """Cancelled (its client went away) while its prefill waits for KV room: the loop ends the prefill's
    call, which takes it out of the primary's queue, and ends CANCELLED at once (before, it waited for
    the prefill's answer, up to the call's deadline, holding its admission slot meanwhile)."""
    backends, store = QueuedPrefill(), InMemoryStateStore()
    loop = make_loop(make_params(is_adaptive=False, degree=2, draft_length=4), backends, store)

    async def main() -> None:
        running = asyncio.ensure_future(drain(loop))
        while not backends.started.is_set():
            await asyncio.sleep(0.01)
        loop.cancel.set()
        await running

    asyncio.run(main())
    assert backends.was_prefill_cancelled
    assert store.load("r1").status == RequestStatus.CANCELLED and loop.outcome.finish_reason == "cancelled"
    assert {"release_primary", "release_draft"} <= {name for name, _ in backends.calls}


@dataclasses.dataclass
class BusyPrimary(FakeBackends):
    """A primary that loses the request (NotFound, as after its restart) at its `lost_at`-th Verify or
    run's message (0: never), and refuses every Prefill from its `busy_from`-th on as busy (its bound on
    Prefills under way), hinting a retry after a minute; `refused` is set at the first refusal."""

    busy_from: int = 1
    lost_at: int = 0
    num_prefills: int = 0
    num_steps_called: int = 0
    refused: threading.Event = dataclasses.field(default_factory=threading.Event)

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        self.num_prefills += 1
        if self.num_prefills >= self.busy_from:
            self.refused.set()
            busy = ResourceExhausted("request_id", "1 prefills under way already; retry later", dependency="primary")
            busy.retry_after_ms = 60_000
            raise busy
        return await super().prefill(request_id, token_ids, num_prompt_tokens)

    def _lose(self) -> None:
        self.num_steps_called += 1
        if self.num_steps_called == self.lost_at:
            raise NotFound("request_id", "no such request", dependency="primary")

    async def verify(self, *args, **kwargs) -> Verified:
        self._lose()
        return await super().verify(*args, **kwargs)

    async def decode_stream(self, *args, **kwargs):
        async for decoded in super().decode_stream(*args, **kwargs):
            self._lose()  # a run's message each
            yield decoded


@pytest.mark.parametrize("prefill", ["own", "recovery", "run"])
def test_a_request_cancelled_while_it_waits_to_retry_a_busy_primary_ends_cancelled(prefill):
    """Its own prefill, a recovery's re-prefill (the primary lost it at a Verify) or a streamed run's
    re-prefill is refused by a busy primary, and the request is cancelled while it waits to retry: it
    ends as a cancel between steps does (stored CANCELLED, no error, outcome "cancelled", its KV and
    draft state released); before, it ended FAILED, its client told RESOURCE_EXHAUSTED."""
    backends = BusyPrimary(busy_from=1 if prefill == "own" else 2, lost_at=0 if prefill == "own" else 3)
    store = InMemoryStateStore()
    params = make_params(is_enabled=prefill != "run", is_adaptive=False, degree=2, draft_length=4)
    loop = make_loop(params, backends, store)

    async def main() -> None:
        running = asyncio.ensure_future(drain(loop))
        while not backends.refused.is_set():
            await asyncio.sleep(0.01)
        loop.cancel.set()
        await asyncio.wait_for(running, 10.0)  # not once the minute's hint is over

    asyncio.run(main())
    state = store.load("r1")
    assert (state.status, state.finish_reason, state.error) == (RequestStatus.CANCELLED, "cancelled", "")
    assert loop.outcome.finish_reason == "cancelled" and loop.outcome.token_ids == list(state.token_ids)
    assert backends.num_steps_called == (0 if prefill == "own" else 3)
    assert {"release_primary", "release_draft"} <= {name for name, _ in backends.calls}


@dataclasses.dataclass
class DownPrimary(FakeBackends):
    """A primary that cannot be reached from its `down_from`-th Verify on (its Prefills neither, so a
    recovery waits for it); `down` is set at the first failure."""

    down_from: int = 3
    num_verifies: int = 0
    down: threading.Event = dataclasses.field(default_factory=threading.Event)

    def _fail(self) -> None:
        self.down.set()
        raise Unavailable("primary", "UNAVAILABLE: connection refused", dependency="primary")

    async def verify(self, *args, **kwargs) -> Verified:
        self.num_verifies += 1
        if self.num_verifies >= self.down_from:
            self._fail()
        return await super().verify(*args, **kwargs)

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        if self.down.is_set():
            self._fail()
        return await super().prefill(request_id, token_ids, num_prompt_tokens)


def test_a_request_cancelled_while_it_waits_for_an_unavailable_primary_ends_cancelled():
    """Cancelled while its recovery waits for the primary to come back: it ends as a cancel between
    steps does (stored CANCELLED, no error, outcome "cancelled"); before, it ended FAILED with the
    primary's UNAVAILABLE, its client told to retry the request it had cancelled."""
    backends, store = DownPrimary(), InMemoryStateStore()
    loop = make_loop(make_params(is_adaptive=False, degree=2, draft_length=4), backends, store)

    async def main() -> None:
        running = asyncio.ensure_future(drain(loop))
        while not backends.down.is_set():
            await asyncio.sleep(0.01)
        loop.cancel.set()
        await asyncio.wait_for(running, 10.0)

    asyncio.run(main())
    state = store.load("r1")
    assert (state.status, state.finish_reason, state.error) == (RequestStatus.CANCELLED, "cancelled", "")
    assert loop.outcome.finish_reason == "cancelled" and loop.outcome.token_ids == list(state.token_ids)


@dataclasses.dataclass
class CachedPromptFeatureBackends(CurrentFeatureBackends):
    """CurrentFeatureBackends whose prefill computes no row (the whole prompt was cached): no features."""

    async def prefill(self, request_id, token_ids, num_prompt_tokens=0, *, return_features=False) -> Prefilled:
        prefilled = await super().prefill(request_id, token_ids, num_prompt_tokens, return_features=return_features)
        return dataclasses.replace(prefilled, features=None)


def test_a_first_step_planned_on_features_the_prefill_did_not_bring_is_not_a_miss_of_its_reader():
    """A feature reader's request is planned before its prefill answers, on the features a prefill
    brings. One that computed no row brings none: the first step's reader has nothing to draft from
    (its Propose carries no features), and the controller hears of that step without the reader, as
    of a refresh, instead of counting a miss; the drafter, right and cheap, drafts on after."""
    backends = CachedPromptFeatureBackends(is_lookup_right=lambda n: False)
    cheap = cost_model_for(FP32_VERIFY_MS, CostSettings(), {FEATURE_STRATEGY: (0.0, 0.01)})
    loop = make_loop(
        make_params(degree=2, draft_length=4, strategies=(LOOKUP, FEATURE_STRATEGY)), backends, cost_model=cheap
    )
    assert loop.planner.controller is not None
    observed: list[tuple[SpeculationPlan, list[str]]] = []
    observe = loop.planner.controller.observe

    def spy(state, plan, outcomes, num_steps=1):  # noqa: ANN001
        observed.append((plan, [o.decoder for o in outcomes]))
        return observe(state, plan, outcomes, num_steps)

    loop.planner.controller.observe = spy  # type: ignore[method-assign]
    asyncio.run(drain(loop))
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    proposes = [args for name, args in backends.calls if name == "propose"]
    assert FEATURE_STRATEGY in proposes[0]["strategies"] and proposes[0]["features"] is None
    first_plan, first_outcomes = observed[0]
    assert FEATURE_STRATEGY not in {d for d, _ in first_plan.sources} and FEATURE_STRATEGY not in first_outcomes
    assert any(FEATURE_STRATEGY in outcomes for _, outcomes in observed[1:])  # counted where it could draft


@dataclasses.dataclass
class UnreachablePrefill(SlowPrefill):
    """A node whose primary cannot be reached at the prefill, which comes after the first Propose."""

    async def prefill(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int = 0) -> Prefilled:
        self.proposed = self.proposed or asyncio.Event()
        async with asyncio.timeout(2.0):
            await self.proposed.wait()
        raise Unavailable("primary", "UNAVAILABLE: connection refused")


def test_a_failover_at_the_prefill_proposes_the_first_step_on_the_new_node():
    """The first Propose went to the first node's draft pool beside a prefill that failed over: it is
    stopped, and the first step proposes on the new node's pool, which then follows the request."""
    dying, other = UnreachablePrefill(hung_propose=True), FakeBackends()
    node = Node(
        NodeAddress("b:1", "b:2", "b:3"), cast(Backends, other), DependencyState("draft"), DependencyState("validator")
    )

    async def failover(node_id: str, error: str) -> Node | None:
        return node

    loop = run(make_params(is_adaptive=False, degree=2, draft_length=4), dying, failover=failover)
    assert loop.outcome.token_ids == plain_decoding(PROMPT, 60)
    assert dying.was_propose_cancelled and loop.node_id == "b:1"
    proposes = [args for name, args in other.calls if name == "propose"]
    assert proposes[0]["is_open"] and not any(p["is_open"] for p in proposes[1:])  # opened once, there
