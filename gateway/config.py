"""Gateway configuration: flags, with SPECDEC_GATEWAY_* / SPECDEC_* environment variables as defaults.
The only module of the gateway that reads os.environ."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from gateway.cost_model import CostSettings
from specdec.grammar.compiling import GrammarSettings
from gateway.node_pool import NodePoolConfig
from gateway.nodes import NodeSpec, parse_nodes, split_host_port
from gateway.routing import LoadLimits
from gateway.request_record import DEFAULT_STATS_INTERVAL_S
from gateway.state_retry import DEFAULT_MAX_STATE_RETRY_S
from specdec.errors import InvalidArgument
from specdec.state_store import DEFAULT_COMMAND_TIMEOUT_S, DEFAULT_LEASE_S
from specdec.logits_codec import FORMATS
from specdec.flags import NO_FIELD, Flag, listen_flags, log_level_flag, model_path_flag, names, parse_flags, values
from specdec.flags import check_num_threads
from specdec.service.auth import service_token_flags
from specdec.service.api_keys import check_public_exposure, check_tls_files, public_access_flags
from specdec.service.server import ServerConfig
from specdec.speculation_bounds import (
    DEFAULT_DRAFT_LENGTH,
    DEFAULT_SPECULATIVE_DEGREE,
    MAX_ADAPTIVE_DRAFT_LENGTH,
    MAX_ADAPTIVE_SPECULATIVE_DEGREE,
    MAX_REQUEST_DRAFT_LENGTH,
    MAX_REQUEST_SPECULATIVE_DEGREE,
    MAX_REQUEST_TREE_NODES,
    check_speculation_bounds,
)
from specdec.pb import MAX_STEPS_PER_MESSAGE
from specdec.model.options import DEFAULT_CACHE_DIR
from specdec.model.tokenizer import MAX_STOP_CHARS, MAX_STOP_STRINGS
from specdec.sampling import MAX_STOP_TOKEN_IDS
from specdec.state_store.redis_url import parse_redis_url
from specdec.strategies import DEFAULT_STRATEGIES, check_names

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
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    max_prompt_chars: int = 1 << 20
    max_chat_messages: int = 256
    # A request's speculation (specdec.speculation_bounds: within what every service accepts).
    max_speculative_degree: int = MAX_REQUEST_SPECULATIVE_DEGREE
    max_draft_length: int = MAX_REQUEST_DRAFT_LENGTH
    max_tree_nodes: int = MAX_REQUEST_TREE_NODES
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
    speculative_degree: int = DEFAULT_SPECULATIVE_DEGREE
    draft_length: int = DEFAULT_DRAFT_LENGTH
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    # The adaptive controller picks degree and draft length per step; a request's own values bound
    # them, and these bound them when the request leaves them unset.
    is_adaptive: bool = True
    max_adaptive_degree: int = MAX_ADAPTIVE_SPECULATIVE_DEGREE
    max_adaptive_draft_length: int = MAX_ADAPTIVE_DRAFT_LENGTH
    # A run of plain steps drafts the copies it meets in the primary itself, with no round
    # trip (DecodeRequest.lookup_draft_length), where prompt lookup is one of the request's strategies.
    is_run_drafting: bool = True
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
    # "" -> the in-process store (single machine, no recovery across restarts); else one Redis
    # server, a Redis Cluster or a Sentinel group (specdec.state_store.redis_url).
    redis_url: str
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
    state_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S  # one state store command, before it is retried
    # A running request's stats and controller state go to the store with one step this often (its
    # tokens with every step; gateway.request_record); 0: with every step.
    state_stats_interval_s: float = DEFAULT_STATS_INTERVAL_S
    # Engine steps of a primary's run sent in one message (DecodeRequest.steps_per_message), after the
    # run's first: a client that streams (GenerateStream) hears of its tokens this often; one that waits
    # for the whole answer (Generate) needs none before the end, and fewer messages cost the gateway
    # less work per token on cores it shares with the primary (docs/benchmarks.md, "Per-step overheads").
    stream_interval: int = 1
    unary_stream_interval: int = 8
    state_ttl_s: float = 24 * 3600.0
    # How long a gateway's claim on a request lasts without renewal (renewed every third of it): a
    # request whose gateway died is adopted by another after this long (gateway.follow).
    owner_lease_s: float = DEFAULT_LEASE_S
    # host:port where the other gateways reach this one (its owner id names it, gateway.owner_id), so
    # that one whose client retried a request here can ask this gateway whether it still runs it.
    # "": the listening host and port when the host is one address, else the machine's name and port.
    advertise_address: str = ""
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
        check_num_threads(self.num_threads)
        if self.max_active_requests < 1:
            raise ValueError(f"max_active_requests must be >= 1, got {self.max_active_requests}")
        if self.max_state_retry_s <= 0:
            raise ValueError(f"max_state_retry_s must be > 0, got {self.max_state_retry_s}")
        if not 0 < self.state_timeout_s < float("inf"):
            raise ValueError(f"state_timeout_s must be > 0 and finite, got {self.state_timeout_s}")
        if not 0 <= self.state_stats_interval_s < float("inf"):
            raise ValueError(f"state_stats_interval_s must be >= 0 and finite, got {self.state_stats_interval_s}")
        if self.owner_lease_s <= 0:
            raise ValueError(f"owner_lease_s must be > 0, got {self.owner_lease_s}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        for name in ("stream_interval", "unary_stream_interval"):
            if not 1 <= getattr(self, name) <= MAX_STEPS_PER_MESSAGE:
                raise ValueError(f"{name} must be in [1, {MAX_STEPS_PER_MESSAGE}], got {getattr(self, name)}")
        check_public_exposure(self.server.host, self.api_keys_file, self.is_insecure_public_allowed)
        if self.redis_url:
            parse_redis_url(self.redis_url)  # a malformed URL fails at start, naming --redis_url
        if self.advertise_address:
            _check_advertise_address(self.advertise_address)


FLAGS = (
    *listen_flags(50050),
    Flag("--primary_address", "127.0.0.1:50051"),
    Flag("--draft_address", "127.0.0.1:50052"),
    Flag("--validator_address", "127.0.0.1:50053"),
    Flag("--redis_url", ""),
    model_path_flag(),
    Flag("--cache_dir", str(DEFAULT_CACHE_DIR), convert=Path),
    Flag("--strategies", ",".join(DEFAULT_STRATEGIES), group="speculation", convert=names),
    Flag("--draft_length", group="speculation"),
    Flag("--speculative_degree", group="speculation"),
    Flag(
        "--adaptive",
        help="let the adaptive controller choose degree and draft length per step (requests may "
        "override with speculation.is_adaptive)",
        group="speculation",
        field="is_adaptive",
    ),
    Flag("--max_adaptive_degree", group="speculation"),
    Flag("--max_adaptive_draft_length", group="speculation"),
    Flag("--plain_overhead_ms", help="cost model: time per plain step outside the primary's forward", group="costs"),
    Flag(
        "--speculative_overhead_ms",
        help="cost model: time per speculative step outside the forward and the drafts",
        group="costs",
    ),
    Flag(
        "--run_drafts",
        help="runs of plain steps draft the copies they meet in the primary, with no round trip "
        "(where prompt lookup is a request's strategy); --no-run_drafts: only speculative steps draft",
        group="speculation",
        field="is_run_drafting",
    ),
    Flag("--greedy_logits_format", choices=FORMATS, group="speculation"),
    Flag(
        "--logits_via_handle",
        help="the validator runs on the primary's machine: pass verify logits through /dev/shm",
        field="is_logits_via_handle",
        options={"action": "store_true"},
    ),
    Flag("--max_message_bytes", 4 << 20, group="server"),
    Flag("--rpc_timeout_s"),
    Flag("--recovery_timeout_s"),
    Flag(
        "--max_state_retry_s",
        help="how long a request waits for a state store that does not answer (a Redis failover) "
        "before it fails UNAVAILABLE; never past the request's deadline",
    ),
    Flag(
        "--state_timeout_s",
        help="how long one state store command (or connect) may take before it counts as failed and is "
        "retried within --max_state_retry_s: what each attempt costs while Redis stalls",
    ),
    Flag(
        "--state_stats_interval_s",
        help="a running request's stats and controller state go to the state store with one step this "
        "often (its tokens with every step); what GetRequest shows of a running request and what a "
        "successor resumes from lag by at most this. 0: with every step",
    ),
    Flag(
        "--stream_interval",
        help="a streaming client (GenerateStream) hears of a run's tokens every this many engine steps "
        "(the first at once)",
    ),
    Flag(
        "--unary_stream_interval",
        help="the same for a client that waits for the whole answer (Generate): the primary sends a run's "
        "tokens this many steps a message, which the gateway commits and stores as one step",
    ),
    Flag(
        "--max_grammar_compile_s",
        help="longest a request waits for its response_format to compile (RESOURCE_EXHAUSTED after)",
        group="grammar",
        field="max_compile_s",
    ),
    Flag(
        "--max_grammar_compiles",
        help="new response_format schemas compiling or queued at once; past it a request with another "
        "new schema is RESOURCE_EXHAUSTED at once (a compile cannot be stopped, so a flood of slow "
        "schemas would otherwise queue without bound)",
        group="grammar",
        field="max_pending_compiles",
    ),
    log_level_flag(),
    Flag("--num_threads", is_shared=False, help="torch intra-op threads (default 1; 0: torch's default)"),
    *service_token_flags(is_server=False),
    *public_access_flags(
        keys_help="tenants and the SHA-256 of their API keys (python -m specdec.service.api_keys add); "
        "every call must carry one of the keys, and a request belongs to the tenant that made it",
        tls_what="TLS",
    ),
    Flag("--max_active_requests", help="requests generating at once; more wait in the admission queue"),
    Flag(
        "--max_queued_requests",
        help="requests waiting for a turn (FIFO per tenant, round-robin across tenants); beyond "
        "them RESOURCE_EXHAUSTED with a retry-after-ms hint in the trailing metadata",
    ),
    Flag(
        "--nodes",
        "",
        help="the nodes (primary + draft pool + validator each) to route requests to: "
        "host:primary_port[/draft_port/validator_port],... (draft and validator default to the ports of "
        "--draft_address/--validator_address on each host), or dns:///name:primary_port[/draft/validator] "
        "whose addresses are the nodes (a Kubernetes headless Service). Empty: the one node of the three "
        "address flags",
        group=NO_FIELD,
    ),
    Flag(
        "--owner_lease_s",
        help="a gateway's lease on its requests in the state store, renewed every third of it; another "
        "gateway adopts a request whose gateway died once the lease lapsed",
    ),
    Flag(
        "--advertise_address",
        is_shared=False,
        help="host:port where other gateways reach this one, to ask whether it still runs its requests "
        "(they adopt those of a gateway that does not answer); default: --host:--port when --host is one "
        "address, else this machine's name and --port. On Kubernetes: the pod IP, from the downward API",
    ),
    Flag(
        "--node_check_interval_s",
        help="health (grpc.health.v1) and load (GetStats) checks of each node",
        group="node_pool",
        field="check_interval_s",
    ),
    Flag(
        "--node_resolve_interval_s",
        help="how often a dns:/// --nodes name is resolved again",
        group="node_pool",
        field="resolve_interval_s",
    ),
    Flag(
        "--node_max_kv_fraction",
        help="a node whose KV cache is this full sheds new requests to the next node on the ring",
        group="node_limits",
        field="max_kv_fraction",
    ),
    Flag(
        "--node_max_active_requests",
        help="... or that holds this many requests (0: no limit)",
        group="node_limits",
        field="max_active_requests",
    ),
    Flag(
        "--node_max_queue_depth",
        help="... or whose engine has this many calls waiting (0: no limit)",
        group="node_limits",
        field="max_queue_depth",
    ),
)
CONFIGS = {
    "": GatewayConfig,
    "server": ServerConfig,
    "speculation": SpeculationDefaults,
    "costs": CostSettings,
    "grammar": GrammarSettings,
    "node_pool": NodePoolConfig,
    "node_limits": LoadLimits,
}


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(prog="python -m gateway", description="The public gRPC API and the per-request loop.")
    a = parse_flags("GATEWAY", os.environ, FLAGS, CONFIGS, p, argv)
    check_tls_files(a.tls_cert, a.tls_key)
    return GatewayConfig(
        server=ServerConfig(**values(a, FLAGS, "server")),
        speculation=SpeculationDefaults(**values(a, FLAGS, "speculation")),
        costs=CostSettings(**values(a, FLAGS, "costs")),
        grammar=GrammarSettings(**values(a, FLAGS, "grammar")),
        nodes=_nodes(a.nodes, a.draft_address, a.validator_address),
        node_pool=NodePoolConfig(**values(a, FLAGS, "node_pool"), limits=LoadLimits(**values(a, FLAGS, "node_limits"))),
        **values(a, FLAGS),
    )


def _check_advertise_address(address: str) -> None:
    """A ValueError naming --advertise_address unless it is host:port (or [v6]:port) with a port."""
    try:
        split_host_port(address, "address")
    except InvalidArgument as e:
        raise ValueError(f"--advertise_address {address!r} must be host:port ({e.message})") from None
    if "#" in address:
        raise ValueError(f"--advertise_address {address!r} must not contain '#'")


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
