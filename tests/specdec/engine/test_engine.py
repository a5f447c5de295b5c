"""The engine against itself: tree verify == token-by-token decoding; commit == fresh prefill."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.engine.engine import Engine, VerifyWork
from specdec.engine.kv_cache import KVCache
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.sampling import SamplingParams

PROMPT = [1, 504, 3458, 282, 260, 2114, 314, 5248, 30, 198, 549, 7224, 314]
ATOL = 2e-4  # fp32: the same math in another order (masked batch vs one row at a time)


def random_tree(rng: random.Random, num_nodes: int) -> tuple[list[int], list[int]]:
    token_ids, parents, children = [], [], {}
    for i in range(num_nodes):
        parent = rng.choice([-1] + list(range(i)))
        token = rng.randrange(200, 20000)
        while token in children.setdefault(parent, set()):
            token = rng.randrange(200, 20000)
        children[parent].add(token)
        token_ids.append(token)
        parents.append(parent)
    return token_ids, parents


def sequential_logits(engine: Engine, context: list[int], continuation: list[int]) -> torch.Tensor:
    """Next-token logits after context, then after each continuation token, one token per forward."""
    engine.open("seq", context)
    engine.prefill("seq")
    rows = []
    for token in continuation + [None]:
        rows.append(engine.verify("seq", (), ())[0])
        if token is not None:
            engine.commit("seq", (), (token,))
    engine.release("seq")
    return torch.stack(rows)  # [len(continuation) + 1, V]


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_verify_equals_decoding_each_root_to_leaf_path(engine, seed):
    rng = random.Random(seed)
    token_ids, parents = random_tree(rng, rng.randint(5, 12))
    engine.open("tree", PROMPT)
    engine.prefill("tree")
    tree_logits = engine.verify("tree", token_ids, parents)  # [N+1, V]
    engine.release("tree")
    leaves = [i for i in range(len(parents)) if i not in parents]
    for leaf in leaves:
        path = path_to(parents, leaf)
        expected = sequential_logits(engine, PROMPT, [token_ids[i] for i in path])
        got = tree_logits[[0] + [i + 1 for i in path]]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert engine.kv_bytes == 0


def test_first_verify_runs_the_whole_prompt_as_a_chain(engine):
    # Without prefill, the chain is the whole prompt; the root row is the prompt's last token.
    engine.open("a", PROMPT)
    logits = engine.verify("a", [700, 701], [-1, 0])
    engine.release("a")
    expected = sequential_logits(engine, PROMPT, [700, 701])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_commit_then_continue_equals_fresh_prefill(engine):
    token_ids, parents = [700, 701, 702, 703, 704], [-1, 0, 0, 2, -1]
    engine.open("a", PROMPT)
    engine.prefill("a")
    engine.verify("a", token_ids, parents)
    engine.commit("a", [0, 2, 3], [700, 702, 703, 9000])  # accepted path + bonus
    assert engine.num_cached("a") == len(PROMPT) + 3  # everything but the bonus token
    continued = engine.verify("a", [11, 12], [-1, 0])  # next step, on the compacted cache
    engine.commit("a", [0], [11, 42])
    after_second = engine.verify("a", (), ())

    committed = PROMPT + [700, 702, 703, 9000]
    fresh = sequential_logits(engine, committed, [11, 12])
    torch.testing.assert_close(continued, fresh, atol=ATOL, rtol=0)
    fresh2 = sequential_logits(engine, committed + [11, 42], [])
    torch.testing.assert_close(after_second, fresh2, atol=ATOL, rtol=0)
    assert engine.token_ids("a") == committed + [11, 42]


def test_rejecting_every_node_rolls_the_tree_back(engine):
    engine.open("a", PROMPT)
    engine.verify("a", [700, 701, 702], [-1, 0, -1])
    engine.commit("a", [], [55])
    got = engine.verify("a", (), ())
    torch.testing.assert_close(got, sequential_logits(engine, PROMPT + [55], []), atol=ATOL, rtol=0)


def test_a_verify_step_that_fails_leaves_no_rows_of_the_last_tree_to_commit(fp32_model):
    """A re-verify whose step fails (here the other request's growth exceeds the budget) has already
    grown "a"'s slot, which copies its cached rows only: the last tree's rows are gone. Committing that
    tree's path must not keep them; its tokens run again in the next verify."""
    probe = KVCache(fp32_model.config, torch.float32)
    kv = KVCache(fp32_model.config, torch.float32, max_bytes=3 * probe.bytes_for_rows(len(PROMPT) + 1))
    engine = Engine(fp32_model.model, kv, 1024)
    engine.open("a", PROMPT)
    engine.prefill("a")
    engine.open("b", PROMPT)
    engine.verify("a", [700, 701], [-1, 0])
    wide = list(range(300, 360)), [-1] * 60  # grows a slot by a block: room for one of them only
    with pytest.raises(ResourceExhausted):
        engine.verify_batch([VerifyWork("a", *wide), VerifyWork("b", *wide)])
    engine.commit("a", [0, 1], [700, 701, 9000])
    got = engine.verify("a", (), ())
    engine.release("b")  # room for the reference
    torch.testing.assert_close(got, sequential_logits(engine, PROMPT + [700, 701, 9000], []), atol=ATOL, rtol=0)


def test_a_commit_after_preemption_re_prefills_the_accepted_rows(engine):
    """Evicted after its verify and given a new slot before its commit: the accepted path's rows went
    with the old slot, so the commit keeps none and the prefill computes them."""
    engine.open("a", PROMPT)
    engine.prefill("a")
    engine.verify("a", [700, 701, 702], [-1, 0, -1])
    engine.evict("a")
    engine.readmit("a")
    engine.commit("a", [0, 1], [700, 701, 9000])
    engine.prefill("a")
    got = engine.verify("a", (), ())
    torch.testing.assert_close(got, sequential_logits(engine, PROMPT + [700, 701, 9000], []), atol=ATOL, rtol=0)


def test_batched_verify_equals_separate_verifies(engine):
    from specdec.engine.engine import VerifyWork

    engine.open("a", PROMPT)
    engine.open("b", PROMPT[:5])
    batched = engine.verify_batch([VerifyWork("a", [700, 701], [-1, -1]), VerifyWork("b", [5], [-1])])
    engine.release("a")
    engine.release("b")
    engine.open("a", PROMPT)
    engine.open("b", PROMPT[:5])
    torch.testing.assert_close(batched[0], engine.verify("a", [700, 701], [-1, -1]), atol=ATOL, rtol=0)
    torch.testing.assert_close(batched[1], engine.verify("b", [5], [-1]), atol=ATOL, rtol=0)


def test_kv_memory_is_accounted_and_returns_to_zero(fp32_model):
    kv = KVCache(fp32_model.config, torch.float32, max_bytes=None)
    engine = Engine(fp32_model.model, kv, 1024)
    engine.open("a", PROMPT)
    engine.open("b", PROMPT * 10)
    assert kv.num_bytes > 0
    engine.prefill("b")
    engine.verify("b", list(range(300, 340)), [-1] + list(range(39)))  # grows b's slot
    assert kv.num_bytes >= (len(PROMPT) * 11 + 40) * kv.bytes_per_token
    engine.release("a")
    engine.release("b")
    assert kv.num_bytes == 0 and engine.num_active_requests == 0


def test_kv_budget_is_enforced(fp32_model):
    kv = KVCache(fp32_model.config, torch.float32, max_bytes=0)
    engine = Engine(fp32_model.model, kv, 1024)
    with pytest.raises(ResourceExhausted):
        engine.open("a", PROMPT)
    assert kv.num_bytes == 0 and engine.num_active_requests == 0


def test_bad_calls_name_the_field(engine):
    with pytest.raises(NotFound):
        engine.verify("missing", (), ())
    with pytest.raises(InvalidArgument, match="token_ids"):
        engine.open("a", [])
    with pytest.raises(InvalidArgument, match="token_ids"):
        engine.open("a", [10**9])
    with pytest.raises(InvalidArgument, match="token_ids"):
        engine.open("a", [1] * 2000)
    engine.open("a", PROMPT)
    with pytest.raises(InvalidArgument, match="request_id"):
        engine.open("a", PROMPT)
    with pytest.raises(InvalidArgument, match="tree.parents"):
        engine.verify("a", [5, 6], [-1, 1])
    with pytest.raises(InvalidArgument, match="tree.token_ids"):
        engine.verify("a", [-3], [-1])
    engine.verify("a", [5, 6, 7], [-1, 0, -1])
    with pytest.raises(InvalidArgument, match="accepted_nodes"):
        engine.commit("a", [1], [6, 8])  # node 1 is not a child of the root
    with pytest.raises(InvalidArgument, match="committed_token_ids"):
        engine.commit("a", [0], [9, 8])  # node 0 carries token 5, not 9
    torch.testing.assert_close(
        engine.verify("a", [5, 6, 7], [-1, 0, -1]),  # a retried verify: same logits
        engine.verify("a", [5, 6, 7], [-1, 0, -1]),
        atol=0,
        rtol=0,
    )
    engine.commit("a", [], [])
    with pytest.raises(FailedPrecondition):
        engine.verify("a", (), ())  # nothing pending: the bonus was not committed
    engine.release("a")
    with pytest.raises(NotFound):
        engine.release("a")
    assert engine.kv_bytes == 0


def test_plain_decoding_is_seeded_and_greedy_is_deterministic(engine):
    greedy = [engine.generate(PROMPT, 8, SamplingParams()) for _ in range(2)]
    assert greedy[0] == greedy[1] and len(greedy[0]) == 8
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=123)
    assert engine.generate(PROMPT, 8, params) == engine.generate(PROMPT, 8, params)
    assert engine.kv_bytes == 0


