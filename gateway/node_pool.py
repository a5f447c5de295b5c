"""The nodes a gateway serves from: their connections, health, load, and where requests go.

Every `check_interval_s` the pool asks each node's primary for its health (grpc.health.v1 Check)
and its load (GetStats); a node that does not report SERVING gets no new requests until it does
again, and a request's call that finds its primary unavailable marks the node down at once
(mark_down), without waiting for the next check. With a DNS name (gateway.nodes.DnsNodes) the
pool re-resolves it every `resolve_interval_s`: addresses that appear become nodes, nodes whose
address is gone get no new requests and are forgotten (their running requests keep their node's
connections, which close once the last of them lets go): on Kubernetes every recreated node Pod has
a new address, and a gateway that kept every node it ever saw would grow for as long as it runs.

New requests go where gateway.routing says: prefix affinity on a consistent-hash ring of the
healthy nodes, bounded by each node's load. Between two reports a node's load counts the requests
this gateway routed to it since the last one, so a burst does not land on one node before its
primary reports the load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Awaitable, Callable, Sequence

import structlog

from gateway.backends import Backends, PrimaryStats
from gateway.dependencies import DependencyState
from gateway.nodes import NodeAddress, NodeSpec
from gateway.routing import DEFAULT_NUM_KEY_BLOCKS, HashRing, LoadLimits, NodeLoad, choose_node, prefix_key
from specdec.engine.prefix_cache import DEFAULT_BLOCK_TOKENS
from specdec.errors import SpecdecError

# resolve(name, port) -> the name's addresses
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


@dataclasses.dataclass(frozen=True, slots=True)
class NodePoolConfig:
    check_interval_s: float = 1.0
    check_timeout_s: float = 1.0
    resolve_interval_s: float = 10.0
    num_key_blocks: int = DEFAULT_NUM_KEY_BLOCKS
    limits: LoadLimits = LoadLimits()

    def __post_init__(self) -> None:
        for name in ("check_interval_s", "check_timeout_s", "resolve_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_key_blocks < 1:
            raise ValueError(f"num_key_blocks must be >= 1, got {self.num_key_blocks}")


@dataclasses.dataclass(slots=True)
class Node:
    """One node as this gateway sees it. Its draft and validator states are its own: a node whose
    draft pool is down leaves the other nodes' requests drafting."""

    address: NodeAddress
    backends: Backends
    draft_state: DependencyState
    validator_state: DependencyState
    is_healthy: bool = True  # until a check or a call says otherwise
    stats: PrimaryStats | None = None  # the latest GetStats
    num_routed: int = 0  # requests routed here since that report
    num_holders: int = 0  # what uses its backends (running requests; the servicer's pool questions)
    is_listed: bool = True  # False once --nodes no longer names it (its address left the DNS records)

    def hold(self) -> None:
        """One more user of its backends: they stay open until each user has let go."""
        self.num_holders += 1

    async def let_go(self) -> None:
        """One user fewer: a node no longer listed closes its backends with its last user."""
        self.num_holders -= 1
        if self.num_holders == 0 and not self.is_listed:
            await self.backends.close()

    @property
    def node_id(self) -> str:
        return self.address.node_id

    @property
    def load(self) -> NodeLoad:
        s = self.stats
        if s is None:
            return NodeLoad(num_active_requests=self.num_routed)
        return NodeLoad(s.kv_bytes, s.max_kv_bytes, s.num_active_requests + self.num_routed, s.queue_depth)


