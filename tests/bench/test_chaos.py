"""bench/chaos.py: the chaos soak's fault schedule, its figures from token arrivals, and its table,
on hand-made traces (no stack, no clock)."""

from __future__ import annotations

import dataclasses

import pytest

from bench import chaos


@dataclasses.dataclass(frozen=True)
class Trace:
    """The fields of bench.concurrency.StreamTrace that bench/chaos.py reads."""

    arrivals: tuple[tuple[float, int], ...] = ()
    error: str = ""
    request_index: int = -1
    token_ids: tuple[int, ...] = ()


def test_the_default_schedule_rotates_every_dependency_and_the_kills():
    faults = chaos.fault_schedule(600.0)
    assert [f.start_s for f in faults] == [30, 90, 150, 210, 270, 330, 390, 450, 510, 570]
    assert [f.label for f in faults] == [
        "stop:validator",
        "stop:draft",
        "stop:primary",
        "stop:redis",
        "kill:primary",
        "stop:validator",
        "stop:draft",
        "stop:primary",
        "stop:redis",
        "kill:draft",
    ]
    assert all(f.stop_s == 15.0 for f in faults if f.action == chaos.STOP)
    assert all(f.stop_s == 0.0 for f in faults if f.action == chaos.KILL)


def test_the_schedule_keeps_only_faults_that_end_within_the_load():
    # a stop at 110 would last until 125 > 120; one at 70 ends at 85, 10 s (settle_s) before 120 at least
    assert [f.start_s for f in chaos.fault_schedule(120.0, period_s=40, stop_s=15, first_at_s=30)] == [30, 70]
    kills = chaos.fault_schedule(100.0, period_s=20, stop_s=5, first_at_s=0, rotation=("kill:*",))
    assert [f.start_s for f in kills] == [0, 20, 40, 60, 80]  # 100 would leave no time to see it back
    assert [f.target for f in kills] == ["primary", "draft", "validator", "primary", "draft"]


@pytest.mark.parametrize("kwargs", [{"period_s": 10, "stop_s": 10}, {"period_s": 0}, {"stop_s": 0}, {"first_at_s": -1}])
def test_the_schedule_refuses_impossible_timings(kwargs):
    with pytest.raises(ValueError):
        chaos.fault_schedule(600.0, **kwargs)


def test_parse_rotation():
    assert chaos.parse_rotation(" stop:redis, kill:*,kill:draft ") == ("stop:redis", "kill:*", "kill:draft")
    for bad in ("", "stop:gateway", "kill:redis", "pause:primary", "stop"):
        with pytest.raises(ValueError):
            chaos.parse_rotation(bad)


def test_a_fault_checks_its_target():
    with pytest.raises(ValueError, match="kill fault"):
        chaos.Fault(0.0, chaos.KILL, "redis", 0.0)
    with pytest.raises(ValueError, match="action"):
        chaos.Fault(0.0, "pause", "primary", 1.0)


def test_timeline_counts_rates_and_gaps():
    timeline = chaos.TokenTimeline(*chaos.merged_arrivals([Trace(((1.0, 2), (6.0, 1))), Trace(((2.0, 3),))]))
    assert timeline.times == [1.0, 2.0, 6.0]
    assert timeline.num_tokens(0.0, 8.0) == 6
    assert timeline.num_tokens(1.0, 2.0) == 2  # [start, end)
    assert timeline.rate(0.0, 4.0) == pytest.approx(5 / 4)
    assert timeline.longest_gap_s(0.0, 8.0) == pytest.approx(4.0)  # 2 -> 6
    assert timeline.longest_gap_s(6.5, 7.0) == pytest.approx(0.5)  # no arrival: the whole interval


def test_per_minute_rates():
    arrivals = tuple((float(t), 2) for t in range(60)) + tuple((60.0 + t, 1) for t in range(30))
    timeline = chaos.TokenTimeline(*chaos.merged_arrivals([Trace(arrivals)]))
    assert chaos.per_minute_rates(timeline, 0.0, 90.0) == pytest.approx([2.0, 1.0])


