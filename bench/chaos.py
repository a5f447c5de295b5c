"""The pure parts of the chaos soak (`python -m bench load --chaos`, run by bench/chaos_run.py): the
fault schedule, the figures drawn from the clients' traces, and the table.

Faults. Every period_s (first at first_at_s) one dependency is hurt, in turn (FAULT_ROTATION):
    stop:<name>   SIGSTOP of the validator, the draft pool, the primary or Redis for stop_s, then
                  SIGCONT: a hung dependency, which holds its sockets open and answers nothing
    kill:<name>   SIGKILL of a service; the stack's supervisor (specdec.supervisor, as under
                  `inference.py --serve`) restarts it. The kills rotate over KILL_TARGETS.
E.g. 10 minutes, period 60 s, first at 30 s, stop 15 s ->
    30 stop:validator, 90 stop:draft, 150 stop:primary, 210 stop:redis, 270 kill:primary,
    330 stop:validator, 390 stop:draft, 450 stop:primary, 510 stop:redis, 570 kill:draft.

Figures. Token rates come from the clients' receive times of streamed tokens (StreamTrace.arrivals).
For each fault, with its baseline the stack's rate over the baseline_s before it:
    dip          the lowest rate over a window_s sliding window from the fault until recovery,
                 over the baseline (1.0: the fault never slowed the stack)
    longest gap  the longest time without any token reaching any client, from the fault on
    recovered    seconds from the resume (SIGCONT, or the killed service serving again) until the
                 window_s rate is back to at least recovered_fraction of the baseline; 0 when it
                 already was (the gateway had routed around the fault); None when it never was
                 before the next fault or the end of the load
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

STOP, KILL = "stop", "kill"
ACTIONS = (STOP, KILL)
REDIS = "redis"
# What `stop` may target: the services behind the gateway and the state store. The gateway itself
# is left alone: it is the clients' endpoint, and a stopped one only shows that a client waits.
STOP_TARGETS = ("validator", "draft", "primary", REDIS)
# What `kill` may target: services the supervisor restarts (the gateway would take its clients'
# streams with it, and Redis without persistence its data: both outside a dependency fault).
KILL_TARGETS = ("primary", "draft", "validator")
FAULT_ROTATION = ("stop:validator", "stop:draft", "stop:primary", f"stop:{REDIS}", f"{KILL}:*")
ANY_KILL_TARGET = "*"  # kill:* takes the next of KILL_TARGETS each time round
WINDOW_S = 5.0  # the sliding window of the token rate after a fault


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault; times in seconds from the start of the load."""

    start_s: float
    action: str  # STOP or KILL
    target: str  # a service name or REDIS
    stop_s: float  # how long a STOP lasts (0 for KILL: the supervisor decides when it is back)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"fault action must be one of {ACTIONS}, got {self.action!r}")
        targets = STOP_TARGETS if self.action == STOP else KILL_TARGETS
        if self.target not in targets:
            raise ValueError(f"a {self.action} fault targets one of {targets}, got {self.target!r}")
        if self.start_s < 0 or self.stop_s < 0:
            raise ValueError(f"fault times must be >= 0, got start {self.start_s}, stop {self.stop_s}")

    @property
    def label(self) -> str:
        return f"{self.action}:{self.target}"


def parse_rotation(text: str) -> tuple[str, ...]:
    """ "stop:validator,kill:*" -> ("stop:validator", "kill:*"); ValueError naming a bad entry."""
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    if not entries:
        raise ValueError("the fault rotation is empty")
    for entry in entries:
        action, _, target = entry.partition(":")
        valid = STOP_TARGETS if action == STOP else KILL_TARGETS + (ANY_KILL_TARGET,) if action == KILL else ()
        if target not in valid:
            raise ValueError(f"bad fault {entry!r}: use stop:<{'|'.join(STOP_TARGETS)}> or kill:<{'|'.join(valid)}>")
    return entries


def fault_schedule(
    duration_s: float,
    period_s: float = 60.0,
    stop_s: float = 15.0,
    first_at_s: float = 30.0,
    rotation: Sequence[str] = FAULT_ROTATION,
    settle_s: float = 10.0,
) -> tuple[Fault, ...]:
    """Faults every period_s from first_at_s, the rotation's entries in turn; only faults that end
    (a stop resumed, a kill sent) settle_s before duration_s, so that the recovery of each can be
    seen. See the module docstring for an example."""
    if period_s <= 0 or stop_s <= 0 or first_at_s < 0 or stop_s >= period_s:
        raise ValueError(f"need period_s > stop_s > 0 and first_at_s >= 0, got {period_s}, {stop_s}, {first_at_s}")
    faults: list[Fault] = []
    num_kills = 0
    start_s = first_at_s
    while True:
        action, _, target = rotation[len(faults) % len(rotation)].partition(":")
        if action == KILL and target == ANY_KILL_TARGET:
            target = KILL_TARGETS[num_kills % len(KILL_TARGETS)]
        length_s = stop_s if action == STOP else 0.0
        if start_s + length_s + settle_s > duration_s:
            return tuple(faults)
        num_kills += action == KILL
        faults.append(Fault(start_s, action, target, length_s))
        start_s += period_s


