"""The primary's grammar states for Decode runs: a state follows the request's committed output
across calls, starts over when the output is not its continuation, refuses an output off the
grammar, and is bounded and dropped with the request."""

from __future__ import annotations

import threading
import time

import pytest

from primary_svc.run_grammars import RunGrammars, check_run_grammar
from specdec.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from specdec.grammar import GrammarCache, ResponseFormat
from specdec.grammar.compiling import Grammars, GrammarSettings

SCHEMA = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'


@pytest.fixture
def grammars(grammar_cache) -> RunGrammars:
    return RunGrammars(lambda: grammar_cache)


def output_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def mask_after(grammar, output):
    state = grammar.new_state()
    assert state.accept_tokens(output)
    return state.allowed_mask().to_bytes()


def test_a_state_follows_the_output_across_calls(grammars, tokenizer):
    grammar = grammars.compile(ResponseFormat("json_schema", SCHEMA))
    output = output_of(tokenizer, '{"ok": true}')
    for n in range(len(output) + 1):  # one token more each call, as a run commits them
        state = grammars.state("r", grammar, output[:n])
        assert state.num_tokens == n and state.allowed_mask().to_bytes() == mask_after(grammar, output[:n])
    assert grammars.num_states == 1


def test_an_output_that_is_not_its_continuation_starts_the_state_over(grammars, tokenizer):
    grammar = grammars.compile(ResponseFormat("json_schema", SCHEMA))
    yes, no = output_of(tokenizer, '{"ok": true'), output_of(tokenizer, '{"ok": false')
    grammars.state("r", grammar, yes)
    state = grammars.state("r", grammar, no)  # the same id, another output (a replaced request)
    assert state.num_tokens == len(no) and state.allowed_mask().to_bytes() == mask_after(grammar, no)
    other = grammars.compile(ResponseFormat("json_object", None))
    assert grammars.state("r", other, no).allowed_mask().to_bytes() == mask_after(other, no)  # another format


def test_an_output_off_the_grammar_is_refused_and_forgotten(grammars, tokenizer):
    grammar = grammars.compile(ResponseFormat("json_schema", SCHEMA))
    with pytest.raises(FailedPrecondition, match="response_format"):
        grammars.state("r", grammar, output_of(tokenizer, "hello"))
    assert grammars.num_states == 0


def test_states_are_bounded_and_dropped(grammar_cache):
    grammars = RunGrammars(lambda: grammar_cache, max_states=2)
    grammar = grammars.compile(ResponseFormat("json_object", None))
    for rid in "abc":
        grammars.state(rid, grammar, [])
    assert grammars.num_states == 2  # the least recently used one went
    grammars.drop("c")
    grammars.drop("missing")
    assert grammars.num_states == 1


def test_the_grammar_tables_are_built_once_on_first_use(grammar_cache):
    built = []
    grammars = RunGrammars(lambda: built.append(1) or grammar_cache)
    assert not built
    grammars.warm()
    grammars.compile(ResponseFormat("json_object", None))
    assert built == [1]


def test_a_run_grammar_needs_no_mask_of_its_own():
    response_format = ResponseFormat("json_object", None)
    check_run_grammar(None, True)  # no response format: nothing to check
    check_run_grammar(response_format, False)
    with pytest.raises(InvalidArgument, match="allowed_tokens"):
        check_run_grammar(response_format, True)


def test_a_prepared_format_compiles_once_and_serves_the_run(grammar_cache):
    """prepare (a Prefill's) begins the compile; the run's compile waits for that one instead of
    compiling again, and a bad schema is reported by the run, not by prepare."""
    cache = GrammarCache(grammar_cache.tokenizer_info)  # its own counts
    grammars = RunGrammars(lambda: cache)
    response_format = ResponseFormat("json_schema", SCHEMA)
    grammars.prepare(response_format)
    grammar = grammars.compile(response_format, deadline=time.monotonic() + 30)
    grammars.prepare(response_format)  # cached now: nothing more compiles
    assert grammars.compile(response_format) is grammar and cache.num_misses == 1
    bad = ResponseFormat("json_schema", '{"type": "no such type"}')
    grammars.prepare(bad)
    with pytest.raises(InvalidArgument, match="json_schema"):
        grammars.compile(bad)
    grammars.close()


def test_a_run_waits_for_a_compile_until_its_deadline_only(grammar_cache):
    """Past the call's deadline a compile still under way is RESOURCE_EXHAUSTED naming the schema; it
    goes on and lands in the cache, so the request's next run finds it."""
    cache = GrammarCache(grammar_cache.tokenizer_info)
    grammars = RunGrammars(lambda: cache)
    grammars.warm()
    response_format = ResponseFormat("json_schema", SCHEMA)
    with pytest.raises(ResourceExhausted, match="json_schema"):
        grammars.compile(response_format, deadline=time.monotonic() - 1)  # no time left: not compiled yet
    assert grammars.compile(response_format, deadline=None).new_state() is not None  # no deadline: waits
    assert cache.num_misses == 1
    grammars.close()


def test_a_prepare_refused_while_the_compiles_are_full_is_left_to_the_run(grammar_cache, monkeypatch):
    """prepare is best effort: a refusal (GrammarSettings.max_pending_compiles) raises nothing there;
    the run's own compile asks again."""
    cache = GrammarCache(grammar_cache.tokenizer_info)
    grammars = RunGrammars(lambda: cache)
    monkeypatch.setattr(grammars, "_grammars", Grammars(cache, GrammarSettings(max_pending_compiles=1)))
    release = threading.Event()
    monkeypatch.setattr(
        cache, "compile", lambda response_format: release.wait(10) and grammar_cache.compile(response_format)
    )
    try:
        grammars.prepare(ResponseFormat("json_schema", '{"type": "string"}'))  # takes the one place
        response_format = ResponseFormat("json_schema", SCHEMA)
        grammars.prepare(response_format)  # refused, quietly
        with pytest.raises(ResourceExhausted, match="cannot compile now"):
            grammars.compile(response_format, deadline=time.monotonic() + 5)
    finally:
        release.set()
        grammars.close()
