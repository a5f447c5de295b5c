"""The request loop with a response format: tokens the grammar allows alone are committed after a
step's own tokens, undrafted and unverified, and the primary runs them at its next call; the output
equals plain constrained decoding token for token. Real tokenizer and grammar engine, fake services.

The fake primary writes TARGET, a hand-spelled output of the person schema, under the mask: its
`"` after `{`, `,` after `Bob"`, `}` after `celsius"` and the end token are the only tokens the
grammar allows there (tests/specdec/grammar/test_state.py), every other token one of several.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import inspect
import threading
from typing import Any

import pytest

from gateway.backends import EMPTY_TREE, Backends, Decoded, DraftTree, ModelInfo, Prefilled, Validation, Verified
from gateway.controller import SpeculationPlan
from gateway.loop import RequestLoop
from gateway.params import GenerationParams, SpeculationParams
from specdec.grammar import ResponseFormat
from specdec.propose_args import ProposeArgs
from specdec.sampling import SamplingParams
from specdec.state_store import RequestStatus
from specdec.state_store import AsyncInMemoryStateStore
from specdec.state_store.memory import InMemoryStateStore
from specdec.task_type import TaskType
from tests.schemas import PERSON_SCHEMA

DECODE_STREAM = inspect.signature(Backends.decode_stream)  # the fake reads its calls by it

EOS = 2  # SmolLM2's <|im_end|>
PROMPT = [1, 9690, 198]
PIECES = ["{", '"', "name", '":', ' "', "Bob", '"', ",", ' "', "age", '":', " ", "4", "2", ","]
PIECES += [' "', "unit", '":', ' "', "c", "elsius", '"', "}"]
FORCED = {'"': 1, ",": 1, "}": 1}  # forced once each where the grammar leaves no choice (module doc)


@pytest.fixture(scope="module")
def target(tokenizer) -> list[int]:
    """TARGET: PIECES as single tokens, then the end token."""
    token_ids = [tokenizer.encode(piece) for piece in PIECES]
    assert all(len(t) == 1 for t in token_ids), "every piece is one token of the model's vocabulary"
    return [t[0] for t in token_ids] + [EOS]


@dataclasses.dataclass
class TargetBackends:
    """Primary, greedy validator and an oracle draft service that proposes the next `draft_length`
    target tokens (0: nothing). The primary checks that everything committed is the target so far and
    that each row's token is allowed by the mask sent with it."""

    target: list[int]
    draft_length: int = 0
    context: list[int] = dataclasses.field(default_factory=list)  # prompt + committed, as the primary has it
    num_drafted_context: int = 0  # prompt + committed, as the draft service has heard it
    committed: list[list[int]] = dataclasses.field(default_factory=list)  # per Verify/Decode call
    other_step_rows: int = 0  # the primary's load as Backends keeps it (an idle primary)
    num_decodes: int = 0
    num_grammar_runs: int = 0  # of which carried the response format (a run)
    prepared: list[ResponseFormat] = dataclasses.field(default_factory=list)  # PrepareGrammar calls
    opened_with: list[ResponseFormat | None] = dataclasses.field(default_factory=list)  # each opening Propose's format

    prefill_formats: list[ResponseFormat | None] = dataclasses.field(default_factory=list)  # per Prefill

    async def prefill(self, request_id, token_ids, num_prompt_tokens=0, *, response_format=None) -> Prefilled:
        self.context = list(token_ids)
        self.prefill_formats.append(response_format)
        return Prefilled(0.0, 0)

    def _commit(self, committed) -> None:
        self.committed.append(list(committed))
        self.context += committed
        assert self.context[len(PROMPT) :] == self.target[: len(self.context) - len(PROMPT)], "off the target"

    def _next(self, path=()) -> int:
        return self.target[len(self.context) - len(PROMPT) + len(path)]

    async def verify(
        self, request_id, accepted_nodes, committed_token_ids, tree, logits_format, allowed=None
    ) -> Verified:
        self._commit(committed_token_ids)
        rows = [self._next(tree.token_ids[: i + 1]) for i in range(-1, tree.num_nodes)]  # a chain tree
        assert allowed.is_allowed(list(range(len(rows))), rows).all(), "a row's token is off the grammar"
        return Verified(None, tuple(rows), 0.0)

    def _run(self, call: dict[str, Any]) -> tuple[int, ...]:
        """The tokens of one decode_stream call: one under the gateway's mask, or a run under the
        response format that the primary masks by its own grammar state."""
        self._commit(call["committed_token_ids"])
        self.num_decodes += 1
        allowed, max_tokens, response_format = call["allowed"], call["max_tokens"], call["response_format"]
        if response_format is None:  # one token under the gateway's mask
            assert max_tokens == 1 and allowed.is_allowed([0], [self._next()]).all()
            return (self._next(),)
        # a run: the primary masks by its own grammar state, committing every token but the last
        assert allowed is None and response_format.schema_text == PERSON_SCHEMA
        self.num_grammar_runs += 1
        tokens = [self._next()]
        while len(tokens) < max_tokens and tokens[-1] not in call["stop_token_ids"]:
            self._commit(tokens[-1:])
            tokens.append(self._next())
        return tuple(tokens)

    async def decode_stream(self, *args, **kwargs):
        """A run as the primary streams it: a token a message, every one but the last committed by the
        primary; the caller's context (before its commit) must be the primary's. Its runs do not end
        at repeats nor draft (stop_at_repeat_tokens, lookup_draft_length: test_loop's fake does)."""
        bound = DECODE_STREAM.bind(None, *args, **kwargs)  # by the real method's names and defaults
        bound.apply_defaults()
        call = bound.arguments
        assert call["num_context_tokens"] == len(self.context), "the caller does not know the primary's context"
        tokens = self._run(call)
        for i, token in enumerate(tokens):
            yield Decoded(token, 0.0, 0, (token,), is_run_end=i == len(tokens) - 1)

    async def validate(self, request_id, mode, sampling, threshold, step, tree, verified, allowed=None) -> Validation:
        num_accepted = next(
            (i for i in range(tree.num_nodes) if tree.token_ids[i] != verified.argmax_token_ids[i]), tree.num_nodes
        )
        return Validation(tuple(range(num_accepted)), verified.argmax_token_ids[num_accepted], (), ())

    async def propose(self, args: ProposeArgs) -> DraftTree:
        if args.prompt_token_ids:  # the call that opens the request
            self.opened_with.append(args.response_format)
        self.num_drafted_context += len(args.prompt_token_ids) + len(args.new_token_ids)
        start = self.num_drafted_context - len(PROMPT)  # the tree continues everything committed
        chain = tuple(self.target[start : start + self.draft_length][: len(self.target) - 1 - start])
        if not chain:
            return EMPTY_TREE
        return DraftTree(chain, tuple(range(-1, len(chain) - 1)), (1,) * len(chain), ("prompt_lookup",), {}, 0.0)

    async def prepare_grammar(self, response_format) -> None:
        assert self.num_drafted_context == 0, "asked after the request's first Propose"
        self.prepared.append(response_format)

    async def release_primary(self, request_id) -> None:
        pass

    async def release_draft(self, request_id, is_finished, new_token_ids=()) -> None:
        pass


