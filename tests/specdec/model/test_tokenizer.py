"""Our runtime tokenizer against transformers' tokenizer of the same GGUF, streaming detokenization, stop strings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import jinja2.sandbox
import pytest

from specdec.model.tokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringWatch,
    Tokenizer,
    find_stop_string,
    num_held_back_chars,
)

TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\tx = {'a': [1, 2]}  # tab",
    "Grüße aus Köln — naïve café 🤗🚀 日本語のテキスト",
    "Pi is 3.14159265, e = 2.71828; 1234567890 and 2024-06-01 at 23:59, x^2 = 0x1F",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing  \n\n\n   ",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": "Describe Mars."},
        {"role": "assistant", "content": '{"name": "Mars", "moons": 2}'},
        {"role": "user", "content": "And Phobos? 🤔"},
    ],
]


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="session")
def transformers_tokenizer(default_gguf_path: Path):
    """transformers' tokenizer built from the GGUF (~9 s): the oracle."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_gguf_path.parent), gguf_file=default_gguf_path.name)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer: Tokenizer, transformers_tokenizer, text: str):
    ids = tokenizer.encode(text)
    assert ids == transformers_tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == transformers_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    if "<|im_start|>" not in text:
        assert tokenizer.decode(ids) == text  # byte-level BPE round-trips any text


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer, transformers_tokenizer, messages, add_generation_prompt: bool
):
    expected = transformers_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_unicode_numerals_are_split_as_llama_cpp_does(tokenizer: Tokenizer):
    # The file names the "smollm" pre-tokenizer: llama.cpp (and SmolLM2's own tokenizer.json) isolate
    # every \p{N} character before the GPT-2 split. transformers' GGUF path ignores the name and
    # gives [" Â", "½"] here, cutting the character in two; we follow llama.cpp.
    assert [tokenizer.backend.id_to_token(i) for i in tokenizer.encode(" ½ x²")] == ["Ġ", "Â½", "Ġx", "Â²"]


@pytest.mark.slow
def test_special_tokens_and_sizes(tokenizer: Tokenizer, transformers_tokenizer):
    assert tokenizer.eos_token_ids == (transformers_tokenizer.eos_token_id,) == (2,)
    assert tokenizer.bos_token_id == transformers_tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == len(transformers_tokenizer) == 49152


