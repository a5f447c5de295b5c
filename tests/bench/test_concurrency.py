"""bench.concurrency: per-token latency from stream arrival times, and a wave's summary."""

from __future__ import annotations

import pytest

from bench.concurrency import (
    StreamTrace,
    format_row,
    message_gaps_ms,
    percentiles,
    summarize_wave,
    token_latencies_ms,
)


def test_token_latencies_split_a_message_gap_over_its_tokens():
    trace = StreamTrace("r", 0.5, ((1.0, 3), (1.1, 2), (1.4, 1)))
    assert token_latencies_ms(trace) == pytest.approx([50.0, 50.0, 300.0])
    assert token_latencies_ms(StreamTrace("r", 0.5, ((1.0, 3),))) == []


def test_message_gaps_count_each_message_once_whatever_its_tokens():
    trace = StreamTrace("r", 0.5, ((1.0, 3), (1.1, 2), (1.4, 1)))
    assert message_gaps_ms(trace) == pytest.approx([100.0, 300.0])
    assert message_gaps_ms(StreamTrace("r", 0.5, ((1.0, 8),))) == []


def test_percentiles_interpolate():
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == {"p50": 3.0, "p99": pytest.approx(4.96)}
    assert percentiles([]) == {"p50": None, "p99": None}


def test_summarize_wave():
    traces = [
        StreamTrace("a", 0.0, ((0.5, 1), (1.0, 3)), controller={"num_steps_by_degree": [1, 2], "num_probe_steps": 1}),
        StreamTrace("b", 0.0, ((1.0, 2), (2.0, 2)), controller={"num_steps_by_degree": [0, 0, 4]}),
        StreamTrace("c", 0.0, (), error="UNAVAILABLE: down"),
    ]
    out = summarize_wave(traces)
    assert (out["num_requests"], out["num_errors"], out["num_tokens"]) == (3, 1, 8)
    assert out["wall_s"] == 2.0 and out["aggregate_tokens_per_s"] == 4.0
    assert out["ttft_ms"]["p50"] == pytest.approx(750.0)
    # latencies: 500/3 ms x3, 500 ms x2
    assert out["token_latency_ms"]["p50"] == pytest.approx(500 / 3)
    assert out["num_steps_by_degree"] == [1, 2, 4] and out["num_probe_steps"] == 1
    assert out["errors"] == ["UNAVAILABLE: down"]


def test_format_row_without_output():
    row = {
        "concurrency": 4,
        "speculation": True,
        "num_errors": 4,
        "num_requests": 4,
        "aggregate_tokens_per_s": None,
        "token_latency_ms": {"p50": None, "p99": None},
    }
    assert format_row(row) == "[concurrency   4] speculation on  | no output | errors 4/4"


def test_summarize_load_counts_throughput_over_the_run_and_errors_by_code():
    from bench.concurrency import summarize_load

    traces = [
        StreamTrace("a", 0.0, ((0.5, 1), (1.0, 3)), controller={"num_steps_by_draft_length": [1, 0, 1]}),
        StreamTrace("b", 1.0, ((1.2, 2),), controller={"num_steps_by_draft_length": [2]}),
        StreamTrace("", 1.0, (), error="RESOURCE_EXHAUSTED: at capacity"),
        StreamTrace("", 1.5, (), error="RESOURCE_EXHAUSTED: at capacity"),
    ]
    out = summarize_load(traces, wall_s=2.0, is_stream=True, num_clients=1)
    assert (out["num_requests"], out["num_ok"], out["num_tokens"]) == (4, 2, 6)
    assert out["requests_per_s"] == 1.0 and out["tokens_per_s"] == 3.0
    assert out["ttft_ms"]["p50"] == pytest.approx(350.0)
    assert out["ttft_after_first_wave_ms"]["p50"] == pytest.approx(200.0)  # "a" was the first wave
    assert out["inter_token_ms"]["p50"] == pytest.approx(500 / 3)
    assert out["message_gap_ms"] == {"p50": pytest.approx(500.0), "p99": pytest.approx(500.0)}  # "a"'s one gap
    assert out["tokens_per_message"] == 2.0  # 6 tokens in 3 messages
    assert out["errors_by_code"] == {"RESOURCE_EXHAUSTED": 2}
    # 4 steps, one with a draft of 2 tokens: a quarter speculative, 6 tokens over 4 steps
    assert out["steps"] == {
        "num_steps": 4,
        "speculative_share": 0.25,
        "tokens_per_step": 1.5,
        "num_steps_by_draft_length": [3, 0, 1],
    }


def test_the_load_generator_stays_on_loopback_and_within_its_bounds():
    from bench.load import is_loopback_address, parse_args

    assert is_loopback_address("127.0.0.1:50050") and is_loopback_address("[::1]:1")
    assert is_loopback_address("localhost:9") and not is_loopback_address("192.168.1.2:50050")
    a = parse_args(["--soak"])
    assert (a.clients, a.duration) == (16, 600.0)
    for bad in (["--clients", "0"], ["--duration", "100000"], ["--mix", "poems"], ["--address", "10.1.1.1:5"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_summarize_load_gives_each_ttft_over_the_same_request_alone():
    from bench.concurrency import summarize_load

    # requests 0 and 1 alone took 100 and 200 ms; request 2 has no reference (it failed alone)
    references = [100.0, 200.0, None]
    traces = [
        StreamTrace("a", 0.0, ((0.3, 1),), request_index=0),  # 300 ms: 3x, first wave
        StreamTrace("b", 0.0, ((0.2, 1),), request_index=1),  # 200 ms: 1x, first wave
        StreamTrace("c", 1.0, ((1.5, 1),), request_index=0),  # 500 ms: 5x
        StreamTrace("d", 1.0, ((1.1, 1),), request_index=2),  # no reference: left out
        StreamTrace("e", 1.0, (), error="RESOURCE_EXHAUSTED: at capacity", request_index=1),
    ]
    out = summarize_load(traces, wall_s=2.0, is_stream=True, num_clients=2, reference_ttft_ms=references)
    assert out["ttft_vs_alone"]["p50"] == pytest.approx(3.0)
    assert out["ttft_vs_alone"]["p99"] == pytest.approx(3.0 + 0.98 * 2.0)  # between 3x and 5x
    assert out["ttft_vs_alone_first_wave"] == {"p50": pytest.approx(2.0), "p99": pytest.approx(1.0 + 0.99 * 2.0)}
    assert out["reference_ttft_ms"]["p50"] == pytest.approx(150.0)
    assert "ttft_vs_alone" not in summarize_load(traces, wall_s=2.0, is_stream=True, num_clients=2)


def test_load_takes_several_gateways_on_loopback_only():
    from bench.load import parse_args

    a = parse_args(["--address", "127.0.0.1:5001, 127.0.0.1:5002"])
    assert a.addresses == ["127.0.0.1:5001", "127.0.0.1:5002"]
    with pytest.raises(SystemExit):
        parse_args(["--address", "127.0.0.1:5001,10.0.0.2:5002"])


def test_load_starts_a_local_cluster_with_nodes_and_gateways():
    from bench.load import parse_args

    a = parse_args(["--nodes", "2"])
    assert (a.nodes, a.gateways) == (2, 2)
    assert parse_args(["--nodes", "3", "--gateways", "1"]).gateways == 1
    for bad in (
        ["--gateways", "2"],
        ["--nodes", "-1"],
        ["--nodes", "2", "--address", "127.0.0.1:5001"],
        ["--nodes", "2", "--precision", "fp32"],  # the cluster's services run their defaults
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
