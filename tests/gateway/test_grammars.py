"""Compiling response formats within a deadline: a slow compile gets RESOURCE_EXHAUSTED naming the
schema field, finishes in the background and serves the next request; one compile per format."""

from __future__ import annotations

import threading
import time

import pytest

from specdec.grammar.compiling import Grammars, GrammarSettings
from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.grammar import ResponseFormat

SLOW = ResponseFormat("json_schema", '{"type": "object"}')


class SlowCache:
    """Stands in for GrammarCache: compiles take until `release` is set (no grammar engine needed)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_compiles = 0
        self.done: dict[ResponseFormat, str] = {}

    def cached(self, response_format: ResponseFormat) -> str | None:
        return self.done.get(response_format)

    def compile(self, response_format: ResponseFormat) -> str:
        self.num_compiles += 1
        if response_format.schema_text == "bad":
            raise InvalidArgument("response_format.json_schema", "is not valid JSON")
        self.release.wait(timeout=10)
        self.done[response_format] = f"compiled {response_format.kind} {response_format.schema_text}"
        return self.done[response_format]


def test_a_slow_compile_is_refused_then_served_once_finished():
    cache = SlowCache()
    grammars = Grammars(cache, GrammarSettings(max_compile_s=0.05))
    with pytest.raises(ResourceExhausted) as e:
        grammars.compile(SLOW)
    assert e.value.field == "response_format.json_schema" and "0.1 s" in str(e.value)
    with pytest.raises(ResourceExhausted):  # a second request waits on the same compile
        grammars.compile(SLOW)
    cache.release.set()
    assert grammars.compile(SLOW) == f"compiled json_schema {SLOW.schema_text}"
    assert cache.num_compiles == 1  # the finished compile is cached: the third request finds it there
    grammars.close()


def test_the_calls_deadline_bounds_the_wait_and_errors_pass_through():
    cache = SlowCache()
    grammars = Grammars(cache, GrammarSettings(max_compile_s=30))
    started = time.monotonic()
    with pytest.raises(ResourceExhausted):
        grammars.compile(SLOW, deadline=time.monotonic() + 0.05)
    assert time.monotonic() - started < 5
    with pytest.raises(InvalidArgument):
        grammars.compile(ResponseFormat("json_schema", "bad"))
    cache.release.set()
    grammars.close()


def test_a_flood_of_new_schemas_is_refused_at_once_while_a_cached_one_is_served():
    """At most max_pending_compiles schemas compile or wait for a thread: another new one is refused
    at once (not after max_compile_s), a schema under way is joined, and a cached one never queues."""
    cache = SlowCache()
    grammars = Grammars(cache, GrammarSettings(max_compile_s=30, num_compile_threads=1, max_pending_compiles=2))
    cache.done[SLOW] = "compiled before"
    first, second, third = (ResponseFormat("json_schema", f'{{"maxLength": {n}}}') for n in (1, 2, 3))
    compiling = [grammars.start(first), grammars.start(second)]  # one compiles, one waits for the thread
    started = time.monotonic()
    with pytest.raises(ResourceExhausted) as e:
        grammars.compile(third)
    assert time.monotonic() - started < 5
    assert e.value.field == "response_format.json_schema"
    assert "2 other schemas are compiling or queued (at most 2)" in str(e.value)
    assert grammars.start(second) is compiling[1]  # under way: joined, not refused
    assert grammars.compile(SLOW) == "compiled before"
    cache.release.set()
    assert [f.result(timeout=10) for f in compiling] == [
        f"compiled json_schema {f.schema_text}" for f in (first, second)
    ]
    # room again, once the finished compiles have left the count (right after their results: retried)
    deadline = time.monotonic() + 10
    while True:
        try:
            assert grammars.compile(third) == f"compiled json_schema {third.schema_text}"
            break
        except ResourceExhausted:
            assert time.monotonic() < deadline, "the finished compiles still count"
            time.sleep(0.01)
    grammars.close()


def test_max_pending_compiles_must_be_positive():
    with pytest.raises(ValueError, match="max_pending_compiles"):
        GrammarSettings(max_pending_compiles=0)
