"""The draft service's corpus flags: flags over environment over defaults, checked at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from draft_svc.__main__ import build
from draft_svc.config import from_args
from draft_svc.corpus.sources import SOURCES
from draft_svc.corpus.store import DEFAULT_MAX_TOKENS


def test_the_corpus_decoder_is_offered_on_request_with_its_corpus_flags():
    config = from_args([], {})
    assert "corpus" not in config.pool.strategies and not config.has_corpus_strategy
    assert "lookahead" in config.pool.strategies  # offered: it runs only where a request names it
    assert (config.corpus.sources, config.corpus.paths, config.corpus.max_tokens) == (SOURCES, (), DEFAULT_MAX_TOKENS)
    config = from_args(
        ["--strategies", "prompt_lookup,corpus", "--corpus_max_tokens", "1000"],
        {
            "SPECDEC_DRAFT_CORPUS_SOURCES": "",
            "SPECDEC_DRAFT_CORPUS_PATHS": "/a,/b",
            "SPECDEC_DRAFT_CORPUS_MAX_TOKENS": "5",
        },
    )
    assert config.has_corpus_strategy and config.pool.default_strategies == ("prompt_lookup", "corpus")
    assert (config.corpus.sources, config.corpus.paths, config.corpus.max_tokens) == (
        (),
        (Path("/a"), Path("/b")),
        1000,
    )
    assert config.corpus.cache_dir == config.cache_dir  # indexes live beside the converted models
    assert from_args(["--corpus_cache_dir", "/idx"], {}).corpus.cache_dir == Path("/idx")


@pytest.mark.parametrize(
    "argv", [["--corpus_sources", "docs,nope"], ["--corpus_max_tokens", "1"], ["--corpus_sources", ""]]
)
def test_bad_corpus_flags_stop_the_start_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        from_args(argv, {})
    assert exited.value.code == 2 and "corpus" in capsys.readouterr().err


def test_offering_corpus_drafts_needs_an_index():
    with pytest.raises(ValueError, match="corpus index"):
        build(from_args(["--strategies", "corpus"], {}), client=None)
