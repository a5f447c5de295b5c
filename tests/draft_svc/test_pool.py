"""The draft pool: candidate order, merge into one tree, per-request decoder state, parallel runs,
validation, release into the suffix index. Fake decoders with scripted answers, no model."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import types
from concurrent.futures import Future
from typing import ClassVar

import numpy as np
import pytest

from draft_svc import pool as pool_module
from draft_svc.__main__ import expire_idle_requests
from draft_svc.pool import DraftPool, PoolConfig
from specdec.propose_args import ProposeArgs
from draft_svc.strategies import model_free_registry
from draft_svc.strategies.base import Candidate, DecoderRegistry, FeatureConsumer
from draft_svc.strategies.suffix_index import SuffixIndex, SuffixIndexConfig
from specdec.engine.tree import ROOT
from specdec.errors import InvalidArgument, NotFound, ResourceExhausted
from specdec.grammar.compiler import ResponseFormat

A, B, C, D, E = 10, 11, 12, 13, 14
VOCAB = 100


class Scripted:
    """Answers every propose with fixed continuations (truncated to max_tokens / max_candidates) and
    records what it was shown."""

    name: ClassVar[str] = "scripted"

    def __init__(self, name: str, answers: tuple[tuple[int, ...], ...], log: list, barrier=None, model=None) -> None:
        self.name, self._answers, self._barrier, self.model = name, answers, barrier, model
        self.context: list[int] = []
        log.append(self)

    def extend(self, token_ids) -> None:
        self.context.extend(token_ids)

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        if self._barrier is not None:
            self._barrier.wait(timeout=5)  # raises BrokenBarrierError unless both decoders run at once
        return tuple(Candidate(self.name, a[:max_tokens], rank=r) for r, a in enumerate(self._answers[:max_candidates]))


class Models:
    def __init__(self) -> None:
        self.attached: tuple[str, object] | None = None
        self.max_context: int | None = None  # the primary's context length, when it described itself

    def current_model(self):
        return self.attached

    def vocab_size(self) -> int | None:
        return VOCAB

    def max_context_length(self) -> int | None:
        return self.max_context


def make_pool(
    answers: dict[str, tuple[tuple[int, ...], ...]],
    log: list,
    model_based: tuple[str, ...] = (),
    models: Models | None = None,
    barrier=None,
    suffix_index=None,
    **config,
) -> DraftPool:
    free, based = DecoderRegistry(), DecoderRegistry()
    for name, a in answers.items():
        registry = based if name in model_based else free
        registry.register(name, functools.partial(Scripted, name, a, log, barrier))
    names = tuple(answers)
    config = PoolConfig(**{"strategies": names, "default_strategies": names[:1], **config})
    return DraftPool(config, free, based, models or Models(), suffix_index=suffix_index)


def test_candidates_follow_the_strategies_list_and_merge_into_one_tree():
    log: list[Scripted] = []
    pool = make_pool({"p": ((A, B, C), (A, D)), "s": ((A, B), (E,))}, log)
    proposal = pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2, 3), strategies=("p", "s", "p"), draft_length=3))
    tree = proposal.tree
    # candidates p#0 [a b c], s#0 [a b], p#1 [a d] -> nodes a b c d; bit i = strategies[i]
    assert tree.decoders == ("p", "s", "p")
    assert tree.token_ids == (A, B, C, D)
    assert tree.parents == (ROOT, 0, 1, 0)
    assert tree.node_sources == (0b111, 0b011, 0b001, 0b100)
    assert [(s.name, s.num_proposed) for s in proposal.decoder_steps] == [("p", 4), ("s", 2)]
    assert all(s.time_ms >= 0 for s in proposal.decoder_steps) and proposal.time_ms > 0
    assert [d.context for d in log] == [[1, 2, 3], [1, 2, 3]]  # one decoder per strategy, prompt once


def test_degree_draft_length_and_node_budget_cut_the_tree():
    pool = make_pool({"p": ((A, B, C), (D, E)), "s": ((E,),)}, [])
    args = ProposeArgs("r", prompt_token_ids=(1,), strategies=("p", "p", "s"))
    # degree 2: the first two entries only; draft_length 2 cuts each chain
    tree = pool.propose(dataclasses.replace(args, speculative_degree=2, draft_length=2)).tree
    assert tree.decoders == ("p", "p") and tree.token_ids == (A, B, D, E)
    # max_nodes 4: candidate 0 whole (a b c), then depth 1 of the others: d; e (under the root) is cut
    tree = pool.propose(dataclasses.replace(args, max_nodes=4, new_token_ids=(2,))).tree
    assert tree.token_ids == (A, B, C, D) and tree.parents == (ROOT, 0, 1, ROOT)


def test_decoders_see_every_committed_token_once_and_late_decoders_catch_up():
    log: list[Scripted] = []
    pool = make_pool({"p": ((A,),), "s": ((B,),)}, log)
    pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2), strategies=("p",)))
    pool.propose(ProposeArgs("r", new_token_ids=(3, 4), strategies=("p",)))
    pool.propose(ProposeArgs("r", new_token_ids=(5,), strategies=("s", "p")))  # s joins at step 3
    pool.propose(ProposeArgs("r", new_token_ids=(6,), strategies=("p",)))  # s sits out: still fed
    assert [(d.name, d.context) for d in log] == [("p", [1, 2, 3, 4, 5, 6]), ("s", [1, 2, 3, 4, 5, 6])]
    # A prompt on a known id re-opens the request (a recovering gateway): fresh decoders.
    pool.propose(ProposeArgs("r", prompt_token_ids=(7, 8), strategies=("p",)))
    assert log[-1].context == [7, 8] and len(log) == 3


def test_model_based_decoders_of_one_step_run_in_parallel():
    models = Models()
    models.attached = ("primary-1", "model-1")
    barrier = threading.Barrier(2)
    pool = make_pool({"m1": ((A,),), "m2": ((B,),)}, [], model_based=("m1", "m2"), models=models, barrier=barrier)
    tree = pool.propose(ProposeArgs("r", prompt_token_ids=(1,), strategies=("m1", "m2"))).tree
    assert tree.token_ids == (A, B)


def test_model_based_decoders_wait_for_weights_and_follow_a_new_instance():
    log: list[Scripted] = []
    models = Models()
    pool = make_pool({"p": ((A,),), "m": ((B, C),)}, log, model_based=("m",), models=models)
    proposal = pool.propose(ProposeArgs("r", prompt_token_ids=(1,), strategies=("m", "p")))
    # not attached: an empty candidate keeps bit 0 for m
    assert proposal.tree.decoders == ("m", "p") and proposal.tree.token_ids == (A,)
    assert proposal.tree.node_sources == (0b10,)
    assert [(s.name, s.num_proposed) for s in proposal.decoder_steps] == [("m", 0), ("p", 1)]
    models.attached = ("primary-1", "model-1")
    assert pool.propose(ProposeArgs("r", new_token_ids=(2,), strategies=("m", "p"))).tree.token_ids == (B, C, A)
    assert log[-1].model == "model-1" and log[-1].context == [1, 2]
    models.attached = ("primary-2", "model-2")  # the primary restarted
    pool.propose(ProposeArgs("r", new_token_ids=(3,), strategies=("m",)))
    assert log[-1].model == "model-2" and log[-1].context == [1, 2, 3]
    assert [d.name for d in log] == ["p", "m", "m"]


def test_a_rank_zero_model_free_candidate_returns_its_continuation_past_the_draft():
    """continuation_length: a model-free decoder asked for one answer runs that many tokens past the
    draft; they come back after the node where its draft ends, best candidate first, one per node.
    Not from a decoder ranking several answers, or a draft the budget cut."""
    log: list[Scripted] = []
    answers = {"p": ((A, B, C, D, E),), "s": ((A, B, E, D),), "q": ((C, D, E),)}
    pool = make_pool(answers, log)
    args = ProposeArgs("r", prompt_token_ids=(1,), strategies=("p", "s", "q"), draft_length=2, continuation_length=3)
    proposal = pool.propose(args)
    assert proposal.tree.token_ids == (A, B, C, D)  # drafts of 2: p, s share a b; q adds c d
    assert [(c.leaf, c.token_ids, c.decoder) for c in proposal.continuations] == [(1, (C, D, E), "p"), (3, (E,), "q")]
    # none without continuation_length; a decoder asked for two answers gives none
    assert pool.propose(dataclasses.replace(args, prompt_token_ids=(), continuation_length=0)).continuations == ()
    ranked = pool.propose(dataclasses.replace(args, prompt_token_ids=(), strategies=("p", "p")))
    assert ranked.continuations == ()
    # a candidate the node budget cut has no leaf to continue from
    cut = pool.propose(dataclasses.replace(args, prompt_token_ids=(), strategies=("q", "p"), max_nodes=3))
    assert cut.tree.token_ids == (C, D, A) and [c.decoder for c in cut.continuations] == ["q"]
    with pytest.raises(InvalidArgument) as e:
        pool.propose(dataclasses.replace(args, continuation_length=65))
    assert e.value.field == "continuation_length"


@pytest.mark.parametrize(
    "args, field",
    [
        (ProposeArgs("", prompt_token_ids=(1,)), "request_id"),
        (ProposeArgs("r", prompt_token_ids=(1,), strategies=("p", "nope")), "strategies"),
        (ProposeArgs("r", prompt_token_ids=(1,), strategies=("p",), speculative_degree=2), "speculative_degree"),
        (ProposeArgs("r", prompt_token_ids=(1,), draft_length=65), "draft_length"),
        (ProposeArgs("r", prompt_token_ids=(1,), max_nodes=257), "max_nodes"),
        (ProposeArgs("r", prompt_token_ids=(1, VOCAB)), "prompt_token_ids"),
        (ProposeArgs("r", prompt_token_ids=(1,), new_token_ids=(-1,)), "new_token_ids"),
        # an opening call has no previous proposal whose lookahead rows the argmaxes could be of
        (ProposeArgs("r", prompt_token_ids=(1,), lookahead_argmax_token_ids=(A,)), "lookahead_argmax_token_ids"),
    ],
)
def test_bad_arguments_name_their_field(args, field):
    pool = make_pool({"p": ((A,),)}, [])
    with pytest.raises(InvalidArgument) as e:
        pool.propose(args)
    assert e.value.field == field
    assert pool.num_requests == 0


def test_unknown_requests_limits_and_idle_expiry(monkeypatch):
    clock = [1000.0]  # the pool's clock, moved by hand: expiry follows the ttl, not the test's pace
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(pool_module, "time", fake_time)
    pool = make_pool({"p": ((A,),)}, [], max_requests=1, request_ttl_s=60.0)
    with pytest.raises(NotFound):
        pool.propose(ProposeArgs("r", new_token_ids=(1,)))
    pool.propose(ProposeArgs("r", prompt_token_ids=(1,)))
    clock[0] += 59.0  # within its ttl: "r" still holds the one place
    with pytest.raises(ResourceExhausted):
        pool.propose(ProposeArgs("other", prompt_token_ids=(1,)))
    clock[0] += 2.0  # "r" idles past its ttl: dropped when the next request arrives
    pool.propose(ProposeArgs("other", prompt_token_ids=(1,)))
    with pytest.raises(NotFound):
        pool.propose(ProposeArgs("r", new_token_ids=(2,)))
    assert pool.release("r", is_finished=False) == 0  # dropped already: releasing it again is a no-op


def test_contexts_longer_than_the_primary_s_are_refused():
    """A context, prediction or released output past the primary's context length is refused naming
    the field. Before, only max_context_tokens (2^20 tokens) bounded them: a caller could have every
    request's decoders index a million tokens the primary would never serve."""
    models = Models()
    models.max_context = 8
    pool = make_pool({"p": ((A,),)}, [], models=models)
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", prompt_token_ids=tuple(range(9))))
    assert e.value.field == "prompt_token_ids" and pool.num_requests == 0
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", prompt_token_ids=(1,), prediction_token_ids=tuple(range(9))))
    assert e.value.field == "prediction_token_ids" and pool.num_requests == 0
    pool.propose(ProposeArgs("r", prompt_token_ids=tuple(range(7))))
    pool.propose(ProposeArgs("r", new_token_ids=(7,)))  # the whole context: it fits
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", new_token_ids=(8,)))
    assert e.value.field == "new_token_ids"
    with pytest.raises(InvalidArgument) as e:
        pool.release("r", is_finished=True, new_token_ids=tuple(range(9)))
    assert e.value.field == "new_token_ids" and pool.num_requests == 1
    models.max_context = None  # not known (the primary not reached yet): the pool's own bound
    pool.propose(ProposeArgs("r", new_token_ids=(8,)))


