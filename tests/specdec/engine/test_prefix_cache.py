"""The prefix cache: chained block keys, longest-prefix lookup (whole blocks, and token for token
into a block or tail) and LRU eviction on hand-built tensors; then on the real model, that a prompt
continuing from cached rows gets exactly (torch.equal) the logits of a prefill without the cache,
with native int4 (reuse at any row count) and fp32 (reuse on the prefill-chunk grid only)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache
from specdec.engine.loading import load_model
from specdec.engine.prefix_cache import PrefixCache

MAX_CONTEXT = 1024
B = 4  # block tokens of the hand-built cases


def rows(num_tokens: int, first: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A slot-shaped pair [layers 2, kv heads 1, num_tokens, head_dim 2] whose row i holds first + i."""
    k = (torch.arange(num_tokens, dtype=torch.float32) + first).view(1, 1, num_tokens, 1).expand(2, 1, -1, 2)
    return k.contiguous(), -k.contiguous()


BLOCK_BYTES = 2 * 2 * 1 * B * 2 * 4  # k and v, [2, 1, 4, 2] fp32


def test_blocks_chain_so_that_equal_blocks_after_different_prefixes_are_different_entries():
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=B)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], *rows(9)) == 2  # the ninth token is no full block
    assert cache.num_blocks == 2 and cache.num_bytes == 2 * BLOCK_BYTES
    assert cache.match([9, 9, 9, 9, 5, 6, 7, 8])[1] == 0  # block [5..8] only after [1..4]
    cache.insert([9, 9, 9, 9, 5, 6, 7, 8], *rows(8, first=100.0))
    assert cache.num_blocks == 4
    found, n = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert len(found) == 2 and n == 8
    k, v = torch.zeros(2, 1, 16, 2), torch.zeros(2, 1, 16, 2)
    cache.copy_prefix(found, 6, k, v)  # not a whole number of blocks: the first 6 rows
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5] + [0] * 10
    assert torch.equal(v[:, :, :6], -k[:, :, :6])


def test_scopes_never_share_blocks():
    """A block cached in one scope (a tenant) is invisible from another: a hit would tell a tenant
    which prompts another sent."""
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=B)
    cache.insert(list(range(8)), *rows(8), scope="acme")
    assert cache.match(list(range(8)), scope="acme")[1] == 8
    assert cache.match(list(range(8)), scope="globex")[1] == 0 and cache.match(list(range(8)))[1] == 0
    assert cache.insert(list(range(8)), *rows(8), scope="globex") == 2 and cache.num_blocks == 4


def test_longest_prefix_stops_at_the_first_block_that_differs():
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=B)
    cache.insert(list(range(12)), *rows(12))
    blocks, n = cache.match(list(range(12)))
    assert len(blocks) == 3 and n == 12
    assert cache.match(list(range(11)))[1] == 11  # into the third block
    assert cache.match([0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11])[1] == 6  # diverges inside block 1
    assert cache.match([99] + list(range(1, 12)))[1] == 0
    assert cache.insert(list(range(8)), *rows(8)) == 2 and cache.num_blocks == 3  # cached ones are reused


def test_a_lookup_goes_token_for_token_into_a_block_or_a_tail():
    """After the whole blocks, the first rows of the entry that begins like the rest of the prompt:
    a block it diverges inside, or a tail (a prompt's partial last block, stored with with_tail)."""
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=B)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], *rows(8)) == 2
    assert cache.insert([1, 2, 3, 4, 9, 9, 7], *rows(7, first=50.0), with_tail=True) == 2  # block 0 shared
    assert cache.num_blocks == 3 and cache.num_bytes == 2 * BLOCK_BYTES + BLOCK_BYTES * 3 // 4  # a 3-row tail
    blocks, n = cache.match([1, 2, 3, 4, 5, 6, 0, 0])  # diverges inside block 1
    assert n == 6 and len(blocks) == 2
    k, v = torch.zeros(2, 1, 8, 2), torch.zeros(2, 1, 8, 2)
    cache.copy_prefix(blocks, n, k, v)
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    blocks, n = cache.match([1, 2, 3, 4, 9, 9, 7])  # the tail's prompt again: every row
    assert n == 7
    cache.copy_prefix(blocks, n, k, v)
    assert k[0, 0, :7, 0].tolist() == [0, 1, 2, 3, 54, 55, 56] and torch.equal(v[:, :, :7], -k[:, :, :7])
    assert cache.match([1, 2, 3, 4, 9, 8])[1] == 5  # into the tail, then it differs
    assert cache.match([1, 2, 3])[1] == 3  # a prompt shorter than a block: into block 0
    assert cache.match([7, 2, 3, 4])[1] == 0 and cache.match([])[1] == 0
    assert cache.match([1, 2, 3, 4, 5], scope="acme")[1] == 0  # scopes still never share
    assert cache.insert([1, 2, 3, 4, 9, 9, 7], *rows(7), with_tail=True) == 2 and cache.num_blocks == 3


