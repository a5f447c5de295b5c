"""Structured output: response formats compiled to token grammars, per-request grammar state,
token masks for plain decoding and for every node of a speculative token tree.

The engine is xgrammar (chosen over llguidance on measured merit, see `compiler.py`). No grpc here:
the services translate their protobuf `ResponseFormat` into `ResponseFormat` and map
`specdec.errors.InvalidArgument` to INVALID_ARGUMENT.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as the type checker sees them (each `as` itself: a re-export)
    from specdec.grammar.bitmask import TokenBitmask as TokenBitmask
    from specdec.grammar.compiler import JSON_OBJECT as JSON_OBJECT
    from specdec.grammar.compiler import JSON_SCHEMA as JSON_SCHEMA
    from specdec.grammar.compiler import CompiledGrammar as CompiledGrammar
    from specdec.grammar.compiler import GrammarCache as GrammarCache
    from specdec.grammar.compiler import ResponseFormat as ResponseFormat
    from specdec.grammar.compiler import compile_response_format as compile_response_format
    from specdec.grammar.mask import MASKED_LOGIT as MASKED_LOGIT
    from specdec.grammar.mask import apply_token_mask as apply_token_mask
    from specdec.grammar.mask import bitmask_to_bool as bitmask_to_bool
    from specdec.grammar.state import GrammarState as GrammarState
    from specdec.grammar.state import TreeMasks as TreeMasks
    from specdec.grammar.tokenizer_info import GrammarTokenizerInfo as GrammarTokenizerInfo

# Each name's module, imported when the name is first read (PEP 562): xgrammar takes 1.6-1.9 s to
# import (with ml_dtypes, tvm_ffi and transformers), and a service that needs only the packed masks
# (the validator: specdec.grammar.bitmask) should not pay it at start-up.
_MODULES = {
    "JSON_OBJECT": "compiler",
    "JSON_SCHEMA": "compiler",
    "CompiledGrammar": "compiler",
    "GrammarCache": "compiler",
    "ResponseFormat": "compiler",
    "compile_response_format": "compiler",
    "TokenBitmask": "bitmask",
    "MASKED_LOGIT": "mask",
    "apply_token_mask": "mask",
    "bitmask_to_bool": "mask",
    "GrammarState": "state",
    "TreeMasks": "state",
    "GrammarTokenizerInfo": "tokenizer_info",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # read once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
