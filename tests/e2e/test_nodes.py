"""Two nodes behind two gateways on loopback: prefix-affinity routing, and failover of a node and of
a gateway without a token lost or repeated, on one Redis server and on a 3-master Redis Cluster.

The cluster is specdec.cluster's: each node a primary, draft pool and validator; each gateway routes
to both nodes (--nodes). Greedy streams run once undisturbed, then again while one whole node is
killed (SIGKILL of its three processes), on Redis Cluster also the master that holds one of the
streams' keys (its replica is promoted), and then one gateway: every stream must end with the
undisturbed run's tokens.
A stream whose node died goes on in the same call (its requests re-prefill on the other node); a
stream whose gateway died is retried by its client on the other gateway with the same request id,
which sends the stored output from the start and takes the request over once the dead gateway fails
its health checks (gateway.owner_probe). The lease is 30 s here, longer than the whole kill-and-retry
phase takes, and the surviving gateway's log must show the takeover: adoption comes from the probe,
not from the lease lapsing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from specdec.cluster import cluster_specs, node_name
from specdec.launcher import DRAFT, GATEWAY, PRIMARY, VALIDATOR, Stack, StackConfig
from specdec.redis_cluster import LocalRedisCluster, master_port_of, wait_for_failover
from specdec.state_store import DEFAULT_NAMESPACE, RedisStateStore
from specdec.v1 import gateway_pb2, gateway_pb2_grpc, primary_pb2, primary_pb2_grpc

pytestmark = pytest.mark.e2e

NUM_STREAMS = 8
MAX_NEW_TOKENS = 64
OWNER_LEASE_S = 30.0
TOPICS = ("rivers", "volcanoes", "bridges", "owls", "comets", "glaciers", "deserts", "lighthouses")
# ~300 tokens shared by the routing test's prompts (several of the primary's 16-token cache blocks)
SYSTEM = " ".join(f"Rule {i}: answer briefly, precisely and politely, citing manual section {i}." for i in range(20))


@pytest.fixture(scope="module", params=["redis_server", "redis_cluster"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The nodes and gateways on a Redis server or on a Redis Cluster (request.param: the fixture)."""
    redis = request.getfixturevalue(request.param)
    config = StackConfig(redis_url=redis.url, log_dir=tmp_path_factory.mktemp(f"stack-nodes-{request.param}"))
    gateway_args = ("--owner_lease_s", str(OWNER_LEASE_S), "--node_check_interval_s", "0.5")
    with Stack(config, specs=cluster_specs(config, 2, 2, gateway_args)) as started:
        yield started


def _gateway(stack: Stack, index: int) -> gateway_pb2_grpc.GenerationServiceStub:
    return gateway_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(stack.addresses[node_name(GATEWAY, index)]))


def _stats(stack: Stack, node: int) -> primary_pb2.GetStatsResponse:
    with stack.channel(node_name(PRIMARY, node)) as channel:
        return primary_pb2_grpc.PrimaryServiceStub(channel).GetStats(primary_pb2.GetStatsRequest(), timeout=30)


def _request(request_id: str, topic: str) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(request_id=request_id, max_new_tokens=MAX_NEW_TOKENS)
    req.chat.messages.add(role="user", content=f"Write a long, detailed essay about {topic}.")
    return req


class StreamClient:
    """One greedy stream read in a thread, retried with the same request id on the other gateway when
    its gateway goes away: the retry sends the whole stored output, which replaces what was read."""

    def __init__(self, stack: Stack, request: gateway_pb2.GenerateRequest, gateway: int) -> None:
        self.stack, self.request, self.gateway = stack, request, gateway
        self.token_ids: list[int] = []
        self.before_retry: list[int] | None = None  # what the first call had read when its gateway died
        self.error: BaseException | None = None
        self.is_final = threading.Event()
        self.has_first = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _read(self, gateway: int) -> None:
        for message in _gateway(self.stack, gateway).GenerateStream(self.request, timeout=600):
            self.token_ids.extend(message.token_ids)
            self.has_first.set()
            if message.is_final:
                self.is_final.set()

    def _run(self) -> None:
        try:
            try:
                self._read(self.gateway)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or self.before_retry is not None:
                    raise
                self.before_retry, self.token_ids = self.token_ids, []
                self._read(1 - self.gateway)
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.error = e
        finally:
            self.has_first.set()


