"""Measure the per-step write of the Redis state store (and the token-log layout).

    .venv/bin/python scripts/measure_state_store.py --url unix:///tmp/redis.sock
    .venv/bin/python scripts/measure_state_store.py --url redis+cluster://127.0.0.1:7000
    .venv/bin/python scripts/measure_state_store.py --local_cluster   # a throwaway 3-master cluster

Compares, on the same server: a PING round trip; the store's append_step (one
EVALSHA of the step script: checks + APPEND + HSET + PEXPIRE), awaited on the store's
event loop as the gateway does it, and once through the blocking SyncStateStore; a bare MULTI
pipeline doing the same writes without checks; and the token-log layouts
APPEND (one string, 4 bytes per token) vs RPUSH (one list item of packed
int32 per step): write time, memory (MEMORY USAGE) and the time to load the
whole log back. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim_redis import STEP_CONTROLLER, STEP_STATS  # noqa: E402
from specdec.redis_cluster import redis_cluster  # noqa: E402
from specdec.state_store import RedisStateStore, StateStoreConfig, encode_token_ids  # noqa: E402
from specdec.state_store.clients import open_sync_client  # noqa: E402
from specdec.state_store.redis_url import parse_redis_url  # noqa: E402
from specdec.flag_spellings import add_spellings

# The layouts' keys share one hash tag: on a cluster a MULTI runs on one slot only.
TOKENS_KEY, LIST_KEY, META_KEY = "m:{layout}:tokens", "m:{layout}:list", "m:{layout}:meta"


def time_us(fn: Callable[[int], object], num_iters: int) -> list[float]:
    samples = []
    for i in range(num_iters):
        start = time.perf_counter_ns()
        fn(i)
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


async def time_awaited_us(fn: Callable[[int], Awaitable[object]], num_iters: int) -> list[float]:
    """time_us of a coroutine function, each call awaited on the running loop (the gateway's way)."""
    samples = []
    for i in range(num_iters):
        start = time.perf_counter_ns()
        await fn(i)
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def row(name: str, samples: list[float]) -> str:
    samples = sorted(samples)
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return f"| {name} | {statistics.median(samples):.1f} | {statistics.fmean(samples):.1f} | {p99:.1f} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="any --redis_url: one server, redis+cluster://..., redis+sentinel://...")
    where.add_argument(
        "--local_cluster", action="store_true", help="start a throwaway 3-master + 3-replica cluster on loopback"
    )
    parser.add_argument("--num-steps", type=int, default=2000)
    parser.add_argument("--tokens-per-step", type=int, default=4)
    args = add_spellings(parser).parse_args()
    with contextlib.ExitStack() as resources:
        url = resources.enter_context(redis_cluster()).url if args.local_cluster else args.url
        return measure(url, args.num_steps, args.tokens_per_step)


def measure(url: str, num_steps: int, tokens_per_step: int) -> int:
    client = open_sync_client(parse_redis_url(url), timeout_s=5.0)  # the raw commands' client
    store = RedisStateStore.from_url(url, StateStoreConfig(namespace=f"measure{uuid.uuid4().hex[:8]}"))
    n, k = num_steps, tokens_per_step
    step_tokens = [[(i * k + j) % 49152 for j in range(k)] for i in range(n)]
    print(f"{n} steps of {k} tokens, stats ~{len(str(STEP_STATS))} B JSON, url {url}\n")
    print("| per-step operation | median µs | mean µs | p99 µs |\n|---|---|---|---|")
    print(row("PING (round-trip floor)", time_us(lambda i: client.ping(), n)))
    store_appends(store, step_tokens)
    raw_appends(client, step_tokens)
    token_log_sizes(client, store, n, n * k)
    for rid in ("r1", "r2", "r3"):
        store.delete(rid)
    client.delete(TOKENS_KEY, LIST_KEY, META_KEY)
    store.close()
    client.close()
    return 0


def store_appends(store: RedisStateStore, step_tokens: list[list[int]]) -> None:
    """The store's step write, awaited on the store's loop as the gateway does: tokens alone, then
    with stats, controller state and the lease; then one call through the blocking facade (what
    a synchronous tool pays: the same write plus the hop to the store's loop thread)."""
    n, k, backend = len(step_tokens), len(step_tokens[0]), store.store
    store.create("r1", {"prompt": "x" * 200, "max_new_tokens": n * k}, prompt_token_ids=list(range(256)))
    tokens_only = store.run(
        time_awaited_us(lambda i: backend.append_step("r1", step_tokens[i], expected_num_tokens=i * k), n)
    )
    print(row("append_step: tokens only", tokens_only))
    store.create("r2", {"prompt": "x" * 200}, prompt_token_ids=list(range(256)))

    def whole_step(i: int) -> Awaitable[int]:
        return backend.append_step(
            "r2",
            step_tokens[i],
            expected_num_tokens=i * k,
            stats=STEP_STATS,
            controller_state=STEP_CONTROLLER,
            owner="gw-1",
        )

    print(row("append_step: tokens + stats + controller + lease", store.run(time_awaited_us(whole_step, n))))
    store.create("r3", {"prompt": "x" * 200}, prompt_token_ids=list(range(256)))
    blocking = time_us(lambda i: store.append_step("r3", step_tokens[i], expected_num_tokens=i * k), n)
    print(row("append_step: tokens only, through SyncStateStore", blocking))


def raw_appends(client: Any, step_tokens: list[list[int]]) -> None:
    """Bare MULTI blocks of the two token-log layouts, without the store's checks."""
    stats_json = json.dumps(STEP_STATS)

    def multi_append(i: int) -> None:
        pipe = client.pipeline(transaction=True)
        pipe.append(TOKENS_KEY, encode_token_ids(step_tokens[i])).hset(META_KEY, mapping={"stats": stats_json})
        pipe.pexpire(TOKENS_KEY, 86_400_000).pexpire(META_KEY, 86_400_000).execute()

    def multi_rpush(i: int) -> None:
        pipe = client.pipeline(transaction=True)
        pipe.rpush(LIST_KEY, encode_token_ids(step_tokens[i])).hset(META_KEY, mapping={"stats": stats_json})
        pipe.pexpire(LIST_KEY, 86_400_000).pexpire(META_KEY, 86_400_000).execute()

    client.delete(TOKENS_KEY, LIST_KEY, META_KEY)
    print(row("MULTI: APPEND + HSET stats + 2 PEXPIRE (no checks)", time_us(multi_append, len(step_tokens))))
    print(row("MULTI: RPUSH + HSET stats + 2 PEXPIRE (no checks)", time_us(multi_rpush, len(step_tokens))))


def token_log_sizes(client: Any, store: RedisStateStore, num_steps: int, num_tokens: int) -> None:
    """What each layout's log of num_tokens tokens takes, and how long loading it back takes."""
    print(f"\n| token log of {num_tokens} tokens | bytes (MEMORY USAGE) | load median µs |\n|---|---|---|")
    load_str = time_us(lambda i: client.get(TOKENS_KEY), 200)
    load_list = time_us(lambda i: b"".join(client.lrange(LIST_KEY, 0, -1)), 200)
    print(f"| APPEND string | {client.memory_usage(TOKENS_KEY)} | {statistics.median(load_str):.1f} |")
    print(f"| RPUSH list ({num_steps} items) | {client.memory_usage(LIST_KEY)} | {statistics.median(load_list):.1f} |")
    print(f"| store.load (whole state) | - | {statistics.median(time_us(lambda i: store.load('r2'), 200)):.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
