"""The model's vocabulary as the grammar engine sees it: token bytes, mask width, stop tokens.

Built once per model (~0.25 s for SmolLM2's 49152 tokens) and shared by every request.

Two details decide correctness:
  * the mask width is the MODEL's vocabulary (its lm_head rows), which may exceed the tokenizer's:
    rows past the tokenizer's last token are padding and are never allowed;
  * special added tokens (`<|im_start|>`, `<file_sep>`, ...) get an empty string, which the engine
    treats as "never part of the text": given their literal text instead, it would allow
    `<|im_start|>` inside a JSON string, where decoding with skip_special_tokens drops it.
    The stop tokens stay allowed where the grammar ends (the engine handles them by id).
"""

from __future__ import annotations

import dataclasses

import xgrammar as xgr

from specdec.model.tokenizer import Tokenizer

SPECIAL_TOKEN_TEXT = ""  # the engine's marker for a token that never appears in generated text


@dataclasses.dataclass(frozen=True, slots=True)
class GrammarTokenizerInfo:
    tokenizer: Tokenizer  # re-tokenizes jump-forward strings with the model's own BPE
    vocab_size: int  # mask width V = the model's vocabulary
    stop_token_ids: tuple[int, ...]  # allowed exactly where the grammar is complete
    special_token_ids: frozenset[int]  # never allowed inside the grammar
    xgr_info: xgr.TokenizerInfo

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {self.vocab_size}")
        if not self.stop_token_ids:
            raise ValueError("stop_token_ids must not be empty: the grammar needs a token that ends the output")

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int | None = None) -> "GrammarTokenizerInfo":
        """`vocab_size` is the model's vocabulary (config.vocab_size); None means the tokenizer's."""
        vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        encoded_vocab = [SPECIAL_TOKEN_TEXT] * vocab_size  # padding rows stay "special": never allowed
        for text, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            if token_id < vocab_size:
                encoded_vocab[token_id] = text
        special_token_ids = frozenset(
            token_id
            for token_id, added in tokenizer.backend.get_added_tokens_decoder().items()
            if added.special and token_id < vocab_size
        )
        for token_id in special_token_ids:
            encoded_vocab[token_id] = SPECIAL_TOKEN_TEXT
        stop_token_ids = tuple(t for t in tokenizer.eos_token_ids if t < vocab_size)
        if not stop_token_ids:
            raise ValueError("the tokenizer has no end-of-sequence token inside the model's vocabulary")
        # The engine's own reading of tokenizer.json (byte-level BPE, byte fallback or raw pieces, and
        # whether a leading space is prepended): it knows the variants the engine supports.
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        xgr_info = xgr.TokenizerInfo(
            encoded_vocab,
            metadata["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
            add_prefix_space=metadata["add_prefix_space"],
        )
        return cls(tokenizer, vocab_size, stop_token_ids, special_token_ids, xgr_info)