def test_idle_requests_expire_on_the_timer_without_another_propose(monkeypatch):
    """The service's expiry thread drops requests idle past request_ttl_s. Before, only a Propose
    dropped them: a pool that heard no more Proposes (its gateways gone) kept their state for ever."""
    clock = [1000.0]  # the pool's clock, moved by hand: expiry follows the ttl, not the test's pace
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(pool_module, "time", fake_time)
    pool = make_pool({"p": ((A,),)}, [], request_ttl_s=60.0)
    pool.propose(ProposeArgs("idle", prompt_token_ids=(1,)))
    clock[0] += 30.0
    pool.propose(ProposeArgs("recent", prompt_token_ids=(1,)))
    clock[0] += 31.0  # "idle" idles past its ttl, "recent" does not
    stop = threading.Event()
    expiry = threading.Thread(target=expire_idle_requests, args=(pool, stop), kwargs={"check_s": 0.01})
    expiry.start()
    try:
        give_up = time.monotonic() + 30
        while pool.num_requests > 1 and time.monotonic() < give_up:
            time.sleep(0.01)
    finally:
        stop.set()
        expiry.join()
    assert pool.num_requests == 1
    with pytest.raises(NotFound):
        pool.propose(ProposeArgs("idle", new_token_ids=(2,)))
    pool.propose(ProposeArgs("recent", new_token_ids=(2,)))


