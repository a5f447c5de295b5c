"""The engine thread's scheduler on the real default model: concurrent verifies share a step,
long prompts are prefilled in chunks between other requests' steps with unchanged results,
prefills wait for KV room instead of failing, and preempted requests re-prefill and continue."""

from __future__ import annotations

import threading
from collections.abc import Callable
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from primary_svc import step_report
from primary_svc.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS
from primary_svc.worker import EngineWorker, RunStep
from specdec.engine.engine import PREFILL_CHUNK_TOKENS, Engine, VerifyWork
from specdec.engine.kv_cache import KVCache
from specdec.engine.prefix_cache import PrefixCache
from specdec.engine.loading import load_model
from specdec.errors import Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted
from primary_svc.metrics import PrimaryMetrics

PROMPTS = [[1, 504, 3458, 282], [1, 9690, 198, 2683, 253], [1, 30760, 563], [1, 260, 1945, 28, 837]]
TREES = [([700, 701], [-1, 0]), ([5], [-1]), ([], []), ([11, 12, 13], [-1, -1, 0])]
LONG_PROMPT = [1] + [(i * 7919) % 40000 + 100 for i in range(300)]
MAX_CONTEXT = 1024


def wait_until(predicate: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Whether predicate() held within timeout_s, polled: a state the engine thread reaches."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(scope="module")
def int4_model(default_model_dir):
    return load_model(default_model_dir, "int4", max_positions=MAX_CONTEXT, is_shared=False)


def new_engine(loaded, max_bytes: int | None = None) -> Engine:
    return Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype, max_bytes=max_bytes), MAX_CONTEXT)


