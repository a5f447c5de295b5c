"""The model's tokenizer as the public API offers it: Tokenize, Detokenize, DescribeModel, and the
text of each token a response's log probabilities name.

Tokenize encodes exactly as Generate does (gateway.chat.PromptEncoder over checked parameters), so
the ids a client counts are the ids the model sees.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from gateway.chat import PromptEncoder
from gateway.params import GenerationParams
from specdec.errors import InvalidArgument
from specdec.model.tokenizer import Tokenizer

# Token texts cached per gateway: a response's top alternatives repeat the same few thousand tokens.
TOKEN_TEXT_CACHE_SIZE = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True)
class ModelDescription:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    special_tokens: dict[str, str]
    chat_template: str


class Tokenization:
    def __init__(self, tokenizer: Tokenizer, prompt_encoder: PromptEncoder, vocab_size: int) -> None:
        self.tokenizer, self.prompt_encoder, self.vocab_size = tokenizer, prompt_encoder, vocab_size
        self.token_text = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)(self._token_text)
        # each token's own bytes (a part of a character where its text is U+FFFD): OpenAI's `bytes`
        self.token_bytes = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE_SIZE)(tokenizer.token_bytes)

    def _token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens spelled out ("<|im_end|>"); a token that is part
        of a UTF-8 character decodes to U+FFFD, as in vLLM's and OpenAI's answers."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def encode(self, params: GenerationParams) -> tuple[list[int], list[str]]:
        """A checked prompt's ids, as Generate encodes them, and each token's text."""
        ids = self.prompt_encoder.encode(params)
        return ids, [self.token_text(t) for t in ids]

    def check_ids(self, field: str, token_ids: Sequence[int]) -> None:
        for i, t in enumerate(token_ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument(
                    field, f"token id {t} at index {i} is outside the vocabulary [0, {self.vocab_size})"
                )

    def decode(self, token_ids: Sequence[int], include_special_tokens: bool = False) -> str:
        self.check_ids("token_ids", token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=not include_special_tokens)

    def describe(self, max_model_len: int, eos_token_ids: Sequence[int]) -> ModelDescription:
        return ModelDescription(
            max_model_len,
            self.vocab_size,
            tuple(eos_token_ids),
            dict(self.tokenizer.special_tokens),
            self.tokenizer.chat_template or "",
        )