def suffix_index_pool() -> DraftPool:
    """A pool of the real suffix index's decoders over a small index of its own."""
    index = SuffixIndex(SuffixIndexConfig(max_total_tokens=256, ngram_sizes=(2,), max_match_len=8))
    return DraftPool(
        PoolConfig(strategies=("suffix_index",), default_strategies=("suffix_index",)),
        model_free_registry(suffix_index=index),
        DecoderRegistry(),
        Models(),
        suffix_index=index,
    )


def test_finished_output_joins_the_suffix_index_for_later_requests():
    pool = suffix_index_pool()
    pool.propose(ProposeArgs("first", prompt_token_ids=(1, 2)))
    pool.propose(ProposeArgs("first", new_token_ids=(20, 21, 22, 23, 24)))
    assert pool.release("first", is_finished=True) == 5  # the output, not the prompt
    assert pool.release("first", is_finished=True) == 0  # idempotent: released already, nothing indexed twice
    assert pool.release("never-proposed", is_finished=True) == 0  # e.g. speculation off: nothing to release
    pool.propose(ProposeArgs("cancelled", prompt_token_ids=(3,), new_token_ids=(30, 31, 32)))
    assert pool.release("cancelled", is_finished=False) == 0  # an unfinished output is not indexed
    proposal = pool.propose(ProposeArgs("second", prompt_token_ids=(9, 20, 21), draft_length=3))
    assert proposal.tree.token_ids == (22, 23, 24)
    assert pool.propose(ProposeArgs("third", prompt_token_ids=(9, 30, 31))).tree.token_ids == ()


