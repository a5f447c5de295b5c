"""The engine thread: concurrent verify work is batched into one forward, results unchanged."""
from __future__ import annotations

import threading

import torch

from primary_svc.worker import EngineWorker
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.errors import InvalidArgument

PROMPTS = [[1, 504, 3458, 282], [1, 9690, 198, 2683, 253], [1, 30760, 563], [1, 260, 1945, 28, 837]]
TREES = [([700, 701], [-1, 0]), ([5], [-1]), ([], []), ([11, 12, 13], [-1, -1, 0])]


def unbatched(fp32_model) -> list[torch.Tensor]:
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), 1024)
    out = []
    for i, (prompt, (ids, parents)) in enumerate(zip(PROMPTS, TREES)):
        engine.open(f"r{i}", prompt)
        out.append(engine.verify(f"r{i}", ids, parents))
    return out


def test_concurrent_verifies_are_batched_and_equal_to_one_at_a_time(fp32_model):
    expected = unbatched(fp32_model)
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), 1024)
    worker = EngineWorker(engine, max_batch=32, min_batch=4, max_wait_ms=500)
    try:
        for i, prompt in enumerate(PROMPTS):
            worker.call(lambda e, i=i, prompt=prompt: e.open(f"r{i}", prompt))
        results: dict[int, torch.Tensor] = {}

        def run(i: int) -> None:
            ids, parents = TREES[i]
            results[i] = worker.verify(f"r{i}", (), (), ids, parents)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert worker.stats.max_batch_seen == len(PROMPTS)     # min_batch 4: all four in one forward
        for i, logits in results.items():
            torch.testing.assert_close(logits, expected[i], atol=2e-4, rtol=0)
    finally:
        worker.stop()


def test_a_bad_item_fails_alone_and_a_lone_request_never_waits(fp32_model):
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), 1024)
    worker = EngineWorker(engine, max_batch=32, min_batch=4, max_wait_ms=60_000)
    try:
        worker.call(lambda e: e.open("a", PROMPTS[0]))
        # One active request: the 60 s window must not be waited for.
        logits, _ = worker.verify("a", (), (), [700], [-1])
        assert logits.shape == (2, fp32_model.config.vocab_size)
        try:
            worker.verify("a", [5], [9, 9], [1], [-1])             # node 5 is not in the last tree
        except InvalidArgument as e:
            assert e.field == "accepted_nodes"
        else:
            raise AssertionError("a bad commit was accepted")
        worker.call(lambda e: e.release("a"))
        assert engine.kv_bytes == 0
    finally:
        worker.stop()
