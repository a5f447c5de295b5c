"""The scale-out simulation's deployment and workload (bench/simulate.py): what is simulated, as
opposed to the node profile (bench/sim_profile.py), which is what was measured.

Defaults follow the service's own: 64 active requests a node (the gateway's --max_active_requests),
prompt chunks of 512 rows a request and 1,024 rows a step (primary_svc.scheduler), a 500-token
system prompt shared by many requests (the routing test of issue 37).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.field_checks import require_at_least_one

ROUTINGS = ("affinity", "random")


@dataclass(frozen=True)
class SimConfig:
    num_nodes: int = 1
    num_gateways: int = 4
    num_redis_masters: int = 1  # 1: one Redis server; M > 1: Redis Cluster of M masters
    rate_per_s: float = 10.0  # Poisson arrivals, all nodes together
    duration_s: float = 150.0  # arrivals stop here
    warmup_s: float = 30.0  # figures count from here to duration_s (the prefix caches fill first)
    max_drain_s: float = 60.0  # after duration_s, events run until the window's requests finish or this passes
    routing: str = "affinity"
    load_bound: float = 1.25  # consistent hashing with bounded loads: a node takes at most this x the mean
    min_load_cap: int = 8  # ... or this many routed, unfinished requests, whichever is more
    num_virtual_nodes: int = 64  # ring points per node
    num_system_prompts: int = 64
    system_prompt_zipf: float = 1.0  # popularity of the system prompts ~ 1 / rank^s (0: uniform)
    system_prompt_tokens: int = 500
    user_tokens: int = 100
    output_tokens: int = 64
    prefix_cache_tokens: int = 8192  # a node's prefix cache, in prompt tokens (LRU of system prompts)
    max_active_per_node: int = 64
    prefill_chunk_tokens: int = 512
    max_step_tokens: int = 1024
    decode_run: int = 1  # tokens a request decodes between two gateway round trips (and state writes)
    step_time_scale: float = 1.0  # x every engine step of the profile (a node slower or faster than measured)
    seed: int = 0

    def __post_init__(self) -> None:
        positive_ints = (
            "num_nodes",
            "num_gateways",
            "num_redis_masters",
            "num_virtual_nodes",
            "min_load_cap",
            "num_system_prompts",
            "system_prompt_tokens",
            "output_tokens",
            "max_active_per_node",
            "prefill_chunk_tokens",
            "max_step_tokens",
            "decode_run",
        )
        require_at_least_one(self, *positive_ints)
        for name in ("rate_per_s", "duration_s", "step_time_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("user_tokens", "prefix_cache_tokens", "system_prompt_zipf", "max_drain_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"warmup_s must be in [0, duration_s), got {self.warmup_s}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.load_bound < 1:
            raise ValueError(f"load_bound must be >= 1, got {self.load_bound}")
        if self.max_step_tokens < self.max_active_per_node:
            raise ValueError("max_step_tokens must hold one row of every active request (>= max_active_per_node)")
        if self.num_nodes > 1024 or self.num_gateways > 1024 or self.num_redis_masters > 1024:
            raise ValueError("num_nodes, num_gateways and num_redis_masters must be <= 1024")

    @property
    def prompt_tokens(self) -> int:
        return self.system_prompt_tokens + self.user_tokens

    @property
    def window_s(self) -> float:
        return self.duration_s - self.warmup_s
