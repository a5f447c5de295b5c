"""Steps acknowledged once a replica holds them, on a replicated Redis (a cluster whose masters have
replicas, a Sentinel-watched master).

Redis replicates asynchronously: a master answers a write before its replicas have it. A master
killed just after answering (kill -9, a lost machine) takes the write with it, and the replica
promoted in its place serves the request without that step, though the gateway was told it was
stored (tests/specdec/state_store/test_cluster_failover.py lost a step this way, once).

So the step script and `WAIT 1 <timeout_ms>` go in one pipeline, on one connection to the master
of the request's slot. WAIT answers once a replica has acknowledged everything that connection wrote
(the script's write last), or after the timeout with how many did:
- 1: the write is on a replica, which a failover promotes; acknowledged.
- 0, and the master has an in-sync replica (online, acknowledged within MAX_REPLICA_LAG_S): the write
  is not safe yet. Unavailable, which the gateway retries (gateway.state_retry); the retry is a
  replay (keyed by the step's position, STEP_LUA), which re-arms the expiry: a write, so the retry's
  WAIT covers the step whichever connection it goes on.
- 0, and no in-sync replica (a promoted master alone, its replica down or lagging): nothing to wait
  for; acknowledged. The master's writes then skip the WAIT; every NO_REPLICA_RECHECK_S one INFO
  asks whether a replica is back.
A single server (redis://, unix://) has no failover that promotes a replica: its writes go as
before, one EVALSHA, with no WAIT.

Cost (scripts/measure_replica_ack.py: a local 3-master cluster, one replica each, a busy 2-core
machine; 2000 steps each): append_step 275 -> 304 us median, 440 -> 479 us p99. The replica's
round trip is partly paid back by sending to the slot's node directly, past the cluster client's
per-command routing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import redis.asyncio
import redis.asyncio.cluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, SlotNotCoveredError

from specdec.errors import Unavailable
from specdec.state_store.redis_scripts import UNAVAILABLE_ERRORS

# How long a write waits for a replica's acknowledgment: a replica on the same network acknowledges
# within a millisecond; one slower than this is lagging, and the write is retried.
DEFAULT_ACK_TIMEOUT_MS = 100
# A replica whose last acknowledgment is older than this (seconds; replicas acknowledge every
# second) is not counted as in sync: a write it has not acknowledged is not waited for.
MAX_REPLICA_LAG_S = 2
# How long a master found without an in-sync replica is written to without WAIT before INFO asks again.
NO_REPLICA_RECHECK_S = 1.0
# What redis-py 8.1's asyncio connection raises, instead of ConnectionError, when the cluster client
# closes a connection under a command (after a failover it replaces the node objects and disconnects
# the old ones, which a write here may still hold): redis-py issues #3546 and #4287, fixed after 8.1.
# Seen here as "'NoneType' object has no attribute 'writelines'" while loading the step script on a
# just-promoted master. Raised by a node's command, it means the connection was lost.
_CLOSED = (AttributeError, TypeError)


def num_synced_replicas(info: dict[str, Any]) -> int:
    """The in-sync replicas in a master's INFO replication (redis-py's parsed dict).
    E.g. {"connected_slaves": 2, "slave0": {"state": "online", "lag": 0, ...},
    "slave1": {"state": "wait_bgsave", "lag": 0, ...}} -> 1."""
    replicas = (info.get(f"slave{i}") for i in range(int(info.get("connected_slaves", 0))))
    return sum(
        1
        for r in replicas
        if isinstance(r, dict) and r.get("state") == "online" and int(r.get("lag", 0)) <= MAX_REPLICA_LAG_S
    )


class _Master(Protocol):
    """The master a write goes to, and one connection's worth of commands to it."""

    name: str

    async def send(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """commands in one pipeline on one connection; each one's reply, or its error as an exception."""
        ...

    async def info_replication(self) -> dict[str, Any]: ...

    async def load_script(self, script: AsyncScript) -> None: ...


class _ClusterMaster:
    """The master of a slot, through redis-py's node of it: the cluster client's own pipeline
    re-routes a command that lost its node (a WAIT) to another master after a connection error,
    where its reply would say nothing of this write."""

    def __init__(self, node: redis.asyncio.cluster.ClusterNode) -> None:
        self.node = node
        self.name = node.name

    async def send(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        queued = [redis.asyncio.cluster.PipelineCommand(i, *args) for i, args in enumerate(commands)]
        with self._closed_as_connection_error():
            await self.node.execute_pipeline(queued)
        return [self._connection_error(c.result) if isinstance(c.result, _CLOSED) else c.result for c in queued]

    async def info_replication(self) -> dict[str, Any]:
        with self._closed_as_connection_error():
            return await self.node.execute_command("INFO", "replication")

    async def load_script(self, script: AsyncScript) -> None:
        with self._closed_as_connection_error():
            await self.node.execute_command("SCRIPT", "LOAD", script.script)

    @contextlib.contextmanager
    def _closed_as_connection_error(self) -> Iterator[None]:
        try:
            yield
        except _CLOSED as e:
            raise self._connection_error(e) from e

    def _connection_error(self, e: BaseException) -> redis.ConnectionError:
        return redis.ConnectionError(f"the connection to {self.name} was closed under the command: {e!r}")


class _SentinelMaster:
    """The Sentinel-watched master: its client's pipeline is one connection to the current master."""

    name = "master"

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client

    async def send(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for args in commands:
            pipe.execute_command(*args)
        return await pipe.execute(raise_on_error=False)

    async def info_replication(self) -> dict[str, Any]:
        return await self.client.info("replication")

    async def load_script(self, script: AsyncScript) -> None:
        await self.client.script_load(script.script)


class ReplicaAck:
    """Runs a write script (the store's step) so that its reply means a replica holds the write."""

    def __init__(
        self,
        client: redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster,
        *,
        timeout_ms: int = DEFAULT_ACK_TIMEOUT_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0 (0 would make WAIT block forever), got {timeout_ms}")
        self._client = client
        self.timeout_ms = timeout_ms
        self._clock = clock
        # master name -> when to ask again whether it has an in-sync replica (none had, last asked)
        self._alone_until: dict[str, float] = {}

    async def run(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """script's reply for keys (all of one slot) and args, once a replica acknowledged its write.
        Raises the script's error reply or the client's error as redis-py does; Unavailable when the
        write may be on the master only."""
        try:
            return await self._run(script, keys, args)
        except UNAVAILABLE_ERRORS:
            await self._reroute(keys[0])
            raise

    async def _run(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        master = await self._master(keys[0])
        if not await self._has_replica(master):
            return await script(keys, args)
        reply, num_acked = await self._write_and_wait(master, script, keys, args)
        if isinstance(reply, Exception):
            raise reply
        if isinstance(num_acked, Exception):  # e.g. the master was just demoted: WAIT refused on a replica
            await self._reroute(keys[0])
            raise Unavailable(
                "state_store", f"Redis unreachable: WAIT after the write failed: {num_acked}", dependency="state_store"
            ) from num_acked
        if num_acked >= 1:
            return reply
        num_synced = num_synced_replicas(await master.info_replication())
        if num_synced == 0:  # nothing to wait for: the write is as safe as the deployment allows now
            self._alone_until[master.name] = self._clock() + NO_REPLICA_RECHECK_S
            return reply
        raise Unavailable(
            "state_store",
            f"Redis master {master.name}: none of its {num_synced} replicas acknowledged the write "
            f"within {self.timeout_ms} ms",
            dependency="state_store",
        )

    async def _master(self, key: str) -> _Master:
        if isinstance(self._client, redis.asyncio.cluster.RedisCluster):
            await self._client.initialize()  # a no-op once the slot map is read
            node = self._client.get_node_from_key(key)
            if node is None:
                raise SlotNotCoveredError(f"no master serves the slot of {key!r} now")
            return _ClusterMaster(node)
        return _SentinelMaster(self._client)

    async def _has_replica(self, master: _Master) -> bool:
        """False while master was last found without an in-sync replica, asking again when that is due."""
        until = self._alone_until.get(master.name)
        if until is None:
            return True
        if self._clock() < until:
            return False
        if num_synced_replicas(await master.info_replication()) == 0:
            self._alone_until[master.name] = self._clock() + NO_REPLICA_RECHECK_S
            return False
        del self._alone_until[master.name]
        return True

    async def _write_and_wait(
        self, master: _Master, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, Any]:
        """(the script's reply, WAIT's reply), each an exception where it failed; the script is
        loaded once where the master does not know it (a promoted replica, a restarted node)."""
        commands = [("EVALSHA", script.sha, len(keys), *keys, *args), ("WAIT", 1, self.timeout_ms)]
        reply, num_acked = await master.send(commands)
        if isinstance(reply, NoScriptError):
            await master.load_script(script)
            reply, num_acked = await master.send(commands)
        return reply, num_acked

    async def _reroute(self, key: str) -> None:
        """After a failed write to a cluster node: one command for key through the cluster client,
        which follows a MOVED or re-reads the slot map after a connection error, so that the retry
        of the write finds the slot's master as it is now."""
        if isinstance(self._client, redis.asyncio.cluster.RedisCluster):
            with contextlib.suppress(redis.RedisError, *_CLOSED):
                await self._client.exists(key)
