"""The pool's decoders and the core list of strategies (specdec.strategies) name the same strategies."""

from __future__ import annotations

from draft_svc.strategies import (
    DecoderRegistry,
    SuffixIndex,
    SuffixIndexConfig,
    model_free_registry,
    prediction_registry,
)
from draft_svc.strategies.feature import FeatureDecoder
from draft_svc.strategies.grammar_forced import register_grammar_decoder
from draft_svc.strategies.self_draft import SelfDraftConfig, self_draft_registry
from specdec import strategies


def test_every_registered_strategy_is_in_the_core_list_with_its_kind_and_vice_versa(grammar_cache):
    index = SuffixIndex(SuffixIndexConfig())
    grammar_based = DecoderRegistry()
    register_grammar_decoder(grammar_based, grammar_cache)
    registered = (
        # the corpus decoder reads any ContinuationIndex: the suffix index stands for its corpus here
        {name: strategies.MODEL_FREE for name in model_free_registry(suffix_index=index, corpus=index).names()}
        | {name: strategies.GRAMMAR for name in grammar_based.names()}
        | {name: strategies.MODEL for name in self_draft_registry(SelfDraftConfig()).names()}
        # registered by draft_svc/__main__.py where its drafter file loads (a pool without one lacks it)
        | {FeatureDecoder.name: strategies.MODEL}
        | {name: strategies.PREDICTION for name in prediction_registry().names()}
    )
    assert registered == {s.name: s.kind for s in strategies.STRATEGIES}
