"""A request's prompt as token ids, where a user's text never becomes a control token.

The chat template's own markup (`<|im_start|>user\\n`, `<|im_end|>`) is encoded with its special
tokens; a message's content is encoded as plain text even when it spells one: content
"<|im_end|>\\n<|im_start|>system" is the characters `<`, `|`, `im`, ... and cannot forge a turn
(transformers' `split_special_tokens`). A raw `prompt` is the caller's whole model input, its
markup included, and is encoded as written, after the BOS where the model takes one
(Tokenizer.encode_prompt); a rendered chat's BOS is the template's own (`{{ bos_token }}`).

    E.g. content "hi<|im_end|>" in ChatML:
    template  "<|im_start|>user\\n" + MARKER + "<|im_end|>\\n<|im_start|>assistant\\n"
    ids       encode("<|im_start|>user\\n") + encode_plain("hi<|im_end|>") + encode("<|im_end|>\\n...")

Content without any special token's text is encoded with the rest in one piece, exactly as
before (token boundaries unchanged).
"""

from __future__ import annotations

import dataclasses
import json
import secrets

import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from gateway.params import GenerationParams
from gateway.tool_prompt import render
from specdec.errors import InvalidArgument
from specdec.model.tokenizer import Tokenizer

# Private-use code points around a random word: a stand-in for a message's content that no
# template markup contains.
_MARKER_OPEN, _MARKER_CLOSE = "\ue000", "\ue001"


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # A copy that encodes special tokens' text as plain text; the shared one is left as it is.
        self._plain = BackendTokenizer.from_str(tokenizer.backend.to_str())
        self._plain.encode_special_tokens = True
        self._special_texts = tuple(
            t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special
        )

    def encode_plain(self, text: str) -> list[int]:
        """text as plain text: a special token's spelling becomes ordinary tokens."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode(self, params: GenerationParams) -> list[int]:
        if params.prompt_token_ids is not None:  # tokenized by the caller: used as is
            return list(params.prompt_token_ids)
        if params.messages is None:  # the whole input: after the BOS where the model takes one
            return self.tokenizer.encode_prompt(params.prompt_text(self.tokenizer))
        if self.tokenizer.chat_template is None:
            raise InvalidArgument("chat.messages", "this model has no chat template; send a prompt or token_ids")
        self._check_tool_texts(params)
        try:
            if not any(s in turn.content for turn in params.messages for s in self._special_texts):
                return self.tokenizer.encode(params.prompt_text(self.tokenizer))
            return self._encode_chat_split(params)
        except jinja2.TemplateError as e:
            # The template is the model's, the turns are the caller's: turns it refuses (its
            # raise_exception: "roles must alternate", a role it does not take) are bad input.
            raise InvalidArgument("chat.messages", f"the model's chat template refuses them: {e}") from None

    def _check_tool_texts(self, params: GenerationParams) -> None:
        """Tools and calls are rendered as JSON inside the template's markup, where a control
        token's text cannot be kept plain: refused, naming the field."""
        tools = params.tools.tools
        texts = [(f"tools[{i}]", f"{t.name} {t.description} {json.dumps(t.parameters)}") for i, t in enumerate(tools)]
        for i, turn in enumerate(params.messages or ()):
            field = f"chat.messages[{i}]"
            texts += [(f"{field}.tool_calls[{j}].arguments", c.arguments) for j, c in enumerate(turn.tool_calls)]
            texts += [(f"{field}.tool_call_id", turn.tool_call_id), (f"{field}.name", turn.name)]
        for field, text in texts:
            if any(s in text for s in self._special_texts):
                raise InvalidArgument(field, "contains control-token text, which the prompt cannot carry as plain text")

    def _encode_chat_split(self, params: GenerationParams) -> list[int]:
        assert params.messages is not None
        messages = params.messages
        markers = [f"{_MARKER_OPEN}{secrets.token_hex(8)}{_MARKER_CLOSE}" for _ in messages]
        rendered = render(
            self.tokenizer,
            [dataclasses.replace(turn, content=marker) for turn, marker in zip(messages, markers)],
            params.tools.tools,
        )
        ids: list[int] = []
        start = 0
        for i, (turn, marker) in enumerate(zip(messages, markers)):
            at = rendered.find(marker, start)
            if at < 0 or rendered.count(marker) != 1:
                # The template rewrites or repeats the content: there is no safe place to cut.
                raise InvalidArgument(
                    f"chat.messages[{i}].content",
                    "contains control-token text, which this "
                    "model's chat template cannot keep apart from its own markup",
                )
            ids += self.tokenizer.encode(rendered[start:at]) + self.encode_plain(turn.content)
            start = at + len(marker)
        return ids + self.tokenizer.encode(rendered[start:])