class Paused:
    """Holds the engine thread in a call until released, so that work queued meanwhile shares a step."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker, self.event, entered = worker, threading.Event(), threading.Event()

        def hold(engine: Engine) -> None:
            entered.set()
            self.event.wait(60)

        self.done = threading.Thread(target=worker.call, args=(hold,))
        self.done.start()
        assert entered.wait(60), "the engine thread is holding"

    def release_when_queued(self, num_items: int) -> None:
        wait_until(lambda: self.worker.queue_depth >= num_items)
        self.event.set()
        self.done.join()


def unbatched(fp32_model) -> list[torch.Tensor]:
    engine = new_engine(fp32_model)
    out = []
    for i, (prompt, (ids, parents)) in enumerate(zip(PROMPTS, TREES)):
        engine.open(f"r{i}", prompt)
        out.append(engine.verify(f"r{i}", ids, parents))
    return out


def test_concurrent_verifies_share_one_step_and_equal_one_at_a_time(fp32_model):
    expected = unbatched(fp32_model)
    engine = new_engine(fp32_model)
    worker = EngineWorker(engine)
    try:
        for i, prompt in enumerate(PROMPTS):
            worker.call(lambda e, i=i, prompt=prompt: e.open(f"r{i}", prompt))
        paused = Paused(worker)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [
                pool.submit(lambda i=i: worker.verify(f"r{i}", (), (), *TREES[i])[0]) for i in range(len(PROMPTS))
            ]
            paused.release_when_queued(len(PROMPTS))
            results = [f.result() for f in futures]
        assert worker.stats.max_batch_seen == len(PROMPTS)  # all four in one step, one forward
        # opened without a prefill: each verify runs its prompt's rows and its tree's; a `finish` reads
        # the step's rows (what a Verify/Decode response reports as the load)
        assert worker.step_history[-1].num_verify_rows == sum(len(p) + len(t[0]) for p, t in zip(PROMPTS, TREES))
        assert worker.step_rows == worker.step_history[-1].num_verify_rows
        for logits, want in zip(results, expected):
            torch.testing.assert_close(logits, want, atol=2e-4, rtol=0)  # fp32 GEMMs round per row count
    finally:
        worker.stop()


def test_a_bad_item_fails_alone_and_a_lone_request_never_waits(fp32_model):
    engine = new_engine(fp32_model)
    worker = EngineWorker(engine)
    try:
        worker.call(lambda e: e.open("a", PROMPTS[0]))
        logits, _ = worker.verify("a", (), (), [700], [-1])
        assert logits.shape == (2, fp32_model.config.vocab_size)
        with pytest.raises(InvalidArgument) as e:
            worker.verify("a", [5], [9, 9], [1], [-1])  # node 5 is not in the last tree
        assert e.value.field == "accepted_nodes"
        worker.call(lambda e: e.release("a"))
        assert engine.kv_bytes == 0
    finally:
        worker.stop()


def decode_steps(worker: EngineWorker, request_id: str, num_steps: int) -> list[torch.Tensor]:
    """num_steps greedy 1-row decode steps through the worker: each commits the last argmax."""
    out, pending = [], ()
    for _ in range(num_steps):
        logits, _ = worker.verify(request_id, (), pending, (), ())
        out.append(logits)
        pending = (int(torch.argmax(logits[0])),)
    return out


def reference(loaded, prompt, num_steps: int, chunk_tokens: int) -> list[torch.Tensor]:
    """The same decode steps after one uninterrupted Engine.prefill, on an engine of its own."""
    engine = new_engine(loaded)
    engine.open("ref", prompt)
    engine.prefill("ref", chunk_tokens=chunk_tokens)
    out, pending = [], ()
    for _ in range(num_steps):
        if pending:
            engine.commit("ref", (), pending)
        logits = engine.verify("ref", (), ())
        out.append(logits)
        pending = (int(torch.argmax(logits[0])),)
    return out


def chunked_while_another_decodes(loaded, chunk_tokens: int, max_step_tokens: int) -> tuple[list, EngineWorker]:
    """Prefill LONG_PROMPT through the scheduler while request 'busy' keeps decoding; then decode it."""
    worker = EngineWorker(new_engine(loaded), max_step_tokens=max_step_tokens, prefill_chunk_tokens=chunk_tokens)
    worker.prefill("busy", PROMPTS[1])
    stop = threading.Event()

    def keep_decoding() -> None:
        pending = ()
        while not stop.is_set():
            logits, _ = worker.verify("busy", (), pending, (), ())
            pending = (int(torch.argmax(logits[0])),)

    busy = threading.Thread(target=keep_decoding)
    busy.start()
    try:
        assert worker.prefill("long", LONG_PROMPT) == len(LONG_PROMPT) - 1
    finally:
        stop.set()
        busy.join()
    return decode_steps(worker, "long", 3), worker


def test_the_default_chunk_is_the_engines_so_fp32_prefills_keep_their_bits():
    assert DEFAULT_PREFILL_CHUNK_TOKENS == PREFILL_CHUNK_TOKENS


def test_chunked_prefill_between_other_steps_equals_one_prefill_fp32(fp32_model):
    """fp32: chunks cut where an uninterrupted prefill of the same chunk size cuts, each its own
    forward, so the logits are bit for bit those of Engine.prefill."""
    got, worker = chunked_while_another_decodes(fp32_model, chunk_tokens=64, max_step_tokens=96)
    try:
        for g, want in zip(got, reference(fp32_model, LONG_PROMPT, 3, chunk_tokens=64)):
            assert torch.equal(g, want)
        prefills = [s for s in worker.step_history if s.num_prefill_rows]
        assert len(prefills) >= 5 and all(s.num_prefill_rows <= 64 for s in prefills)  # 300 tokens, 64 a step
        assert any(s.num_verify_rows for s in prefills), "the other request decoded between the chunks"
    finally:
        worker.stop()


def test_chunked_prefill_mixed_with_verify_rows_equals_one_prefill_int4(int4_model):
    """int4 (native kernels, row-exact): chunks cut anywhere, mixed in one forward with other
    requests' verify rows, still give the bits of an uninterrupted prefill in the default 512 chunks."""
    assert int4_model.model.is_batch_invariant
    got, worker = chunked_while_another_decodes(int4_model, chunk_tokens=48, max_step_tokens=48)
    try:
        for g, want in zip(got, reference(int4_model, LONG_PROMPT, 3, chunk_tokens=512)):
            assert torch.equal(g, want)
        mixed = [s for s in worker.step_history if s.num_prefill_rows and s.num_verify_rows]
        assert mixed and all(s.num_forwards == 1 for s in worker.step_history)
        assert all(s.num_verify_rows + s.num_prefill_rows <= 48 for s in mixed), "chunks cut to the budget's rest"
    finally:
        worker.stop()


