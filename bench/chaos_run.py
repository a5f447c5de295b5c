"""`python -m bench load --chaos`: the load of bench/load.py on a supervised stack while its
dependencies are hurt one after another (the schedule and figures: bench/chaos.py).

    python -m bench load --chaos                    # 16 clients, 10 minutes, a fault every minute
    python -m bench load --chaos --duration 120 --chaos-faults stop:redis,kill:primary

The stack is the benchmark's own (a redis-server and the four services, bench/stack.py) under the
same Supervisor as `inference.py --serve` (specdec.supervisor), polled from the thread that started
it: a killed service is restarted on its port, as in production. Before the load, each of the mix's
requests is decoded once alone (streamed, no fault): the reference that every greedy request of
the load must equal token for token. Requests are streamed, so token arrivals give the rates.
Reported: requests by final status, greedy outputs identical to the reference, tokens/s per minute,
one row per fault (bench/chaos.py), each process's RSS and open fds at the start, every
--sample-s and at the end, and the primary's KV bytes and active requests after the load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from bench import chaos
from bench.concurrency import request_once, run_load
from bench.load import primary_occupancy, primary_stats, process_resources
from bench.stack import SystemUnderTest
from specdec.launcher import SERVICE_NAMES
from specdec.supervisor import Supervisor
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

TICK_S = 0.5  # how often the faults and the supervisor are looked after
DRAIN_TIMEOUT_S = 30.0  # after the load: how long the primary may take to show its last request gone


@dataclasses.dataclass(slots=True)
class _Active:
    fault: chaos.Fault
    started_at: float
    resumed_at: float | None = None
    num_restarts_before: int = 0


class FaultInjector:
    """Starts and ends the schedule's faults against a running stack; tick() from the thread that
    started the stack (the supervisor restarts services from it)."""

    def __init__(
        self, sut: SystemUnderTest, schedule: Sequence[chaos.Fault], supervisor: Supervisor, say: Any = print
    ) -> None:
        self._sut = sut
        self._pending = list(schedule)
        self._supervisor = supervisor
        self._say = say
        self.done: list[_Active] = []
        self._current: _Active | None = None
        self._load_start = 0.0

    def start(self, load_start: float) -> None:
        self._load_start = load_start

    def pid(self, target: str) -> int:
        return self._sut.redis_pid if target == chaos.REDIS else self._sut.stack.pid(target)

    def tick(self) -> None:
        """Restart what exited, end the current fault when due, start the next when due."""
        self._supervisor.poll()  # blocks while it restarts a service (until it serves)
        now = time.perf_counter()
        current = self._current
        if current is not None and current.resumed_at is None:
            self._maybe_resume(current, now)
        if self._pending and now - self._load_start >= self._pending[0].start_s and self._is_idle():
            self._begin(self._pending.pop(0), now)

    def close(self) -> None:
        """Continue anything still stopped (a run cut short must not leave a service frozen)."""
        current = self._current
        if current is not None and current.fault.action == chaos.STOP and current.resumed_at is None:
            self._signal(current.fault.target, signal.SIGCONT)
            current.resumed_at = time.perf_counter()

    def _is_idle(self) -> bool:
        return self._current is None or self._current.resumed_at is not None

    def _begin(self, fault: chaos.Fault, now: float) -> None:
        active = _Active(fault, now)
        if fault.action == chaos.STOP:
            self._signal(fault.target, signal.SIGSTOP)
        else:
            active.num_restarts_before = self._sut.stack.num_restarts(fault.target)
            self._sut.stack.kill(fault.target)
        self._say(f"[chaos {now - self._load_start:6.1f} s] {fault.label}")
        self._current = active
        self.done.append(active)

    def _maybe_resume(self, active: _Active, now: float) -> None:
        fault = active.fault
        if fault.action == chaos.STOP and now - active.started_at >= fault.stop_s:
            self._signal(fault.target, signal.SIGCONT)
        elif not (
            fault.action == chaos.KILL
            and self._sut.stack.num_restarts(fault.target) > active.num_restarts_before
            and self._sut.stack.is_running(fault.target)
        ):
            return
        active.resumed_at = time.perf_counter()
        self._say(f"[chaos {active.resumed_at - self._load_start:6.1f} s] {fault.label} over")

    def _signal(self, target: str, sig: signal.Signals) -> None:
        # A service leads its own process group (Stack): the whole group, as a hang would take it.
        if target == chaos.REDIS:
            os.kill(self._sut.redis_pid, sig)
        else:
            os.killpg(self._sut.stack.pid(target), sig)


def reference_outputs(
    address: str, requests: Sequence[gateway_pb2.GenerateRequest], timeout_s: float
) -> list[tuple[int, ...] | None]:
    """Each request decoded once alone, streamed, before any fault: its token ids (None if it failed)."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        out: list[tuple[int, ...] | None] = []
        for r in requests:
            trace, _ = request_once(stub, r, True, timeout_s)
            out.append(None if trace.error else trace.token_ids)
        return out


