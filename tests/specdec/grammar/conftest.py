from __future__ import annotations

import json

import pytest

from specdec.grammar import GrammarCache, GrammarTokenizerInfo
from specdec.model.tokenizer import Tokenizer

# A tiny schema whose forced text is easy to write down by hand: keys in declared order, all
# required, compact separators ", " and ": ".
PERSON_SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["name", "age", "unit"],
})


@pytest.fixture(scope="session")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="session")
def tokenizer_info(tokenizer, default_model_dir) -> GrammarTokenizerInfo:
    vocab_size = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    return GrammarTokenizerInfo.from_tokenizer(tokenizer, vocab_size)


@pytest.fixture(scope="session")
def grammar_cache(tokenizer_info) -> GrammarCache:
    return GrammarCache(tokenizer_info)
