"""Steps acknowledged once a replica holds them (specdec.state_store.replica_ack): the count of in-sync
replicas read from INFO; on a real 3-master + 3-replica cluster on loopback (this module's own) a step
whose master's replica is stalled (SIGSTOP) is Unavailable until the replica has it, then stored
once, and a master whose replica is gone acknowledges without waiting; one server sends no WAIT."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import redis

from gateway.state_retry import give_up_at, with_state_retries
from specdec.errors import Unavailable
from specdec.redis_cluster import LocalRedisCluster, local_client, master_port_of
from specdec.state_store import AsyncRedisStateStore, RequestStatus
from specdec.state_store.replica_ack import DEFAULT_ACK_TIMEOUT_MS, MAX_REPLICA_LAG_S, num_synced_replicas


def test_in_sync_replicas_are_online_and_acknowledged_lately() -> None:
    online = {"state": "online", "lag": 0}
    info = {
        "connected_slaves": 4,
        "slave0": online,
        "slave1": {"state": "wait_bgsave", "lag": 0},  # still loading the master's snapshot
        "slave2": {"state": "online", "lag": MAX_REPLICA_LAG_S + 1},  # silent for seconds
        "slave3": {"state": "online", "lag": MAX_REPLICA_LAG_S},
    }
    assert num_synced_replicas(info) == 2
    assert num_synced_replicas({"role": "master", "connected_slaves": 0}) == 0


def replica_port_of(cluster: LocalRedisCluster, master_port: int) -> int:
    """The port of the replica of the master on master_port."""
    with local_client(master_port, decode_responses=True) as client:
        master_id = client.execute_command("CLUSTER", "MYID")
        lines = client.execute_command("CLUSTER", "NODES").splitlines()
    for line in lines:
        fields = line.split()
        if fields[3] == master_id:
            return int(fields[1].split("@")[0].rpartition(":")[2])
    raise AssertionError(f"no replica of {master_port}")


def test_a_step_is_acknowledged_once_the_replica_has_it(redis_cluster: LocalRedisCluster) -> None:
    async def run() -> tuple[float, int, tuple[int, ...]]:
        store = AsyncRedisStateStore.from_url(redis_cluster.url)
        try:
            await store.create("stalled", {}, status=RequestStatus.RUNNING)
            # as the gateway writes it, retried: a replica that is still catching up with the new
            # cluster, or a busy machine, can miss one ack's 100 ms
            first = await with_state_retries(
                lambda: store.append_step("stalled", [1, 2], expected_num_tokens=0), give_up_at(10.0, None)
            )
            assert first == 2
            master = master_port_of(redis_cluster, store.keys("stalled")[0])
            assert master is not None
            replica_pid = redis_cluster.pid_of(replica_port_of(redis_cluster, master))
            os.kill(replica_pid, signal.SIGSTOP)  # online to its master, acknowledging nothing
            try:
                start = time.monotonic()
                with pytest.raises(Unavailable, match="acknowledged"):
                    await store.append_step("stalled", [3, 4], expected_num_tokens=2)
                waited_s = time.monotonic() - start
            finally:
                os.kill(replica_pid, signal.SIGCONT)
            # the gateway's retry: a replay of the applied step, acknowledged once the replica has it
            num_tokens = await with_state_retries(
                lambda: store.append_step("stalled", [3, 4], expected_num_tokens=2), give_up_at(10.0, None)
            )
            state = await store.load("stalled")
            assert state is not None and await store.delete("stalled")
            return waited_s, num_tokens, state.token_ids
        finally:
            await store.close()

    waited_s, num_tokens, token_ids = asyncio.run(run())
    assert waited_s >= DEFAULT_ACK_TIMEOUT_MS / 1000
    assert num_tokens == 4 and token_ids == (1, 2, 3, 4)


def test_a_master_without_a_replica_acknowledges_without_waiting(redis_cluster: LocalRedisCluster) -> None:
    """The module's last test: it kills a replica."""

    async def run() -> list[float]:
        store = AsyncRedisStateStore.from_url(redis_cluster.url)
        try:
            await store.create("alone", {}, status=RequestStatus.RUNNING)
            master = master_port_of(redis_cluster, store.keys("alone")[0])
            assert master is not None
            os.kill(redis_cluster.pid_of(replica_port_of(redis_cluster, master)), signal.SIGKILL)
            with local_client(master) as client:  # the master drops the replica's closed link
                give_up = time.monotonic() + 10
                while client.info("replication")["connected_slaves"] and time.monotonic() < give_up:
                    time.sleep(0.05)
            times_s = []
            for step in range(10):
                start = time.monotonic()
                assert await store.append_step("alone", [step], expected_num_tokens=step) == step + 1
                times_s.append(time.monotonic() - start)
            return times_s
        finally:
            await store.close()

    times_s = asyncio.run(run())
    # The first step waits out WAIT's timeout and finds no replica in sync; the next ones do not wait.
    assert times_s[0] >= DEFAULT_ACK_TIMEOUT_MS / 1000, times_s
    assert max(times_s[1:]) < DEFAULT_ACK_TIMEOUT_MS / 1000, times_s


def test_a_single_server_store_sends_no_wait(redis_server, redis_client: redis.Redis) -> None:
    async def run() -> None:
        store = AsyncRedisStateStore.from_url(redis_server.url)
        try:
            await store.create("single", {}, status=RequestStatus.RUNNING)
            assert await store.append_step("single", [1], expected_num_tokens=0) == 1
        finally:
            await store.close()

    asyncio.run(run())
    assert "cmdstat_wait" not in redis_client.info("commandstats")
