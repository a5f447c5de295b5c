"""The node pool: health and load checks decide where new requests go, a failed call moves a request
off a node only when the node's primary is down, and a DNS name's addresses are re-resolved.

The nodes here are stand-ins answering the two calls the pool makes (health Check, GetStats); the
pool over real primaries is tested end to end in tests/e2e/test_nodes.py."""

from __future__ import annotations

import asyncio

from gateway.backends import PrimaryStats
from gateway.node_pool import NodePool, NodePoolConfig
from gateway.nodes import NodeAddress, parse_nodes
from gateway.routing import LoadLimits


class StandInPrimary:
    """What the pool asks of a node's Backends: is_primary_serving, primary_stats, close."""

    def __init__(self, address: NodeAddress) -> None:
        self.address, self.is_serving, self.num_active_requests, self.is_closed = address, True, 0, False

    async def is_primary_serving(self, timeout_s: float) -> bool:
        return self.is_serving

    async def primary_stats(self, timeout_s: float) -> PrimaryStats:
        return PrimaryStats(self.num_active_requests, 0, 1 << 30, 0, 16, 0, 0)

    async def close(self) -> None:
        self.is_closed = True


def pool_of(text: str, limits: LoadLimits = LoadLimits(), resolver=None) -> NodePool:
    kwargs = {} if resolver is None else {"resolver": resolver}
    return NodePool(parse_nodes(text, 2, 3), StandInPrimary, NodePoolConfig(limits=limits), **kwargs)  # type: ignore[arg-type]


PROMPT = list(range(1000, 1100))


def test_requests_sharing_a_prefix_land_on_one_node_until_it_is_unhealthy():
    async def main() -> None:
        pool = pool_of("a:1,b:1,c:1")
        await pool.check()
        homes = {pool.route(PROMPT + [i]).node_id for i in range(20)}  # type: ignore[union-attr]
        assert len(homes) == 1
        home = homes.pop()
        pool.nodes[home].backends.is_serving = False  # type: ignore[attr-defined]
        await pool.check()
        assert home not in pool.healthy()
        moved = pool.route(PROMPT)
        assert moved is not None and moved.node_id != home
        pool.nodes[home].backends.is_serving = True  # type: ignore[attr-defined]
        await pool.check()
        assert pool.route(PROMPT).node_id == home  # type: ignore[union-attr]
        await pool.close()
        assert all(n.backends.is_closed for n in pool.nodes.values())  # type: ignore[attr-defined]

    asyncio.run(main())


def test_a_busy_node_sheds_counting_the_requests_routed_since_its_report():
    async def main() -> None:
        pool = pool_of("a:1,b:1", LoadLimits(max_active_requests=3))
        await pool.check()
        placed = [pool.route(PROMPT).node_id for _ in range(5)]  # type: ignore[union-attr]
        assert placed[:3] == [placed[0]] * 3 and set(placed[3:]) == {n for n in pool.listed if n != placed[0]}
        await pool.check()  # the report replaces the gateway's own count: both idle again
        assert pool.route(PROMPT).node_id == placed[0]  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_failed_call_fails_over_only_when_the_primary_is_down():
    async def main() -> None:
        pool = pool_of("a:1,b:1")
        await pool.check()
        home = pool.route(PROMPT).node_id  # type: ignore[union-attr]
        # still serving (a passing fault, a slot leased to another gateway): the request stays
        assert await pool.fail_over(home, PROMPT, "", "UNAVAILABLE") is None and home in pool.healthy()
        pool.nodes[home].backends.is_serving = False  # type: ignore[attr-defined]
        other = await pool.fail_over(home, PROMPT, "", "UNAVAILABLE")
        assert other is not None and other.node_id != home and pool.healthy() == [other.node_id]
        # no other healthy node: none (the request waits for its node as a single node's does)
        other.backends.is_serving = False  # type: ignore[attr-defined]
        assert await pool.fail_over(other.node_id, PROMPT, "", "UNAVAILABLE") is None
        assert pool.place(PROMPT) is not None  # still somewhere to wait

    asyncio.run(main())


def test_a_dns_name_is_re_resolved_and_a_failed_lookup_keeps_the_nodes():
    answers: list[object] = [["10.0.0.1"], ["10.0.0.1", "10.0.0.2"], OSError("no such host"), ["10.0.0.2"]]

    async def resolver(name: str, port: int) -> list[str]:
        assert (name, port) == ("nodes.svc", 50051)
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer  # type: ignore[return-value]

    async def main() -> None:
        pool = pool_of("dns:///nodes.svc:50051", resolver=resolver)
        assert pool.first() is None  # nothing resolved yet
        listed = []
        for _ in range(4):
            await pool.resolve()
            listed.append(pool.listed)
        assert listed == [
            ("10.0.0.1:50051",),
            ("10.0.0.1:50051", "10.0.0.2:50051"),
            ("10.0.0.1:50051", "10.0.0.2:50051"),
            ("10.0.0.2:50051",),
        ]
        assert pool.nodes["10.0.0.2:50051"].address.draft_address == "10.0.0.2:2"
        await pool.check()
        assert pool.route(PROMPT).node_id == "10.0.0.2:50051"  # type: ignore[union-attr]

    asyncio.run(main())


def test_nodes_gone_from_the_dns_name_are_forgotten_but_not_closed_under_their_requests():
    """A Kubernetes node Pod that is recreated comes back at a new address: the pool kept every node it
    ever resolved, with its connections and states, for as long as the gateway ran. A node whose address
    left the records is forgotten now; its backends stay open for the requests running on it."""
    hosts = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(100)]

    async def resolver(name: str, port: int) -> list[str]:
        return [hosts.pop(0)]

    async def main() -> None:
        pool = pool_of("dns:///nodes.svc:50051", resolver=resolver)
        await pool.resolve()
        await pool.check()
        running = pool.route(PROMPT)  # a request's node, whose address then goes
        assert running is not None
        running.hold()  # as the request's loop does
        while hosts:
            await pool.resolve()
        assert len(pool.nodes) == 1 and list(pool.nodes) == list(pool.listed)
        assert running.node_id not in pool.nodes and not running.backends.is_closed  # type: ignore[attr-defined]
        # its request's failed call moves it to a listed node, without asking the forgotten one
        running.backends.is_serving = True  # type: ignore[attr-defined]
        moved = await pool.fail_over(running.node_id, PROMPT, "", "UNAVAILABLE")
        assert moved is not None and moved.node_id == pool.listed[0]

    asyncio.run(main())


def test_a_node_gone_from_the_dns_name_closes_its_connections_once_nothing_uses_it():
    """Forgotten nodes were never closed: each address a recreated node Pod left behind kept its three
    channels for as long as the gateway ran. One that nothing holds closes when it is forgotten; one a
    request holds closes when that request lets go."""
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    made: list[StandInPrimary] = []

    async def resolver(name: str, port: int) -> list[str]:
        return [hosts.pop(0)]

    def make_backends(address: NodeAddress) -> StandInPrimary:
        made.append(StandInPrimary(address))
        return made[-1]

    async def main() -> None:
        pool = NodePool(parse_nodes("dns:///nodes.svc:50051", 2, 3), make_backends, resolver=resolver)  # type: ignore[arg-type]
        await pool.resolve()
        running = pool.first()
        assert running is not None
        running.hold()  # a request runs on it
        await pool.resolve()  # its address goes: forgotten, held
        await pool.resolve()  # the second's goes too: nothing holds it
        assert [b.is_closed for b in made] == [False, True, False]
        await running.let_go()  # its request ended
        assert [b.is_closed for b in made] == [True, True, False]

    asyncio.run(main())