def test_evicting_a_tail_forgets_it_for_lookups():
    cache = PrefixCache(max_bytes=2 * BLOCK_BYTES, block_tokens=B)
    cache.insert([1, 2, 3, 4, 5, 6], *rows(6), with_tail=True)  # a block and a 2-row tail
    cache.insert([8, 8, 8, 8], *rows(4))  # room is made: the tail, least recently used, goes
    assert cache.stats.num_evicted_blocks == 1 and cache.num_bytes == 2 * BLOCK_BYTES
    assert cache.match([1, 2, 3, 4, 5, 6])[1] == 4
    cache.insert([1, 2, 3, 4, 5, 6], *rows(6), with_tail=True)  # stored again (evicting [8 8 8 8])
    assert cache.match([1, 2, 3, 4, 5, 6])[1] == 6 and cache.match([8, 8, 8, 8])[1] == 0


def test_lru_eviction_keeps_the_byte_budget_and_takes_leaves_first():
    cache = PrefixCache(max_bytes=3 * BLOCK_BYTES, block_tokens=B)
    cache.insert(list(range(8)), *rows(8))  # a: two blocks
    cache.insert([50, 51, 52, 53], *rows(4))  # b: one block; full
    cache.match(list(range(8)))  # a is the most recent now
    cache.insert([60, 61, 62, 63], *rows(4))  # c evicts b, the least recently used
    assert cache.num_bytes == 3 * BLOCK_BYTES and cache.stats.num_evicted_blocks == 1
    assert cache.match([50, 51, 52, 53])[1] == 0 and cache.match(list(range(8)))[1] == 8
    cache.insert([70, 71, 72, 73], *rows(4))  # evicts c (a was just used): a's chain stays whole
    cache.insert([80, 81, 82, 83], *rows(4))  # now a is the least recent: its leaf goes first
    assert cache.stats.num_evicted_blocks == 3
    assert cache.match(list(range(8)))[1] == 4  # its first block
    assert cache.num_bytes <= cache.max_bytes


def test_a_chain_longer_than_the_budget_keeps_its_first_blocks():
    cache = PrefixCache(max_bytes=2 * BLOCK_BYTES, block_tokens=B)
    assert cache.insert(list(range(16)), *rows(16)) == 2
    assert cache.match(list(range(16)))[1] == 8 and cache.stats.num_evicted_blocks == 0


def test_lookups_are_counted():
    cache = PrefixCache(max_bytes=1 << 20, block_tokens=B)
    cache.record_query(10, 0)
    cache.record_query(10, 8)
    s = cache.stats
    assert (s.num_queries, s.num_hits, s.num_query_tokens, s.num_reused_tokens) == (2, 1, 20, 8)


