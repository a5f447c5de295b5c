"""Rebuilding `tokenizer.json` and `tokenizer_config.json` from a GGUF file's `tokenizer.*` metadata.

A GGUF carries the vocabulary, the BPE merges, each token's type and the special token ids, but not
the pre-tokenizer: that is named by `tokenizer.ggml.pre` and hard-coded in llama.cpp. Byte-level BPE
vocabularies (`tokenizer.ggml.model == "gpt2"`: SmolLM, Llama 3, Qwen2, ...) are rebuilt here with
`tokenizers` alone, using llama.cpp's split rules for the named pre-tokenizer; anything else falls
back to transformers' GGUF tokenizer conversion, which is then needed at conversion time only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (`tokenizer.ggml.token_type`).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp's split rules (llama-vocab.cpp) for the pre-tokenizers we rebuild natively.
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
# StarCoder-style: every digit on its own, then the GPT-2 regex. SmolLM/SmolLM2 use it.
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen", "stablelm2")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def eos_token_ids(metadata: dict[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids: EOS, then end-of-turn / end-of-message where the file names them (Llama 3)."""
    ids = [metadata.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def build_tokenizer_files(metadata: dict[str, Any], gguf_path: Path) -> tuple[str, dict[str, Any]]:
    """(`tokenizer.json` text, `tokenizer_config.json` dict) for the tokenizer the file describes."""
    tokenizer_type = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if tokenizer_type == "gpt2" and pre in _GPT2_PRE + _DIGITS_PRE + _LLAMA3_PRE + _QWEN2_PRE:
        tokenizer_json = byte_level_bpe_tokenizer(metadata).to_str()
    else:
        tokenizer_json = _tokenizer_json_via_transformers(gguf_path, tokenizer_type, pre)
    return tokenizer_json, _tokenizer_config(metadata)


def byte_level_bpe_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE tokenizer equivalent to llama.cpp's for this vocabulary."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    pre = metadata.get("tokenizer.ggml.pre", "default")
    byte_chars = bytes_to_unicode()
    alphabet = set(byte_chars.values())
    # Vocabulary entries are spelled in the byte alphabet; a few files store added tokens as raw
    # text, which is respelled the same way transformers does it.
    vocab = {
        (token if set(token) <= alphabet else "".join(byte_chars[b] for b in token.encode("utf-8"))): i
        for i, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    # llama.cpp (and Llama 3's own tokenizer) take a whole word straight from the vocabulary.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRE))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in _GPT2_PRE + _DIGITS_PRE)
    if pre in _DIGITS_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_PRE + _QWEN2_PRE:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) are matched whole and are special (skipped by decode);
    # user-defined ones (<think>, ...) are matched whole but are ordinary text. A "control" token
    # not spelled in the byte alphabet is a llama.cpp mislabel and stays an ordinary entry.
    control = [t for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user_defined = [t for t, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if metadata.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        name: (tokens[metadata[f"tokenizer.ggml.{key}"]] if f"tokenizer.ggml.{key}" in metadata else None)
        for name, key in _SPECIAL_TOKEN_KEYS.items()
    }
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    config["clean_up_tokenization_spaces"] = False
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if (context_length := metadata.get(f"{metadata['general.architecture']}.context_length")) is not None:
        config["model_max_length"] = context_length
    # Named variants (`tokenizer.chat_template.tool_use`, ...) use HF's list form next to "default".
    named = {
        key.removeprefix("tokenizer.chat_template."): value
        for key, value in metadata.items()
        if key.startswith("tokenizer.chat_template.")
    }
    default = metadata.get("tokenizer.chat_template")
    if named:
        config["chat_template"] = ([{"name": "default", "template": default}] if default else []) + [
            {"name": name, "template": template} for name, template in named.items()
        ]
    elif default is not None:
        config["chat_template"] = default
    return config


def _tokenizer_json_via_transformers(gguf_path: Path, tokenizer_type: str | None, pre: str) -> str:
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise RuntimeError(
            f"{gguf_path.name} has a {tokenizer_type!r} tokenizer with pre-tokenizer {pre!r}, which only "
            "transformers can rebuild; install it for the one-time conversion (pip install transformers)"
        ) from error
    hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return hf_tokenizer.backend_tokenizer.to_str()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table