def _until(predicate, timeout_s: float = 120.0, what: str = "") -> None:
    give_up = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < give_up, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def test_requests_sharing_a_system_prompt_land_on_one_node(cluster: Stack):
    before = [_stats(cluster, n) for n in (0, 1)]
    assert all(s.prefix_block_tokens > 0 for s in before)
    for i, topic in enumerate(TOPICS[:4]):
        req = gateway_pb2.GenerateRequest(request_id=f"shared-{i}", max_new_tokens=2, prompt=f"{SYSTEM}\nQ: {topic}?")
        _gateway(cluster, i % 2).Generate(req, timeout=300)
    after = [_stats(cluster, n) for n in (0, 1)]
    queried = [a.num_prefix_query_tokens - b.num_prefix_query_tokens for a, b in zip(after, before)]
    reused = [a.num_prefix_reused_tokens - b.num_prefix_reused_tokens for a, b in zip(after, before)]
    home = 0 if queried[0] else 1
    assert queried[1 - home] == 0, f"the shared prefix went to both nodes: {queried}"
    # the first request fills the cache; the three others reuse the shared ~300 tokens
    assert reused[home] / queried[home] > 0.6, (reused, queried)


def _kill_the_master_of(request: pytest.FixtureRequest, clients: dict[str, StreamClient]) -> int | None:
    """On Redis Cluster: SIGKILL of the master that holds a running stream's keys; its port (None on
    one Redis server)."""
    if "redis_cluster" not in request.fixturenames:
        return None
    redis: LocalRedisCluster = request.getfixturevalue("redis_cluster")
    running = next(c for c in clients.values() if not c.is_final.is_set())
    victim = master_port_of(redis, f"{DEFAULT_NAMESPACE}:req:{{{running.request.request_id}}}:meta")
    assert victim is not None
    os.kill(redis.pid_of(victim), signal.SIGKILL)
    return victim


def test_streams_survive_a_node_kill_and_a_gateway_kill(cluster: Stack, request: pytest.FixtureRequest):
    # the reference runs are a tenant of their own: the runs below draft nothing from their outputs
    # (the primaries' learned answers), so they take as long as a first answer and are still running
    # when the node dies
    undisturbed = {
        topic: StreamClient(cluster, _request(f"ref/{topic}", topic), gateway=i % 2)
        for i, topic in enumerate(TOPICS[:NUM_STREAMS])
    }
    for c in undisturbed.values():
        c.thread.join(600)
        assert c.error is None and c.is_final.is_set(), c.error
    reference = {topic: c.token_ids for topic, c in undisturbed.items()}
    clients = {
        topic: StreamClient(cluster, _request(f"run-{topic}", topic), gateway=i % 2)
        for i, topic in enumerate(TOPICS[:NUM_STREAMS])
    }
    for c in clients.values():
        assert c.has_first.wait(300) and c.error is None, c.error
    loads = [_stats(cluster, n).num_active_requests for n in (0, 1)]
    victim = 0 if loads[0] >= loads[1] else 1
    survivor = 1 - victim
    num_read = {t: len(c.token_ids) for t, c in clients.items()}
    for service in (PRIMARY, DRAFT, VALIDATOR):
        cluster.kill(node_name(service, victim), signal.SIGKILL)
    # a stream that had ended by now may have ended on the victim; every other one ends on the survivor
    ended_before_kill = {t for t, c in clients.items() if c.is_final.is_set()}
    # every stream moves on after the kill (the victim's by failing over) before a gateway dies too
    _until(
        lambda: all(len(c.token_ids) > num_read[t] or c.is_final.is_set() for t, c in clients.items()),
        what="streams went on after the node kill",
    )
    redis_victim = _kill_the_master_of(request, clients)
    cluster.kill(node_name(GATEWAY, 0), signal.SIGKILL)
    for c in clients.values():
        c.thread.join(600)
    for topic, c in clients.items():
        assert c.error is None, f"{topic}: {c.error}"
        assert c.token_ids == reference[topic], f"{topic}: the stream's tokens differ from the undisturbed run"
        if c.before_retry is not None:  # what the dead gateway had sent is where the retry's output starts
            assert c.token_ids[: len(c.before_retry)] == c.before_retry
    retried = [t for t, c in clients.items() if c.before_retry is not None]
    assert retried, "no stream was still running on the killed gateway"
    takeovers = [
        line
        for line in (cluster.log_dir / f"{node_name(GATEWAY, 1)}.log").read_text().splitlines()
        if "took over a request from a gateway that does not answer" in line
    ]
    for topic in retried:
        assert any(f"run-{topic}" in line for line in takeovers), f"{topic}: not taken over from the dead gateway"
    if redis_victim is not None:
        wait_for_failover(request.getfixturevalue("redis_cluster"), redis_victim)
    store = RedisStateStore.from_url(cluster.config.redis_url)
    try:
        for topic in TOPICS[:NUM_STREAMS]:
            state = store.load(f"run-{topic}")
            assert state is not None and state.status.value == "finished"
            assert list(state.token_ids) == reference[topic]
            if topic not in ended_before_kill:
                assert state.node.endswith(cluster.addresses[node_name(PRIMARY, survivor)].rpartition(":")[2])
        assert not {f"run-{t}" for t in TOPICS} & set(store.list_active())
    finally:
        store.close()
    _until(
        lambda: (s := _stats(cluster, survivor)).num_active_requests == 0 and s.kv_bytes == 0,
        timeout_s=60,
        what="the surviving node released every request",
    )
