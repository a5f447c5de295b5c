"""Grammar states for Decode runs under a response format.

A greedy request without a grammar decodes runs of tokens in one Decode (DecodeRequest.max_tokens):
the primary steps it itself, beside the other requests, and the round trip to the gateway is paid
once a run. Under a grammar each token needs the mask of the state after the one before, which the
gateway holds; so a constrained request used to pay a round trip per token, and under load (an
engine step of 30 rows takes ~100 ms on a 2-core CPU) each trip costs it about a step. With
DecodeRequest.response_format the primary masks every token of the call by its own state of the
request's grammar instead, exactly as the gateway's one-token Decodes would (same grammar engine,
same compiled grammar, same committed output), so the output is unchanged token for token.

The state of a request follows its committed output (the engine's token ids after the prompt):
before each token the state accepts whatever was committed since it last looked (the previous
token of the run, or a whole step of another kind: a verify's accepted tokens, forced tokens), so it
stays in step with any mix of calls. When the output is not a continuation of what it accepted (a
request replaced under the same id, another response format) it starts over from the output.

Compiles run on worker threads (specdec.grammar.compiling.Grammars: cached, one compile per schema at
a time, 8-16 ms a new schema of the json prompts on a 2-vCPU EPYC); a Prefill that names the request's
response format begins its compile (prepare), so the request's first run finds it compiled instead of
compiling on its path, and a run waits for a compile under way at most until its deadline. Only
accepting tokens and filling masks run on the engine thread, a few tens of microseconds a token.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable

from specdec.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from specdec.grammar import CompiledGrammar, GrammarCache, GrammarState, ResponseFormat
from specdec.grammar.compiling import Grammars, GrammarSettings

# A run waits for its schema's compile until its call's deadline only: the gateway has compiled the
# schema within its own bound (--max_grammar_compile_s) before the request began.
RUN_COMPILE_SETTINGS = GrammarSettings(max_compile_s=threading.TIMEOUT_MAX)
# States kept at most: one per active request using a grammar run, dropped at Release and expiry;
# the bound only guards against callers that never release (least recently used dropped first).
MAX_STATES = 4096


@dataclasses.dataclass(slots=True)
class _Entry:
    response_format: ResponseFormat
    state: GrammarState
    token_ids: list[int]  # the output the state accepted, in order


class RunGrammars:
    """Thread-safe: compiles on any thread, states on the engine thread, drops on any thread."""

    def __init__(self, make_cache: Callable[[], GrammarCache], max_states: int = MAX_STATES) -> None:
        """`make_cache` builds the grammar cache (its tokenizer tables take ~1 s): on first use or `warm`."""
        self._make_cache, self.max_states = make_cache, max_states
        self._grammars: Grammars | None = None
        self._cache_lock = threading.Lock()
        self._lock = threading.Lock()
        self._states: collections.OrderedDict[str, _Entry] = collections.OrderedDict()

    def warm(self) -> None:
        """Build the grammar cache now (a start-up thread), so the first constrained run does not wait."""
        self._grammar_cache()

    def _grammar_cache(self) -> Grammars:
        with self._cache_lock:
            if self._grammars is None:
                self._grammars = Grammars(self._make_cache(), RUN_COMPILE_SETTINGS)
            return self._grammars

    def close(self) -> None:
        """Stop the compile threads (a compile under way is abandoned)."""
        with self._cache_lock:
            if self._grammars is not None:
                self._grammars.close()

    @property
    def num_states(self) -> int:
        return len(self._states)

    def prepare(self, response_format: ResponseFormat) -> None:
        """Begin compiling `response_format` (a request's, at its Prefill), unless cached or under way;
        a schema that does not compile is reported by the run that sends it (compile), and so is one
        refused while the compiles are full (GrammarSettings.max_pending_compiles)."""
        with contextlib.suppress(ResourceExhausted):
            self._grammar_cache().start(response_format)

    def compile(self, response_format: ResponseFormat, deadline: float | None = None) -> CompiledGrammar:
        """The compiled grammar: InvalidArgument naming response_format.json_schema when it cannot be,
        ResourceExhausted when its compile outlasts `deadline` (time.monotonic(); None: no bound)."""
        return self._grammar_cache().compile(response_format, deadline)

    def state(self, request_id: str, grammar: CompiledGrammar, output: list[int]) -> GrammarState:
        """The request's grammar state past `output` (its committed output tokens), kept between calls."""
        with self._lock:
            entry = self._states.get(request_id)
            if entry is not None:
                self._states.move_to_end(request_id)
        n = 0 if entry is None else len(entry.token_ids)
        if entry is None or entry.response_format != grammar.response_format or output[:n] != entry.token_ids:
            entry = _Entry(grammar.response_format, grammar.new_state(), [])
            with self._lock:
                self._states[request_id] = entry
                while len(self._states) > self.max_states:
                    self._states.popitem(last=False)
        new = output[len(entry.token_ids) :]
        if new:
            if not entry.state.accept_tokens(new):
                self.drop(request_id)
                raise FailedPrecondition("response_format", "the request's committed output does not follow it")
            entry.token_ids.extend(new)
        return entry.state

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._states.pop(request_id, None)


def check_run_grammar(response_format: ResponseFormat | None, has_allowed_tokens: bool) -> None:
    """A Decode's response_format with its other fields (InvalidArgument naming response_format)."""
    if response_format is None:
        return
    if has_allowed_tokens:
        raise InvalidArgument("response_format", "cannot come with allowed_tokens: it masks every token itself")
