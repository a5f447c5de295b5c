"""Draft strategies behind one protocol (`DraftDecoder`), created per request through a registry."""

from __future__ import annotations

import functools

from draft_svc.strategies.base import Candidate, DecoderRegistry, DraftDecoder, UnknownDecoderError
from draft_svc.strategies.corpus import CorpusDecoder
from draft_svc.strategies.lookahead import LookaheadConfig, LookaheadDecoder
from draft_svc.strategies.prediction import PredictionDecoder
from draft_svc.strategies.prompt_lookup import PromptLookupConfig, PromptLookupDecoder
from draft_svc.strategies.suffix_index import ContinuationIndex, SuffixDecoder, SuffixIndex, SuffixIndexConfig
from specdec.prediction import PredictionConfig

__all__ = [
    "Candidate",
    "CorpusDecoder",
    "DecoderRegistry",
    "DraftDecoder",
    "LookaheadConfig",
    "LookaheadDecoder",
    "PredictionConfig",
    "PredictionDecoder",
    "PromptLookupConfig",
    "PromptLookupDecoder",
    "SuffixDecoder",
    "SuffixIndex",
    "SuffixIndexConfig",
    "UnknownDecoderError",
    "model_free_registry",
    "prediction_registry",
]


def model_free_registry(
    prompt_lookup: PromptLookupConfig | None = None,
    suffix_index: SuffixIndex | None = None,
    corpus: ContinuationIndex | None = None,
    lookahead: LookaheadConfig | None = None,
) -> DecoderRegistry:
    """The strategies that need no model of their own: prompt lookup and lookahead (whose rows the
    primary runs) always, the suffix index and the corpus decoder when their index is given (each
    is shared across requests: its owner creates it once)."""
    registry = DecoderRegistry()
    registry.register(PromptLookupDecoder.name, functools.partial(PromptLookupDecoder, prompt_lookup))
    registry.register(LookaheadDecoder.name, functools.partial(LookaheadDecoder, lookahead))
    if suffix_index is not None:
        registry.register(SuffixDecoder.name, functools.partial(SuffixDecoder, suffix_index), is_tenant_scoped=True)
    if corpus is not None:
        registry.register(CorpusDecoder.name, functools.partial(CorpusDecoder, corpus))
    return registry


def prediction_registry(config: PredictionConfig | None = None) -> DecoderRegistry:
    """The strategies that draft from a request's own prediction of its output; the pool creates
    one per request with `create(name, prediction_token_ids=..., num_prompt_tokens=...)`."""
    registry = DecoderRegistry()
    registry.register(PredictionDecoder.name, functools.partial(PredictionDecoder, config))
    return registry
