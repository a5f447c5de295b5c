"""The primary's flags: the compiled-step switch, its alias and its environment default; the run
answers' file and how start-up takes it."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import structlog
import torch

import primary_svc.__main__ as primary_main
from primary_svc.__main__ import load_run_answers
from primary_svc.config import parse_config
from primary_svc.worker import EngineWorker
from specdec.answers import DEFAULT_ANSWERS, save_answers
from specdec.engine.engine import Engine
from specdec.engine.kv_cache import KVCache


def test_compiled_step_is_off_by_default(monkeypatch):
    monkeypatch.delenv("SPECDEC_PRIMARY_TENSORMT_OPTIMIZER", raising=False)
    monkeypatch.delenv("SPECDEC_TENSORMT_OPTIMIZER", raising=False)
    assert not parse_config([]).tensormt_optimizer


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--tensormt_optimizer", "true"], True),
        (["--tensormt_optimizer", "false"], False),
        (["--compile"], True),
        (["--compile", "false"], False),
        (["--compile", "1"], True),
    ],
)
def test_tensormt_optimizer_flag_and_its_compile_alias(argv, expected):
    assert parse_config(argv).tensormt_optimizer is expected


def test_environment_sets_the_default_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("SPECDEC_PRIMARY_TENSORMT_OPTIMIZER", "true")
    assert parse_config([]).tensormt_optimizer
    assert not parse_config(["--tensormt_optimizer", "false"]).tensormt_optimizer


def test_bad_values_are_rejected():
    with pytest.raises(SystemExit):
        parse_config(["--tensormt_optimizer", "maybe"])
    with pytest.raises(SystemExit):
        parse_config(["--compile_mode", "reduce-overhead"])


def test_compiled_graphs_are_cached_under_the_cache_dir(tmp_path):
    config = parse_config(["--cache_dir", str(tmp_path)])
    assert config.compile_cache_dir == tmp_path / "inductor"


def test_scheduler_flags_and_their_environment(monkeypatch):
    config = parse_config([])
    assert (config.max_step_tokens, config.prefill_chunk_tokens) == (1024, 512)
    monkeypatch.setenv("SPECDEC_PRIMARY_MAX_STEP_TOKENS", "256")
    monkeypatch.setenv("SPECDEC_PRIMARY_PREFILL_CHUNK_TOKENS", "64")
    assert (parse_config([]).max_step_tokens, parse_config([]).prefill_chunk_tokens) == (256, 64)
    assert parse_config(["--prefill_chunk_tokens", "32"]).prefill_chunk_tokens == 32
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        parse_config(["--prefill_chunk_tokens", "512"])  # more than the step's 256
    with pytest.raises(ValueError, match="max_step_tokens"):
        parse_config(["--max_step_tokens", "0"])


@pytest.mark.parametrize(
    ("name", "default", "value"), [("prefix_cache_bytes", 256 << 20, 1 << 20), ("learned_answer_tokens", 1 << 14, 4096)]
)
def test_a_size_flag_its_environment_and_zero_for_none(monkeypatch, name, default, value):
    assert getattr(parse_config([]), name) == default
    monkeypatch.setenv(f"SPECDEC_PRIMARY_{name.upper()}", "0")
    assert getattr(parse_config([]), name) == 0
    assert getattr(parse_config([f"--{name}", str(value)]), name) == value
    with pytest.raises(ValueError, match=name):
        parse_config([f"--{name}", "-1"])


def test_rpc_threads_leave_room_for_a_full_batch_of_verifies_and_as_many_prefills():
    config = parse_config([])
    assert config.max_batch == 64 and config.server.max_workers >= 2 * config.max_batch
    assert parse_config(["--max_batch", "4"]).server.max_workers >= 8


def test_batch_wait_flag_and_its_bounds(monkeypatch):
    assert parse_config(["--batch_wait_ms", "4"]).batch_wait_ms == 4.0
    monkeypatch.setenv("SPECDEC_PRIMARY_BATCH_WAIT_MS", "2.5")
    assert parse_config([]).batch_wait_ms == 2.5
    with pytest.raises(ValueError, match="batch_wait_ms"):
        parse_config(["--batch_wait_ms", "-1"])


def test_kv_takeover_s_defaults_below_the_gateways_owner_lease_and_within_the_kv_lease():
    from specdec.state_store import DEFAULT_LEASE_S as OWNER_LEASE_S

    config = parse_config([])
    assert 0 < config.kv_takeover_s < OWNER_LEASE_S and config.kv_takeover_s <= config.kv_lease_s
    assert parse_config(["--kv_takeover_s", "2.5"]).kv_takeover_s == 2.5
    with pytest.raises(ValueError, match="kv_takeover_s"):
        parse_config(["--kv_takeover_s", "0"])
    with pytest.raises(ValueError, match="kv_takeover_s"):
        parse_config(["--kv_lease_s", "5", "--kv_takeover_s", "6"])


def test_run_answers_default_to_the_shipped_file_and_empty_turns_them_off(monkeypatch):
    assert parse_config([]).run_answers == str(DEFAULT_ANSWERS)
    assert parse_config(["--run_answers", ""]).run_answers == ""
    monkeypatch.setenv("SPECDEC_PRIMARY_RUN_ANSWERS", "/x/answers.safetensors")
    assert parse_config([]).run_answers == "/x/answers.safetensors"


def test_the_shipped_answers_load_for_the_default_model_and_another_model_s_are_left_out(fp32_model, tmp_path):
    """The primary's start-up (primary_svc.__main__.load_run_answers): the default model's answers
    load at any precision (fp32 here); a file of another model, or none, leaves runs without."""
    worker = EngineWorker(Engine(fp32_model.model, KVCache(fp32_model.config, torch.float32, max_bytes=1 << 20), 64))
    try:
        index = load_run_answers(str(DEFAULT_ANSWERS), fp32_model, worker)
        assert index is not None and index.num_tokens > 100_000
        other = tmp_path / "other.safetensors"
        save_answers(other, [[1, 2, 3]], "0" * 32, {})
        with structlog.testing.capture_logs() as logs:
            assert load_run_answers(str(other), fp32_model, worker) is None
        assert [(e["event"], e["log_level"]) for e in logs] == [("run_answers_left_out", "warning")]
        assert "0" * 32 in logs[0]["reason"]
        assert load_run_answers("", fp32_model, worker) is None
    finally:
        worker.stop()


@pytest.mark.parametrize("is_vectorized", [False, True])
def test_int8_token_on_the_portable_loops_is_logged_as_a_warning(monkeypatch, is_vectorized):
    """A primary told to serve int8_token where its products have no vector path (the portable build:
    ~25x an int4 step) says so once it has loaded; other precisions and vectorized builds say nothing."""
    monkeypatch.setattr(primary_main, "token_products_vectorized", lambda: is_vectorized)
    model = types.SimpleNamespace(layers=[], matrices={})
    for precision in ("int8_token", "int4"):
        loaded = types.SimpleNamespace(precision=precision, model=model, weight_bytes=0)
        with structlog.testing.capture_logs() as logs:
            primary_main.log_loaded(types.SimpleNamespace(tensormt_optimizer=False), Path("m"), loaded, {})
        warned = [e["event"] for e in logs if e["log_level"] == "warning"]
        expected = precision == "int8_token" and not is_vectorized
        assert warned == (
            ["int8_token runs the portable loops on this CPU: int4 or int8 serve many times faster here"]
            if expected
            else []
        )
