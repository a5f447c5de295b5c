"""The scheduling policy on hand-built queues: budget filling, chunk boundaries, admission,
preemption order, no starvation. No model: the policy is pure bookkeeping."""

from __future__ import annotations

import pytest

from primary_svc.scheduler import RunningEntry, SchedulerPolicy, VerifyEntry, WaitingEntry, choose_victims


def waiting(request_id: str, num_remaining: int, kv: int = 0, is_admitted: bool = True) -> WaitingEntry:
    return WaitingEntry(request_id, num_remaining, kv, is_admitted)


def test_verify_rows_go_first_then_prefill_chunks_fill_the_budget():
    policy = SchedulerPolicy(max_step_tokens=100, prefill_chunk_tokens=40, is_chunk_splittable=True)
    plan = policy.plan(
        [VerifyEntry("a", 5), VerifyEntry("b", 3)], [waiting("p", 2000), waiting("q", 30), waiting("r", 500)], None
    )
    assert plan.verify_ids == ["a", "b"] and plan.num_verify_rows == 8
    # 92 rows left: p gets a whole chunk (40), q its 30, r what is left (22)
    assert plan.prefill_chunks == [("p", 40), ("q", 30), ("r", 22)]
    assert plan.num_verify_rows + plan.num_prefill_rows == 100


def test_a_long_prompt_is_prefilled_over_several_steps_while_others_decode():
    policy = SchedulerPolicy(max_step_tokens=64, prefill_chunk_tokens=32)
    long = waiting("long", 2000)
    steps = 0
    while long.num_remaining:
        plan = policy.plan([VerifyEntry("d1", 1), VerifyEntry("d2", 4)], [long], None)
        assert plan.verify_ids == ["d1", "d2"]  # the decoders run in every step
        ((request_id, n),) = plan.prefill_chunks
        assert request_id == "long" and n == min(32, long.num_remaining)
        long.num_remaining -= n
        steps += 1
    assert steps == 63  # ceil(2000 / 32)


def test_unsplittable_chunks_are_whole_and_wait_for_room():
    # Chunks cut where an uninterrupted prefill cuts: a whole chunk or the prompt's rest, never a part.
    policy = SchedulerPolicy(max_step_tokens=100, prefill_chunk_tokens=64, is_chunk_splittable=False)
    plan = policy.plan([VerifyEntry("a", 50)], [waiting("p", 200), waiting("q", 20)], None)
    assert plan.prefill_chunks == [("q", 20)]  # p's 64 do not fit the 50 left; q's rest does
    assert plan.num_verify_rows + plan.num_prefill_rows <= 100
    plan = policy.plan([], [waiting("p", 130)], None)
    assert plan.prefill_chunks == [("p", 64)]
    plan = policy.plan([], [waiting("p", 2)], None)
    assert plan.prefill_chunks == [("p", 2)]


def test_one_chunk_per_request_per_step_and_several_requests_in_one_step():
    policy = SchedulerPolicy(max_step_tokens=1000, prefill_chunk_tokens=100, is_chunk_splittable=True)
    plan = policy.plan([], [waiting("p", 1000), waiting("q", 1000), waiting("r", 50)], None)
    assert plan.prefill_chunks == [("p", 100), ("q", 100), ("r", 50)]


def test_the_first_verify_always_runs_and_the_rest_wait_for_budget():
    policy = SchedulerPolicy(max_step_tokens=16, prefill_chunk_tokens=8)
    plan = policy.plan([VerifyEntry("big", 40), VerifyEntry("small", 1)], [], None)
    assert plan.verify_ids == ["big"]
    plan = policy.plan([VerifyEntry("a", 10), VerifyEntry("b", 6), VerifyEntry("c", 1)], [], None)
    assert plan.verify_ids == ["a", "b"]  # arrival order: c waits although it fits


def test_one_verify_per_request_and_the_item_cap():
    policy = SchedulerPolicy(max_step_tokens=100, prefill_chunk_tokens=8, max_verify_items=2)
    plan = policy.plan([VerifyEntry("a", 1), VerifyEntry("a", 1), VerifyEntry("b", 1), VerifyEntry("c", 1)], [], None)
    assert plan.verify_ids == ["a", "b"]


def test_a_starved_prefill_runs_past_the_budget():
    policy = SchedulerPolicy(
        max_step_tokens=32, prefill_chunk_tokens=16, is_chunk_splittable=False, max_skipped_steps=3
    )
    p = waiting("p", 100)
    busy = [VerifyEntry(f"d{i}", 8) for i in range(4)]  # verify rows take the whole budget
    for _ in range(3):
        assert policy.plan(busy, [p], None).prefill_chunks == []
    assert p.num_skipped_steps == 3
    plan = policy.plan(busy, [p], None)
    assert plan.prefill_chunks == [("p", 16)] and p.num_skipped_steps == 0
    assert plan.num_verify_rows == 32  # the decoders were not pushed out


