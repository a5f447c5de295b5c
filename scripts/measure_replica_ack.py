"""What acknowledging a step only once a replica holds it costs a step write (specdec.state_store.replica_ack).

    .venv/bin/python scripts/measure_replica_ack.py                 # a throwaway 3-master cluster, 1 replica each
    .venv/bin/python scripts/measure_replica_ack.py --num_steps 5000

On one local cluster, the same store's append_step (4 tokens, stats, owner) awaited one at a time as
the gateway does, alternating in rounds: without replica_ack (the step script alone, as on one
server) and with it (the script and WAIT 1 in one pipeline). Prints the median and p99 latency of each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.redis_cluster import redis_cluster  # noqa: E402
from specdec.state_store import AsyncRedisStateStore, RequestStatus  # noqa: E402
from specdec.state_store.clients import open_async_client  # noqa: E402
from specdec.state_store.redis_url import parse_redis_url  # noqa: E402
from specdec.state_store.replica_ack import ReplicaAck  # noqa: E402

NUM_ROUNDS = 4


async def time_steps_us(store: AsyncRedisStateStore, request_id: str, num_steps: int) -> list[float]:
    """Latency of num_steps append_step calls in a row, each awaited (microseconds)."""
    await store.create(request_id, {}, status=RequestStatus.RUNNING)
    samples = []
    for step in range(num_steps):
        start = time.perf_counter_ns()
        await store.append_step(
            request_id, [1, 2, 3, 4], expected_num_tokens=4 * step, stats={"step": step}, owner="gw-1"
        )
        samples.append((time.perf_counter_ns() - start) / 1000)
    await store.delete(request_id)
    return samples


async def measure(url: str, num_steps: int) -> dict[str, list[float]]:
    client = open_async_client(parse_redis_url(url), 5.0, 32)
    stores = {
        "step script alone": AsyncRedisStateStore(client),
        "step script + WAIT 1": AsyncRedisStateStore(client, replica_ack=ReplicaAck(client)),
    }
    samples: dict[str, list[float]] = {name: [] for name in stores}
    try:
        for round_index in range(NUM_ROUNDS):  # alternated: a busy moment of the machine hits both
            for name, store in stores.items():
                samples[name] += await time_steps_us(store, f"measure-{round_index}", num_steps // NUM_ROUNDS)
    finally:
        await client.aclose()
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num_steps", type=int, default=2000, help="steps timed per variant")
    a = p.parse_args()
    with redis_cluster(num_masters=3, num_replicas=1) as cluster:
        samples = asyncio.run(measure(cluster.url, a.num_steps))
    print("| append_step on a local cluster (1 replica per master) | median us | p99 us |")
    print("|---|---|---|")
    for name, values in samples.items():
        p99 = statistics.quantiles(values, n=100)[98]
        print(f"| {name} | {statistics.median(values):.0f} | {p99:.0f} |")


if __name__ == "__main__":
    main()