def test_chat_prompt_starts_with_the_default_system_turn(tokenizer: Tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode(prompt)[0] == 1  # <|im_start|> is matched whole


def _stream(detokenizer: IncrementalDetokenizer, ids: list[int], step: int) -> list[str]:
    deltas = [detokenizer.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return deltas + [detokenizer.finish()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_deltas_concatenate_to_decode(tokenizer: Tokenizer, text: str, step: int):
    ids = tokenizer.encode(text)
    deltas = _stream(IncrementalDetokenizer(tokenizer), ids, step)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_incremental_never_emits_half_a_character(tokenizer: Tokenizer):
    ids = tokenizer.encode("ok 🤗")
    assert len(ids) > 3  # " 🤗" is split over several byte-level tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([token_id]) for token_id in ids]
    # " 🤗" (with its space) is held back until its last byte arrives
    assert deltas == ["ok"] + [""] * (len(ids) - 2) + [" 🤗"]
    assert detokenizer.finish() == ""


def test_incremental_decodes_a_bounded_window(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch):
    ids = tokenizer.encode(" ".join(TEXTS) * 4)
    window_sizes = []
    decode = tokenizer.decode

    def recording_decode(token_ids, **kwargs):
        window_sizes.append(len(token_ids))
        return decode(token_ids, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", recording_decode)
    assert "".join(_stream(IncrementalDetokenizer(tokenizer), ids, 1)) == decode(ids)
    assert len(ids) > 300 and max(window_sizes) <= 8  # each step costs O(1), not O(length so far)


def test_incremental_truncated_character_is_flushed_by_finish(tokenizer: Tokenizer):
    ids = tokenizer.encode("🤗")[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add([i]) for i in ids] == [""] * len(ids)
    assert detokenizer.finish() == tokenizer.decode(ids) and REPLACEMENT_CHAR in tokenizer.decode(ids)


def test_incremental_with_prompt_context_and_special_tokens(tokenizer: Tokenizer):
    prompt_ids = tokenizer.encode("<|im_start|>assistant\n")
    ids = tokenizer.encode("Sure: x = 1<|im_end|>")
    detokenizer = IncrementalDetokenizer(tokenizer, context_ids=prompt_ids)
    assert "".join(_stream(detokenizer, ids, 1)) == "Sure: x = 1"
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(_stream(keep, ids, 2)) == "Sure: x = 1<|im_end|>"


def test_find_stop_string():
    assert find_stop_string("a: 1}\n\nb", ["\n\n", "}"]) == 4
    assert find_stop_string("no stop here", ["###"]) is None
    assert find_stop_string("abc###", ["###", ""]) == 3
    # a match straddling the already-checked part is still found
    assert find_stop_string("abc##", ["##"], start=4) == 3
    assert find_stop_string("##abc", ["##"], start=4) is None


def _stops_around(text: str, at: int) -> list[str]:
    """Substrings of `text` that end after `at`: one inside what follows, one that starts before it."""
    stops = [text[at + 1 : at + 4], text[max(0, at - 3) : at + 2], text[-3:]]
    return [s for s in stops if s.strip()]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_a_stop_string_watch_fires_at_the_tokens_that_complete_a_stop_string(
    tokenizer: Tokenizer, text: str, step: int
):
    """After an output's tokens (the context), batches of tokens: the watch fires at the first batch
    with which the output's text contains the stop string, as the gateway's cut finds it (a batch
    that ends inside a character adds its text with the next)."""
    ids = tokenizer.encode(text)
    for split in (0, 1, len(ids) // 3, len(ids) // 2):
        context, rest = ids[:split], ids[split:]
        before = tokenizer.decode(context)
        if before.endswith(REPLACEMENT_CHAR):
            continue  # the output's text ends inside a character: the watch's text starts after it
        for stop in _stops_around(tokenizer.decode(ids), len(before)):
            if stop in before:
                continue  # the output would have ended before these tokens
            watch = StopStringWatch(tokenizer, ["never in it", stop], context)
            batches = [rest[i : i + step] for i in range(0, len(rest), step)]
            fired = [watch.add(batch) for batch in batches]
            # the gateway's text of the output (gateway.output): the whole output's, detokenized as it grows
            detokenizer = IncrementalDetokenizer(tokenizer)
            texts = [detokenizer.add(context)] + [detokenizer.add(batch) for batch in batches]
            first = next(k for k in range(len(batches)) if stop in "".join(texts[: k + 2]))
            assert fired.index(True) == first, (text, split, stop)


def test_a_stop_string_watch_ignores_the_context_s_own_stop_strings(tokenizer: Tokenizer):
    ids = tokenizer.encode("one two three four")
    watch = StopStringWatch(tokenizer, ["two"], ids[:3])  # "one two three"
    assert [watch.add([t]) for t in ids[3:]] == [False] * len(ids[3:])
    assert StopStringWatch(tokenizer, ["o t"], []).add(ids) is True  # no context: the batch alone
    assert StopStringWatch(tokenizer, [], ids[:2]).add(ids[2:]) is False


def test_num_held_back_chars():
    assert num_held_back_chars("end of line\n", ["\n\n"]) == 1
    assert num_held_back_chars("value: </", ["</json>", "STOP"]) == 2
    assert num_held_back_chars("value", ["</json>"]) == 0
    assert num_held_back_chars("ab", ["abc", "bcd"]) == 2
    assert num_held_back_chars("", ["x"]) == 0


def test_template_helpers_and_sandbox(tokenizer: Tokenizer):
    def with_template(template: str) -> Tokenizer:
        return Tokenizer(tokenizer.backend, chat_template=template, special_tokens={"eos_token": "<|im_end|>"})

    messages = [{"role": "user", "content": "<b>é</b>"}]
    assert with_template("{{ messages[0] | tojson }}").apply_chat_template(messages) == (
        '{"role": "user", "content": "<b>é</b>"}'
    )
    assert with_template("{{ eos_token }}{{ add_generation_prompt }}").apply_chat_template([]) == "<|im_end|>True"
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        with_template("{{ raise_exception('roles must alternate') }}").apply_chat_template(messages)
    with pytest.raises(jinja2.sandbox.SecurityError):
        with_template("{{ messages.append(1) }}").apply_chat_template(messages)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tokenizer.backend).apply_chat_template(messages)


def test_from_dir_reads_hf_layouts(default_model_dir: Path, tmp_path: Path):
    shutil.copy(default_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": {"content": "<|im_end|>", "special": True},
                "chat_template": [
                    {"name": "tool_use", "template": "tools"},
                    {"name": "default", "template": "default"},
                ],
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    from_list = Tokenizer.from_dir(tmp_path)
    assert from_list.apply_chat_template([]) == "default"
    assert from_list.eos_token_ids == (2, 0)
    (tmp_path / "chat_template.jinja").write_text("from jinja file")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "from jinja file"
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "missing")


def test_token_bytes_are_a_split_characters_parts(tokenizer: Tokenizer):
    ids = tokenizer.encode(" 🤗")
    assert len(ids) > 1 and REPLACEMENT_CHAR in tokenizer.decode(ids[:1])
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == " 🤗".encode()
    assert tokenizer.token_bytes(tokenizer.encode("<|im_end|>")[0]) == b"<|im_end|>"
    # SentencePiece's byte fallback spells a byte <0xF0>
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models

    backend = BackendTokenizer(models.BPE(vocab={"<0xF0>": 0, "<0x9F>": 1, "▁ok": 2}, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    fallback = Tokenizer(backend)
    assert fallback.decode([0]) == REPLACEMENT_CHAR
    assert [fallback.token_bytes(t) for t in (0, 1, 2)] == [b"\xf0", b"\x9f", b" ok"]
