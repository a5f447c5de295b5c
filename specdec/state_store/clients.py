"""Redis clients for a RedisTarget (specdec.state_store.redis_url): one server, a Redis Cluster or
a Sentinel-watched master: asyncio for AsyncRedisStateStore, and a plain client for tools that send
commands of their own (scripts/measure_state_store.py).

What each client does across a failover, before the store's caller retries (gateway.state_retry):
- cluster: redis-py's RedisCluster follows MOVED/ASK, and on a connection error or CLUSTERDOWN
  refreshes the slot map and retries a few times; what still fails reaches the store as
  ConnectionError/ClusterDownError/..., which the store reports as Unavailable.
- sentinel: the master's pool asks the sentinels for the current master on every new
  connection and drops connections to a demoted master (READONLY), so a retry after the
  promotion lands on the new master.
require_full_coverage=False: while one master's slots are being failed over, requests whose
slots live on the other masters go on.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.sentinel
import redis.cluster
import redis.sentinel

from specdec.state_store.redis_url import RedisKind, RedisTarget

SyncClient = redis.Redis | redis.cluster.RedisCluster
AsyncClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster


def client_options(timeout_s: float) -> dict[str, Any]:
    """Options of every client: a stalled server fails a call after timeout_s."""
    return {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "health_check_interval": 30}


def _node_options(target: RedisTarget, timeout_s: float) -> dict[str, Any]:
    """Options of the connections to data nodes (cluster nodes, the sentinel's master)."""
    options = client_options(timeout_s)
    if target.username is not None:
        options["username"] = target.username
    if target.password is not None:
        options["password"] = target.password
    if target.is_tls:
        options["ssl"] = True
    return options


def _sentinel_options(target: RedisTarget, timeout_s: float) -> dict[str, Any]:
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if target.is_tls:
        options["ssl"] = True
    return options


def open_sync_client(target: RedisTarget, timeout_s: float) -> SyncClient:
    """A redis-py client on target (connects lazily, except a cluster's, which reads its slot map)."""
    if target.kind is RedisKind.SINGLE:
        return redis.Redis.from_url(target.url, **client_options(timeout_s))
    options = _node_options(target, timeout_s)
    if target.kind is RedisKind.CLUSTER:
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in target.nodes]
        return redis.cluster.RedisCluster(startup_nodes=nodes, require_full_coverage=False, **options)
    sentinel = redis.sentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(target, timeout_s))
    return sentinel.master_for(target.service_name, db=target.db, **options)


def open_async_client(target: RedisTarget, timeout_s: float, max_connections: int) -> AsyncClient:
    """A redis.asyncio client on target; connects on the first call's event loop.

    A single server's pool blocks past max_connections (up to timeout_s) rather than refusing;
    a cluster keeps redis-py's bound per node (100)."""
    if target.kind is RedisKind.SINGLE:
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            target.url, max_connections=max_connections, timeout=timeout_s, **client_options(timeout_s)
        )
        return redis.asyncio.Redis(connection_pool=pool)
    options = _node_options(target, timeout_s)
    if target.kind is RedisKind.CLUSTER:
        nodes = [redis.asyncio.cluster.ClusterNode(host, port) for host, port in target.nodes]
        return redis.asyncio.cluster.RedisCluster(startup_nodes=nodes, require_full_coverage=False, **options)
    sentinel = redis.asyncio.sentinel.Sentinel(list(target.nodes), sentinel_kwargs=_sentinel_options(target, timeout_s))
    return sentinel.master_for(target.service_name, redis_class=redis.asyncio.Redis, db=target.db, **options)


async def close_async_client(client: AsyncClient) -> None:
    """Close client, and the connections to the sentinels of a Sentinel-managed one."""
    await client.aclose()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        await sentinel.aclose()
