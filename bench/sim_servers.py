"""The shared servers of the scale-out simulation: a gateway's event loop and a Redis master are
each one FIFO server of fixed service time per job (one core each).

A job submitted at `now` starts when the server is free and ends service_s later (Lindley's
recursion): jobs must be submitted in time order, which the simulation's event loop guarantees.
Busy time is counted inside the measurement window, for utilisation; jobs by their submission.
"""

from __future__ import annotations

# Redis Cluster's hash slots; redis-cli --cluster create gives each master a contiguous range.
NUM_HASH_SLOTS = 16384


def window_overlap(start: float, end: float, window_start: float, window_end: float) -> float:
    return max(0.0, min(end, window_end) - max(start, window_start))


class FifoServer:
    __slots__ = ("free_at", "busy_s", "num_jobs", "window_start", "window_end")

    def __init__(self, window_start: float, window_end: float) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0
        self.num_jobs = 0
        self.window_start, self.window_end = window_start, window_end

    def submit(self, now: float, service_s: float) -> float:
        """When the job submitted at `now` completes."""
        start = max(now, self.free_at)
        done = self.free_at = start + service_s
        self.busy_s += window_overlap(start, done, self.window_start, self.window_end)
        self.num_jobs += self.window_start <= now < self.window_end
        return done

    def utilisation(self) -> float:
        return self.busy_s / (self.window_end - self.window_start)


class RedisDeployment:
    """One Redis server (num_masters 1) or a Redis Cluster. A request's keys share the hash slot of
    their {request_id} tag, so its script calls go to one master; the index of active requests
    ({ns}:active) is one key, so its ZADD / ZREM all go to the master that owns that slot."""

    def __init__(
        self, num_masters: int, step_op_s: float, index_op_s: float, window_start: float, window_end: float
    ) -> None:
        self.masters = [FifoServer(window_start, window_end) for _ in range(num_masters)]
        self.step_op_s, self.index_op_s = step_op_s, index_op_s
        self.index_master = self.masters[0]
        self.num_step_ops = 0  # in the window
        self.num_index_ops = 0

    def master_of(self, request_index: int) -> FifoServer:
        # a well-spread slot per request: the top 14 bits of Knuth's multiplicative hash stand in for
        # CRC16 of the id (both spread ids evenly over the 16,384 slots)
        slot = ((request_index * 2654435761) % (1 << 32)) >> 18
        return self.masters[slot * len(self.masters) // NUM_HASH_SLOTS]

    def script(self, master: FifoServer, now: float, num_calls: int = 1) -> float:
        if master.window_start <= now < master.window_end:
            self.num_step_ops += num_calls
        return master.submit(now, num_calls * self.step_op_s)

    def index(self, now: float) -> float:
        if self.index_master.window_start <= now < self.index_master.window_end:
            self.num_index_ops += 1
        return self.index_master.submit(now, self.index_op_s)

    def max_utilisation(self) -> float:
        return max(m.utilisation() for m in self.masters)