def test_a_finished_output_joins_the_index_with_the_tokens_committed_after_its_last_propose():
    """A request's last steps are often the primary's own: the Release brings the output's tokens
    the pool has not seen, and the whole output is indexed; ids outside the vocabulary are refused."""
    pool = suffix_index_pool()
    pool.propose(ProposeArgs("first", prompt_token_ids=(1, 2)))
    pool.propose(ProposeArgs("first", new_token_ids=(20, 21)))
    assert pool.release("first", is_finished=True, new_token_ids=(22, 23, 24)) == 5
    proposal = pool.propose(ProposeArgs("second", prompt_token_ids=(9, 21, 22), draft_length=2))
    assert proposal.tree.token_ids == (23, 24)  # drafted from the part no Propose carried
    pool.propose(ProposeArgs("bad", prompt_token_ids=(1,), new_token_ids=(40, 41)))
    with pytest.raises(InvalidArgument, match="new_token_ids"):
        pool.release("bad", is_finished=True, new_token_ids=(-1,))
    assert pool.release("bad", is_finished=True) == 2  # refused before anything was dropped


def test_a_finished_output_joins_its_tenant_s_suffix_index_only():
    """With API keys the ids behind the gateway are tenant/id: a later request of the same tenant
    drafts from an earlier one's output, another tenant's does not."""
    pool = suffix_index_pool()
    pool.propose(ProposeArgs("a/first", prompt_token_ids=(1, 2)))
    pool.propose(ProposeArgs("a/first", new_token_ids=(20, 21, 22, 23, 24)))
    assert pool.release("a/first", is_finished=True) == 5
    same = pool.propose(ProposeArgs("a/second", prompt_token_ids=(9, 20, 21), draft_length=3))
    other = pool.propose(ProposeArgs("b/second", prompt_token_ids=(9, 20, 21), draft_length=3))
    assert same.tree.token_ids == (22, 23, 24) and other.tree.token_ids == ()


