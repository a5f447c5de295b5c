"""int4/int8: greedy tree-verify speculation equals plain greedy decoding, token for token.

The packed kernels give a row the same bits whatever the row count, and the engine attends row
by row for these models, so a k-row verify reproduces 1-row decoding exactly (not only at
non-near-ties, as bf16 does: see test_precision.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.engine.engine import Engine, VerifyWork
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.sampling import SamplingParams
from tests.specdec.engine.decoding import decode_one_token_at_a_time

PROMPT = [1, 9690, 198, 2683, 253, 30760, 563, 260, 1945, 28, 837, 2456, 357, 30, 2, 198, 1, 520, 9531, 198]
NUM_TOKENS = 16
MAX_CONTEXT = 256


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized_engine(request, default_model_dir):
    loaded = load_model(default_model_dir, request.param, max_positions=MAX_CONTEXT, is_shared=False)
    assert loaded.model.is_batch_invariant
    return Engine(loaded.model, KVCache(loaded.config, loaded.model.kv_dtype), MAX_CONTEXT)


def draft_tree(rng: random.Random, truth: list[int]) -> tuple[list[int], list[int]]:
    """A tree whose main branch follows `truth` for a random number of tokens, then goes wrong,
    with a wrong sibling at every depth: acceptance stops anywhere from depth 0 to the end."""
    num_right = rng.randint(0, len(truth))
    token_ids, parents, parent = [], [], -1
    for depth, token in enumerate(truth):
        wrong = (token + 1 + rng.randrange(1000)) % 49152
        main = token if depth < num_right else wrong
        token_ids += [main, (main + 7) % 49152]
        parents += [parent, parent]
        parent = len(token_ids) - 2
    return token_ids, parents


def speculate_greedy(engine: Engine, prompt: list[int], plain: list[int], seed: int) -> list[int]:
    rng, out = random.Random(seed), []
    engine.open("spec", prompt)
    engine.prefill("spec")
    while len(out) < len(plain):
        token_ids, parents = draft_tree(rng, plain[len(out) : len(out) + rng.randint(1, 6)])
        logits = engine.verify("spec", token_ids, parents)  # [N + 1, V]
        node, accepted = -1, []
        while True:
            best = int(logits[node + 1].argmax())
            child = next((i for i, (t, p) in enumerate(zip(token_ids, parents)) if p == node and t == best), None)
            if child is None:
                break
            accepted.append(child)
            node = child
        new_tokens = [token_ids[i] for i in accepted] + [best]
        engine.commit("spec", accepted, new_tokens)
        out += new_tokens
    engine.release("spec")
    return out[: len(plain)]


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_tree_speculation_equals_plain_decoding(quantized_engine, seed):
    plain = quantized_engine.generate(PROMPT, NUM_TOKENS, SamplingParams())
    assert speculate_greedy(quantized_engine, PROMPT, plain, seed) == plain


@pytest.mark.parametrize("k", [8])
def test_chain_verify_logits_equal_one_token_decoding_bit_for_bit(quantized_engine, k):
    engine = quantized_engine
    tokens, one_token = decode_one_token_at_a_time(engine, "one", PROMPT, k)
    engine.release("one")
    engine.open("chain", PROMPT)
    engine.prefill("chain")  # the same prompt KV as "one"
    chain = engine.verify("chain", tokens[:-1], [-1] + list(range(k - 2)))  # [k, V], same positions
    engine.release("chain")
    assert torch.equal(chain, one_token)


def test_a_recovered_request_continues_bit_for_bit(quantized_engine):
    """Re-prefilling prompt + generated tokens (a restarted primary) recomputes the generated
    tokens row by row, as decoding did: the next logits equal the uninterrupted request's."""
    engine = quantized_engine
    engine.open("live", PROMPT)
    engine.prefill("live")
    generated = []
    for _ in range(6):
        logits = engine.verify("live", (), ())
        generated.append(int(logits[0].argmax()))
        engine.commit("live", (), (generated[-1],))
    live = engine.verify("live", (), ())
    engine.release("live")
    engine.open("recovered", PROMPT + generated, len(PROMPT))
    engine.prefill("recovered")
    recovered = engine.verify("recovered", (), ())
    engine.release("recovered")
    assert torch.equal(recovered, live)


