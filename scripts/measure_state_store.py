"""Measure the per-step write of the Redis state store (and the token-log layout).

    .venv/bin/python scripts/measure_state_store.py --url unix:///tmp/redis.sock

Compares, on the same server: a PING round trip; the store's append_step (one
EVALSHA of the step script: checks + APPEND + HSET + PEXPIRE); a bare MULTI
pipeline doing the same writes without checks; and the token-log layouts
APPEND (one string, 4 bytes per token) vs RPUSH (one list item of packed
int32 per step): write time, memory (MEMORY USAGE) and the time to load the
whole log back. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.state_store import RedisStateStore, StateStoreConfig, encode_token_ids  # noqa: E402
from specdec.flag_spellings import add_spellings

STATS = {
    "num_steps": 100,
    "num_proposed_tokens": 800,
    "num_accepted_tokens": 300,
    "acceptance_rate": 0.375,
    "stage_times": {"draft_ms": 12.5, "verify_ms": 3100.2, "validate_ms": 8.1, "state_ms": 9.9},
}
CONTROLLER = {"speculative_degree": 3, "draft_length": 6, "ewma_acceptance": 0.41}


def time_us(fn: Callable[[int], object], num_iters: int) -> list[float]:
    samples = []
    for i in range(num_iters):
        start = time.perf_counter_ns()
        fn(i)
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def row(name: str, samples: list[float]) -> str:
    samples = sorted(samples)
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return f"| {name} | {statistics.median(samples):.1f} | {statistics.fmean(samples):.1f} | {p99:.1f} |"


def store_appends(client: redis.Redis, store: RedisStateStore, step_tokens: list[list[int]]) -> None:
    """The store's own per-step write, with tokens only and with everything a step writes."""
    n, k = len(step_tokens), len(step_tokens[0])
    store.create("r1", {"prompt": "x" * 200, "max_new_tokens": n * k}, prompt_token_ids=list(range(256)))
    print(
        row(
            "append_step: tokens only",
            time_us(lambda i: store.append_step("r1", step_tokens[i], expected_num_tokens=i * k), n),
        )
    )
    store.create("r2", {"prompt": "x" * 200}, prompt_token_ids=list(range(256)))
    print(
        row(
            "append_step: tokens + stats + controller + lease",
            time_us(
                lambda i: store.append_step(
                    "r2", step_tokens[i], expected_num_tokens=i * k, stats=STATS, controller_state=CONTROLLER,
                    owner="gw-1",
                ),
                n,
            ),
        )
    )  # fmt: skip


def raw_appends(client: redis.Redis, step_tokens: list[list[int]]) -> None:
    """The floor under append_step: the same writes as one MULTI without the store's checks, as a
    string (APPEND) and as a list (RPUSH)."""
    stats_json = json.dumps(STATS)

    def multi_append(i: int) -> None:
        pipe = client.pipeline(transaction=True)
        pipe.append("m:tokens", encode_token_ids(step_tokens[i])).hset("m:meta", mapping={"stats": stats_json})
        pipe.pexpire("m:tokens", 86_400_000).pexpire("m:meta", 86_400_000).execute()

    def multi_rpush(i: int) -> None:
        pipe = client.pipeline(transaction=True)
        pipe.rpush("m:list", encode_token_ids(step_tokens[i])).hset("m:meta", mapping={"stats": stats_json})
        pipe.pexpire("m:list", 86_400_000).pexpire("m:meta", 86_400_000).execute()

    client.delete("m:tokens", "m:list", "m:meta")
    print(row("MULTI: APPEND + HSET stats + 2 PEXPIRE (no checks)", time_us(multi_append, len(step_tokens))))
    print(row("MULTI: RPUSH + HSET stats + 2 PEXPIRE (no checks)", time_us(multi_rpush, len(step_tokens))))


def token_log_sizes(client: redis.Redis, store: RedisStateStore, num_steps: int, num_tokens: int) -> None:
    """What the token log written above holds and costs to read back, string against list."""
    print(f"\n| token log of {num_tokens} tokens | bytes (MEMORY USAGE) | load median µs |\n|---|---|---|")
    load_str = time_us(lambda i: client.get("m:tokens"), 200)
    load_list = time_us(lambda i: b"".join(client.lrange("m:list", 0, -1)), 200)
    print(f"| APPEND string | {client.memory_usage('m:tokens')} | {statistics.median(load_str):.1f} |")
    print(f"| RPUSH list ({num_steps} items) | {client.memory_usage('m:list')} | {statistics.median(load_list):.1f} |")
    print(f"| store.load (whole state) | - | {statistics.median(time_us(lambda i: store.load('r2'), 200)):.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--num-steps", type=int, default=2000)
    parser.add_argument("--tokens-per-step", type=int, default=4)
    args = add_spellings(parser).parse_args()
    client = redis.Redis.from_url(args.url)
    store = RedisStateStore(client, StateStoreConfig(namespace=f"measure{uuid.uuid4().hex[:8]}"))
    n, k = args.num_steps, args.tokens_per_step
    step_tokens = [[(i * k + j) % 49152 for j in range(k)] for i in range(n)]

    print(f"{n} steps of {k} tokens, stats ~{len(str(STATS))} B JSON, url {args.url}\n")
    print("| per-step operation | median µs | mean µs | p99 µs |\n|---|---|---|---|")
    print(row("PING (round-trip floor)", time_us(lambda i: client.ping(), n)))
    store_appends(client, store, step_tokens)
    raw_appends(client, step_tokens)
    token_log_sizes(client, store, n, n * k)
    for rid in ("r1", "r2"):
        store.delete(rid)
    client.delete("m:tokens", "m:list", "m:meta")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
