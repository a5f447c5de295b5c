"""The pool with a response format: grammar-forced drafts merged with the others, and no proposed
token the grammar forbids (candidates are cut at the first one). Real tokenizer and grammar engine."""

from __future__ import annotations

import functools
import threading

import pytest

from draft_svc.pool import DraftPool, PoolConfig, within_grammar
from specdec.propose_args import ProposeArgs
from draft_svc.strategies.base import Candidate, DecoderRegistry
from draft_svc.strategies.grammar_forced import register_grammar_decoder
from specdec.errors import InvalidArgument
from specdec.grammar import GrammarCache, ResponseFormat
from tests.schemas import NAME_AGE_SCHEMA

PERSON = ResponseFormat("json_schema", NAME_AGE_SCHEMA)
PROMPT = (1, 9690, 198)


class Fixed:
    """Proposes the same continuation every step."""

    def __init__(self, token_ids: tuple[int, ...]) -> None:
        self.token_ids = token_ids

    def extend(self, token_ids) -> None:
        pass

    def propose(self, max_tokens: int, max_candidates: int = 1) -> tuple[Candidate, ...]:
        return (Candidate("lookup", self.token_ids[:max_tokens]),)


class Models:
    def current_model(self):
        return None

    def vocab_size(self) -> int:
        return 49152

    def max_context_length(self) -> int | None:
        return None


def make_pool(grammar_cache, lookup_ids: tuple[int, ...]) -> DraftPool:
    free, grammar_based = DecoderRegistry(), DecoderRegistry()
    free.register("lookup", functools.partial(Fixed, lookup_ids))
    register_grammar_decoder(grammar_based, grammar_cache)
    config = PoolConfig(strategies=("grammar", "lookup"), default_strategies=("lookup",))
    return DraftPool(config, free, DecoderRegistry(), Models(), grammar_based=grammar_based, grammars=grammar_cache)


def test_within_grammar_cuts_at_the_first_forbidden_token(grammar_cache, tokenizer):
    state = grammar_cache.compile(PERSON).new_state()
    body = tokenizer.encode('{"name": "Bo", "age": 7')
    closing = tokenizer.encode("}")
    # E.g. ... 7 } } -> ... 7 }: the second brace closes nothing.
    cut = within_grammar(state, Candidate("lookup", tuple(body + closing + closing)))
    assert list(cut.token_ids) == body + closing
    assert state.num_tokens == 0  # unchanged
    assert within_grammar(state, Candidate("lookup", tuple(tokenizer.encode("hello")))).token_ids == ()


def test_grammar_drafts_merge_with_the_others_and_nothing_off_grammar_is_proposed(grammar_cache, tokenizer):
    forced = tokenizer.encode('{"name":')  # `{"name": "` less its last token (held back)
    off_grammar = tuple(tokenizer.encode("Sure! Here"))
    pool = make_pool(grammar_cache, off_grammar)
    proposal = pool.propose(
        ProposeArgs(
            "r", prompt_token_ids=PROMPT, strategies=("grammar", "lookup"), draft_length=8, response_format=PERSON
        )
    )
    assert list(proposal.tree.token_ids) == forced  # the lookup's text was cut to nothing
    assert {s.name: s.num_proposed for s in proposal.decoder_steps} == {"grammar": len(forced), "lookup": 0}
    # Next step: the primary wrote `{"name": "Al`; inside the string the grammar forces nothing, and a
    # lookup proposing `ice", "age": 3}` is kept whole.
    pool2 = make_pool(grammar_cache, tuple(tokenizer.encode('ice", "age": 3}')))
    pool2.propose(ProposeArgs("r", prompt_token_ids=PROMPT, strategies=("grammar",), response_format=PERSON))
    step = pool2.propose(
        ProposeArgs("r", new_token_ids=tuple(tokenizer.encode('{"name": "Al')), strategies=("grammar", "lookup"))
    )
    assert tokenizer.decode(step.tree.token_ids) == 'ice", "age": 3}'


def test_without_a_response_format_grammar_drafts_propose_nothing(grammar_cache, tokenizer):
    pool = make_pool(grammar_cache, tuple(tokenizer.encode("Sure")))
    proposal = pool.propose(ProposeArgs("r", prompt_token_ids=PROMPT, strategies=("grammar", "lookup")))
    assert tokenizer.decode(proposal.tree.token_ids) == "Sure"  # no grammar: no cut either