def resources(sut: SystemUnderTest) -> dict[str, dict[str, int]]:
    """RSS, open fds and pid of each service and of redis-server."""
    pids = {name: sut.stack.pid(name) for name in SERVICE_NAMES} | {chaos.REDIS: sut.redis_pid}
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a killed one, not yet restarted
            out[name] = process_resources(pid) | {"pid": pid}
    return out


def drained_occupancy(sut: SystemUnderTest) -> dict[str, int]:
    """The primary's KV bytes and active requests once the load is over: read until both are 0, or
    DRAIN_TIMEOUT_S has passed (then the last reading)."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        occupancy = primary_occupancy(primary_stats(sut.stack))
        if not any(occupancy.values()) or time.monotonic() > deadline:
            return occupancy
        time.sleep(1.0)


def run_chaos(
    sut: SystemUnderTest,
    requests: Sequence[gateway_pb2.GenerateRequest],
    clients: int,
    duration_s: float,
    schedule: Sequence[chaos.Fault],
    timeout_s: float,
    sample_s: float = 60.0,
) -> dict[str, Any]:
    """References, then the load with the faults; the figures of bench/chaos.py."""
    references = reference_outputs(sut.address, requests, timeout_s)
    supervisor = Supervisor(sut.stack, say=lambda m: print(f"[supervisor] {m}", flush=True))
    injector = FaultInjector(sut, schedule, supervisor, say=lambda m: print(m, flush=True))
    samples: list[dict[str, Any]] = []
    next_sample = [sample_s]

    def on_tick(elapsed_s: float) -> None:
        injector.tick()
        if elapsed_s >= next_sample[0]:
            samples.append({"elapsed_s": elapsed_s, "services": resources(sut)})
            next_sample[0] += sample_s

    samples.append({"elapsed_s": 0.0, "services": resources(sut)})
    load_start = time.perf_counter()
    injector.start(load_start)
    try:
        traces, wall_s = run_load(sut.address, requests, clients, duration_s, True, timeout_s, on_tick, TICK_S)
    finally:
        injector.close()
    while any(a.resumed_at is None for a in injector.done):  # a kill near the end: wait for the restart
        injector.tick()
        time.sleep(TICK_S)
    samples.append({"elapsed_s": time.perf_counter() - load_start, "services": resources(sut)})
    return summarize(traces, wall_s, load_start, injector.done, references, samples) | {
        "clients": clients,
        "duration_s": duration_s,
        "primary_after": drained_occupancy(sut),
        "num_restarts": {name: sut.stack.num_restarts(name) for name in SERVICE_NAMES},
    }


def summarize(
    traces: Sequence[Any],
    wall_s: float,
    load_start: float,
    faults: Sequence[_Active],
    references: Sequence[tuple[int, ...] | None],
    samples: list[dict[str, Any]],
) -> dict[str, Any]:
    timeline = chaos.TokenTimeline(*chaos.merged_arrivals(traces))
    load_end = load_start + wall_s
    failed_at = [t.ended_at if t.finished_at is None else t.finished_at for t in traces if t.error]
    outcomes = []
    for i, a in enumerate(faults):
        until = faults[i + 1].started_at if i + 1 < len(faults) else load_end
        outcomes.append(chaos.fault_outcome(timeline, a.fault, a.started_at, a.resumed_at, until, failed_at))
    return {
        "wall_s": wall_s,
        "load_start": load_start,
        "statuses": chaos.status_counts(traces),
        "error_examples": sorted({t.error for t in traces if t.error})[:8],
        "exactness": chaos.check_exactness(traces, references),
        "num_references": sum(r is not None for r in references),
        "num_tokens": timeline.num_tokens(load_start, load_end + 1),
        "tokens_per_minute": chaos.per_minute_rates(timeline, load_start, load_end),
        "faults": outcomes,
        "resources": samples,
    }


def format_chaos(r: dict[str, Any]) -> str:
    exact: chaos.Exactness = r["exactness"]
    lines = [
        f"{r['clients']} clients, {r['wall_s']:.0f} s, streamed, {len(r['faults'])} faults",
        "requests by status: " + ", ".join(f"{c} {n}" for c, n in r["statuses"].items()),
        *[f"  e.g. {e}" for e in r["error_examples"]],
        f"greedy outputs identical to the reference: {exact.num_identical}/{exact.num_checked} "
        f"({r['num_references']} references decoded before the faults)",
        *[f"  {m}" for m in exact.mismatches[:8]],
        f"generated tokens: {r['num_tokens']}, {r['num_tokens'] / r['wall_s']:.1f} tok/s overall; "
        + chaos.format_minutes(r["tokens_per_minute"]),
        "",
        *chaos.format_faults(r["faults"], r["load_start"]),
        "",
        *chaos.format_resources(r["resources"]),
        "",
        f"service restarts: {r['num_restarts']}",
        f"primary after the load: {r['primary_after']}",
    ]
    return "\n".join(lines)