def steady(start: float, end: float, per_s: int = 10) -> list[tuple[float, int]]:
    """per_s tokens a second, one arrival every 0.1 s (one token each), from start to end."""
    num = round((end - start) * 10)
    return [(start + i / 10, per_s // 10) for i in range(num)]


def test_a_fault_that_stops_the_stack_until_the_resume_recovers_after_it():
    # 10 tok/s, nothing from 100 to 115 (stopped 100 -> 110, 5 s to pick up), then 10 tok/s again
    timeline = chaos.TokenTimeline(*chaos.merged_arrivals([Trace(tuple(steady(50, 100) + steady(115, 160)))]))
    fault = chaos.Fault(30.0, chaos.STOP, "primary", 10.0)
    o = chaos.fault_outcome(timeline, fault, started_at=100.0, resumed_at=110.0, until=160.0)
    assert o.baseline_tok_s == pytest.approx(10.0)
    assert o.dip == 0.0
    assert o.longest_gap_s == pytest.approx(15.0, abs=0.11)
    # the first 5 s window with >= 5 tok/s starts at 112.5 (tokens from 115 on): 2.5 s after the resume
    assert o.recovered_s == pytest.approx(2.5)
    assert o.num_failed == 0


def test_a_fault_the_stack_routed_around_counts_as_recovered_at_the_resume():
    # a short stall at the fault (a per-call deadline), then plain decoding at 8 tok/s meanwhile
    arrivals = steady(50, 100) + [(101.5 + i / 10, 8) for i in range(0, 585, 10)] + steady(160, 200)
    arrivals = [(t, n) for t, n in arrivals if n]
    timeline = chaos.TokenTimeline(*chaos.merged_arrivals([Trace(tuple(arrivals))]))
    fault = chaos.Fault(30.0, chaos.STOP, "validator", 15.0)
    o = chaos.fault_outcome(
        timeline, fault, started_at=100.0, resumed_at=115.0, until=200.0, failed_at=[99.0, 120.0, 201.0]
    )
    assert o.recovered_s == 0.0
    assert o.dip is not None and 0.5 < o.dip < 1.0
    assert o.longest_gap_s == pytest.approx(1.5, abs=0.11)
    assert o.num_failed == 1  # only the failure between the fault and the next


def test_a_fault_never_recovered_or_never_resumed():
    timeline = chaos.TokenTimeline(*chaos.merged_arrivals([Trace(tuple(steady(50, 100)))]))
    fault = chaos.Fault(30.0, chaos.KILL, "primary", 0.0)
    never_back = chaos.fault_outcome(timeline, fault, started_at=100.0, resumed_at=None, until=150.0)
    assert never_back.recovered_s is None and never_back.resumed_at is None
    slow = chaos.fault_outcome(timeline, fault, started_at=100.0, resumed_at=120.0, until=150.0)
    assert slow.recovered_s is None
    assert slow.longest_gap_s == pytest.approx(50.0)


def test_exactness_compares_every_successful_request_with_its_reference():
    references = [(1, 2, 3), (4, 5), None]
    traces = [
        Trace(request_index=0, token_ids=(1, 2, 3)),
        Trace(request_index=0, token_ids=(1, 9, 3)),
        Trace(request_index=1, token_ids=(4,)),
        Trace(request_index=1, token_ids=(4, 5), error="UNAVAILABLE: gone"),  # failed: not checked
        Trace(request_index=2, token_ids=(7,)),  # no reference
        Trace(request_index=-1, token_ids=(7,)),
    ]
    e = chaos.check_exactness(traces, references)
    assert (e.num_checked, e.num_identical) == (3, 1)
    assert e.mismatches == (
        "request 0: first differs at token 1 (of 3 / 3)",
        "request 1: first differs at token 1 (of 1 / 2)",
    )


def test_status_counts_put_ok_first():
    traces = [Trace(error="UNAVAILABLE: x"), Trace(), Trace(error="DEADLINE_EXCEEDED: y"), Trace()]
    assert chaos.status_counts(traces) == {"OK": 2, "DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 1}


def test_fault_table():
    fault = chaos.Fault(30.0, chaos.STOP, "redis", 15.0)
    o = chaos.FaultOutcome(fault, 1030.0, 1045.2, 250.0, 0.12, 14.0, 1.5, 0, until=1090.0)
    kill = chaos.Fault(90.0, chaos.KILL, "draft", 0.0)
    never = chaos.FaultOutcome(kill, 1090.0, None, 0.0, None, 30.0, None, 2, until=1150.0)
    late = chaos.FaultOutcome(kill, 1090.0, 1095.0, 0.0, None, 5.0, None, 0, until=1098.0)
    lines = chaos.format_faults([o, never, late], load_start=1000.0)
    assert lines[2] == "| 30 | stop:redis | 15.2 | 250.0 | 12 % | 14.0 | 1.5 | 0 |"
    assert lines[3] == "| 90 | kill:draft | never | 0.0 | n/a | 30.0 | not within the period | 2 |"
    assert lines[4] == "| 90 | kill:draft | 5.0 | 0.0 | n/a | 5.0 | load over | 0 |"


def test_resources_table_marks_a_restarted_process():
    samples = [
        {"elapsed_s": 0.0, "services": {"primary": {"rss_bytes": 600 * 2**20, "open_fds": 40, "pid": 10}}},
        {"elapsed_s": 60.0, "services": {"primary": {"rss_bytes": 610 * 2**20, "open_fds": 41, "pid": 10}}},
        {"elapsed_s": 120.0, "services": {}},
        {"elapsed_s": 180.0, "services": {"primary": {"rss_bytes": 590 * 2**20, "open_fds": 40, "pid": 11}}},
    ]
    lines = chaos.format_resources(samples)
    assert lines[0] == "| service (RSS MiB / fds) | 0 s | 60 s | 120 s | 180 s |"
    assert lines[2] == "| primary | 600/40 | 610/41 | - | 590/40* |"
    assert chaos.format_resources([]) == []


def test_the_chaos_options():
    from bench.load import parse_args

    a = parse_args(["--chaos"])
    assert (a.clients, a.duration, a.sample_s) == (16, 600.0, 60.0)
    assert [f.label for f in a.chaos_schedule] == [f.label for f in chaos.fault_schedule(600.0)]
    short = parse_args(["--chaos", "--duration", "120", "--chaos-faults", "stop:redis", "--chaos-stop-s", "10"])
    assert [(f.start_s, f.label, f.stop_s) for f in short.chaos_schedule] == [
        (30, "stop:redis", 10),
        (90, "stop:redis", 10),
    ]
    assert parse_args(["--duration", "5"]).sample_s == 10.0  # without --chaos as before
    for bad in (
        ["--chaos", "--address", "127.0.0.1:50050"],  # it must own the processes it signals
        ["--chaos", "--chaos-faults", "stop:gateway"],
        ["--chaos", "--chaos-stop-s", "60"],  # not shorter than the period
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
