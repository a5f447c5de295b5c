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
from draft_svc.strategies.base import FeatureConsumer, append_tokens, implements, new_context, reads_features
from draft_svc.strategies.lookahead import LookaheadSource, gives_lookahead


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


def test_capabilities_are_the_protocols_isinstance_decided_once_per_class():
    index = SuffixIndex(SuffixIndexConfig(max_total_tokens=64))
    decoders = model_free_registry(PromptLookupConfig(max_ngram=2), index).create_all(
        ["prompt_lookup", "lookahead", "suffix_index"]
    )

    class Reader:
        def observe_features(self, position: int, features: np.ndarray) -> None:
            pass

    for d in [*decoders.values(), Reader(), object(), None]:
        for _ in range(2):  # the second answer comes from the cache
            assert gives_lookahead(d) is isinstance(d, LookaheadSource)
            assert reads_features(d) is isinstance(d, FeatureConsumer)
    assert gives_lookahead(decoders["lookahead"]) and not gives_lookahead(decoders["prompt_lookup"])
    assert reads_features(Reader()) and not reads_features(decoders["suffix_index"])
    assert implements(Reader(), FeatureConsumer) and not implements(Reader(), LookaheadSource)


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
