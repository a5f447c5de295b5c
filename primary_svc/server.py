"""PrimaryService servicer: protobuf -> engine work -> protobuf. Translation only.

Every request's KV slot is leased to the caller that prefilled it (primary_svc.leases):
Verify, Decode and Release check the lease first, and a Prefill that would replace a live
request needs it too (else ALREADY_EXISTS); expire_idle_requests() frees the slots nobody
called for --kv_lease_s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from primary_svc.leases import KVLeases
from primary_svc.run_grammars import RunGrammars, check_run_grammar
from primary_svc.run_steps import Decided, NextToken, Run, RunLimits
from primary_svc.worker import EngineWorker
from specdec import pb
from specdec.engine.engine import Engine
from specdec.engine.loading import LoadedModel, config_to_json
from specdec.engine.tree import with_lookahead
from specdec.errors import RETRY_AFTER_KEY, AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted
from specdec.features import encode_features
from specdec.grammar import GrammarState
from specdec.grammar.bitmask import TokenBitmask
from specdec.logits_codec import row_argmax
from specdec.logits_shm import LogitsSlots
from primary_svc.metrics import PrimaryMetrics
from specdec.logprobs import LogprobsRequest, TokenLogprob, token_logprobs
from specdec.model.tokenizer import StopStringWatch, Tokenizer, check_stop_strings
from specdec.penalties import penalize
from specdec.answers import AnswerIndex, LearnedAnswers
from specdec.repeats import MAX_REPEAT_TOKENS, RepeatIndex, RunDrafts
from specdec.request_id import tenant_of
from specdec.speculation_bounds import MAX_DRAFT_LENGTH
from specdec.sampling import SamplingParams, draw_token
from specdec.v1 import common_pb2, primary_pb2, primary_pb2_grpc
from specdec.verify_args import VerifyArgs
from specdec.weights.wire import manifest_to_pb

# What a Verify's finish hands back from the engine thread: argmaxes, logits, num_cached, lookahead
# argmaxes, the step's rows, features (None unless asked for).
_Verified = tuple[list[int], common_pb2.Logits, int, list[int], int, common_pb2.Features | None]

# The most tokens one Decode may ask for (DecodeRequest.max_tokens): a call holds its caller at most
# this many engine steps, so a cancel or deadline is seen within them. A DecodeStream may ask for up to
# the context: its caller hears of every step and cancels whenever it likes.
MAX_DECODE_TOKENS = 64
# A Prefill refused because max_prefills are under way already (RESOURCE_EXHAUSTED) carries this trailing
# metadata: the milliseconds after which a retry may find room, as the gateway's admission sends it.
PREFILL_RETRY_AFTER_MS = 500


@dataclasses.dataclass(frozen=True, slots=True)
class _StreamedStep:
    """One engine step of a DecodeStream run, as plain values from the engine thread."""

    decided: Decided
    forward_ms: float
    is_last: bool  # the run ends with it: its last token is pending (DecodeStreamResponse.is_run_end)
    logprob: TokenLogprob | None  # asked by logprobs


def _stream_message(steps: Sequence[_StreamedStep]) -> primary_pb2.DecodeStreamResponse:
    """One DecodeStream message carrying `steps` in order: their tokens, summed times and counts."""
    last = steps[-1]
    return primary_pb2.DecodeStreamResponse(
        token_ids=[t for s in steps for t in s.decided.token_ids],
        is_run_end=last.is_last,
        forward_ms=sum(s.forward_ms for s in steps),
        num_step_rows=last.decided.num_step_rows,
        num_drafted=sum(s.decided.num_drafted for s in steps),
        num_draft_accepted=sum(s.decided.num_draft_accepted for s in steps),
        num_answer_drafted=sum(s.decided.num_answer_drafted for s in steps),
        num_answer_accepted=sum(s.decided.num_answer_accepted for s in steps),
        logprobs=[pb.token_logprob_to_pb(s.logprob) for s in steps if s.logprob is not None],
        num_steps=len(steps),
        num_other_rows=max(0, last.decided.num_step_rows - 1 - last.decided.num_drafted),
        num_drafting_steps=sum(1 for s in steps if s.decided.num_drafted),
    )


class _StopHints:
    """A DecodeStream's stop_strings: whether a step's tokens complete one (StopStringWatch) after the
    output's last tokens, which the engine thread reads before the run's first step decides (`before`
    wraps the run's finish: a step's tokens are committed once it has decided); the handler's thread
    decodes (`completes`, for every step in order)."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str], output_token_ids: Callable[[], list[int]]):
        self.tokenizer, self.stop_strings, self.output_token_ids = tokenizer, stop_strings, output_token_ids
        self.context: list[int] | None = None
        self.watch: StopStringWatch | None = None

    def before(self, finish: Callable[[torch.Tensor], Decided]) -> Callable[[torch.Tensor], Decided]:
        def reading_the_output_first(logits: torch.Tensor) -> Decided:
            if self.context is None:
                self.context = self.output_token_ids()  # a copy; the watch keeps the tail it needs
            return finish(logits)

        return reading_the_output_first

    def completes(self, token_ids: Sequence[int]) -> bool:
        if self.watch is None:
            self.watch = StopStringWatch(self.tokenizer, self.stop_strings, self.context or [])
        return self.watch.add(token_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelIdentity:
    model_id: str
    instance_id: str
    max_context: int
    eos_token_ids: tuple[int, ...]
    verify_costs_ms: dict[int, float]
    precision_choice: str = "requested"


class PrimaryServicer(primary_pb2_grpc.PrimaryServiceServicer):
    def __init__(
        self,
        loaded: LoadedModel,
        worker: EngineWorker,
        identity: ModelIdentity,
        max_kv_bytes: int,
        metrics: PrimaryMetrics | None = None,
        leases: KVLeases | None = None,
        run_grammars: RunGrammars | None = None,
        answers: AnswerIndex | None = None,
        tokenizer: Tokenizer | None = None,
        learned_answers: LearnedAnswers | None = None,
        max_prefills: int | None = None,
    ) -> None:
        """`run_grammars`: the grammar states of Decode calls with a response_format (None: such
        calls are refused); `answers`: the model's own answers, which runs draft from too;
        `tokenizer`: the model's, which DecodeStream's stop_strings are read by (None: ignored);
        `learned_answers`: where the outputs of requests that speculate are kept, at their Release,
        as drafts for the same tenant's later runs (None: not kept); `max_prefills`: Prefill calls
        under way at once, at most (None: no bound). A Prefill holds its RPC thread while it waits for
        KV room, and the calls that free room (Verify, Decode, Release) need threads of the same pool:
        bounded below the server's threads, the waiting Prefills cannot take them all; one more is
        RESOURCE_EXHAUSTED at once, with a retry hint (primary_svc.config.max_prefill_calls)."""
        self.loaded, self.worker, self.identity = loaded, worker, identity
        self.run_grammars, self.answers, self.tokenizer = run_grammars, answers, tokenizer
        self.learned_answers = learned_answers
        self._speculating: set[str] = set()  # requests that verified a tree or drafted in a run
        self.max_kv_bytes, self.metrics = max_kv_bytes, metrics
        self.vocab_size = loaded.config.vocab_size
        self.logits_slots = LogitsSlots(identity.instance_id)
        self.leases = KVLeases() if leases is None else leases
        self.max_prefills = max_prefills
        self._prefill_calls = None if max_prefills is None else threading.BoundedSemaphore(max_prefills)

    def GetModelInfo(self, request, context):
        return primary_pb2.GetModelInfoResponse(
            model_id=self.identity.model_id,
            model_config_json=config_to_json(self.loaded.config),
            precision=self.loaded.precision,
            vocab_size=self.vocab_size,
            eos_token_ids=self.identity.eos_token_ids,
            max_context_length=self.identity.max_context,
            instance_id=self.identity.instance_id,
            verify_costs=[
                primary_pb2.VerifyCost(num_nodes=k, time_ms=ms)
                for k, ms in sorted(self.identity.verify_costs_ms.items())
            ],
            precision_choice=self.identity.precision_choice,
        )

    def ExportWeights(self, request, context):
        if self.loaded.shared is None:
            raise InvalidArgument("weights", "this primary runs with private weights (--no_shared_weights)")
        return primary_pb2.ExportWeightsResponse(
            manifest=manifest_to_pb(
                self.loaded.shared.manifest,
                config_to_json(self.loaded.config),
                self.loaded.precision,
                self.identity.model_id,
            )
        )

    def Prefill(self, request, context):
        request_id = pb.request_id_from_pb(request.request_id)
        token_ids = list(request.token_ids)
        if request.num_prompt_tokens > len(token_ids):
            raise InvalidArgument(
                "num_prompt_tokens", f"is {request.num_prompt_tokens}, more than the {len(token_ids)} token_ids"
            )
        prompt_logprobs = (  # refused before anything starts
            pb.logprobs_request_from_pb(request.prompt_logprobs) if request.HasField("prompt_logprobs") else None
        )
        self._prepare_grammar(request)
        calls = self._prefill_calls
        if calls is not None and not calls.acquire(blocking=False):
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(PREFILL_RETRY_AFTER_MS)),))
            raise ResourceExhausted(
                "request_id",
                f"this primary serves {self.max_prefills} prefills at once already (waiting for KV room or "
                "running); retry later",
            )
        try:
            return self._prefill(request, request_id, token_ids, prompt_logprobs, context)
        finally:
            if calls is not None:
                calls.release()

    def _prefill(
        self, request, request_id: str, token_ids: list[int], prompt_logprobs: LogprobsRequest | None, context
    ) -> primary_pb2.PrefillResponse:
        """Prefill's work, checked and within the bound on Prefill calls."""
        start = time.perf_counter()
        features: list[torch.Tensor] | None = [] if request.return_features else None
        scored = self._scored_prompt(prompt_logprobs, token_ids[: request.num_prompt_tokens or len(token_ids)])
        # Queued in the engine thread's scheduler: it waits for KV room (at most until the deadline),
        # then runs in chunks between other requests' steps. A re-prefill (recovery) with the request's
        # lease replaces the old state; the lease is checked and granted on the engine thread, like
        # expiry, so never for a slot being expired. A call that ends first (its caller cancelled, or
        # gave up at its own deadline) leaves the queue: no slot under a lease nobody received.
        ended = threading.Event()

        def on_end() -> None:  # on gRPC's thread, when the call ends (answered: set already)
            if not ended.is_set():
                ended.set()
                self.worker.wake()

        if not context.add_callback(on_end):  # the call has ended already: the callback would never run
            on_end()
        try:
            num_cached, num_reused, lease = self.worker.prefill(
                request_id,
                token_ids,
                request.num_prompt_tokens,
                timeout_s=context.time_remaining(),
                on_replace=lambda: self._take_over(request_id, request.kv_lease),
                finish=lambda num_cached: (
                    num_cached,
                    self.worker.built_engine().num_reused_tokens(request_id),
                    self.leases.grant(request_id),
                ),
                features_out=features,
                cancel=ended,
            )
        finally:
            ended.set()
        self._observe_kv()
        return primary_pb2.PrefillResponse(
            num_cached_tokens=num_cached,
            num_cached_prompt_tokens=num_reused,
            kv_lease=lease,
            time_ms=(time.perf_counter() - start) * 1000,
            features=pb.features_to_pb(encode_features(features[0])) if features else None,
            prompt_logprobs=[pb.token_logprob_to_pb(v) for v in scored],
            precision=self.loaded.precision,
        )

    def _scored_prompt(self, asked: LogprobsRequest | None, prompt: list[int]) -> list[TokenLogprob]:
        """The prompt's log probabilities where the Prefill asks for them, before it: in a forward of
        their own on the engine thread, so that one that fails (no KV room) leaves nothing opened."""
        if asked is None:
            return []
        return self.worker.call(lambda engine: engine.prompt_logprobs(prompt, asked.num_top))

    def Verify(self, request, context):
        args = VerifyArgs.from_pb(request, self.vocab_size, check_lease=self.leases.check)
        request_id, num_rows = args.request_id, args.num_rows
        self._speculating.add(request_id)
        token_ids, parents = args.tree_token_ids, args.tree_parents
        allowed, logprobs = args.allowed_tokens, args.logprobs
        features_out: list[torch.Tensor] | None = [] if args.return_features else None
        node_logprobs: list[TokenLogprob] = []
        row_logprobs: list[TokenLogprob] = []
        sampling = SamplingParams() if args.sampling is None else args.sampling

        def finish(logits: torch.Tensor) -> _Verified:  # engine thread
            lookahead_argmax = row_argmax(logits[num_rows:])  # [L], unmasked
            # [N+1, V], each row processed from its node's history when the request has penalties
            raw = logits[:num_rows]  # [N+1, V]: log probabilities are the model's own, as Decode's
            logits = self._penalized(request_id, raw, sampling, token_ids, parents)
            # from fp32 logits whatever the wire format; among the grammar's tokens when masked.
            argmax = row_argmax(logits) if allowed is None else allowed.argmax(logits).tolist()
            if logprobs is not None:  # node i's token at its parent's row (row parent + 1)
                node_logprobs.extend(token_logprobs(raw[[p + 1 for p in parents]], token_ids, logprobs.num_top))
                row_logprobs.extend(token_logprobs(raw, argmax, logprobs.num_top))
            num_cached = self.worker.built_engine().num_cached(request_id)  # read here: this pass's, not a later one's
            step_rows = self.worker.step_rows  # likewise
            # the logits rows' features, [N+1, C] (the lookahead rows' are not returned)
            features = encode_features(features_out[0][:num_rows]) if features_out else None
            payload, features_pb = self._logits_payload(
                request_id, logits, args.logits_format, features, args.return_handle
            )
            return argmax, payload, num_cached, lookahead_argmax, step_rows, features_pb

        with self._until_call_ends(context) as ended:
            (argmax, payload, num_cached, lookahead_argmax, step_rows, features_pb), forward_ms = self.worker.verify(
                request_id,
                args.accepted_nodes,
                args.committed_token_ids,
                *with_lookahead(token_ids, parents, args.lookahead_token_ids, args.lookahead_parents),
                finish,
                num_lookahead=len(args.lookahead_token_ids),
                features_out=features_out,
                cancel=ended,
            )
        return primary_pb2.VerifyResponse(
            logits=payload,
            argmax_token_ids=argmax,
            lookahead_argmax_token_ids=lookahead_argmax,
            num_cached_tokens=num_cached,
            forward_ms=forward_ms,
            kv_bytes=self.worker.built_engine().kv_bytes,
            num_step_rows=step_rows,
            features=features_pb,
            node_logprobs=[pb.token_logprob_to_pb(v) for v in node_logprobs],
            row_logprobs=[pb.token_logprob_to_pb(v) for v in row_logprobs],
        )

    @contextlib.contextmanager
    def _until_call_ends(self, context) -> Iterator[threading.Event]:
        """An event set when the call ends before its engine work is done (its caller cancelled, or its
        deadline passed), with a turn of the engine thread to see it: work queued with it as `cancel`
        leaves the queue unrun, and a run takes no further step (as a DecodeStream's on its end). Set
        once the work is done too, so that an answered call wakes nothing."""
        ended = threading.Event()

        def on_end() -> None:  # on gRPC's thread, when the call ends
            if not ended.is_set():
                ended.set()
                self.worker.wake()

        if not context.add_callback(on_end):  # the call has ended already
            on_end()
        try:
            yield ended
        finally:
            ended.set()

    def _logits_payload(self, request_id: str, logits: torch.Tensor, fmt, features, is_handle: bool) -> tuple:
        """A verify's logits (and features) for the wire: inline, or (`is_handle`: the validator and draft
        pool run on this machine) written to the request's /dev/shm slot and sent as its handle."""
        if not is_handle:
            return pb.logits_to_pb(logits, fmt), None if features is None else pb.features_to_pb(features)
        name, encoded = self.logits_slots.write(request_id, logits, fmt, features)
        payload = pb.logits_handle_to_pb(name, encoded, self.identity.instance_id)
        if features is None:
            return payload, None
        return payload, pb.features_handle_to_pb(name, features, len(encoded.data), self.identity.instance_id)

    def Decode(self, request, context):
        request_id = pb.request_id_from_pb(request.request_id)
        self.leases.check(request_id, request.kv_lease)
        run = self._plain_run(request, request_id, MAX_DECODE_TOKENS, context.time_remaining())
        with self._until_call_ends(context) as ended:
            decided, forward_ms = self.worker.verify(
                request_id,
                list(request.accepted_nodes),
                list(request.committed_token_ids),
                (),
                (),
                run.finish,
                repeat=run.repeat,
                num_context_tokens=request.num_context_tokens,
                cancel=ended,
            )
        return primary_pb2.DecodeResponse(
            token_id=run.tokens[-1],
            forward_ms=forward_ms,
            num_step_rows=decided.num_step_rows,
            token_ids=run.tokens,
            num_drafted=run.num_drafted,
            num_draft_accepted=run.num_draft_accepted,
            num_answer_drafted=run.num_answer_drafted,
            num_answer_accepted=run.num_answer_accepted,
            logprobs=[pb.token_logprob_to_pb(v) for v in run.logprobs],
        )

    def DecodeStream(self, request, context):
        """Decode's run, a message per engine step as the engine thread decides it (primary_svc.worker
        stream_decode), or after the run's first step one per steps_per_message steps; the RPC's end
        (a cancelled caller) ends the run at the next step boundary."""
        request_id = pb.request_id_from_pb(request.request_id)
        self.leases.check(request_id, request.kv_lease)
        per_message = pb.steps_per_message_from_pb(request.steps_per_message)
        check_stop_strings(request.stop_strings, "stop_strings")
        run_max = self.identity.max_context
        run = self._plain_run(request, request_id, run_max, context.time_remaining())
        stops = None  # a message is sent at once after a step that completes a stop string
        if request.stop_strings and per_message > 1 and self.tokenizer is not None:
            engine = self.worker.built_engine()
            stops = _StopHints(self.tokenizer, request.stop_strings, lambda: engine.output_token_ids(request_id))
        steps: queue.SimpleQueue[_StreamedStep | None] = queue.SimpleQueue()
        cancel = threading.Event()
        context.add_callback(cancel.set)

        def on_step(result: Decided, forward_ms: float, is_last: bool) -> None:  # on the engine thread
            self.leases.renew(request_id, request.kv_lease)  # the run holds the slot: no expiry under it
            scored = run.logprobs[len(run.tokens) - 1] if run.logprobs else None  # logprobs: one token a step
            steps.put(_StreamedStep(result, forward_ms, is_last, scored))

        running = self.worker.stream_decode(
            request_id,
            list(request.accepted_nodes),
            list(request.committed_token_ids),
            run.finish if stops is None else stops.before(run.finish),
            run.repeat,
            on_step,
            cancel,
            request.num_context_tokens,
        )
        running.add_done_callback(lambda _: steps.put(None))
        held: list[_StreamedStep] = []  # decided steps not sent yet
        is_first = True
        try:
            while (step := steps.get()) is not None:
                held.append(step)
                is_stop = stops is not None and stops.completes(step.decided.token_ids)
                if is_first or step.is_last or is_stop or len(held) >= per_message:
                    yield _stream_message(held)
                    held, is_first = [], False
            running.result()  # the error that ended the run, if one did (a run ends on is_last or a cancel)
        finally:
            cancel.set()  # a caller gone mid-run (the generator closed): no further step

    def _plain_run(self, request, request_id: str, max_run_tokens: int, remaining_s: float | None) -> Run:
        """A Decode call's steps, checked (primary_svc.run_steps); `remaining_s`: the call's time left."""
        sampling = self._sampling(request)
        allowed = self._allowed_tokens(request, 1)
        grammar = self._run_grammar(request, request_id, allowed is not None, remaining_s)
        max_tokens, stop = self._decode_run(request, allowed is None, max_run_tokens)
        logprobs = pb.logprobs_request_from_pb(request.logprobs) if request.HasField("logprobs") else None
        engine, worker = self.worker.built_engine, self.worker
        return Run(
            request_id=request_id,
            position=request.position,
            sampling=sampling,
            limits=RunLimits(max_tokens, stop, self._run_repeats(request, request_id)),
            next_token=self._next_token(request_id, sampling, allowed, grammar),
            grammar=grammar,
            make_drafts=self._run_drafts(request, request_id, sampling, logprobs is not None),
            logprobs_top=None if logprobs is None else logprobs.num_top,
            output_token_ids=lambda rid: engine().output_token_ids(rid),
            step_load=lambda: (worker.step_rows, worker.step_requests),
            metrics=self.metrics,
        )

    def _next_token(self, request_id: str, sampling: SamplingParams, allowed, grammar) -> NextToken:
        """(logits [1, V], position) -> a plain step's token, as the request's sampling, mask and grammar
        choose it; a draw is keyed by the token's position among the request's generated tokens."""

        def next_token(logits: torch.Tensor, position: int) -> int:
            logits = self._penalized(request_id, logits[:1], sampling)  # [1, V]
            mask = allowed
            if grammar is not None:  # on the engine thread, past every token committed so far
                mask = grammar(self.worker.built_engine().output_token_ids(request_id)).allowed_mask()
            if sampling.is_greedy:  # the masked argmax constrained speculation validates against
                return row_argmax(logits[:1])[0] if mask is None else int(mask.argmax(logits)[0])
            if mask is not None:
                logits = mask.masked_rows(logits, [0])  # [1, V]
            return draw_token(logits, sampling, position)

        return next_token

    def _run_drafts(
        self, request, request_id: str, sampling: SamplingParams, has_logprobs: bool
    ) -> Callable[[], RunDrafts] | None:
        """For a Decode with lookup_draft_length: a maker of the run's own prompt-lookup drafts
        (specdec.repeats), called on the engine thread after the run's first step (the index is built
        from the request's tokens then); None without. Checked: greedy, without allowed_tokens (a
        grammar comes as response_format), penalties or logprobs."""
        n = request.lookup_draft_length
        if n > MAX_DRAFT_LENGTH:
            raise InvalidArgument("lookup_draft_length", f"must be at most {MAX_DRAFT_LENGTH}, got {n}")
        if n == 0:
            return None
        if request.HasField("allowed_tokens"):
            raise InvalidArgument(
                "lookup_draft_length", "drafts a run without allowed_tokens only (send response_format)"
            )
        if sampling.has_penalties or has_logprobs:
            raise InvalidArgument("lookup_draft_length", "drafts a run without penalties, logit_bias or logprobs only")
        costs, engine = self.identity.verify_costs_ms or None, self.worker.built_engine
        answers, learned = self.answers, self.learned_answers
        drafts_learned = None if learned is None else functools.partial(learned.draft, tenant_of(request_id))
        self._speculating.add(request_id)
        return lambda: RunDrafts(engine().token_ids(request_id), n, costs, answers, drafts_learned)

    def _sampling(self, request) -> SamplingParams:
        """The request's sampling parameters, checked (logit_bias ids against the vocabulary too)."""
        sampling = pb.sampling_from_pb(request.sampling)
        pb.check_sampling_token_ids(sampling, self.vocab_size)
        return sampling

    def _penalized(
        self,
        request_id: str,
        logits: torch.Tensor,
        sampling: SamplingParams,
        tree_token_ids: Sequence[int] = (),
        tree_parents: Sequence[int] = (),
    ) -> torch.Tensor:
        """Logits [N+1, V] processed by the request's penalties and logit_bias from each row's history
        (specdec.penalties); as they are when it has none. On the engine thread, after this step's
        commit: the engine's tokens are the context up to the pending (root) token."""
        if not sampling.has_penalties:
            return logits
        engine = self.worker.built_engine()
        output_ids = engine.output_token_ids(request_id)
        context = engine.token_ids(request_id)
        prompt_ids = context[: len(context) - len(output_ids)]
        return penalize(logits, sampling, prompt_ids, output_ids, tree_token_ids, tree_parents)

    def _decode_run(self, request, is_unmasked: bool, max_run_tokens: int) -> tuple[int, frozenset[int]]:
        """A Decode's max_tokens (at least 1, at most max_run_tokens) and stop token ids, checked."""
        max_tokens = max(1, request.max_tokens)
        if max_tokens > max_run_tokens:
            raise InvalidArgument("max_tokens", f"must be at most {max_run_tokens}, got {request.max_tokens}")
        if max_tokens > 1 and not is_unmasked:
            raise InvalidArgument(
                "max_tokens", "more than one token a call needs no allowed_tokens (send response_format)"
            )
        self.worker.built_engine().check_token_ids("stop_token_ids", request.stop_token_ids)
        return max_tokens, frozenset(request.stop_token_ids)

    def _run_repeats(self, request, request_id: str) -> Callable[[int], bool] | None:
        """For a Decode with stop_at_repeat_tokens: decoded token -> whether the context's tail repeats
        earlier text with it (specdec.repeats), the index built from the request's tokens at the run's
        first step (on the engine thread); None without."""
        n = request.stop_at_repeat_tokens
        if n > MAX_REPEAT_TOKENS:
            raise InvalidArgument("stop_at_repeat_tokens", f"must be at most {MAX_REPEAT_TOKENS}, got {n}")
        if n == 0:
            return None
        index: list[RepeatIndex] = []

        def repeats(token: int) -> bool:
            if not index:
                index.append(RepeatIndex(self.worker.built_engine().token_ids(request_id), n))
            index[0].extend((token,))
            return index[0].tail_repeats()

        return repeats

    def _run_grammar(
        self, request, request_id: str, has_allowed_tokens: bool, remaining_s: float | None
    ) -> Callable[[list[int]], GrammarState] | None:
        """For a Decode with a response_format: output token ids -> the request's grammar state past
        them (primary_svc.run_grammars); compiled, or its compile under way (a Prefill's) waited for, at
        most until the call's deadline. None without one."""
        response_format = pb.response_format_from_pb(request.response_format)
        check_run_grammar(response_format, has_allowed_tokens)
        if response_format is None:
            return None
        if self.run_grammars is None:
            raise FailedPrecondition("response_format", "this primary serves no grammars")
        deadline = None if remaining_s is None else time.monotonic() + remaining_s
        grammars, compiled = self.run_grammars, self.run_grammars.compile(response_format, deadline)
        return lambda output: grammars.state(request_id, compiled, output)

    def _prepare_grammar(self, request) -> None:
        """A Prefill's response_format, checked (InvalidArgument naming the field), its compile begun
        for the request's runs (RunGrammars.prepare); a primary that serves no grammars ignores it
        (the request's runs under it are refused, FAILED_PRECONDITION)."""
        if not request.HasField("response_format"):
            return
        response_format = pb.response_format_from_pb(request.response_format)
        if response_format is not None and self.run_grammars is not None:
            self.run_grammars.prepare(response_format)

    def _take_over(self, request_id: str, kv_lease: str) -> None:
        """A Prefill of a live request: allowed to its lease's holder, or to anyone once the slot
        has had no call for leases.takeover_s (the request is then forgotten here, to be replaced);
        else ALREADY_EXISTS and the request runs on untouched. A request whose own Prefill is still
        queued has no lease yet, so nobody can replace it."""
        if not self.leases.may_replace(request_id, kv_lease):
            raise AlreadyExists(
                "request_id",
                f"request {request_id!r} is active on this primary; only its kv_lease's holder may prefill it "
                f"again (anyone, after {self.leases.takeover_s:g} s without a call)",
            )
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """What the service keeps of a request beside the engine: its lease and grammar state."""
        self.leases.drop(request_id)
        self._speculating.discard(request_id)
        if self.run_grammars is not None:
            self.run_grammars.drop(request_id)

    def Release(self, request, context):
        request_id = pb.request_id_from_pb(request.request_id)
        self.leases.check(request_id, request.kv_lease)
        is_speculating = request_id in self._speculating
        self._forget(request_id)

        def release(engine: Engine) -> int:
            # On the engine thread, as expiry does: a Verify of the request in its step writes its slot
            # there, before this call runs (removed here) or never (its queued work fails NOT_FOUND).
            self.logits_slots.release(request_id)
            if is_speculating and self.learned_answers is not None and engine.has_request(request_id):
                output = engine.output_token_ids(request_id)
                prompt = engine.token_ids(request_id)[: engine.num_tokens(request_id) - len(output)]
                self.learned_answers.add(tenant_of(request_id), prompt, output)
            return engine.release(request_id)

        freed = self.worker.call(release)
        self._observe_kv()
        return primary_pb2.PrimaryServiceReleaseResponse(freed_kv_bytes=freed)

    def expire_idle_requests(self) -> list[str]:
        """Release every request whose lease ran out (no call for leases.lease_s); returns their ids."""

        def run(engine: Engine) -> list[str]:
            expired = self.leases.take_expired()
            for request_id in expired:
                self.logits_slots.release(request_id)
                self._speculating.discard(request_id)
                if self.run_grammars is not None:
                    self.run_grammars.drop(request_id)
                if engine.has_request(request_id):
                    engine.release(request_id)
            return expired

        expired = self.worker.call(run)
        if expired:
            self._observe_kv()
        return expired

    def GetStats(self, request, context):
        engine = self.worker.built_engine()
        response = primary_pb2.GetStatsResponse(
            num_active_requests=engine.num_active_requests,
            kv_bytes=engine.kv_bytes,
            max_kv_bytes=self.max_kv_bytes,
            weight_bytes=self.loaded.weight_bytes,
            queue_depth=self.worker.queue_depth,
        )
        if (cache := engine.prefix_cache) is not None:  # plain ints the engine thread updates: read as they are
            response.prefix_cache_bytes = cache.num_bytes
            response.max_prefix_cache_bytes = cache.max_bytes
            response.num_prefix_query_tokens = cache.stats.num_query_tokens
            response.num_prefix_reused_tokens = cache.stats.num_reused_tokens
            response.prefix_block_tokens = cache.block_tokens
        return response

    def _allowed_tokens(self, request, num_rows: int) -> TokenBitmask | None:
        """The request's grammar mask, num_rows packed rows, or None when it has none."""
        if not request.HasField("allowed_tokens"):
            return None
        return pb.token_mask_from_pb(request.allowed_tokens, num_rows, self.vocab_size, "allowed_tokens")

    def _observe_kv(self) -> None:
        if self.metrics is not None:
            # specdec_kv_requests is the engine thread's to set (EngineWorker._observe): it counts the
            # requests holding a slot, which only that thread can list while the engine runs
            self.metrics.observe_kv(self.worker.built_engine().kv_bytes, self.max_kv_bytes)
            self.metrics.queue_depth.set(self.worker.queue_depth)
            self.metrics.scheduler_waiting.set(self.worker.num_waiting)