# --- figures from the traces ------------------------------------------------------------------------


def merged_arrivals(traces: Sequence[Any]) -> tuple[list[float], list[int]]:
    """Every token arrival of every trace (StreamTrace.arrivals), in time order: (times, counts)."""
    events = sorted(a for t in traces for a in t.arrivals)
    return [t for t, _ in events], [n for _, n in events]


class TokenTimeline:
    """Tokens received by all clients over time: how many in any interval, in O(log n)."""

    def __init__(self, times: Sequence[float], counts: Sequence[int]) -> None:
        assert len(times) == len(counts)
        assert all(a <= b for a, b in zip(times, times[1:])), "times must be sorted"
        self.times = list(times)
        self._cumulative = [0]
        for n in counts:
            self._cumulative.append(self._cumulative[-1] + n)

    def num_tokens(self, start: float, end: float) -> int:
        """Tokens received in [start, end)."""
        lo = bisect.bisect_left(self.times, start)
        hi = bisect.bisect_left(self.times, end)
        return self._cumulative[hi] - self._cumulative[lo]

    def rate(self, start: float, end: float) -> float:
        return self.num_tokens(start, end) / (end - start) if end > start else 0.0

    def longest_gap_s(self, start: float, end: float) -> float:
        """The longest time in [start, end] without an arrival (the interval's edges count as ends).

        E.g. arrivals at 1, 2, 6 in [0, 8] -> gaps 1, 1, 4, 2 -> 4."""
        lo = bisect.bisect_left(self.times, start)
        hi = bisect.bisect_right(self.times, end)
        points = [start, *self.times[lo:hi], end]
        return max(b - a for a, b in zip(points, points[1:]))


def per_minute_rates(timeline: TokenTimeline, start: float, end: float, bin_s: float = 60.0) -> list[float]:
    """Tokens/s in each bin_s from start (the last bin may be shorter; its rate is over its own length).

    E.g. 120 tokens in [0, 60) and 30 in [60, 90), start 0, end 90 -> [2.0, 1.0]."""
    rates = []
    t = start
    while t < end:
        rates.append(timeline.rate(t, min(t + bin_s, end)))
        t += bin_s
    return rates


@dataclasses.dataclass(frozen=True, slots=True)
class FaultOutcome:
    """What a fault did to the stack, as the clients saw it (see the module docstring)."""

    fault: Fault
    started_at: float  # perf_counter seconds
    resumed_at: float | None  # SIGCONT sent / the killed service serving again; None: never
    baseline_tok_s: float
    dip: float | None  # lowest window rate over the baseline; None without a baseline
    longest_gap_s: float
    recovered_s: float | None
    num_failed: int  # requests that ended with an error between the fault and the next one
    until: float  # the next fault's start or the end of the load (perf_counter seconds)

    @property
    def is_cut_short(self) -> bool:
        """The load ended too soon after the resume to see a recovery."""
        return self.recovered_s is None and self.resumed_at is not None and self.until - self.resumed_at < WINDOW_S


def fault_outcome(
    timeline: TokenTimeline,
    fault: Fault,
    started_at: float,
    resumed_at: float | None,
    until: float,
    failed_at: Sequence[float] = (),
    baseline_s: float = 20.0,
    window_s: float = WINDOW_S,
    recovered_fraction: float = 0.5,
    step_s: float = 0.5,
) -> FaultOutcome:
    """The figures of one fault; until: the next fault's start or the end of the load. failed_at:
    when the load's failed requests ended (perf_counter)."""
    baseline = timeline.rate(started_at - baseline_s, started_at)
    target = recovered_fraction * baseline
    recovered_s: float | None = None
    lowest = None
    t = started_at
    while t + window_s <= until:
        rate = timeline.rate(t, t + window_s)
        lowest = rate if lowest is None else min(lowest, rate)
        if resumed_at is not None and t >= resumed_at and rate >= target:
            recovered_s = 0.0 if _was_recovered(timeline, resumed_at, window_s, target) else t - resumed_at
            break
        t += step_s
    end = until if recovered_s is None or resumed_at is None else resumed_at + recovered_s + window_s
    return FaultOutcome(
        fault=fault,
        started_at=started_at,
        resumed_at=resumed_at,
        baseline_tok_s=baseline,
        dip=None if baseline <= 0 or lowest is None else lowest / baseline,
        longest_gap_s=timeline.longest_gap_s(started_at, min(end, until)),
        recovered_s=recovered_s,
        num_failed=sum(started_at <= f < until for f in failed_at),
        until=until,
    )


