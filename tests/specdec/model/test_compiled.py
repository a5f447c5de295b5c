"""The compiled step against the eager forward: same logits, padding invisible, speculation == decoding.

Compiling is slow, so the whole module shares one step with two small buckets (1 and 4 rows).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from specdec.engine import tree as tree_geometry
from specdec.engine.background_compile import BackgroundCompiler
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.model import compiled
from specdec.model.compiled import CompiledStep, CompileSettings
from specdec.model.llama import SequenceSpan
from specdec.sampling import SamplingParams

BUCKETS = (1, 4)
PROMPT = [1, 504, 3458, 282, 260, 2114, 314, 5248, 30, 198, 549, 7224, 314]
ATOL = 2e-4  # fp32: the same math, fused and ordered differently
MAX_CONTEXT = 256
SENTINEL = 1234.5  # a KV value no forward writes


@pytest.fixture(scope="module")
def compiled_while_serving(fp32_model, tmp_path_factory):
    """The step, compiled by the background compiler while this thread decodes greedily with the step
    installed (eager until its buckets are ready); returns it with the tokens decoded meanwhile."""
    step = CompiledStep(fp32_model.model, CompileSettings(buckets=BUCKETS))
    compiler = BackgroundCompiler(step, tmp_path_factory.mktemp("inductor"))
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), MAX_CONTEXT)
    fp32_model.model.fast_path = step
    try:
        compiler.start()
        decoded = engine.generate(PROMPT, 8, SamplingParams())
        assert compiler.join(600) and step.ready_buckets == BUCKETS
    finally:
        fp32_model.model.fast_path = None
    return step, decoded


@pytest.fixture(scope="module")
def step(compiled_while_serving):
    return compiled_while_serving[0]


@pytest.fixture()
def model(fp32_model, step):
    """The fp32 model with the compiled step installed for one test (other tests share the model)."""
    fp32_model.model.fast_path = step
    yield fp32_model.model
    fp32_model.model.fast_path = None


def num_compiled_regions_run(fn) -> int:
    with profile() as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("Torch-Compiled Region"))


def forward_rows(model, token_ids: list[int], k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """One causal forward of `token_ids` into empty caches; logits [T, V]."""
    n = len(token_ids)
    span = SequenceSpan(0, n, 0, k_cache, v_cache, tree_geometry.verify_mask(0, n, ()))
    return model.forward(torch.tensor(token_ids), torch.arange(n), [span])


def empty_caches(model, capacity: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    c = model.config
    shape = (c.num_hidden_layers, c.num_key_value_heads, capacity, c.head_dim)
    return torch.full(shape, SENTINEL), torch.full(shape, SENTINEL)


def test_only_ready_buckets_up_to_the_largest_run_compiled(fp32_model):
    step = CompiledStep(fp32_model.model, CompileSettings(buckets=(1, 4)))
    assert [step.bucket_for(n) for n in (1, 2, 3, 4, 5)] == [1, 4, 4, 4, None]
    ids, positions = torch.tensor([504]), torch.arange(1)
    assert step(ids, positions, [], None) is None  # nothing compiled yet: the eager forward runs it


def test_compiled_logits_equal_eager_logits(model, step):
    for token_ids in ([504], [504, 3458, 282], [504, 3458, 282, 260]):  # buckets 1, 4 (padded), 4
        k, v = empty_caches(model)
        if len(token_ids) == 1:  # the graphs' guards pass: nothing falls back to eager
            num_regions = num_compiled_regions_run(lambda: forward_rows(model, token_ids, k, v))
            assert num_regions == 2 * model.config.num_hidden_layers + 1  # pre, post per layer; the head
        got = forward_rows(model, token_ids, k, v)
        model.fast_path = None
        k_eager, v_eager = empty_caches(model)
        expected = forward_rows(model, token_ids, k_eager, v_eager)
        model.fast_path = step
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(k, k_eager, atol=ATOL, rtol=0)


def test_padded_rows_write_no_kv_and_do_not_change_real_rows(model, monkeypatch):
    token_ids = [504, 3458, 282]  # 3 rows in the 4-row bucket: one padded row
    k, v = empty_caches(model)
    logits = forward_rows(model, token_ids, k, v)
    assert logits.shape == (3, model.config.vocab_size)
    assert not (k[:, :, :3] == SENTINEL).any() and not (v[:, :, :3] == SENTINEL).any()
    assert (k[:, :, 3:] == SENTINEL).all() and (v[:, :, 3:] == SENTINEL).all()

    monkeypatch.setattr(compiled, "PAD_TOKEN_ID", 7224)
    monkeypatch.setattr(compiled, "PAD_POSITION", 5)
    k_other, v_other = empty_caches(model)
    assert torch.equal(forward_rows(model, token_ids, k_other, v_other), logits)
    assert torch.equal(k_other, k) and torch.equal(v_other, v)


def greedy_speculation(engine: Engine, prompt: list[int], reference: list[int]) -> list[int]:
    """Greedy tree verification with drafts built from `reference`: some right, some wrong.

    Steps cycle through trees of 3 nodes (4 rows), 1 node (2 rows, padded to 4) and none (1 row).
    Each step accepts the path of nodes whose token is the argmax after their parent, then the bonus.
    """
    engine.open("spec", prompt)
    engine.prefill("spec")
    out: list[int] = []
    while len(out) < len(reference) - 2:
        i, shape = len(out), len(out) % 3
        trees = (
            ([reference[i], reference[i] + 1, reference[i + 1] + (i % 2)], [-1, -1, 0]),
            ([reference[i] + (i % 2)], [-1]),
            ([], []),
        )
        token_ids, parents = trees[shape]
        logits = engine.verify("spec", token_ids, parents)  # [N+1, V]
        accepted, row = [], 0  # row 0: the root
        while True:
            best = int(logits[row].argmax())
            child = next((j for j, (t, p) in enumerate(zip(token_ids, parents)) if p == row - 1 and t == best), None)
            if child is None:
                break
            accepted.append(child)
            row = child + 1
        new_token_ids = [token_ids[j] for j in accepted] + [best]
        engine.commit("spec", accepted, new_token_ids)
        out.extend(new_token_ids)
    engine.release("spec")
    return out[: len(reference) - 2]


def test_greedy_speculation_equals_plain_greedy_decoding(model, fp32_model):
    engine = Engine(model, KVCache(fp32_model.config, torch.float32), MAX_CONTEXT)
    reference = engine.generate(PROMPT, 10, SamplingParams())  # 1-row steps: bucket 1
    assert greedy_speculation(engine, PROMPT, reference) == reference[:8]
    assert engine.kv_bytes == 0


def test_decoding_while_the_step_compiles_is_unaffected(compiled_while_serving, fp32_model):
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32), MAX_CONTEXT)
    assert compiled_while_serving[1] == engine.generate(PROMPT, 8, SamplingParams())  # eager
