"""A throwaway Redis with Sentinel on loopback: one master, num_replicas replicas and num_sentinels
sentinels watching it under one service name, for the test suite. No persistence; every process
in a fresh directory under /tmp, removed afterwards.

    with redis_sentinel() as group:
        store = RedisStateStore.from_url(group.url)   # redis+sentinel://127.0.0.1:S1,.../mymaster
        os.kill(group.master_pid, signal.SIGKILL)
        wait_for_promotion(group)                     # the sentinels name a replica the master
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import redis

from specdec.redis_cluster import LOOPBACK, free_port_pairs, local_client, replication_info, start_node
from specdec.redis_server import START_TIMEOUT_S, RedisServerError, poll_until, scratch_processes

SERVICE_NAME = "specdec"
# How long the master may be silent before the sentinels call it down: short, for a local group.
DOWN_AFTER_MS = 1000
PROMOTION_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class LocalSentinelGroup:
    master_port: int
    master_pid: int
    replica_ports: tuple[int, ...]
    sentinel_ports: tuple[int, ...]
    url: str  # redis+sentinel://127.0.0.1:S1,.../SERVICE_NAME: the --redis_url of the services


@contextlib.contextmanager
def redis_sentinel(num_replicas: int = 1, num_sentinels: int = 3) -> Iterator[LocalSentinelGroup]:
    """Start the master, its replicas and the sentinels (quorum: a majority of them); wait until the
    replicas are in sync and every sentinel knows the replicas and the other sentinels; yield."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisServerError("redis-server is not installed (`make redis-server` installs it)")
    with scratch_processes("specdec-sentinel-") as (directory, processes):
        master, *replicas = free_port_pairs(1 + num_replicas)
        sentinels = free_port_pairs(num_sentinels)
        processes.append(start_node(binary, directory, master))
        processes += [start_node(binary, directory, port, ["--replicaof", LOOPBACK, str(master)]) for port in replicas]
        quorum = num_sentinels // 2 + 1
        processes += [_start_sentinel(binary, directory, port, master, quorum) for port in sentinels]
        _await_ready(master, replicas, sentinels)
        url = "redis+sentinel://" + ",".join(f"{LOOPBACK}:{p}" for p in sentinels) + f"/{SERVICE_NAME}"
        yield LocalSentinelGroup(master, processes[0].pid, tuple(replicas), tuple(sentinels), url)


def _start_sentinel(binary: str, directory: Path, port: int, master: int, quorum: int) -> subprocess.Popen:
    """A sentinel rewrites its configuration file as it learns the group, so each has its own."""
    config = directory / f"sentinel-{port}.conf"
    config.write_text(
        f"port {port}\nbind {LOOPBACK}\ndir {directory}\n"
        f"sentinel monitor {SERVICE_NAME} {LOOPBACK} {master} {quorum}\n"
        f"sentinel down-after-milliseconds {SERVICE_NAME} {DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {SERVICE_NAME} 10000\n"
    )
    with open(directory / f"sentinel-{port}.log", "wb") as log:
        return subprocess.Popen([binary, str(config), "--sentinel"], stdout=log, stderr=subprocess.STDOUT)


def _await_ready(master: int, replicas: list[int], sentinels: list[int]) -> None:
    timeout_s = START_TIMEOUT_S * 3
    poll_until(
        lambda: _is_ready(master, replicas, sentinels) or None,
        timeout_s,
        lambda: f"the sentinel group did not settle within {timeout_s} s",
    )


def _is_ready(master: int, replicas: list[int], sentinels: list[int]) -> bool:
    try:
        for port in replicas:
            with local_client(port) as client:
                if client.info("replication").get("master_link_status") != "up":
                    return False
        for port in sentinels:
            with local_client(port) as client:
                if len(client.sentinel_slaves(SERVICE_NAME)) < len(replicas):
                    return False
                if len(client.sentinel_sentinels(SERVICE_NAME)) < len(sentinels) - 1:
                    return False
    except redis.ConnectionError:
        return False
    except redis.ResponseError:  # a sentinel that does not monitor the service yet
        return False
    return True


def current_master_port(group: LocalSentinelGroup) -> int | None:
    """The master's port as the first sentinel that answers names it; None when none answers."""
    for port in group.sentinel_ports:
        try:
            with local_client(port) as client:
                address = client.sentinel_get_master_addr_by_name(SERVICE_NAME)
            return None if address is None else int(address[1])
        except redis.ConnectionError:
            continue
    return None


def wait_for_promotion(group: LocalSentinelGroup, timeout_s: float = PROMOTION_TIMEOUT_S) -> int:
    """Until the sentinels name another master than group.master_port and it answers as a master;
    its port. RedisServerError after timeout_s."""

    def promoted() -> int | None:
        port = current_master_port(group)
        return port if port is not None and port != group.master_port and _is_master(port) else None

    return poll_until(promoted, timeout_s, lambda: f"no replica was promoted within {timeout_s} s")


def _is_master(port: int) -> bool:
    return replication_info(port).get("role") == "master"
