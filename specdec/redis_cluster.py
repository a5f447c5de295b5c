"""A throwaway Redis Cluster on loopback: num_masters masters with num_replicas replicas each, made
by `redis-cli --cluster create`, for `inference.py --serve --redis_cluster`, the test suite and the
state store benchmark. No persistence; every node in a fresh directory under /tmp, removed after.

    with redis_cluster(num_masters=3, num_replicas=1) as cluster:
        store = RedisStateStore.from_url(cluster.url)      # redis+cluster://127.0.0.1:P1,...
        port = master_port_of(cluster, "specdec:req:{r1}:meta")
        os.kill(cluster.pid_of(port), signal.SIGKILL)
        wait_for_failover(cluster, port)                    # a replica now serves its slots

A node's cluster bus listens on its port + 10000 (Redis' fixed offset), so ports are picked in
pairs that are both free, below the kernel's ephemeral range (free_port_pairs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from specdec.redis_server import RedisServerError, await_ping, poll_until, scratch_processes

LOOPBACK = "127.0.0.1"
BUS_PORT_OFFSET = 10000
FIRST_UNRESERVED_PORT = 1024
DEFAULT_EPHEMERAL_PORTS = (32768, 60999)
# How long a master may be unreachable before its replica is promoted: short, for a local cluster.
DEFAULT_NODE_TIMEOUT_MS = 1000
FAILOVER_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterNodeProcess:
    port: int
    pid: int


@dataclasses.dataclass(frozen=True, slots=True)
class LocalRedisCluster:
    nodes: tuple[ClusterNodeProcess, ...]
    url: str  # redis+cluster://127.0.0.1:P1,...: the --redis_url of the services

    def pid_of(self, port: int) -> int:
        return next(node.pid for node in self.nodes if node.port == port)


@contextlib.contextmanager
def redis_cluster(
    num_masters: int = 3,
    num_replicas: int = 1,
    *,
    node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS,
    prefix: str = "specdec-cluster-",
) -> Iterator[LocalRedisCluster]:
    """Start the nodes, create the cluster, wait until every node sees all slots served; yield it;
    stop every node and remove their directories."""
    if num_masters < 3:
        raise ValueError(f"a Redis Cluster needs >= 3 masters, got {num_masters}")
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        raise RedisServerError("redis-server and redis-cli are not installed (`make redis-server` installs them)")
    with scratch_processes(prefix) as (directory, processes):
        ports = free_port_pairs(num_masters * (1 + num_replicas))
        for port in ports:
            processes.append(start_node(binary, directory, port, _cluster_node_args(directory, port, node_timeout_ms)))
        for port, process in zip(ports, processes, strict=True):
            await_ping(process, functools.partial(local_client, port), directory / f"{port}.log")
        _create(cli, ports, num_replicas)
        _await_all_slots(ports)
        nodes = tuple(ClusterNodeProcess(port, p.pid) for port, p in zip(ports, processes, strict=True))
        yield LocalRedisCluster(nodes, "redis+cluster://" + ",".join(f"{LOOPBACK}:{port}" for port in ports))


def free_port_pairs(num_ports: int) -> list[int]:
    """num_ports distinct ports p with p and p + BUS_PORT_OFFSET both free now, and both below the
    kernel's ephemeral range where it has room: the kernel numbers every client connection and every
    bind to port 0 from that range, so a port in it can be taken by any process between this check
    and the node's own bind (a node then fails with "Address already in use"); one below it only by
    a process that binds it by number."""
    first, last = FIRST_UNRESERVED_PORT, ephemeral_ports()[0] - 1 - BUS_PORT_OFFSET
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < num_ports:
        if last > first:
            port = rng.randint(first, last)
        else:  # no room below the range: the kernel's choice
            with socket.socket() as probe:
                probe.bind((LOOPBACK, 0))
                port = probe.getsockname()[1]
        if port + BUS_PORT_OFFSET > 65535 or port in ports:
            continue
        with socket.socket() as node, socket.socket() as bus, contextlib.suppress(OSError):
            node.bind((LOOPBACK, port))
            bus.bind((LOOPBACK, port + BUS_PORT_OFFSET))
            ports.append(port)
    return ports


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range of ports for connections and binds to port 0 (Linux's default elsewhere)."""
    try:
        low, high = map(int, path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_PORTS
    return low, high


def start_node(binary: str, directory: Path, port: int, role_args: Sequence[str] = ()) -> subprocess.Popen:
    """A redis-server on LOOPBACK:port without persistence, working in directory/port (made here) and
    logging to directory/port.log; role_args: what makes it a cluster node or a replica."""
    node_dir = directory / str(port)
    node_dir.mkdir()
    with open(directory / f"{port}.log", "wb") as log:
        return subprocess.Popen(
            [
                binary,
                "--port", str(port),
                "--bind", LOOPBACK,
                "--repl-diskless-sync-delay", "0",  # replicas sync at once, not after 5 s
                "--save", "",
                "--appendonly", "no",
                "--dir", str(node_dir),
                "--daemonize", "no",
                *role_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip


def _cluster_node_args(directory: Path, port: int, node_timeout_ms: int) -> list[str]:
    """What makes a start_node a cluster node: its cluster state file in its directory, its failover timeout."""
    return [
        "--cluster-enabled", "yes",
        "--cluster-config-file", str(directory / str(port) / "nodes.conf"),
        "--cluster-node-timeout", str(node_timeout_ms),
    ]  # fmt: skip


def local_client(port: int, *, decode_responses: bool = False) -> redis.Redis:
    """A client of the local node on `port`, one that gives up on a silent node after a second."""
    return redis.Redis(host=LOOPBACK, port=port, socket_timeout=1.0, decode_responses=decode_responses)


def _create(cli: str, ports: list[int], num_replicas: int) -> None:
    """redis-cli assigns the slots to the first len(ports) / (1 + num_replicas) nodes, the rest
    replicate them (on other "hosts" where it can; all are one host here)."""
    command = [cli, "--cluster", "create", *(f"{LOOPBACK}:{p}" for p in ports)]
    command += ["--cluster-replicas", str(num_replicas), "--cluster-yes"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0 or "[OK] All 16384 slots covered" not in result.stdout:
        raise RedisServerError(f"redis-cli --cluster create failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")


def _await_all_slots(ports: list[int], timeout_s: float = FAILOVER_TIMEOUT_S) -> None:
    """Until every node reports cluster_state:ok and knows every node (the gossip settled), and
    every replica finished its first sync (one that has not cannot be promoted)."""

    def is_settled() -> bool | None:
        infos = _infos(ports)
        num_known = str(len(ports))
        is_known = all(i.get("cluster_state") == "ok" and i.get("cluster_known_nodes") == num_known for i in infos)
        return (is_known and all(_is_in_sync(port) for port in ports)) or None

    poll_until(is_settled, timeout_s, lambda: f"the cluster did not settle within {timeout_s} s: {_infos(ports)}")


def _infos(ports: list[int]) -> list[dict[str, str]]:
    return [_cluster_info(port) for port in ports]


def _is_in_sync(port: int) -> bool:
    """Whether the node on port is a master, or a replica whose link to its master is up."""
    info = replication_info(port)
    return info.get("role") == "master" or info.get("master_link_status") == "up"


def replication_info(port: int) -> dict[str, Any]:
    """INFO replication of the node on port (its role, its master link); {} when it does not answer."""
    try:
        with local_client(port) as client:
            return client.info("replication")
    except redis.ConnectionError:
        return {}


def _cluster_info(port: int) -> dict[str, str]:
    try:
        with local_client(port) as client:
            return {k: str(v) for k, v in client.cluster("INFO").items()}
    except redis.ConnectionError:
        return {}


def master_port_of(cluster: LocalRedisCluster, key: str, exclude: int | None = None) -> int | None:
    """The port of the master serving key's slot, as the live nodes (not exclude) see it; None
    while no live master serves it (a failover under way)."""
    for node in cluster.nodes:
        if node.port == exclude:
            continue
        try:
            with local_client(node.port, decode_responses=True) as client:
                slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
                for line in client.execute_command("CLUSTER", "NODES").splitlines():
                    port = _serving_port(line, slot)
                    if port is not None:
                        return None if port == exclude else port
                return None
        except redis.ConnectionError:
            continue
    return None


def _serving_port(line: str, slot: int) -> int | None:
    """The port of a CLUSTER NODES line's node when it is a healthy master serving slot.
    E.g. "id 127.0.0.1:7001@17001 master - 0 0 1 connected 0-5460" serves slot 42 -> 7001."""
    fields = line.split()
    flags = fields[2].split(",")
    if "master" not in flags or "fail" in flags or "fail?" in flags:
        return None
    for part in fields[8:]:
        if part.startswith("["):  # a slot being migrated
            continue
        first, _, last = part.partition("-")
        if int(first) <= slot <= int(last or first):
            return int(fields[1].split("@")[0].rpartition(":")[2])
    return None


def wait_for_failover(cluster: LocalRedisCluster, dead_port: int, timeout_s: float = FAILOVER_TIMEOUT_S) -> None:
    """Until a live node serves every slot the dead master served and all live nodes report
    cluster_state:ok (polling CLUSTER INFO/NODES); RedisServerError after timeout_s."""
    live = [node.port for node in cluster.nodes if node.port != dead_port]

    def is_taken_over() -> bool | None:
        is_ok = all(i.get("cluster_state") == "ok" for i in _infos(live))
        return (is_ok and _is_dead_port_gone(live[0], dead_port)) or None

    poll_until(
        is_taken_over, timeout_s, lambda: f"no replica took over from {dead_port} within {timeout_s} s: {_infos(live)}"
    )


def _is_dead_port_gone(port: int, dead_port: int) -> bool:
    """Whether the node on port no longer counts dead_port as a master serving slots."""
    try:
        with local_client(port, decode_responses=True) as client:
            lines = client.execute_command("CLUSTER", "NODES").splitlines()
    except redis.ConnectionError:
        return False
    for line in lines:
        fields = line.split()
        if int(fields[1].split("@")[0].rpartition(":")[2]) == dead_port:
            return "fail" in fields[2].split(",") and ("master" not in fields[2] or len(fields) <= 8)
    return True