def test_a_slow_schema_holds_neither_other_requests_nor_its_own_first_propose():
    """A new request's first compile (milliseconds; seconds for some schemas) must not stall other
    requests' calls, nor hold its own Propose past OPEN_GRAMMAR_WAIT_S, which the gateway would take
    for a hung pool: the request drafts without its grammar until a later Propose finds the compile
    done (here a failure, which leaves the request drafting without it)."""
    compiling, release = threading.Event(), threading.Event()
    compiled: Future = Future()

    class SlowGrammars:  # one compile per format, shared by every caller (as specdec.grammar.compiling's)
        def start(self, response_format):
            if not compiling.is_set():
                compiling.set()
                threading.Thread(target=run, daemon=True).start()
            return compiled

    def run() -> None:
        release.wait(10)
        compiled.set_exception(InvalidArgument("response_format.json_schema", "not a schema this test takes"))

    pool = make_pool({"p": ((A, B),)}, [])
    pool._grammars = SlowGrammars()
    pool.propose(ProposeArgs("other", prompt_token_ids=(1, 2)))
    try:
        schema = ResponseFormat("json_schema", "{}")
        pool.prepare_grammar(schema)  # returns while the compile runs on
        opened = pool.propose(ProposeArgs("json", prompt_token_ids=(1,), response_format=schema))
        assert compiling.is_set() and not compiled.done()  # neither call waited for the compile
        assert opened.tree.token_ids == (A, B)  # drafts meanwhile, unfiltered (the gateway masks them)
        assert pool.propose(ProposeArgs("other", new_token_ids=(3,))).tree.token_ids == (A, B)
        assert pool.propose(ProposeArgs("json", new_token_ids=(4,))).tree.token_ids == (A, B)  # still compiling
    finally:
        release.set()
    assert compiled.exception(timeout=10) is not None
    assert pool.propose(ProposeArgs("json", new_token_ids=(5,))).tree.token_ids == (A, B)  # goes on without it
    assert pool._requests["json"].response_format is None and pool._requests["json"].compiling is None