def test_prefills_of_several_requests_share_a_step(int4_model):
    metrics = PrimaryMetrics(CollectorRegistry())
    worker = EngineWorker(new_engine(int4_model), max_step_tokens=512, prefill_chunk_tokens=128, metrics=metrics)
    try:
        paused = Paused(worker)
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(worker.prefill, f"p{i}", LONG_PROMPT[: 200 + i]) for i in range(3)]
            paused.release_when_queued(3)
            assert [f.result() for f in futures] == [199, 200, 201]
        assert worker.step_history[0].num_prefill_chunks == 3
        assert worker.step_history[0].num_prefill_rows == 3 * 128
        value = metrics.registry.get_sample_value
        assert value("specdec_engine_steps_total") == 2  # 384 rows, then the rests (71 + 72 + 73)
        assert value("specdec_engine_step_rows_sum", {"kind": "prefill"}) == 199 + 200 + 201
        assert value("specdec_engine_step_rows_sum", {"kind": "verify"}) == 0
        assert value("specdec_scheduler_waiting_requests") == 0
        assert value("specdec_scheduler_running_requests") == 3
        assert value("specdec_preemptions_total") == 0
        report = step_report.parse(generate_latest(metrics.registry).decode()).summary()
        assert value("specdec_engine_step_seconds_count") == 2
        assert report.pop("mean_step_ms") > 0  # the forwards' wall time, whatever this machine's speed
        assert report == {
            "steps": 2,
            "preemptions": 0,
            "verify_rows_per_step": 0,
            "prefill_rows_per_step": 300,
            "steps_with_verify": 0,
            "steps_with_prefill": 2,
        }
    finally:
        worker.stop()