def test_tokens_committed_after_the_bonus_token_continue_bit_for_bit(quantized_engine):
    """Tokens committed behind a step's bonus token without a verify of their own (the tokens a
    grammar allows alone) run as the next verify's uncached chain, row by row as decoding ran
    them: the logits after them, and so every later step, equal one-token decoding's."""
    engine = quantized_engine
    engine.open("live", PROMPT)
    engine.prefill("live", len(PROMPT))
    generated = []
    for _ in range(6):
        generated.append(int(engine.verify("live", (), ())[0].argmax()))
        engine.commit("live", (), (generated[-1],))
    live = engine.verify("live", (), ())
    engine.release("live")
    engine.open("chained", PROMPT)
    engine.prefill("chained", len(PROMPT))
    engine.verify("chained", (), ())
    engine.commit("chained", (), generated[:2])  # the bonus token, then one without a verify
    engine.verify("chained", (), ())  # a chain of 2
    engine.commit("chained", (), generated[2:])  # the bonus token, then three without a verify
    chained = engine.verify("chained", (), ())  # a chain of 4
    engine.release("chained")
    assert torch.equal(chained, live)


def test_the_one_call_native_stack_equals_the_layer_by_layer_path(quantized_engine):
    """Where every layer is native, a forward's layers run as one native call (`NativeStack`): the
    same arithmetic in the same order as the per-layer calls, so prefill, a batched verify of two
    trees and their cache rows come out bit for bit the same."""
    engine, model = quantized_engine, quantized_engine.model
    if model.native_stack is None:
        pytest.skip("the native kernels are unavailable here")
    trees = [([5, 6, 7, 8], [-1, 0, 0, 2]), ([9, 10, 11], [-1, -1, 1])]

    def run(stack) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        saved, model.native_stack = model.native_stack, stack
        try:
            for name in ("a", "b"):
                engine.open(name, PROMPT[:10] if name == "a" else PROMPT)
                engine.prefill(name)
            logits = engine.verify_batch([VerifyWork(n, t, p) for n, (t, p) in zip("ab", trees)])
            kv = []
            for name, (tokens, _) in zip("ab", trees):  # the context, the chain row and the tree's rows
                c = engine._requests[name].kv
                end = c.num_cached + 1 + len(tokens)
                kv.append(torch.cat([c.k[:, :, :end].flatten(), c.v[:, :, :end].flatten()]))
            return logits, kv
        finally:
            model.native_stack = saved
            for name in ("a", "b"):
                engine.release(name)

    (one_call, one_call_kv), (per_layer, per_layer_kv) = run(model.native_stack), run(None)
    assert all(torch.equal(x, y) for x, y in zip(one_call, per_layer))
    assert all(torch.equal(x, y) for x, y in zip(one_call_kv, per_layer_kv))


def test_a_request_gets_the_same_bits_batched_with_others_as_alone(quantized_engine):
    """One forward over many requests' rows (one-row decodes, trees, a chain; the native stack runs
    every request's attention in one parallel loop a layer) gives each request the logits it gets
    in a forward of its own, bit for bit."""
    engine = quantized_engine
    prompts = [PROMPT[: 4 + 3 * i] for i in range(6)] + [PROMPT] * 3
    works = [
        VerifyWork(f"r{i}", *(([700 + i, 701, 702], [-1, 0, 0]) if i % 3 == 1 else ((), ())))
        for i in range(len(prompts))
    ]

    def forward(batch: list[VerifyWork]) -> list[torch.Tensor]:
        for w in batch:
            engine.open(w.request_id, prompts[int(w.request_id[1:])])
            engine.prefill(w.request_id)
            if w.request_id == "r8":
                engine.commit(w.request_id, (), (55, 56))  # this one runs a chain of 3 rows
        try:
            return engine.verify_batch(batch)
        finally:
            for w in batch:
                engine.release(w.request_id)

    together = forward(works)
    alone = [forward([w])[0] for w in works]
    assert all(torch.equal(t, a) for t, a in zip(together, alone))
