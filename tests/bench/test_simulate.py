"""python -m bench simulate: the node profile, the routers, the Redis deployment and the event model
(Little's law, saturation at the modelled capacities, affinity against random routing, determinism),
the command line, and the in-process measurement of a profile on the real model."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench import simulate
from bench.sim_config import SimConfig
from bench.sim_measure import engine_figures, measured_profile
from bench.sim_model import node_capacity_req_per_s
from bench.sim_model import simulate as run_simulation
from bench.sim_profile import DEFAULT_PROFILE, NodeProfile, ProfileError, load_profile, profile_from_json
from bench.sim_routing import AffinityRouter, RandomRouter
from bench.sim_servers import FifoServer, RedisDeployment
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def profile(**figures: object) -> NodeProfile:
    values: dict = {
        "machine": "test",
        "verify_rows": (1, 8),
        "verify_ms": (4.0, 8.0),
        "prefill_ms_per_token": 0.5,
        "gateway_ms_per_token": 0.001,
        "redis_step_ops_per_s": 1e6,
        "redis_index_ops_per_s": 1e6,
    }
    values.update(figures)
    return NodeProfile(**values)


# --- the profile


def test_step_ms_interpolates_between_and_extrapolates_beyond_the_measured_rows():
    p = profile(verify_rows=(1, 2, 4), verify_ms=(4.0, 5.0, 9.0))
    assert p.step_ms(0) == 0.0
    assert p.step_ms(1) == 4.0
    assert p.step_ms(3) == 7.0  # halfway between 5 ms at 2 rows and 9 ms at 4
    assert p.step_ms(8) == 17.0  # 9 ms + 4 rows x the last segment's 2 ms a row


def test_the_default_profile_cites_a_section_of_docs_benchmarks_for_every_figure():
    p = load_profile(DEFAULT_PROFILE)
    headings = set(re.findall(r"^## (.+)$", DOCS.read_text(), flags=re.MULTILINE))
    assert set(p.sources) == {"verify_ms", "prefill_ms_per_token", "gateway_ms_per_token"} | {
        "redis_step_ops_per_s",
        "redis_index_ops_per_s",
    }
    for name, source in p.sources.items():
        assert source.startswith("docs/benchmarks.md, "), name
        section = source.removeprefix("docs/benchmarks.md, ").split(" > ")[0]
        assert section in headings, (name, section)
    assert p.verify_rows == (1, 2, 4, 8, 16, 32, 64)


def test_a_profile_figure_without_a_source_or_with_an_impossible_value_is_refused():
    data = json.loads(DEFAULT_PROFILE.read_text())
    no_source = json.loads(json.dumps(data))
    no_source["figures"]["gateway_ms_per_token"]["source"] = " "
    with pytest.raises(ProfileError, match="gateway_ms_per_token.source"):
        profile_from_json(no_source)
    negative = json.loads(json.dumps(data))
    negative["figures"]["redis_step_ops_per_s"]["value"] = -1
    with pytest.raises(ProfileError, match="redis_step_ops_per_s must be > 0"):
        profile_from_json(negative)
    unsorted = json.loads(json.dumps(data))
    unsorted["figures"]["verify_ms"]["rows"] = [1, 4, 2, 8, 16, 32, 64]
    with pytest.raises(ProfileError, match="rows must ascend"):
        profile_from_json(unsorted)
    with pytest.raises(ProfileError, match="figures.prefill_ms_per_token: missing"):
        del data["figures"]["prefill_ms_per_token"]
        profile_from_json(data)


def test_the_config_names_the_field_it_refuses():
    with pytest.raises(ValueError, match="num_gateways must be >= 1"):
        SimConfig(num_gateways=0)
    with pytest.raises(ValueError, match="routing must be one of"):
        SimConfig(routing="round_robin")
    with pytest.raises(ValueError, match="warmup_s"):
        SimConfig(duration_s=10, warmup_s=10)


# --- routers and servers


def test_affinity_keeps_a_key_on_its_node_and_never_exceeds_the_load_bound():
    router = AffinityRouter(num_nodes=4, num_virtual_nodes=64, load_bound=1.25)
    assert sorted(router.walk(7)) == [0, 1, 2, 3]
    idle = [0, 0, 0, 0]
    assert router.route(7, idle) == router.walk(7)[0] == router.route(7, idle)
    loads = [0, 0, 0, 0]
    loads[router.walk(7)[0]] = 9  # the key's first node is full: cap ceil(1.25 x 10 / 4) = 4
    chosen = router.route(7, loads)
    assert chosen == router.walk(7)[1] and loads[chosen] + 1 <= 4
    homes = {router.walk(key)[0] for key in range(64)}
    assert homes == {0, 1, 2, 3}  # 64 keys land on every node


def test_below_the_minimum_cap_a_node_keeps_its_prefixes_whatever_the_mean():
    router = AffinityRouter(num_nodes=4, num_virtual_nodes=64, load_bound=1.25, min_cap=8)
    loads = [0, 0, 0, 0]
    loads[router.walk(3)[0]] = 7  # 1.25 x the mean would be 3, but 7 + 1 is within the minimum cap
    assert router.route(3, loads) == router.walk(3)[0]
    loads[router.walk(3)[0]] = 8
    assert router.route(3, loads) == router.walk(3)[1]


def test_random_routing_spreads_over_every_node():
    router = RandomRouter(3, np.random.default_rng(0))
    assert {router.route(0, [0, 0, 0]) for _ in range(100)} == {0, 1, 2}


def test_a_fifo_server_queues_jobs_and_counts_busy_time_inside_the_window():
    server = FifoServer(window_start=1.0, window_end=3.0)
    assert server.submit(0.0, 1.5) == 1.5  # busy 1.0-1.5 inside the window
    assert server.submit(1.0, 1.0) == 2.5  # waits for the first job
    assert server.submit(2.8, 1.0) == 3.8  # busy 2.8-3.0 inside
    assert server.busy_s == pytest.approx(0.5 + 1.0 + 0.2)
    assert server.utilisation() == pytest.approx(0.85)


def test_a_cluster_spreads_request_keys_over_its_masters_and_keeps_the_index_on_one():
    redis = RedisDeployment(3, step_op_s=1e-5, index_op_s=1e-6, window_start=0.0, window_end=1.0)
    counts = [0, 0, 0]
    for i in range(3000):
        counts[redis.masters.index(redis.master_of(i))] += 1
    assert all(900 <= n <= 1100 for n in counts)
    redis.index(0.5)
    redis.index(0.6)
    assert redis.index_master.num_jobs == 2 and sum(m.num_jobs for m in redis.masters) == 2


# --- the event model


def small_config(**overrides: object) -> SimConfig:
    values: dict = {
        "num_nodes": 2,
        "num_gateways": 2,
        "rate_per_s": 1.0,
        "duration_s": 200.0,
        "warmup_s": 20.0,
        "num_system_prompts": 8,
        "system_prompt_tokens": 200,
        "user_tokens": 20,
        "output_tokens": 32,
        "prefix_cache_tokens": 800,
        "max_active_per_node": 16,
        "max_step_tokens": 256,
        "prefill_chunk_tokens": 128,
    }
    values.update(overrides)
    return SimConfig(**values)


def test_littles_law_holds_under_a_stable_load():
    p = load_profile(DEFAULT_PROFILE)
    config = small_config()
    rate = 0.6 * node_capacity_req_per_s(p, config) * config.num_nodes
    result = run_simulation(p, dataclasses.replace(config, rate_per_s=rate))
    arrival_rate = result.num_arrivals / config.window_s
    assert result.num_arrivals > 500
    # L = lambda W: the time-average number in the system against arrivals x mean time in it
    assert result.mean_in_system == pytest.approx(arrival_rate * result.mean_sojourn_s, rel=0.05)
    assert all(np.isfinite(result.ttft_s))


def test_throughput_saturates_at_the_modelled_node_capacity():
    # one node, 8 active requests, every prompt cached after the first: decode only, 8 rows a step of 8 ms
    p = profile()
    config = small_config(
        num_nodes=1,
        max_active_per_node=8,
        num_system_prompts=1,
        system_prompt_tokens=1,
        user_tokens=0,
        prefix_cache_tokens=1,
        output_tokens=100,
        decode_run=100,
        duration_s=60.0,
        warmup_s=10.0,
    )
    capacity = node_capacity_req_per_s(p, config, prefix_hit_rate=1.0)
    assert capacity == pytest.approx(10.0)  # 100 tokens at 1 ms a row
    result = run_simulation(p, dataclasses.replace(config, rate_per_s=3 * capacity))
    capacity_tok_per_s = capacity * config.output_tokens
    assert 0.95 * capacity_tok_per_s <= result.throughput_tok_per_s <= 1.001 * capacity_tok_per_s
    assert result.node_utilisation > 0.99
    assert result.rows_per_step > 7.5


def test_throughput_saturates_at_the_redis_servers_capacity():
    # fast nodes and gateways, a Redis of 2,000 step writes a second: a token a write caps tokens/s
    p = profile(verify_rows=(1, 64), verify_ms=(1.0, 2.0), prefill_ms_per_token=0.001, redis_step_ops_per_s=2000.0)
    config = small_config(output_tokens=200, max_active_per_node=64, rate_per_s=30.0, duration_s=60.0)
    result = run_simulation(p, config)
    writes_per_token = (200 + 3) / 200  # a write a token, plus create, RUNNING and the terminal status
    assert result.redis_max_utilisation > 0.98
    assert 0.9 * 2000 / writes_per_token <= result.throughput_tok_per_s <= 2000
    node_capacity_tok_per_s = node_capacity_req_per_s(p, config) * config.output_tokens * config.num_nodes
    assert result.throughput_tok_per_s < 0.2 * node_capacity_tok_per_s  # the nodes were not the bound


def test_affinity_routing_beats_random_routing_on_prefix_cache_hits():
    # 16 equally popular system prompts, 4 nodes whose caches hold 4 each
    p = load_profile(DEFAULT_PROFILE)
    config = small_config(
        num_nodes=4,
        num_system_prompts=16,
        system_prompt_zipf=0.0,
        system_prompt_tokens=500,
        prefix_cache_tokens=2000,
        duration_s=150.0,
        warmup_s=30.0,
    )
    rate = 0.5 * node_capacity_req_per_s(p, config) * config.num_nodes
    config = dataclasses.replace(config, rate_per_s=rate)
    affinity = run_simulation(p, config)
    random = run_simulation(p, dataclasses.replace(config, routing="random"))
    assert affinity.num_arrivals == random.num_arrivals  # the same arrivals, routed differently
    assert random.prefix_hit_rate == pytest.approx(0.25, abs=0.1)  # 4 of 16 prompts per cache
    assert affinity.prefix_hit_rate > 0.6
    assert affinity.prefix_hit_rate > random.prefix_hit_rate + 0.3
    assert sorted(affinity.ttft_s)[len(affinity.ttft_s) // 2] < sorted(random.ttft_s)[len(random.ttft_s) // 2]


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    p = load_profile(DEFAULT_PROFILE)
    config = small_config(rate_per_s=4.0, duration_s=60.0)
    first, again = run_simulation(p, config), run_simulation(p, config)
    assert first == again
    other = run_simulation(p, dataclasses.replace(config, seed=1))
    assert other.ttft_s != first.ttft_s


# --- the command line


def test_the_command_prints_a_row_per_node_count_and_the_saturation_points(capsys, tmp_path):
    out = tmp_path / "sim.json"
    args = ["--nodes", "1,2", "--routings", "affinity", "--duration-s", "40", "--warmup-s", "10"]
    simulate.main([*args, "--cluster-masters", "1,3", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| routing | N | offered req/s |" in printed
    assert re.search(r"^\| affinity \| 1 \|", printed, flags=re.MULTILINE)
    assert re.search(r"^\| affinity \| 2 \|", printed, flags=re.MULTILINE)
    assert "Redis, 1 master: saturates at N ~" in printed and "Redis, 3 masters: saturates at N ~" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["num_nodes"] for r in rows] == [1, 2]
    assert all(r["redis_ops_per_request_step"] > 1 for r in rows)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0,2"], "--nodes"),
        (["--routings", "nearest"], "--routings"),
        (["--gateways", "0"], "num_gateways must be >= 1"),
        (["--load", "-1"], "rate_per_s must be > 0"),
        (["--node-profile", "/nonexistent.json"], "--node-profile /nonexistent.json"),
        (["--measure-out", "/tmp/profile.json"], "--measure-out needs --measure"),
        (["--measure", "--measure-repeats", "0"], "--measure-repeats must be >= 1"),
    ],
)
def test_the_command_refuses_bad_input_naming_the_field(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        simulate.main(args)
    assert e.value.code != 0
    assert message in f"{e.value.code}{capsys.readouterr().err}"


# --- measuring a profile


def test_a_profile_measured_in_process_keeps_the_base_profiles_other_figures(fp32_model):
    engine = Engine(fp32_model.model, KVCache(fp32_model.config, fp32_model.model.kv_dtype), 256)
    figures = engine_figures(engine, repeats=1, rows=(1, 4), prefill_tokens=40)
    assert figures["verify_rows"] == (1, 4) and all(ms > 0 for ms in figures["verify_ms"])
    assert figures["prefill_ms_per_token"] > 0
    assert engine.num_active_requests == 0
    base = load_profile(DEFAULT_PROFILE)
    p = measured_profile(base, figures, None)
    assert p.verify_ms == figures["verify_ms"] and p.gateway_ms_per_token == base.gateway_ms_per_token
    assert "simulate --measure" in p.sources["verify_ms"]
    assert p.sources["gateway_ms_per_token"] == base.sources["gateway_ms_per_token"]
    assert profile_from_json(json.loads(json.dumps(p.to_json()))) == p


@pytest.mark.skipif(shutil.which("redis-benchmark") is None, reason="redis-benchmark is not installed")
def test_the_redis_measurement_runs_the_step_script_without_errors():
    from argparse import Namespace

    from bench.sim_redis import measure

    out = measure(Namespace(num_requests=200, num_ops=2000, clients=4, pipeline=[1]))
    assert out["evalsha_p1"]["client_ops_per_s"] > 0 and out["evalsha_p1"]["server_usec_per_call"] > 0
    assert out["zadd_p1"]["client_ops_per_s"] > 0