def test_a_prefill_waits_for_kv_room_instead_of_failing(fp32_model):
    probe = new_engine(fp32_model)
    one = probe.kv_bytes_to_open(len(LONG_PROMPT))
    worker = EngineWorker(new_engine(fp32_model, max_bytes=one + one // 2))  # room for one long prompt
    try:
        worker.prefill("a", LONG_PROMPT)
        with pytest.raises(DeadlineExceeded):
            worker.prefill("b", LONG_PROMPT, timeout_s=0.3)
        assert worker.engine.kv_bytes == one and not worker.engine.has_request("b")
        with ThreadPoolExecutor(1) as pool:
            waiting: Future = pool.submit(worker.prefill, "b", LONG_PROMPT)
            deadline = time.monotonic() + 60  # until the worker has taken "b" into its queue
            while worker.num_waiting == 0 and not waiting.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert worker.num_waiting == 1 and not waiting.done()
            worker.call(lambda e: e.release("a"))
            assert waiting.result(timeout=120) == len(LONG_PROMPT) - 1
        with pytest.raises(ResourceExhausted):  # never fits, even alone: at once
            worker.prefill("huge", LONG_PROMPT * 2)
        worker.call(lambda e: e.release("b"))
        assert worker.engine.kv_bytes == 0 and worker.num_waiting == 0
    finally:
        worker.stop()


def test_preemption_releases_the_newest_and_it_continues_after_a_re_prefill(int4_model):
    """Two requests whose slots fill the budget; the older one's tree needs its slot to grow, so the
    newer one is preempted; its next verify waits for room (the older one finishing), re-prefills
    it from its committed tokens and runs. int4: every logit equals the run without preemption."""
    probe = new_engine(int4_model)
    prompts = {"old": LONG_PROMPT[:120], "new": LONG_PROMPT[:100]}
    slots = sum(probe.kv_bytes_to_open(len(p)) for p in prompts.values())
    tree = ([7] * 16, list(range(-1, 15)))  # a 16-deep chain: 'old' must grow
    growth = probe.kv_cache.bytes_for_rows(len(prompts["old"]) + 16) - probe.kv_bytes_to_open(len(prompts["old"]))
    assert growth > 0
    worker = EngineWorker(new_engine(int4_model, max_bytes=slots + growth // 2))
    unlimited = EngineWorker(new_engine(int4_model))
    try:
        results = {}
        for w in (worker, unlimited):
            for rid, prompt in prompts.items():
                w.prefill(rid, prompt)
            first_new, _ = w.verify("new", (), (), (), ())
            big, _ = w.verify("old", (), (), *tree)
            if w is worker:
                assert w.stats.num_preemptions == 1 and w.engine.is_evicted("new")
            nxt = int(torch.argmax(first_new[0]))
            with ThreadPoolExecutor(1) as pool:
                after = pool.submit(w.verify, "new", (), (nxt,), (5, 6), (-1, 0))
                if w is worker:
                    # Once it waits for room it cannot finish before "old" is released below.
                    assert wait_until(lambda: w.num_waiting == 1), "the preempted request waits for room"
                    assert not after.done()  # no room to re-prefill yet
                w.call(lambda e: e.release("old"))
                results[w is worker] = (first_new, big, after.result(timeout=120)[0])
        assert not worker.engine.is_evicted("new") and unlimited.stats.num_preemptions == 0
        for got, want in zip(results[True], results[False]):
            assert torch.equal(got, want)
        worker.call(lambda e: e.release("new"))
        assert worker.engine.kv_bytes == 0
    finally:
        worker.stop()
        unlimited.stop()


def test_a_cancelled_run_waiting_for_its_re_prefill_leaves_the_queue_without_it(int4_model):
    """A streamed run whose request was preempted waits for room to re-prefill; cancelled meanwhile (its
    caller went away), it leaves the queue at the next step: no re-prefill of its context into the room,
    no step. Before, only the queued verifies of cancelled runs were dropped: the waiting one was first
    re-prefilled (its whole context computed, its KV taken, ahead of every new prompt) for a caller that
    was gone, and only then dropped."""
    probe = new_engine(int4_model)
    prompts = {"old": LONG_PROMPT[:120], "new": LONG_PROMPT[:100]}
    slots = sum(probe.kv_bytes_to_open(len(p)) for p in prompts.values())
    tree = ([7] * 16, list(range(-1, 15)))  # a 16-deep chain: 'old' must grow, 'new' is preempted
    growth = probe.kv_cache.bytes_for_rows(len(prompts["old"]) + 16) - probe.kv_bytes_to_open(len(prompts["old"]))
    worker = EngineWorker(new_engine(int4_model, max_bytes=slots + growth // 2))
    try:
        for rid, prompt in prompts.items():
            worker.prefill(rid, prompt)
        first, _ = worker.verify("new", (), (), (), ())
        worker.verify("old", (), (), *tree)
        assert worker.engine.is_evicted("new")
        steps: list[bool] = []
        cancel = threading.Event()
        run = worker.stream_decode(
            "new",
            (),
            (int(torch.argmax(first[0])),),
            lambda logits: int(torch.argmax(logits[0])),
            lambda token: RunStep((token,)),
            lambda _token, _ms, is_last: steps.append(is_last),
            cancel,
        )
        assert wait_until(lambda: worker.num_waiting == 1), "the preempted run waits for room"
        cancel.set()  # its caller went away
        worker.call(lambda e: e.release("old"))  # room again: a step follows this call
        with pytest.raises(Cancelled):
            run.result(timeout=120)
        assert steps == [] and worker.num_waiting == 0 and worker.engine.is_evicted("new")
        assert worker.engine.kv_bytes == 0
        worker.call(lambda e: e.release("new"))
    finally:
        worker.stop()


def test_a_preempted_request_leaves_the_kv_gauges(int4_model):
    """specdec_kv_requests counts the requests holding a KV slot: a preempted one keeps its tokens
    but not its slot (Engine.evict) until it re-prefills; specdec_kv_bytes drops with its slot."""
    probe = new_engine(int4_model)
    prompts = {"old": LONG_PROMPT[:120], "new": LONG_PROMPT[:100]}
    slots = sum(probe.kv_bytes_to_open(len(p)) for p in prompts.values())
    tree = ([7] * 16, list(range(-1, 15)))  # a 16-deep chain: 'old' must grow
    growth = probe.kv_cache.bytes_for_rows(len(prompts["old"]) + 16) - probe.kv_bytes_to_open(len(prompts["old"]))
    metrics = PrimaryMetrics(CollectorRegistry())
    worker = EngineWorker(new_engine(int4_model, max_bytes=slots + growth // 2), metrics=metrics)
    value = metrics.registry.get_sample_value
    try:
        for rid, prompt in prompts.items():
            worker.prefill(rid, prompt)
        worker.call(lambda e: None)  # the engine thread observed the metrics after the prefills' turn
        assert value("specdec_kv_requests") == 2 and value("specdec_kv_bytes") == slots
        worker.verify("old", (), (), *tree)  # grows 'old', preempts 'new'
        assert worker.engine.is_evicted("new") and worker.engine.has_request("new")
        worker.call(lambda e: None)
        assert value("specdec_kv_requests") == 1
        assert value("specdec_kv_bytes") == worker.engine.kv_bytes == worker.engine.kv_bytes_of("old")
    finally:
        worker.stop()


def test_the_queue_depth_gauge_says_what_each_turn_left(int4_model):
    """specdec_queue_depth was set after a Prefill or Release RPC only: the calls in between
    (Verify, Decode) came and went, and the gauge kept its last figure for good once traffic stopped."""
    metrics = PrimaryMetrics(CollectorRegistry())
    worker = EngineWorker(new_engine(int4_model), metrics=metrics)
    try:
        metrics.queue_depth.set(3)  # the figure an RPC left while three calls waited
        worker.call(lambda e: None)
        assert metrics.registry.get_sample_value("specdec_queue_depth") == 0
    finally:
        worker.stop()


def test_concurrent_greedy_requests_equal_each_one_alone_int4(int4_model):
    """Four requests at once (chunked prompts, verify rows and chunks sharing forwards, a KV budget
    with no room to grow, so a request may wait or be preempted, depending on the order of arrival)
    produce the logits each produces alone. int4: bit for bit."""
    prompts = {f"c{i}": LONG_PROMPT[i * 20 : i * 20 + 60 + 25 * i] for i in range(4)}
    alone = {}
    for rid, prompt in prompts.items():
        worker = EngineWorker(new_engine(int4_model))
        try:
            worker.prefill(rid, prompt)
            alone[rid] = decode_steps(worker, rid, 6)
        finally:
            worker.stop()
    probe = new_engine(int4_model)
    budget = sum(probe.kv_bytes_to_open(len(p)) for p in prompts.values())  # no room for any slot to grow
    worker = EngineWorker(new_engine(int4_model, max_bytes=budget), max_step_tokens=40, prefill_chunk_tokens=32)
    try:

        def run(rid: str) -> list[torch.Tensor]:
            worker.prefill(rid, prompts[rid])
            out = decode_steps(worker, rid, 6)
            worker.call(lambda e: e.release(rid))  # done: its KV lets the others grow
            return out

        with ThreadPoolExecutor(len(prompts)) as pool:
            together = dict(zip(prompts, pool.map(run, prompts)))
        for rid in prompts:
            assert all(torch.equal(a, b) for a, b in zip(together[rid], alone[rid])), rid
        assert worker.engine.kv_bytes == 0 and worker.num_waiting == 0
        assert any(s.num_verify_rows and s.num_prefill_rows for s in worker.step_history)
    finally:
        worker.stop()


def test_a_prefill_continues_from_the_prefix_cache_between_other_steps_int4(int4_model):
    """Through the scheduler: the second prompt sharing a 256-token prefix reuses its rows, runs only
    its own rest in chunks mixed with another request's decode steps, and decodes exactly as one
    uninterrupted prefill without the cache would. The metrics count the lookup and the reuse."""
    prompt_b = LONG_PROMPT[:257] + [(i * 104729) % 40000 + 100 for i in range(30)]
    want = reference(int4_model, prompt_b, 3, chunk_tokens=512)
    metrics = PrimaryMetrics(CollectorRegistry())
    engine = Engine(int4_model.model, KVCache(int4_model.config, int4_model.model.kv_dtype), MAX_CONTEXT, PrefixCache())
    worker = EngineWorker(engine, max_step_tokens=48, prefill_chunk_tokens=48, metrics=metrics)
    try:
        worker.prefill("a", LONG_PROMPT)
        worker.prefill("other", PROMPTS[1])
        stop = threading.Event()

        def keep_decoding() -> None:
            while not stop.is_set():
                decode_steps(worker, "other", 1)

        with ThreadPoolExecutor(1) as pool:
            decoding = pool.submit(keep_decoding)
            assert worker.prefill("b", prompt_b) == len(prompt_b) - 1
            stop.set()
            decoding.result()
        assert worker.call(lambda e: e.num_reused_tokens("b")) == 257  # every shared token
        for got, expected in zip(decode_steps(worker, "b", 3), want):
            assert torch.equal(got, expected)
        reused = worker.call(lambda e: [e.num_reused_tokens(r) for r in ("a", "other", "b")])
        worker.call(lambda e: [e.release(r) for r in ("a", "other", "b")])
        assert engine.kv_bytes == 0 and engine.prefix_cache.num_bytes > 0  # the cache is not KV budget
        worker.call(lambda e: None)  # the engine thread observed the metrics after the release's turn
        value = metrics.registry.get_sample_value
        assert value("specdec_prefix_cache_queries_total") == 3
        # "other" shares its first token (BOS) with "a": a one-row hit
        assert value("specdec_prefix_cache_hits_total") == sum(n > 0 for n in reused) == 2
        assert value("specdec_prefix_cache_tokens_total", {"kind": "reused"}) == sum(reused)
        queried = len(LONG_PROMPT) - 1 + len(PROMPTS[1]) - 1 + len(prompt_b) - 1
        assert value("specdec_prefix_cache_tokens_total", {"kind": "queried"}) == queried
        assert value("specdec_prefix_cache_bytes") == engine.prefix_cache.num_bytes
        assert value("specdec_prefix_cache_blocks") == engine.prefix_cache.num_blocks
    finally:
        worker.stop()


def test_a_burst_sharing_a_system_prompt_computes_it_once_int4(int4_model):
    """Three prompts arrive together, two with the same 64-token start (a system prompt), one not:
    the second sits out one step, then takes those rows from the prefix cache instead of computing
    them again; the unrelated one is not held. Every request decodes as an uninterrupted prefill."""
    system = LONG_PROMPT[:64]
    prompts = {
        "first": system + [(i * 31) % 40000 + 100 for i in range(20)],
        "second": system + [(i * 37) % 40000 + 100 for i in range(25)],
        "unrelated": [1] + [(i * 41) % 40000 + 100 for i in range(40)],
    }
    want = {rid: reference(int4_model, p, 2, chunk_tokens=512) for rid, p in prompts.items()}
    engine = Engine(int4_model.model, KVCache(int4_model.config, int4_model.model.kv_dtype), MAX_CONTEXT, PrefixCache())
    worker = EngineWorker(engine)
    try:
        paused = Paused(worker)
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = {rid: pool.submit(worker.prefill, rid, p) for rid, p in prompts.items()}
            paused.release_when_queued(len(prompts))
            assert all(f.result() == len(prompts[rid]) - 1 for rid, f in futures.items())
        reused = {rid: worker.call(lambda e, rid=rid: e.num_reused_tokens(rid)) for rid in prompts}
        assert reused == {"first": 0, "second": 65, "unrelated": 0}  # the system prompt, and both go on with 100
        prefilled = sum(s.num_prefill_rows for s in worker.step_history)
        assert prefilled == sum(len(p) - 1 for p in prompts.values()) - 65  # the system prompt (and a 100) once
        for rid in prompts:
            assert all(torch.equal(a, b) for a, b in zip(decode_steps(worker, rid, 2), want[rid])), rid
    finally:
        worker.stop()


def test_a_float_engines_prefix_cache_must_share_the_schedulers_chunk_grid(fp32_model):
    """Without batch invariance cached rows are reused on the prefill-chunk grid: a scheduler cutting
    prompts elsewhere would make them differ from a fresh prefill, so the pairing is refused."""
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), MAX_CONTEXT, PrefixCache(), 512)
    with pytest.raises(ValueError, match="multiples of 512"):
        EngineWorker(engine, prefill_chunk_tokens=64)


def test_a_request_preempted_during_its_prefill_is_readmitted_and_finishes_it_int4(int4_model):
    """The newest request is preempted in the middle of its prefill (another's tree needs the KV):
    once room returns it gets a slot again, re-prefills (its prefix from the prefix cache) and its
    Prefill succeeds with the logits of a run without preemption."""
    old, new = LONG_PROMPT[:120], (LONG_PROMPT * 2)[:600]
    probe = new_engine(int4_model)
    growth = probe.kv_cache.bytes_for_rows(len(old) + 16) - probe.kv_bytes_to_open(len(old))
    budget = probe.kv_bytes_to_open(len(old)) + probe.kv_bytes_to_open(len(new)) + growth // 2
    kv = KVCache(int4_model.config, int4_model.model.kv_dtype, max_bytes=budget)
    worker = EngineWorker(Engine(int4_model.model, kv, MAX_CONTEXT, PrefixCache()), 32, 16, 16)
    try:
        worker.prefill("old", old)
        with ThreadPoolExecutor(2) as pool:
            paused = Paused(worker)
            prefilled = pool.submit(worker.prefill, "new", new)
            paused.release_when_queued(1)
            deadline = time.monotonic() + 120
            while not worker.call(lambda e: e.has_request("new")):
                assert time.monotonic() < deadline, "the new request was never admitted"
                time.sleep(0.01)
            paused = Paused(worker)  # between two of its chunks
            assert 0 < worker.engine.num_cached("new") < len(new) - 1
            grown = pool.submit(worker.verify, "old", (), (), [7] * 16, list(range(-1, 15)))
            paused.release_when_queued(1)
            grown.result(timeout=120)
            assert worker.stats.num_preemptions == 1 and worker.engine.is_evicted("new")
            worker.call(lambda e: e.release("old"))
            assert prefilled.result(timeout=120) == len(new) - 1
        assert worker.call(lambda e: e.num_reused_tokens("new")) > 0
        for got, want in zip(decode_steps(worker, "new", 2), reference(int4_model, new, 2, chunk_tokens=512)):
            assert torch.equal(got, want)
        worker.call(lambda e: e.release("new"))
        assert worker.engine.kv_bytes == 0
    finally:
        worker.stop()


def test_a_step_waits_for_the_requests_coming_back_and_not_for_the_others(fp32_model):
    """With a batch wait, a step holds for the running requests whose results just went out, so one
    coming back a little later shares the step; a request released meanwhile holds nothing."""
    engine = new_engine(fp32_model)
    # waits and windows far longer than the test: only a request's return (or release) ends a wait
    worker = EngineWorker(engine, batch_wait_s=60.0, return_window_s=600.0)
    try:
        for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
            worker.call(lambda e, rid=rid, prompt=prompt: e.open(rid, prompt))
        with ThreadPoolExecutor(3) as pool:
            # the engine thread busy meanwhile, both first verifies queue up and share a step (one
            # run alone would send its result out, and the other's step would then hold for it)
            started, release = threading.Event(), threading.Event()

            def hold(_engine: Engine) -> None:
                started.set()
                release.wait(30)

            busy = pool.submit(worker.call, hold)
            assert started.wait(30), "the engine thread never ran the call"
            first = [pool.submit(worker.verify, rid, (), (), (), ()) for rid in ("a", "b")]
            assert wait_until(lambda: worker.queue_depth >= 2), "the verifies never queued"
            release.set()
            busy.result(timeout=30)
            logits = {rid: f.result(timeout=30)[0] for rid, f in zip(("a", "b"), first)}
            assert (worker.step_history[-1].num_verify_items, worker.step_history[-1].num_verify_rows) == (2, 9)
            # both results went out: a's next verify waits for b's, which comes 0.2 s later
            a = pool.submit(worker.verify, "a", (), [int(torch.argmax(logits["a"][0]))], (), ())
            time.sleep(0.2)
            b = pool.submit(worker.verify, "b", (), [int(torch.argmax(logits["b"][0]))], (), ())
            a.result(timeout=30), b.result(timeout=30)
        last = worker.step_history[-1]
        assert (last.num_verify_items, last.num_verify_rows) == (2, 2)
        # b is released: a's next verify does not wait for it (the 60 s wait would time this out)
        worker.call(lambda e: e.release("b"))
        worker.verify("a", (), [1], (), ())
        assert worker.step_history[-1].num_verify_items == 1
    finally:
        worker.stop()


def test_a_step_does_not_wait_for_a_request_whose_streamed_run_ended(fp32_model):
    """The end of a streamed run (DecodeStream) is most often the end of its request: the next step
    does not hold for it (the 60 s wait would time this out), though the request stays open."""
    engine = new_engine(fp32_model)
    worker = EngineWorker(engine, batch_wait_s=60.0, return_window_s=600.0)
    try:
        for rid, prompt in (("a", PROMPTS[0]), ("b", PROMPTS[1])):
            worker.call(lambda e, rid=rid, prompt=prompt: e.open(rid, prompt))
        tokens: list[int] = []

        def finish(logits: torch.Tensor) -> int:
            tokens.append(int(torch.argmax(logits[0])))
            return tokens[-1]

        messages: list[bool] = []
        run = worker.stream_decode(
            "a",
            (),
            (),
            finish,
            lambda token: RunStep((token,), is_last=len(tokens) >= 3),
            lambda _token, _ms, is_last: messages.append(is_last),
            threading.Event(),
        )
        assert run.result(timeout=120)[0] == tokens[-1] and messages == [False, False, True]
        assert worker.call(lambda e: e.has_request("a"))
        with ThreadPoolExecutor(1) as pool:
            logits, _ = pool.submit(worker.verify, "b", (), (), (), ()).result(timeout=30)
        assert logits.shape[0] == 1 and worker.step_history[-1].num_verify_items == 1
    finally:
        worker.stop()


def test_features_asked_in_a_shared_step_are_each_requests_own_and_change_no_logits_int4(int4_model):
    """int4 (batch invariant, one forward for every item): the features a prefill or verify asks for
    equal those of the request run alone, beside items that ask for none, whose results keep their bits."""
    prompts = {f"p{i}": LONG_PROMPT[: 100 + i] for i in range(3)}  # one chunk each: one step for all
    tree = ([700, 701], [-1, 0])
    probe = new_engine(int4_model)
    want_prefill, want_rows, want_logits = {}, {}, {}
    for rid, prompt in prompts.items():
        probe.open(rid, prompt)
        out: list[torch.Tensor] = []
        probe.prefill(rid, features_out=out)
        want_prefill[rid] = out[0]
    for rid in ("p0", "p1"):
        rows: list[torch.Tensor] = []
        want_logits[rid] = probe.step([VerifyWork(rid, *tree)], [], features_out=rows)[0]
        want_rows[rid] = rows[0]
    worker = EngineWorker(new_engine(int4_model), max_step_tokens=512, prefill_chunk_tokens=128)
    try:
        paused = Paused(worker)
        features: dict[str, list[torch.Tensor]] = {"p0": [], "p2": []}
        with ThreadPoolExecutor(3) as pool:
            futures = [
                pool.submit(worker.prefill, rid, p, features_out=features.get(rid)) for rid, p in prompts.items()
            ]
            paused.release_when_queued(3)
            assert [f.result() for f in futures] == [99, 100, 101]
        assert worker.step_history[-1].num_prefill_chunks == 3 and worker.step_history[-1].num_forwards == 1
        for rid in ("p0", "p2"):
            assert len(features[rid]) == 1 and torch.equal(features[rid][0], want_prefill[rid])
        paused = Paused(worker)
        rows = []
        with ThreadPoolExecutor(2) as pool:
            asked = pool.submit(worker.verify, "p0", [], [], *tree, features_out=rows)
            other = pool.submit(worker.verify, "p1", [], [], *tree)
            paused.release_when_queued(2)
            (logits0, _), (logits1, _) = asked.result(), other.result()
        assert worker.step_history[-1].num_verify_items == 2
        assert torch.equal(rows[0], want_rows["p0"]) and rows[0].shape[0] == 3  # root + 2 nodes
        assert torch.equal(logits0, want_logits["p0"]) and torch.equal(logits1, want_logits["p1"])
    finally:
        worker.stop()


def test_a_prefill_preempted_mid_way_that_waits_past_its_deadline_leaves_no_request(fp32_model):
    """A Prefill preempted in the middle of its prompt waits (evicted, still open) for room; when its
    deadline passes there, DEADLINE_EXCEEDED forgets the request too: it was never leased, so nothing
    else would, and a later Prefill of the id would find it live (ALREADY_EXISTS) for ever."""
    old, new = LONG_PROMPT[:120], LONG_PROMPT[:300]
    probe = new_engine(fp32_model)
    growth = probe.kv_cache.bytes_for_rows(len(old) + 16) - probe.kv_bytes_to_open(len(old))
    budget = probe.kv_bytes_to_open(len(old)) + probe.kv_bytes_to_open(len(new)) + growth // 2
    worker = EngineWorker(new_engine(fp32_model, max_bytes=budget), 32, 16, 16)
    try:
        worker.prefill("old", old)
        with ThreadPoolExecutor(2) as pool:
            paused = Paused(worker)
            prefilled = pool.submit(worker.prefill, "new", new, timeout_s=600)
            paused.release_when_queued(1)
            assert wait_until(lambda: worker.call(lambda e: e.has_request("new"))), "never admitted"
            paused = Paused(worker)  # between two of its chunks
            grown = pool.submit(worker.verify, "old", (), (), [7] * 16, list(range(-1, 15)))
            paused.release_when_queued(1)
            grown.result(timeout=120)
            assert worker.engine.is_evicted("new") and worker.num_waiting == 1

            def expire(engine: Engine) -> None:  # its deadline passes while it waits for room
                for w in worker._waiting:
                    if w.prefill is not None:
                        w.prefill.deadline = time.monotonic()

            worker.call(expire)
            with pytest.raises(DeadlineExceeded):
                prefilled.result(timeout=120)
        assert not worker.call(lambda e: e.has_request("new"))
        assert worker.engine.num_active_requests == 1
    finally:
        worker.stop()
