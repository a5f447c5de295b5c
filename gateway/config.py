"""Gateway configuration: flags, with SPECDEC_GATEWAY_* / SPECDEC_* environment variables as defaults.
The only module of the gateway that reads os.environ."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from gateway.cost_model import CostSettings
from gateway.grammars import GrammarSettings
from gateway.node_pool import NodePoolConfig
from gateway.nodes import NodeSpec, parse_nodes, split_host_port
from gateway.routing import LoadLimits
from gateway.state_retry import DEFAULT_MAX_STATE_RETRY_S
from specdec.errors import InvalidArgument
from specdec.state_store import DEFAULT_LEASE_S
from specdec.controller_defaults import PLAIN_OVERHEAD_MS, SPECULATIVE_OVERHEAD_MS
from specdec.engine.tree import MAX_DRAFT_LENGTH, MAX_TREE_NODES, check_speculation_bounds
from specdec.logits_codec import FORMATS
from specdec.service.auth import add_service_token_arguments
from specdec.service.api_keys import add_public_access_arguments, check_public_exposure
from specdec.service.flags import Flags
from specdec.service.server import DEFAULT_HOST, ServerConfig
from specdec.strategies import DEFAULT_STRATEGIES, check_names
from specdec.flag_spellings import add_spellings

# Ranked spellings a grammar-forced draft offers per step: the model's own (learned per request) and
# the canonical tokens, or for a text not written before the canonical tokens and the shortest other
# first piece (draft_svc/strategies/grammar_forced.py). More rarely pay: a forced text seldom has
# more than two spellings in use.
GRAMMAR_MAX_SPELLINGS = 2


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask for; beyond these it gets INVALID_ARGUMENT naming the field."""

    default_max_new_tokens: int = 256
    max_new_tokens: int = 8192
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    max_prompt_chars: int = 1 << 20
    max_chat_messages: int = 256
    # A request's speculation, derived from what every service accepts (specdec.engine.tree's bounds,
    # also the draft pool's): half the draft length and a quarter of the tree keep a step within the
    # measured verify curve (64 rows, gateway/cost_model.py).
    max_speculative_degree: int = 8
    max_draft_length: int = MAX_DRAFT_LENGTH // 2
    max_tree_nodes: int = MAX_TREE_NODES // 4
    # JSON nesting of a response_format schema: deeper ones exhaust the recursion of schema checking
    # and compiling (RecursionError after seconds of CPU), so they are refused before either runs.
    max_schema_depth: int = 64
    # A request's prediction (Predicted Outputs): more than a context of text drafts nothing more.
    max_prediction_chars: int = 1 << 16

    def __post_init__(self) -> None:
        check_speculation_bounds(self.max_speculative_degree, self.max_draft_length, self.max_tree_nodes)


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculationDefaults:
    is_enabled: bool = True
    speculative_degree: int = 1
    draft_length: int = 8
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    # The adaptive controller picks degree and draft length per step; a request's own values bound
    # them, and these bound them when the request leaves them unset.
    is_adaptive: bool = True
    max_adaptive_degree: int = 4
    max_adaptive_draft_length: int = 16
    greedy_logits_format: str = "fp8_e4m3"  # greedy decisions use the primary's fp32 argmax
    sample_logits_format: str = "fp32"  # lossless sampling needs the exact distribution

    def __post_init__(self) -> None:
        for fmt in (self.greedy_logits_format, self.sample_logits_format):
            if fmt not in FORMATS:
                raise ValueError(f"logits format must be one of {FORMATS}, got {fmt!r}")
        for name in ("speculative_degree", "draft_length", "max_adaptive_degree", "max_adaptive_draft_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_names(self.strategies)


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayConfig:
    server: ServerConfig
    primary_address: str
    draft_address: str
    validator_address: str
    redis_url: str  # "" -> the in-process store (single machine, no recovery across restarts)
    model_path: str | None
    cache_dir: Path
    limits: Limits = Limits()
    speculation: SpeculationDefaults = SpeculationDefaults()
    costs: CostSettings = CostSettings()  # the adaptive controller's cost model beyond the verify curve
    grammar: GrammarSettings = GrammarSettings()  # compiling response formats
    is_logits_via_handle: bool = False  # validator co-located with the primary: logits through /dev/shm
    rpc_timeout_s: float = 60.0
    recovery_timeout_s: float = 120.0  # how long a request waits for a restarted primary
    max_state_retry_s: float = DEFAULT_MAX_STATE_RETRY_S  # ... and for a state store that does not answer
    state_ttl_s: float = 24 * 3600.0
    # How long a gateway's claim on a request lasts without renewal (renewed every third of it): a
    # request whose gateway died is adopted by another after this long (gateway.follow).
    owner_lease_s: float = DEFAULT_LEASE_S
    log_level: str = "INFO"
    # Torch intra-op threads: the gateway's tensor work (grammar masks) is small, and spare
    # OpenMP workers of each RPC thread would spin on the cores the primary's forward needs.
    num_threads: int = 1
    # The shared secret sent to primary, draft and validator (specdec.service.auth); "" with
    # is_unauthenticated_allowed: send none (services started with --allow_unauthenticated).
    service_token_file: str = ""
    is_unauthenticated_allowed: bool = False
    # The public API: tenants and the hashes of their keys (specdec.service.api_keys); "" accepts any
    # caller, and is allowed only on a loopback host unless is_insecure_public_allowed.
    api_keys_file: str = ""
    is_insecure_public_allowed: bool = False
    # Admission control (gateway.admission): requests generating at once, and waiting beyond those
    # (FIFO per tenant, round-robin across tenants); beyond both, RESOURCE_EXHAUSTED.
    max_active_requests: int = 64
    max_queued_requests: int = 128
    # --nodes: the nodes to route requests to (gateway.nodes), None: the one node of the three
    # addresses above, as a gateway without --nodes always had; their health checks and load limits.
    nodes: NodeSpec | None = None
    node_pool: NodePoolConfig = NodePoolConfig()

    def __post_init__(self) -> None:
        if self.max_active_requests < 1:
            raise ValueError(f"max_active_requests must be >= 1, got {self.max_active_requests}")
        if self.max_state_retry_s <= 0:
            raise ValueError(f"max_state_retry_s must be > 0, got {self.max_state_retry_s}")
        if self.owner_lease_s <= 0:
            raise ValueError(f"owner_lease_s must be > 0, got {self.owner_lease_s}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        check_public_exposure(self.server.host, self.api_keys_file, self.is_insecure_public_allowed)


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m gateway", description="The public gRPC API and the per-request loop.")
    flags = Flags(p, "GATEWAY", os.environ)
    speculation = SpeculationDefaults()
    flags.add("--host", DEFAULT_HOST)
    flags.add("--port", 50050)
    flags.add("--metrics_port", 0)
    flags.add("--primary_address", "127.0.0.1:50051")
    flags.add("--draft_address", "127.0.0.1:50052")
    flags.add("--validator_address", "127.0.0.1:50053")
    flags.add("--redis_url", "")
    flags.add("--model_path", None, env=("MODEL_PATH", "MODEL"), type=str)
    flags.add("--cache_dir", str(Path.home() / ".cache" / "specdec" / "models"))
    flags.add("--strategies", ",".join(speculation.strategies))
    flags.add("--draft_length", speculation.draft_length)
    flags.add("--speculative_degree", speculation.speculative_degree)
    flags.add(
        "--adaptive",
        True,
        help="let the adaptive controller choose degree and draft length per step (requests may "
        "override with speculation.is_adaptive)",
    )
    flags.add("--max_adaptive_degree", speculation.max_adaptive_degree)
    flags.add("--max_adaptive_draft_length", speculation.max_adaptive_draft_length)
    flags.add(
        "--plain_overhead_ms",
        PLAIN_OVERHEAD_MS,
        help="cost model: time per plain step outside the primary's forward",
    )
    flags.add(
        "--speculative_overhead_ms",
        SPECULATIVE_OVERHEAD_MS,
        help="cost model: time per speculative step outside the forward and the drafts",
    )
    flags.add("--greedy_logits_format", speculation.greedy_logits_format, choices=FORMATS)
    flags.add(
        "--logits_via_handle",
        False,
        action="store_true",
        help="the validator runs on the primary's machine: pass verify logits through /dev/shm",
    )
    flags.add("--max_message_bytes", 4 << 20)
    flags.add("--rpc_timeout_s", 60.0)
    flags.add("--recovery_timeout_s", 120.0)
    flags.add(
        "--max_state_retry_s",
        DEFAULT_MAX_STATE_RETRY_S,
        help="how long a request waits for a state store that does not answer (a Redis failover) "
        "before it fails UNAVAILABLE; never past the request's deadline",
    )
    flags.add(
        "--max_grammar_compile_s",
        10.0,
        help="longest a request waits for its response_format to compile (RESOURCE_EXHAUSTED after)",
    )
    flags.add("--log_level", "INFO")
    flags.add("--num_threads", 1, shared=False, help="torch intra-op threads (default 1; 0: torch's default)")
    add_service_token_arguments(flags, is_server=False)
    add_public_access_arguments(
        flags,
        keys_help="tenants and the SHA-256 of their API keys (python -m specdec.service.api_keys add); "
        "every call must carry one of the keys, and a request belongs to the tenant that made it",
        tls_what="TLS",
    )
    flags.add(
        "--max_active_requests",
        64,
        help="requests generating at once; more wait in the admission queue",
    )
    flags.add(
        "--max_queued_requests",
        128,
        help="requests waiting for a turn (FIFO per tenant, round-robin across tenants); beyond "
        "them RESOURCE_EXHAUSTED with a retry-after-ms hint in the trailing metadata",
    )
    _add_node_flags(flags)
    a = add_spellings(p).parse_args(argv)
    return GatewayConfig(
        server=ServerConfig(
            host=a.host,
            port=a.port,
            metrics_port=a.metrics_port,
            max_message_bytes=a.max_message_bytes,
            tls_cert_file=a.tls_cert,
            tls_key_file=a.tls_key,
        ),
        primary_address=a.primary_address,
        draft_address=a.draft_address,
        validator_address=a.validator_address,
        redis_url=a.redis_url,
        model_path=a.model_path or None,
        cache_dir=Path(a.cache_dir),
        speculation=SpeculationDefaults(
            speculative_degree=a.speculative_degree,
            draft_length=a.draft_length,
            strategies=tuple(s for s in a.strategies.split(",") if s),
            greedy_logits_format=a.greedy_logits_format,
            is_adaptive=a.adaptive,
            max_adaptive_degree=a.max_adaptive_degree,
            max_adaptive_draft_length=a.max_adaptive_draft_length,
        ),
        costs=CostSettings(plain_overhead_ms=a.plain_overhead_ms, speculative_overhead_ms=a.speculative_overhead_ms),
        grammar=GrammarSettings(max_compile_s=a.max_grammar_compile_s),
        is_logits_via_handle=a.logits_via_handle,
        rpc_timeout_s=a.rpc_timeout_s,
        recovery_timeout_s=a.recovery_timeout_s,
        max_state_retry_s=a.max_state_retry_s,
        log_level=a.log_level,
        num_threads=a.num_threads,
        service_token_file=a.service_token_file,
        is_unauthenticated_allowed=a.allow_unauthenticated,
        api_keys_file=a.api_keys_file,
        is_insecure_public_allowed=a.allow_insecure_public,
        max_active_requests=a.max_active_requests,
        max_queued_requests=a.max_queued_requests,
        nodes=_nodes(a.nodes, a.draft_address, a.validator_address),
        owner_lease_s=a.owner_lease_s,
        node_pool=NodePoolConfig(
            check_interval_s=a.node_check_interval_s,
            resolve_interval_s=a.node_resolve_interval_s,
            limits=LoadLimits(
                max_kv_fraction=a.node_max_kv_fraction,
                max_active_requests=a.node_max_active_requests,
                max_queue_depth=a.node_max_queue_depth,
            ),
        ),
    )


def _add_node_flags(flags: Flags) -> None:
    flags.add(
        "--nodes",
        "",
        help="the nodes (primary + draft pool + validator each) to route requests to: "
        "host:primary_port[/draft_port/validator_port],... (draft and validator default to the ports of "
        "--draft_address/--validator_address on each host), or dns:///name:primary_port[/draft/validator] "
        "whose addresses are the nodes (a Kubernetes headless Service). Empty: the one node of the three "
        "address flags",
    )
    flags.add(
        "--owner_lease_s",
        DEFAULT_LEASE_S,
        help="a gateway's lease on its requests in the state store, renewed every third of it; another "
        "gateway adopts a request whose gateway died once the lease lapsed",
    )
    flags.add("--node_check_interval_s", 1.0, help="health (grpc.health.v1) and load (GetStats) checks of each node")
    flags.add("--node_resolve_interval_s", 10.0, help="how often a dns:/// --nodes name is resolved again")
    flags.add(
        "--node_max_kv_fraction",
        0.9,
        help="a node whose KV cache is this full sheds new requests to the next node on the ring",
    )
    flags.add("--node_max_active_requests", 0, help="... or that holds this many requests (0: no limit)")
    flags.add("--node_max_queue_depth", 0, help="... or whose engine has this many calls waiting (0: no limit)")


def _nodes(text: str, draft_address: str, validator_address: str) -> NodeSpec | None:
    """--nodes parsed (None when empty); a ValueError naming --nodes when it does not parse."""
    if not text:
        return None
    try:
        ports = [
            split_host_port(a, f"--{name}")
            for name, a in (("draft_address", draft_address), ("validator_address", validator_address))
        ]
        return parse_nodes(text, ports[0][1], ports[1][1])
    except InvalidArgument as e:
        raise ValueError(str(e)) from None
