"""The corpus index on disk with the real tokenizer: built from hand-made files, cached, mapped
read-only; the `build` command; the corpus decoder before and after its index is ready."""

from __future__ import annotations

import io
import json
import threading
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from draft_svc.corpus.__main__ import main as corpus_main
from draft_svc.corpus.sources import source_files
from draft_svc.corpus.store import CorpusConfig, index_dir, open_index
from specdec.suffix_array import sort_positions
from draft_svc.strategies import Candidate, model_free_registry
from draft_svc.strategies.corpus import CorpusDecoder, PendingCorpusIndex
from specdec.suffix_array import SEPARATOR

DOCS = {
    "a.py": "def add(a, b):\n    return a + b\n",
    "b.txt": "The quick brown fox jumps over the lazy dog.\n",
    "c.py": "def add(a, b):\n    return a - b\n",
}


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in DOCS.items():
        (folder / name).write_text(text)
    (folder / "skipped.bin").write_bytes(b"\0\1")  # not a text suffix
    return folder


def config_for(corpus_dir: Path, **kwargs) -> CorpusConfig:
    return CorpusConfig(sources=(), paths=(corpus_dir,), **kwargs)


def test_sources_are_listed_in_order_up_to_the_byte_budget(corpus_dir):
    assert [f.path.name for f in source_files((), [corpus_dir], max_bytes=1 << 20)] == ["a.py", "b.txt", "c.py"]
    assert [f.path.name for f in source_files((), [corpus_dir], max_bytes=1)] == ["a.py"]
    with pytest.raises(ValueError, match="sources"):
        source_files(("nope",), [], 10)
    with pytest.raises(ValueError, match="source or path"):
        CorpusConfig(sources=())


def test_index_holds_the_tokenized_documents_and_is_mapped_read_only(
    corpus_dir, tmp_path, tokenizer, default_model_dir
):
    index = open_index(config_for(corpus_dir), default_model_dir, tmp_path / "cache", show_progress=False)
    want = [t for name in sorted(DOCS) for t in [*tokenizer.encode(DOCS[name]), SEPARATOR]]
    sa = index.suffix_array
    assert sa.tokens.tolist() == want
    assert sa.order.tolist() == sort_positions(np.array(want, dtype=np.int32), 16).tolist()
    assert (index.meta["num_documents"], index.meta["num_tokens"]) == (3, len(want))
    assert not sa.tokens.flags.writeable and not sa.order.flags.writeable  # mapped, shared, never copied
    assert index.num_bytes >= 4 * len(want) * 2
    # "def add(a, b):\n    return a" is followed by " +" once and " -" once: two candidates.
    context = tokenizer.encode("def add(a, b):\n    return a")
    drafts = {tokenizer.decode(list(d)) for d in sa.query(context, max_tokens=3, max_candidates=2)}
    assert drafts == {" + b\n", " - b\n"}


def test_the_index_is_built_once_per_tokenizer_and_corpus(corpus_dir, tmp_path, default_model_dir, monkeypatch):
    cache = tmp_path / "cache"
    first = open_index(config_for(corpus_dir), default_model_dir, cache, show_progress=False)
    monkeypatch.setattr("draft_svc.corpus.store.build_index", lambda *a, **k: pytest.fail("rebuilt a cached index"))
    assert open_index(config_for(corpus_dir), default_model_dir, cache, show_progress=False).path == first.path
    (corpus_dir / "b.txt").write_text("Changed.\n")  # another corpus, another index
    assert index_dir(config_for(corpus_dir), default_model_dir, cache)[0] != first.path
    assert index_dir(config_for(corpus_dir, max_tokens=5), default_model_dir, cache)[0] != first.path


def test_the_budget_cuts_the_corpus(corpus_dir, tmp_path, default_model_dir):
    index = open_index(config_for(corpus_dir, max_tokens=5), default_model_dir, tmp_path / "cache", show_progress=False)
    assert index.suffix_array.tokens.size == 5 and index.suffix_array.tokens[-1] == SEPARATOR


def test_build_command_prints_what_it_built_then_finds_it_cached(corpus_dir, tmp_path, default_model_dir):
    argv = [
        "build",
        "--corpus_sources",
        "",
        "--corpus_paths",
        str(corpus_dir),
        "--model_path",
        str(default_model_dir),
        "--cache_dir",
        str(tmp_path / "cache"),
    ]
    outputs = []
    for _ in range(2):
        with redirect_stdout(io.StringIO()) as out:
            assert corpus_main(argv, environ={}) == 0
        outputs.append(json.loads(out.getvalue()))
    assert [o["was_cached"] for o in outputs] == [False, True]
    assert outputs[0]["num_documents"] == 3 and outputs[0]["num_bytes"] > 0
    assert Path(outputs[0]["path"]).parent == tmp_path / "cache"
    with pytest.raises(SystemExit):  # a bad flag is a usage error, not a traceback
        corpus_main(["build", "--corpus_sources", "nope"], environ={})


def test_corpus_decoder_is_silent_until_its_index_is_ready(corpus_dir, tmp_path, tokenizer, default_model_dir):
    is_released = threading.Event()

    def open_later():
        is_released.wait(30)
        return open_index(config_for(corpus_dir), default_model_dir, tmp_path / "cache", show_progress=False)

    pending = PendingCorpusIndex(open_later, max_match_len=32)
    decoder = model_free_registry(corpus=pending).create("corpus")
    assert isinstance(decoder, CorpusDecoder)
    decoder.extend(tokenizer.encode("The quick brown"))
    pending.start()
    assert decoder.propose(2) == ()
    is_released.set()
    assert pending.wait(30) is not None
    want = tuple(tokenizer.encode(" fox jumps"))
    assert decoder.propose(len(want)) == (Candidate("corpus", want),)


def test_a_failed_build_leaves_the_decoder_silent():
    def fail():
        raise FileNotFoundError("no tokenizer")

    pending = PendingCorpusIndex(fail, max_match_len=8)
    pending.start()
    assert pending.wait(30) is None
    decoder = CorpusDecoder(pending)
    decoder.extend([1, 2, 3])
    assert decoder.propose(4) == ()