def test_a_bad_schema_is_refused_naming_the_field(grammar_cache):
    pool = make_pool(grammar_cache, ())
    with pytest.raises(InvalidArgument) as e:
        pool.propose(ProposeArgs("r", prompt_token_ids=PROMPT, response_format=ResponseFormat("json_schema", "{")))
    assert e.value.field == "response_format.json_schema"


def test_a_prepared_format_is_compiled_once_and_the_first_propose_finds_it(grammar_cache):
    """PrepareGrammar (beside the request's prefill) compiles the format; the request's first Propose
    and its grammar decoder then find it compiled."""
    cache = GrammarCache(grammar_cache.tokenizer_info)
    pool = make_pool(cache, ())
    pool.prepare_grammar(PERSON)
    pool._grammars.start(PERSON).result(timeout=10)  # a loaded machine may take past prepare's short wait
    assert (cache.num_misses, cache.num_cached) == (1, 1)
    pool.propose(ProposeArgs("r", prompt_token_ids=PROMPT, strategies=("grammar",), response_format=PERSON))
    assert cache.num_misses == 1 and cache.num_hits >= 1
    with pytest.raises(InvalidArgument) as e:
        pool.prepare_grammar(ResponseFormat("json_schema", '{"type": "object", "properties": 3}'))
    assert e.value.field == "response_format.json_schema"


def test_a_pool_without_grammars_refuses_to_prepare_one():
    config = PoolConfig(strategies=("lookup",), default_strategies=("lookup",))
    free = DecoderRegistry()
    free.register("lookup", functools.partial(Fixed, ()))
    pool = DraftPool(config, free, DecoderRegistry(), Models())
    with pytest.raises(InvalidArgument) as e:
        pool.prepare_grammar(PERSON)
    assert e.value.field == "response_format"


def test_a_request_opened_while_its_schema_compiles_gets_the_grammar_once_compiled(grammar_cache, tokenizer):
    """A compile longer than OPEN_GRAMMAR_WAIT_S: the opening Propose drafts without the grammar (the
    lookup's off-grammar text uncut, no grammar drafts); a later one finds it compiled and catches the
    grammar up on the output committed meanwhile."""
    release = threading.Event()

    class SlowCache(GrammarCache):
        def compile(self, response_format):
            release.wait(10)
            return super().compile(response_format)

    off_grammar = tuple(tokenizer.encode("Sure! Here"))
    pool = make_pool(SlowCache(grammar_cache.tokenizer_info), off_grammar)
    strategies = ("grammar", "lookup")
    try:
        first = pool.propose(
            ProposeArgs("r", prompt_token_ids=PROMPT, strategies=strategies, draft_length=8, response_format=PERSON)
        )
        assert first.tree.token_ids == off_grammar and pool._requests["r"].grammar is None
    finally:
        release.set()
    pool._requests["r"].compiling.result(timeout=10)
    written = tuple(tokenizer.encode('{"name": "Al'))
    pool.propose(ProposeArgs("r", new_token_ids=written, strategies=strategies, draft_length=8))
    request = pool._requests["r"]
    assert request.grammar is not None and request.grammar.num_tokens == len(written)
    # after `ice", ` the grammar forces the next key, and refuses the lookup's text
    step = pool.propose(ProposeArgs("r", new_token_ids=tuple(tokenizer.encode('ice", ')), strategies=strategies))
    assert tokenizer.decode(step.tree.token_ids) == '"age":'  # the grammar's key; the lookup's text cut
    assert {d.name: d.num_proposed for d in step.decoder_steps}["lookup"] == 0


def test_a_tenant_s_requests_draft_what_it_taught_the_pool_and_no_other_tenant_does(grammar_cache, tokenizer):
    """The pool's grammar decoders share the model's spellings among one tenant's requests (the
    tenant of `tenant/id`), never across tenants."""
    pool = make_pool(grammar_cache, ())
    written = tuple(t for piece in ["{", '"', "name", '":', ' "', "Al"] for t in tokenizer.encode(piece))
    opening = ProposeArgs("a/1", prompt_token_ids=PROMPT, strategies=("grammar",), response_format=PERSON)
    pool.propose(opening)
    pool.propose(ProposeArgs("a/1", new_token_ids=written, strategies=("grammar",)))

    def first_draft(request_id: str) -> list[str]:
        args = ProposeArgs(request_id, prompt_token_ids=PROMPT, strategies=("grammar",), response_format=PERSON)
        return [tokenizer.decode([t]) for t in pool.propose(args).tree.token_ids]

    assert first_draft("a/2") == ["{", '"', "name", '":', ' "']  # the model's own opening, learned
    assert first_draft("b/1") == ['{"', "name", '":']  # canonical: tenant b learned nothing from a