def run_loop(
    grammar_cache,
    tokenizer,
    backends: TargetBackends,
    is_enabled: bool,
    decode_run_max: int | None = 1,
    is_first_step_plain: bool = False,
) -> RequestLoop:
    """The request under PERSON_SCHEMA; decode_run_max 1: every plain step decodes one token;
    is_first_step_plain: the first plan is a plain step (the fixed plan's after it)."""
    spec = SpeculationParams(is_enabled, 1, 4, 0.0, ("prompt_lookup",), TaskType.STRUCTURED, False)
    response_format = ResponseFormat("json_schema", PERSON_SCHEMA)
    params = GenerationParams("p", None, 64, (), SamplingParams(), spec, response_format=response_format)
    store = InMemoryStateStore()
    store.create("r1", {}, prompt_token_ids=PROMPT, status=RequestStatus.RUNNING)
    model = ModelInfo(49152, (EOS,), 4096, "fake", verify_costs_ms={})
    loop = RequestLoop(
        "r1",
        params,
        PROMPT,
        backends,
        AsyncInMemoryStateStore(store),
        tokenizer,
        model,
        ("fp32", "fp32"),
        recovery_timeout_s=1.0,
        max_tree_nodes=64,
        cancel=threading.Event(),
        owner="test",
        grammar=grammar_cache.compile(response_format).new_state(),
        decode_run_max=decode_run_max,
    )
    if is_first_step_plain:
        plan, plans = loop.planner.plan, iter([SpeculationPlan()])
        loop.planner.plan = lambda: next(plans, None) or plan()  # type: ignore[method-assign]
    asyncio.run(drain(loop))
    return loop


async def drain(loop: RequestLoop) -> None:
    async for _ in loop.run():
        pass


