"""The scale-out simulation's discrete-event model: N nodes behind G gateways and a Redis deployment,
under Poisson arrivals (bench/simulate.py drives it; bench/sim_profile.py holds the measured figures).

A request's life, as the service runs it:
  arrive at a gateway (round robin over G) -> the state store's create script, the index's ZADD and
  the RUNNING status write -> routed to a node (bench/sim_routing.py) -> queued there until the node
  has fewer than max_active_per_node active requests -> its prompt prefilled in chunks, the system
  prompt skipped when the node's prefix cache holds it -> one decode row in each engine step until
  decode_run tokens (a request's first token alone) -> a gateway round: the gateway's CPU for those
  tokens (FIFO on its one core), then the step's state write (one EVALSHA on the request's master),
  which runs beside the next step: a request waits only for its previous write -> ... -> after
  output_tokens the terminal status write and the index's ZREM.
A node's engine step (continuous batching) takes every ready decode row and prefill chunks up to
max_step_tokens rows; it lasts profile.step_ms(decode rows) + prefill rows x prefill_ms_per_token.
The prefix cache is an LRU of whole system prompts, filled when a request is admitted (a request that
arrives while the same prompt is being prefilled counts as a hit: the primary holds it for the
shared prefix).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from bench.sim_config import SimConfig
from bench.sim_profile import NodeProfile
from bench.sim_routing import AffinityRouter, RandomRouter
from bench.sim_servers import FifoServer, RedisDeployment, window_overlap

ARRIVAL, ADMIT, STEP_END, ROUND_DONE, READY, DEPART = range(6)
# The state store's calls of a request besides one per step (specdec/state_store/redis_store.py as the
# gateway makes them): at the start the create script and the status RUNNING (a step script), at the
# end the terminal status (a step script); plus the index's ZADD and ZREM.
NUM_START_SCRIPTS = 2
NUM_END_SCRIPTS = 1
NOT_YET = -1.0  # a time not reached yet
_ARRIVAL_CHUNK = 4096


class Request:
    __slots__ = (
        "index",
        "arrival",
        "prompt_id",
        "gateway",
        "node",
        "master",
        "prefill_left",
        "num_generated",
        "round_tokens",
        "first_token_at",
        "last_write_done",
        "is_counted",
    )

    def __init__(self, index: int, arrival: float, prompt_id: int, gateway: int, is_counted: bool) -> None:
        self.index, self.arrival, self.prompt_id, self.gateway = index, arrival, prompt_id, gateway
        self.node = 0
        self.master: FifoServer | None = None
        self.prefill_left = 0
        self.num_generated = 0
        self.round_tokens = 0
        self.first_token_at = NOT_YET
        self.last_write_done = 0.0
        self.is_counted = is_counted  # arrived in the measurement window


class Node:
    __slots__ = (
        "index",
        "queue",
        "prefilling",
        "ready",
        "num_active",
        "is_busy",
        "cache",
        "step_decode",
        "step_prefill",
        "busy_s",
        "num_steps",
        "num_rows",
        "num_hits",
        "num_lookups",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.queue: deque[Request] = deque()  # routed here, waiting for an active slot
        self.prefilling: deque[Request] = deque()
        self.ready: list[Request] = []  # decode rows of the next step
        self.num_active = 0
        self.is_busy = False
        self.cache: OrderedDict[int, None] = OrderedDict()  # system prompt ids, least recently used first
        self.step_decode: list[Request] = []
        self.step_prefill: list[tuple[Request, int]] = []
        self.busy_s = 0.0
        self.num_steps = self.num_rows = self.num_hits = self.num_lookups = 0


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    num_arrivals: int  # in the window
    num_departures: int  # in the window
    throughput_tok_per_s: float
    ttft_s: tuple[float, ...]  # sorted, one per window arrival; inf: no first token before the end
    prefix_hit_rate: float
    num_request_steps: int  # gateway rounds in the window
    redis_ops_per_s: float
    redis_max_utilisation: float
    gateway_utilisations: tuple[float, ...]
    gateway_cores_per_node: float  # gateway busy seconds a second, per node
    redis_step_busy_per_node: float  # Redis busy seconds a second of the step scripts, per node
    redis_index_busy_per_node: float  # the same, index commands (all on one master)
    node_utilisation: float  # mean busy fraction of the nodes
    rows_per_step: float
    mean_in_system: float  # time-average requests in the system (Little's L)
    mean_sojourn_s: float  # of the window's arrivals, arrival to the end's state write (Little's W)
    end_s: float  # simulated time when the run stopped


class Simulation:
    def __init__(self, profile: NodeProfile, config: SimConfig) -> None:
        self.profile, self.config = profile, config
        c = config
        arrival_seq, prompt_seq, route_seq = np.random.SeedSequence(c.seed).spawn(3)
        self._arrival_rng = np.random.default_rng(arrival_seq)
        self._prompt_rng = np.random.default_rng(prompt_seq)
        weights = 1.0 / np.arange(1, c.num_system_prompts + 1) ** c.system_prompt_zipf
        self._prompt_probs = weights / weights.sum()
        self._gaps: list[float] = []
        self._prompt_ids: list[int] = []
        self.router = (
            AffinityRouter(c.num_nodes, c.num_virtual_nodes, c.load_bound, c.min_load_cap)
            if c.routing == "affinity"
            else RandomRouter(c.num_nodes, np.random.default_rng(route_seq))
        )
        w0, w1 = c.warmup_s, c.duration_s
        self.nodes = [Node(i) for i in range(c.num_nodes)]
        self.gateways = [FifoServer(w0, w1) for _ in range(c.num_gateways)]
        self.redis = RedisDeployment(
            c.num_redis_masters, 1 / profile.redis_step_ops_per_s, 1 / profile.redis_index_ops_per_s, w0, w1
        )
        self._loads = [0] * c.num_nodes  # routed and not finished, per node
        self._cache_capacity = c.prefix_cache_tokens // c.system_prompt_tokens
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._num_requests = 0
        self._num_in_system, self._last_t, self._area = 0, 0.0, 0.0
        self._num_open = 0  # window arrivals not departed yet
        self._num_arrivals = self._num_departures = self._num_tokens = self._num_rounds = 0
        self._counted: list[Request] = []
        self._sojourns: list[float] = []

    def _push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    def _in_window(self, t: float) -> bool:
        return self.config.warmup_s <= t < self.config.duration_s

    def _next_arrival(self) -> tuple[float, int]:
        """The gap to the next arrival and its system prompt (drawn in chunks; the same seed gives
        the same arrivals whatever the routing)."""
        if not self._gaps:
            self._gaps = self._arrival_rng.exponential(1 / self.config.rate_per_s, _ARRIVAL_CHUNK).tolist()[::-1]
            ids = self._prompt_rng.choice(self.config.num_system_prompts, _ARRIVAL_CHUNK, p=self._prompt_probs)
            self._prompt_ids = ids.tolist()[::-1]
        return self._gaps.pop(), self._prompt_ids.pop()

    def _count_in_system(self, t: float, delta: int) -> None:
        """Integrate the number in the system over the window, then change it."""
        lo, hi = max(self._last_t, self.config.warmup_s), min(t, self.config.duration_s)
        if hi > lo:
            self._area += self._num_in_system * (hi - lo)
        self._last_t = t
        self._num_in_system += delta

    def run(self) -> SimResult:
        c = self.config
        gap, prompt_id = self._next_arrival()
        self._push(gap, ARRIVAL, prompt_id)
        stop_at = c.duration_s + c.max_drain_s
        handlers = {
            ARRIVAL: self._on_arrival,
            ADMIT: self._on_admit,
            STEP_END: self._on_step_end,
            ROUND_DONE: self._on_round_done,
            READY: self._on_ready,
            DEPART: self._on_depart,
        }
        t = 0.0
        while self._heap:
            t, _, kind, obj = heapq.heappop(self._heap)
            if t > stop_at or (t >= c.duration_s and self._num_open == 0):
                break
            handlers[kind](t, obj)
        self._count_in_system(max(t, c.duration_s), 0)
        return self._result(t)

    def _on_arrival(self, t: float, prompt_id: object) -> None:
        assert isinstance(prompt_id, int)
        c = self.config
        is_counted = self._in_window(t)
        index = self._num_requests
        self._num_requests += 1
        r = Request(index, t, prompt_id, index % c.num_gateways, is_counted)  # clients spread round robin
        self._count_in_system(t, +1)
        if is_counted:
            self._num_arrivals += 1
            self._num_open += 1
            self._counted.append(r)
        r.node = self.router.route(prompt_id, self._loads)
        self._loads[r.node] += 1
        r.master = self.redis.master_of(r.index)
        created = max(self.redis.script(r.master, t, NUM_START_SCRIPTS), self.redis.index(t))
        r.last_write_done = created
        self._push(created, ADMIT, r)
        gap, next_prompt = self._next_arrival()
        if t + gap < c.duration_s:
            self._push(t + gap, ARRIVAL, next_prompt)

    def _on_admit(self, t: float, r: object) -> None:
        assert isinstance(r, Request)
        node = self.nodes[r.node]
        node.queue.append(r)
        self._admit(node, t)
        self._kick(node, t)

    def _admit(self, node: Node, t: float) -> None:
        while node.queue and node.num_active < self.config.max_active_per_node:
            r = node.queue.popleft()
            node.num_active += 1
            r.prefill_left = self._prompt_rows(node, r, t)
            if r.prefill_left > 0:
                node.prefilling.append(r)
            else:
                node.ready.append(r)

    def _prompt_rows(self, node: Node, r: Request, t: float) -> int:
        """Prompt rows left to prefill after the node's prefix cache (LRU of system prompts)."""
        c = self.config
        is_hit = r.prompt_id in node.cache
        if is_hit:
            node.cache.move_to_end(r.prompt_id)
        elif self._cache_capacity > 0:
            node.cache[r.prompt_id] = None
            if len(node.cache) > self._cache_capacity:
                node.cache.popitem(last=False)
        if self._in_window(t):
            node.num_lookups += 1
            node.num_hits += is_hit
        return c.user_tokens + (0 if is_hit else c.system_prompt_tokens)

    def _kick(self, node: Node, t: float) -> None:
        if not node.is_busy and (node.ready or node.prefilling):
            self._start_step(node, t)

    def _start_step(self, node: Node, t: float) -> None:
        c = self.config
        decode, node.ready = node.ready, []
        budget = c.max_step_tokens - len(decode)
        parts: list[tuple[Request, int]] = []
        for r in node.prefilling:
            if budget <= 0:
                break
            n = min(c.prefill_chunk_tokens, r.prefill_left, budget)
            parts.append((r, n))
            budget -= n
        num_prefill = c.max_step_tokens - len(decode) - budget
        step_ms = self.profile.step_ms(len(decode)) + num_prefill * self.profile.prefill_ms_per_token
        step_s = step_ms * c.step_time_scale / 1000
        node.step_decode, node.step_prefill, node.is_busy = decode, parts, True
        node.busy_s += window_overlap(t, t + step_s, c.warmup_s, c.duration_s)
        if self._in_window(t):
            node.num_steps += 1
            node.num_rows += len(decode) + num_prefill
        self._push(t + step_s, STEP_END, node)

    def _on_step_end(self, t: float, node: object) -> None:
        assert isinstance(node, Node)
        c = self.config
        is_counted = self._in_window(t)
        for r in node.step_decode:
            r.num_generated += 1
            r.round_tokens += 1
            self._num_tokens += is_counted
            if r.num_generated == 1 or r.round_tokens >= c.decode_run or r.num_generated >= c.output_tokens:
                self._start_round(r, t)
            else:
                node.ready.append(r)
        if node.step_prefill:
            for r, n in node.step_prefill:
                r.prefill_left -= n
                if r.prefill_left == 0:
                    node.ready.append(r)
            node.prefilling = deque(r for r in node.prefilling if r.prefill_left > 0)
        node.is_busy = False
        self._kick(node, t)

    def _start_round(self, r: Request, t: float) -> None:
        gateway = self.gateways[r.gateway]
        done = gateway.submit(t, r.round_tokens * self.profile.gateway_ms_per_token / 1000)
        self._num_rounds += self._in_window(t)
        self._push(done, ROUND_DONE, r)

    def _on_round_done(self, t: float, r: object) -> None:
        assert isinstance(r, Request) and r.master is not None
        if r.first_token_at == NOT_YET:
            r.first_token_at = t
        r.round_tokens = 0
        node = self.nodes[r.node]
        if r.num_generated >= self.config.output_tokens:
            written = self.redis.script(r.master, t, 1 + NUM_END_SCRIPTS)
            departs = max(written, self.redis.index(t), r.last_write_done)
            node.num_active -= 1
            self._loads[r.node] -= 1
            self._admit(node, t)
            self._kick(node, t)
            self._push(departs, DEPART, r)
            return
        # the step's write runs beside the next step: the request waits only on its previous write
        ready_at = max(t, r.last_write_done)
        r.last_write_done = self.redis.script(r.master, t)
        if ready_at <= t:
            self._on_ready(t, r)
        else:
            self._push(ready_at, READY, r)

    def _on_ready(self, t: float, r: object) -> None:
        assert isinstance(r, Request)
        node = self.nodes[r.node]
        node.ready.append(r)
        self._kick(node, t)

    def _on_depart(self, t: float, r: object) -> None:
        assert isinstance(r, Request)
        self._count_in_system(t, -1)
        if self._in_window(t):
            self._num_departures += 1
        if r.is_counted:
            self._num_open -= 1
            self._sojourns.append(t - r.arrival)

    def _result(self, end_s: float) -> SimResult:
        c = self.config
        window = c.window_s
        ttfts = sorted(r.first_token_at - r.arrival if r.first_token_at != NOT_YET else math.inf for r in self._counted)
        num_lookups = sum(n.num_lookups for n in self.nodes)
        num_index_ops = self.redis.num_index_ops
        gateway_busy = sum(g.busy_s for g in self.gateways)
        return SimResult(
            config=c,
            num_arrivals=self._num_arrivals,
            num_departures=self._num_departures,
            throughput_tok_per_s=self._num_tokens / window,
            ttft_s=tuple(ttfts),
            prefix_hit_rate=sum(n.num_hits for n in self.nodes) / num_lookups if num_lookups else 0.0,
            num_request_steps=self._num_rounds,
            redis_ops_per_s=(self.redis.num_step_ops + num_index_ops) / window,
            redis_max_utilisation=self.redis.max_utilisation(),
            gateway_utilisations=tuple(g.utilisation() for g in self.gateways),
            gateway_cores_per_node=gateway_busy / window / c.num_nodes,
            redis_step_busy_per_node=self.redis.num_step_ops * self.redis.step_op_s / window / c.num_nodes,
            redis_index_busy_per_node=num_index_ops * self.redis.index_op_s / window / c.num_nodes,
            node_utilisation=sum(n.busy_s for n in self.nodes) / window / c.num_nodes,
            rows_per_step=sum(n.num_rows for n in self.nodes) / max(1, sum(n.num_steps for n in self.nodes)),
            mean_in_system=self._area / window,
            mean_sojourn_s=float(np.mean(self._sojourns)) if self._sojourns else math.inf,
            end_s=end_s,
        )


def simulate(profile: NodeProfile, config: SimConfig) -> SimResult:
    return Simulation(profile, config).run()


def node_capacity_req_per_s(profile: NodeProfile, config: SimConfig, prefix_hit_rate: float = 0.0) -> float:
    """Requests a second one node completes when it is always full: each request's output tokens at
    the ms per row of a step of max_active_per_node rows, plus its prompt rows (the system prompt's
    only on a prefix-cache miss) at prefill_ms_per_token. Gateways and Redis not counted."""
    b = config.max_active_per_node
    decode_ms = config.output_tokens * profile.step_ms(b) / b
    prompt_rows = config.user_tokens + (1 - prefix_hit_rate) * config.system_prompt_tokens
    return 1000 / ((decode_ms + prompt_rows * profile.prefill_ms_per_token) * config.step_time_scale)
