"""Structured output: response formats compiled to token grammars, per-request grammar state,
token masks for plain decoding and for every node of a speculative token tree.

The engine is xgrammar (chosen over llguidance on measured merit, see `compiler.py`). No grpc here:
the services translate their protobuf `ResponseFormat` into `ResponseFormat` and map
`specdec.errors.InvalidArgument` to INVALID_ARGUMENT.
"""

from __future__ import annotations

from specdec.grammar.compiler import (
    JSON_OBJECT,
    JSON_SCHEMA,
    CompiledGrammar,
    GrammarCache,
    ResponseFormat,
    compile_response_format,
)
from specdec.grammar.bitmask import TokenBitmask
from specdec.grammar.mask import MASKED_LOGIT, apply_token_mask, bitmask_to_bool
from specdec.grammar.state import GrammarState, TreeMasks
from specdec.grammar.tokenizer_info import GrammarTokenizerInfo

__all__ = [
    "JSON_OBJECT",
    "JSON_SCHEMA",
    "MASKED_LOGIT",
    "CompiledGrammar",
    "GrammarCache",
    "GrammarState",
    "GrammarTokenizerInfo",
    "ResponseFormat",
    "TokenBitmask",
    "TreeMasks",
    "apply_token_mask",
    "bitmask_to_bool",
    "compile_response_format",
]
