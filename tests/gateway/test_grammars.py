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

    def compile(self, response_format: ResponseFormat) -> str:
        self.num_compiles += 1
        if response_format.schema_text == "bad":
            raise InvalidArgument("response_format.json_schema", "is not valid JSON")
        self.release.wait(timeout=10)
        return f"compiled {response_format.kind}"


def test_a_slow_compile_is_refused_then_served_once_finished():
    cache = SlowCache()
    grammars = Grammars(cache, GrammarSettings(max_compile_s=0.05))
    with pytest.raises(ResourceExhausted) as e:
        grammars.compile(SLOW)
    assert e.value.field == "response_format.json_schema" and "0.1 s" in str(e.value)
    with pytest.raises(ResourceExhausted):  # a second request waits on the same compile
        grammars.compile(SLOW)
    cache.release.set()
    assert grammars.compile(SLOW) == "compiled json_schema"  # (a real cache would answer from its LRU)
    assert cache.num_compiles <= 2
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