def test_a_request_whose_compile_is_refused_drafts_without_its_grammar():
    """The pool's compiles are full (GrammarSettings.max_pending_compiles): the request opens and
    drafts, unfiltered (the gateway masks them), with no grammar-based decoders; nothing fails."""

    class FullGrammars:
        def start(self, response_format):
            raise ResourceExhausted("response_format.json_schema", "cannot compile now")

    pool = make_pool({"p": ((A, B),)}, [])
    pool._grammars = FullGrammars()
    schema = ResponseFormat("json_schema", "{}")
    with pytest.raises(ResourceExhausted):  # PrepareGrammar says so (the gateway ignores it)
        pool.prepare_grammar(schema)
    opened = pool.propose(ProposeArgs("json", prompt_token_ids=(1,), response_format=schema))
    assert opened.tree.token_ids == (A, B)
    assert pool._requests["json"].response_format is None and pool._requests["json"].compiling is None


class FeatureReader(Scripted):
    """A Scripted decoder that also reads the primary's features (FeatureConsumer), logging each
    extend and observe_features in order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple] = []

    def extend(self, token_ids) -> None:
        super().extend(token_ids)
        self.events.append(("extend", tuple(token_ids)))

    def observe_features(self, position: int, features) -> None:
        self.events.append(("features", position, features.copy()))


def make_feature_pool(log: list) -> DraftPool:
    free = DecoderRegistry()
    free.register("p", functools.partial(Scripted, "p", ((A,),), log))
    free.register("f", functools.partial(FeatureReader, "f", ((B,),), log))
    return DraftPool(PoolConfig(strategies=("p", "f"), default_strategies=("p",)), free, DecoderRegistry(), Models())


def test_feature_readers_get_the_features_after_the_committed_tokens_they_predict():
    log: list = []
    pool = make_feature_pool(log)
    prompt = (1, 2, 3, 4, 5)
    prefill_row = np.full((1, 4), 0.5, dtype=np.float32)  # predicts the last prompt token, position 4
    pool.propose(
        ProposeArgs("r", prompt_token_ids=prompt, strategies=("p", "f"), features=prefill_row, feature_position=4)
    )
    reader = next(d for d in log if isinstance(d, FeatureConsumer))
    assert not any(isinstance(d, FeatureConsumer) for d in log if d is not reader)
    assert reader.events[0] == ("extend", prompt)  # created in the call: caught up first
    assert reader.events[1][:2] == ("features", 4) and np.array_equal(reader.events[1][2], prefill_row)
    # A step accepted 2 drafts + a bonus (positions 5-7): 3 rows, after the tokens.
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    pool.propose(ProposeArgs("r", new_token_ids=(6, 7, 8), strategies=("p",), features=rows, feature_position=5))
    assert reader.events[2] == ("extend", (6, 7, 8))  # not proposing this step, still hears both
    assert reader.events[3][:2] == ("features", 5) and np.array_equal(reader.events[3][2], rows)
    pool.propose(ProposeArgs("r", new_token_ids=(9,), strategies=("f",)))  # no features: a gap
    assert reader.events[4:] == [("extend", (9,))]


@pytest.mark.parametrize(
    "position, rows, field",
    [
        (0, 1, "feature_position"),  # nothing predicts the first token
        (7, 2, "feature_position"),  # position 8 is not committed (context: 8 tokens after the call)
        (5, 0, "features"),
    ],
)
def test_features_of_uncommitted_tokens_or_bad_rows_are_refused_and_change_nothing(position, rows, field):
    log: list = []
    pool = make_feature_pool(log)
    pool.propose(ProposeArgs("r", prompt_token_ids=(1, 2, 3, 4, 5), strategies=("f",)))
    features = np.zeros((rows, 4), dtype=np.float32)
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", new_token_ids=(6, 7, 8), features=features, feature_position=position))
    assert e.value.field == field
    assert log[-1].context == [1, 2, 3, 4, 5]  # the refused call's tokens were not taken
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", new_token_ids=(6,), features=features.astype(np.float16), feature_position=5))
    assert e.value.field == "features"
