"""The Redis figures of the scale-out simulation (bench/simulate.py): how many of the state store's
per-step writes one redis-server completes a second, and what each costs the server.

    python -m bench.sim_redis [--num-requests 10000] [--num-ops 200000] [--clients 32] [--pipeline 1,16]

Starts its own redis-server (specdec.redis_server, unix socket, no persistence), creates
--num-requests requests through the real RedisStateStore, then runs redis-benchmark against it:
the step write exactly as the gateway sends it (EVALSHA of STEP_LUA: checks, APPEND of one token,
HSET of stats and controller JSON, lease, PEXPIRE) and the index's ZADD. Per command it prints the
client-seen ops/s of redis-benchmark and the server's own usec_per_call (INFO commandstats); the
server's capacity is 1e6 / usec_per_call, what one core of Redis completes when nothing else waits.
redis-benchmark replaces each __rand_int__ on its own, so a step's keys belong to different requests;
every key exists, so the script does the work of a real step.
"""

from __future__ import annotations

import argparse
import json
import csv
import io
import shutil
import subprocess
from pathlib import Path
from typing import Any

import redis

from bench.report import machine_info
from specdec.flag_spellings import add_spellings
from specdec.redis_server import redis_server
from specdec.state_store import RedisStateStore, StateStoreConfig
from specdec.state_store.redis_scripts import STEP_LUA

# What a step writes besides its tokens, sizes like the gateway's (scripts/measure_state_store.py writes
# the same).
STEP_STATS = {
    "num_steps": 100,
    "num_proposed_tokens": 800,
    "num_accepted_tokens": 300,
    "acceptance_rate": 0.375,
    "stage_times": {"draft_ms": 12.5, "verify_ms": 3100.2, "validate_ms": 8.1, "state_ms": 9.9},
}
STEP_CONTROLLER = {"speculative_degree": 3, "draft_length": 6, "ewma_acceptance": 0.41}
OWNER = "gateway-0"


def create_requests(url: str, num_requests: int) -> None:
    """Requests whose ids are redis-benchmark's __rand_int__ spelling (12 digits, zero-padded)."""
    store = RedisStateStore.from_url(url, StateStoreConfig())
    try:
        for i in range(num_requests):
            store.create(f"{i:012d}", {"max_new_tokens": 64}, prompt_token_ids=list(range(64)))
    finally:
        store.close()


def step_command(sha: str, namespace: str) -> list[str]:
    """EVALSHA of the step script with the gateway's argument shapes: one token, no count check."""
    keys = [f"{namespace}:req:{{__rand_int__}}:{name}" for name in ("meta", "tokens", "prompt", "owner")]
    fields = ["stats", json.dumps(STEP_STATS), "controller", json.dumps(STEP_CONTROLLER)]
    return ["EVALSHA", sha, "4", *keys, "abcd", "-1", "86400000", "1764780000000", OWNER, "30000", *fields]


def run_benchmark(socket_path: str, command: list[str], args: argparse.Namespace, pipeline: int) -> float:
    """Client-seen ops/s of one redis-benchmark run (its --csv line)."""
    out = subprocess.run(
        ["redis-benchmark", "-s", socket_path, "-n", str(args.num_ops), "-c", str(args.clients)]
        + ["-P", str(pipeline), "-r", str(args.num_requests), "--csv", *command],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = list(csv.reader(io.StringIO(out)))
    if len(rows) < 2 or rows[0][:2] != ["test", "rps"]:
        raise RuntimeError(f"unexpected redis-benchmark output: {out!r}")
    # The test name is not CSV-escaped (the JSON's quotes), so read the figures from the end.
    return float(rows[1][-7])


def usec_per_call(client: redis.Redis, command: str) -> float:
    """The server's mean time per call; refuses a run where any call failed (an error reply is cheap)."""
    stats = client.info("commandstats")[f"cmdstat_{command}"]
    if int(stats.get("failed_calls", 0)) or int(stats.get("rejected_calls", 0)):
        raise RuntimeError(f"{command}: calls failed on the server: {stats}")
    return float(stats["usec_per_call"])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine_info(), "clients": args.clients, "num_ops": args.num_ops}
    with redis_server(prefix="specdec-sim-redis-") as server:
        create_requests(server.url, args.num_requests)
        client = redis.Redis(unix_socket_path=server.socket_path)
        sha = client.script_load(STEP_LUA)
        namespace = StateStoreConfig().namespace
        commands = {
            "evalsha": step_command(sha, namespace),
            "zadd": ["ZADD", f"{namespace}:active", "NX", "1764780000000", "__rand_int__"],
        }
        for name, command in commands.items():
            for pipeline in args.pipeline:
                client.config_resetstat()
                ops_per_s = run_benchmark(server.socket_path, command, args, pipeline)
                results[f"{name}_p{pipeline}"] = {
                    "client_ops_per_s": ops_per_s,
                    "server_usec_per_call": usec_per_call(client, name),
                }
        client.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--num-ops", type=int, default=200_000)
    p.add_argument("--clients", type=int, default=32, help="redis-benchmark connections")
    p.add_argument("--pipeline", default="1,16", help="comma list of redis-benchmark -P depths")
    p.add_argument("--out", type=Path, default=None)
    args = add_spellings(p).parse_args()
    args.pipeline = [int(x) for x in args.pipeline.split(",")]
    if shutil.which("redis-benchmark") is None:
        raise SystemExit("redis-benchmark is not installed (it ships with redis-server)")
    results = measure(args)
    m = results["machine"]
    print(f"CPU {m['cpu_model']}, {m['num_cpus']} CPUs; {args.clients} connections, {args.num_ops} ops per run")
    print("| command | pipeline | client ops/s | server us/call | server capacity ops/s |")
    print("|---|---|---|---|---|")
    for key, r in results.items():
        if isinstance(r, dict) and "server_usec_per_call" in r:
            name, _, depth = key.rpartition("_p")
            usec = r["server_usec_per_call"]
            print(f"| {name} | {depth} | {r['client_ops_per_s']:,.0f} | {usec:.2f} | {1e6 / usec:,.0f} |")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