@pytest.mark.parametrize("kwargs", [dict(max_bytes=0), dict(block_tokens=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        PrefixCache(**kwargs)


# --- on the real model ---------------------------------------------------------------------------

SHARED = [1] + [(i * 7919) % 40000 + 100 for i in range(140)]  # 141 tokens
PROMPT_A = SHARED + [(i * 104729) % 40000 + 100 for i in range(60)]
PROMPT_B = SHARED + [(i * 15485863) % 40000 + 100 for i in range(45)]


@pytest.fixture(scope="module")
def int4_model(default_model_dir):
    return load_model(default_model_dir, "int4", max_positions=MAX_CONTEXT, is_shared=False)


def new_engine(loaded, prefix_cache: PrefixCache | None = None, prefill_chunk_tokens: int = 512) -> Engine:
    kv = KVCache(loaded.config, loaded.model.kv_dtype)
    return Engine(loaded.model, kv, MAX_CONTEXT, prefix_cache, prefill_chunk_tokens)


def run(engine: Engine, request_id: str, prompt: list[int], num_steps: int = 3) -> list[torch.Tensor]:
    """Open, prefill, then num_steps greedy decode steps; the logits of each."""
    engine.open(request_id, prompt)
    return run_opened(engine, request_id, num_steps)


def run_opened(engine: Engine, request_id: str, num_steps: int = 3) -> list[torch.Tensor]:
    engine.prefill(request_id)
    out = []
    for _ in range(num_steps):
        logits = engine.verify(request_id, (), ())
        out.append(logits)
        engine.commit(request_id, (), (int(logits[0].argmax()),))
    return out


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_prompt_sharing_a_prefix_reuses_it_bit_for_bit_int4(int4_model):
    assert int4_model.model.is_batch_invariant and int4_model.model.is_attention_row_exact
    reference = new_engine(int4_model)
    want = run(reference, "b", PROMPT_B)
    engine = new_engine(int4_model, PrefixCache())
    run(engine, "a", PROMPT_A)
    engine.release("a")  # releasing A leaves its blocks in the cache
    assert engine.kv_bytes == 0 and engine.prefix_cache.num_bytes > 0
    got = run(engine, "b", PROMPT_B)
    assert engine.num_reused_tokens("b") == 142  # every shared token (SHARED and both continue with 100)
    assert_equal(got, want)
    assert engine.kv_bytes_of("b") == reference.kv_bytes_of("b")  # the slot is the same size
    engine.release("b")
    assert engine.kv_bytes == 0  # the per-request accounting never sees the cache


def test_the_engine_shares_prefixes_within_a_tenant_only_int4(int4_model):
    """Request ids behind the gateway are tenant/client-id: the same prompt from another tenant
    prefills from scratch, from the same tenant it reuses the cached rows."""
    engine = new_engine(int4_model, PrefixCache())
    run(engine, "acme/a", PROMPT_A, num_steps=1)
    run(engine, "globex/a", PROMPT_A, num_steps=1)
    assert engine.num_reused_tokens("globex/a") == 0
    run(engine, "acme/b", PROMPT_A, num_steps=1)
    assert engine.num_reused_tokens("acme/b") > 0


@pytest.mark.parametrize("num_tokens", [161, 150])
def test_an_identical_prompt_prefills_nothing_int4(int4_model, num_tokens):
    """161 tokens: 160 rows to prefill, ten whole blocks; 150: nine blocks and a 5-row tail."""
    prompt = PROMPT_A[:num_tokens]
    want = run(new_engine(int4_model), "x", prompt)
    engine = new_engine(int4_model, PrefixCache())
    run(engine, "first", prompt)
    engine.open("again", prompt)
    assert engine.num_reused_tokens("again") == num_tokens - 1 and engine.num_to_prefill("again") == 0
    assert_equal(run_opened(engine, "again"), want)
    engine.release("first")
    engine.release("again")
    assert engine.kv_bytes == 0


def test_a_prompt_diverging_inside_a_block_reuses_every_row_before_it_int4(int4_model):
    prompt = PROMPT_A[:100] + [7] + PROMPT_A[101:]  # differs at position 100, inside block 6 (96..111)
    want = run(new_engine(int4_model), "x", prompt)
    engine = new_engine(int4_model, PrefixCache())
    run(engine, "a", PROMPT_A)
    got = run(engine, "diverged", prompt)
    assert engine.num_reused_tokens("diverged") == 100
    assert_equal(got, want)
    stats = engine.prefix_cache.stats
    assert (stats.num_queries, stats.num_hits, stats.num_reused_tokens) == (2, 1, 100)


def test_generated_tokens_are_never_shared_and_a_recovery_reuses_its_prompt_int4(int4_model):
    """A request's decoded tokens are not offered to the cache; a re-prefill of prompt + generated
    tokens (recovery) reuses the prompt's rows and continues exactly as the live request."""
    engine = new_engine(int4_model, PrefixCache())
    live = run(engine, "live", PROMPT_A[:97], num_steps=40)  # 96 prompt rows, 40 decoded
    blocks = engine.prefix_cache.num_blocks
    assert blocks == 96 // 16  # whole blocks, no tail
    generated = engine.token_ids("live")[97:]
    engine.open("recovered", PROMPT_A[:97] + generated[:-1], num_prompt_tokens=97)
    assert engine.num_reused_tokens("recovered") == 96  # the prompt only
    engine.prefill("recovered")
    assert torch.equal(engine.verify("recovered", (), ()), live[-1])
    assert engine.prefix_cache.num_blocks == blocks


def test_fp32_reuses_on_the_prefill_chunk_grid_only(fp32_model):
    """fp32 GEMMs round by row count, so a row's bits depend on the chunk it ran in: only whole
    chunks of the prefill grid (here 64 tokens) are shared and reused."""
    assert not fp32_model.model.is_batch_invariant
    want = run(new_engine(fp32_model, prefill_chunk_tokens=64), "b", PROMPT_B)
    engine = new_engine(fp32_model, PrefixCache(), prefill_chunk_tokens=64)
    assert engine.prefix_grid_tokens == 64
    run(engine, "a", PROMPT_A[:100])  # 99 prompt rows: one whole chunk is shared, not the 35 after it
    assert engine.prefix_cache.num_blocks == 64 // 16
    got = run(engine, "b", PROMPT_B)
    assert engine.num_reused_tokens("b") == 64
    assert_equal(got, want)
    run(engine, "a2", PROMPT_A)  # 200 prompt rows: three whole chunks shared
    c = run(engine, "c", SHARED + [5])
    assert engine.num_reused_tokens("c") == 128  # 141 shared: two whole chunks
    assert_equal(c, run(new_engine(fp32_model, prefill_chunk_tokens=64), "c", SHARED + [5]))


def test_fp32_prefills_with_a_prefix_cache_keep_to_the_grid(fp32_model):
    engine = new_engine(fp32_model, PrefixCache(), prefill_chunk_tokens=64)
    engine.open("a", PROMPT_A)
    with pytest.raises(ValueError, match="every 64 tokens"):
        engine.prefill("a", chunk_tokens=32)


def test_a_preempted_request_re_prefills_from_its_cached_prompt_int4(int4_model):
    engine = new_engine(int4_model, PrefixCache())
    run(engine, "r", PROMPT_A, num_steps=5)
    want = engine.verify("r", (), ())  # uncommitted: the same verify again after the re-prefill
    engine.evict("r")
    engine.readmit("r")
    assert engine.num_reused_tokens("r") == 200  # every prompt row (12 blocks and an 8-row tail), no generated one
    engine.prefill("r")
    assert torch.equal(engine.verify("r", (), ()), want)
