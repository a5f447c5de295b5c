"""Text <-> token ids for a model directory, with chat templates, streaming detokenization and stop strings.

Runtime needs only `tokenizers` and `jinja2`: the directory's `tokenizer.json` is the tokenizer,
`tokenizer_config.json` (or `chat_template.jinja`) gives the chat template and special tokens, and
`generation_config.json` / `config.json` add end-of-sequence ids. Chat templates are rendered the
way transformers renders them (sandboxed jinja2, `trim_blocks`, `lstrip_blocks`, `tojson`,
`raise_exception`, `strftime_now`), so a prompt is byte-for-byte what the model was trained on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as BackendTokenizer

from specdec.errors import InvalidArgument
from specdec.model.gguf_tokenizer import bytes_to_unicode

# Decoding a token that ends inside a multi-byte character gives this replacement character.
REPLACEMENT_CHAR = "\ufffd"
# Tokens of context decoded before the first new token, so that decoders that treat the start of
# a text specially (a SentencePiece leading space) see a continuation, as vLLM does.
NUM_CONTEXT_TOKENS = 5
# A request's stop strings: how many, and their longest (the gateway's limits, and what the primary
# takes as a run's stop hints: DecodeRequest.stop_strings)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# How tokenizers spell raw bytes in a token: SentencePiece's byte fallback, and byte-level BPE's
# printable character per byte (GPT-2's table).
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTE_LEVEL_BYTES = {c: b for b, c in bytes_to_unicode().items()}


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<|im_start|>", ...}
        self.chat_template = chat_template
        self._compiled_template = None if chat_template is None else compile_chat_template(chat_template)
        eos_token = self.special_tokens.get("eos_token")
        eos_from_token = [] if eos_token is None else [backend.token_to_id(eos_token)]
        self.eos_token_ids = tuple(dict.fromkeys(i for i in [*eos_from_token, *eos_token_ids] if i is not None))
        # The BOS that the tokenizer puts before every text (its post-processor: a GGUF's
        # add_bos_token, a tokenizer.json's template; Llama, Gemma, Mistral), which a whole prompt
        # starts with (encode_prompt); None where the model takes none (SmolLM2, Qwen2).
        bos_id = self.bos_token_id
        is_bos_added = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        self.prompt_bos_id = bos_id if is_bos_added else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"model directory {str(model_dir)!r} has no tokenizer.json")
        backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        special_tokens = {
            name: _token_content(config[name]) for name in _SPECIAL_TOKEN_NAMES if config.get(name) is not None
        }
        eos_token_ids = [
            *_id_list(_read_json(model_dir / "generation_config.json").get("eos_token_id")),
            *_id_list(_read_json(model_dir / "config.json").get("eos_token_id")),
        ]
        return cls(
            backend,
            chat_template=_chat_template(model_dir, config),
            special_tokens=special_tokens,
            eos_token_ids=eos_token_ids,
        )

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model's embedding may have more rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.backend.token_to_id(bos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in the text (`<|im_start|>`) are always matched whole;
        `add_special_tokens` only adds the ones the tokenizer puts around every text (a BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (the model's whole input, not a rendered chat) as the model reads it: after the
        BOS where the model takes one (`prompt_bos_id`), as llama.cpp and transformers encode a prompt
        (without it such a model's output differs, often into garbage). A text that starts with the
        BOS's own spelling keeps that one: never two. A chat template writes its own BOS
        (`{{ bos_token }}`), so a rendered chat is encoded with `encode`."""
        ids = self.encode(text)
        if self.prompt_bos_id is not None and ids[:1] != [self.prompt_bos_id]:
            ids.insert(0, self.prompt_bos_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: for a token that holds part of a UTF-8 character (a byte-level
        piece, a byte fallback's `<0xF0>`), that part, where its decoding alone gives U+FFFD; else
        its text's UTF-8, special tokens spelled out."""
        text = self.decode([token_id], skip_special_tokens=False)
        if REPLACEMENT_CHAR not in text:
            return text.encode()
        piece = self.backend.id_to_token(token_id) or ""
        if match := _BYTE_FALLBACK_PIECE.fullmatch(piece):
            return bytes([int(match[1], 16)])
        if piece and all(c in _BYTE_LEVEL_BYTES for c in piece):
            return bytes(_BYTE_LEVEL_BYTES[c] for c in piece)
        return text.encode()

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """The prompt text for `messages` (`[{"role": "user", "content": "hi"}, ...]`); extra keyword
        arguments (`tools=...`) are visible to the template, as in transformers."""
        if self._compiled_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self._compiled_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **template_kwargs}
        )


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, never emitting half a UTF-8 character.

    Byte-level tokens can end inside a character: "🤗" is 4 bytes and may come as two tokens, the
    first decoding to "\ufffd". Each call decodes a small window twice, up to the text already
    emitted and up to the newest token, and emits the difference only when it does not end in a
    partial character. `finish()` emits what is still held back, so the concatenation of all returned
    deltas equals `tokenizer.decode(context_ids + all ids)` minus the decoded context.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(context_ids[-NUM_CONTEXT_TOKENS:]) if context_ids else []
        # token_ids[prefix_offset:read_offset] decodes to text already emitted (or context);
        # token_ids[read_offset:] to text not yet emitted.
        self._prefix_offset = 0
        self._read_offset = len(self.token_ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append this step's new token ids; return the text they completed ("" if none yet)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or it ends inside a character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def held_back(self) -> str:
        """The whole characters of the tokens added but not yet returned: those before a trailing
        partial character, which `add` holds back with it."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        return new_text[len(prefix_text) :].rstrip(REPLACEMENT_CHAR)

    def finish(self) -> str:
        """The text still held back at the end of the stream (a trailing partial character decodes as "\ufffd")."""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def find_stop_string(text: str, stop_strings: Sequence[str], start: int = 0) -> int | None:
    """Where to cut `text` so that it ends before its earliest stop string, or None when none occurs.

    `start` skips text already checked: a match may begin up to `len(stop) - 1` characters before it.
    E.g. find_stop_string("a: 1}\\n\\nb", ["\\n\\n", "}"]) == 4 (cut "a: 1", drop "}\\n\\nb").
    """
    cuts = [text.find(stop, max(0, start - len(stop) + 1)) for stop in stop_strings if stop]
    return min((cut for cut in cuts if cut >= 0), default=None)


class StopStringWatch:
    """Whether each batch of tokens that follows an output completes one of its stop strings in the
    output's text: for a producer that sends tokens several at a time to the consumer that cuts the
    output at them, so that it sends at once where the output ends (PrimaryService.DecodeStream's
    stop_strings). `context_ids`: the output's tokens so far (the last that a match can start in
    are kept). The text is decoded as IncrementalDetokenizer decodes it, from a window of the
    context: a stop string that starts in a character split by the window's first token, or by the
    context's end, can be missed. A hint, not the cut itself."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str], context_ids: Sequence[int]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self._tail_chars = max(map(len, self.stop_strings), default=1) - 1  # where a match can start
        # a token decodes to a character or more, but for the pieces of one character
        context = list(context_ids[-(self._tail_chars + NUM_CONTEXT_TOKENS) :]) if context_ids else []
        self._detok = IncrementalDetokenizer(tokenizer, context_ids=context)
        self.text = self._tail(tokenizer.decode(context)) if context else ""

    def add(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids`, after the output and every earlier batch, complete a stop string."""
        new_text = self._detok.add(token_ids)
        if not new_text:
            return False
        checked = len(self.text)
        self.text += new_text
        is_complete = find_stop_string(self.text, self.stop_strings, checked) is not None
        self.text = self._tail(self.text)
        return is_complete

    def _tail(self, text: str) -> str:
        return text[max(0, len(text) - self._tail_chars) :] if self._tail_chars else ""


def check_stop_strings(
    stop_strings: Sequence[str], field: str, max_strings: int = MAX_STOP_STRINGS, max_chars: int = MAX_STOP_CHARS
) -> None:
    """At most max_strings stop strings, each of 1 to max_chars characters (InvalidArgument naming `field`)."""
    if len(stop_strings) > max_strings:
        raise InvalidArgument(field, f"at most {max_strings} stop strings, got {len(stop_strings)}")
    if any(not 1 <= len(s) <= max_chars for s in stop_strings):
        raise InvalidArgument(field, f"each stop string must have 1 to {max_chars} characters")


def num_held_back_chars(text: str, stop_strings: Sequence[str]) -> int:
    """How many trailing characters of `text` could be the start of a stop string.

    A streamer holds those back until the next tokens show whether a stop string follows.
    E.g. num_held_back_chars("end of line\\n", ["\\n\\n"]) == 1.
    """
    longest = 0
    for stop in stop_strings:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def compile_chat_template(chat_template: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it, in jinja2's immutable sandbox."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(date_format: str) -> str:
        return datetime.now().strftime(date_format)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(chat_template)


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """`chat_template.jinja` (transformers >= 4.43 saves it there), else tokenizer_config's entry,
    which may be a list of named templates: the one named "default" is used."""
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _token_content(token: str | dict[str, Any]) -> str:
    """tokenizer_config writes a special token as a string or as an AddedToken dict."""
    return token["content"] if isinstance(token, dict) else token


def _id_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else ([value] if isinstance(value, int) else list(value))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