# A Jacobi window of 3 positions x 2 levels (draft_svc/strategies/lookahead.py): level 0 a chain off
# the root, level 1 position i a child of level 0 position i.
LOOKAHEAD_IDS = [900, 901, 902, 910, 911, 912]
LOOKAHEAD_PARENTS = [-1, 0, 1, 0, 1, 2]


def test_lookahead_rows_do_not_change_the_verify_rows_logits(engine):
    """The verify rows with a lookahead window equal those with any other rows of the same shape (a
    forward of as many rows: the linear layers' blocking depends on the row count only) bit for
    bit, so nothing of the window reaches them; and equal a verify without it to the fp32 tolerance
    of a different row count."""
    from specdec.engine.tree import with_lookahead

    token_ids, parents = [700, 701, 702, 703], [-1, 0, 0, -1]
    num_rows = len(token_ids) + 1
    other_ids = [t + 1000 for t in LOOKAHEAD_IDS]
    engine.open("a", PROMPT)
    engine.prefill("a")
    alone = engine.verify("a", token_ids, parents)  # [N+1, V]
    both = engine.verify("a", *with_lookahead(token_ids, parents, LOOKAHEAD_IDS, LOOKAHEAD_PARENTS), 6)
    other = engine.verify("a", *with_lookahead(token_ids, parents, other_ids, LOOKAHEAD_PARENTS), 6)
    assert both.shape[0] == num_rows + len(LOOKAHEAD_IDS)
    torch.testing.assert_close(both[:num_rows], other[:num_rows], atol=0, rtol=0)
    torch.testing.assert_close(both[:num_rows], alone, atol=ATOL, rtol=0)
    # the lookahead rows are what the same window gives verified as a draft tree of its own
    window = engine.verify("a", LOOKAHEAD_IDS, LOOKAHEAD_PARENTS)
    torch.testing.assert_close(both[num_rows:], window[1:], atol=ATOL, rtol=0)
    engine.release("a")


def test_lookahead_rows_are_never_committed(engine):
    from specdec.engine.tree import with_lookahead

    engine.open("a", PROMPT)
    engine.verify("a", *with_lookahead([700], [-1], LOOKAHEAD_IDS, LOOKAHEAD_PARENTS), 6)
    with pytest.raises(InvalidArgument, match="accepted_nodes"):
        engine.commit("a", [1], [900, 55])  # node 1 is the lookahead window's first row
    engine.commit("a", [0], [700, 55])
    got = engine.verify("a", (), ())
    torch.testing.assert_close(got, sequential_logits(engine, PROMPT + [700, 55], []), atol=ATOL, rtol=0)
    engine.release("a")


def test_bad_lookahead_rows_name_the_field(engine):
    engine.open("a", PROMPT)
    with pytest.raises(InvalidArgument, match="lookahead.parents"):
        engine.verify("a", [5, 6], [-1, 0], 1)  # the lookahead row hangs off a draft node
    with pytest.raises(InvalidArgument, match="lookahead.token_ids"):
        engine.verify("a", list(range(100, 165)), [-1] * 65, 65)
    engine.release("a")