def test_admission_is_fifo_with_head_of_line_blocking():
    policy = SchedulerPolicy(max_step_tokens=1000, prefill_chunk_tokens=100, is_chunk_splittable=True)
    queue = [
        waiting("running-prefill", 300, kv=0, is_admitted=True),
        waiting("big", 300, kv=900, is_admitted=False),
        waiting("small", 10, kv=50, is_admitted=False),
    ]
    plan = policy.plan([], queue, kv_free_bytes=500)
    # big does not fit, so small (which would) is not admitted before it; the admitted one continues
    assert plan.admit_ids == [] and plan.prefill_chunks == [("running-prefill", 100)]
    plan = policy.plan([], queue, kv_free_bytes=920)
    assert plan.admit_ids == ["big"] and plan.prefill_chunks == [("running-prefill", 100), ("big", 100)]
    plan = policy.plan([], queue, kv_free_bytes=950)
    assert plan.admit_ids == ["big", "small"]


def test_a_held_prefill_sits_the_step_out_without_holding_up_those_behind_it():
    policy = SchedulerPolicy(max_step_tokens=1000, prefill_chunk_tokens=100, max_skipped_steps=1)
    queue = [
        waiting("leader", 120, kv=100, is_admitted=False),
        waiting("follower", 120, kv=100, is_admitted=False),
        waiting("other", 50, kv=100, is_admitted=False),
    ]
    for _ in range(3):  # held steps are not skipped steps: no starvation override kicks in
        plan = policy.plan([], queue, kv_free_bytes=250, held={"follower"})
        assert plan.admit_ids == ["leader", "other"] and [r for r, _ in plan.prefill_chunks] == ["leader", "other"]
        assert queue[1].num_skipped_steps == 0
    plan = policy.plan([], queue, kv_free_bytes=250)
    assert plan.admit_ids == ["leader", "follower"]  # let go: FIFO again (other does not fit behind it)
    queue[0].is_admitted = True
    plan = policy.plan([], queue, kv_free_bytes=250, held={"leader"})
    assert ("leader", 100) in plan.prefill_chunks  # an admitted prefill is never held


def test_verify_growth_is_served_before_admission_and_a_shortfall_is_reported():
    policy = SchedulerPolicy(max_step_tokens=100, prefill_chunk_tokens=10)
    queue = [waiting("new", 10, kv=100, is_admitted=False)]
    plan = policy.plan([VerifyEntry("a", 1, kv_growth_bytes=60)], queue, kv_free_bytes=150)
    assert plan.admit_ids == [] and plan.kv_shortfall_bytes == 0
    plan = policy.plan(
        [VerifyEntry("a", 1, kv_growth_bytes=60), VerifyEntry("b", 1, kv_growth_bytes=60)], queue, kv_free_bytes=100
    )
    assert plan.kv_shortfall_bytes == 20 and plan.admit_ids == []


def test_preemption_releases_the_newest_first_until_the_shortfall_is_covered():
    running = [
        RunningEntry("old", 1, kv_bytes=100),
        RunningEntry("newest", 9, kv_bytes=30),
        RunningEntry("mid", 5, kv_bytes=50),
        RunningEntry("new", 7, kv_bytes=40, kv_growth_bytes=10),
    ]
    assert choose_victims(running, 0) == []
    assert choose_victims(running, 30) == ["newest"]
    assert choose_victims(running, 31) == ["newest", "new"]
    assert choose_victims(running, 80) == ["newest", "new"]  # 30 + 40 freed + 10 growth no longer needed
    assert choose_victims(running, 81) == ["newest", "new", "mid"]
    assert choose_victims(running, 10**9) == ["newest", "new", "mid", "old"]


def test_no_starvation_every_waiting_prefill_finishes_under_constant_decode_load():
    policy = SchedulerPolicy(
        max_step_tokens=48, prefill_chunk_tokens=16, is_chunk_splittable=False, max_skipped_steps=2
    )
    queue = [waiting(f"p{i}", n) for i, n in enumerate([100, 7, 300, 16, 33])]
    decoders = [VerifyEntry(f"d{i}", 10) for i in range(4)]  # 40 of the 48 rows every step
    for _ in range(200):
        if not queue:
            break
        plan = policy.plan(decoders, queue, None)
        assert plan.verify_ids == [d.request_id for d in decoders]
        for request_id, n in plan.prefill_chunks:
            entry = next(w for w in queue if w.request_id == request_id)
            entry.num_remaining -= n
        queue = [w for w in queue if w.num_remaining]
    assert queue == []


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_step_tokens=0),
        dict(max_step_tokens=8, prefill_chunk_tokens=9),
        dict(prefill_chunk_tokens=0),
        dict(max_skipped_steps=-1),
    ],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SchedulerPolicy(**kwargs)