async def resolve_dns(name: str, port: int) -> list[str]:
    """The addresses of name (A and AAAA records), sorted: a Kubernetes headless Service's pods."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class NodePool:
    def __init__(
        self,
        spec: NodeSpec,
        make_backends: Callable[[NodeAddress], Backends],
        config: NodePoolConfig = NodePoolConfig(),
        resolver: Resolver = resolve_dns,
        make_state: Callable[[str, str], DependencyState] | None = None,
    ) -> None:
        self.spec, self.config = spec, config
        self._make_backends, self._resolver = make_backends, resolver
        # (node id, "draft" | "validator") -> that dependency's state
        self._make_state = make_state or (lambda _node_id, name: DependencyState(name))
        self.nodes: dict[str, Node] = {}  # the listed nodes
        self.listed: tuple[str, ...] = ()  # the node ids --nodes names now (static, or resolved)
        self.ring = HashRing(())
        self._task: asyncio.Task | None = None
        self.log = structlog.get_logger("gateway.nodes")
        if spec.static:
            self._set_listed(spec.static)

    def _set_listed(self, addresses: Sequence[NodeAddress]) -> list[Node]:
        """List these nodes; the nodes no longer listed, forgotten (their backends are not closed here:
        requests may still run on them)."""
        for a in addresses:
            if a.node_id not in self.nodes:
                states = (self._make_state(a.node_id, "draft"), self._make_state(a.node_id, "validator"))
                self.nodes[a.node_id] = Node(a, self._make_backends(a), *states)
        listed = tuple(a.node_id for a in addresses)
        dropped = []
        if listed != self.listed:
            self.log.info("nodes listed", nodes=list(listed))
            self.listed, self.ring = listed, HashRing(listed)
            for node_id in set(self.nodes) - set(listed):
                node = self.nodes.pop(node_id)
                node.is_listed = False
                dropped.append(node)
        return dropped

    async def resolve(self) -> None:
        """Re-resolve the DNS name (a no-op for static nodes); a failed lookup keeps the nodes known."""
        dns = self.spec.dns
        if dns is None:
            return
        try:
            hosts = await self._resolver(dns.name, dns.primary_port)
        except OSError as e:
            self.log.warning("could not resolve the nodes' name", name=dns.name, error=str(e))
            return
        if hosts:
            for node in self._set_listed([dns.at(h) for h in hosts]):
                # A node nothing uses is closed now, another with its last user (Node.let_go): kept open,
                # each address a recreated Pod left behind would hold its channels for good.
                if node.num_holders == 0:
                    await node.backends.close()

    async def check(self) -> None:
        """Health and load of every listed node, all at once."""
        await asyncio.gather(*(self._check(self.nodes[n]) for n in self.listed))

    async def _check(self, node: Node) -> None:
        timeout_s = self.config.check_timeout_s
        is_serving = await node.backends.is_primary_serving(timeout_s)
        if is_serving:
            try:
                node.stats, node.num_routed = await node.backends.primary_stats(timeout_s), 0
            except SpecdecError as e:
                is_serving = False
                self.log.debug("node stats failed", node=node.node_id, error=str(e))
        if is_serving != node.is_healthy:
            self.log.info("node is healthy" if is_serving else "node is unhealthy", node=node.node_id)
        node.is_healthy = is_serving

    async def start(self) -> None:
        """Resolve and check once, then keep doing it in a task (until close)."""
        await self.resolve()
        await self.check()
        self._task = asyncio.create_task(self._watch(), name="node-pool")

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        resolve_at = loop.time() + self.config.resolve_interval_s
        while True:
            await asyncio.sleep(self.config.check_interval_s)
            if loop.time() >= resolve_at:
                resolve_at = loop.time() + self.config.resolve_interval_s
                await self.resolve()
            try:
                await self.check()
            except Exception as e:  # noqa: BLE001 - a check that fails must not end the watch
                self.log.warning("node check failed", error=str(e))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(n.backends.close() for n in self.nodes.values()))

    # --- routing ---------------------------------------------------------------------------------

    def healthy(self) -> list[str]:
        return [n for n in self.listed if self.nodes[n].is_healthy]

    def route(self, token_ids: Sequence[int], scope: str = "", exclude: Sequence[str] = ()) -> Node | None:
        """The node for a new request (gateway.routing.choose_node), counted in its load; None when
        no listed node is healthy outside `exclude`."""
        block_tokens = next(
            (s.prefix_block_tokens for n in self.listed if (s := self.nodes[n].stats) and s.prefix_block_tokens),
            DEFAULT_BLOCK_TOKENS,
        )
        key = prefix_key(token_ids, block_tokens, self.config.num_key_blocks, scope)
        loads = {n: self.nodes[n].load for n in self.listed}
        node_id = choose_node(self.ring, key, self.healthy(), loads, self.config.limits, exclude)
        if node_id is None:
            return None
        node = self.nodes[node_id]
        node.num_routed += 1
        return node

    def first(self) -> Node | None:
        """Some listed node (a healthy one first): where a request goes when none is healthy, so that
        it waits for the nodes to come back as a single node's requests wait for their primary. None
        while no node is listed (a DNS name that resolved to nothing yet)."""
        healthy = self.healthy()
        if not self.listed:
            return None
        return self.nodes[healthy[0] if healthy else self.listed[0]]

    def place(self, token_ids: Sequence[int], scope: str = "") -> Node | None:
        """route(), or first() when no node is healthy."""
        return self.route(token_ids, scope) or self.first()

    async def fail_over(self, node_id: str, token_ids: Sequence[int], scope: str, error: str) -> Node | None:
        """Another node for a request whose call to node_id's primary failed, when that primary is
        down: it does not report SERVING to a health check now (a refused connection answers at once).
        None when it still serves (a passing fault, or a slot another gateway's lease holds: the request
        waits there as with a single node) or no other node is healthy. A down node gets no new
        requests until a periodic check finds it serving again. A node no longer listed (its address
        left the DNS name's records) is not asked: its requests move at their first failed call."""
        node = self.nodes.get(node_id)
        if node is not None:
            if await node.backends.is_primary_serving(self.config.check_timeout_s):
                return None
            if node.is_healthy:
                node.is_healthy = False
                self.log.warning("node unhealthy: a request's call failed and its check too", node=node_id, error=error)
        return self.route(token_ids, scope, exclude=(node_id,))