@pytest.mark.parametrize("draft_length", [0, 2])
def test_forced_tokens_join_the_commit_and_the_output_equals_plain_decoding(
    grammar_cache, tokenizer, target, draft_length
):
    plain = run_loop(grammar_cache, tokenizer, TargetBackends(target), is_enabled=False)  # a token a step
    assert plain.outcome.token_ids == target[:-1] and plain.outcome.finish_reason == "eos"
    assert plain.stats.num_forced_tokens == 0 and plain.stats.num_steps == len(target)  # one token a step

    backends = TargetBackends(target, draft_length)
    loop = run_loop(grammar_cache, tokenizer, backends, is_enabled=True)
    assert loop.outcome.token_ids == plain.outcome.token_ids and loop.outcome.finish_reason == "eos"
    assert json.loads(tokenizer.decode(loop.outcome.token_ids))["unit"] == "celsius"
    if draft_length == 0:
        # `"`, `,`, `}` forced after their step's one token, and the end token after `}` ends the
        # request in that step: a step saved for each
        assert loop.stats.num_forced_tokens == sum(FORCED.values())
        assert loop.stats.num_steps == plain.stats.num_steps - sum(FORCED.values()) - 1
        # the primary hears each forced token right behind the step's own token, in one commit
        forced_ids = {tokenizer.encode(piece)[0] for piece in FORCED}
        assert sum(len(c) == 2 and c[-1] in forced_ids for c in backends.committed) == 2  # the `}` ended it
    else:  # the drafts may reach forced tokens first: accepted as drafts then, not counted as forced
        assert loop.stats.num_forced_tokens <= sum(FORCED.values()) and loop.stats.num_accepted > 0
        num_gained = loop.stats.num_accepted + loop.stats.num_forced_tokens  # beyond a token a step
        assert loop.stats.num_steps <= plain.stats.num_steps - num_gained


@pytest.mark.parametrize("is_enabled", [False, True])
def test_the_draft_pool_compiles_the_format_beside_the_prefill_when_speculation_may_draft(
    grammar_cache, tokenizer, target, is_enabled
):
    """A speculative request with a response format has the draft pool compile it beside the prefill:
    here its first step drafts, so that step's Propose goes out beside the prefill with the format and
    begins the compile, without a PrepareGrammar of its own; one with speculation off never calls the
    pool."""
    backends = TargetBackends(target, draft_length=2)
    loop = run_loop(grammar_cache, tokenizer, backends, is_enabled=is_enabled)
    assert loop.outcome.token_ids == target[:-1]
    assert backends.prepared == []
    assert backends.opened_with == ([ResponseFormat("json_schema", PERSON_SCHEMA)] if is_enabled else [])


def test_a_request_whose_first_step_is_plain_has_the_draft_pool_compile_its_format_beside_the_prefill(
    grammar_cache, tokenizer, target
):
    """Where the first step does not draft, the draft pool is asked to compile the format beside the
    prefill (PrepareGrammar), before the Propose of the first step that drafts."""
    backends = TargetBackends(target, draft_length=2)
    loop = run_loop(grammar_cache, tokenizer, backends, is_enabled=True, is_first_step_plain=True)
    assert loop.outcome.token_ids == target[:-1]
    assert backends.prepared == [ResponseFormat("json_schema", PERSON_SCHEMA)]  # before any Propose (the fake checks)
    assert backends.opened_with == [ResponseFormat("json_schema", PERSON_SCHEMA)]


@pytest.mark.parametrize("decode_run_max", [None, 1])
def test_the_primary_compiles_the_format_beside_the_prefill_when_runs_may_use_it(
    grammar_cache, tokenizer, target, decode_run_max
):
    """A greedy request whose plain steps may be runs under its response format names the format in
    its Prefill, so that the primary compiles it beside the prefill instead of in the first run; one
    whose plain steps are a token each (decode_run_max 1: the gateway masks them) does not."""
    backends = TargetBackends(target)
    loop = run_loop(grammar_cache, tokenizer, backends, is_enabled=False, decode_run_max=decode_run_max)
    assert loop.outcome.token_ids == target[:-1]
    runs_format = ResponseFormat("json_schema", PERSON_SCHEMA) if decode_run_max is None else None
    assert backends.prefill_formats == [runs_format]


def test_plain_steps_under_a_grammar_decode_runs_that_the_primary_masks(grammar_cache, tokenizer, target):
    """With runs (the default), a plain step under a grammar sends the response format instead of a
    mask, and the primary decodes the rest of the request in the call; the output is the same."""
    backends = TargetBackends(target)
    loop = run_loop(grammar_cache, tokenizer, backends, is_enabled=False, decode_run_max=None)
    assert loop.outcome.token_ids == target[:-1] and loop.outcome.finish_reason == "eos"
    assert backends.num_grammar_runs > 0 and backends.num_decodes < len(target) // 2  # far fewer calls than tokens
    assert json.loads(tokenizer.decode(loop.outcome.token_ids))["unit"] == "celsius"
