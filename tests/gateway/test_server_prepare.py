"""The checks a request passes before anything is stored (GenerationServicer._prepare): its prompt
leaves room in the context for an output token (specdec.context_room), as the primary's Prefill asks."""

from __future__ import annotations

import types

import pytest

from gateway.chat import PromptEncoder
from gateway.config import Limits, SpeculationDefaults
from gateway.server import GenerationServicer
from gateway.tokenization import Tokenization
from specdec.errors import InvalidArgument
from specdec.model.tokenizer import Tokenizer
from specdec.v1 import gateway_pb2

MAX_CONTEXT = 64


def servicer(tokenizer: Tokenizer) -> GenerationServicer:
    """A servicer with only what _prepare touches, serving a context of MAX_CONTEXT tokens."""
    s = GenerationServicer.__new__(GenerationServicer)
    s.config = types.SimpleNamespace(limits=Limits(), speculation=SpeculationDefaults())
    s.model = types.SimpleNamespace(
        vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids, max_context=MAX_CONTEXT
    )
    s.prompt_encoder = PromptEncoder(tokenizer)
    s.tokenization = Tokenization(tokenizer, s.prompt_encoder, tokenizer.vocab_size)
    return s


@pytest.mark.parametrize(
    "make_request, field",
    [
        (lambda n: gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[42] * n)), "token_ids.ids"),
        (lambda n: gateway_pb2.GenerateRequest(prompt="7" * n), "prompt"),  # a token a digit (SmolLM2)
    ],
)
def test_a_prompt_one_token_short_of_the_context_fits_and_a_longer_one_is_refused(
    tokenizer: Tokenizer, make_request, field: str
) -> None:
    """Prompt + output <= max_context: a prompt of max_context - 1 tokens has room for its one token
    (it was refused as not fitting, though the primary takes it); one of max_context has none."""
    s = servicer(tokenizer)
    _, prompt_ids, _, _ = s._prepare(make_request(MAX_CONTEXT - 1), "r", None, None)
    assert len(prompt_ids) == MAX_CONTEXT - 1
    with pytest.raises(InvalidArgument) as refused:
        s._prepare(make_request(MAX_CONTEXT), "r", None, None)
    assert refused.value.field == field and f"{MAX_CONTEXT} tokens do not fit" in refused.value.message
