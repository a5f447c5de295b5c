"""Draft strategies behind one protocol (`DraftDecoder`), created per request through a registry."""
from __future__ import annotations

import functools

from draft_svc.strategies.base import (Candidate, DecoderRegistry, DraftDecoder, UnknownDecoderError)
from draft_svc.strategies.prompt_lookup import PromptLookupConfig, PromptLookupDecoder
from draft_svc.strategies.suffix_index import SuffixDecoder, SuffixIndex, SuffixIndexConfig

__all__ = ["Candidate", "DecoderRegistry", "DraftDecoder", "PromptLookupConfig", "PromptLookupDecoder",
           "SuffixDecoder", "SuffixIndex", "SuffixIndexConfig", "UnknownDecoderError", "model_free_registry"]


def model_free_registry(prompt_lookup: PromptLookupConfig | None = None,
                        suffix_index: SuffixIndex | None = None) -> DecoderRegistry:
    """The strategies that need no model: prompt lookup always, the suffix index when one is given
    (it is shared across requests, so its owner creates it once and passes it in)."""
    registry = DecoderRegistry()
    registry.register(PromptLookupDecoder.name, functools.partial(PromptLookupDecoder, prompt_lookup))
    if suffix_index is not None:
        registry.register(SuffixDecoder.name, functools.partial(SuffixDecoder, suffix_index))
    return registry
