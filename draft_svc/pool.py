"""The draft pool: per-request draft decoders, run in parallel, merged into one token tree.

Per request the pool keeps the committed context and one decoder per strategy the request has
used; a decoder is created on first use and catches up on the whole context then, so a request
may change strategies between steps (the controller does) and model-based decoders join once
the primary's weights are attached.

Candidate list of a step (bit order of the tree's node_sources): `strategies` best first, the
r-th occurrence of a name meaning that decoder's rank r, truncated to `speculative_degree`:

    # E.g. strategies [prompt_lookup, suffix_index, prompt_lookup], degree 0 (all):
    #   prompt_lookup runs once with max_candidates=2, suffix_index once with 1;
    #   candidates = [prompt_lookup#0, suffix_index#0, prompt_lookup#1]

A decoder that has nothing (no match, weights not attached) contributes an empty candidate,
so bit i always means strategies[i]. Model-based decoders run in parallel in a thread pool
(torch releases the GIL); the model-free ones take microseconds and run on the calling thread.

A request opened with a response_format also gets the grammar-based decoders (grammar-forced
text), and the pool follows the output with its own grammar state: every candidate is cut before
its first token the grammar forbids, so no draft leaves the grammar (the primary and validator
mask the rest). The format compiles when the gateway asks (prepare_grammar, beside the request's
prefill) or at the request's first Propose, whichever comes first, once per format at a time. A
first Propose waits for that compile at most OPEN_GRAMMAR_WAIT_S: a schema that takes longer (up to
seconds) must not hold the call past the gateway's deadline for the pool, which would count as a
hung pool for every request. The request then drafts without its grammar until a later Propose finds
the compile done and catches the grammar up on the output so far.

A decoder that reads the primary's features (FeatureConsumer, draft_svc/strategies/base.py) gets
those a Propose carries (the latest verify's rows of committed tokens, or the prefill's last row)
after it heard the committed tokens, and one created during the call right after its catch-up.

A request opened with a prediction (its predicted output's tokens) also gets the prediction-based
decoders (draft_svc/strategies/prediction.py), created with those tokens; requests without one get
no candidate from them.

A lookahead decoder (draft_svc/strategies/lookahead.py) also has the primary run rows of its own
beside the tree: the pool returns them with the proposal (Proposal.lookahead) and hands the
primary's argmaxes there, which the next Propose carries, back to the decoder that asked, before
it hears the committed tokens.

Release(is_finished) adds the request's output (committed tokens after the prompt) to the
shared suffix index, so later requests can draft from it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import numpy as np
import structlog

from draft_svc.strategies.base import Candidate, DecoderRegistry, DraftDecoder, reads_features
from draft_svc.strategies.lookahead import gives_lookahead
from draft_svc.strategies.suffix_index import SuffixIndex
from draft_svc.tree import TokenTree, build_token_tree
from specdec.candidates import ranked_sources
from specdec.engine.tree import ROOT
from specdec.field_checks import require_at_least_one
from specdec.speculation_bounds import (
    DEFAULT_DRAFT_LENGTH,
    MAX_CANDIDATES,
    MAX_DRAFT_LENGTH,
    MAX_TREE_NODES,
    check_speculation_bounds,
)
from specdec.errors import InvalidArgument, NotFound, ResourceExhausted, quoted
from specdec.grammar import CompiledGrammar, GrammarCache, GrammarState, ResponseFormat
from specdec.grammar.compiling import Grammars, GrammarSettings
from specdec.model.llama import Transformer
from specdec.propose_args import ProposeArgs
from specdec.request_id import check_request_id, tenant_of
from specdec.strategies import MODEL_FREE_DEFAULTS

# How long a Propose that opens a request, or a PrepareGrammar, waits for a schema's compile (module
# doc); the json rows' schemas compiled in 3-7 ms, and the gateway's deadline for a Propose is 2 s or
# more. A PrepareGrammar held longer would keep one of the server's few threads from the Proposes.
OPEN_GRAMMAR_WAIT_S = 0.25


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    strategies: tuple[str, ...] = MODEL_FREE_DEFAULTS  # what this pool offers
    default_strategies: tuple[str, ...] = MODEL_FREE_DEFAULTS  # when a request names none
    default_draft_length: int = DEFAULT_DRAFT_LENGTH
    # The pool accepts any step within the structural bounds (specdec.speculation_bounds); what one
    # request may ask for is the gateway's to limit.
    max_draft_length: int = MAX_DRAFT_LENGTH
    max_speculative_degree: int = MAX_CANDIDATES
    max_tree_nodes: int = MAX_TREE_NODES
    max_context_tokens: int = 1 << 20
    max_requests: int = 4096
    request_ttl_s: float = 900.0  # a request idle this long (its gateway died) is dropped
    num_threads: int = 4

    def __post_init__(self) -> None:
        check_speculation_bounds(self.max_speculative_degree, self.max_draft_length, self.max_tree_nodes)
        if not self.strategies or len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must be distinct and non-empty, got {self.strategies}")
        unknown = set(self.default_strategies) - set(self.strategies)
        if unknown or not self.default_strategies:
            raise ValueError(
                f"default_strategies must be a non-empty subset of strategies {self.strategies}, "
                f"got {self.default_strategies}"
            )
        require_at_least_one(self, "default_draft_length", "max_context_tokens", "max_requests", "num_threads")
        if self.default_draft_length > self.max_draft_length:
            raise ValueError(
                f"default_draft_length {self.default_draft_length} exceeds max_draft_length {self.max_draft_length}"
            )
        if self.request_ttl_s <= 0:
            raise ValueError(f"request_ttl_s must be > 0, got {self.request_ttl_s}")


class ModelSource(Protocol):
    """What the pool needs from the attached primary weights (draft_svc.weights.WeightAttacher)."""

    def current_model(self) -> tuple[str, Transformer] | None:
        """(instance id, model) of the attached weights, or None while none are attached."""
        ...

    def vocab_size(self) -> int | None:
        """The primary's vocabulary size when known (attached or described by the primary)."""
        ...

    def max_context_length(self) -> int | None:
        """The primary's context length (prompt and output together) when known (described by the
        primary), else None."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Continuation:
    """What a rank-0 candidate proposed past draft_length, after `leaf`, the tree node where its draft
    ends: a caller whose step accepts the path to `leaf` with the bonus token token_ids[0] can draft
    its next step from token_ids[1:] without asking (continuations_of)."""

    leaf: int
    token_ids: tuple[int, ...]
    decoder: str


@dataclasses.dataclass(frozen=True, slots=True)
class DecoderStep:
    name: str
    num_proposed: int  # tree nodes this decoder's candidates pass through
    time_ms: float


@dataclasses.dataclass(frozen=True, slots=True)
class Proposal:
    tree: TokenTree  # tree.decoders[i] = candidate i's decoder = bit i
    decoder_steps: tuple[DecoderStep, ...]  # one per distinct decoder, in first-use order
    time_ms: float
    lookahead: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # rows (token_ids, parents) to verify beside
    continuations: tuple[Continuation, ...] = ()  # best candidate first, one per leaf


@dataclasses.dataclass(slots=True)
class _Request:
    token_ids: list[int]
    num_prompt_tokens: int
    decoders: dict[str, DraftDecoder] = dataclasses.field(default_factory=dict)
    model_instance: dict[str, str] = dataclasses.field(default_factory=dict)  # decoder -> its weights' instance
    response_format: ResponseFormat | None = None
    grammar: GrammarState | None = None  # at the end of the committed output: cuts candidates that leave it
    compiling: Future[CompiledGrammar] | None = None  # the response format's compile, still under way at the open
    tenant: str = ""  # of its id (specdec.request_id.tenant_of): what its decoders may learn from others
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    last_used: float = 0.0
    lookahead_source: str | None = None  # the decoder whose lookahead rows the last proposal carried
    # This call's features (position, rows), for decoders created during it: what `extend` hands the
    # existing ones (FeatureConsumer). Cleared when the call ends.
    features: tuple[int, np.ndarray] | None = None
    prediction_token_ids: tuple[int, ...] = ()  # the request's predicted output, for prediction-based decoders


class DraftPool:
    def __init__(
        self,
        config: PoolConfig,
        model_free: DecoderRegistry,
        model_based: DecoderRegistry,
        models: ModelSource,
        suffix_index: SuffixIndex | None = None,
        *,
        grammar_based: DecoderRegistry | None = None,
        grammars: GrammarCache | None = None,
        refusal: Callable[[str], str | None] | None = None,
        prediction_based: DecoderRegistry | None = None,
    ) -> None:
        """`grammar_based` decoders are created with the request's response_format (requests without
        one get no candidate from them); `grammars` compiles those formats for the pool's own check
        that every proposed token is one the grammar allows. `refusal(name)` says why a strategy
        cannot serve (a feature drafter whose file is missing or was trained for another model), or
        None: a request naming a refused strategy gets INVALID_ARGUMENT with that reason.
        `prediction_based` decoders are created with the request's prediction_token_ids (requests
        without a prediction get no candidate from them)."""
        grammar_based = grammar_based or DecoderRegistry()
        prediction_based = prediction_based or DecoderRegistry()
        if grammar_based.names() and grammars is None:
            raise ValueError("grammar-based strategies need a GrammarCache")
        offered = (
            set(model_free.names())
            | set(model_based.names())
            | set(grammar_based.names())
            | set(prediction_based.names())
        )
        if missing := set(config.strategies) - offered:
            raise ValueError(f"strategies {sorted(missing)} have no registered decoder (have {sorted(offered)})")
        self.config = config
        self._model_free, self._model_based, self._models = model_free, model_based, models
        self._grammar_based = grammar_based
        # One compile per format at a time, shared by PrepareGrammar and the request's first Propose.
        self._grammars = None if grammars is None else Grammars(grammars, GrammarSettings())
        self._prediction_based = prediction_based
        self._suffix_index = suffix_index
        self._refusal = refusal or _never_refused
        self._requests: collections.OrderedDict[str, _Request] = collections.OrderedDict()  # LRU order
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(config.num_threads, thread_name_prefix="draft")
        self._log = structlog.get_logger("draft_svc.pool")

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_kv_bytes(self) -> int:
        """KV bytes of the model-based decoders of every request (the pool's own memory beyond weights)."""
        with self._lock:
            requests = list(self._requests.values())
        return sum(getattr(d, "num_kv_bytes", 0) for r in requests for d in list(r.decoders.values()))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._grammars is not None:
            self._grammars.close()

    def prepare_grammar(self, response_format: ResponseFormat) -> None:
        """Begin compiling `response_format` into the grammar cache (or join its compile under way), so
        that the first Propose of a request with it finds it ready; returns once it is compiled or
        after OPEN_GRAMMAR_WAIT_S, the compile going on. InvalidArgument for a bad schema found in that
        time, or a pool without grammars."""
        self._start_compile(response_format)

    def _start_compile(self, response_format: ResponseFormat) -> tuple[Future[CompiledGrammar], CompiledGrammar | None]:
        """The format's compile (begun now or under way) and its result if it ends within
        OPEN_GRAMMAR_WAIT_S (InvalidArgument for a bad schema), else None: it runs on."""
        if self._grammars is None:
            raise InvalidArgument("response_format", "this draft pool serves no grammars (no tokenizer configured)")
        compiling = self._grammars.start(response_format)
        try:
            return compiling, compiling.result(timeout=OPEN_GRAMMAR_WAIT_S)
        except FutureTimeout:
            return compiling, None

    def offered_strategies(self) -> tuple[str, ...]:
        """The strategies a request may name now: the configured ones less those refused (a feature
        drafter trained for another model than the attached one)."""
        return tuple(name for name in self.config.strategies if self._refusal(name) is None)

    # --- Propose -----------------------------------------------------------------------------

    def propose(self, args: ProposeArgs) -> Proposal:
        started = time.perf_counter()
        entries, draft_length, max_nodes = self._resolve(args)
        if args.prompt_token_ids:  # the call (re)opens the request: refused before it exists
            self._checked_features(args, len(args.prompt_token_ids) + len(args.new_token_ids))
        request, is_new = self._request_for(args)
        with request.lock:
            # checked before the context grows and before the lookahead decoder takes its argmaxes (a
            # Jacobi step): a refused call leaves the request as it was
            num_tokens = len(request.token_ids) + (0 if is_new else len(args.new_token_ids))
            features = self._checked_features(args, num_tokens)
            self._observe_lookahead(request, args.lookahead_argmax_token_ids)
            if not is_new:
                self._extend(request, args.new_token_ids)
            self._attach_grammar(request)
            request.features = features
            try:
                self._observe_features(request.features, request.decoders.values())
                extra = args.continuation_length if request.grammar is None else 0
                candidates, steps = self._run_decoders(request, entries, draft_length, extra, max_nodes)
            finally:
                request.features = None
            if request.grammar is not None:
                candidates = [within_grammar(request.grammar, c) for c in candidates]
            lookahead = self._lookahead_rows(request, entries)
            request.last_used = time.monotonic()
        drafts = [dataclasses.replace(c, token_ids=c.token_ids[:draft_length]) for c in candidates]
        tree = build_token_tree(drafts, max_nodes)
        counted = tuple(dataclasses.replace(s, num_proposed=_num_nodes_from(tree, s.name)) for s in steps)
        continuations = continuations_of(tree, candidates, draft_length)
        return Proposal(tree, counted, (time.perf_counter() - started) * 1e3, lookahead, continuations)

    def _resolve(self, args: ProposeArgs) -> tuple[list[tuple[str, int]], int, int]:
        """Validate the step's parameters -> ([(decoder, rank)] best first, draft_length, max_nodes)."""
        c = self.config
        check_request_id(args.request_id)
        names = args.strategies or c.default_strategies
        for name in names:
            if (reason := self._refusal(name)) is not None:
                raise InvalidArgument("strategies", f"{name!r} is not served by this pool: {reason}")
            if name not in c.strategies:
                # quoted: a caller's name of megabytes would make a status message no client accepts
                raise InvalidArgument("strategies", f"{quoted(name)} is not one of this pool's {list(c.strategies)}")
        degree = args.speculative_degree or len(names)
        if not 1 <= degree <= min(len(names), c.max_speculative_degree):
            raise InvalidArgument(
                "speculative_degree",
                f"must be in [0, {min(len(names), c.max_speculative_degree)}]"
                f" ({len(names)} strategies named), got {args.speculative_degree}",
            )
        draft_length = args.draft_length or c.default_draft_length
        if not 1 <= draft_length <= c.max_draft_length:
            raise InvalidArgument("draft_length", f"must be in [0, {c.max_draft_length}], got {args.draft_length}")
        if not 0 <= args.max_nodes <= c.max_tree_nodes:
            raise InvalidArgument("max_nodes", f"must be in [0, {c.max_tree_nodes}], got {args.max_nodes}")
        if not 0 <= args.continuation_length <= c.max_draft_length:
            raise InvalidArgument(
                "continuation_length", f"must be in [0, {c.max_draft_length}], got {args.continuation_length}"
            )
        max_nodes = args.max_nodes or min(degree * draft_length, c.max_tree_nodes)
        self._check_token_ids("prompt_token_ids", args.prompt_token_ids)
        self._check_token_ids("new_token_ids", args.new_token_ids)
        self._check_token_ids("lookahead_argmax_token_ids", args.lookahead_argmax_token_ids)
        self._check_token_ids("prediction_token_ids", args.prediction_token_ids)
        if len(args.prediction_token_ids) > (max_context := self._max_context_tokens()):
            raise InvalidArgument("prediction_token_ids", f"longer than {max_context} tokens")
        if args.prediction_token_ids and not args.prompt_token_ids:
            raise InvalidArgument("prediction_token_ids", "goes with the request's first Propose (prompt_token_ids)")
        # A call that (re)opens the request follows no proposal of its state: refused here, before
        # _request_for creates the request a later refusal would leave behind.
        if args.lookahead_argmax_token_ids and args.prompt_token_ids:
            raise InvalidArgument("lookahead_argmax_token_ids", "the previous Propose proposed no lookahead rows")
        return list(ranked_sources(names[:degree])), draft_length, max_nodes

    def _max_context_tokens(self) -> int:
        """The most tokens a request's context (or prediction) may hold: max_context_tokens, or the
        primary's context length where it is known and smaller. The gateway never commits more, and a
        caller's longer contexts would only fill the pool's memory (its decoders index every token)."""
        primary = self._models.max_context_length()
        return min(primary, self.config.max_context_tokens) if primary else self.config.max_context_tokens

    def _check_token_ids(self, field: str, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        vocab_size = self._models.vocab_size()
        low, high = min(token_ids), max(token_ids)
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            raise InvalidArgument(field, f"token id {bad} is outside the vocabulary [0, {vocab_size or '?'})")

    def _request_for(self, args: ProposeArgs) -> tuple[_Request, bool]:
        """The request's state, and whether this call created it (from prompt + new tokens)."""
        c = self.config
        grammar, compiling, response_format = None, None, args.response_format
        if args.prompt_token_ids:
            if len(args.prompt_token_ids) + len(args.new_token_ids) > (max_context := self._max_context_tokens()):
                raise InvalidArgument("prompt_token_ids", f"context exceeds {max_context} tokens")
            # Outside the pool's lock: a schema's first compile takes tens of ms, and every other
            # request's Propose would wait for it.
            try:
                grammar, compiling = self._grammar_state(args)
            except ResourceExhausted as e:  # the compiles are full: it drafts without the grammar (the gateway masks)
                self._log.warning("draft_grammar_refused", error=str(e))
                response_format = None
        now = time.monotonic()
        with self._lock:
            self._drop_idle(now)
            request = self._requests.get(args.request_id)
            if args.prompt_token_ids:
                # A prompt (re)opens the request: on a known id it is a gateway that recovered the
                # request, whose view of the committed tokens wins.
                if request is None and len(self._requests) >= c.max_requests:
                    raise ResourceExhausted("request_id", f"the draft pool holds {c.max_requests} requests")
                request = _Request(
                    [*args.prompt_token_ids, *args.new_token_ids],
                    len(args.prompt_token_ids),
                    last_used=now,
                    response_format=response_format,
                    grammar=grammar,
                    compiling=compiling,
                    tenant=tenant_of(args.request_id),
                    prediction_token_ids=args.prediction_token_ids,
                )
                self._requests[args.request_id] = request
                self._requests.move_to_end(args.request_id)
                return request, True
            elif request is None:
                raise NotFound(
                    "request_id",
                    f"no draft state for {args.request_id!r}: the first Propose of a request carries prompt_token_ids",
                )
            self._requests.move_to_end(args.request_id)
            request.last_used = now
        return request, False

    def _grammar_state(self, args: ProposeArgs) -> tuple[GrammarState | None, Future[CompiledGrammar] | None]:
        """The pool's grammar state of a new request, past the output tokens it was opened with; or,
        while its compile runs past OPEN_GRAMMAR_WAIT_S, that compile (_attach_grammar takes it up)."""
        if args.response_format is None:
            return None, None
        compiling, compiled = self._start_compile(args.response_format)
        if compiled is None:
            self._log.info("draft_grammar_compiling", wait_s=OPEN_GRAMMAR_WAIT_S)
            return None, compiling
        state = compiled.new_state()
        if not state.accept_tokens(args.new_token_ids):
            raise InvalidArgument("new_token_ids", "the committed output does not follow response_format")
        return state, None

    def _attach_grammar(self, request: _Request) -> None:
        """The grammar of a request opened while its schema compiled, once the compile is done, caught
        up on the output so far; its grammar-based decoders join from then on (_decoder)."""
        compiling = request.compiling
        if compiling is None or not compiling.done():
            return
        request.compiling = None
        try:
            state = compiling.result().new_state()
        except Exception as e:  # noqa: BLE001 - a schema the gateway took but this pool cannot compile
            self._log.warning("draft_grammar_failed", error=str(e))
            request.response_format = None  # no grammar-based decoders; the gateway masks as before
            return
        if state.accept_tokens(request.token_ids[request.num_prompt_tokens :]):
            request.grammar = state
        else:  # as in _extend: the committed output left the grammar, so nothing is filtered
            self._log.warning("draft_output_left_grammar", num_tokens=len(request.token_ids))

    def expire_idle(self) -> int:
        """Drop the requests idle for request_ttl_s (their gateway died, or its Release never came);
        returns how many. A Propose drops them too, but a pool that hears no more Proposes would keep
        their state (and its memory) for ever: the service calls this on a timer
        (draft_svc.__main__.expire_idle_requests)."""
        with self._lock:
            num_requests = len(self._requests)
            self._drop_idle(time.monotonic())
            return num_requests - len(self._requests)

    def _drop_idle(self, now: float) -> None:
        while self._requests:
            request_id, request = next(iter(self._requests.items()))
            if now - request.last_used < self.config.request_ttl_s:
                return
            del self._requests[request_id]
            self._log.warning("draft_request_expired", request_id=request_id, idle_s=round(now - request.last_used))
            _release_decoders(request)

    def _extend(self, request: _Request, token_ids: Sequence[int]) -> None:
        if len(request.token_ids) + len(token_ids) > (max_context := self._max_context_tokens()):
            raise InvalidArgument("new_token_ids", f"context exceeds {max_context} tokens")
        request.token_ids.extend(token_ids)
        if request.grammar is not None and not request.grammar.accept_tokens(token_ids):
            # The primary committed text the grammar refuses (its masks were not applied): stop filtering
            # rather than fail the request; the grammar decoder falls silent the same way.
            self._log.warning("draft_output_left_grammar", num_tokens=len(request.token_ids))
            request.grammar = None
        for decoder in request.decoders.values():
            decoder.extend(token_ids)

    def _checked_features(self, args: ProposeArgs, num_tokens: int) -> tuple[int, np.ndarray] | None:
        """(feature_position, features) of the call, checked against the committed context's num_tokens
        and, once the weights are attached, the model's hidden size (rows of another width are not the
        primary's features, and the decoders that read them could not take them)."""
        if args.features is None:
            return None
        features, position = args.features, args.feature_position
        if features.ndim != 2 or features.dtype != np.float32 or not len(features):
            raise InvalidArgument("features", f"must be float32 rows [n, C], got {features.dtype} {features.shape}")
        if position < 1 or position + len(features) > num_tokens:
            raise InvalidArgument(
                "feature_position",
                f"{len(features)} rows predicting tokens from position {position} must predict committed tokens "
                f"(positions 1 to {num_tokens - 1})",
            )
        attached = self._models.current_model()
        if attached is not None and features.shape[1] != (hidden_size := attached[1].config.hidden_size):
            raise InvalidArgument(
                "features", f"rows of {features.shape[1]} values; the model's hidden size is {hidden_size}"
            )
        return position, features

    @staticmethod
    def _observe_features(features: tuple[int, np.ndarray] | None, decoders: Iterable[DraftDecoder]) -> None:
        """The call's features to every decoder that reads them, after it heard the committed tokens."""
        if features is None:
            return
        for decoder in decoders:
            if reads_features(decoder):
                decoder.observe_features(*features)

    def _observe_lookahead(self, request: _Request, argmax_token_ids: Sequence[int]) -> None:
        """The primary's argmaxes at the last proposal's lookahead rows, to the decoder that gave them
        (none: they were not verified, and the decoder's window stays)."""
        source, request.lookahead_source = request.lookahead_source, None
        decoder = None if source is None else request.decoders.get(source)
        if not gives_lookahead(decoder):
            if argmax_token_ids:
                raise InvalidArgument("lookahead_argmax_token_ids", "the previous Propose proposed no lookahead rows")
            return
        try:
            decoder.observe(argmax_token_ids)
        except ValueError as e:
            raise InvalidArgument("lookahead_argmax_token_ids", str(e)) from None

    def _lookahead_rows(
        self, request: _Request, entries: list[tuple[str, int]]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The rows of the step's first lookahead decoder, remembered for the argmaxes that come back."""
        for name in dict.fromkeys(name for name, _ in entries):
            decoder = request.decoders.get(name)
            if gives_lookahead(decoder):
                request.lookahead_source = name
                return decoder.lookahead_rows()
        return (), ()

    def _run_decoders(
        self,
        request: _Request,
        entries: list[tuple[str, int]],
        draft_length: int,
        extra: int = 0,
        max_nodes: int = 0,
    ) -> tuple[list[Candidate], list[DecoderStep]]:
        """Each entry's candidate; a model-free decoder asked for one answer runs `extra` tokens past
        draft_length (free for it; a model-based decoder pays per token, and a decoder ranking
        several answers would rank them by tokens past the draft)."""
        num_ranks: dict[str, int] = {}
        for name, rank in entries:
            num_ranks[name] = max(num_ranks.get(name, 0), rank + 1)
        runnable = {name: d for name in num_ranks if (d := self._decoder(request, name)) is not None}
        # Model-based decoders run in parallel, the first on this thread; the model-free ones take
        # microseconds, less than handing them to another thread.
        heavy = [name for name in runnable if name in self._model_based]
        futures = {
            name: self._executor.submit(_timed_propose, runnable[name], draft_length, num_ranks[name], max_nodes)
            for name in heavy[1:]
        }
        try:
            results = {
                name: _timed_propose(
                    runnable[name],
                    draft_length + (extra if num_ranks[name] == 1 and name not in self._model_based else 0),
                    num_ranks[name],
                    max_nodes,
                )
                for name in runnable
                if name not in futures
            }
        finally:
            wait(futures.values())  # even when one fails: no decoder may outlive the request's lock
        results.update((name, f.result()) for name, f in futures.items())  # a decoder's error propagates
        candidates = []
        for name, rank in entries:
            proposed = results.get(name, ((), 0.0))[0]
            candidates.append(proposed[rank] if rank < len(proposed) else Candidate(name, (), rank=rank))
        steps = [DecoderStep(name, 0, results.get(name, ((), 0.0))[1]) for name in num_ranks]
        return candidates, steps

    def _decoder(self, request: _Request, name: str) -> DraftDecoder | None:
        """The request's decoder for `name`, created (and caught up) on first use; None when a
        model-based strategy has no attached weights."""
        if name in self._model_based:
            attached = self._models.current_model()
            if attached is None:
                return None
            if self._refusal(name) is not None:  # e.g. new weights its drafter file was not trained for
                _release_decoder(request, name)
                return None
            instance_id, model = attached
            if request.model_instance.get(name) != instance_id:
                # New weights (the primary restarted): the old decoder's cache belongs to the old ones.
                _release_decoder(request, name)
                request.decoders[name] = self._model_based.create(name, model=model)
                request.decoders[name].extend(request.token_ids)
                request.model_instance[name] = instance_id
                self._observe_features(request.features, [request.decoders[name]])
        elif name in self._grammar_based:
            if request.response_format is None or request.compiling is not None:
                return None
            if name not in request.decoders:
                request.decoders[name] = self._grammar_based.create(
                    name,
                    response_format=request.response_format,
                    num_prompt_tokens=request.num_prompt_tokens,
                    tenant=request.tenant,
                )
                request.decoders[name].extend(request.token_ids)
                self._observe_features(request.features, [request.decoders[name]])
        elif name in self._prediction_based:
            if not request.prediction_token_ids:
                return None
            if name not in request.decoders:
                request.decoders[name] = self._prediction_based.create(
                    name, prediction_token_ids=request.prediction_token_ids, num_prompt_tokens=request.num_prompt_tokens
                )
                request.decoders[name].extend(request.token_ids)
        elif name not in request.decoders:
            scoped = {"tenant": request.tenant} if self._model_free.is_tenant_scoped(name) else {}
            request.decoders[name] = self._model_free.create(name, **scoped)
            request.decoders[name].extend(request.token_ids)
            self._observe_features(request.features, [request.decoders[name]])
        return request.decoders[name]

    # --- Release -----------------------------------------------------------------------------

    def release(self, request_id: str, is_finished: bool, new_token_ids: Sequence[int] = ()) -> int:
        """Drop the request's state; a finished request's output joins the suffix index: what its
        Proposes brought, then `new_token_ids` (committed since its last Propose). Returns the number
        of output tokens indexed. Idempotent: a request the pool does not hold (it never proposed, as
        with speculation off, or it was released already, or the pool restarted) is released
        already (0)."""
        self._check_token_ids("new_token_ids", new_token_ids)  # refused before anything is dropped
        if len(new_token_ids) > (max_context := self._max_context_tokens()):
            raise InvalidArgument("new_token_ids", f"longer than {max_context} tokens")
        with self._lock:
            request = self._requests.pop(request_id, None)
        if request is None:
            return 0
        with request.lock:  # wait for an in-flight Propose of the request
            _release_decoders(request)
            output = [*request.token_ids[request.num_prompt_tokens :], *new_token_ids]
        if is_finished and self._suffix_index is not None and output:
            self._suffix_index.insert(output, tenant=request.tenant)
            return len(output)
        return 0


def _never_refused(name: str) -> None:
    return None


def _timed_propose(
    decoder: DraftDecoder, max_tokens: int, max_candidates: int, max_nodes: int = 0
) -> tuple[tuple[Candidate, ...], float]:
    started = time.perf_counter()
    if getattr(decoder, "takes_max_nodes", False):  # a tree decoder sizes its tree to the step's node budget
        candidates = decoder.propose(max_tokens, max_candidates, max_nodes=max_nodes)  # type: ignore[call-arg]
    else:
        candidates = decoder.propose(max_tokens, max_candidates)
    return candidates, (time.perf_counter() - started) * 1e3


def continuations_of(tree: TokenTree, candidates: Sequence[Candidate], draft_length: int) -> tuple[Continuation, ...]:
    """For each rank-0 candidate longer than draft_length whose whole draft made it into `tree` (the
    node budget may cut it), the tokens past its draft, after the node where the draft ends; best
    candidate first, one per node.

    # E.g. draft_length 2, candidates [a b c d] (prompt_lookup), [a e f] (suffix_index); tree
    #   0:a 1:b 2:e -> (Continuation(1, (c, d), prompt_lookup), Continuation(2, (f,), suffix_index))
    """
    child = {(parent, token): node for node, (parent, token) in enumerate(zip(tree.parents, tree.token_ids))}
    found: dict[int, Continuation] = {}
    for candidate in candidates:
        if candidate.rank != 0 or len(candidate.token_ids) <= draft_length:
            continue
        node = ROOT
        for token in candidate.token_ids[:draft_length]:
            node = child.get((node, token), ROOT)
            if node == ROOT:  # cut by the node budget
                break
        if node != ROOT and node not in found:
            found[node] = Continuation(node, candidate.token_ids[draft_length:], candidate.decoder)
    return tuple(found.values())


def within_grammar(grammar: GrammarState, candidate: Candidate) -> Candidate:
    """`candidate` cut before its first token the grammar refuses (the state is unchanged after).
    E.g. after `{"a": ` a candidate `1`, `}`, `}` keeps `1`, `}`: the second `}` closes nothing."""
    num_kept = 0
    for token_id in candidate.token_ids:
        if not grammar.accept_tokens((token_id,)):
            break
        num_kept += 1
    grammar.rollback(num_kept)
    if num_kept == len(candidate.token_ids):
        return candidate
    return dataclasses.replace(candidate, token_ids=candidate.token_ids[:num_kept])


def _num_nodes_from(tree: TokenTree, decoder: str) -> int:
    bits = sum(1 << i for i, name in enumerate(tree.decoders) if name == decoder)
    return sum(1 for sources in tree.node_sources if sources & bits)


def _release_decoder(request: _Request, name: str) -> None:
    old = request.decoders.pop(name, None)
    request.model_instance.pop(name, None)
    if old is not None and hasattr(old, "release"):
        old.release()


def _release_decoders(request: _Request) -> None:
    for decoder in request.decoders.values():
        if hasattr(decoder, "release"):
            decoder.release()
    request.decoders.clear()
