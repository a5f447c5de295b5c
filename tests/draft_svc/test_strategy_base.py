"""The draft-decoder protocol, Candidate and the registry."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from draft_svc.strategies import (
    Candidate,
    DecoderRegistry,
    DraftDecoder,
    PromptLookupConfig,
    PromptLookupDecoder,
    SuffixDecoder,
    SuffixIndex,
    SuffixIndexConfig,
    UnknownDecoderError,
    model_free_registry,
)
from draft_svc.strategies.base import append_tokens, new_context


def test_candidate_validates_its_fields():
    assert Candidate("a", (1, 2), rank=1) != Candidate("a", (1, 2))
    with pytest.raises(ValueError, match="rank"):
        Candidate("a", (1,), rank=-1)
    with pytest.raises(ValueError, match="decoder"):
        Candidate("", (1,))


def test_registry_creates_independent_decoders_per_request():
    index = SuffixIndex(SuffixIndexConfig(max_total_tokens=64))
    registry = model_free_registry(PromptLookupConfig(max_ngram=2), index)
    assert registry.names() == ("prompt_lookup", "lookahead", "suffix_index")
    first, second = registry.create("prompt_lookup"), registry.create("prompt_lookup")
    assert first is not second
    first.extend([1, 2, 1])
    assert first.propose(1) == (Candidate("prompt_lookup", (2,)),)
    assert second.propose(1) == ()  # its own, empty context
    decoders = registry.create_all(["prompt_lookup", "suffix_index"])
    assert all(isinstance(d, DraftDecoder) for d in decoders.values())
    assert isinstance(decoders["suffix_index"], SuffixDecoder)


def test_registry_rejects_unknown_and_duplicate_names():
    registry = DecoderRegistry({"prompt_lookup": PromptLookupDecoder})
    with pytest.raises(UnknownDecoderError, match="'early_exit'"):
        registry.create("early_exit")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("prompt_lookup", functools.partial(PromptLookupDecoder, None))
    assert "prompt_lookup" in registry and "early_exit" not in registry


def test_append_tokens_accepts_numpy_and_rejects_negative_ids():
    context = new_context()
    append_tokens(context, np.array([3, 4], dtype=np.int64))
    append_tokens(context, [5])
    assert context.tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="non-negative"):
        append_tokens(context, [1, -1])
    assert context.tolist() == [3, 4, 5]