def _was_recovered(timeline: TokenTimeline, resumed_at: float, window_s: float, target: float) -> bool:
    """The window ending at the resume already ran at the target rate: the stack had routed around it."""
    return timeline.rate(resumed_at - window_s, resumed_at) >= target


@dataclasses.dataclass(frozen=True, slots=True)
class Exactness:
    """Greedy outputs of the load against the reference decoded before the chaos."""

    num_checked: int
    num_identical: int
    mismatches: tuple[str, ...]  # e.g. "request 3: first differs at token 17 (of 64 / 64)"


def check_exactness(traces: Sequence[Any], references: Sequence[Sequence[int] | None]) -> Exactness:
    """Each successful trace's token ids (StreamTrace.token_ids) against references[request_index];
    traces without a reference are not counted."""
    num_checked = num_identical = 0
    mismatches = []
    for t in traces:
        if t.error or not 0 <= t.request_index < len(references) or references[t.request_index] is None:
            continue
        expected = tuple(references[t.request_index])
        num_checked += 1
        if tuple(t.token_ids) == expected:
            num_identical += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(t.token_ids, expected)) if a != b), None)
        where = f"first differs at token {min(len(t.token_ids), len(expected)) if first is None else first}"
        mismatches.append(f"request {t.request_index}: {where} (of {len(t.token_ids)} / {len(expected)})")
    return Exactness(num_checked, num_identical, tuple(mismatches))


def status_counts(traces: Sequence[Any]) -> dict[str, int]:
    """Requests by final status: {"OK": 950, "UNAVAILABLE": 2}; OK first, the rest by name."""
    codes = collections.Counter(t.error.split(":", 1)[0] if t.error else "OK" for t in traces)
    return {c: codes[c] for c in sorted(codes, key=lambda c: (c != "OK", c))}


# --- the table ----------------------------------------------------------------------------------------


def format_faults(outcomes: Sequence[FaultOutcome], load_start: float) -> list[str]:
    """One row per fault (markdown)."""

    def opt(value: float | None, fmt: str, none: str) -> str:
        return none if value is None else format(value, fmt)

    lines = [
        "| at (s) | fault | held (s) | baseline tok/s | dip | longest gap (s) | recovered after resume (s) | failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        held = None if o.resumed_at is None else o.resumed_at - o.started_at
        recovered = "load over" if o.is_cut_short else opt(o.recovered_s, ".1f", "not within the period")
        dip = opt(None if o.dip is None else 100 * o.dip, ".0f", "n/a")
        lines.append(
            f"| {o.started_at - load_start:.0f} | {o.fault.label} | {opt(held, '.1f', 'never')} | "
            f"{o.baseline_tok_s:.1f} | {dip}{'' if o.dip is None else ' %'} | {o.longest_gap_s:.1f} | "
            f"{recovered} | {o.num_failed} |"
        )
    return lines


def format_resources(samples: Sequence[Mapping[str, Any]]) -> list[str]:
    """RSS (MiB) and open fds per service at each sample (markdown): one row per service, one column
    per sample, e.g. "| primary | 612/41 | 615/41 |"; a restarted process is marked with "*"."""
    if not samples:
        return []
    names = list(samples[0]["services"])
    head = "| service (RSS MiB / fds) | " + " | ".join(f"{s['elapsed_s']:.0f} s" for s in samples) + " |"
    lines = [head, "|---|" + "---:|" * len(samples)]
    for name in names:
        cells = []
        previous_pid = None
        for s in samples:
            r = s["services"].get(name)
            if r is None:
                cells.append("-")
                continue
            mark = "*" if previous_pid is not None and r["pid"] != previous_pid else ""
            previous_pid = r["pid"]
            cells.append(f"{r['rss_bytes'] / 2**20:.0f}/{r['open_fds']}{mark}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def format_minutes(rates: Sequence[float]) -> str:
    """ "tokens/s per minute: 281, 240, 266" """
    return "tokens/s per minute: " + ", ".join(f"{r:.0f}" for r in rates)
