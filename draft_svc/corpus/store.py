"""The corpus index on disk: built once per tokenizer and corpus, then memory-mapped read-only.

    <cache_dir>/corpus-<key>/
        tokens.npy   [N] int32   the corpus, SEPARATOR after every document
        order.npy    [R] int32   the backward suffix array (specdec/suffix_array.py)
        starts.npy   [V + 1] int64  rows of each last token
        meta.json    what was built from what, sizes and build time

`key` hashes the tokenizer's tokenizer.json, the files read (path, size, mtime), the token budget
and the format, so a new tokenizer, an upgraded package or a changed flag gets its own index.
Every process maps the same files (np.load(mmap_mode="r")): the pages live once, in the page
cache, shared by every draft worker on the machine; nothing is copied per process or pickled.

A build writes into a private folder and publishes it with one atomic rename, under a file lock,
so services starting together build once and a killed build leaves nothing half-written.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import structlog
from tqdm.auto import tqdm

from draft_svc.corpus.sources import SOURCES, SourceFile, documents, source_files
from specdec.suffix_array import QueryConfig, SuffixArray, block_starts, sort_positions
from specdec.suffix_array import SEPARATOR
from specdec.model.tokenizer import Tokenizer

FORMAT_VERSION = 1
BYTES_PER_TOKEN = 4.5  # source bytes read per budgeted token: Python code is ~3.8 characters a token here
TOKENIZE_BATCH_BYTES = 1 << 20
_KEY_CHARS = 16
DEFAULT_MAX_TOKENS = 1 << 21


@dataclasses.dataclass(frozen=True, slots=True)
class CorpusConfig:
    sources: tuple[str, ...] = SOURCES
    paths: tuple[Path, ...] = ()  # extra files or folders, read after the sources
    max_tokens: int = DEFAULT_MAX_TOKENS  # the corpus budget (separators included)
    sort_depth: int = 16  # tokens the suffix array is sorted by (a power of two is cheapest)
    query: QueryConfig = QueryConfig()
    cache_dir: Path | None = None  # where indexes are kept; None: the service's model cache dir

    def __post_init__(self) -> None:
        if unknown := set(self.sources) - set(SOURCES):
            raise ValueError(f"corpus sources {sorted(unknown)} are not among {SOURCES}")
        if not self.sources and not self.paths:
            raise ValueError("a corpus needs at least one source or path")
        if not 2 <= self.max_tokens < np.iinfo(np.int32).max:
            raise ValueError(f"max_tokens must be in [2, {np.iinfo(np.int32).max}), got {self.max_tokens}")
        if self.sort_depth < 1:
            raise ValueError(f"sort_depth must be >= 1, got {self.sort_depth}")


@dataclasses.dataclass(frozen=True, slots=True)
class CorpusIndex:
    """A mapped index and what it was built from."""

    suffix_array: SuffixArray
    path: Path
    meta: dict

    @property
    def num_bytes(self) -> int:
        return sum((self.path / name).stat().st_size for name in ("tokens.npy", "order.npy", "starts.npy"))


def index_dir(config: CorpusConfig, tokenizer_dir: Path, cache_dir: Path) -> tuple[Path, list[SourceFile]]:
    """Where the index of this tokenizer and corpus lives, and the files it is built from."""
    files = source_files(config.sources, config.paths, int(config.max_tokens * BYTES_PER_TOKEN))
    digest = hashlib.sha256(f"{FORMAT_VERSION}\0{config.max_tokens}\0{config.sort_depth}\0".encode())
    digest.update(hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).digest())
    for file in files:
        digest.update(file.identity.encode() + b"\n")
    return Path(cache_dir) / f"corpus-{digest.hexdigest()[:_KEY_CHARS]}", files


def open_index(
    config: CorpusConfig, tokenizer_dir: Path, cache_dir: Path, *, show_progress: bool = True
) -> CorpusIndex:
    """The index of this tokenizer and corpus, built on first use."""
    out_dir, files = index_dir(config, tokenizer_dir, cache_dir)
    if not out_dir.is_dir():  # the rename that publishes an index is atomic: present means complete
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the process dies
            if not out_dir.is_dir():  # else built by whoever held the lock before us
                for stale in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                build_index(config, Tokenizer.from_dir(tokenizer_dir), files, out_dir, show_progress=show_progress)
    return load_index(out_dir, config.query)


def load_index(path: Path, query: QueryConfig | None = None) -> CorpusIndex:
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"corpus index {str(path)!r} has format {meta.get('format_version')}, not {FORMAT_VERSION}")
    arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in ("tokens", "order", "starts")}
    suffix_array = SuffixArray(arrays["tokens"], arrays["order"], arrays["starts"], meta["sort_depth"], query)
    return CorpusIndex(suffix_array, path, meta)


def build_index(
    config: CorpusConfig,
    tokenizer: Tokenizer,
    files: Sequence[SourceFile],
    out_dir: Path,
    *,
    show_progress: bool = True,
) -> dict:
    """Tokenize `files`, sort, and publish the index at out_dir; returns its meta."""
    log = structlog.get_logger("draft_svc.corpus")
    started = time.perf_counter()
    log.info("corpus_index_build_started", path=str(out_dir), num_files=len(files), max_tokens=config.max_tokens)
    tokens, num_documents = tokenize(tokenizer, files, config.max_tokens, show_progress)
    tokenized_s = time.perf_counter() - started
    with tqdm(total=1, desc="sorting corpus suffixes", unit="round", disable=not show_progress, file=sys.stderr) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

        order = sort_positions(tokens, config.sort_depth, progress)
        bar.n = bar.total or 0  # tqdm types total as optional; progress() has set it
    starts = block_starts(tokens, order, tokenizer.vocab_size)
    meta = {
        "format_version": FORMAT_VERSION,
        "sort_depth": config.sort_depth,
        "vocab_size": tokenizer.vocab_size,
        "sources": list(config.sources),
        "paths": [str(p) for p in config.paths],
        "num_files": len(files),
        "num_documents": num_documents,
        "num_tokens": int(tokens.size),
        "num_rows": int(order.size),
        "max_tokens": config.max_tokens,
        "tokenize_s": round(tokenized_s, 2),
        "build_s": round(time.perf_counter() - started, 2),
    }
    partial = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    partial.mkdir(parents=True)
    for name, array in (("tokens", tokens), ("order", order), ("starts", starts)):
        np.save(partial / f"{name}.npy", array)
    (partial / "meta.json").write_text(json.dumps(meta, indent=1))
    os.rename(partial, out_dir)
    log.info(
        "corpus_index_built",
        **{k: meta[k] for k in ("num_files", "num_documents", "num_tokens", "tokenize_s", "build_s")},
        num_bytes=sum(a.nbytes for a in (tokens, order, starts)),
    )
    return meta


def tokenize(
    tokenizer: Tokenizer, files: Sequence[SourceFile], max_tokens: int, show_progress: bool
) -> tuple[np.ndarray, int]:
    """-> (tokens [N <= max_tokens] int32, SEPARATOR after each document; number of documents), in
    file order; the document that crosses the budget is cut."""
    chunks: list[np.ndarray] = []
    num_tokens = num_documents = 0
    with tqdm(
        total=sum(f.num_bytes for f in files),
        desc="tokenizing corpus",
        unit="B",
        unit_scale=True,
        disable=not show_progress,
        file=sys.stderr,
    ) as bar:
        batch: list[str] = []
        num_batch_chars = 0
        for i, file in enumerate(files):
            batch += documents(file)
            num_batch_chars += file.num_bytes
            bar.update(file.num_bytes)
            if num_batch_chars < TOKENIZE_BATCH_BYTES and i + 1 < len(files):
                continue
            for encoding in tokenizer.backend.encode_batch(batch, add_special_tokens=False):
                ids = np.array([*encoding.ids, SEPARATOR], dtype=np.int32)[: max_tokens - num_tokens]
                chunks.append(ids)
                num_tokens += ids.size
                num_documents += 1
                if num_tokens == max_tokens:
                    break
            batch, num_batch_chars = [], 0
            if num_tokens == max_tokens:
                break
    tokens = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int32)
    if tokens.size:
        tokens[-1] = SEPARATOR  # a cut document still ends the corpus with a separator
    return tokens, num_documents
